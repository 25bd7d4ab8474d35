"""DTensor sharding rules of customops' ops and their backward ops.

Each rule lists, for one mesh dimension, the placements an op accepts and what its outputs then
are (``torch.distributed.tensor.experimental.register_sharding``); DTensor expands them over every
mesh dimension and redistributes inputs that match none (at worst to Replicate), so a placement
without a rule costs communication, never a wrong result. A placement list is the outputs' then
the arguments', None where an argument is not a tensor (or is None).

- Pointwise ops (muladd, mul, silu, silu_mul, swiglu, scale_clamp, their backward ops) shard on
  any dim (swiglu not on its last, whose halves are gate and up) and take ``Partial`` where they are
  linear in it: mul in either input, silu_mul in up, every backward op in its incoming gradient.
- rms_norm and add_rms_norm shard on any dim but the normalized (last) one with the weight
  replicated; their backward gives the weight's gradient ``Partial`` (a sum over rows, finished by
  DTensor's reduction when it is redistributed).
- rope shards on batch, heads or sequence; cos and sin follow the sequence (and the batch when
  they have one).
- cross_entropy shards on rows.
- attention shards on batch and on heads, the latter only where every mesh dimension divides the
  key/value heads (so each query head's key/value head is on its rank).

merge_attention is composite (its pointwise ATen ops have DTensor's own rules).
linear_cross_entropy has no rule yet: DTensor raises its own error for it.

Importing this module registers the rules (once: Python imports a module once).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

_ops = torch.ops.customops
R, P = Replicate(), Partial()

def _spec_or_none(x, placement):
    """placement for a tensor argument, None for an absent one."""
    return None if x is None else placement


# ---- pointwise ---------------------------------------------------------------------------------

def _pointwise(n_out: int, tensors: list, extra: int = 0, shard_dims=None, linear: tuple = ()):
    """Strategies of an op with n_out outputs shaped like its len(tensors) same-shaped tensor
    inputs (then `extra` non-tensor arguments): all replicated; all sharded on each dim in
    shard_dims (default: every dim); and for each input position in `linear`, that input Partial,
    the others replicated, the outputs Partial."""
    ndim = tensors[0].ndim
    none = [None] * extra
    out = [([R] * n_out, [R] * len(tensors) + none)]
    for d in range(ndim) if shard_dims is None else shard_dims:
        out.append(([Shard(d)] * n_out, [Shard(d)] * len(tensors) + none))
    for i in linear:
        out.append(([P] * n_out, [P if j == i else R for j in range(len(tensors))] + none))
    return out


@register_sharding(_ops.muladd.default)
def _muladd(a, b, c):
    return _pointwise(1, [a, b], extra=1)


@register_sharding(_ops.mul.default)
def _mul(a, b):
    return _pointwise(1, [a, b], linear=(0, 1))


@register_sharding(_ops.silu.default)
def _silu(x):
    return _pointwise(1, [x])


@register_sharding(_ops._silu_backward.default)
def _silu_backward(grad_y, x):
    return _pointwise(1, [grad_y, x], linear=(0,))


@register_sharding(_ops.silu_mul.default)
def _silu_mul(gate, up):
    return _pointwise(1, [gate, up], linear=(1,))


@register_sharding(_ops._silu_mul_backward.default)
def _silu_mul_backward(grad_y, gate, up):
    return _pointwise(2, [grad_y, gate, up], linear=(0,))


@register_sharding(_ops.swiglu.default)
def _swiglu(x):
    return _pointwise(1, [x], shard_dims=range(x.ndim - 1))


@register_sharding(_ops._swiglu_backward.default)
def _swiglu_backward(grad_y, x):
    return _pointwise(1, [grad_y, x], shard_dims=range(x.ndim - 1), linear=(0,))


@register_sharding(_ops.scale_clamp.default)
def _scale_clamp(x, scale, lo, hi):
    return _pointwise(1, [x], extra=3)


@register_sharding(_ops._scale_clamp_backward.default)
def _scale_clamp_backward(grad_y, x, scale, lo, hi):
    return _pointwise(1, [grad_y, x], extra=3, linear=(0,))


# ---- norms -------------------------------------------------------------------------------------

@register_sharding(_ops.rms_norm.default)
def _rms_norm(x, weight, eps=1e-6):
    w = _spec_or_none(weight, R)
    out = [([R, R], [R, w, None])]
    for d in range(x.ndim - 1):
        out.append(([Shard(d), Shard(d)], [Shard(d), w, None]))
    return out


@register_sharding(_ops._rms_norm_backward.default)
def _rms_norm_backward(grad_y, x, weight, rstd, output_mask):
    # The weight's gradient sums over rows: Partial where the rows are sharded. (Its placement
    # does not depend on output_mask, which DTensor does not key its cache by.)
    w = _spec_or_none(weight, R)
    out = [([R, R], [R, R, w, R, None])]
    for d in range(x.ndim - 1):
        out.append(([Shard(d), P], [Shard(d), Shard(d), w, Shard(d), None]))
    return out


@register_sharding(_ops.add_rms_norm.default)
def _add_rms_norm(x, residual, weight, eps=1e-6):
    w = _spec_or_none(weight, R)
    out = [([R, R, R], [R, R, w, None])]
    for d in range(x.ndim - 1):
        out.append(([Shard(d)] * 3, [Shard(d), Shard(d), w, None]))
    return out


@register_sharding(_ops._add_rms_norm_backward.default)
def _add_rms_norm_backward(grad_y, grad_sum, sum_, weight, rstd, output_mask):
    w = _spec_or_none(weight, R)
    out = [([R, R], [R, _spec_or_none(grad_sum, R), R, w, R, None])]
    for d in range(sum_.ndim - 1):
        s = Shard(d)
        out.append(([s, P], [s, _spec_or_none(grad_sum, s), s, w, s, None]))
    return out


# ---- rope --------------------------------------------------------------------------------------

def _rope_strategies(cos, n_extra: int, linear: bool):
    """q and k (or their gradients) [B, H, S, D] with cos and sin [S, R] or [B, S, R]: sharded on
    batch, heads or sequence."""
    cos_batch = cos.ndim == 3 and cos.shape[0] != 1
    none = [None] * n_extra
    out = [([R, R], [R, R, R, R] + none)]
    out.append(([Shard(0)] * 2, [Shard(0)] * 2 + [Shard(0) if cos_batch else R] * 2 + none))
    out.append(([Shard(1)] * 2, [Shard(1)] * 2 + [R, R] + none))
    out.append(([Shard(2)] * 2, [Shard(2)] * 2 + [Shard(cos.ndim - 2)] * 2 + none))
    if linear:
        out.append(([P, P], [P, P, R, R] + none))
    return out


@register_sharding(_ops.rope.default)
def _rope(q, k, cos, sin, interleaved=False):
    return _rope_strategies(cos, 1, linear=False)


@register_sharding(_ops._rope_backward.default)
def _rope_backward(grad_q, grad_k, cos, sin, interleaved):
    return _rope_strategies(cos, 1, linear=True)


# ---- cross_entropy -----------------------------------------------------------------------------

@register_sharding(_ops.cross_entropy.default)
def _cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0):
    out = [([R, R], [R, R, None, None])]
    for d in range(logits.ndim - 1):
        out.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), None, None]))
    return out


@register_sharding(_ops._cross_entropy_backward.default)
def _cross_entropy_backward(grad_loss, grad_lse, logits, target, lse, ignore_index, label_smoothing):
    def rows(p):
        return [_spec_or_none(grad_loss, p), _spec_or_none(grad_lse, p), p, p, p, None, None]

    out = [([R], rows(R))]
    for d in range(logits.ndim - 1):
        out.append(([Shard(d)], rows(Shard(d))))
    return out


# ---- attention ---------------------------------------------------------------------------------

def _heads_divide(k) -> bool:
    """Whether sharding heads on every mesh dim keeps each query head's key/value head on its rank:
    the key/value heads divide evenly by the whole mesh."""
    return k.shape[1] % math.prod(k.mesh.shape) == 0


@register_sharding(_ops.attention.default)
def _attention(q, k, v, causal=False, scale=None):
    out = [([R, R], [R, R, R, None, None]), ([Shard(0)] * 2, [Shard(0)] * 3 + [None, None])]
    if _heads_divide(k):
        out.append(([Shard(1)] * 2, [Shard(1)] * 3 + [None, None]))
    return out


@register_sharding(_ops._attention_backward.default)
def _attention_backward(grad_out, grad_lse, q, k, v, out_, lse, causal, scale):
    def args(p):
        return [_spec_or_none(grad_out, p), _spec_or_none(grad_lse, p), p, p, p, p, p, None, None]

    out = [([R] * 3, args(R)), ([Shard(0)] * 3, args(Shard(0)))]
    if _heads_divide(k):
        out.append(([Shard(1)] * 3, args(Shard(1))))
    return out
