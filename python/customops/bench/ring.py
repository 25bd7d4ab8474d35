"""``python -m customops bench --ring``: ring attention across GPUs against attention on one GPU.

Run under ``torchrun --nproc-per-node N`` (N GPUs, NCCL). Every rank first times
:func:`customops.attention` on the whole sequence alone, then :func:`ring_attention` on its shard
(causal in the load-balanced layout), forward and forward + backward, with CUDA events after a
barrier; rank 0 reports the medians. Two more timings say how much of the communication is hidden:
the ring's computation without its transfers (each step attends the rank's own shard again) and
the transfers alone; hidden = (compute + transfers - ring) / transfers.

In a single process (no torchrun) there is no ring: it reports, as an estimate only, the slowest
rank's computation of a 2-rank ring against one GPU, the speedup if every transfer were hidden.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import customops
from customops.distributed import ring

from .common import versions, write_json


def _time(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def _passes(attend, q, k, v):
    """(forward, forward + backward) closures of attend(q, k, v) -> (out, lse)."""
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        out, _ = attend(qs, ks, vs)
        out.backward(grad)

    return fwd, fwd_bwd


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --ring", description=__doc__.split("\n\n")[0])
    p.add_argument("--ring", action="store_true", required=True)
    p.add_argument("--seq", type=int, default=32768, help="tokens of the whole sequence (default: 32768)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--full", action="store_true", help="full attention (default: causal)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("customops bench --ring: needs CUDA")
    causal = not args.full
    torchrun = "RANK" in os.environ
    if torchrun:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = (dist.get_rank(), dist.get_world_size()) if torchrun else (0, 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in (shape, kv_shape, kv_shape))

    def whole(q, k, v):
        return customops.attention(q, k, v, causal=causal, return_lse=True)

    rows = {}
    fwd, fwd_bwd = _passes(whole, q, k, v)
    rows["one GPU, whole sequence"] = (_time(fwd, args.iters), _time(fwd_bwd, args.iters))
    if world > 1:
        shards = [ring.shard_sequence(t, causal=causal) for t in (q, k, v)]

        def ring_attend(q, k, v):
            return customops.distributed.ring_attention(q, k, v, causal=causal)

        fwd, fwd_bwd = _passes(ring_attend, *shards)
        rows[f"ring over {world} GPUs"] = (_time(fwd, args.iters), _time(fwd_bwd, args.iters))
        offline = ring._Offline(rank, world)

        def compute(q, k, v):
            return ring._RingAttention.apply(q, k, v, causal, None, offline)

        fwd, fwd_bwd = _passes(compute, *shards)
        rows["its computation alone"] = (_time(fwd, args.iters), _time(fwd_bwd, args.iters))
        exchange = ring._Ring(None)
        kv = torch.stack(shards[1:])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")

        def transfers(backward: bool):
            def run():
                for _ in range(world - 1):
                    exchange.wait(exchange.start(kv, ring._KV))
                for _ in range(world if backward else 0):
                    exchange.wait(exchange.start(dkv, ring._GRAD))
            return run

        rows["its transfers alone"] = (_time(transfers(False), args.iters), _time(transfers(True), args.iters))
    else:  # an estimate: the slower rank of a 2-rank ring, computing without transfers
        s = args.seq // 2
        est = []
        for r in range(2):
            shards = [t[:, :, :s] for t in (q, k, v)]
            offline = ring._Offline(r, 2)

            def compute(q, k, v, offline=offline):
                return ring._RingAttention.apply(q, k, v, causal, None, offline)

            fwd, fwd_bwd = _passes(compute, *shards)
            est.append((_time(fwd, args.iters), _time(fwd_bwd, args.iters)))
        rows["estimate: slowest rank of 2, computation only"] = tuple(max(e[i] for e in est) for i in range(2))
    if rank == 0:
        one = rows["one GPU, whole sequence"]
        print(f"{torch.cuda.get_device_name()}; {', '.join(f'{a} {b}' for a, b in versions('cuda').items())}")
        print(f"B={args.batch} Hq={args.heads} Hkv={args.kv_heads} S={args.seq} D={args.head_dim} bf16, "
              f"{'causal' if causal else 'full'}; CUDA events, median of {args.iters}")
        print(f"{'':48s} {'fwd ms':>9s} {'speedup':>8s} {'fwd+bwd ms':>11s} {'speedup':>8s}")
        for name, (f, fb) in rows.items():
            print(f"{name:48s} {f:9.2f} {one[0] / f:7.2f}x {fb:11.2f} {one[1] / fb:7.2f}x")
        if world > 1:
            (rf, rfb), (cf, cfb), (tf, tfb) = (rows[n] for n in list(rows)[1:4])
            print(f"communication hidden: forward {(cf + tf - rf) / tf:.0%}, forward + backward "
                  f"{(cfb + tfb - rfb) / tfb:.0%}")
        write_json(args.json, {"world": world, "args": vars(args), "rows": rows})
    if torchrun:
        dist.destroy_process_group()
    return 0
