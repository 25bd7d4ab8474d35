"""Every kernel of one decode step of customops-run generate, with its GPU time (ncu).

    python3 .ci/profile-decode.py MODEL[,MODEL...] [--batch B] [--layers L] [--weights bf16|fp8|int4]
                                  [--base-clocks] [--temperature T [--top-k K] [--top-p P]]
                                  [--detail REGEX [--detail-count N]]

MODEL: a name of bench/model.py's MODELS (llama-3.2-1b, llama-3-8b, qwen2.5-1.5b, qwen3-1.7b,
mistral-7b), built with random weights in bfloat16 and packaged (package_causal_lm, 8 slots of 256
tokens; --weights: the decoder layers' linear weights as package_causal_lm's weights=). The runner generates 8 ids without its CUDA graph under ncu, which times each kernel
alone (gpu__time_duration); the last decode step is found as the period of the kernel names. By
default at the GPU's own clocks and without ncu's cache flush (a decode step's weights are cold in
L2 anyway); --base-clocks takes ncu's defaults (clocks locked to base, L2 flushed). The step's
kernels summed against its time in the graph (bench --generate) say how much is launch and ramp.
Writes each model's raw CSV to $OUT (or /tmp) as ncu-MODEL-WEIGHTS.csv. A package is kept in /tmp and
reused by the next run on the same machine (delete /tmp/profile-*.pt2 after rebuilding customops).
With --temperature the rows sample (seed 0), and the step's kernels include the sampler's.

--detail REGEX profiles the first N (4) kernels of the last decode step whose base names (no
template arguments: gemv_mma_kernel) match REGEX once more with `ncu --set full` (clocks locked to
base, as ncu does) and prints what bounds each: duration, DRAM throughput, instructions issued a
cycle, occupancy, registers, and the warp stall reasons in cycles an issued instruction
(ncu-MODEL-WEIGHTS-detail.ncu-rep in $OUT, whole). (2026-11-30 on an H200, by hand: int4's 1-row
kernel issued 0.43 instructions a cycle a scheduler; ncu's summary page did not say why.)
"""
import argparse
import collections
import csv
import io
import os
import re
import subprocess
import types

import torch

import customops
from customops.bench.generate import _model
from customops.export import package_causal_lm


def kernels(cmd, base_clocks):
    flags = [] if base_clocks else ["--clock-control", "none", "--cache-control", "none"]
    r = subprocess.run(["ncu", "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base", *flags, *cmd],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"ncu failed ({r.returncode}): {r.stderr[-2000:]}")
    text = r.stdout[r.stdout.find('"ID"'):]
    rows = [row for row in csv.DictReader(io.StringIO(text)) if row.get("Metric Name") == "gpu__time_duration.sum"]
    names = [re.sub(r"\(.*", "", row["Kernel Name"]).replace("void ", "").replace("customops::<unnamed>::", "")
             for row in rows]
    return r.stdout, names, [float(row["Metric Value"].replace(",", "")) / 1e3 for row in rows]  # us


def detail(cmd, names, period, regex, count, rep):
    """ncu --set full on the first count kernels of the last decode step matching regex."""
    matches = [i for i, n in enumerate(names) if re.search(regex, n)]
    first = len(names) - period
    targets = [i for i in matches if i >= first][:count]
    if not targets:
        print(f"--detail: no kernel of the decode step matches {regex!r}")
        return
    skip = matches.index(targets[0])
    r = subprocess.run(["ncu", "--set", "full", "--import-source", "no", "-k", f"regex:{regex}", "--launch-skip",
                        str(skip), "--launch-count", str(len(targets)), "-o", rep, "-f", *cmd],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        print(f"--detail: ncu failed ({r.returncode}): {r.stderr[-2000:]}")
        return
    r = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "raw", "--csv", "--print-units", "base"],
                       capture_output=True, text=True, timeout=300)
    table = list(csv.reader(io.StringIO(r.stdout[r.stdout.find('"ID"'):])))
    if len(table) < 3:
        print(f"--detail: no metrics read back: {r.stderr[-500:]}")
        return
    head, rows = table[0], table[2:]  # (the second row holds the units)
    col = {h: k for k, h in enumerate(head)}
    stalled = re.compile(r"^smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio$")
    wanted = [("us", "gpu__time_duration.sum", 1e-3), ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
              ("IPC a SM", "sm__inst_executed.avg.per_cycle_active", 1),
              ("warps a scheduler", "smsp__warps_active.avg.per_cycle_active", 1),
              ("eligible", "smsp__warps_eligible.avg.per_cycle_active", 1),
              ("registers", "launch__registers_per_thread", 1), ("grid", "launch__grid_size", 1),
              ("instructions", "smsp__inst_executed.sum", 1)]
    for row in rows:
        name = re.sub(r"\(.*", "", row[col["Kernel Name"]]).replace("void ", "")
        def value(metric):
            try:
                return float(row[col[metric]].replace(",", ""))
            except (KeyError, ValueError):
                return float("nan")
        print(f"--- {name[:100]}")
        print("    " + ", ".join(f"{label} {value(m) * scale:,.2f}" for label, m, scale in wanted))
        stalls = sorted(((value(h), m.group(1)) for h in head if (m := stalled.match(h))), reverse=True)
        print("    stalls (cycles an issued instruction): " +
              ", ".join(f"{why} {v:.2f}" for v, why in stalls if v >= 0.05))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--weights", choices=("bf16", "fp8", "int4"), default="bf16")
    p.add_argument("--base-clocks", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--detail", metavar="REGEX", help="ncu --set full on the decode step's kernels matching REGEX")
    p.add_argument("--detail-count", type=int, default=4)
    args = p.parse_args()
    if not 1 <= args.batch <= 8:
        p.error("--batch takes 1 to 8 (the package's slots)")
    out = os.environ.get("OUT", "/tmp")
    for name in args.models.split(","):
        model = _model(types.SimpleNamespace(device="cuda", layers=args.layers), name)
        path = f"/tmp/profile-{name}-{args.layers}-{args.weights}.pt2"
        if not os.path.exists(path):
            package_causal_lm(model, path, max_batch=8, max_seq_len=256, weights=args.weights)
        del model
        torch.cuda.empty_cache()
        cmd = [customops.runner_path(), "generate", path, "--max-new-tokens", "8", "--ignore-eos", "--no-cuda-graph"]
        if args.temperature > 0:
            cmd += ["--temperature", str(args.temperature), "--top-k", str(args.top_k), "--top-p", str(args.top_p),
                    "--seed", "0"]
        for b in range(args.batch):
            cmd += ["--prompt", " ".join(str(10 + i + b) for i in range(64))]
        raw, names, us = kernels(cmd, args.base_clocks)
        with open(f"{out}/ncu-{name}-{args.weights}.csv", "w") as f:
            f.write(raw)
        period = next((n for n in range(8, len(names) // 2 + 1) if names[-n:] == names[-2 * n:-n]), None)
        if period is None:
            raise SystemExit(f"{name}: no repeating decode step among {len(names)} kernels")
        step = list(zip(names[-period:], us[-period:]))
        sampled = f", temperature {args.temperature} top-k {args.top_k} top-p {args.top_p}" if args.temperature > 0 else ""
        print(f"=== {name} ({args.weights}), batch {args.batch}, {args.layers} layers{sampled}: one decode step is "
              f"{period} kernels, "
              f"{sum(t for _, t in step):.1f} us summed")
        total = collections.defaultdict(lambda: [0, 0.0])
        for n, t in step:
            total[n][0] += 1
            total[n][1] += t
        for n, (count, t) in sorted(total.items(), key=lambda kv: -kv[1][1]):
            print(f"{t:9.1f} us {count:4d}x {t / count:8.2f} us each  {n[:100]}")
        print("in order:")
        for n, t in step:
            print(f"  {t:8.1f}  {n[:100]}")
        if args.detail:
            detail(cmd, names, period, args.detail, args.detail_count, f"{out}/ncu-{name}-{args.weights}-detail")


if __name__ == "__main__":
    main()
