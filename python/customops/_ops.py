"""Typed Python wrappers of the customops operators (``torch.ops.customops.*``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.compiler import is_compiling

_ops = torch.ops.customops

# Outside torch.compile and torch.export the wrappers call the C++ callable that
# OpOverload.__call__ forwards to (``overload._op``): the same dispatcher call, about 0.3 us less
# per call on tiny tensors. Dynamo cannot trace that builtin, so while compiling they call the
# OpOverload itself.
_muladd, _muladd_out, _mul = _ops.muladd.default, _ops.muladd.out, _ops.mul.default
_rms_norm, _silu, _silu_mul, _swiglu, _scale_clamp = (
    _ops.rms_norm.default, _ops.silu.default, _ops.silu_mul.default, _ops.swiglu.default, _ops.scale_clamp.default)
_muladd_c, _mul_c, _rms_norm_c, _silu_c, _silu_mul_c, _swiglu_c, _scale_clamp_c = (
    o._op for o in (_muladd, _mul, _rms_norm, _silu, _silu_mul, _swiglu, _scale_clamp))


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
        return _muladd(a, b, c) if is_compiling() else _muladd_c(a, b, c)
    return _muladd_out(a, b, c, out=out)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a * b`` of two tensors of one shape, dtype and device.

    Args:
        a: Tensor of any shape and strides; float32, float64, float16 or bfloat16.
        b: Tensor with the shape, dtype and device of ``a``.

    Returns:
        A new contiguous tensor shaped like ``a``.
    """
    return _mul(a, b) if is_compiling() else _mul_c(a, b)


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
    return (_rms_norm(x, weight, eps) if is_compiling() else _rms_norm_c(x, weight, eps))[0]


def silu(x: Tensor) -> Tensor:
    """SiLU (swish): ``x * sigmoid(x)``, elementwise.

    Args:
        x: Tensor of any shape and strides; float32, float64, float16 or bfloat16.

    Returns:
        A new contiguous tensor shaped like ``x``; half types are computed in float32.
        Differentiable; double backward raises.
    """
    return _silu(x) if is_compiling() else _silu_c(x)


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
    return _silu_mul(gate, up) if is_compiling() else _silu_mul_c(gate, up)


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
    return _swiglu(x) if is_compiling() else _swiglu_c(x)


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
    return _scale_clamp(x, scale, lo, hi) if is_compiling() else _scale_clamp_c(x, scale, lo, hi)
