"""Typed Python wrappers of the customops operators (``torch.ops.customops.*``)."""

from __future__ import annotations

import torch
from torch import Tensor

_ops = torch.ops.customops


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
        return _ops.muladd.default(a, b, c)
    return _ops.muladd.out(a, b, c, out=out)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a * b`` of two tensors of one shape, dtype and device.

    Args:
        a: Tensor of any shape and strides; float32, float64, float16 or bfloat16.
        b: Tensor with the shape, dtype and device of ``a``.

    Returns:
        A new contiguous tensor shaped like ``a``.
    """
    return _ops.mul.default(a, b)
