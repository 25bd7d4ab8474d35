"""Property-based fuzzing of every op of the op table (hypothesis).

Each row's ``fuzz`` maker draws a sample: shapes of rank 0-5 with sizes 0, 1, odd and a few
thousand, every tensor in a drawn layout (contiguous, transposed, sliced with a step, expanded,
offset into its storage, channels-last) holding normal values and, in most draws, NaN, +-inf,
huge, tiny and denormal ones. The op must then either reject the sample with the error the maker
predicts, or:
- leave its inputs as they were;
- give outputs of the reference's shape, with the Meta kernel's shape, dtype and strides;
- agree with the float64 reference rounded to the output dtype where that is finite, and have
  its NaN/inf pattern where it is not, or else agree with the same reference computed as ATen
  would (in the inputs' dtype, float32 for half types), whose intermediates overflow and cancel
  as the op's may;
- and, on normal values, give the reference's gradients.

CI runs a bounded number of examples with a fixed seed. More:
    CUSTOMOPS_FUZZ_EXAMPLES=2000 CUSTOMOPS_FUZZ_SEED=random python -m pytest tests/python/test_fuzz.py
(CUSTOMOPS_FUZZ_SEED=random draws new cases each run; hypothesis prints every draw of a failing
case, shrunk, and its seed to reproduce it with ``--hypothesis-seed``.)
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from torch.utils._pytree import tree_map

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from customops import testing as T  # noqa: E402
from conftest import DEVICES  # noqa: E402

EXAMPLES = int(os.environ.get("CUSTOMOPS_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("CUSTOMOPS_FUZZ_SEED", "") == "random"
NUMEL = 1 << 14  # elements per tensor at most: the float64 references stay quick

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

OPS = [pytest.param(o, id=o.name) for o in T.OPS if o.fuzz is not None]
DIFF_OPS = [p for p in OPS if p.values[0].differentiable]
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in T.FLOAT_DTYPES]

LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "offset", "channels_last")


class HypothesisSource:
    """customops.testing.FuzzSource drawing from hypothesis. Bulk values come from a drawn seed
    (drawing thousands of floats one by one would be slow); which specials appear, and how often,
    is drawn, so a failure shrinks to "no specials" or to the one kind that matters."""

    gradients = False

    def __init__(self, data):
        self.data = data

    def draw(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def choice(self, options):
        return self.draw(st.sampled_from(list(options)))

    def size(self, most=None):
        most = NUMEL if most is None else most
        n = self.draw(st.one_of(st.sampled_from([1, 0, 2]), st.integers(1, 31).map(lambda k: 2 * k + 1),
                                st.integers(1000, 4099)))
        return min(n, most)

    def shape(self, min_rank=0, max_rank=5, most=None):
        left = NUMEL if most is None else most
        dims = []
        for _ in range(self.draw(st.integers(min_rank, max_rank))):
            dims.append(self.size(max(left, 1)))
            left //= max(dims[-1], 1)
        return tuple(self.draw(st.permutations(dims))) if dims else ()

    def _layout(self, shape, writable):
        """(shape of the storage tensor, view of it with the drawn layout and `shape`)."""
        layout = self.draw(st.sampled_from([x for x in LAYOUTS if writable is False or x != "expanded"]),
                           label="layout")
        rank = len(shape)
        if layout == "transposed" and rank >= 2:
            perm = self.draw(st.permutations(range(rank)))
            inverse = [perm.index(i) for i in range(rank)]
            return [shape[p] for p in perm], lambda t: t.permute(inverse)
        if layout == "sliced" and rank >= 1:
            d, step = self.draw(st.integers(0, rank - 1)), self.draw(st.sampled_from([2, 3]))
            base = list(shape)
            base[d] = shape[d] * step + 1
            return base, lambda t: t[(slice(None),) * d + (slice(1, None, step),)]
        if layout == "expanded" and any(n != 1 for n in shape):
            dims = self.draw(st.sets(st.sampled_from([i for i, n in enumerate(shape) if n != 1]), min_size=1))
            return [1 if i in dims else n for i, n in enumerate(shape)], lambda t: t.expand(shape)
        if layout == "offset":
            off = self.draw(st.integers(1, 7))
            return [math.prod(shape) + off], lambda t: t[off:].view(shape)
        if layout == "channels_last" and rank in (4, 5):
            fmt = torch.channels_last if rank == 4 else torch.channels_last_3d
            return list(shape), lambda t: t.contiguous(memory_format=fmt)
        return list(shape), lambda t: t

    def _values(self, n, dtype, values, gen):
        scales = [1.0, 1e-3] if values == "normal" else [1.0, 1e-3, 30.0]
        x = torch.randn(n, generator=gen, dtype=torch.float64) * self.draw(st.sampled_from(scales))
        if values == "normal" or n == 0:
            return x
        rate = self.draw(st.sampled_from([0.0, 0.01, 0.3]), label="specials rate")
        if not rate:
            return x
        fi = torch.finfo(dtype)
        specials = [fi.max * 0.3, -fi.max * 0.7, math.sqrt(fi.max) * 2, fi.tiny, -fi.tiny * 3, fi.tiny * fi.eps,
                    -fi.tiny * fi.eps * 5, 0.0, -0.0]
        if values == "nonfinite":
            specials = [fi.tiny, -fi.tiny * 3, fi.tiny * fi.eps, -fi.tiny * fi.eps * 5, 0.0, -0.0]
        if values in ("any", "nonfinite"):
            specials += [math.nan, math.inf, -math.inf]
        specials = self.draw(st.lists(st.sampled_from(specials), min_size=1, max_size=4, unique=True),
                             label="specials")
        where = torch.rand(n, generator=gen, dtype=torch.float64) < rate
        pick = torch.randint(0, len(specials), (n,), generator=gen)
        return torch.where(where, torch.tensor(specials, dtype=torch.float64)[pick], x)

    def tensor(self, shape, dtype, device, values="any", writable=False):
        base_shape, view = self._layout(tuple(shape), writable)
        gen = torch.Generator().manual_seed(self.draw(st.integers(0, 2**31 - 1), label="seed"))
        base = self._values(math.prod(base_shape), dtype, values, gen).to(dtype).reshape(base_shape)
        return view(base.to(device))

    def index(self, shape, high, device, ignore_index=None):
        base_shape, view = self._layout(tuple(shape), False)
        gen = torch.Generator().manual_seed(self.draw(st.integers(0, 2**31 - 1), label="seed"))
        t = torch.randint(0, high, base_shape, generator=gen)
        if ignore_index is not None:
            t = t.masked_fill(torch.rand(base_shape, generator=gen) < 0.25, ignore_index)
        return view(t.to(device))


def _as_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _close(got, want, atol, rtol):
    """Per element: within tolerance of `want` rounded to got's dtype, NaN where it is NaN, the
    same infinity where it is infinite."""
    want = want.to(got.dtype).to(torch.float64) if got.is_floating_point() else want
    return torch.isclose(got.to(torch.float64), want.to(torch.float64), atol=atol, rtol=rtol, equal_nan=True)


def _agrees(got, want, aten, atol, rtol):
    """Close to the float64 reference or to the reference computed by ATen in the inputs' dtype;
    where that overflowed too (an intermediate out of the dtype's range, as x * cos - y * sin can
    be), any non-finite value: the op does not hide the overflow behind a finite number. And a
    finite value near the top of the range where both overflowed to the same infinity: a fused
    multiply-add (x * cos - y * sin in one rounding) stays in range where separate products do
    not. Where the float64 reference is NaN, never a finite value (a 0 from an "empty" path, say),
    even where ATen's own rounding happens to give one; an infinity may stand for a NaN that the
    reference got from its own overflow (inf - inf) where a fused op stays in range. And, where an
    element is ill-conditioned (scores far apart enough that the dtype's rounding of them moves
    the softmax), no further from the float64 reference than twice ATen's own error in that dtype."""
    overflow = aten.isfinite().logical_not() & got.isfinite().logical_not()
    if got.is_floating_point():
        top = torch.finfo(got.dtype).max / 16
        fused = (got.isfinite() & want.isinf() & (aten.to(want.dtype) == want) & (got.double().abs() >= top)
                 & (got.sign() == want.sign()))
        overflow |= fused
    ok = _close(got, want, atol, rtol) | _close(got, aten, atol, rtol) | overflow
    if got.is_floating_point():
        ok |= (got.double() - want.double()).abs() <= 2 * (aten.double() - want.double()).abs()
    if got.is_floating_point():
        ok &= ~got.isfinite() | ~want.isnan()
    return ok


def _largest_finite(ts) -> float:
    mags = [t.detach().double().abs().nan_to_num(0.0, 0.0, 0.0).max().item() for t in ts
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return max(mags, default=0.0)


def _score_rounding(info: T.OpInfo, args, dtype) -> float:
    """For attention: how far its output may move when its scores are rounded in dtype. An online
    softmax (every attention kernel) forms exp(s - max) from a score s rounded at its own
    magnitude, an absolute error of eps x |s| in the exponent: a relative error of each weight, so
    eps x |largest score| x |largest value| in the output (the largest score bounded by the rows'
    norms, Cauchy-Schwarz). ATen's own error, the other yardstick, is one rounding among many and
    may be luckily small (seen on an H100: D = 8, |q|, |k| up to 30, ATen 4e-6 off, the kernel
    4e-5 off, the bound 4e-3). float32 only: the half types' tolerances already hold it, and a
    bound that loose there would hide a wrong kernel. 0 for other ops and dtypes."""
    if info.name not in ("attention", "cache_attention") or dtype != torch.float32:
        return 0.0
    q, k, v, scale = args[0], args[1], args[2], args[4]
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)
    if not math.isfinite(scale):
        return 0.0
    norm = lambda t: t.detach().double().nan_to_num(0.0, 0.0, 0.0).norm(dim=-1).max().item()  # noqa: E731
    return 4 * torch.finfo(dtype).eps * norm(q) * norm(k) * scale * _largest_finite([v])


def check_sample(info: T.OpInfo, s: T.Sample, dtype) -> None:
    note(f"{info.name} {dtype} [{s.desc}]")
    if s.error is not None:
        with pytest.raises(RuntimeError, match=s.error):
            info.run(*s.args, **s.kwargs)
        return
    before = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, s.args)
    got = T._outputs(info.run(*s.args, **s.kwargs))
    for i, (a, b) in enumerate(zip(s.args, before)):
        if isinstance(a, torch.Tensor) and i not in info.writes:
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True,
                                       msg=lambda m: f"{info.qualname} [{s.desc}] wrote its input {i}: {m}")
    meta = T._outputs(info.run(*tree_map(_as_meta, s.args), **tree_map(_as_meta, s.kwargs)))
    want = T._outputs(info.ref(*tree_map(T._to64, s.args), **tree_map(T._to64, s.kwargs)))
    aten = T._outputs(info.ref(*s.args, **s.kwargs))
    atol, rtol = info.tolerances[dtype]
    if info.cancels:
        atol = atol + 8 * torch.finfo(torch.float32).eps * _largest_finite(s.args + tuple(want))
    score_atol = _score_rounding(info, s.args, dtype)
    assert len(got) == len(want), f"{info.qualname}: {len(got)} outputs, the reference {len(want)}"
    for i, (g, m, w, a) in enumerate(zip(got, meta, want, aten)):
        where = f"{info.qualname} {dtype} [{s.desc}] output {i}"
        assert g.shape == w.shape, f"{where}: shape {list(g.shape)}, the reference's {list(w.shape)}"
        assert (m.shape, m.dtype) == (g.shape, g.dtype), f"{where}: Meta gives {list(m.shape)} {m.dtype}"
        if g.numel() > 1:
            # strides of size-1 dims address nothing (PyTorch's own stride checks skip them too)
            sig = lambda t: [st for st, n in zip(t.stride(), t.shape) if n > 1]  # noqa: E731
            assert sig(m) == sig(g), f"{where}: Meta strides {m.stride()}, the kernel's {g.stride()}"
        ok = _agrees(g, w, a, atol + (score_atol if i == 0 else 0.0), rtol)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[:5].tolist()
            idx = [tuple(b) for b in bad]
            raise AssertionError(f"{where}: {int((~ok).sum())} of {g.numel()} elements differ; at {idx}: got "
                                 f"{[g[j].item() for j in idx]}, float64 reference {[w[j].item() for j in idx]}, "
                                 f"ATen's {[a[j].item() for j in idx]}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("info", OPS)
@FUZZ
@given(data=st.data())
def test_fuzz_forward(info, dtype, device, data):
    check_sample(info, info.fuzz(HypothesisSource(data), torch.device(device), dtype), dtype)


class _NormalValues(HypothesisSource):
    """Normal values only (gradients of NaN and inf compare nothing useful), at differentiable
    points."""

    gradients = True

    def tensor(self, shape, dtype, device, values="any", writable=False):
        return super().tensor(shape, dtype, device, "normal", writable)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")])
@pytest.mark.parametrize("info", DIFF_OPS)
@FUZZ
@given(data=st.data())
def test_fuzz_gradients(info, dtype, device, data):
    s = info.fuzz(_NormalValues(data), torch.device(device), dtype)
    if s.error is not None:
        return
    args = tuple(a.detach().requires_grad_() if info.differentiable_arg(i, a) else a for i, a in enumerate(s.args))
    xs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    note(f"{info.name} {dtype} [{s.desc}]")
    ys = [T._outputs(info.run(*args))[i] for i in info.diff_outputs]
    # cotangents drawn in float64 and rounded to each output's dtype; the reference gets the same
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="cotangent seed"))
    cots = [torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype).to(y.device) for y in ys]
    got = torch.autograd.grad(ys, xs, cots, allow_unused=True)
    def ref_grads(cast):
        a = tuple(cast(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in args)
        ys = [T._outputs(info.ref(*a))[i] for i in info.diff_outputs]
        return torch.autograd.grad(ys, [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad],
                                   [c.to(y.dtype) for c, y in zip(cots, ys)], allow_unused=True)

    want, aten = ref_grads(T._to64), ref_grads(lambda x: x.detach())
    atol, rtol = info.tolerances[dtype]
    for i, (g, w, a) in enumerate(zip(got, want, aten)):
        if w is None:
            continue
        assert g is not None, f"{info.qualname} [{s.desc}]: no gradient for input {i}"
        # as close as the tolerance, or no further off than 4x ATen's own rounding of the same
        # formula (the backward of a near-degenerate row cancels in every float implementation)
        err, ulps = (g.double() - w).abs(), 10 * (atol + rtol * w.abs()) + 4 * (a.double() - w).abs()
        if not bool((err <= ulps).all()):
            j = tuple((err - ulps).argmax().item() // max(math.prod(g.shape[k + 1:]), 1) % g.shape[k]
                      for k in range(g.dim()))
            raise AssertionError(f"{info.qualname} {dtype} grad {i} [{s.desc}]: {int((err > ulps).sum())} of "
                                 f"{g.numel()} differ; at {j}: got {g[j].item()}, float64 reference {w[j].item()}, "
                                 f"ATen's {a[j].item()}")
