"""Fuzz makers of the op table: each draws one sample from a :class:`~.core.FuzzSource` (the property-based
suite, tests/python/test_fuzz.py, implements it with hypothesis), with the error the op must raise
where the draw is one it rejects.
"""

from __future__ import annotations

from typing import Callable

import torch

from .core import Sample


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


def _fuzz_fused_linear(src, device, dtype):
    # Normal values: the product sums over in_features after the prologue is rounded, which the
    # float64 reference is not; huge and non-finite values would test that rounding, not the op.
    prologue = src.choice(["none", "rms_norm", "swiglu"])
    lead = src.shape(min_rank=0, max_rank=2, most=12)
    k, n = src.size(64), src.size(64)
    x = src.tensor((*lead, 2 * k if prologue == "swiglu" else k), dtype, device, values="normal")
    weight = src.tensor((n, k), dtype, device, values="normal")
    bias = src.tensor((n,), dtype, device, values="normal") if src.choice([False, True]) else None
    residual = src.tensor((*lead, n), dtype, device, values="normal") if src.choice([False, True]) else None
    norm_weight = None
    if prologue == "rms_norm" and src.choice([False, True]):
        norm_weight = src.tensor((k,), src.choice([dtype, torch.float32]) if _half(dtype) else dtype, device,
                                 values="normal")
    eps = src.choice([1e-6, 1e-5])
    return Sample((x, weight, bias, residual, prologue, norm_weight, eps), {},
                  f"x {list(x.shape)} weight {list(weight.shape)} {prologue}{' bias' if bias is not None else ''}"
                  f"{' residual' if residual is not None else ''}")


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


def _fuzz_slots(src, b, bc, device):
    """None (row b is sequence b), or distinct slots of the cache: 0 to b - 1 rotated by an offset."""
    if b == 0 or not src.choice([False, True]):
        return None
    off = src.choice(range(bc))
    return torch.tensor([(i + off) % bc for i in range(b)], dtype=torch.long, device=device)


def _fuzz_cache_attention(src, device, dtype):
    b, hkv, g = src.size(3), max(src.size(4), 1), max(src.size(4), 1)
    # D = 128 with the half types only, which the CUDA kernel takes: in float32 a dot product of 128
    # "nonfinite" terms is ill-conditioned enough that no two summation orders agree to the tolerance
    t, s, d = src.size(20), src.size(300), src.choice([8, 64, 128] if _half(dtype) else [8, 64])
    s = max(s, t)
    bc = b + src.choice([0, 1])
    # q and k as _fuzz_attention draws them (no huge values), v normal
    q = src.tensor((b, hkv * g, t, d), dtype, device, values="nonfinite")
    k = src.tensor((bc, hkv, s, d), dtype, device, values="nonfinite")
    v = src.tensor((bc, hkv, s, d), dtype, device, values="normal")
    lengths = torch.tensor([src.choice([t, s, (t + s) // 2]) for _ in range(b)], dtype=torch.long, device=device)
    scale = src.choice([None, 0.5])
    slots = _fuzz_slots(src, b, bc, device)
    return Sample((q, k, v, lengths, scale, slots), {},
                  f"q {list(q.shape)} cache {list(k.shape)} lengths {lengths.tolist()}"
                  + (f" slots {slots.tolist()}" if slots is not None else ""))


def _fuzz_cache_write(src, device, dtype):
    b, h, t, s, d = src.size(3), max(src.size(4), 1), src.size(20), src.size(300), src.size(64)
    s = max(s, t)
    bc = b + src.choice([0, 1])
    k_cache, v_cache = (src.tensor((bc, h, s, d), dtype, device, writable=True) for _ in range(2))
    k, v = (src.tensor((b, h, t, d), dtype, device) for _ in range(2))
    start = torch.tensor([src.choice([0, s - t, (s - t) // 2]) for _ in range(b)], dtype=torch.long, device=device)
    slots = _fuzz_slots(src, b, bc, device)
    return Sample((k_cache, v_cache, k, v, start, slots), {},
                  f"k {list(k.shape)} cache {list(k_cache.shape)} start {start.tolist()}"
                  + (f" slots {slots.tolist()}" if slots is not None else ""))


def _fuzz_rope_cache_write(src, device, dtype):
    b, hkv, t, s = src.size(3), max(src.size(4), 1), src.size(20), src.size(300)
    hq = hkv * src.choice([1, 2, 4])
    d = 2 * max(src.size(64), 1)
    r = src.choice([d, 2 * src.choice(range(d // 2 + 1))])
    s = max(s, t)
    bc = b + src.choice([0, 1])
    k_cache, v_cache = (src.tensor((bc, hkv, s, d), dtype, device, writable=True) for _ in range(2))
    q = src.tensor((b, hq, t, d), dtype, device)
    k, v = (src.tensor((b, hkv, t, d), dtype, device) for _ in range(2))
    cs_shape = src.choice([(t, r), (1, t, r), (b, t, r)])
    cos, sin = (src.tensor(cs_shape, dtype, device, values="finite") for _ in range(2))
    start = torch.tensor([src.choice([0, s - t, (s - t) // 2]) for _ in range(b)], dtype=torch.long, device=device)
    slots = _fuzz_slots(src, b, bc, device)
    return Sample((k_cache, v_cache, q, k, v, cos, sin, start, slots), {},
                  f"q {list(q.shape)} k {list(k.shape)} cos {list(cs_shape)} cache {list(k_cache.shape)} "
                  f"start {start.tolist()}" + (f" slots {slots.tolist()}" if slots is not None else ""))


def _fuzz_merge_attention(src, device, dtype):
    shape = src.shape(min_rank=1, max_rank=4)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    oa, ob = (src.tensor(shape, dtype, device) for _ in range(2))
    la, lb = (src.tensor(shape[:-1], lse_dtype, device, values="normal") * 3 for _ in range(2))
    if src.choice([False, True]):  # one side attended to no key
        lb = torch.full_like(lb, float("-inf"))
    return Sample((oa, la, ob, lb), {}, f"{list(shape)}")
