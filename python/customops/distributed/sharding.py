"""DTensor sharding rules of customops' ops and their backward ops.

Each rule lists, for one mesh dimension, the placements an op accepts and what its outputs then
are (``torch.distributed.tensor.experimental.register_sharding``); DTensor expands them over every
mesh dimension and redistributes inputs that match none (at worst to Replicate), so a placement
without a rule costs communication, never a wrong result. A placement list is the outputs' then
the arguments', None where an argument is not a tensor (or is None).

- Pointwise ops (muladd and muladd.out, mul, silu, silu_mul, swiglu, scale_clamp, their backward ops) shard on
  any dim (swiglu not on its last, whose halves are gate and up) and take ``Partial`` where they are
  linear in it: mul in either input, silu_mul in up, every backward op in its incoming gradient.
- rms_norm and add_rms_norm shard on any dim but the normalized (last) one with the weight
  replicated; their backward gives the weight's gradient ``Partial`` (a sum over rows, finished by
  DTensor's reduction when it is redistributed).
- fused_linear shards on rows (x and residual; the weights replicated) and on the output
  features (column-parallel: the weight and bias sharded on their first dim, x replicated).
- rope shards on batch, heads or sequence; cos and sin follow the sequence (and the batch when
  they have one).
- cross_entropy shards on rows, and on the classes (vocabulary-parallel, as loss parallel: the
  handlers of :mod:`.loss_handlers` reduce the log-sum-exp across ranks; loss and lse come back
  replicated there).
- attention shards on batch and on heads, the latter only where every mesh dimension divides the
  key/value heads (so each query head's key/value head is on its rank).

- linear_cross_entropy shards on rows with a "sum" loss (Partial, as the weight's gradient); a
  "mean" is replicated. A vocabulary-sharded weight has no rule yet (DTensor gathers it).
- cache_attention, cache_write and rope_cache_write shard on batch (where the caches hold exactly
  the batch's rows) and on heads (cache_attention only where the mesh divides the key/value heads,
  as attention). The writes keep the caches where they are (see _in_place).

merge_attention is composite (its pointwise ATen ops have DTensor's own rules).

Importing this module registers the rules and (importing :mod:`.loss_handlers`) the handlers, once:
Python imports a module once.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from . import loss_handlers  # noqa: F401  (importing it registers the loss ops' DTensor handlers)

_ops = torch.ops.customops
R, P = Replicate(), Partial()

def _spec_or_none(x, placement):
    """placement for a tensor argument, None for an absent one."""
    return None if x is None else placement


def _in_place(op):
    """register_sharding for an op that writes arguments in place (``Tensor(a!)``). DTensor runs the
    op on the local tensors it passes, so a written argument must keep its placement (a
    redistributed copy would take the write): only the rule's strategies that leave every written
    argument as it is stay, and where none does the error names them (DTensor's own is "min() arg
    is an empty sequence"). A written keyword argument (out=) also joins the key of DTensor's cache
    of sharding decisions, which register_sharding makes of the positional tensors only: a second
    muladd.out with out placed otherwise took the first call's decision, and wrote out as if it
    were placed so."""
    written = {a.name: a.kwarg_only for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    def register(rule):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import OpStrategy

        register_sharding(op)(rule)
        prop = DTensor._op_dispatcher.sharding_propagator
        strategies = prop.op_strategy_funcs[op]
        info = prop.op_to_schema_info[op]
        info.static_kwargkey = (info.static_kwargkey or []) + [n for n, kwarg in written.items() if kwarg]

        def keep_in_place(op_schema):
            names = [a.name for a in op._schema.arguments[:len(op_schema.args_schema)]] + list(op_schema.kwargs_schema)
            values = [*op_schema.args_schema, *op_schema.kwargs_schema.values()]
            tensors = [(n, v.strategies[0].output_spec.placements) for n, v in zip(names, values)
                       if isinstance(v, OpStrategy)]  # in the order of OpSpec.input_specs
            held = [(i, n, p) for i, (n, p) in enumerate(tensors) if n in written]
            out = strategies(op_schema)
            out.strategies = [s for s in out.strategies if all(s.input_specs[i].placements == p for i, _, p in held)]
            if not out.strategies:
                which, placed = " and ".join(n for _, n, _ in held), " and ".join(str(tuple(p)) for _, _, p in held)
                raise ValueError(f"{op} writes {which} in place, placed {placed}, and none of its sharding rules "
                                 f"(customops.distributed.sharding) takes that placement with the others "
                                 f"redistributed to match: redistribute {which} first")
            return out

        prop.op_strategy_funcs[op] = keep_in_place
        return rule

    return register


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


@_in_place(_ops.muladd.out)
def _muladd_out(a, b, c, out=None):
    # the result is out, in out's placement: any Shard or Replicate (a and b follow it), never Partial
    return [(outs, ins + [outs[0]]) for outs, ins in _pointwise(1, [a, b], extra=1)]


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


@register_sharding(_ops.fused_linear.default)
def _fused_linear(x, weight, bias=None, residual=None, prologue="none", norm_weight=None, eps=1e-6,
                  constant_weight=False, weight_scale=None):
    # Rows: x and residual sharded alike, the weights replicated. Column-parallel: each rank's
    # output features from its rows of the weight (and bias), x replicated (the prologue reads
    # whole rows of x). Without a gradient only: with one the op is taken apart into ATen ops
    # before DTensor sees it.
    def args(xp, wp, rp):
        # (a quantized weight's scale, one an output feature, is placed as the bias)
        return [xp, wp, _spec_or_none(bias, R if wp == R else Shard(0)), _spec_or_none(residual, rp), None,
                _spec_or_none(norm_weight, R), None, None, _spec_or_none(weight_scale, R if wp == R else Shard(0))]

    last = x.ndim - 1
    out = [([R], args(R, R, R)), ([Shard(last)], args(R, Shard(0), Shard(last)))]
    for d in range(last):
        out.append(([Shard(d)], args(Shard(d), R, Shard(d))))
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


# ---- linear_cross_entropy ----------------------------------------------------------------------
#
# Rows (hidden's and target's) sharded with the weight and bias replicated: a "sum" loss and the
# weight's and bias's gradients are sums over rows, Partial; hidden's gradient stays sharded. A
# "mean" divides by the count of rows that count on every rank, which a shard does not know: it
# has the replicated strategy only (DTensor gathers the rows). On the CPU a handler turns a target
# outside the vocabulary into NaN first (loss_handlers._linear_cross_entropy_by_rules).

def _lce_strategies(hidden, bias, reduction, n_extra: int, with_grads: bool):
    """linear_cross_entropy's (or with the gradients, _linear_cross_entropy_with_grads's) strategies."""
    none = [None] * n_extra
    b = _spec_or_none(bias, R)
    out = [([R] * (4 if with_grads else 1), [R, R, R, b] + none)]
    if reduction == "sum":
        for d in range(hidden.ndim - 1):
            out.append(([P, Shard(d), P, P] if with_grads else [P], [Shard(d), R, Shard(d), b] + none))
    return out


@register_sharding(_ops.linear_cross_entropy.default)
def _linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                          tile_rows=None, tile_classes=None):
    return _lce_strategies(hidden, bias, reduction, 5, with_grads=False)


@register_sharding(_ops._linear_cross_entropy_with_grads.default)
def _linear_cross_entropy_with_grads(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows,
                                     tile_classes, output_mask):
    return _lce_strategies(hidden, bias, reduction, 6, with_grads=True)


@register_sharding(_ops._linear_cross_entropy_backward.default)
def _linear_cross_entropy_backward(grad_loss, grad_hidden, grad_weight, grad_bias):
    # each gradient times the loss's (a scalar): linear in each
    out = [([R] * 3, [R] * 4)]
    for d in range(grad_hidden.ndim - 1):
        out.append(([Shard(d), P, P], [R, Shard(d), P, P]))
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


# ---- static KV cache ---------------------------------------------------------------------------
#
# Batch: sequence b on the rank that holds cache row b, so only where the caches hold exactly the
# batch's rows (B == Bc: the chunks of B and of Bc then line up); a cache with more rows than the
# batch is redistributed by DTensor for cache_attention, and refused by the writes (see _in_place).
# Heads: cache_attention where the mesh divides the key/value heads, as attention; the writes on
# any heads (k and v have the caches' heads; rope rotates each of q's heads alone).

def _batch_aligned(x, cache) -> bool:
    return x.shape[0] == cache.shape[0]


@register_sharding(_ops.cache_attention.default)
def _cache_attention(q, k_cache, v_cache, lengths, scale=None):
    out = [([R, R], [R, R, R, R, None])]
    if _batch_aligned(q, k_cache):
        out.append(([Shard(0)] * 2, [Shard(0)] * 4 + [None]))
    if _heads_divide(k_cache):
        out.append(([Shard(1)] * 2, [Shard(1)] * 3 + [R, None]))
    return out


@_in_place(_ops.cache_write.default)
def _cache_write(k_cache, v_cache, k, v, start):
    out = [([], [R] * 5), ([], [Shard(1)] * 4 + [R])]
    if _batch_aligned(k, k_cache):
        out.append(([], [Shard(0)] * 5))
    return out


@_in_place(_ops.rope_cache_write.default)
def _rope_cache_write(k_cache, v_cache, q, k, v, cos, sin, start):
    out = [([R], [R] * 8), ([Shard(1)], [Shard(1)] * 5 + [R] * 3)]
    if _batch_aligned(k, k_cache):
        cs = Shard(0) if cos.ndim == 3 and cos.shape[0] != 1 else R  # cos and sin [T, R] or [B, T, R]
        out.append(([Shard(0)], [Shard(0)] * 5 + [cs, cs, Shard(0)]))
    return out
