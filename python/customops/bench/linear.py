"""``python -m customops bench --linear``: a decoder layer's products with quantized weights,
:func:`customops.fused_linear` reading a bfloat16, float8 (``quantize_fp8``) or int4
(``quantize_int4``, groups of 128) weight, side by side in one run.

The products are a decoder layer's at a model's shapes (``--shape``: Llama-3-8B by default; the
norm, SwiGLU and residual add fused as a package's layers call them, ``constant_weight``), for a
few rows (decoding: the matrix-vector kernels, the quantized ones streaming 1 or 0.5 bytes a
weight) and many (prefill: bfloat16 through cuBLAS, float8 through the FP8 tensor cores, int4
dequantized for cuBLAS). Each call is timed two ways, as ``bench --decode`` times them:
alone (CUDA events after a 256 MiB write that evicts L2, the median of ``--iters``; the write's
dirty lines drain while the call reads, a cost of some microseconds to every format), and back to
back in a CUDA graph, as a decode step runs its layers' products (one call on each of enough
copies of the weight to overflow L2, the graph replayed; the better of two replays). The floor of
a call is its weight's bytes (with their scales) at the device-to-device copy speed measured in the
same run; "vs bf16" is the bfloat16 weight's time over the format's at the same rows, in the graph.
``--variant VAR=VALUE[,VAR=VALUE]`` (repeatable) times every format again with those environment
variables set around its calls (the kernels' switches, e.g. ``CUSTOMOPS_LINEAR_BLOCKS_PER_SM=1``),
in the same run, against the same bf16 baseline.
"""

from __future__ import annotations

import argparse

import torch

import customops

from .common import pick_device, versions, write_json
from .attention import _in_environment, parse_variant, variant_label
from .decode import _copy_speed, _graph_us, _time_us

# (name, out_features, in_features, prologue, residual) of a decoder layer's products
SHAPES = {
    "llama-3-8b": (("qkv", 6144, 4096, "rms_norm", False), ("o_proj", 4096, 4096, "none", True),
                   ("gate_up", 28672, 4096, "rms_norm", False), ("down", 4096, 14336, "swiglu", True)),
    "llama-3.2-1b": (("qkv", 3072, 2048, "rms_norm", False), ("o_proj", 2048, 2048, "none", True),
                     ("gate_up", 16384, 2048, "rms_norm", False), ("down", 2048, 8192, "swiglu", True)),
}
FORMATS = ("bf16", "fp8", "int4")


def _weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == "fp8":
        return customops.quantize_fp8(w)
    if fmt == "int4":
        return customops.quantize_int4(w, 128)
    return w, None


def run(args) -> dict:
    torch.manual_seed(0)
    speed = _copy_speed()
    flush = torch.empty(2**26, dtype=torch.float32, device="cuda")
    formats = args.weights.split(",")
    rows = []
    for name, n, k, prologue, with_residual in SHAPES[args.shape]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5 if prologue == "rms_norm" else None
        weights = {f: _weight(w, f) for f in formats}
        # copies of each format's weight (the first is itself) that together overflow L2, for the graph
        copies = {}
        for f, (q, sc) in weights.items():
            nbytes = q.numel() * q.element_size()
            copies[f] = [(q, sc)] + [(q.clone(), None if sc is None else sc.clone())
                                     for _ in range(min(15, max(1, -(-(256 << 20) // nbytes) - 1)))]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if with_residual else None
            ref = None
            for f, (q, s), env in [(f, qs, env) for f, qs in weights.items() for env in [{}, *args.variant]]:
                def plain(i=0, q=q, s=s, f=f):
                    qi, si = copies[f][i] if i else (q, s)
                    return customops.fused_linear(x, qi, None, r, prologue=prologue, norm_weight=nw,
                                                  constant_weight=True, weight_scale=si)

                def call(i=0, plain=plain, env=env):  # (the variant's variables set around the launch)
                    return _in_environment(env, lambda: plain(i))() if env else plain(i)

                variant = variant_label(env)

                y = call().float()
                ref = y if ref is None else ref  # (the first format's: bf16 by default)
                nbytes = q.numel() * q.element_size() + (s.numel() * s.element_size() if s is not None else 0)
                us = _time_us(call, args.iters, flush)
                graph_us = _graph_us({f: call}, len(copies[f]))[f]
                rows.append({"product": name, "rows": m, "format": f, "variant": variant, "out_features": n,
                             "in_features": k, "weight_mb": nbytes / 2**20, "us": us, "graph_us": graph_us,
                             "floor_us": nbytes / speed * 1e6, "rel_err": ((y - ref).norm() / ref.norm()).item()})
                if not args.no_progress:
                    share = rows[-1]["floor_us"] / graph_us
                    print(f"... {name} rows {m} {f}{' ' + variant if variant else ''}: {us:.1f} us alone, "
                          f"{graph_us:.1f} in a graph ({share:.0%} of copy speed)", flush=True)
        del w, weights, copies
    base = {(r["product"], r["rows"]): r["graph_us"] for r in rows if r["format"] == formats[0] and not r["variant"]}
    for r in rows:
        r[f"vs_{formats[0]}"] = base[(r["product"], r["rows"])] / r["graph_us"]
    meta = {"device": torch.cuda.get_device_name(), "versions": versions("cuda"), "shape": args.shape,
            "copy_gb_s": speed / 1e9, "formats": formats,
            "variants": [variant_label(env) for env in args.variant]}
    return {"meta": meta, "rows": rows}


def print_report(report: dict) -> None:
    m = report["meta"]
    first = m["formats"][0]
    print(f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    print(f"a decoder layer's products at {m['shape']} shapes, bfloat16 activations; copy speed {m['copy_gb_s']:.0f} GB/s")
    print(f"{'product':>8s} {'rows':>5s} {'weight':>6s} {'MiB':>8s} {'us alone':>9s} {'us graph':>9s} {'x floor':>8s} "
          f"{'vs ' + first:>8s} {'rel err':>8s}")
    for r in report["rows"]:
        print(f"{r['product']:>8s} {r['rows']:5d} {r['format']:>6s} {r['weight_mb']:8.1f} {r['us']:9.1f} "
              f"{r['graph_us']:9.1f} {r['graph_us'] / r['floor_us']:7.2f}x {r['vs_' + first]:7.2f}x {r['rel_err']:8.1e}"
              + (f"  [{r['variant']}]" if r.get("variant") else ""))
    print(f"us alone: one call after an L2 flush; us graph: a call of many back to back in a CUDA graph (a decode "
          f"step's way), which x floor and vs {first} compare; rel err: against the {first} weight's output")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--linear", action="store_true", required=True)
    p.add_argument("--device", choices=["cuda"])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--weights", default=",".join(FORMATS), help="comma-separated: bf16, fp8, int4 (the first is "
                   "the baseline)")
    p.add_argument("--rows", default="1,4,8,16,512,4096", help="comma-separated rows (tokens) a call")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="time every format again with these environment variables set (repeatable)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if pick_device(p, args.device or "cuda") != "cuda":
        p.error("--linear times CUDA kernels")
    bad = [f for f in args.weights.split(",") if f not in FORMATS]
    if bad:
        p.error(f"--weights takes {', '.join(FORMATS)}, not {', '.join(bad)}")
    report = run(args)
    print_report(report)
    write_json(args.json, report)
    return 0
