"""Ring attention: attention over a sequence sharded across a process group.

Each rank holds a shard of q, k and v on the sequence. The key/value shards travel around the ring
(rank r sends to r + 1 and receives from r - 1) while each rank attends its queries to the shard it
holds, so after ``world`` steps every query has seen every key; the partial results are combined
with :func:`customops.merge_attention` (exact: it is the log-sum-exp merge), the next shard's
transfer overlapping the current shard's attention. The backward is a ring too: the key/value
shards travel again with their gradients' running sums, which arrive back at their owners after a
full turn, and ``customops._attention_backward`` with the final ``out`` and ``lse`` gives each
block's share of every gradient.

Causal attention balances the load: the sequence is cut in ``2 * world`` chunks and rank r holds
chunks r and ``2 * world - 1 - r`` (a head and a tail chunk), so each rank has the same number of
visible keys. Every step after the first is then half a block of work: a shard from a lower rank
is seen whole by its head chunk and not at all by its tail chunk (keys of the first half only), one
from a higher rank only by the tail chunk (queries of the second half only).
:func:`shard_sequence` and :func:`gather_sequence` make and undo that layout.

Before the first transfer the ranks all-gather a few integers (shapes, dtypes and arguments) and,
where they differ, every rank raises the same error: a ring of unequal shards would transfer
buffers of different sizes (one rank aborts in the transfer, another reads an unfilled buffer) or
compute different attentions without an error.

This is a composite of customops ops and ``torch.distributed`` point-to-point calls, not an op:
its autograd is a ``torch.autograd.Function`` (eager; under ``torch.compile`` it breaks the graph).
"""

from __future__ import annotations

import struct
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from .._ops import attention, merge_attention

__all__ = ["ring_attention", "shard_sequence", "gather_sequence"]

_ops = torch.ops.customops
_KV, _GRAD = 0, 1  # message tags: a key/value shard, a running sum of its gradients


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _chunks(world: int, rank: int, causal: bool) -> list[int]:
    """Which of the sequence's chunks a rank holds: with causal, chunks r and 2w - 1 - r of 2w;
    otherwise chunk r of w."""
    return [rank, 2 * world - 1 - rank] if causal else [rank]


def shard_sequence(x: Tensor, *, causal: bool = False, group=None, seq_dim: int = 2) -> Tensor:
    """This rank's shard of a whole sequence ``x`` (the same on every rank) for
    :func:`ring_attention`: chunk r of ``world`` equal chunks, or with ``causal`` chunks r and
    ``2 * world - 1 - r`` of ``2 * world`` (load balancing). The length must divide evenly."""
    rank, world = _world(group)
    n = 2 * world if causal else world
    if x.shape[seq_dim] % n:
        raise ValueError(f"customops.shard_sequence: the sequence ({x.shape[seq_dim]} on dim {seq_dim}) must divide "
                         f"into {n} equal chunks ({'2 x ' if causal else ''}{world} ranks)")
    parts = x.chunk(n, seq_dim)
    return torch.cat([parts[i] for i in _chunks(world, rank, causal)], seq_dim)


def gather_sequence(x: Tensor, *, causal: bool = False, group=None, seq_dim: int = 2) -> Tensor:
    """The whole sequence from every rank's shard (the inverse of :func:`shard_sequence`), on every
    rank. Not differentiable."""
    rank, world = _world(group)
    if world == 1:
        # nothing to gather. (A collective just before exit also risks torch's gloo race: its
        # worker thread frees the work's tensors, which needs the GIL, after Python began to
        # finalize, and the process aborts with "terminate called without an active exception".)
        shards = [x]
    else:
        shards = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(shards, x.contiguous(), group=group)
    n = 2 * world if causal else world
    parts: list = [None] * n
    for r, shard in enumerate(shards):
        for i, part in zip(_chunks(world, r, causal), shard.chunk(len(_chunks(world, r, causal)), seq_dim)):
            parts[i] = part
    return torch.cat(parts, seq_dim)


class _Ring:
    """Point-to-point exchanges with the ring's neighbours: each call sends one tensor to the next
    rank and receives one of the same shape from the previous, started together (NCCL needs them
    batched) and waited for later."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = _world(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.next, self.prev = ranks[(self.rank + 1) % self.world], ranks[(self.rank - 1) % self.world]

    def start(self, send: Tensor, tag: int):
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending) -> Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


class _Offline:
    """The ring's computation for one rank of a ring of `world` without the transfers (each step
    gets the rank's own shard back): the benchmark's measure of the compute to hide."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def start(self, send: Tensor, tag: int):
        return send

    @staticmethod
    def wait(pending) -> Tensor:
        return pending


def _block(i: int, rank: int, world: int, causal: bool, s: int):
    """What step i attends: (query rows, key rows, causal) as slices of the local sequence (s rows)
    and of the shard held (from rank (rank - i) % world), or None for the whole."""
    if not causal:
        return slice(None), slice(None), False
    if i == 0:  # its own shard: head then tail chunk, in order, so plainly causal
        return slice(None), slice(None), True
    half = s // 2
    if (rank - i) % world < rank:  # a lower rank's head chunk is before both of ours, its tail after both
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # a higher rank's: after our head, before our tail


def _seq(x: Tensor, rows: slice) -> Tensor:
    return x[:, :, rows]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring):
        rank, world = ring.rank, ring.world
        s = q.shape[2]
        kv = torch.stack([k, v])
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # the running out, merged in
        out = lse = None
        for i in range(world):
            pending = ring.start(kv, _KV) if i + 1 < world else None
            rows, keys, blk_causal = _block(i, rank, world, causal, s)
            o, l = attention(_seq(q, rows), _seq(kv[0], keys), _seq(kv[1], keys), causal=blk_causal, scale=scale,
                             return_lse=True)
            if out is None:  # the first step attends every row
                out, lse = (o, l) if world == 1 else (o.to(acc), l)
            else:
                o_acc, l_acc = merge_attention(_seq(out, rows), _seq(lse, rows), o.to(acc), l)
                _seq(out, rows).copy_(o_acc)
                _seq(lse, rows).copy_(l_acc)
            if pending is not None:
                kv = ring.wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.ring = causal, scale, ring
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        rank, world = ring.rank, ring.world
        s = q.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # the running sum for the shard held
        grad_pending = None
        for i in range(world):
            pending = ring.start(kv, _KV) if i + 1 < world else None
            rows, keys, blk_causal = _block(i, rank, world, causal=ctx.causal, s=s)
            d_q, d_k, d_v = _ops._attention_backward(
                None if grad_out is None else _seq(grad_out, rows).contiguous(),
                None if grad_lse is None else _seq(grad_lse, rows).contiguous(),
                _seq(q, rows), _seq(kv[0], keys), _seq(kv[1], keys), _seq(out, rows).contiguous(),
                _seq(lse, rows).contiguous(), blk_causal, ctx.scale)
            _seq(dq, rows).add_(d_q)
            if grad_pending is not None:  # the sum the previous holders of this shard made
                dkv = ring.wait(grad_pending)
            _seq(dkv[0], keys).add_(d_k)
            _seq(dkv[1], keys).add_(d_v)
            if world > 1:  # to the next holder; after the last step, to the owner
                grad_pending = ring.start(dkv, _GRAD)
            if pending is not None:
                kv = ring.wait(pending)
        if grad_pending is not None:
            dkv = ring.wait(grad_pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # attention's; any other is len(_DTYPES)


def _is_dtensor(t) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor here (nor the second it takes)
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _agree(q, k, v, causal, scale, seq_dim, group) -> None:
    """Raises the same ValueError on every rank of group where the ranks called with different
    shapes, dtypes or arguments (one all-gather of a few integers); after it, a check that depends
    on these alone raises on every rank or on none. One rank has no one to disagree with."""
    if dist.get_world_size(group) == 1:
        return

    def shape(t):
        return [t.dim(), *t.shape[:4]] + [0] * (4 - min(t.dim(), 4))

    def dtype(t):
        return _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)

    def show_shape(n):
        return n[1:1 + min(n[0], 4)] + (["..."] if n[0] > 4 else [])

    def show_dtype(n):
        return _DTYPES[n[0]] if n[0] < len(_DTYPES) else "a dtype attention does not take"

    def show_scale(n):
        return struct.unpack("<d", struct.pack("<q", n[1]))[0] if n[0] else None

    fields = [(f"{name}'s shape", shape(t), show_shape) for name, t in zip("qkv", (q, k, v))]
    fields += [(f"{name}'s dtype", [dtype(t)], show_dtype) for name, t in zip("qkv", (q, k, v))]
    fields += [
        ("causal", [int(bool(causal))], lambda n: bool(n[0])),
        ("scale", [0, 0] if scale is None else [1, struct.unpack("<q", struct.pack("<d", float(scale)))[0]],
         show_scale),
        ("seq_dim", [int(seq_dim)], lambda n: n[0]),
        ("whether a gradient is needed (q, k or v requires grad, in grad mode)",
         [int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))], lambda n: bool(n[0])),
        ("whether q, k and v are DTensors", [sum(_is_dtensor(t) for t in (q, k, v))],
         lambda n: ("none", "one", "two", "all")[n[0]]),
    ]
    mine = torch.tensor([i for _, ints, _ in fields for i in ints], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every).tolist()
    at = 0
    for name, ints, show in fields:
        values = [row[at:at + len(ints)] for row in every]
        for r, value in enumerate(values):
            if value != values[0]:
                raise ValueError(f"customops.ring_attention: ranks disagree on {name}: rank 0 has "
                                 f"{show(values[0])}, rank {r} has {show(value)}")
        at += len(ints)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None, group=None,
                   seq_dim: int = 2) -> tuple[Tensor, Tensor]:
    """:func:`customops.attention` over a sequence sharded across ``group``'s ranks.

    Args:
        q: this rank's queries, ``[B, Hq, S_local, D]`` (``seq_dim=2``) or ``[B, S_local, Hq, D]``
            (``seq_dim=1``); the dtypes and devices :func:`customops.attention` takes.
        k, v: this rank's keys and values, ``[B, Hkv, S_local, D]`` likewise (grouped-query heads).
        causal: Causal over the whole sequence. The shards must then be in the load-balanced
            layout :func:`shard_sequence` makes (this rank holds chunks r and ``2 * world - 1 - r``
            of ``2 * world``), so ``S_local`` is even; without it, rank r holds chunk r.
        scale: Defaults to ``1 / sqrt(D)``.
        group: The process group (default: the whole world). Every rank calls with the same
            shapes, dtypes and arguments (checked: else every rank raises the same ValueError); the
            communication is point-to-point with the ring's neighbours.
        seq_dim: The sequence dim of q, k and v: 2 or 1.

    Returns:
        ``(out, lse)`` for this rank's queries, as :func:`customops.attention` with
        ``return_lse=True`` on the whole sequence gives them (``lse`` ``[B, Hq, S_local]``, or
        ``[B, S_local, Hq]`` with ``seq_dim=1``). Differentiable in q, k and v through both.
    """
    if not dist.is_initialized():
        raise RuntimeError("customops.ring_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    _agree(q, k, v, causal, scale, seq_dim, group)  # every check below then raises on every rank or on none
    if any(_is_dtensor(t) for t in (q, k, v)):
        # Not taken apart here: a DTensor sharded on the sequence holds contiguous chunks (rank r
        # the r-th), which its placement cannot tell from shard_sequence's causal layout (chunks r
        # and 2 * world - 1 - r), so its local tensors would give a wrong causal result without
        # an error. The caller knows which layout its shards hold.
        raise TypeError("customops.ring_attention takes each rank's shard as a plain tensor, not a DTensor: pass "
                        "DTensor.to_local() of shards in shard_sequence's layout (with causal, chunks r and "
                        "2 * world - 1 - r of 2 * world, not a Shard placement's chunk r)")
    if seq_dim not in (1, 2):
        raise ValueError(f"customops.ring_attention: seq_dim must be 2 ([B, H, S, D]) or 1 ([B, S, H, D]), not {seq_dim}")
    if seq_dim == 1:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if causal and q.shape[2] % 2:
        raise ValueError(f"customops.ring_attention: with causal, each rank holds a head and a tail chunk of equal "
                         f"length (shard_sequence's layout), so its sequence must be even, not {q.shape[2]}")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"customops.ring_attention: q, k and v must hold the same sequence shard, got lengths "
                         f"{q.shape[2]}, {k.shape[2]} and {v.shape[2]}")
    out, lse = _RingAttention.apply(q, k, v, causal, scale, _Ring(group))
    if seq_dim == 1:
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return out, lse
