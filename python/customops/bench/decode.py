"""``python -m customops bench --decode``: decode attention against a KV cache,
:func:`customops.cache_attention` against ``F.scaled_dot_product_attention`` on the same cache.

One new query a sequence (Hq/Hkv 32/8, head dim 128, bfloat16 on CUDA) against caches of 1k to 32k
filled positions, batch 1 to 16. Decoding reads the cache once a step, so the measure is the
bandwidth of that read: the k and v bytes over the time, and its share of the copy speed measured
in the same run (bytes read and written a second by a large device copy). SDPA takes the cache
sliced to the filled length (equal lengths: it has no per-sequence ones) with ``enable_gqa``.

The second table is a decode step's matrix products at Llama-3.2-1B's shapes (hidden 2048,
intermediate 8192, vocabulary 128256), one token a sequence: :func:`customops.fused_linear` (the
norm, SwiGLU or residual add fused with the product; ``constant_weight``, as a model's parameters
are) against the unfused ops a layer would call
(customops' rms_norm or swiglu, ``F.linear``, the add), with the weight bytes' share of the copy
speed.

Each call is timed alone with CUDA events after a 256 MiB write that evicts the cache from L2 and
keeps the GPU busy while the call is queued, so the time is the kernels' and the bytes come from
memory; the median of ``--iters``. A decode step runs the attention calls of its layers back to
back in a CUDA graph, where a call's launch overlaps the one before: the "graph" columns time that
(one call on each of enough caches to overflow L2, captured in one graph and replayed; the better
of two replays a variant, customops and SDPA in turn).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import customops

from .common import pick_device, versions, write_json

BATCHES = (1, 4, 8, 16)
# (name, out_features, in_features, prologue, residual): a Llama-3.2-1B decode step's products.
PRODUCTS = (("qkv", 3072, 2048, "rms_norm", False), ("o_proj", 2048, 2048, "none", True),
            ("gate_up", 16384, 2048, "rms_norm", False), ("down", 2048, 8192, "swiglu", True),
            ("lm_head", 128256, 2048, "rms_norm", False))
PRODUCT_BATCHES = (1, 4, 8)
LENGTHS = (1024, 4096, 16384, 32768)


def _copy_speed() -> float:
    a = torch.ones(2**28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 * 20 / (start.elapsed_time(end) / 1e3)


def _time_us(fn, iters: int, flush: torch.Tensor) -> float:
    fn()
    ms = []
    for _ in range(iters):
        flush.fill_(1.0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms) * 1e3


def _graph_us(fns: dict, layers: int) -> dict:
    """Microseconds a call of each fn(i), i < layers, captured back to back in one CUDA graph."""
    graphs = {}
    for name, fn in fns.items():
        for i in range(layers):
            fn(i)
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for i in range(layers):
                fn(i)
    best = {}
    for _ in range(2):  # in turn, so that a drift of the clocks reaches both
        for name, g in graphs.items():
            g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            best[name] = min(best.get(name, float("inf")), start.elapsed_time(end) * 1e3 / (10 * layers))
    return best


def run(args) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    speed = _copy_speed()
    flush = torch.empty(2**26, dtype=torch.float32, device="cuda")
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for s in [int(x) for x in args.lengths.split(",")]:
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=dtype) for _ in range(2))
            lengths = torch.full((b,), s, device="cuda", dtype=torch.long)
            got, _ = customops.cache_attention(q, k, v, lengths)
            want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            err = (got.float() - want.float()).abs().max().item()
            fns = {"customops": lambda: customops.cache_attention(q, k, v, lengths),
                   "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
            kv_bytes = 2 * b * hkv * s * d * k.element_size()
            row = {"batch": b, "length": s, "kv_mb": kv_bytes / 2**20, "max_abs_err": err}
            for name, fn in fns.items():
                us = _time_us(fn, args.iters, flush)
                row[f"{name}_us"] = us
                row[f"{name}_gb_s"] = kv_bytes / (us / 1e6) / 1e9
            row["vs_sdpa"] = row["sdpa_us"] / row["customops_us"]
            row["bandwidth_share"] = row["customops_gb_s"] * 1e9 / speed
            # as in a decode step: a call a layer, each on its own cache, enough of them to overflow L2
            layers = max(4, min(64, int(3e8 // kv_bytes)))
            qs = [torch.randn_like(q) for _ in range(layers)]
            ks = [torch.randn_like(k) for _ in range(layers)]
            vs = [torch.randn_like(v) for _ in range(layers)]
            graph = _graph_us({"customops": lambda i: customops.cache_attention(qs[i], ks[i], vs[i], lengths),
                               "sdpa": lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True)},
                              layers)
            del qs, ks, vs
            row["customops_graph_us"], row["sdpa_graph_us"] = graph["customops"], graph["sdpa"]
            row["graph_bandwidth_share"] = kv_bytes / (graph["customops"] / 1e6) / speed
            row["graph_vs_sdpa"] = graph["sdpa"] / graph["customops"]
            rows.append(row)
            if not args.no_progress:
                print(f"... batch {b} length {s}: {row['customops_us']:.1f} us ({row['bandwidth_share']:.0%} of copy "
                      f"speed), SDPA {row['sdpa_us']:.1f} us; in a graph {graph['customops']:.1f} us, SDPA "
                      f"{graph['sdpa']:.1f} us", flush=True)
            del q, k, v
    meta = {"device": torch.cuda.get_device_name(), "versions": versions("cuda"), "heads": hq, "kv_heads": hkv,
            "head_dim": d, "dtype": str(dtype).removeprefix("torch."), "copy_gb_s": speed / 1e9}
    return {"meta": meta, "rows": rows, "products": _products(args, speed, flush)}


def _products(args, speed: float, flush: torch.Tensor) -> list[dict]:
    dtype = torch.bfloat16
    rows = []
    for name, n, k, prologue, with_residual in PRODUCTS:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        nw = torch.rand(k, device="cuda", dtype=dtype) + 0.5 if prologue == "rms_norm" else None
        for b in [int(x) for x in args.product_batches.split(",")]:
            x = torch.randn(b, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=dtype)
            r = torch.randn(b, n, device="cuda", dtype=dtype) if with_residual else None

            def fused():
                return customops.fused_linear(x, w, None, r, prologue=prologue, norm_weight=nw, constant_weight=True)

            def unfused():
                h = x
                if prologue == "rms_norm":
                    h = customops.rms_norm(x, nw)
                elif prologue == "swiglu":
                    h = customops.swiglu(x)
                y = F.linear(h, w)
                return y + r if r is not None else y

            err = (fused().float() - unfused().float()).abs().max().item()
            row = {"product": name, "batch": b, "out_features": n, "in_features": k, "prologue": prologue,
                   "residual": with_residual, "weight_mb": w.numel() * w.element_size() / 2**20, "max_abs_err": err}
            for label, fn in (("fused", fused), ("unfused", unfused)):
                row[f"{label}_us"] = _time_us(fn, args.iters, flush)
            row["speedup"] = row["unfused_us"] / row["fused_us"]
            row["bandwidth_share"] = w.numel() * w.element_size() / (row["fused_us"] / 1e6) / speed
            rows.append(row)
            if not args.no_progress:
                print(f"... {name} batch {b}: fused {row['fused_us']:.1f} us, unfused {row['unfused_us']:.1f} us",
                      flush=True)
        del w
    return rows


def print_report(report: dict) -> None:
    m = report["meta"]
    print(f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    print(f"decode attention: 1 query, Hq/Hkv {m['heads']}/{m['kv_heads']}, D {m['head_dim']}, {m['dtype']}; "
          f"copy speed {m['copy_gb_s']:.0f} GB/s")
    print(f"{'':>22s} {'a call alone':^48s} {'calls back to back in a CUDA graph':^38s}")
    print(f"{'batch':>5s} {'length':>7s} {'k+v MiB':>8s} {'customops us':>13s} {'GB/s':>6s} {'of copy':>8s} "
          f"{'SDPA us':>8s} {'vs SDPA':>8s} {'customops us':>13s} {'of copy':>8s} {'SDPA us':>8s} {'vs SDPA':>8s} "
          f"{'max err':>8s}")
    for r in report["rows"]:
        print(f"{r['batch']:5d} {r['length']:7d} {r['kv_mb']:8.1f} {r['customops_us']:13.1f} {r['customops_gb_s']:6.0f} "
              f"{r['bandwidth_share']:7.0%} {r['sdpa_us']:8.1f} {r['vs_sdpa']:7.2f}x {r['customops_graph_us']:13.1f} "
              f"{r['graph_bandwidth_share']:7.0%} {r['sdpa_graph_us']:8.1f} {r['graph_vs_sdpa']:7.2f}x "
              f"{r['max_abs_err']:8.1e}")
    if report.get("products"):
        print("\ndecode products (Llama-3.2-1B shapes, bfloat16): customops.fused_linear against the unfused ops")
        print(f"{'product':>8s} {'prologue':>9s} {'+res':>5s} {'batch':>5s} {'weight MiB':>10s} {'fused us':>9s} "
              f"{'of copy':>8s} {'unfused us':>11s} {'speedup':>8s} {'max err':>8s}")
        for r in report["products"]:
            print(f"{r['product']:>8s} {r['prologue']:>9s} {'yes' if r['residual'] else 'no':>5s} {r['batch']:5d} "
                  f"{r['weight_mb']:10.1f} {r['fused_us']:9.1f} {r['bandwidth_share']:7.0%} {r['unfused_us']:11.1f} "
                  f"{r['speedup']:7.2f}x {r['max_abs_err']:8.1e}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", action="store_true", required=True)
    p.add_argument("--device", choices=["cuda"])
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--product-batches", default=",".join(map(str, PRODUCT_BATCHES)))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if pick_device(p, args.device or "cuda") != "cuda":
        p.error("--decode times CUDA kernels")
    report = run(args)
    print_report(report)
    write_json(args.json, report)
    return 0
