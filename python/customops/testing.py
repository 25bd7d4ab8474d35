"""The op table and the checks it drives.

Each :class:`OpInfo` row says how to make sample inputs for a device and dtype (contiguous,
non-contiguous, empty, with and without ``requires_grad``), a float64 reference, tolerances and
bad inputs. The ``check_*`` functions below take one row; the pytest suite and the support
matrix of ``python -m customops`` both loop over :data:`OPS`, so a new op gets every check by
adding one row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Protocol, Sequence

import torch
from torch.utils._pytree import tree_map

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# (atol, rtol) of a result rounded once to the dtype, compared with a float64 reference.
ROUNDED_ONCE = {
    torch.float32: (1e-5, 1.3e-6 * 4),
    torch.float64: (1e-10, 1e-10),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 8e-3),
}

# A sum (over a row, or over keys) in float32 before the final rounding: a little looser.
SUMMED_THEN_ROUNDED = {**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
                       torch.bfloat16: (2e-2, 1.6e-2)}


@dataclasses.dataclass
class Sample:
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    desc: str = ""
    error: str | None = None  # a drawn sample the op must reject: the regex of its error


@dataclasses.dataclass
class OpInfo:
    name: str  # "muladd" or "muladd.out": the row's label and the overload it tests
    samples: Callable[[torch.device, torch.dtype, bool], list[Sample]]  # (device, dtype, requires_grad)
    ref: Callable  # float64 reference with the op's signature; returns what the op returns
    batch: Callable[[torch.device, torch.dtype, int], Sample]  # a sample whose leading size is n
    bad_inputs: Callable[[torch.device], list[tuple[Sample, str]]]  # (sample, regex of the error)
    tolerances: dict = dataclasses.field(default_factory=lambda: dict(ROUNDED_ONCE))
    differentiable: bool = True  # out= variants are not
    double_backward: bool = True  # else: double backward must raise a clear error
    diff_outputs: tuple = (0,)  # outputs that carry gradients (rms_norm's rstd does not)
    # Under torch.autocast: "promote" (mixed inputs go to the widest dtype), "norm" (x keeps its
    # dtype, a float32 weight is taken as it is), "add_norm" (x and residual promoted, then
    # "norm"), "first" (every tensor cast to the first one's dtype), "lower" (float32 tensors run
    # in the autocast dtype, as a linear layer), "float32" (any dtype read as it is, computed and
    # returned in float32) or "none" (runs in its input's dtype).
    autocast: str = "none"
    # Positions of the differentiable tensor arguments; None: every floating-point tensor.
    grad_args: tuple | None = None
    # Outputs are sums of terms that can cancel (x + residual, lse - logit, a rotation): where
    # inputs are huge, the fuzz suite allows an error of a few float32 ulps of the largest one.
    cancels: bool = False
    # Draws one random sample from a FuzzSource (the property-based suite, test_fuzz.py).
    fuzz: Callable[["FuzzSource", torch.device, torch.dtype], Sample] | None = None

    def differentiable_arg(self, i: int, x) -> bool:
        if not (self.differentiable and isinstance(x, torch.Tensor) and x.is_floating_point()):
            return False
        return self.grad_args is None or i in self.grad_args

    @property
    def op(self) -> torch._ops.OpOverload:
        name, _, overload = self.name.partition(".")
        return getattr(getattr(torch.ops.customops, name), overload or "default")

    @property
    def qualname(self) -> str:
        return f"customops::{self.name}"


def _rand(shape, device, dtype, requires_grad=False, *, layout="contiguous", low=None, high=None):
    """Random tensor of `shape`; layout "transposed" or "strided" gives a non-contiguous leaf."""
    if layout == "transposed":
        t = torch.randn(shape[::-1], device=device, dtype=dtype).permute(*reversed(range(len(shape))))
    elif layout == "strided":
        t = torch.randn(*shape[:-1], shape[-1] * 2, device=device, dtype=dtype)[..., ::2]
    else:
        t = torch.randn(shape, device=device, dtype=dtype)
    if low is not None or high is not None:
        t = t.clamp(low, high)
    return t.detach().requires_grad_(requires_grad)


def _to64(x):
    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _clone(x):
    return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def clone_sample(s: Sample) -> Sample:
    return Sample(tree_map(_clone, s.args), tree_map(_clone, s.kwargs), s.desc)


# ---- sample makers -----------------------------------------------------------------------------

def _elementwise_samples(n_tensors: int, scalars: tuple = (), with_out: bool = False):
    """Samples for ops taking n_tensors same-shaped tensors, then `scalars`."""

    def make(device, dtype, requires_grad):
        shapes_layouts = [
            ((5, 7), "contiguous"),
            ((1031,), "contiguous"),  # not a multiple of any vector width
            ((3, 4, 9), "contiguous"),
            ((6, 5), "transposed"),
            ((4, 6), "strided"),
            ((0, 3), "contiguous"),
        ]
        out = []
        for shape, layout in shapes_layouts:
            ts = tuple(_rand(shape, device, dtype, requires_grad and not with_out, layout=layout)
                       for _ in range(n_tensors))
            kwargs = {"out": torch.empty(shape, device=device, dtype=dtype)} if with_out else {}
            out.append(Sample(ts + scalars, kwargs, f"{layout} {list(shape)}"))
        return out

    return make


def _elementwise_batch(n_tensors: int, scalars: tuple = (), with_out: bool = False):
    def make(device, dtype, n):
        ts = tuple(torch.randn(n, 8, device=device, dtype=dtype) for _ in range(n_tensors))
        kwargs = {"out": torch.empty(n, 8, device=device, dtype=dtype)} if with_out else {}
        return Sample(ts + scalars, kwargs, f"batch {n}")

    return make


def _binary_bad_inputs(name: str, scalars: tuple = (), with_out: bool = False):
    op = f"customops::{name}"

    def make(device):
        a = torch.randn(4, 4, device=device)
        kw = (lambda: {"out": torch.empty(4, 4, device=device)}) if with_out else (lambda: {})
        cases = [
            (Sample((a, torch.randn(4, 5, device=device)) + scalars, kw()), rf"{op}: expected b to have the shape"),
            (Sample((a, a.double()) + scalars, kw()), rf"{op}: expected b to have the dtype"),
            (Sample((a.long(), a.long()) + scalars, kw()), rf"{op}: a has dtype Long"),
            (Sample((a, a.int()) + scalars, kw()), rf"{op}: b has dtype Int"),
            (Sample((a, a.to("meta")) + scalars, kw()), rf"{op}: expected b to be on the device of a"),
        ]
        if with_out:
            buf = torch.randn(20, device=device)
            x, o = buf[:16].view(4, 4), buf[2:18].view(4, 4)
            cases += [
                (Sample((a, a) + scalars, {"out": torch.empty(4, 5, device=device)}),
                 rf"{op}: expected out to have the shape"),
                (Sample((a, a) + scalars, {"out": torch.empty(4, 4, device=device, dtype=torch.float64)}),
                 rf"{op}: expected out to have the dtype"),
                (Sample((x, x.clone()) + scalars, {"out": o}), rf"{op}: out overlaps a partially"),
                (Sample((a, a) + scalars, {"out": torch.empty(4, 1, device=device).expand(4, 4)}),
                 rf"{op}: out has elements that share memory"),
                (Sample((a.clone().requires_grad_(), a) + scalars, kw()),
                 rf"{op}: out= arguments don't support automatic differentiation"),
            ]
        return cases

    return make


def _rms_norm_ref(x, weight=None, eps=1e-6):
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    y = x * rstd.unsqueeze(-1)
    return (y * weight if weight is not None else y), rstd


def _rms_norm_samples(device, dtype, requires_grad):
    def w(n, wdtype=dtype):
        return (torch.rand(n, device=device, dtype=wdtype) + 0.5).requires_grad_(requires_grad)

    out = []
    for shape, layout, with_w in [((5, 7), "contiguous", True), ((3, 4, 40), "contiguous", True),
                                  ((2, 1031), "contiguous", False), ((9,), "contiguous", True),
                                  ((6, 5), "transposed", True), ((4, 6), "strided", True),
                                  ((0, 3), "contiguous", True), ((1, 64), "contiguous", True)]:
        x = _rand(shape, device, dtype, requires_grad, layout=layout)
        out.append(Sample((x, w(shape[-1]) if with_w else None, 1e-5), {}, f"{layout} {list(shape)}"
                          + ("" if with_w else " no weight")))
    if dtype in (torch.float16, torch.bfloat16):  # mixed precision: a float32 weight, read as it is
        out.append(Sample((_rand((6, 40), device, dtype, requires_grad), w(40, torch.float32), 1e-5), {},
                          "contiguous [6, 40] float32 weight"))
    return out


def _rms_norm_batch(device, dtype, n):
    return Sample((torch.randn(n, 16, device=device, dtype=dtype), torch.rand(16, device=device, dtype=dtype) + 0.5,
                   1e-6), {}, f"batch {n}")


def _rms_norm_bad_inputs(device):
    op = "customops::rms_norm"
    x = torch.randn(4, 8, device=device)
    return [
        (Sample((x, torch.ones(7, device=device), 1e-6)), rf"{op}: expected weight of shape \[8\]"),
        (Sample((x, torch.ones(8, device=device, dtype=torch.float64), 1e-6)), rf"{op}: expected weight to have the dtype"),
        (Sample((x.half(), torch.ones(8, device=device, dtype=torch.bfloat16), 1e-6)),
         rf"{op}: expected weight to have the dtype of x \(Half\), or float32"),
        (Sample((x.long(), None, 1e-6)), rf"{op}: x has dtype Long"),
        (Sample((x, torch.ones(8, device="meta"), 1e-6)), rf"{op}: expected weight to be on the device of x"),
        (Sample((torch.tensor(1.0, device=device), None, 1e-6)), rf"{op}: x must have at least one dimension"),
    ]


def _add_rms_norm_ref(x, residual, weight=None, eps=1e-6):
    s = x + residual
    y, rstd = _rms_norm_ref(s, weight, eps)
    return y, s, rstd


def _add_rms_norm_samples(device, dtype, requires_grad):
    """rms_norm's samples with a residual of x's shape and layout (its rounding: the sum is
    rounded to the dtype before it is normalized, as the reference's inputs are)."""
    out = []
    for s in _rms_norm_samples(device, dtype, requires_grad):
        x = s.args[0]
        layout = s.desc.split()[0]
        res = _rand(tuple(x.shape), device, dtype, requires_grad, layout=layout if layout in ("transposed", "strided")
                    else "contiguous")
        out.append(Sample((x, res) + s.args[1:], {}, s.desc))
    return out


def _add_rms_norm_batch(device, dtype, n):
    s = _rms_norm_batch(device, dtype, n)
    return Sample((s.args[0], torch.randn(n, 16, device=device, dtype=dtype)) + s.args[1:], {}, s.desc)


def _add_rms_norm_bad_inputs(device):
    op = "customops::add_rms_norm"
    x = torch.randn(4, 8, device=device)
    return [
        (Sample((x, torch.randn(4, 7, device=device), None, 1e-6)), rf"{op}: expected residual to have the shape"),
        (Sample((x, x.double(), None, 1e-6)), rf"{op}: expected residual to have the dtype"),
        (Sample((x, x.to("meta"), None, 1e-6)), rf"{op}: expected residual to be on the device of x"),
        (Sample((x, x, torch.ones(7, device=device), 1e-6)), rf"{op}: expected weight of shape \[8\]"),
        (Sample((x.long(), x.long(), None, 1e-6)), rf"{op}: x has dtype Long"),
        (Sample((torch.tensor(1.0, device=device), torch.tensor(1.0, device=device), None, 1e-6)),
         rf"{op}: x must have at least one dimension"),
    ]


def _rope_ref(q, k, cos, sin, interleaved=False):
    r = cos.shape[-1]
    c, s_ = (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)  # broadcast over heads

    def rotate(x):
        xr, rest = x[..., :r], x[..., r:]
        if interleaved:
            turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        else:
            turned = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1)
        return torch.cat((xr * c + turned * s_, rest), -1)

    return rotate(q), rotate(k)


def _rope_samples(device, dtype, requires_grad):
    """q and k in every layout (views of one fused qkv projection among them), cos and sin of
    each accepted shape, both pairings, partial rotary, empty."""

    def angles(*shape):
        theta = torch.randn(shape, device=device, dtype=torch.float64)
        return theta.cos().to(dtype), theta.sin().to(dtype)

    def qk(b, hq, hkv, s, d, layout):
        if layout == "strided":  # q and k as views of qkv [B, S, Hq + 2 * Hkv, D]
            qkv = torch.randn(b, s, hq + 2 * hkv, d, device=device, dtype=dtype).transpose(1, 2)
            q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        else:
            q, k = _rand((b, hq, s, d), device, dtype, layout=layout), _rand((b, hkv, s, d), device, dtype, layout=layout)
        return q.detach().requires_grad_(requires_grad), k.detach().requires_grad_(requires_grad)

    out = []
    for (b, hq, hkv, s, d), layout, cs_shape, interleaved in [
        ((2, 4, 2, 5, 8), "contiguous", (5, 8), False),
        ((2, 4, 2, 5, 8), "contiguous", (2, 5, 8), True),
        ((2, 3, 1, 5, 10), "contiguous", (1, 5, 6), False),  # partial rotary: 6 of 10 dims
        ((1, 2, 2, 3, 64), "contiguous", (3, 64), False),  # vector-width rows
        ((2, 4, 2, 3, 8), "transposed", (3, 8), False),
        ((2, 4, 2, 5, 8), "strided", (2, 5, 8), False),
        ((2, 4, 2, 5, 12), "strided", (5, 8), True),
        ((2, 4, 2, 0, 8), "contiguous", (0, 8), False),
    ]:
        q, k = qk(b, hq, hkv, s, d, layout)
        out.append(Sample((q, k, *angles(*cs_shape), interleaved), {},
                          f"{layout} q {list(q.shape)} k {list(k.shape)} cos {list(cs_shape)}"
                          + (" interleaved" if interleaved else "")))
    return out


def _rope_batch(device, dtype, n):
    # Heads and positions unlike any batch size the checks use (a size equal to the batch would be
    # specialized with it by torch.compile's duck sizing).
    theta = torch.randn(6, 8, device=device, dtype=torch.float64)
    return Sample((torch.randn(n, 4, 6, 8, device=device, dtype=dtype), torch.randn(n, 1, 6, 8, device=device, dtype=dtype),
                   theta.cos().to(dtype), theta.sin().to(dtype), False), {}, f"batch {n}")


def _rope_bad_inputs(device):
    op = "customops::rope"
    q, k, c = (torch.randn(2, 4, 5, 8, device=device), torch.randn(2, 2, 5, 8, device=device),
               torch.randn(5, 8, device=device))
    return [
        (Sample((q, k.double(), c, c, False)), rf"{op}: expected k to have the dtype of q"),
        (Sample((q[0], k, c, c, False)), rf"{op}: expected q of shape \[B, Hq, S, D\]"),
        (Sample((q, k[:, :, :4], c, c, False)), rf"{op}: expected k of shape \[B, Hkv, S, D\] with B, S and D of q"),
        (Sample((q, k, c[:4], c[:4], False)), rf"{op}: expected cos of shape \[S, R\] or \[B, S, R\] with S = 5"),
        (Sample((q, k, torch.randn(5, 10, device=device), torch.randn(5, 10, device=device), False)),
         rf"{op}: cos's last dim \(10, the rotated dims\) must be at most D = 8"),
        (Sample((q, k, c[:, :5], c[:, :5], False)), rf"{op}: cos's last dim \(5, the rotated dims\) must be even"),
        (Sample((q, k, c, c[:, :6], False)), rf"{op}: expected sin to have the shape of cos"),
        (Sample((q, k, torch.randn(3, 5, 8, device=device), torch.randn(3, 5, 8, device=device), False)),
         rf"{op}: expected cos of shape \[B, S, R\] with B = 1 or 2 \(q.shape\[0\]\), but got \[3, 5, 8\]"),
        (Sample((q.long(), k.long(), c, c, False)), rf"{op}: q has dtype Long"),
        (Sample((q, k, c.clone().requires_grad_(), c, False)), rf"{op}: cos and sin must not require grad"),
    ]


def _cross_entropy_ref(logits, target, ignore_index=-100, label_smoothing=0.0):
    lse = torch.logsumexp(logits, -1)
    ignored = target == ignore_index
    picked = logits.gather(-1, target.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing:  # (0 * mean would turn a -inf logit into NaN)
        loss = loss - label_smoothing * logits.mean(-1)
    return loss.masked_fill(ignored, 0), lse


def _targets(shape, v, device, ignore_index=-100, every=3):
    t = torch.randint(0, v, shape, device=device)
    t.view(-1)[::every] = ignore_index  # some rows ignored
    return t


def _cross_entropy_samples(device, dtype, requires_grad):
    out = []
    for shape, layout, ignore_index, smoothing in [
        ((6, 11), "contiguous", -100, 0.0),
        ((3, 4, 40), "contiguous", -100, 0.1),
        ((2, 1031), "contiguous", 5, 0.0),
        ((3, 1), "contiguous", -100, 0.0),  # one class
        ((5, 7), "transposed", -100, 0.2),
        ((4, 6), "strided", -100, 0.0),
        ((0, 5), "contiguous", -100, 0.0),
    ]:
        logits = _rand(shape, device, dtype, requires_grad, layout=layout)
        target = _targets(shape[:-1], shape[-1], device, ignore_index)
        out.append(Sample((logits, target, ignore_index, smoothing), {}, f"{layout} {list(shape)}"
                          + (f" smoothing {smoothing}" if smoothing else "")))
    # A masked-out class (-inf logit) off the target: a finite loss, a zero gradient there.
    logits = torch.randn(4, 9, device=device, dtype=dtype)
    logits[:, 3] = float("-inf")
    out.append(Sample((logits.requires_grad_(requires_grad), torch.tensor([0, 8, 1, 5], device=device), -100, 0.0), {},
                      "contiguous [4, 9] with -inf logits"))
    return out


def _cross_entropy_batch(device, dtype, n):
    return Sample((torch.randn(n, 16, device=device, dtype=dtype), torch.randint(0, 16, (n,), device=device), -100, 0.0),
                  {}, f"batch {n}")


def _cross_entropy_bad_inputs(device):
    op = "customops::cross_entropy"
    x, t = torch.randn(4, 8, device=device), torch.randint(0, 8, (4,), device=device)
    cases = [
        (Sample((x, t.int(), -100, 0.0)), rf"{op}: expected target of dtype Long \(int64\)"),
        (Sample((x, t.float(), -100, 0.0)), rf"{op}: expected target of dtype Long"),
        (Sample((x, t[:3], -100, 0.0)), rf"{op}: expected target of shape logits.shape\[:-1\]"),
        (Sample((x.long(), t, -100, 0.0)), rf"{op}: logits has dtype Long"),
        (Sample((torch.tensor(1.0, device=device), t, -100, 0.0)), rf"{op}: logits must have at least one dimension"),
        (Sample((x[:, :0], t, -100, 0.0)), rf"{op}: logits must have at least one class"),
        (Sample((x, t, -100, 1.5)), rf"{op}: label_smoothing must be in \[0, 1\]"),
        (Sample((x, t.to("meta"), -100, 0.0)), rf"{op}: expected target to be on the device of logits"),
    ]
    if torch.device(device).type == "cpu":  # CUDA gives NaN for the row instead (no device sync)
        cases += [(Sample((x, torch.tensor([0, 8, 1, 2], device=device), -100, 0.0)),
                   rf"{op}: target holds 8 at index 1, outside \[0, 8\) and not ignore_index \(-100\)"),
                  (Sample((x, torch.tensor([0, -1, 1, 2], device=device), -100, 0.0)), rf"{op}: target holds -1")]
    return cases


def _linear_cross_entropy_ref(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                              reduction="mean", tile_rows=None, tile_classes=None):
    import torch.nn.functional as F

    logits = hidden @ weight.T + (bias if bias is not None else 0)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)


def _linear_cross_entropy_samples(device, dtype, requires_grad):
    out = []
    for (n, h, v), layout, with_bias, ignore_index, smoothing, reduction, tiles in [
        ((6, 8, 11), "contiguous", False, -100, 0.0, "mean", ()),
        ((9, 16, 37), "contiguous", True, -100, 0.1, "sum", (4, 16)),  # tiles of 4 rows x 16 classes
        ((130, 8, 600), "contiguous", False, 3, 0.1, "mean", ()),
        ((5, 6, 7), "transposed", True, -100, 0.0, "mean", ()),
        ((4, 6, 9), "strided", False, -100, 0.2, "sum", (None, 4)),
        ((0, 6, 9), "contiguous", True, -100, 0.0, "sum", ()),
    ]:
        hidden = _rand((n, h), device, dtype, requires_grad, layout=layout)
        weight = (_rand((v, h), device, dtype) * h ** -0.5).requires_grad_(requires_grad)
        bias = _rand((v,), device, dtype, requires_grad) if with_bias else None
        out.append(Sample((hidden, weight, _targets((n,), v, device, ignore_index), bias, ignore_index, smoothing,
                           reduction, *tiles), {}, f"{layout} N={n} H={h} V={v}" + (" bias" if with_bias else "")
                          + f" {reduction}" + (f" tiles {tiles}" if tiles else "")))
    return out


def _linear_cross_entropy_batch(device, dtype, n):
    return Sample((torch.randn(n, 8, device=device, dtype=dtype), torch.randn(10, 8, device=device, dtype=dtype) / 3,
                   torch.randint(0, 10, (n,), device=device), None, -100, 0.0, "mean"), {}, f"batch {n}")


def _linear_cross_entropy_bad_inputs(device):
    op = "customops::linear_cross_entropy"
    h, w, t = torch.randn(4, 8, device=device), torch.randn(10, 8, device=device), torch.randint(0, 10, (4,), device=device)
    return [
        (Sample((h, torch.randn(10, 7, device=device), t)), rf"{op}: expected weight of shape \[V, H\] with H = 8"),
        (Sample((h, w.double(), t)), rf"{op}: expected weight to have the dtype of hidden"),
        (Sample((h, w, t.int())), rf"{op}: expected target of dtype Long"),
        (Sample((h, w, t[:3])), rf"{op}: expected target of shape \[N\] with N = 4"),
        (Sample((h.long(), w.long(), t)), rf"{op}: hidden has dtype Long"),
        (Sample((h[0], w, t)), rf"{op}: expected hidden of shape \[N, H\]"),
        (Sample((h, w, t, torch.randn(9, device=device))), rf"{op}: expected bias of shape \[V\] with V = 10"),
        (Sample((h, w, t, None, -100, 0.0, "none")), rf"{op}: reduction must be \"mean\" or \"sum\""),
        (Sample((h, w, t, None, -100, 0.0, "mean", 0)), rf"{op}: tile_rows must be positive, but got 0"),
        (Sample((h, w, t, None, -100, -0.5)), rf"{op}: label_smoothing must be in \[0, 1\]"),
    ]


def _attention_ref(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v over every key (k and v repeated per group), and lse; a row that
    sees no key gives out 0 and lse -inf, a row with a NaN or +inf score NaN in both."""
    g = q.shape[1] // max(k.shape[1], 1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = scale if scale is not None else (q.shape[-1] ** -0.5 if q.shape[-1] else 1.0)
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        hidden = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf")).unsqueeze(-1))
    return p @ v, lse


def _attention_samples(device, dtype, requires_grad):
    def qkv(b, hq, hkv, sq, sk, d, layout="contiguous"):
        def make(h, s):
            if layout == "transposed":  # [B, S, H, D] memory read as [B, H, S, D]
                return _rand((b, s, h, d), device, dtype).transpose(1, 2).detach().requires_grad_(requires_grad)
            return _rand((b, h, s, d), device, dtype, requires_grad, layout=layout)
        return make(hq, sq), make(hkv, sk), make(hkv, sk)

    out = []
    for (b, hq, hkv, sq, sk, d), layout, causal, scale in [
        ((1, 2, 1, 3, 5, 4), "contiguous", False, None),  # small ones first: gradcheck takes three
        ((2, 2, 2, 4, 4, 3), "contiguous", True, 0.5),
        ((1, 4, 2, 3, 6, 2), "transposed", True, None),
        ((2, 4, 2, 9, 13, 8), "contiguous", False, None),
        # head dims of the fused CUDA kernel (float16 and bfloat16): several blocks, partial ones
        ((1, 4, 2, 70, 130, 64), "transposed", True, None),
        ((2, 2, 1, 67, 40, 128), "contiguous", False, 0.3),
        ((1, 3, 1, 1, 7, 16), "contiguous", True, None),  # decoding one query over a cache
        ((2, 2, 1, 6, 5, 8), "strided", False, 0.3),
        ((1, 2, 2, 130, 520, 4), "contiguous", True, None),  # several blocks of rows and keys
        ((2, 2, 1, 0, 5, 8), "contiguous", True, None),
    ]:
        q, k, v = qkv(b, hq, hkv, sq, sk, d, layout)
        out.append(Sample((q, k, v, causal, scale), {}, f"{layout} q {[b, hq, sq, d]} k {[b, hkv, sk, d]}"
                          + (" causal" if causal else "") + (f" scale {scale}" if scale else "")))
    return out


def _attention_batch(device, dtype, n):
    return Sample((torch.randn(n, 2, 5, 8, device=device, dtype=dtype), torch.randn(n, 1, 7, 8, device=device, dtype=dtype),
                   torch.randn(n, 1, 7, 8, device=device, dtype=dtype), True, None), {}, f"batch {n}")


def _attention_bad_inputs(device):
    op = "customops::attention"
    q, k = torch.randn(1, 4, 5, 8, device=device), torch.randn(1, 2, 6, 8, device=device)
    return [
        (Sample((q, k.double(), k)), rf"{op}: expected k to have the dtype of q"),
        (Sample((q.long(), k.long(), k.long())), rf"{op}: q has dtype Long"),
        (Sample((q[0], k, k)), rf"{op}: expected q of shape \[B, Hq, Sq, D\]"),
        (Sample((q[:, :3], k, k)), rf"{op}: q's heads \(3\) must be a multiple of k's \(2\)"),
        (Sample((q, k[..., :4], k[..., :4])), rf"{op}: expected k of shape \[B, Hkv, Sk, D\] with B and D of q"),
        (Sample((q, k, k[:, :, :5])), rf"{op}: expected v to have the shape of k"),
        (Sample((q, k[:, :0], k[:, :0])), rf"{op}: k must have at least one head"),
        (Sample((q, k.to("meta"), k)), rf"{op}: expected k to be on the device of q"),
    ]


def _merge_attention_ref(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1)
    return out_a * (lse_a.unsqueeze(-1) - safe).exp() + out_b * (lse_b.unsqueeze(-1) - safe).exp(), lse


def _merge_attention_samples(device, dtype, requires_grad):
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = []
    for shape, layout in [((2, 3, 5, 8), "contiguous"), ((7, 16), "contiguous"), ((4, 6), "transposed"),
                          ((3, 2, 10), "strided"), ((0, 4), "contiguous")]:
        oa, ob = (_rand(shape, device, dtype, requires_grad, layout=layout) for _ in range(2))
        la, lb = (_rand(shape[:-1], device, lse_dtype, requires_grad) * 3 for _ in range(2))
        out.append(Sample((oa, la.detach().requires_grad_(requires_grad), ob, lb.detach().requires_grad_(requires_grad)),
                          {}, f"{layout} {list(shape)}"))
    return out


def _merge_attention_batch(device, dtype, n):
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return Sample((torch.randn(n, 2, 4, 8, device=device, dtype=dtype), torch.randn(n, 2, 4, device=device, dtype=lse_dtype),
                   torch.randn(n, 2, 4, 8, device=device, dtype=dtype), torch.randn(n, 2, 4, device=device, dtype=lse_dtype)),
                  {}, f"batch {n}")


def _merge_attention_bad_inputs(device):
    op = "customops::merge_attention"
    o, l = torch.randn(2, 4, 8, device=device), torch.randn(2, 4, device=device)
    return [
        (Sample((o, l, o[:, :3], l)), rf"{op}: expected out_b to have the shape of out_a"),
        (Sample((o, l[:, :3], o, l[:, :3])), rf"{op}: expected lse_a of shape out_a.shape\[:-1\]"),
        (Sample((o, l, o, l.double())), rf"{op}: expected lse_b to have the dtype of lse_a"),
        (Sample((o.long(), l, o.long(), l)), rf"{op}: out_a has dtype Long"),
    ]


def _halves_samples(device, dtype, requires_grad):
    """silu_mul samples, plus gate and up as the two halves of one gate-up tensor."""
    out = _elementwise_samples(2)(device, dtype, requires_grad)
    for shape in [(6, 2 * 24), (2, 3, 2 * 17)]:
        base = torch.randn(shape, device=device, dtype=dtype)
        gate, up = (h.detach().requires_grad_(requires_grad) for h in base.chunk(2, -1))
        out.append(Sample((gate, up), {}, f"strided halves of {list(shape)}"))
    return out


def _unary_bad_inputs(name, scalars=()):
    op = f"customops::{name}"

    def make(device):
        x = torch.randn(4, 4, device=device)
        return [(Sample((x.long(),) + scalars), rf"{op}: x has dtype Long"),
                (Sample((x.int(),) + scalars), rf"{op}: x has dtype Int"),
                (Sample((x.bool(),) + scalars), rf"{op}: x has dtype Bool"),
                (Sample((x.to(torch.complex64),) + scalars), rf"{op}: x has dtype ComplexFloat")]

    return make


def _silu_mul_bad_inputs(device):
    op = "customops::silu_mul"
    g = torch.randn(4, 4, device=device)
    return [
        (Sample((g, torch.randn(4, 5, device=device))), rf"{op}: expected up to have the shape"),
        (Sample((g, g.double())), rf"{op}: expected up to have the dtype"),
        (Sample((g.long(), g.long())), rf"{op}: gate has dtype Long"),
        (Sample((g, g.to("meta"))), rf"{op}: expected up to be on the device of gate"),
    ]


def _swiglu_ref(x):
    gate, up = x.chunk(2, -1)
    return gate * torch.sigmoid(gate) * up


def _swiglu_samples(device, dtype, requires_grad):
    """x of shape [..., 2n] in every layout (n odd too), and an x that is itself a strided view."""
    out = []
    for shape, layout in [((5, 14), "contiguous"), ((2 * 1031,), "contiguous"), ((3, 4, 34), "contiguous"),
                          ((6, 10), "transposed"), ((4, 12), "strided"), ((0, 6), "contiguous"),
                          ((3, 0), "contiguous")]:
        out.append(Sample((_rand(shape, device, dtype, requires_grad, layout=layout),), {}, f"{layout} {list(shape)}"))
    wide = torch.randn(4, 3 * 8, device=device, dtype=dtype)[:, 8:]  # rows of 16 with row stride 24
    out.append(Sample((wide.detach().requires_grad_(requires_grad),), {}, "strided rows [4, 16] of [4, 24]"))
    return out


def _swiglu_batch(device, dtype, n):
    return Sample((torch.randn(n, 16, device=device, dtype=dtype),), {}, f"batch {n}")


def _swiglu_bad_inputs(device):
    op = "customops::swiglu"
    x = torch.randn(4, 6, device=device)
    return _unary_bad_inputs("swiglu")(device) + [
        (Sample((torch.randn(4, 7, device=device),)), rf"{op}: x's last dimension holds gate and up side by side, "
         r"so its size must be even, but x has shape \[4, 7\]"),
        (Sample((torch.tensor(1.0, device=device),)), rf"{op}: x must have at least one dimension"),
        (Sample((x[:, :5],)), rf"{op}: x's last dimension .* must be even"),
    ]


def _scale_clamp_bad_inputs(device):
    op = "customops::scale_clamp"
    return _unary_bad_inputs("scale_clamp", (2.0, -1.0, 1.0))(device) + [
        (Sample((torch.randn(3, device=device), 2.0, 1.0, -1.0)), rf"{op}: expected lo <= hi"),
    ]


# ---- fuzz makers: one sample drawn from a FuzzSource ---------------------------------------------

class FuzzSource(Protocol):
    """What a row's ``fuzz`` maker draws from; tests/python/test_fuzz.py implements it with
    hypothesis, so a failing case shrinks to a small one. Sizes are 0, 1, small odd numbers or a
    few thousand; every tensor comes in a drawn layout (contiguous, transposed, sliced with a step,
    expanded with stride 0, offset into its storage, channels-last) and, unless ``values`` says
    otherwise, holds NaN, +-inf, huge, tiny and denormal values among normal ones. ``gradients``
    is true when the sample is for a gradient check: makers then keep off the points where the op
    is not differentiable (eps = 0 on a row of one element, clamp bounds that tie)."""

    gradients: bool

    def choice(self, options: Sequence): ...

    def size(self, most: int | None = None) -> int: ...

    def shape(self, min_rank: int = 0, max_rank: int = 5, most: int | None = None) -> tuple[int, ...]: ...

    # values: "any" (NaN and inf too), "finite" (huge, tiny, denormal), "nonfinite" (NaN, inf, tiny
    # and denormal but nothing huge: for ops ill-conditioned in huge inputs, as softmax's near-ties
    # are) or "normal" (randn only);
    # writable=False allows expanded layouts, whose elements share memory.
    def tensor(self, shape, dtype, device, values: str = "any", writable: bool = False) -> torch.Tensor: ...

    # int64 class indices in [0, high), some of them ignore_index
    def index(self, shape, high: int, device, ignore_index: int | None = None) -> torch.Tensor: ...


def _half(dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _fuzz_elementwise(n_tensors: int, scalars: Callable = lambda src: ((), None), with_out: bool = False):
    """Same-shaped tensors, each in its own layout, then the scalars `scalars(src)` draws (with
    the error they must raise, if any)."""

    def make(src, device, dtype):
        shape = src.shape()
        ts = tuple(src.tensor(shape, dtype, device) for _ in range(n_tensors))
        sc, error = scalars(src)
        kwargs = {"out": src.tensor(shape, dtype, device, writable=True)} if with_out else {}
        return Sample(ts + sc, kwargs, f"{list(shape)}", error)

    return make


def _fuzz_muladd_c(src):
    return (src.choice([0.75, 0.0, -1.5, 1e4, float("inf"), float("nan")]),), None


def _fuzz_scale_clamp(src):
    if src.gradients:  # x * scale never on a bound
        scale, lo, hi = src.choice([2.0, -0.5]), src.choice([-1.0, -float("inf")]), src.choice([1.5, float("inf")])
    else:
        scale, lo, hi = (src.choice([2.0, -0.5, 0.0, 1e30]), src.choice([-1.0, 0.0, -float("inf")]),
                         src.choice([1.5, 0.0, -2.0, float("inf")]))
    return (scale, lo, hi), (r"customops::scale_clamp: expected lo <= hi" if lo > hi else None)


def _fuzz_rms_norm(residual: bool):
    op = "customops::add_rms_norm" if residual else "customops::rms_norm"

    def make(src, device, dtype):
        shape = src.shape()
        x = src.tensor(shape, dtype, device)
        res = (src.tensor(shape, dtype, device),) if residual else ()
        wdtype = src.choice([dtype, torch.float32]) if _half(dtype) else dtype
        weight = src.tensor(shape[-1:], wdtype, device) if shape and src.choice([True, False]) else None
        eps = src.choice([1e-6, 1e-5, 1.0] if src.gradients else [1e-6, 1e-5, 0.0, 1.0])
        error = rf"{op}: x must have at least one dimension" if not shape else None
        return Sample((x, *res, weight, eps), {}, f"{list(shape)} weight {None if weight is None else wdtype}",
                      error)

    return make


def _fuzz_swiglu(src, device, dtype):
    shape = src.shape()
    error = None
    if not shape:
        error = r"customops::swiglu: x must have at least one dimension"
    elif shape[-1] % 2:
        error = r"customops::swiglu: x's last dimension holds gate and up side by side, so its size must be even"
    return Sample((src.tensor(shape, dtype, device),), {}, f"{list(shape)}", error)


def _fuzz_rope(src, device, dtype):
    most = 1 << 12
    b, hq, hkv, s = src.size(8), src.size(8), src.size(8), src.size(most // 8)
    d = 2 * src.size(32) + src.choice([0, 1])
    r = 2 * src.choice(range(d // 2 + 1))
    q, k = src.tensor((b, hq, s, d), dtype, device), src.tensor((b, hkv, s, d), dtype, device)
    cs_shape = src.choice([(s, r), (1, s, r), (b, s, r)])
    cos, sin = (src.tensor(cs_shape, dtype, device, values="finite") for _ in range(2))
    interleaved = src.choice([False, True])
    return Sample((q, k, cos, sin, interleaved), {},
                  f"q {list(q.shape)} k {list(k.shape)} cos {list(cs_shape)}" + (" interleaved" if interleaved else ""))


def _fuzz_cross_entropy(src, device, dtype):
    shape = src.shape(min_rank=1, max_rank=4)
    v = shape[-1]
    ignore_index = src.choice([-100, 0, max(v - 1, 0)])
    smoothing = src.choice([0.0, 0.1, 1.0])
    error = r"customops::cross_entropy: logits must have at least one class" if v == 0 else None
    return Sample((src.tensor(shape, dtype, device), src.index(shape[:-1], max(v, 1), device, ignore_index),
                   ignore_index, smoothing), {}, f"{list(shape)} ignore {ignore_index} smoothing {smoothing}", error)


def _fuzz_linear_cross_entropy(src, device, dtype):
    most = 1 << 13
    n, h = src.size(512), src.size(64)
    v = src.size(max(most // max(n, h, 1), 1))
    ignore_index = src.choice([-100, 0])
    bias = src.tensor((v,), dtype, device) if src.choice([False, True]) else None
    smoothing, reduction = src.choice([0.0, 0.1]), src.choice(["mean", "sum"])
    error = r"customops::linear_cross_entropy: weight must have at least one row \(class\)" if v == 0 else None
    return Sample((src.tensor((n, h), dtype, device), src.tensor((v, h), dtype, device),
                   src.index((n,), max(v, 1), device, ignore_index), bias, ignore_index, smoothing, reduction), {},
                  f"N={n} H={h} V={v}{' bias' if bias is not None else ''} {reduction} smoothing {smoothing}",
                  error)


def _fuzz_attention(src, device, dtype):
    b, hkv, g = src.size(3), src.size(4), max(src.size(4), 1)
    sq, sk, d = src.size(300), src.size(300), src.size(64)
    causal = src.choice([False, True]) and not (src.gradients and sq > sk)  # no key-less rows to differentiate
    scale = src.choice([None, 0.5])
    # q and k: no huge values, whose scores' float32 rounding decides between near-tied keys (so
    # no reference can agree; tests/python/test_attention.py checks huge scores on separated rows).
    # v: normal values. A key of probability 0 (masked, or beside a row's limit in a kernel's key
    # block) adds 0 * v, NaN for an infinite v in the reference and in some kernel blocks but not
    # in others; and the online softmax sums p * v before dividing by the sum of p, which
    # overflows for v near the dtype's largest value where the normalized reference does not.
    q, k = (src.tensor((b, h, s, d), dtype, device, values="nonfinite") for h, s in ((hkv * g, sq), (hkv, sk)))
    v = src.tensor((b, hkv, sk, d), dtype, device, values="normal")
    if not src.gradients and src.choice([False, True]):  # every score NaN or infinite
        scale = src.choice([float("nan"), float("inf"), -float("inf")])
    error = r"customops::attention: k must have at least one head" if hkv == 0 else None
    return Sample((q, k, v, causal, scale), {}, f"q {list(q.shape)} k {list(k.shape)}"
                  + (" causal" if causal else "") + (f" scale {scale}" if scale else ""), error)


def _fuzz_merge_attention(src, device, dtype):
    shape = src.shape(min_rank=1, max_rank=4)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    oa, ob = (src.tensor(shape, dtype, device) for _ in range(2))
    la, lb = (src.tensor(shape[:-1], lse_dtype, device, values="normal") * 3 for _ in range(2))
    if src.choice([False, True]):  # one side attended to no key
        lb = torch.full_like(lb, float("-inf"))
    return Sample((oa, la, ob, lb), {}, f"{list(shape)}")


# ---- the table ---------------------------------------------------------------------------------

OPS: list[OpInfo] = [
    OpInfo(
        name="muladd",
        samples=_elementwise_samples(2, (0.75,)),
        ref=lambda a, b, c: a * b + c,
        batch=_elementwise_batch(2, (0.75,)),
        bad_inputs=_binary_bad_inputs("muladd", (0.75,)),
        autocast="promote",
        cancels=True,
        fuzz=_fuzz_elementwise(2, _fuzz_muladd_c),
    ),
    OpInfo(
        name="mul",
        samples=_elementwise_samples(2),
        ref=lambda a, b: a * b,
        batch=_elementwise_batch(2),
        bad_inputs=_binary_bad_inputs("mul"),
        autocast="promote",
        fuzz=_fuzz_elementwise(2),
    ),
    OpInfo(
        name="muladd.out",
        samples=_elementwise_samples(2, (-1.5,), with_out=True),
        ref=lambda a, b, c, out: a * b + c,
        batch=_elementwise_batch(2, (-1.5,), with_out=True),
        bad_inputs=_binary_bad_inputs("muladd.out", (-1.5,), with_out=True),
        differentiable=False,
        cancels=True,
        fuzz=_fuzz_elementwise(2, _fuzz_muladd_c, with_out=True),
    ),
    OpInfo(
        name="rms_norm",
        samples=_rms_norm_samples,
        ref=_rms_norm_ref,
        batch=_rms_norm_batch,
        bad_inputs=_rms_norm_bad_inputs,
        # a reduction over the row before the final rounding: a little looser than one rounding
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        double_backward=False,
        autocast="norm",
        fuzz=_fuzz_rms_norm(residual=False),
    ),
    OpInfo(
        name="add_rms_norm",
        samples=_add_rms_norm_samples,
        ref=_add_rms_norm_ref,
        batch=_add_rms_norm_batch,
        bad_inputs=_add_rms_norm_bad_inputs,
        # the reference normalizes the exact sum, the op the sum rounded to the dtype
        tolerances=SUMMED_THEN_ROUNDED,
        double_backward=False,
        diff_outputs=(0, 1),
        autocast="add_norm",
        cancels=True,
        fuzz=_fuzz_rms_norm(residual=True),
    ),
    OpInfo(
        name="rope",
        samples=_rope_samples,
        ref=_rope_ref,
        batch=_rope_batch,
        bad_inputs=_rope_bad_inputs,
        diff_outputs=(0, 1),
        grad_args=(0, 1),
        autocast="first",
        cancels=True,
        fuzz=_fuzz_rope,
    ),
    OpInfo(
        name="cross_entropy",
        samples=_cross_entropy_samples,
        ref=_cross_entropy_ref,
        batch=_cross_entropy_batch,
        bad_inputs=_cross_entropy_bad_inputs,
        # the outputs are float32 whatever the logits' dtype; the gradient is rounded once to it
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        double_backward=False,
        diff_outputs=(0, 1),
        autocast="float32",
        cancels=True,
        fuzz=_fuzz_cross_entropy,
    ),
    OpInfo(
        name="linear_cross_entropy",
        samples=_linear_cross_entropy_samples,
        ref=_linear_cross_entropy_ref,
        batch=_linear_cross_entropy_batch,
        bad_inputs=_linear_cross_entropy_bad_inputs,
        # the logits are rounded to the inputs' dtype before the loss, as in eager
        tolerances={**ROUNDED_ONCE, torch.float32: (5e-5, 5e-5), torch.float16: (1e-2, 1e-2),
                    torch.bfloat16: (5e-2, 3e-2)},
        double_backward=False,
        autocast="lower",
        cancels=True,
        fuzz=_fuzz_linear_cross_entropy,
    ),
    OpInfo(
        name="attention",
        samples=_attention_samples,
        ref=_attention_ref,
        batch=_attention_batch,
        bad_inputs=_attention_bad_inputs,
        # sums over keys before the final rounding
        tolerances=SUMMED_THEN_ROUNDED,
        double_backward=False,
        diff_outputs=(0, 1),
        grad_args=(0, 1, 2),
        autocast="lower",
        fuzz=_fuzz_attention,
    ),
    OpInfo(
        name="merge_attention",
        samples=_merge_attention_samples,
        ref=_merge_attention_ref,
        batch=_merge_attention_batch,
        bad_inputs=_merge_attention_bad_inputs,
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        diff_outputs=(0, 1),
        cancels=True,
        fuzz=_fuzz_merge_attention,
    ),
    OpInfo(
        name="silu",
        samples=_elementwise_samples(1),
        ref=lambda x: x * torch.sigmoid(x),
        batch=_elementwise_batch(1),
        bad_inputs=_unary_bad_inputs("silu"),
        double_backward=False,
        fuzz=_fuzz_elementwise(1),
    ),
    OpInfo(
        name="silu_mul",
        samples=_halves_samples,
        ref=lambda gate, up: gate * torch.sigmoid(gate) * up,
        batch=_elementwise_batch(2),
        bad_inputs=_silu_mul_bad_inputs,
        double_backward=False,
        autocast="promote",
        fuzz=_fuzz_elementwise(2),
    ),
    OpInfo(
        name="swiglu",
        samples=_swiglu_samples,
        ref=_swiglu_ref,
        batch=_swiglu_batch,
        bad_inputs=_swiglu_bad_inputs,
        double_backward=False,
        fuzz=_fuzz_swiglu,
    ),
    OpInfo(
        name="scale_clamp",
        samples=_elementwise_samples(1, (2.0, -1.0, 1.5)),
        ref=lambda x, scale, lo, hi: torch.clamp(x * scale, lo, hi),
        batch=_elementwise_batch(1, (2.0, -1.0, 1.5)),
        bad_inputs=_scale_clamp_bad_inputs,
        fuzz=_fuzz_elementwise(1, _fuzz_scale_clamp),
    ),
]

OPS_BY_NAME = {o.name: o for o in OPS}


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and _built_with_cuda() else [])


def _built_with_cuda() -> bool:
    import customops

    return bool(customops.build_info()["cuda"])


# ---- checks: each raises AssertionError (or the op's error) on failure -------------------------

def _outputs(y) -> tuple:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _call(info: OpInfo, s: Sample):
    return info.op(*s.args, **s.kwargs)


def check_correctness(info: OpInfo, device, dtype) -> int:
    """The op against its float64 reference on every sample; returns the number of samples."""
    atol, rtol = info.tolerances[dtype]
    samples = info.samples(torch.device(device), dtype, False)
    for s in samples:
        got = _outputs(_call(info, clone_sample(s)))
        want = _outputs(info.ref(*tree_map(_to64, s.args), **tree_map(_to64, s.kwargs)))
        assert len(got) == len(want), f"{info.qualname}: {len(got)} outputs, reference has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.device.type == torch.device(device).type, f"{info.qualname}: output on {g.device}"
            assert g.shape == w.shape, f"{info.qualname} [{s.desc}] output {i}: shape {g.shape} != {w.shape}"
            torch.testing.assert_close(g.to(torch.float64), w, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{info.qualname} {dtype} [{s.desc}] output {i}: {m}")
    return len(samples)


def check_meta(info: OpInfo, device="cpu") -> None:
    """Meta kernel: the same shapes, dtypes and strides as the real kernel, on every sample."""
    for s in info.samples(torch.device(device), torch.float32, False):
        real = _outputs(_call(info, clone_sample(s)))
        meta = _outputs(_call(info, Sample(*tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x,
                                                     (s.args, s.kwargs)))))
        for r, m in zip(real, meta):
            assert m.device.type == "meta"
            assert (m.shape, m.dtype) == (r.shape, r.dtype), f"{info.qualname} [{s.desc}]: meta {m.shape} {m.dtype}"
            if r.numel() > 1:
                assert m.stride() == r.stride(), f"{info.qualname} [{s.desc}]: meta strides {m.stride()} != {r.stride()}"


def _grad_inputs(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _loss(outputs, which=None) -> torch.Tensor:
    # A fixed weighting per differentiable output, so every output's gradient is exercised.
    total = 0
    for i, y in enumerate(outputs):
        if which is not None and i not in which:
            continue
        if y.is_floating_point():
            w = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).reshape(y.shape)
            total = total + (y * w).sum() * (i + 1)
    return total


def check_autograd(info: OpInfo, device, dtype=torch.float32) -> None:
    """Gradients of the op equal the reference's (autograd of the float64 reference)."""
    if not info.differentiable:
        return
    atol, rtol = info.tolerances[dtype]
    for s in info.samples(torch.device(device), dtype, True):
        xs = _grad_inputs(s.args)
        got = torch.autograd.grad(_loss(_outputs(_call(info, s)), info.diff_outputs), xs, allow_unused=True) if xs and any(
            x.numel() for x in xs) else None
        s64 = Sample(tree_map(lambda x: _to64(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x,
                              s.args), {}, s.desc)
        xs64 = _grad_inputs(s64.args)
        if got is None:
            continue
        want = torch.autograd.grad(_loss(_outputs(info.ref(*s64.args)), info.diff_outputs), xs64, allow_unused=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.to(torch.float64), w, atol=atol * 10, rtol=rtol * 10,
                                       msg=lambda m: f"{info.qualname} grad [{s.desc}]: {m}")


def opcheck_samples(info: OpInfo, device) -> list[Sample]:
    """Contiguous, non-contiguous and empty samples, with and without requires_grad."""
    samples = info.samples(torch.device(device), torch.float32, False)
    if info.differentiable:
        samples = samples + info.samples(torch.device(device), torch.float32, True)
    return samples


def check_opcheck(info: OpInfo, device) -> int:
    """torch.library.opcheck with all four default tests on every opcheck sample."""
    samples = opcheck_samples(info, device)
    for s in samples:
        torch.library.opcheck(info.op, s.args, s.kwargs)
    return len(samples)


def check_gradcheck(info: OpInfo, device) -> None:
    """gradcheck and gradgradcheck in float64 (or a clear error where double backward is unsupported)."""
    if not info.differentiable:
        return
    for s in info.samples(torch.device(device), torch.float64, True)[:3]:
        xs = _grad_inputs(s.args)
        pos = [i for i, a in enumerate(s.args) if isinstance(a, torch.Tensor) and a.requires_grad]

        def fn(*ts, s=s, pos=pos):
            args = list(s.args)
            for i, t in zip(pos, ts):
                args[i] = t
            outs = _outputs(info.op(*args, **s.kwargs))
            return tuple(outs[i] for i in info.diff_outputs)

        assert torch.autograd.gradcheck(fn, xs, check_forward_ad=True), f"{info.qualname}: gradcheck failed [{s.desc}]"
        if info.double_backward:
            assert torch.autograd.gradgradcheck(fn, xs, check_fwd_over_rev=True), (
                f"{info.qualname}: gradgradcheck failed [{s.desc}]")
        else:
            y = _loss(_outputs(fn(*xs)))
            grads = torch.autograd.grad(y, xs, create_graph=True)
            try:
                torch.autograd.grad(sum(g.sum() for g in grads if g is not None), xs, allow_unused=True)
            except RuntimeError as e:
                assert f"double backward is not supported for {info.qualname}" in str(e), str(e)
            else:
                raise AssertionError(f"{info.qualname}: double backward neither worked nor raised")


def _dynamic_dims(info: OpInfo, device, dtype) -> tuple[Sample, Sample, object]:
    """Two batch samples and the export dynamic_shapes spec derived from where they differ."""
    a, b = info.batch(device, dtype, 3), info.batch(device, dtype, 5)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)

    def spec(x, y):
        if not isinstance(x, torch.Tensor):
            return None
        dims = {d: batch for d in range(x.dim()) if x.shape[d] != y.shape[d]}
        return dims or None

    args_spec = tuple(spec(x, y) for x, y in zip(a.args, b.args))
    kw_spec = {k: spec(a.kwargs[k], b.kwargs[k]) for k in a.kwargs}
    return a, b, (args_spec, kw_spec)


def check_compile(info: OpInfo, device, backend="inductor", sizes=(3, 5, 17)) -> int:
    """torch.compile(fullgraph=True, dynamic=True): equal to eager forward and backward on three
    sizes, with no recompilation after the first. Returns the number of graphs compiled."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    op = info.op

    def fn(*args, **kwargs):
        return op(*args, **kwargs)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    first = None
    for n in sizes:
        s = info.batch(torch.device(device), torch.float32, n)
        if info.differentiable:
            s = Sample(tuple(x.requires_grad_() if info.differentiable_arg(i, x) else x for i, x in enumerate(s.args)),
                       s.kwargs)
        e = clone_sample(s)
        got, want = _outputs(compiled(*s.args, **s.kwargs)), _outputs(fn(*e.args, **e.kwargs))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} compiled forward, batch {n}: {m}")
        if info.differentiable:
            gg = torch.autograd.grad(_loss(got, info.diff_outputs), _grad_inputs(s.args))
            gw = torch.autograd.grad(_loss(want, info.diff_outputs), _grad_inputs(e.args))
            for g, w in zip(gg, gw):
                torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} compiled backward, batch {n}: {m}")
        # Dynamo may trace the first call twice (it retries with float arguments specialized);
        # what matters is that no later size compiles again.
        first = counter.frame_count if first is None else first
    assert counter.frame_count == first, f"{info.qualname}: recompiled for sizes {sizes} ({counter.frame_count} graphs)"
    return counter.frame_count


class _OpModule(torch.nn.Module):
    """Calls op with keyword arguments passed positionally after the others (export-friendly)."""

    def __init__(self, op, n_args: int, kwnames: Sequence[str]):
        super().__init__()
        self.op, self.n_args, self.kwnames = op, n_args, tuple(kwnames)

    def forward(self, *flat):
        return self.op(*flat[: self.n_args], **dict(zip(self.kwnames, flat[self.n_args:])))


def export(info: OpInfo, device, dtype=torch.float32) -> tuple[torch.export.ExportedProgram, Callable]:
    """torch.export of the op alone with a dynamic batch dimension; also returns how to turn a
    Sample into the exported program's positional inputs."""
    a, _, (args_spec, kw_spec) = _dynamic_dims(info, torch.device(device), dtype)
    names = list(a.kwargs)
    flat = lambda s: tuple(s.args) + tuple(s.kwargs[k] for k in names)  # noqa: E731
    mod = _OpModule(info.op, len(a.args), names)
    spec = {"flat": tuple(args_spec) + tuple(kw_spec[k] for k in names)}
    return torch.export.export(mod, flat(a), dynamic_shapes=spec), flat


def check_export(info: OpInfo, device, sizes=(2, 7, 33)) -> None:
    """The exported program runs at several batch sizes and equals eager."""
    ep, flat = export(info, device)
    mod = ep.module()
    for n in sizes:
        s = info.batch(torch.device(device), torch.float32, n)
        e = clone_sample(s)
        for g, w in zip(_outputs(mod(*flat(s))), _outputs(info.op(*e.args, **e.kwargs))):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} exported, batch {n}: {m}")


def check_bad_inputs(info: OpInfo, device) -> int:
    """Every bad input raises RuntimeError naming the op and the argument."""
    import re

    cases = info.bad_inputs(torch.device(device))
    for s, pattern in cases:
        try:
            _call(info, s)
        except RuntimeError as e:
            assert re.search(pattern, str(e)), f"{info.qualname}: error {str(e)!r} does not match {pattern!r}"
        else:
            raise AssertionError(f"{info.qualname}: no error for bad input, expected {pattern!r}")
    return len(cases)


# ---- subsystems: torch.func, vmap, autocast, compiled autograd ----------------------------------

def _func_samples(info: OpInfo, device) -> list[Sample]:
    """A few small float64 samples with gradients (Jacobians are numel x numel)."""
    out = []
    for s in info.samples(torch.device(device), torch.float64, True):
        xs = _grad_inputs(s.args)
        if xs and all(0 < x.numel() <= 256 for x in xs):
            out.append(s)
    return out[:3]


def _as_function(info: OpInfo, s: Sample, fn=None):
    """(f, xs): f(*xs) -> the differentiable outputs of fn (the op, or its reference) on s with
    its requires-grad tensors replaced by xs."""
    fn = info.op if fn is None else fn
    pos = [i for i, a in enumerate(s.args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def f(*xs):
        args = list(s.args)
        for i, x in zip(pos, xs):
            args[i] = x
        outs = _outputs(fn(*args, **s.kwargs))
        return tuple(outs[i] for i in info.diff_outputs)

    return f, tuple(s.args[i].detach() for i in pos)


def check_func(info: OpInfo, device) -> int:
    """torch.func transforms against the same transforms of the float64 reference: grad, vjp,
    jvp, jacrev, jacfwd, and hessian where double backward exists (a clear error where not)."""
    from torch import func

    if not info.differentiable:
        return 0
    samples = _func_samples(info, device)
    for s in samples:
        f, xs = _as_function(info, s)
        r, _ = _as_function(info, s, info.ref)
        msg = lambda what: (lambda m: f"{info.qualname} torch.func.{what} [{s.desc}]: {m}")  # noqa: E731
        close = lambda got, want, what: torch.testing.assert_close(got, want, msg=msg(what))  # noqa: E731
        cot = tuple(torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape) for y in r(*xs))
        tan = tuple(torch.randn_like(x) for x in xs)
        loss = lambda g: (lambda *a: sum((y * c).sum() for y, c in zip(g(*a), cot)))  # noqa: E731
        close(func.grad(loss(f), argnums=tuple(range(len(xs))))(*xs),
              func.grad(loss(r), argnums=tuple(range(len(xs))))(*xs), "grad")
        (y, pull), (yr, pull_r) = func.vjp(f, *xs), func.vjp(r, *xs)
        close(y, yr, "vjp output")
        close(pull(cot), pull_r(cot), "vjp")
        close(func.jvp(f, xs, tan), func.jvp(r, xs, tan), "jvp")
        argnums = tuple(range(len(xs)))
        jr = func.jacrev(r, argnums=argnums)(*xs)
        close(func.jacrev(f, argnums=argnums)(*xs), jr, "jacrev")
        close(func.jacfwd(f, argnums=argnums)(*xs), jr, "jacfwd")
        if info.double_backward:
            close(func.hessian(loss(f))(*xs), func.hessian(loss(r))(*xs), "hessian")
        else:
            try:
                func.hessian(loss(f))(*xs)
            except RuntimeError as e:
                assert f"double backward is not supported for {info.qualname}" in str(e), str(e)
            else:
                raise AssertionError(f"{info.qualname}: torch.func.hessian neither worked nor raised")
    return len(samples)


class no_vmap_fallback:
    """Within it, an op without a batching rule raises instead of taking functorch's per-entry
    fallback: proof that vmap calls the op once on the whole batch."""

    def __enter__(self):
        self._was = torch._C._functorch._is_vmap_fallback_enabled()
        torch._C._functorch._set_vmap_fallback_enabled(False)

    def __exit__(self, *exc):
        torch._C._functorch._set_vmap_fallback_enabled(self._was)


def _positional(info: OpInfo, s: Sample):
    """(fn, args): the op with keyword tensors (out=) passed positionally, for vmap's in_dims."""
    names = list(s.kwargs)
    n = len(s.args)

    def fn(*a):
        return info.op(*a[:n], **dict(zip(names, a[n:])))

    return fn, tuple(s.args) + tuple(s.kwargs[k] for k in names)


def check_vmap(info: OpInfo, device, dtype=torch.float64, entries=4) -> int:
    """vmap with the batching rules (the fallback disabled): batch dim first and last, shared
    (unbatched) arguments, per-entry weights, nested vmap, and vmap(grad) per-entry gradients,
    each against a loop of calls. Returns the number of variants checked."""
    from torch import func

    dev = torch.device(device)
    per_entry = [_positional(info, info.batch(dev, dtype, 3)) for _ in range(entries)]
    fn, first = per_entry[0]
    other = _positional(info, info.batch(dev, dtype, 5))[1]
    rows = [isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(first, other)]
    tensors = [isinstance(a, torch.Tensor) for a in first]
    loop = lambda argsets: tuple(torch.stack(ys) for ys in zip(*(_outputs(fn(*clone_sample(Sample(a)).args)) for a in argsets)))  # noqa: E731

    def stacked(batched, dim=0):
        return tuple(torch.stack([args[i] for _, args in per_entry], dim) if batched[i] else first[i]
                     for i in range(len(first)))

    def compare(got, want, what):
        for g, w in zip(_outputs(got), want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} vmap ({what}): {m}")

    variants = 0
    with no_vmap_fallback():
        # Rows batched, other tensors shared: batch dim first, then last.
        shared = [tuple(a if rows[i] else first[i] for i, a in enumerate(args)) for _, args in per_entry]
        want = loop(shared)
        in_dims = tuple(0 if r else None for r in rows)
        compare(func.vmap(fn, in_dims)(*stacked(rows)), want, "batch dim 0")
        in_last = tuple(-1 if r else None for r in rows)
        got = func.vmap(fn, in_last, out_dims=-1)(*stacked(rows, -1))
        compare(tuple(g.movedim(-1, 0) for g in _outputs(got)), want, "batch dim -1")
        variants += 2
        # Every tensor batched (per-entry weights), when some were shared above.
        if any(t and not r for t, r in zip(tensors, rows)):
            want_all = loop([args for _, args in per_entry])
            compare(func.vmap(fn, tuple(0 if t else None for t in tensors))(*stacked(tensors)), want_all,
                    "all tensors batched")
            variants += 1
        # Nested: entries as 2 x (entries / 2).
        nested = tuple(a.reshape(2, entries // 2, *a.shape[1:]) if r else a for a, r in zip(stacked(rows), rows))
        got = func.vmap(func.vmap(fn, in_dims), in_dims)(*nested)
        compare(tuple(g.flatten(0, 1) for g in _outputs(got)), want, "nested")
        variants += 1
        # Per-entry gradients of the row inputs.
        if info.differentiable:
            diff = [i for i, r in enumerate(rows) if r and first[i].is_floating_point()]

            def loss(*a):
                outs = _outputs(fn(*a))
                return sum((outs[k] * torch.linspace(-1, 1, outs[k].numel(), dtype=outs[k].dtype,
                                                     device=outs[k].device).reshape(outs[k].shape)).sum()
                           for k in info.diff_outputs)

            got = func.vmap(func.grad(loss, argnums=tuple(diff)), in_dims)(*stacked(rows))
            wants = []
            for args in shared:
                a = [x.detach().clone().requires_grad_(i in diff) if isinstance(x, torch.Tensor) else x
                     for i, x in enumerate(args)]
                wants.append(torch.autograd.grad(loss(*a), [a[i] for i in diff]))
            compare(got, tuple(torch.stack(ws) for ws in zip(*wants)), "vmap(grad)")
            variants += 1
    return variants


def _autocast_policy(policy: str, args: list, ti: list[int], low: torch.dtype) -> list:
    """args (detached) as an op of the given autocast policy computes with them."""
    a = [x.detach() if isinstance(x, torch.Tensor) else x for x in args]
    if policy == "promote":
        widest = functools.reduce(torch.promote_types, (a[i].dtype for i in ti))
        return [x.to(widest) if i in ti else x for i, x in enumerate(a)]
    if policy == "lower":  # as ATen's lower-precision ops: float32 tensors run in the autocast dtype
        return [x.to(low) if i in ti and x.dtype == torch.float32 else x for i, x in enumerate(a)]
    if policy == "first":
        return [x.to(a[ti[0]].dtype) if i in ti else x for i, x in enumerate(a)]
    if policy == "add_norm":  # x and residual promoted, then the weight as "norm"
        wide = torch.promote_types(a[ti[0]].dtype, a[ti[1]].dtype)
        a[ti[0]], a[ti[1]] = a[ti[0]].to(wide), a[ti[1]].to(wide)
        ti = [ti[0], ti[2]]
    if policy in ("norm", "add_norm"):
        x, w = a[ti[0]], a[ti[1]]
        half_x = x.dtype in (torch.float16, torch.bfloat16)
        if not (w.dtype == x.dtype or (half_x and w.dtype == torch.float32)):
            a[ti[1]] = w.to(torch.float32 if half_x else x.dtype)
    return a


def check_autocast(info: OpInfo, device) -> int:
    """Inside torch.autocast the op takes what autocast ops produce (mixed dtypes) and returns
    what its policy says, forward and backward (gradients in each input's own dtype)."""
    dev = torch.device(device)
    low_dtypes = [torch.bfloat16] + ([torch.float16] if dev.type == "cuda" else [])
    checked = 0
    for low in low_dtypes:
        s = info.batch(dev, torch.float32, 3)
        fn, args = _positional(info, s)
        ti = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if info.autocast == "promote":
            cases = [({ti[0]: low}, torch.float32), ({i: low for i in ti}, low)]
        elif info.autocast == "norm":
            cases = [({ti[0]: low}, low), ({ti[1]: low}, torch.float32), ({i: low for i in ti}, low)]
        elif info.autocast == "add_norm":
            cases = [({ti[0]: low}, torch.float32), ({ti[0]: low, ti[1]: low}, low), ({i: low for i in ti}, low)]
        elif info.autocast == "float32":  # computes in float32 whatever it is given, returns float32
            cases = [({}, torch.float32), ({i: low for i in ti}, torch.float32)]
        elif info.autocast == "lower":  # output dtype: the op's on the cast inputs (checked below)
            cases = [({}, None), ({ti[0]: low}, None), ({i: low for i in ti}, None)]
        elif info.autocast == "first":
            cases = [({ti[0]: low}, low), ({i: low for i in ti[1:]}, torch.float32), ({i: low for i in ti}, low)]
        else:
            cases = [({}, torch.float32), ({i: low for i in ti}, low)]
        for casts, want_dtype in cases:
            a = [x.detach().to(casts[i]).requires_grad_(info.differentiable_arg(i, x)) if i in casts else
                 (x.detach().clone().requires_grad_(info.differentiable_arg(i, x)) if isinstance(x, torch.Tensor) else x)
                 for i, x in enumerate(args)]
            with torch.autocast(dev.type, dtype=low):
                outs = _outputs(fn(*a))
            y = outs[0]
            if want_dtype is None:
                want_dtype = _outputs(fn(*_autocast_policy(info.autocast, a, ti, low)))[0].dtype
            assert y.dtype == want_dtype, (f"{info.qualname} under autocast({low}) with {casts}: output dtype "
                                           f"{y.dtype}, policy {info.autocast!r} says {want_dtype}")
            # Values: the op outside autocast on the inputs cast as the policy casts them.
            torch.testing.assert_close(y, _outputs(fn(*_autocast_policy(info.autocast, a, ti, low)))[0],
                                       msg=lambda m: f"{info.qualname} under autocast({low}): {m}")
            if info.differentiable:
                xs = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad]
                grads = torch.autograd.grad(_loss(outs, info.diff_outputs), xs)
                for x, g in zip(xs, grads):
                    assert g.dtype == x.dtype and bool(torch.isfinite(g).all()), (
                        f"{info.qualname} under autocast: gradient {g.dtype} for an input of {x.dtype}")
            checked += 1
    return checked


def check_compiled_autograd(info: OpInfo, device, backend="aot_eager") -> int:
    """The backward under compiled autograd (torch._dynamo.compiled_autograd) equals eager's."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    if not info.differentiable:
        return 0
    torch._dynamo.reset()
    samples = [s for s in info.samples(torch.device(device), torch.float32, True)
               if any(x.numel() for x in _grad_inputs(s.args))][:3]
    for s in samples:
        e = clone_sample(s)
        want = torch.autograd.grad(_loss(_outputs(_call(info, e)), info.diff_outputs), _grad_inputs(e.args))
        xs = _grad_inputs(s.args)
        for x in xs:
            x.grad = None
        with compiled_autograd._enable(torch.compile(backend=backend)):
            _loss(_outputs(_call(info, s)), info.diff_outputs).backward()
        for x, w in zip(xs, want):
            torch.testing.assert_close(x.grad, w, msg=lambda m: f"{info.qualname} compiled autograd [{s.desc}]: {m}")
    torch._dynamo.reset()
    return len(samples)
