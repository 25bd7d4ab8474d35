"""Typed Python wrappers of the customops operators (``torch.ops.customops.*``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.compiler import is_compiling


class _Overloads:
    """Every overload of the library, read from the dispatcher once, as an attribute named after its
    op (``mul``: ``torch.ops.customops.mul.default``) or, past the default, op_overload
    (``muladd_out``). An attribute lookup through torch.ops costs about 0.1 us per call; on a plain
    object, like this one, a few ns."""

    def __init__(self):
        for qualname in torch._C._dispatch_get_all_op_names():
            namespace, _, name = qualname.partition("::")
            if namespace == "customops":
                op, _, overload = name.partition(".")
                setattr(self, name.replace(".", "_"), getattr(getattr(torch.ops.customops, op), overload or "default"))


_overloads = _Overloads()


def _callable(overload: torch._ops.OpOverload) -> Callable:
    """What a wrapper calls ``overload`` through. Outside torch.compile and torch.export: the C++
    callable that OpOverload.__call__ forwards to (``overload._op``), the same dispatcher call,
    about 0.3 us less per call on tiny tensors. Dynamo cannot trace that builtin, so while
    compiling: the OpOverload itself."""
    return overload if is_compiling() else overload._op


def muladd(a: Tensor, b: Tensor, c: float, *, out: Tensor | None = None) -> Tensor:
    """Fused ``a * b + c``, elementwise, in one pass over memory.

    Args:
        a: Tensor of any shape and strides; float32, float64, float16 or bfloat16.
        b: Tensor with the shape, dtype and device of ``a``.
        c: Python float added to every element (a constant: no gradient).
        out: Optional tensor with the shape, dtype and device of ``a`` to write into. It may be
            ``a`` or ``b`` itself, but must not overlap them partially. ``out=`` does not support
            autograd (as in ATen): it raises if ``a`` or ``b`` requires grad.

    Returns:
        A new contiguous tensor shaped like ``a`` (or ``out``). Half types are computed in float32
        and rounded once.
    """
    if out is None:
        return _callable(_overloads.muladd)(a, b, c)
    return _callable(_overloads.muladd_out)(a, b, c, out=out)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a * b`` of two tensors of one shape, dtype and device.

    Args:
        a: Tensor of any shape and strides; float32, float64, float16 or bfloat16.
        b: Tensor with the shape, dtype and device of ``a``.

    Returns:
        A new contiguous tensor shaped like ``a``.
    """
    return _callable(_overloads.mul)(a, b)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    Args:
        x: Tensor of shape ``[..., n]`` (at least one dimension); float32, float64, float16 or
            bfloat16. Any strides (non-contiguous inputs are read through a contiguous copy).
        weight: Optional tensor of shape ``[n]`` on x's device, of x's dtype or, for a float16 or
            bfloat16 x, float32 (read as it is; its gradient comes back in float32).
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        Tensor shaped like ``x`` (contiguous), computed in float32 (float64 for float64) and rounded
        once. The op itself, ``torch.ops.customops.rms_norm``, also returns ``rstd`` (shape
        ``x.shape[:-1]``), which its backward reuses; this wrapper drops it. Differentiable in x and
        weight; double backward raises.
    """
    return _callable(_overloads.rms_norm)(x, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """A residual connection followed by RMSNorm, in one pass: ``sum = x + residual`` and
    ``y = rms_norm(sum, weight, eps)``.

    Args:
        x: Tensor of shape ``[..., n]``; float32, float64, float16 or bfloat16 (any strides).
        residual: Tensor with x's shape, dtype and device.
        weight: Optional ``[n]`` tensor of x's dtype or, for half types, float32.
        eps: Added to the mean square before the reciprocal square root.

    Returns:
        ``(y, sum)``, both shaped like x: the normalized output, and ``sum`` (rounded to x's dtype,
        which is what is normalized), the residual stream the next block adds to. Differentiable
        in x, residual and weight, through y and sum; double backward raises. The op itself,
        ``torch.ops.customops.add_rms_norm``, also returns rstd.
    """
    y, s, _ = _callable(_overloads.add_rms_norm)(x, residual, weight, eps)
    return y, s


def silu(x: Tensor) -> Tensor:
    """SiLU (swish): ``x * sigmoid(x)``, elementwise.

    Args:
        x: Tensor of any shape and strides; float32, float64, float16 or bfloat16.

    Returns:
        A new contiguous tensor shaped like ``x``; half types are computed in float32.
        Differentiable; double backward raises.
    """
    return _callable(_overloads.silu)(x)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU product ``silu(gate) * up`` in one pass.

    Args:
        gate: Tensor of any shape; float32, float64, float16 or bfloat16.
        up: Tensor with gate's shape, dtype and device. ``gate, up = x.chunk(2, -1)`` of a fused
            gate-up projection is read in place (no copy).

    Returns:
        A new contiguous tensor shaped like ``gate``. Differentiable; double backward raises.

    When gate and up are the two halves of one tensor ``x``, :func:`swiglu` ``(x)`` computes the
    same and trains faster: autograd turns the gradients of ``x.chunk(2, -1)`` into the gradient of
    ``x`` by concatenating them, one more pass over memory, which swiglu's backward does not need.
    """
    return _callable(_overloads.silu_mul)(gate, up)


def swiglu(x: Tensor) -> Tensor:
    """``silu_mul(*x.chunk(2, -1))``: the SwiGLU product of a fused gate-up projection's output.

    Args:
        x: Tensor of shape ``[..., 2 * n]``, gate in ``x[..., :n]`` and up in ``x[..., n:]``;
            float32, float64, float16 or bfloat16; any strides.

    Returns:
        A new contiguous tensor of shape ``[..., n]``: ``silu(gate) * up``, computed in float32
        for half types. Differentiable; the backward writes x's gradient in one pass (no
        concatenation of the two halves' gradients); double backward raises.
    """
    return _callable(_overloads.swiglu)(x)


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, *,
                 prologue: str = "none", norm_weight: Tensor | None = None, eps: float = 1e-6,
                 constant_weight: bool = False, weight_scale: Tensor | None = None) -> Tensor:
    """``prologue(x) @ weight.T + bias + residual``: a linear layer with the work around it fused,
    for decoding, where a step is a chain of matrix-vector products.

    Args:
        x: Tensor of shape ``[..., K]`` (``[..., 2 * K]`` with ``prologue="swiglu"``).
        weight: ``[N, K]``, as ``nn.Linear.weight``; x's dtype and device.
        bias: optional ``[N]``.
        residual: optional, shaped like the result, ``[..., N]``: added after the product.
        prologue: ``"none"``; ``"rms_norm"``, ``rms_norm(x, norm_weight, eps)``; or ``"swiglu"``,
            ``swiglu(x)`` (gate then up along x's last dim). The prologue is rounded to x's
            dtype as those ops round it.
        norm_weight: the RMSNorm weight of ``prologue="rms_norm"`` (optional; float32 is read as
            it is with half-type x).
        constant_weight: ``weight`` is not written by any kernel still running ahead of this op
            on the stream (a model's parameter). On CUDA (sm_90) the kernel then starts reading
            it while those kernels finish (programmatic dependent launch), which is what keeps a
            decode step's chain of products streaming; otherwise (the default) it waits for them
            first, so a weight computed just before is read as written.
        weight_scale: ``weight`` is quantized, and the product reads it dequantized,
            accumulating in float32 (float64 for float64 x): float8_e4m3fn ``[N, K]`` with a
            float32 scale ``[N]`` (:func:`quantize_fp8`), or int4 packed two a byte, uint8 ``[N,
            K / 2]`` with a scale ``[N, K / group]`` (:func:`quantize_int4`). Such a weight is
            frozen: a gradient for it (or its scale) raises; x, bias, residual and norm_weight
            still differentiate.

    Returns:
        A new tensor ``[..., N]``. On CUDA, up to 4 rows whose prologue fits in shared memory run
        as one kernel that reads each weight element once; other inputs run the prologue op, the
        GEMM and the add. On CPU a float32 product of 1-4 rows is split over torch's threads by
        output features. Differentiable (taken apart into ATen ops when a gradient is needed), twice
        too. A quantized weight is read as stored by the decoding kernels (CPU: up to 8 rows; CUDA:
        docs/quantization.md says which kernel takes which rows); more rows multiply blocks of it
        dequantized (bfloat16 x on the CPU: in bfloat16, the product rounded before the bias).
    """
    return _callable(_overloads.fused_linear)(x, weight, bias, residual, prologue=prologue, norm_weight=norm_weight,
                                              eps=eps, constant_weight=constant_weight, weight_scale=weight_scale)


def quantize_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A linear layer's weight as float8 E4M3 with a float32 scale per output feature, for
    :func:`fused_linear`'s ``weight_scale``.

    Args:
        weight: ``[N, K]`` float32, float64, float16 or bfloat16 (quantized from float32), finite.

    Returns:
        ``(q, scale)``: q float8_e4m3fn ``[N, K]`` and scale float32 ``[N]``, each row's largest
        magnitude over 448 (E4M3's largest finite; 1 for a row of zeros), q the row over its
        scale rounded to nearest. ``q.float() * scale[:, None]`` is within half an E4M3 step of
        each element: a relative 2^-4, or ``scale * 2^-10`` for the smallest (E4M3's
        subnormals). Not differentiable.
    """
    return tuple(_callable(_overloads.quantize_fp8)(weight))


def quantize_int4(weight: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor]:
    """A linear layer's weight as symmetric int4 in groups of ``group_size`` consecutive inputs,
    for :func:`fused_linear`'s ``weight_scale``.

    Args:
        weight: ``[N, K]`` float32, float64, float16 or bfloat16, finite; K a multiple of group_size.
        group_size: An even number (128, as GPTQ and AWQ checkpoints use).

    Returns:
        ``(packed, scale)``: packed uint8 ``[N, K / 2]``, element ``2j`` of a row in byte ``j``'s
        low nibble and ``2j + 1`` in its high one, each ``q + 8`` for q in [-8, 7]; scale ``[N,
        K / group_size]`` in weight's dtype: of the group's largest magnitude over 7 times 1,
        0.95, ..., 0.7, each rounded to weight's dtype (never to 0), the one leaving the least
        squared error (1 for zeros). ``(nibble - 8) *
        scale`` is within half a step (``scale / 2``) of each element but the clipped largest
        ones (within ``amax - 7 * scale``). Not differentiable.
    """
    return tuple(_callable(_overloads.quantize_int4)(weight, group_size))


def scale_clamp(x: Tensor, scale: float, lo: float, hi: float) -> Tensor:
    """``clamp(x * scale, lo, hi)`` in one pass.

    Args:
        x: Tensor of any shape and strides; float32, float64, float16 or bfloat16.
        scale: Multiplier (a compile-time constant to torch.compile).
        lo: Lower bound; must be <= hi.
        hi: Upper bound.

    Returns:
        A new contiguous tensor shaped like ``x``. Its gradient is ``grad * scale`` where
        ``lo < x * scale < hi`` and 0 elsewhere; double backward works.
    """
    return _callable(_overloads.scale_clamp)(x, scale, lo, hi)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of queries and keys in one launch: ``x * cos + rotate(x) * sin``.

    Args:
        q: ``[B, Hq, S, D]``; float32, float64, float16 or bfloat16. Any strides (a view of a fused
            qkv projection is read in place when its last dim is contiguous).
        k: ``[B, Hkv, S, D]`` with q's B, S, D and dtype (Hkv may differ: grouped-query attention).
        cos, sin: ``[S, R]`` or ``[B or 1, S, R]`` of q's dtype, as Hugging Face's rotary modules
            produce them; R <= D and even. Only the first R dims of each head rotate (partial
            rotary); the rest pass through.
        interleaved: False (default) rotates pairs ``(i, i + R/2)`` (rotate-half, Llama/Mistral/Qwen);
            True rotates pairs ``(2i, 2i + 1)`` (GPT-J).

    Returns:
        ``(q_rotated, k_rotated)``, new tensors shaped like q and k and dense in their memory order
        (``[B, S, H, D]`` order for Hugging Face's transposed views), computed in float32 (float64
        for float64). Differentiable in q and k, to any order (the op is linear in them); cos and
        sin are not differentiable (they come from positions; passing ones that require grad
        raises).
    """
    return tuple(_callable(_overloads.rope)(q, k, cos, sin, interleaved))


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention ``softmax(q @ k.T * scale) @ v`` that can return its
    log-sum-exp.

    Args:
        q: ``[B, Hq, Sq, D]``; float32, float64, float16 or bfloat16, the layout of
            ``F.scaled_dot_product_attention``. Any strides with a contiguous last dim
            (``[B, S, H, D]`` tensors passed as ``.transpose(1, 2)`` views are read in place).
        k, v: ``[B, Hkv, Sk, D]`` with q's B, D, dtype and device; Hq a multiple of Hkv
            (grouped-query attention: each kv head serves Hq / Hkv query heads, never repeated).
        causal: Hide key j from query i when ``j > i + Sk - Sq`` (aligned to the bottom right:
            ``is_causal`` of SDPA when Sq == Sk, and what decoding with a cache needs).
        scale: Defaults to ``1 / sqrt(D)``.
        return_lse: Also return ``lse``, the rows' log-sum-exp ``logsumexp(q @ k.T * scale, -1)``
            (natural log; ``[B, Hq, Sq]``, float32, float64 for float64).

    Returns:
        ``out`` (``[B, Hq, Sq, D]`` of q's dtype, in q's memory order), or ``(out, lse)``. A row
        that sees no key gives out 0 and lse -inf, never NaN. Differentiable in q, k and v
        through out and lse (the backward reuses lse; ``d lse_i / d s_ij = p_ij``); double
        backward raises. :func:`merge_attention` combines attentions over disjoint key sets.
    """
    out, lse = _callable(_overloads.attention)(q, k, v, causal, scale)
    return (out, lse) if return_lse else out


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention over the union of two disjoint key sets, from the attention over each.

    ``lse = logaddexp(lse_a, lse_b)`` and ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``:
    exact, so attending to keys in parts (ring or context-parallel attention, split-KV decoding,
    a cached prefix plus new tokens) and merging gives the attention over all of them.

    Args:
        out_a, out_b: ``[..., D]`` of one shape, dtype and device (as :func:`attention` returns).
        lse_a, lse_b: ``out_a.shape[:-1]``, the log-sum-exps :func:`attention` returns with
            ``return_lse=True``.

    Returns:
        ``(out, lse)`` in out_a's and lse_a's dtypes; rows empty on both sides (lse -inf) give out
        0 and lse -inf. Differentiable, to any order.
    """
    out, lse = _callable(_overloads.merge_attention)(out_a, lse_a, out_b, lse_b)
    return out, lse


def cache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, *,
                    scale: float | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of a few new queries a sequence against a static KV cache, reading each
    sequence's filled length only (decoding and prefill of a causal LM).

    Args:
        q: ``[B, Hq, T, D]``, the T new queries of each sequence (float32, float64, float16 or
            bfloat16; any strides with a contiguous last dim).
        k_cache, v_cache: ``[Bc, Hkv, S, D]`` with ``Bc >= B`` (sequence b reads row b, unless
            ``slots`` says otherwise), q's dtype, device and D; Hq a multiple of Hkv
            (grouped-query attention).
        lengths: int64 ``[B]`` on q's device: sequence b's keys are cache positions
            ``[0, lengths[b])``, its new tokens included (``T <= lengths[b] <= S``); its queries
            are the last T of them, causal.
        scale: Defaults to ``1 / sqrt(D)``.
        slots: int64 ``[B]`` on q's device: sequence b reads row ``slots[b]`` of the caches (a
            continuous-batching engine runs the sequences of some slots alone). Default: row b.

    Returns:
        ``(out, lse)`` as :func:`attention` with ``return_lse=True``. Inference only: inputs that
        require grad raise under grad mode. On CUDA (float16/bfloat16, D of 64, 128 or 256,
        ``T <= 512``, or up to ``CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES``) a split-KV kernel reads
        ``lengths`` and ``slots`` on the device, so a CUDA graph can capture it; there a length or
        slot out of range gives NaN rows, elsewhere an error.
    """
    out, lse = _callable(_overloads.cache_attention)(q, k_cache, v_cache, lengths, scale, slots)
    return out, lse


def cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, start: Tensor, *,
                slots: Tensor | None = None) -> None:
    """Writes new keys and values into a static KV cache in place.

    Args:
        k_cache, v_cache: ``[Bc, Hkv, S, D]`` of one dtype and device, written in place.
        k, v: ``[B, Hkv, T, D]`` (``B <= Bc``) of the caches' dtype and device: sequence b's new
            keys and values, which go to its positions ``[start[b], start[b] + T)``.
        start: int64 ``[B]`` on the caches' device.
        slots: int64 ``[B]``, distinct: sequence b writes row ``slots[b]`` of the caches.
            Default: row b (then ``B <= Bc``).

    Returns:
        None: the caches hold the new rows. The mutation is declared in the op's schema, so
        torch.export and AOTInductor keep the caches updated in place. A position or slot
        outside the cache (or a repeated slot) raises, except on CUDA, where ``start`` and
        ``slots`` are read on the device and rows outside the cache are not written. Inference
        only: inputs that require grad raise under grad mode.
    """
    _callable(_overloads.cache_write)(k_cache, v_cache, k, v, start, slots)


def rope_cache_write(k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                     start: Tensor, *, slots: Tensor | None = None) -> Tensor:
    """:func:`rope` of q and k, then :func:`cache_write` of the rotated k and v: a decode step's
    work between the qkv projection and attention, one kernel on CUDA.

    Args:
        k_cache, v_cache: ``[Bc, Hkv, S, D]``, written in place as by :func:`cache_write`.
        q: ``[B, Hq, T, D]``; k, v: ``[B, Hkv, T, D]`` (views of a fused qkv projection stay in
            place), the caches' dtype and device.
        cos, sin: ``[T, R]`` or ``[B, T, R]`` as :func:`rope` takes them (rotate-half pairs; the
            first R dims rotate).
        start: int64 ``[B]``: sequence b's new keys and values go to positions
            ``[start[b], start[b] + T)``.
        slots: int64 ``[B]``, distinct: sequence b writes row ``slots[b]`` of the caches, as
            :func:`cache_write`.

    Returns:
        The rotated q, as :func:`rope` returns it (dense in q's memory order). On CUDA, float32,
        float16 and bfloat16 inputs that rotate every dim, in 16-byte aligned rows, run as one
        kernel that reads ``start`` on the device (a CUDA graph can capture it; rows outside the
        cache are not written); others run the two ops (a position outside the cache raises on
        CPU). Inference only: inputs that require grad raise under grad mode.
    """
    return _callable(_overloads.rope_cache_write)(k_cache, v_cache, q, k, v, cos, sin, start, slots)


def _reduce(loss: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":  # over the rows that count, as F.cross_entropy (NaN when none does)
        return loss.sum() / (target != ignore_index).sum()
    raise ValueError(f"customops.cross_entropy: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean", return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of logits against class indices, with the log-sum-exp it computes on the way.

    Args:
        logits: ``[..., V]``, classes in the LAST dim (unlike ``F.cross_entropy``'s ``[N, C, ...]``);
            float32, float64, float16 or bfloat16 (computed in float32, float64 for float64).
            Rows of any stride are read in place when the last dim is contiguous.
        target: int64 tensor of shape ``logits.shape[:-1]``: a class in ``[0, V)`` or ``ignore_index``.
            Out of range: on CPU an error; on CUDA (which cannot check without a device sync) that
            row's loss is NaN, so the reduced loss is NaN rather than silently wrong.
        ignore_index: Rows with this target contribute 0 and are not counted by "mean".
        label_smoothing: In [0, 1], as in ``F.cross_entropy``.
        reduction: "mean" (over non-ignored rows), "sum" or "none", as in ``F.cross_entropy``.
        return_lse: Also return ``lse = logsumexp(logits, -1)`` (float32, shaped like target),
            which is differentiable: a z-loss ``lse ** 2`` costs no second pass over the logits.

    Returns:
        The loss (float32; per row for reduction "none"), or ``(loss, lse)``. The backward reuses
        lse and reads the logits once; double backward raises.
    """
    loss, lse = _callable(_overloads.cross_entropy)(logits, target, ignore_index, label_smoothing)
    loss = _reduce(loss, target, ignore_index, reduction)
    return (loss, lse) if return_lse else loss


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         tile_rows: int | None = None, tile_classes: int | None = None) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without ever building the logits.

    The language-model head and its loss in one op, in tiles of 1024 rows x as many classes as
    keep a tile within hidden's own size (N x H elements, at least 4M): the extra memory is at
    most hidden's, never the [N, V] logits or their float32 copy. When a tile holds the whole
    vocabulary the op takes three matmuls, as a plain linear + cross-entropy; otherwise four (each
    tile's logits twice: once for the rows' log-sum-exp, once into their gradient). The matmuls
    run on ATen (cuBLAS on CUDA), the softmax and its gradient on customops kernels.
    ``tile_rows`` and ``tile_classes`` override the tile: at N 8192, H 2048, V 128256 on an H100
    (bf16, forward and backward), the default takes 32.5 ms and 566 MiB above the inputs,
    ``tile_classes=V`` (three matmuls) 22.3 ms and 785 MiB (Liger-Kernel: 34.5 ms, 597 MiB).
    :func:`customops.optimize` takes whole-vocabulary tiles: 1024 x V logits are little beside a
    training step's activations.

    Args:
        hidden: ``[..., H]`` (flattened to rows); float32, float64, float16 or bfloat16.
        weight: ``[V, H]``, hidden's dtype and device (an ``nn.Linear(H, V)``'s weight).
        target: int64 of shape ``hidden.shape[:-1]``; a class in ``[0, V)`` or ``ignore_index``.
        bias: Optional ``[V]``.
        ignore_index, label_smoothing: As in :func:`cross_entropy`.
        reduction: "mean" (over non-ignored rows) or "sum".
        tile_rows, tile_classes: The tile's rows (default 1024) and classes (default: as many as
            keep the tile within hidden's size); positive.

    Returns:
        The scalar loss (float32; float64 for float64 inputs). Differentiable in hidden, weight and
        bias: when a gradient is needed, the forward computes the gradients for a unit loss
        gradient tile by tile (as Liger-Kernel does: the backward runs no matmul) and the
        backward scales them. Double backward raises.
    """
    # rows flattened (flatten, not reshape(-1, H): H may be 0); a 0-dim hidden goes to the op as it
    # is, which names it in its error
    h = hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0) if hidden.dim() == 1 else hidden
    t = target.reshape(-1)
    return _callable(_overloads.linear_cross_entropy)(h, weight, t, bias, ignore_index, label_smoothing, reduction,
                                             tile_rows, tile_classes)
