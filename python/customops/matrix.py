"""The live support matrix of ``python -m customops``.

Columns: CPU and CUDA (correctness against the float64 reference in every dtype), Meta (shapes,
dtypes and strides equal the real kernel's), Autograd (gradients equal the reference's), opcheck
(torch.library.opcheck, all four tests), gradcheck (gradcheck and gradgradcheck in float64),
compile (torch.compile fullgraph, dynamic shapes, no recompiles, forward and backward), export
(torch.export with a dynamic batch dimension, run at several sizes), func (torch.func grad, vjp,
jvp, jacrev, jacfwd and hessian against the reference's), vmap (the op's batching rule, with
functorch's per-entry fallback disabled, against a loop; vmap(grad) per-entry gradients),
autocast (the op's autocast policy on CPU, and CUDA when present, forward and backward),
compiled autograd (the backward under torch._dynamo.compiled_autograd equals eager's).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import customops

from . import testing as T

COLUMNS = ("CPU", "CUDA", "Meta", "Autograd", "opcheck", "gradcheck", "compile", "export", "func", "vmap",
           "autocast", "compiled autograd")
PASS, FAIL, NA = "pass", "FAIL", "n/a"


def _cell(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
        return PASS, ""
    except Exception as e:  # a failing cell reports why; the run goes on
        msg = str(e).strip().splitlines()
        return FAIL, f"{type(e).__name__}: {msg[0] if msg else ''}"


def _checks(info: T.OpInfo, devices: list[str], compile_backend: str) -> dict[str, Callable[[], object] | None]:
    def on_devices(fn):
        return lambda: [fn(d) for d in devices]

    def correctness(device):
        return lambda: [T.check_correctness(info, device, dt) for dt in T.FLOAT_DTYPES]

    return {
        "CPU": correctness("cpu"),
        "CUDA": correctness("cuda") if "cuda" in devices else None,
        "Meta": lambda: T.check_meta(info),
        "Autograd": on_devices(lambda d: T.check_autograd(info, d)) if info.differentiable else None,
        "opcheck": on_devices(lambda d: T.check_opcheck(info, d)),
        "gradcheck": on_devices(lambda d: T.check_gradcheck(info, d)) if info.differentiable else None,
        "compile": on_devices(lambda d: T.check_compile(info, d, backend=compile_backend)),
        "export": on_devices(lambda d: T.check_export(info, d)),
        "func": on_devices(lambda d: T.check_func(info, d)) if info.differentiable else None,
        "vmap": on_devices(lambda d: T.check_vmap(info, d)),
        "autocast": on_devices(lambda d: T.check_autocast(info, d)),
        "compiled autograd": on_devices(lambda d: T.check_compiled_autograd(info, d)) if info.differentiable else None,
    }


def run(devices: list[str], compile_backend: str, ops: list[str] | None = None) -> list[dict]:
    rows = []
    for info in T.OPS:
        if ops and info.name not in ops:
            continue
        row = {"op": info.name, "cells": {}, "why": {}}
        for col, fn in _checks(info, devices, compile_backend).items():
            status, why = (NA, "") if fn is None else _cell(fn)
            row["cells"][col], row["why"][col] = status, why
        rows.append(row)
    return rows


def _print(rows: list[dict], header: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text when rich is not installed
        print(header)
        width = {c: max(len(c), 4) + 2 for c in COLUMNS}
        print("op".ljust(14) + "".join(c.ljust(width[c]) for c in COLUMNS))
        for r in rows:
            print(r["op"].ljust(14) + "".join(r["cells"][c].ljust(width[c]) for c in COLUMNS))
        for r in rows:
            for c, why in r["why"].items():
                if why:
                    print(f"  {r['op']} / {c}: {why}")
        return
    style = {PASS: "green", FAIL: "bold red", NA: "dim"}
    table = Table(title=header, title_justify="left")
    table.add_column("op", style="bold")
    for c in COLUMNS:
        table.add_column(c, justify="center")
    for r in rows:
        table.add_row(r["op"], *(f"[{style[r['cells'][c]]}]{r['cells'][c]}[/]" for c in COLUMNS))
    console = Console(width=max(150, Console().width))
    console.print(table)
    for r in rows:
        for c, why in r["why"].items():
            if why:
                console.print(f"[red]{r['op']} / {c}[/]: {why}", markup=True, highlight=False)


def main(argv: list[str], epilog: str | None = None) -> int:
    """The matrix; `epilog` ends its --help (``python -m customops`` gives it every command)."""
    p = argparse.ArgumentParser(prog="python -m customops", description=__doc__.splitlines()[0], epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", action="append", choices=["cpu", "cuda"],
                   help="devices to check (default: cpu, and cuda when present)")
    p.add_argument("--op", action="append", help="only these ops (default: all)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile column (default: inductor)")
    args = p.parse_args(argv)

    devices = args.device or T.devices()
    info = customops.build_info()
    cuda = f"CUDA {info['cuda_version']} (sm {info['cuda_archs']})" if info["cuda"] else "cpu only"
    header = (f"customops {info['version']} | built against torch {info['torch_version']} | {cuda} | "
              f"{info['compiler']} | CPU threads: {info['cpu_threads']} | running torch {torch.__version__} on "
              f"{', '.join(devices)}")
    start = time.perf_counter()
    rows = run(devices, args.compile_backend, args.op)
    _print(rows, header)
    failed = sum(v == FAIL for r in rows for v in r["cells"].values())
    passed = sum(v == PASS for r in rows for v in r["cells"].values())
    print(f"{passed} cells passed, {failed} failed, in {time.perf_counter() - start:.0f} s")
    return 0 if failed == 0 else 1
