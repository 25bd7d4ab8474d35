"""Property-based fuzzing of the "customops" compile pass (hypothesis).

Each family below builds one pattern the pass knows (RMSNorm, residual add + RMSNorm, RoPE,
SwiGLU, cross-entropy, linear + cross-entropy) and perturbs it as user code does: keywords off
their defaults (alpha, dtype, keepdim, dims, weights), extra users of intermediates, a second site
that depends on the first, broadcasting, mixed dtypes and views. The pass runs alone (no Inductor:
the rewritten graph runs eagerly, as ``customops.explain`` does) and must give eager's outputs and
gradients; a pattern left alone because of a keyword must be named in the report; the unperturbed
form must be replaced; and no case may fail the pass (it would fall back to Inductor with a
warning, which the test counts as a failure).

CI runs a bounded number of examples per family with a fixed seed. More:
    CUSTOMOPS_COMPILE_FUZZ_EXAMPLES=500 CUSTOMOPS_FUZZ_SEED=random python -m pytest tests/python/test_compile_fuzz.py
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from customops import compile as cc  # noqa: E402

EXAMPLES = int(os.environ.get("CUSTOMOPS_COMPILE_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("CUSTOMOPS_FUZZ_SEED", "") == "random"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

F32, BF16 = torch.float32, torch.bfloat16


@dataclasses.dataclass
class Case:
    fn: Callable
    args: tuple
    replaced: str  # what the report must list as replaced when nothing is perturbed
    said: tuple[str, str] | None = None  # (perturbation, what the report says of it when it is the only one)
    grad_args: tuple = ()  # indices of the args to differentiate


class Draw:
    """Draws a case's knobs and records which were perturbed (off the form the pass replaces)."""

    def __init__(self, data):
        self.data, self.perturbed, self.desc = data, [], []

    def __call__(self, label, options, canonical=...):
        """One of options; anything but `canonical` (when given) is a perturbation, drawn a quarter of
        the time, so that most cases perturb a knob or two and some none."""
        others = [o for o in options if o != canonical]
        weighted = options if canonical is ... else [canonical] * (3 * len(others)) + others
        value = self.data.draw(st.sampled_from(weighted), label=label)
        self.desc.append(f"{label}={value!r}")
        if canonical is not ... and value != canonical:
            self.perturbed.append(label)
        return value


def _randn(*shape, dtype=F32, layout="contiguous"):
    if layout == "transposed" and len(shape) >= 2:
        return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)
    if layout == "sliced":
        return torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    return torch.randn(*shape, dtype=dtype)


def _rms(h, w, eps, *, weight="right", square="pow", dim=-1, keepdim=True, alpha=1, mean_dtype=None, upcast=False,
         extra=False):
    """RMSNorm as Hugging Face writes it, with the knobs a perturbation turns."""
    x = h.to(F32) if upcast else h
    sq = x.pow(2) if square == "pow" else x * x if square == "mul" else x.pow(3)
    ms = sq.mean(dim, keepdim=keepdim) if mean_dtype is None else sq.mean(dim, keepdim=keepdim, dtype=mean_dtype)
    rstd = torch.rsqrt(torch.add(ms, eps) if alpha == 1 else torch.add(ms, eps, alpha=alpha))
    y = x * rstd
    if upcast:
        y = y.to(h.dtype)
    y = w * y if weight == "left" else y * w if weight == "right" else y
    return (y, rstd) if extra else y


LAYOUTS = ["contiguous", "transposed", "sliced"]


def rms_norm(d: Draw) -> Case:
    n = d("n", [8, 6])
    rows = d("rows", [3, n])  # square rows: a reduction over the wrong dim still broadcasts
    dtype = d("dtype", [F32, BF16])
    knobs = dict(weight=d("weight", ["right", "left", None]), square=d("square", ["pow", "mul", "pow3"], "pow"),
                 dim=d("dim", [-1, 0], -1), keepdim=d("keepdim", [True, False], True),
                 alpha=d("alpha", [1, 2.0], 1), mean_dtype=d("mean dtype", [None, torch.float64], None),
                 upcast=d("upcast", [False, True]) and dtype == BF16, extra=d("extra user", [False, True], False))
    wshape = d("weight shape", ["[n]", "[1, n]", "float32 [n]"], "[n]")
    eps = d("eps", [0.5, 1e-6])  # 0.5: an alpha on eps shows in the result
    x = _randn(rows, n, dtype=dtype, layout=d("layout", LAYOUTS))
    w = torch.randn(1, n, dtype=dtype) if wshape == "[1, n]" else torch.randn(n, dtype=F32 if "float32" in wshape
                                                                               else dtype)
    said = (("alpha", f"with alpha={knobs['alpha']!r}") if knobs["alpha"] != 1 else
            ("mean dtype", f"with dtype={knobs['mean_dtype']!r}") if knobs["mean_dtype"] is not None else None)
    return Case(lambda x, w: _rms(x, w, eps, **knobs), (x, w), "RMSNorm -> customops.rms_norm", said, (0, 1))


def add_rms_norm(d: Draw) -> Case:
    n, rows = 8, d("rows", [3, 5])
    dtype = d("dtype", [F32, BF16])
    alpha = d("alpha", [1, 2.0, -1], 1)
    other = d("residual", ["same", "broadcast [n]", "float32"], "same")
    spelled = d("norm", ["F.rms_norm", "hugging face"])
    uses = d("sum's uses", ["returned", "doubled", "norm only"])
    chain = d("second layer", [False, True])  # a second add + norm whose residual is the first's sum
    x = _randn(rows, n, dtype=dtype, layout=d("layout", LAYOUTS))
    r = torch.randn(n, dtype=dtype) if other == "broadcast [n]" else torch.randn(rows, n, dtype=F32 if other == "float32"
                                                                                 else dtype)
    w = torch.randn(n, dtype=dtype)

    def norm(h, w):
        return F.rms_norm(h, (n,), w, 0.5) if spelled == "F.rms_norm" else _rms(h, w, 0.5)

    def fn(x, r, w):
        h = x + r if alpha == 1 else torch.add(x, r, alpha=alpha)
        y = norm(h, w)
        if chain:
            h = y * 0.5 + h
            y = norm(h, w)
        return (y,) if uses == "norm only" else (y, h) if uses == "returned" else (y, h * 2)

    return Case(fn, (x, r, w), "residual add + RMSNorm -> customops.add_rms_norm",
                ("alpha", f"with alpha={alpha!r}") if alpha != 1 else None, (0, 1, 2))


def _rot(x, *, split=None, inverse=False):
    h = x.shape[-1] // 2 if split is None else split
    a, b = x[..., :h], x[..., h:]
    return torch.cat((b, -a), -1) if inverse else torch.cat((-b, a), -1)


def rope(d: Draw) -> Case:
    b, hq, hkv, s, dim = 2, 4, 2, 5, 8
    dtype = d("dtype", [F32, BF16])
    cs = d("cos", ["[B, 1, S, D]", "[1, 1, S, D]", "[1, 1, S, D] expanded to B", "[1, 1, 1, D]", "[B, 1, S, D/2]",
                   "float32", "requires grad"], "[B, 1, S, D]")
    rot = d("rotation", ["rotate-half", "inverse", "split 3"], "rotate-half")
    combine = d("combine", ["add", "alpha=-1", "sub"], "add")
    sites = d("sites", ["q and k", "q only", "q twice", "k from rotated q"])
    layout = d("layout", ["contiguous", "transposed"])
    q = (torch.randn(b, s, hq, dim, dtype=dtype).transpose(1, 2) if layout == "transposed"
         else torch.randn(b, hq, s, dim, dtype=dtype))
    k = torch.randn(b, hkv, s, dim, dtype=dtype)
    shape = {"[1, 1, S, D]": (1, 1, s, dim), "[1, 1, S, D] expanded to B": (1, 1, s, dim), "[1, 1, 1, D]": (1, 1, 1, dim),
             "[B, 1, S, D/2]": (b, 1, s, dim // 2)}.get(cs, (b, 1, s, dim))
    cos, sin = (torch.randn(shape, dtype=F32 if cs == "float32" else dtype) for _ in range(2))
    if cs == "[1, 1, S, D] expanded to B":
        cos, sin = cos.expand(b, 1, s, dim), sin.expand(b, 1, s, dim)
    if cs == "[B, 1, S, D/2]":  # the halves' angles repeated, as Hugging Face's cat((freqs, freqs))
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def one(x, cos, sin):
        r = _rot(x, split=3 if rot == "split 3" else None, inverse=rot == "inverse")
        if combine == "add":
            return x * cos + r * sin
        return torch.add(x * cos, r * sin, alpha=-1) if combine == "alpha=-1" else x * cos - r * sin

    def fn(q, k, cos, sin):
        if sites == "q only":
            return (one(q, cos, sin),)
        if sites == "q twice":
            return (one(one(q, cos, sin), cos, sin),)
        q2 = one(q, cos, sin)
        if sites == "k from rotated q":
            return q2, one(q2[:, :hkv] * 0.5 + k, cos, sin)
        return q2, one(k, cos, sin)

    grads = (0, 1, 2, 3) if cs == "requires grad" else (0, 1)
    replaced = "rotate-half RoPE of q and k -> customops.rope" if sites == "q and k" else "rotate-half RoPE -> customops.rope"
    return Case(fn, (q, k, cos, sin), replaced, ("combine", "with alpha=-1") if combine == "alpha=-1" else None, grads)


def swiglu(d: Draw) -> Case:
    n, rows = 8, 3
    dtype = d("dtype", [F32, BF16])
    form = d("silu", ["F.silu(g)", "g * sigmoid(g)", "g * sigmoid(u)"], "F.silu(g)")
    up = d("up", ["same", "broadcast [n]", "float32"], "same")
    extra = d("extra user", [False, True])
    g = _randn(rows, n, dtype=dtype, layout=d("layout", LAYOUTS))
    u = torch.randn(n, dtype=dtype) if up == "broadcast [n]" else torch.randn(rows, n, dtype=F32 if up == "float32" else dtype)

    def fn(g, u):
        a = F.silu(g) if form == "F.silu(g)" else g * torch.sigmoid(g if form == "g * sigmoid(g)" else u)
        return (a * u, a + 1) if extra else (a * u,)

    return Case(fn, (g, u), "silu -> customops.silu" if extra else "silu(gate) * up -> customops.silu_mul", None, (0, 1))


def cross_entropy(d: Draw) -> Case:
    n, c = 6, 10
    dtype = d("dtype", [F32, BF16])
    form = d("form", ["F.cross_entropy", "upcast", "log_softmax + nll_loss", "log_softmax dim 0", "class weights",
                      "[N, C, L]"])
    if form in ("log_softmax dim 0", "class weights", "[N, C, L]"):
        d.perturbed.append("form")
    reduction = d("reduction", ["mean", "sum", "none"])
    ii, ls = d("ignore_index", [-100, 2]), d("label_smoothing", [0.0, 0.1])
    x = _randn(n, c, dtype=dtype, layout=d("layout", ["contiguous", "transposed"]))
    t = torch.randint(0, c, (n,))
    if ii >= 0:
        t[1] = ii
    wt = torch.rand(c, dtype=dtype)

    def fn(x, wt):
        if form == "upcast":
            return F.cross_entropy(x.float(), t, reduction=reduction, ignore_index=ii, label_smoothing=ls)
        if form.startswith("log_softmax"):
            return F.nll_loss(F.log_softmax(x, 0 if form.endswith("dim 0") else -1), t, reduction=reduction,
                              ignore_index=ii)
        if form == "class weights":
            return F.cross_entropy(x, t, wt, reduction=reduction, ignore_index=ii, label_smoothing=ls)
        if form == "[N, C, L]":
            return F.cross_entropy(x.unsqueeze(-1).expand(n, c, 3), t[:, None].expand(n, 3), reduction=reduction,
                                   ignore_index=ii, label_smoothing=ls)
        return F.cross_entropy(x, t, reduction=reduction, ignore_index=ii, label_smoothing=ls)

    replaced = ("log_softmax + nll_loss -> customops.cross_entropy" if form == "log_softmax + nll_loss"
                else "cross_entropy -> customops.cross_entropy")
    return Case(fn, (x, wt), replaced, None, (0,))


def linear_cross_entropy(d: Draw) -> Case:
    b, s, h, v = 2, 3, 8, 10
    dtype = d("dtype", [F32, BF16])
    bias = d("bias", [False, True])
    flatten = d("flatten", ["view", "reshape", "flatten"])
    upcast = d("upcast", [None, F32, torch.float64])
    reduction = d("reduction", ["mean", "sum", "none"])
    extra = d("extra user of the logits", [False, True])
    x = _randn(b, s, h, dtype=dtype, layout=d("layout", ["contiguous", "transposed"]))
    w, bb = torch.randn(v, h, dtype=dtype), torch.randn(v, dtype=dtype)
    t = torch.randint(0, v, (b * s,))
    if flatten == "flatten":
        d.perturbed.append("flatten")

    def fn(x, w, bb):
        logits = F.linear(x, w, bb if bias else None)
        lg = logits if upcast is None else logits.to(upcast)
        lg = lg.view(-1, v) if flatten == "view" else lg.reshape(b * s, v) if flatten == "reshape" else lg.flatten(0, 1)
        loss = F.cross_entropy(lg, t, reduction=reduction)
        return (loss, logits.sum()) if extra else (loss,)

    fused = upcast in (None, F32) and reduction != "none" and not extra
    replaced = ("linear + cross_entropy -> customops.linear_cross_entropy" if fused
                else "cross_entropy -> customops.cross_entropy")
    return Case(fn, (x, w, bb), replaced, None, (0, 1, 2) if bias else (0, 1))


FAMILIES = {f.__name__: f for f in (rms_norm, add_rms_norm, rope, swiglu, cross_entropy, linear_cross_entropy)}


def _assert_agrees(what, got, eager, ref, text):
    """float32 cases: got close to eager. bfloat16 ones: got no further from the float32 run than
    twice eager's largest rounding error, plus bfloat16's (the customops ops compute in float32
    and round once, where eager rounds at every step)."""
    if ref is None:
        torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-4, equal_nan=True, msg=lambda m: f"{what}: {m}\n{text}")
        return
    r = ref.double()
    eager_err = (eager.double() - r).abs().nan_to_num(0, 0, 0)
    err, allowed = (got.double() - r).abs(), 2 * eager_err.max() + 1e-2 * (1 + r.abs())
    bad = ~(err <= allowed) & ~(got.isnan() & ref.isnan())
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {got.numel()} off; worst {err.max().item()} where eager is "
                                 f"{(eager.double() - r).abs().max().item()} off the float32 run\n{text}")


def _leaves(y):
    return [t for t in torch.utils._pytree.tree_leaves(y) if isinstance(t, torch.Tensor)]


def _run(case: Case, fn):
    args = tuple(a.detach().clone().requires_grad_(i in case.grad_args) for i, a in enumerate(case.args))
    ys = _leaves(fn(*args))
    gen = torch.Generator().manual_seed(0)
    loss = sum((y.float() * torch.randn(y.shape, generator=gen)).sum() for y in ys if y.is_floating_point())
    diff = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(loss, diff, allow_unused=True) if diff and loss.requires_grad else ()
    return [y.detach() for y in ys], list(grads)


@pytest.mark.parametrize("family", list(FAMILIES))
@FUZZ
@given(data=st.data())
def test_compile_pass_equals_eager(family, data):
    d = Draw(data)
    case = FAMILIES[family](d)
    note(f"{family}: {', '.join(d.desc)}")
    try:
        want = _run(case, case.fn)
    except RuntimeError:  # a perturbation eager itself rejects (a broadcast that does not fit)
        event("eager rejects the case")
        return
    reports = []

    def backend(gm, example_inputs):
        new, report = cc.rewrite(gm, example_inputs)
        reports.append(report)
        return new

    torch._dynamo.reset()
    got = _run(case, torch.compile(case.fn, backend=backend, fullgraph=True))
    text = "\n".join(str(r) for r in reports)
    note(text)
    assert not any(r.error for r in reports), text
    half = any(a.dtype == BF16 for a in case.args)
    ref = _run(dataclasses.replace(case, args=tuple(a.float() for a in case.args)), case.fn) if half else None
    for kind in (0, 1):
        for i, (g, w) in enumerate(zip(got[kind], want[kind])):
            what = f"{('output', 'gradient')[kind]} {i}"
            if w is None:
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {g.dtype} {g.shape}, eager's {w.dtype} {w.shape}"
            _assert_agrees(what, g, w, None if ref is None else ref[kind][i], text)
    matched = sum((r.matched for r in reports), start=Counter())
    event("replaced something" if matched else "left alone")
    if not d.perturbed:
        assert matched[case.replaced] >= 1, f"the unperturbed pattern was not replaced:\n{text}"
    if case.said is not None and d.perturbed == [case.said[0]]:
        assert case.said[1] in text, f"left alone without saying {case.said[1]!r}:\n{text}"
