"""DTensor handlers of the loss ops: cross_entropy over a sharded vocabulary (its log-sum-exp
reduced across ranks, which a placement rule cannot say), and on the CPU a target outside the
vocabulary turned into NaN rows for cross_entropy and linear_cross_entropy (the CPU ops raise on
the ranks holding the row only, and the others would wait in the next collective). Placements
the handlers do not take go through the rules of :mod:`.sharding`. Importing this module
registers them (once: Python imports a module once)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate

_ops = torch.ops.customops
R = Replicate()


# ---- cross_entropy over a sharded vocabulary ----------------------------------------------------
#
# Logits sharded on the class dim (the LM head's output under column parallelism, as loss parallel
# keeps it) need the log-sum-exp reduced across ranks, which a placement rule cannot say: these
# handlers compute it. Each rank runs the op on its shard (its log-sum-exp, read once); two
# all-reduces of one value a row (a max, then sums) give the whole row's log-sum-exp, the target's
# logit from the rank that holds it and, with label smoothing, the row's logit sum. The backward
# runs the backward op on each shard with the whole row's log-sum-exp: the softmax of a shard is
# exp(x - lse) there. A rank may hold no class (DTensor splits unevenly: 9 classes on 4 ranks are
# 3, 3, 3 and 0): its log-sum-exp is -inf, and it joins the same all-reduces. Other placements go
# the way of the rules above.
#
# A target outside [0, V) gives its row a NaN loss and gradient on every device, as the CUDA
# kernels do: the CPU op's error would come only from the ranks that hold the row (the others then
# wait in the next collective until the timeout), and an error on every rank would cost an
# all-reduce and a host sync per call, which torch.compile cannot trace either.

_SENTINEL = -1  # the local target of a row whose target another rank holds: never a class index


def _vocab_mesh_dim(logits, target):
    """The mesh dim that shards logits on its class dim when the handler applies: exactly one,
    every other one Shard on a row dim or Replicate, target a DTensor on the same mesh. Else None."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor) or not isinstance(target, DTensor) or target.device_mesh != logits.device_mesh:
        return None
    c = logits.ndim - 1
    dims = [i for i, p in enumerate(logits.placements) if p.is_shard(c)]
    if len(dims) != 1 or not all(p.is_replicate() or p.is_shard() for p in logits.placements):
        return None
    return dims[0]


def _outside(t, ignore_index, vocab):
    """which targets count and lie outside the vocabulary"""
    return (t != ignore_index) & ((t < 0) | (t >= vocab))


def _vocab_local(logits, target, mesh_dim, ignore_index):
    """(local logits x, local targets t with rows placed as logits', t in this rank's classes,
    which rows count (t != ignore_index), which of those have their target here, which lie outside
    the vocabulary, the whole vocabulary)."""
    rows = list(logits.placements)
    rows[mesh_dim] = R
    vocab = logits.shape[-1]
    # The first class of this rank's shard, as torch.chunk (DTensor's Shard) cuts them, from the
    # rank's coordinate: compute_local_shape_and_global_offset reads it off an index tensor, a
    # data-dependent int that torch.compile cannot trace.
    chunk = -(-vocab // logits.device_mesh.size(mesh_dim))
    offset = torch.sym_min(vocab, chunk * logits.device_mesh.get_local_rank(mesh_dim))
    x, t = logits._local_tensor, _local_as(target, rows)
    local = t - offset
    valid = t != ignore_index
    mine = valid & (local >= 0) & (local < x.shape[-1])
    return x, t, local, valid, mine, _outside(t, ignore_index, vocab), vocab


def _local_as(t, placements):
    """t's local tensor as it would be with `placements` (redistributed without DTensor's autograd
    function, which must not run inside its dispatch: on torch 2.11 it detaches in place)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    if tuple(t.placements) == tuple(placements):
        return t._local_tensor
    spec = DTensorSpec(t.device_mesh, tuple(placements), tensor_meta=t._spec.tensor_meta)
    return redistribute_local_tensor(t._local_tensor, t._spec, spec)


def _without_handler(op, args, kwargs):
    """op through DTensor's placement rules (its handler lifted for the call)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _by_rules(op, args, kwargs):
    """op (cross_entropy or its backward) through the rules, a target outside the vocabulary giving
    NaN rows in its first output on the CPU too (the op raises there, on the ranks holding the row
    only; the CUDA one gives NaN)."""
    from torch.distributed.tensor import DTensor

    args = _args(op, args, kwargs)
    names = [a.name for a in op._schema.arguments]
    logits, target, ignore_index = (args[names.index(n)] for n in ("logits", "target", "ignore_index"))
    if logits.device.type != "cpu" or not isinstance(target, DTensor):
        return _without_handler(op, tuple(args), {})
    vocab, t = logits.shape[-1], target._local_tensor
    args[names.index("target")] = _wrap(torch.where(_outside(t, ignore_index, vocab), ignore_index, t),
                                        target.device_mesh, target.placements, target.shape)
    out = _without_handler(op, tuple(args), {})
    first = out[0] if isinstance(out, tuple) else out
    bad = _outside(_local_as(target, first.placements), ignore_index, vocab)  # placed as first's rows
    bad = bad.reshape(bad.shape + (1,) * (first.ndim - bad.ndim))
    first = _wrap(torch.where(bad, torch.nan, first._local_tensor), first.device_mesh, first.placements, first.shape)
    return (first, *out[1:]) if isinstance(out, tuple) else first


def _wrap(t, mesh, placements, shape):
    """a local result as a DTensor, from inside DTensor's dispatch (as its own handlers do: no
    DTensor.from_local, an autograd function, there)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), t.dtype)
    return DTensor._op_dispatcher.wrap(t, DTensorSpec(mesh, tuple(placements), tensor_meta=meta))


def _wrap_rows(t, logits, mesh_dim):
    """a per-row result as a DTensor: logits' row placements, Replicate on the vocabulary's dim."""
    placements = list(logits.placements)
    placements[mesh_dim] = R
    return _wrap(t, logits.device_mesh, placements, logits.shape[:-1])


def _cross_entropy_vocab_parallel(op, args, kwargs):
    from torch.distributed import _functional_collectives as funcol

    logits, target, ignore_index, label_smoothing = _args(op, args, kwargs)
    mesh_dim = _vocab_mesh_dim(logits, target)
    if mesh_dim is None:
        return _by_rules(op, args, kwargs)
    group = (logits.device_mesh, mesh_dim)
    x, t, local, valid, mine, outside, vocab = _vocab_local(logits, target, mesh_dim, ignore_index)
    if x.shape[-1]:
        _, lse_r = op(x, torch.where(mine, local, _SENTINEL), _SENTINEL, 0.0)
        picked = x.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1).to(lse_r.dtype)
    else:  # no class here (the op takes none): the log-sum-exp of nothing
        lse_r = torch.full(t.shape, -math.inf, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                           device=x.device)
        picked = torch.zeros_like(lse_r)
    top = funcol.all_reduce(lse_r, "max", group)
    top = torch.where(torch.isfinite(top), top, 0.0)
    parts = [torch.exp(lse_r - top), torch.where(mine, picked, 0.0)]
    if label_smoothing:
        parts.append(x.sum(-1, dtype=lse_r.dtype))
    sums = funcol.all_reduce(torch.stack(parts), "sum", group)
    lse = top + torch.log(sums[0])
    loss = lse - (1 - label_smoothing) * sums[1]
    if label_smoothing:
        loss = loss - label_smoothing * sums[2] / vocab
    loss = torch.where(valid, torch.where(outside, torch.nan, loss), 0.0)
    return _wrap_rows(loss, logits, mesh_dim), _wrap_rows(lse, logits, mesh_dim)


def _cross_entropy_backward_vocab_parallel(op, args, kwargs):
    grad_loss, grad_lse, logits, target, lse, ignore_index, label_smoothing = _args(op, args, kwargs)
    mesh_dim = _vocab_mesh_dim(logits, target)
    if mesh_dim is None:
        return _by_rules(op, args, kwargs)
    x, t, local, valid, mine, outside, vocab = _vocab_local(logits, target, mesh_dim, ignore_index)
    rows = list(logits.placements)
    rows[mesh_dim] = R

    def local_rows(g):
        return None if g is None else _local_as(g, rows)

    grad_loss, grad_lse, lse = local_rows(grad_loss), local_rows(grad_lse), local_rows(lse)
    if not x.shape[-1]:  # no class here (the op takes none), and every collective above joined
        return _wrap(torch.empty_like(x), logits.device_mesh, logits.placements, logits.shape)
    # The op gives a row whose target it holds (g_loss + g_lse) p - g_loss ((1 - e) onehot + e / V_local),
    # and an ignored row g_lse p. A row whose target another rank holds needs (g_loss + g_lse) p -
    # g_loss e / V: its g_loss goes in with g_lse; the e / V terms are set right after.
    if grad_loss is not None:
        g_loss = torch.where(valid, grad_loss, 0.0)
        elsewhere = torch.where(valid & ~mine, g_loss, 0.0)
        grad_lse = elsewhere if grad_lse is None else grad_lse + elsewhere
        grad_loss = torch.where(mine, g_loss, 0.0)
    grad = op(grad_loss, grad_lse, x, torch.where(mine, local, _SENTINEL), lse, _SENTINEL, label_smoothing)
    if label_smoothing and grad_loss is not None:
        fix = label_smoothing * (grad_loss / x.shape[-1] - g_loss / vocab)
        grad = grad + fix.unsqueeze(-1).to(grad.dtype)
    grad = torch.where(outside.unsqueeze(-1), torch.nan, grad)
    return _wrap(grad, logits.device_mesh, logits.placements, logits.shape)


def _args(op, args, kwargs):
    """op's arguments in schema order, defaults filled in."""
    out = list(args)
    for a in op._schema.arguments[len(args):]:
        out.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return out


def _linear_cross_entropy_by_rules(op, args, kwargs):
    """linear_cross_entropy (or _linear_cross_entropy_with_grads) through the rules, a target outside
    the vocabulary giving a NaN loss and NaN gradients on the CPU too, as the CUDA kernels do: its
    row's hidden becomes NaN and its target a class, so that the row's loss and gradients are NaN
    (and with them the sum, the mean and the weight's and bias's gradients) on every rank. (The CPU
    op raises, on the ranks that hold the row only: rows sharded for a "sum", the others then
    waited in the loss's reduction until the process group's timeout.)"""
    from torch.distributed.tensor import DTensor

    args = _args(op, args, kwargs)
    names = [a.name for a in op._schema.arguments]
    hidden, weight, target, ignore_index = (args[names.index(n)] for n in ("hidden", "weight", "target", "ignore_index"))
    if hidden.device.type == "cpu" and isinstance(hidden, DTensor) and isinstance(target, DTensor):
        vocab, t = weight.shape[0], target._local_tensor
        args[names.index("target")] = _wrap(t.masked_fill(_outside(t, ignore_index, vocab), 0), target.device_mesh,
                                            target.placements, target.shape)
        # (target placed as hidden's rows: hidden's Shard placements but on its last dim, which target lacks)
        rows = [p if p.is_shard() and not p.is_shard(hidden.ndim - 1) else R for p in hidden.placements]
        bad = _outside(_local_as(target, rows), ignore_index, vocab).unsqueeze(-1)
        args[names.index("hidden")] = _wrap(hidden._local_tensor.masked_fill(bad, math.nan), hidden.device_mesh,
                                            hidden.placements, hidden.shape)
    return _without_handler(op, tuple(args), {})


def _register_handlers():
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._custom_op_handlers.update({
        _ops.cross_entropy.default: _cross_entropy_vocab_parallel,
        _ops._cross_entropy_backward.default: _cross_entropy_backward_vocab_parallel,
        _ops.linear_cross_entropy.default: _linear_cross_entropy_by_rules,
        _ops._linear_cross_entropy_with_grads.default: _linear_cross_entropy_by_rules,
    })


_register_handlers()
