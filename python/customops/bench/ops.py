"""``python -m customops bench``: customops against PyTorch eager, torch.compile and Liger-Kernel.

For each op of :data:`BENCHES` (the registry, :mod:`.op_table`) and a few realistic shapes,
forward and forward+backward: median time, effective bandwidth from the minimum bytes the op must
move, that bandwidth as a share of a device-to-device copy timed in the same run, and customops'
speed-up over each alternative. Then the per-call overhead on tiny tensors against the closest
single ATen op. Output: a table, and on request JSON, a PNG bar chart and the device's section of
docs/benchmarks.md (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import statistics
import time
from typing import Callable

import torch
import torch._dynamo

from .. import _cli
from . import timers
from .common import DTYPES, cpu_name, pick_device, update_doc, versions, write_json
from .op_table import (ALTERNATIVES, BENCHES, BENCHES_BY_NAME, IMPL_LABEL, IMPLS, OVERHEAD_MAX, PASSES, Bench,
                       Shape)
from .report import markdown, plot, print_report

_OPS = torch.ops.customops
# Allocator settings that change what a fresh output costs; recorded with the results when set.
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")


# ---- one comparison ---------------------------------------------------------------------------------


def _grad_leaves(args: tuple, no_grad: tuple[int, ...] = ()) -> tuple:
    return tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and i not in no_grad else a for i, a in enumerate(args))


def _grads_like(ref) -> torch.Tensor | tuple:
    # A scalar loss gets 1, as loss.backward() gives it: Liger-Kernel's cross entropies skip a pass
    # over their saved gradient then (any other value costs them a read and write of [N, V]).
    if isinstance(ref, (tuple, list)):
        return tuple(_grads_like(r) for r in ref)
    return torch.ones_like(ref) if ref.dim() == 0 else torch.randn_like(ref)


def _peak_mib(fn: Callable, device: str) -> float | None:
    """Peak memory one call allocates above what was allocated before it (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _forward_backward(fn: Callable, args: tuple, grad_out) -> Callable[[], object]:
    # autograd.grad returns the gradients instead of accumulating into .grad: no extra add.
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return lambda: torch.autograd.grad(fn(*args), leaves, grad_out)


class _Copy:
    """The roofline: dst.copy_(src), timed within every comparison (on CPU interleaved with the
    ops), so that each row's share of copy bandwidth comes from the same minutes as its time."""

    def __init__(self, device: str, nbytes: int):
        self.src = torch.randn(nbytes // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.bytes = 2 * nbytes  # read + write
        self.ms: list[float] = []

    def __call__(self):
        return self.dst.copy_(self.src)

    def record(self, t: dict) -> float:
        self.ms.append(t["median_ms"])
        return self.bytes / t["median_ms"] / 1e6

    def summary(self, device: str, budget: timers.Budget) -> dict:
        if not self.ms:  # nothing else ran
            self.record(timers.timer(device)({"copy": self}, budget)["copy"])
        ms = statistics.median(self.ms)
        return {"bytes": self.bytes, "median_ms": ms, "gbps": self.bytes / ms / 1e6, "comparisons": len(self.ms),
                "gbps_range": [self.bytes / max(self.ms) / 1e6, self.bytes / min(self.ms) / 1e6]}


def _impls(bench: Bench, device: str, notes: list[str]) -> dict[str, Callable]:
    fns = {"customops": bench.customops(), "eager": bench.eager}
    torch._dynamo.reset()  # a fresh compile per shape: no dynamic-shape graph from an earlier one
    fns["compile"] = torch.compile(bench.eager)  # default backend: inductor
    if bench.liger is None:
        _note(notes, f"{bench.name}: Liger-Kernel has no such op")
    elif device != "cuda":
        _note(notes, "Liger-Kernel runs on CUDA (Triton) only: skipped on cpu")
    else:
        try:
            fns["liger"] = bench.liger()
        except Exception as e:  # not installed, or an API it no longer has
            _note(notes, f"{bench.name}: Liger-Kernel skipped ({type(e).__name__}: {e})")
    return fns


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _run_case(bench: Bench, dims: tuple, dtype: torch.dtype, device: str, budget: timers.Budget, copy: _Copy,
              notes: list[str], failures: list[str]) -> list[dict]:
    args = bench.inputs(dims, torch.device(device), dtype)
    fns = _impls(bench, device, notes)
    with torch.no_grad():
        ref = bench.eager(*args)
    fwd_bytes, bwd_bytes = bench.bytes(dims, torch.empty((), dtype=dtype).element_size())
    fwd_flops, bwd_flops = bench.flops(dims) if bench.flops is not None else (0, 0)
    timer, sync = timers.timer(device), timers.sync(device)
    rows = []
    for pass_ in PASSES:
        if pass_ == "fwd":
            calls = {k: functools.partial(f, *args) for k, f in fns.items()}
            if bench.out is not None:
                out, out_fn = torch.empty_like(ref), bench.out()
                calls["customops_out"] = lambda: out_fn(*args, out=out)
            nbytes = fwd_bytes
        else:
            gargs, grad_out = _grad_leaves(args, bench.no_grad), _grads_like(ref)
            calls = {k: _forward_backward(f, gargs, grad_out) for k, f in fns.items()}
            if bench.matmuls is not None:
                calls["matmuls"] = functools.partial(bench.matmuls(), *args)
            nbytes = fwd_bytes + bwd_bytes
        compile_s = {}
        for k, f in list(calls.items()):  # the first call compiles (torch.compile, Triton autotuning)
            t0 = time.perf_counter()
            try:
                f()
                sync()
            except Exception as e:  # the others are still timed; a customops failure fails the run
                msg = (str(e).strip().splitlines() or [""])[0]
                where = f"{bench.name} {'x'.join(map(str, dims))} {str(dtype).removeprefix('torch.')} {pass_}"
                (failures if k.startswith("customops") else notes).append(
                    f"{where}: {IMPL_LABEL[k]} failed, left out ({type(e).__name__}: {msg})")
                del calls[k]
                continue
            compile_s[k] = time.perf_counter() - t0
        if "customops" not in calls:
            continue
        times = timer({**calls, "copy": copy}, budget)
        copy_gbps = copy.record(times.pop("copy"))
        base = times["customops"]["median_ms"]
        peaks = {k: _peak_mib(f, device) for k, f in calls.items()}
        for impl in IMPLS:
            if impl not in times:
                continue
            t = times[impl]
            gbps = nbytes / t["median_ms"] / 1e6
            row = {"op": bench.name, "shape": list(dims), "dtype": str(dtype).removeprefix("torch."), "pass": pass_,
                   "impl": impl, **t, "bytes": nbytes, "gbps": gbps, "pct_of_copy": 100 * gbps / copy_gbps,
                   "copy_gbps": copy_gbps, "peak_mib": peaks[impl]}
            if fwd_flops:
                nflops = fwd_flops if pass_ == "fwd" else fwd_flops + bwd_flops
                row["tflops"] = nflops / t["median_ms"] / 1e9
            if impl == "compile":
                row["first_call_s"] = compile_s[impl]
            if impl == "customops":
                row["speedup"] = {a: times[a]["median_ms"] / base for a in ALTERNATIVES if a in times}
            rows.append(row)
    return rows


# ---- per-call overhead on tiny tensors ----------------------------------------------------------------


def _overhead(bench: Bench, device: str, budget: timers.Budget) -> list[dict]:
    """customops vs the closest ATen op on 4-element tensors, from Python (customops.<op> vs
    torch.<op>) and through torch.ops, with inputs that do and do not require grad."""
    o = bench.overhead
    args = bench.inputs((2, 4)[-len(bench.quick_dims):], torch.device(device), torch.float32)
    python = bench.customops()
    op = getattr(_OPS, bench.op).default
    rows = []
    for grad in (False, True):
        a = _grad_leaves(args) if grad else args
        aten_args, aten_kwargs = o.args(*a)
        calls = {
            ("python", "customops"): functools.partial(python, *a),
            ("python", "aten"): functools.partial(o.python, *aten_args, **aten_kwargs),
            ("torch.ops", "customops"): functools.partial(op, *a),
            ("torch.ops", "aten"): functools.partial(o.op, *aten_args, **aten_kwargs),
        }
        us = timers.per_call_us(calls, budget, timers.sync(device))
        for path in ("python", "torch.ops"):
            c, t = us[(path, "customops")], us[(path, "aten")]
            rows.append({"op": bench.name, "path": path, "requires_grad": grad, "customops_us": c,
                         "aten": o.name if path == "python" else str(o.op), "aten_us": t, "ratio": c / t,
                         "within_limit": c / t <= OVERHEAD_MAX})
    return rows


# ---- targets ----------------------------------------------------------------------------------------


def _targets(benches: list[Bench], rows: list[dict], device: str) -> list[dict]:
    out = []
    for b in benches:
        for tg in b.targets:
            if tg.device != device:
                continue
            for r in rows:
                if r["op"] != b.name or r["impl"] != "customops" or r["pass"] != tg.pass_:
                    continue
                fastest = [a for a in ("compile", "liger") if a in r["speedup"]]
                liger = next((x for x in rows if x["impl"] == "liger" and
                              (x["op"], x["shape"], x["dtype"], x["pass"]) == (r["op"], r["shape"], r["dtype"], r["pass"])),
                             None)
                if tg.against == "copy":
                    value = r["pct_of_copy"] / 100
                elif tg.against == "liger_memory":
                    if liger is None or not liger.get("peak_mib") or not r.get("peak_mib"):
                        continue
                    value = liger["peak_mib"] / r["peak_mib"]
                elif tg.against == "fastest" and fastest:
                    value = min(r["speedup"][a] for a in fastest)
                elif tg.against in r["speedup"]:
                    value = r["speedup"][tg.against]
                else:
                    continue
                out.append({"op": b.name, "shape": r["shape"], "dtype": r["dtype"], "pass": tg.pass_,
                            "compared": fastest if tg.against == "fastest" else [tg.against],
                            "against": tg.against, "at_least": tg.at_least, "value": value,
                            "met": value >= tg.at_least})
    return out


# ---- the run ------------------------------------------------------------------------------------------


def _cases(benches: list[Bench], device: str, dtypes: list[torch.dtype] | None, quick: bool):
    for b in benches:
        shapes = [s for s in b.shapes if s.device == device]
        if quick:
            shapes = [Shape(b.quick_dims, device, shapes[0].dtypes if shapes else (torch.float32,))]
        for s in shapes:
            for dt in dtypes or s.dtypes:
                yield b, s.dims, dt


def run(ops: list[str] | None = None, device: str = "cpu", dtypes: list[torch.dtype] | None = None,
        quick: bool = False, progress: bool = True) -> dict:
    """Runs the benchmarks and returns the report (what --json writes)."""
    budget = timers.QUICK if quick else timers.FULL
    notes: list[str] = []
    failures: list[str] = []  # customops calls that raised: the exit status is 1
    benches = []
    for b in (BENCHES_BY_NAME[n] for n in ops) if ops else BENCHES:
        if hasattr(_OPS, b.op):
            benches.append(b)
        else:
            _note(notes, f"{b.name}: customops::{b.op} is not in this build: skipped")
    cases = list(_cases(benches, device, dtypes, quick))
    meta = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "versions": versions(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "timer": timers.timer_name(device),
        "env": {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ},
        "command": None,  # main() fills it in
    }
    if device == "cpu":
        # Compile in this process: inductor's pool of compile workers would otherwise still be
        # starting up (importing torch) while the first cases are timed, on the same cores.
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    torch.manual_seed(0)
    copy_bytes = (1 << 22) if quick else (1 << 28 if device == "cuda" else 1 << 26)
    copy = _Copy(device, copy_bytes)
    rows, overhead = [], []
    from tqdm import tqdm

    with tqdm(total=len(cases) + len(benches), desc="bench", unit="case", disable=None if progress else True,
              leave=False) as bar:
        for b, dims, dt in cases:
            bar.set_postfix_str(f"{b.name} {'x'.join(map(str, dims))} {str(dt).removeprefix('torch.')}")
            rows += _run_case(b, dims, dt, device, budget, copy, notes, failures)
            bar.update()
        for b in benches:
            bar.set_postfix_str(f"{b.name} overhead")
            if b.overhead is not None:
                try:
                    overhead += _overhead(b, device, budget)
                except Exception as e:
                    msg = (str(e).strip().splitlines() or [""])[0]
                    notes.append(f"{b.name}: per-call overhead not measured ({type(e).__name__}: {msg})")
            bar.update()
    return {"meta": meta, "copy": copy.summary(device, budget), "rows": rows, "overhead": overhead,
            "targets": _targets(benches, rows, device), "notes": notes, "failures": failures}


# ---- command line -------------------------------------------------------------------------------------


def _dtype_list(text: str) -> list[torch.dtype]:
    try:
        return [DTYPES[t.strip()] for t in text.split(",") if t.strip()]
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"unknown dtype {e.args[0]!r}; one of {', '.join(DTYPES)}") from None


def vmap_report(device: str, entries: int = 64, quick: bool = False) -> list[dict]:
    """Per op, forward: torch.vmap over `entries` entries (the op's batching rule: one kernel call)
    against a Python loop of `entries` calls, and against one plain call on the stacked input (what
    the batching rule should cost). Entries of two sizes: tiny (where a loop pays per-call overhead)
    and the benchmark's quick shape; rows, elementwise inputs and class targets are batched, a
    norm's weight is shared. Ops on rows only (1-D or 2-D dims): not rope or linear_cross_entropy."""
    budget = timers.QUICK if quick else timers.Budget(seconds=0.5, min_reps=10, rounds=5, overhead_calls=0,
                                                      overhead_rounds=0)
    timer = timers.time_cuda if device == "cuda" else timers.time_cpu
    sync = timers.sync(device)
    out = []
    for b in BENCHES:
        if b.name != b.op or not hasattr(_OPS, b.op) or len(b.quick_dims) > 2:
            continue
        for dims in ((32, 64) if len(b.quick_dims) == 2 else (2048,), b.quick_dims):
            out.append(_vmap_case(b, dims, device, entries, budget, timer, sync))
    return out


def _vmap_case(b: Bench, dims: tuple, device: str, entries: int, budget: timers.Budget, timer, sync) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args = b.inputs(dims, device, dtype)
    fn = b.customops()
    rows = [isinstance(a, torch.Tensor) and (a.dim() >= len(dims) or not a.is_floating_point()) for a in args]
    stacked = [torch.stack([a] * entries) if r else a for a, r in zip(args, rows)]
    vmapped = torch.vmap(fn, in_dims=tuple(0 if r else None for r in rows))
    entry = [[s[i] if r else s for s, r in zip(stacked, rows)] for i in range(entries)]

    def loop(fn=fn, entry=entry):
        for a in entry:
            fn(*a)
        sync()

    fns = {"vmap": lambda: (vmapped(*stacked), sync()), "loop": loop,
           "one call": lambda: (fn(*stacked), sync())}
    with torch.no_grad():
        t = timer(fns, budget)
    return {"op": b.name, "entry": list(dims), "entries": entries, "dtype": str(dtype).removeprefix("torch."),
            **{k: v["median_ms"] for k, v in t.items()}}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench", description=__doc__.splitlines()[0],
                                epilog="Ops whose customops:: operator is not in this build are skipped with a note. "
                                       "`--model llama` instead times a training step and an inference forward of "
                                       "Hugging Face Llama (see `python -m customops bench --model llama --help`).")
    p.add_argument("ops", nargs="*", metavar="OP",
                   help=f"benchmarks to run (default: all): {', '.join(BENCHES_BY_NAME)}")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--dtype", type=_dtype_list, action="extend",
                   help="dtypes to run every shape in, e.g. bfloat16 or float32,bfloat16 (default: per shape)")
    p.add_argument("--quick", action="store_true",
                   help="one small shape per op and few repetitions: checks that everything runs, in seconds")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of effective bandwidth (PNG)")
    p.add_argument("--doc", metavar="PATH",
                   help="rewrite this device's section of a Markdown file (e.g. docs/benchmarks.md), between "
                        "<!-- bench:DEVICE --> and <!-- /bench:DEVICE -->")
    p.add_argument("--section", metavar="NAME",
                   help="the markers --doc writes between: <!-- bench:NAME --> (default: the device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vmap", type=int, metavar="N",
                   help="instead: time torch.vmap over N entries against a loop of N calls and one call on the "
                        "stacked input, per op")
    args = p.parse_args(argv)
    _cli.require("python -m customops bench",
                 {"rich": "cli", "tqdm": "cli", **({"matplotlib": "cli"} if args.plot else {})})

    device = pick_device(p, args.device)
    if args.vmap:
        rows = vmap_report(device, args.vmap, args.quick)
        print(f"vmap over {args.vmap} entries on {device} (forward, median ms):")
        print(f"{'op':14s} {'entry':>10s} {'vmap':>9s} {'loop':>9s} {'one call':>9s} {'loop/vmap':>9s} {'vmap/one':>9s}")
        for r in rows:
            print(f"{r['op']:14s} {'x'.join(map(str, r['entry'])):>10s} {r['vmap']:9.3f} {r['loop']:9.3f} "
                  f"{r['one call']:9.3f} {r['loop'] / r['vmap']:8.1f}x {r['vmap'] / r['one call']:8.2f}x")
        write_json(args.json, rows)
        return 0
    unknown = [o for o in args.ops if o not in BENCHES_BY_NAME]
    if unknown:
        p.error(f"unknown op {', '.join(unknown)}; one of {', '.join(BENCHES_BY_NAME)}")
    report = run(list(dict.fromkeys(args.ops)) or None, device, args.dtype, args.quick,
                 progress=not args.no_progress)
    env = [f"{k}={v}" for k, v in report["meta"]["env"].items()]
    report["meta"]["command"] = " ".join([*env, "python -m customops bench", *argv])
    print_report(report)
    write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    if args.doc:
        image = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.doc))) if args.plot else None
        update_doc(args.doc, args.section or device, markdown(report, image))
    return 1 if report["failures"] else 0
