"""Sample makers of the op table: per op, inputs for a device, dtype and requires_grad in every
layout (contiguous, transposed, strided, empty), and batch makers: a sample whose leading size is
n, for the compile, export, vmap and autocast checks.
"""

from __future__ import annotations

import torch

from .core import Sample


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


def _cache_attention_samples(device, dtype, requires_grad):
    """q [B, Hq, T, D] against caches of Bc >= B sequences, with each sequence's filled length:
    decoding (T = 1) and a few new tokens, lengths from T to the whole cache; head dims and sizes
    that take the CUDA kernel with one and with several splits, and T past its limit."""
    def q_of(b, hq, t, d, layout):
        if layout == "transposed":  # [B, T, H, D] memory read as [B, H, T, D], as a model passes it
            return torch.randn(b, t, hq, d, device=device, dtype=dtype).transpose(1, 2)
        return _rand((b, hq, t, d), device, dtype, layout=layout)

    out = []
    for (b, bc, hq, hkv, t, s, d), lengths, layout, scale, *slots in [
        ((2, 3, 4, 2, 1, 10, 8), (5, 10), "contiguous", None),
        ((2, 4, 4, 2, 1, 10, 8), (5, 10), "contiguous", None, (3, 1)),  # rows of some slots of the cache
        ((2, 3, 8, 2, 1, 300, 64), (300, 77), "transposed", None, (2, 0)),  # CUDA: several splits
        ((2, 2, 4, 2, 3, 9, 16), (3, 7), "transposed", None),
        ((2, 2, 2, 1, 2, 6, 8), (4, 6), "strided", 0.3),
        ((2, 2, 8, 2, 1, 300, 64), (300, 77), "transposed", None),  # CUDA: several splits
        ((1, 1, 4, 1, 5, 130, 128), (100,), "contiguous", None),  # 20 rows: two row groups
        ((1, 2, 2, 1, 2, 70, 256), (70,), "contiguous", None),
        ((1, 1, 4, 1, 1, 1000, 128), (777,), "transposed", 0.05),
        ((1, 1, 2, 1, 17, 40, 64), (33,), "contiguous", None),  # CUDA: more queries than its kernel takes
        ((3, 4, 4, 2, 18, 40, 16), (25, 25, 25), "transposed", None),  # a prefill of equal prompts: one call
        ((2, 4, 4, 2, 18, 40, 16), (25, 25), "transposed", None, (3, 0)),  # the same, of two slots
        ((2, 3, 2, 1, 17, 40, 64), (33, 20), "contiguous", None, (1, 2)),  # a prefill of two slots
        ((2, 2, 2, 2, 0, 5, 8), (0, 3), "contiguous", None),
    ]:
        q = q_of(b, hq, t, d, layout)
        k, v = (_rand((bc, hkv, s, d), device, dtype, layout="strided" if layout == "strided" else "contiguous")
                for _ in range(2))
        args = (q, k, v, torch.tensor(lengths, device=device), scale)
        if slots:
            args += (torch.tensor(slots[0], device=device),)
        out.append(Sample(args, {}, f"{layout} q {[b, hq, t, d]} cache {[bc, hkv, s, d]} lengths {list(lengths)}"
                          + (f" scale {scale}" if scale else "") + (f" slots {list(slots[0])}" if slots else "")))
    return out


def _cache_attention_batch(device, dtype, n):
    lengths = torch.arange(n, device=device) % 5 + 2  # 2 to 6 of the 6 positions
    q, k, v = (torch.randn(n, h, s, 8, device=device, dtype=dtype) for h, s in ((4, 2), (2, 6), (2, 6)))
    slots = torch.arange(n - 1, -1, -1, device=device)  # the cache's sequences in reverse
    return Sample((q, k, v, lengths, None, slots), {}, f"batch {n}")


def _cache_write_samples(device, dtype, requires_grad):
    """New keys and values [B, Hkv, T, D] into caches of Bc >= B sequences at each one's start."""
    out = []
    for (b, bc, h, t, s, d), start, layout, *slots in [
        ((2, 3, 2, 3, 8, 4), (0, 5), "contiguous"),
        ((2, 3, 2, 3, 8, 4), (0, 5), "contiguous", (2, 0)),  # rows of some slots of the cache
        ((2, 2, 2, 2, 6, 8), (1, 4), "transposed"),  # k, v: [B, T, H, D] memory read as [B, H, T, D]
        ((2, 2, 1, 2, 5, 4), (3, 0), "strided"),
        ((1, 1, 4, 5, 300, 128), (290,), "contiguous"),
        ((2, 2, 2, 0, 8, 4), (3, 8), "contiguous"),
    ]:
        if layout == "transposed":
            k, v = (torch.randn(b, t, h, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
        else:
            k, v = (_rand((b, h, t, d), device, dtype, layout=layout) for _ in range(2))
        kc, vc = (_rand((bc, h, s, d), device, dtype, layout="strided" if layout == "strided" else "contiguous")
                  for _ in range(2))
        args = (kc, vc, k, v, torch.tensor(start, device=device))
        if slots:
            args += (torch.tensor(slots[0], device=device),)
        out.append(Sample(args, {}, f"{layout} k {[b, h, t, d]} cache {[bc, h, s, d]} start {list(start)}"
                          + (f" slots {list(slots[0])}" if slots else "")))
    return out


def _cache_write_batch(device, dtype, n):
    start = torch.arange(n, device=device) % 5  # 2 new positions of 6
    kc, vc, k, v = (torch.randn(n, 2, s, 8, device=device, dtype=dtype) for s in (6, 6, 2, 2))
    return Sample((kc, vc, k, v, start), {}, f"batch {n}")


def _rope_cache_write_samples(device, dtype, requires_grad):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] rotated and written into caches of Bc >= B sequences:
    views of a fused qkv projection (the decode layout: CUDA's one kernel), contiguous and strided
    inputs, cos shared or per sequence, a partial rotation (R < D), T of 0."""
    out = []
    for (b, bc, hq, hkv, t, s, d, r), start, layout, per_seq, *slots in [
        ((1, 1, 4, 2, 1, 8, 16, 16), (5,), "qkv", True),  # a decode step
        ((2, 4, 4, 2, 1, 8, 16, 16), (5, 2), "qkv", True, (3, 1)),  # a decode step of some slots
        ((2, 3, 2, 1, 2, 6, 8, 8), (1, 4), "contiguous", True, (1, 0)),
        ((2, 3, 4, 2, 3, 8, 16, 16), (0, 5), "qkv", False),
        ((2, 2, 2, 1, 2, 6, 8, 8), (1, 4), "contiguous", True),
        ((2, 2, 2, 2, 2, 5, 8, 4), (3, 0), "strided", True),  # rotates the first 4 of 8 dims
        ((1, 1, 4, 1, 5, 300, 64, 64), (290,), "transposed", False),
        ((2, 2, 2, 1, 0, 8, 8, 8), (3, 8), "contiguous", False),
    ]:
        if layout == "qkv":  # q, k, v: head views of one [B, T, (Hq + 2 Hkv) * D] projection
            qkv = torch.randn(b, t, hq + 2 * hkv, d, device=device, dtype=dtype)
            q, k, v = (x.transpose(1, 2) for x in qkv.split([hq, hkv, hkv], dim=2))
        elif layout == "transposed":
            q, k, v = (torch.randn(b, t, h, d, device=device, dtype=dtype).transpose(1, 2) for h in (hq, hkv, hkv))
        else:
            q, k, v = (_rand((b, h, t, d), device, dtype, layout=layout) for h in (hq, hkv, hkv))
        angle = torch.rand(b if per_seq else 1, t, r // 2, device=device, dtype=torch.float64) * 6.3
        angle = torch.cat((angle, angle), -1)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        if not per_seq:
            cos, sin = cos[0], sin[0]  # [T, R], shared by the sequences
        kc, vc = (_rand((bc, hkv, s, d), device, dtype, layout="strided" if layout == "strided" else "contiguous")
                  for _ in range(2))
        args = (kc, vc, q, k, v, cos, sin, torch.tensor(start, device=device))
        if slots:
            args += (torch.tensor(slots[0], device=device),)
        out.append(Sample(args, {}, f"{layout} q {[b, hq, t, d]} k {[b, hkv, t, d]} R {r} cache {[bc, hkv, s, d]} "
                          f"start {list(start)}" + (f" slots {list(slots[0])}" if slots else "")))
    return out


def _rope_cache_write_batch(device, dtype, n):
    start = torch.arange(n, device=device) % 5  # 2 new positions of 6
    kc, vc = (torch.randn(n, 2, 6, 8, device=device, dtype=dtype) for _ in range(2))
    q, k, v = (torch.randn(n, h, 2, 8, device=device, dtype=dtype) for h in (4, 2, 2))
    angle = torch.rand(n, 2, 4, device=device, dtype=dtype) * 6.3
    angle = torch.cat((angle, angle), -1)
    slots = torch.arange(n - 1, -1, -1, device=device)  # the cache's sequences in reverse
    return Sample((kc, vc, q, k, v, angle.cos(), angle.sin(), start, slots), {}, f"batch {n}")


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


def _halves_samples(device, dtype, requires_grad):
    """silu_mul samples, plus gate and up as the two halves of one gate-up tensor."""
    out = _elementwise_samples(2)(device, dtype, requires_grad)
    for shape in [(6, 2 * 24), (2, 3, 2 * 17)]:
        base = torch.randn(shape, device=device, dtype=dtype)
        gate, up = (h.detach().requires_grad_(requires_grad) for h in base.chunk(2, -1))
        out.append(Sample((gate, up), {}, f"strided halves of {list(shape)}"))
    return out


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


def _fused_linear_samples(device, dtype, requires_grad):
    """Each prologue with and without bias and residual; a few rows (CUDA's matrix-vector
    kernel, rows of 16-byte vectors or not) and more than it takes; non-contiguous x, weight and
    residual; empty x and empty features; a float32 norm weight with half-type x. Weights are
    scaled by 1/sqrt(in_features) so outputs stay near 1 (the prologue is rounded to the dtype
    before the product, which the float64 reference is not)."""

    def lin(n, k, layout="contiguous"):
        w = _rand((n, k), device, dtype, layout=layout) / max(k, 1) ** 0.5
        return w.detach().requires_grad_(requires_grad)

    def vec(n, wdtype=dtype, offset=0.0):
        return (torch.rand(n, device=device, dtype=wdtype) + offset).requires_grad_(requires_grad)

    def x_(shape, layout="contiguous"):
        return _rand(shape, device, dtype, requires_grad, layout=layout)

    out = [
        Sample((x_((1, 64)), lin(24, 64)), {}, "contiguous none [1, 64] @ [24, 64]"),
        Sample((x_((2, 64)), lin(24, 64), vec(24), x_((2, 24)), "none", None, 1e-6, True), {},
               "contiguous none + bias + residual, constant weight"),
        Sample((x_((3, 32)), lin(20, 32), vec(20), x_((3, 20))), {}, "contiguous none [3, 32] + bias + residual"),
        Sample((x_((2, 3, 16), "transposed"), lin(12, 16, "transposed"), None, x_((2, 3, 12), "strided")), {},
               "transposed x and weight, strided residual, none"),
        Sample((x_((12, 40)), lin(8, 40), vec(8)), {}, "contiguous none [12, 40]: more rows"),
        Sample((x_((5, 13)), lin(7, 13)), {}, "contiguous none, odd in_features"),
        Sample((x_((0, 16)), lin(8, 16), vec(8)), {}, "contiguous none, empty x"),
        Sample((x_((3, 0)), lin(5, 0), vec(5)), {}, "contiguous none, no in_features"),
        Sample((x_((4, 32)), lin(24, 32), None, x_((4, 24)), "rms_norm", vec(32, offset=0.5)), {},
               "contiguous rms_norm [4, 32] + residual"),
        Sample((x_((1, 2, 48), "strided"), lin(16, 48), vec(16), None, "rms_norm", None, 1e-5), {},
               "strided x, rms_norm without norm weight, bias"),
        Sample((x_((9, 16)), lin(8, 16), None, None, "rms_norm", vec(16, offset=0.5)), {},
               "contiguous rms_norm [9, 16]: more rows"),
        Sample((x_((2, 64)), lin(16, 32), vec(16), x_((2, 16)), "swiglu"), {}, "contiguous swiglu [2, 64] + bias + residual"),
        Sample((x_((3, 4, 32), "transposed"), lin(8, 16), None, None, "swiglu"), {}, "transposed x, swiglu"),
        Sample((x_((0, 32)), lin(8, 16), None, None, "swiglu"), {}, "contiguous swiglu, empty x"),
    ]
    if dtype in (torch.float16, torch.bfloat16):  # a float32 norm weight, read as it is
        out.append(Sample((x_((2, 32)), lin(8, 32), None, None, "rms_norm", vec(32, torch.float32, offset=0.5)), {},
                          "contiguous rms_norm, float32 norm weight"))

    def fp8(n, k):  # a quantized weight and its scale (frozen: no gradient)
        w = torch.randn(n, k, device=device) / max(k, 1) ** 0.5
        scale = torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 448, torch.ones(n, device=device)) if k else \
            torch.ones(n, device=device)
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale

    q, s = fp8(24, 64)
    out.append(Sample((x_((2, 64)), q, vec(24), x_((2, 24)), "none", None, 1e-6, True, s), {},
                      "fp8 weight + bias + residual"))
    q, s = fp8(16, 32)
    out.append(Sample((x_((3, 32)), q, None, None, "rms_norm", vec(32, offset=0.5), 1e-6, False, s), {},
                      "fp8 weight, rms_norm"))
    q, s = fp8(8, 16)
    out.append(Sample((x_((3, 4, 32), "transposed"), q, None, None, "swiglu", None, 1e-6, False, s), {},
                      "fp8 weight, transposed x, swiglu"))
    q, s = fp8(8, 16)
    out.append(Sample((x_((0, 16)), q, None, None, "none", None, 1e-6, False, s), {}, "fp8 weight, empty x"))
    q, s = fp8(24, 80)
    out.append(Sample((x_((20, 80)), q, vec(24), None, "none", None, 1e-6, True, s), {},
                      "fp8 weight, 20 rows (prefill's path) + bias"))

    def int4(n, k, group):  # a weight packed two int4 a byte, a scale a group (frozen)
        w = torch.randn(n, k // group, group, device=device) / k ** 0.5
        scale = (w.abs().amax(2) / 7).to(dtype if dtype != torch.float64 else torch.float32)
        q = (torch.round(w / scale.float()[:, :, None]).clamp(-7, 7) + 8).to(torch.uint8).reshape(n, k // 2, 2)
        return q[..., 0] | (q[..., 1] << 4), scale

    q, s = int4(24, 64, 32)
    out.append(Sample((x_((2, 64)), q, vec(24), x_((2, 24)), "none", None, 1e-6, True, s), {},
                      "int4 weight (groups of 32) + bias + residual"))
    q, s = int4(16, 32, 16)
    out.append(Sample((x_((1, 2, 32), "strided"), q, None, None, "rms_norm", vec(32, offset=0.5), 1e-6, False, s), {},
                      "int4 weight (groups of 16), strided x, rms_norm"))
    q, s = int4(8, 16, 16)
    out.append(Sample((x_((3, 32)), q, None, None, "swiglu", None, 1e-6, False, s), {}, "int4 weight, swiglu"))
    q, s = int4(24, 96, 48)
    out.append(Sample((x_((20, 96)), q, None, x_((20, 24)), "rms_norm", vec(96, offset=0.5), 1e-6, True, s), {},
                      "int4 weight (groups of 48), 20 rows (prefill's path), rms_norm + residual"))
    return out


def _fused_linear_batch(device, dtype, n):
    w = torch.randn(12, 16, device=device, dtype=dtype) / 4
    return Sample((torch.randn(n, 16, device=device, dtype=dtype), w, torch.randn(12, device=device, dtype=dtype),
                   torch.randn(n, 12, device=device, dtype=dtype), "rms_norm",
                   torch.rand(16, device=device, dtype=dtype) + 0.5), {},
                  f"batch {n}")


def _swiglu_batch(device, dtype, n):
    return Sample((torch.randn(n, 16, device=device, dtype=dtype),), {}, f"batch {n}")


def _quantize_fp8_samples(device, dtype, requires_grad):
    """Weights [N, K] with rows of very different magnitudes, a row of zeros, strided and
    transposed layouts, empty rows and no rows."""
    w = torch.randn(12, 40, device=device, dtype=dtype) * torch.logspace(-3, 2, 12, device=device, dtype=dtype)[:, None]
    w[5] = 0
    return [Sample((w,), {}, "contiguous [12, 40], a row of zeros"),
            Sample((_rand((16, 24), device, dtype, layout="strided"),), {}, "strided [16, 24]"),
            Sample((_rand((8, 32), device, dtype, layout="transposed"),), {}, "transposed [8, 32]"),
            Sample((torch.randn(0, 16, device=device, dtype=dtype),), {}, "no rows"),
            Sample((torch.randn(4, 0, device=device, dtype=dtype),), {}, "empty rows")]


def _quantize_fp8_batch(device, dtype, n):
    return Sample((torch.randn(n, 32, device=device, dtype=dtype),), {}, f"batch {n}")


def _quantize_int4_samples(device, dtype, requires_grad):
    """Weights [N, K] in groups of 128, 32 and 16, a group of zeros, strided and transposed
    layouts, no rows."""
    w = torch.randn(6, 256, device=device, dtype=dtype) * torch.logspace(-2, 1, 6, device=device, dtype=dtype)[:, None]
    w[2, 128:] = 0
    return [Sample((w, 128), {}, "contiguous [6, 256], groups of 128, a group of zeros"),
            Sample((_rand((8, 64), device, dtype, layout="strided"), 32), {}, "strided [8, 64], groups of 32"),
            Sample((_rand((4, 32), device, dtype, layout="transposed"), 16), {}, "transposed [4, 32], groups of 16"),
            Sample((torch.randn(0, 32, device=device, dtype=dtype), 16), {}, "no rows"),
            Sample((torch.randn(2, 512, device=device, dtype=dtype), 128), {}, "[2, 512], groups of 128")]


def _quantize_int4_batch(device, dtype, n):
    return Sample((torch.randn(n, 32, device=device, dtype=dtype), 16), {}, f"batch {n}")
