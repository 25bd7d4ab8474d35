"""``python -m customops bench --attention``: :func:`customops.attention` against
``F.scaled_dot_product_attention`` (cuDNN's or FlashAttention's kernel on CUDA, its flash kernel on
CPU), forward and forward+backward, side by side in one run.

The CUDA shapes are those of the attention issue's table (grouped-query, float16, causal and full)
plus head dims 64 and 256 and 16k-token sequences; each row gives both implementations' median
time, their TFLOP/s (the FlashAttention count: 4 B H S^2 D a forward, half of it causal, 2.5 times
that a backward) and SDPA's time over customops' (above 1: customops is faster), and the largest
error of each against SDPA in float32 on the same inputs. ``--shapes`` picks others:
``B,Hq,Hkv,S,D,causal|full,dtype`` separated by spaces. ``--variant VAR=VALUE[,VAR=VALUE]``
(repeatable) also times customops with those environment variables set around its calls (the
kernel paths' switches, e.g. ``CUSTOMOPS_ATTENTION_WS=0``), in the same run; a variant that switches
one of our backward's paths (``CUSTOMOPS_ATTENTION_BWD_*``, ``CUSTOMOPS_ATTENTION_SM80``) runs our backward
(``CUSTOMOPS_ATTENTION_BWD_CUDNN=0`` added, and named) unless it says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.nn.functional as F

import customops

from . import timers
from .common import DTYPES, pick_device, versions, write_json


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    hq: int
    hkv: int
    s: int
    d: int
    causal: bool
    dtype: torch.dtype

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            b, hq, hkv, s, d, mask, dtype = text.split(",")
            if mask not in ("causal", "full"):
                raise ValueError(mask)
            return cls(int(b), int(hq), int(hkv), int(s), int(d), mask == "causal", DTYPES[dtype])
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(f"{text!r}: expected B,Hq,Hkv,S,D,causal|full,dtype "
                                             f"(e.g. 2,32,8,8192,128,causal,bfloat16)") from None

    def __str__(self) -> str:
        heads = f"H{self.hq}" if self.hq == self.hkv else f"Hq{self.hq} Hkv{self.hkv}"
        return (f"B{self.b} {heads} S{self.s} D{self.d} {'causal' if self.causal else 'full'} "
                f"{str(self.dtype).removeprefix('torch.')}")

    def flops(self) -> tuple[float, float]:
        fwd = 4 * self.b * self.hq * self.s * self.s * self.d / (2 if self.causal else 1)
        return fwd, 3.5 * fwd


_BF16, _F16, _F32 = torch.bfloat16, torch.float16, torch.float32
CUDA_SHAPES = (
    Shape(2, 32, 8, 8192, 128, True, _BF16),   # the table: grouped-query, causal
    Shape(8, 16, 16, 1024, 64, False, _F16),
    Shape(4, 8, 8, 2048, 128, True, _F16),
    Shape(4, 16, 16, 4096, 128, False, _BF16),  # the op benchmark's shape
    Shape(4, 16, 16, 4096, 64, True, _BF16),   # head dims 64 and 256
    Shape(2, 16, 16, 4096, 256, True, _BF16),
    Shape(1, 16, 16, 16384, 128, True, _BF16),  # 16k tokens
    Shape(1, 16, 16, 16384, 128, False, _BF16),
)
CPU_SHAPES = (Shape(1, 4, 2, 512, 64, True, _F32), Shape(1, 4, 4, 512, 64, False, _BF16))


def _inputs(shape: Shape, device: str, requires_grad: bool):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(shape.b, shape.hq, shape.s, shape.d, device=device, dtype=shape.dtype, generator=g)
    k, v = (torch.randn(shape.b, shape.hkv, shape.s, shape.d, device=device, dtype=shape.dtype, generator=g)
            for _ in range(2))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def parse_variant(text: str) -> dict[str, str]:
    """``VAR=VALUE[,VAR=VALUE]`` -> {VAR: VALUE}."""
    pairs = [item.partition("=") for item in text.split(",")]
    if not all(name and sep for name, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected VAR=VALUE[,VAR=VALUE], got {text!r}")
    return {name: value for name, _, value in pairs}


def _in_environment(env: dict[str, str], thunk):
    """thunk, called with env's variables set (a variant's switches) and put back after it, for the
    forward and the backward alike: the backward reads its switches when autograd runs it, after the
    forward has returned. Only env's variables are touched: unittest.mock.patch.dict restores the
    whole environment, about 0.1 ms a call, as long as the shortest shapes' kernels."""
    if not env:
        return thunk

    def call():
        old = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return thunk()
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return call


def variant_label(env: dict[str, str]) -> str:
    """{VAR: VALUE} -> ``VAR=VALUE[,VAR=VALUE]`` (parse_variant's inverse)."""
    return ",".join(f"{k}={v}" for k, v in env.items())


def variant_name(env: dict[str, str]) -> str:
    return f"customops[{variant_label(env)}]"


def _functions(shape: Shape, variants: list[dict[str, str]] = ()):
    """name -> (the attention function, the environment it runs in)."""
    gqa = {"enable_gqa": True} if shape.hq != shape.hkv else {}
    custom = lambda q, k, v: customops.attention(q, k, v, causal=shape.causal)  # noqa: E731
    fns = {"customops": (custom, {}),
           "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **gqa), {})}
    for env in variants:
        fns[variant_name(env)] = (custom, env)
    return fns


def _with_our_backward(env: dict[str, str]) -> dict[str, str]:
    """env, plus CUSTOMOPS_ATTENTION_BWD_CUDNN=0 where it switches one of our backward's paths
    (CUSTOMOPS_ATTENTION_BWD_*, CUSTOMOPS_ATTENTION_SM80) and does not say which backward runs: a loss
    of out alone takes cuDNN's backward where that is the faster, which would leave that switch unread."""
    ours = any(k.startswith("CUSTOMOPS_ATTENTION_BWD_") or k == "CUSTOMOPS_ATTENTION_SM80" for k in env)
    return {**env, "CUSTOMOPS_ATTENTION_BWD_CUDNN": "0"} if ours and "CUSTOMOPS_ATTENTION_BWD_CUDNN" not in env else env


def _row(shape: Shape, device: str, budget: timers.Budget, variants: list[dict[str, str]] = ()) -> dict:
    fns = _functions(shape, variants)
    q, k, v = _inputs(shape, device, requires_grad=False)
    with torch.no_grad():
        # float32 SDPA with k and v repeated per query head: the memory-efficient kernel takes it (with
        # enable_gqa only the math one would, materializing the scores: 16 GiB at 32 heads x 8k)
        g = shape.hq // shape.hkv
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                             v.float().repeat_interleave(g, 1), is_causal=shape.causal)
        err = {name: (_in_environment(env, lambda fn=fn: fn(q, k, v))().float() - ref).abs().max().item()
               for name, (fn, env) in fns.items()}
    del ref
    time = timers.timer(device)
    fwd = time({name: _in_environment(env, lambda fn=fn: fn(q, k, v)) for name, (fn, env) in fns.items()}, budget)
    qg, kg, vg = _inputs(shape, device, requires_grad=True)
    grad = torch.randn_like(q)

    def step(fn, env):
        return _in_environment(env, lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), grad))

    both = time({name: step(fn, env) for name, (fn, env) in fns.items()}, budget)
    flops = shape.flops()
    row = {"shape": str(shape), "b": shape.b, "hq": shape.hq, "hkv": shape.hkv, "s": shape.s, "d": shape.d,
           "causal": shape.causal, "dtype": str(shape.dtype).removeprefix("torch.")}
    for mode, times, n in (("fwd", fwd, flops[0]), ("fwd_bwd", both, flops[1])):
        for name in fns:
            ms = times[name]["median_ms"]
            row[f"{mode}_{name}_ms"] = ms
            row[f"{mode}_{name}_tflops"] = n / (ms / 1e3) / 1e12
        for name in fns:
            if name != "sdpa":  # customops' and each variant's: fwd_vs_sdpa, fwd_customops[...]_vs_sdpa
                key = f"{mode}_vs_sdpa" if name == "customops" else f"{mode}_{name}_vs_sdpa"
                row[key] = times["sdpa"]["median_ms"] / times[name]["median_ms"]
    for name in fns:
        row[f"max_err_{name}"] = err[name]
    return row


def run(args) -> dict:
    device = args.device
    shapes = args.shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES)
    budget = timers.QUICK if args.quick else timers.FULL
    variants = [_with_our_backward(env) for env in args.variant]  # as timed, and as named in the report
    rows = []
    for shape in shapes:
        rows.append(_row(shape, device, budget, variants))
        if not args.no_progress:
            r = rows[-1]
            print(f"... {shape}: forward {r['fwd_vs_sdpa']:.2f}x SDPA, forward+backward {r['fwd_bwd_vs_sdpa']:.2f}x",
                  flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": name, "versions": versions(device), "timer": timers.timer_name(device),
            "variants": [variant_name(env) for env in variants]}
    return {"meta": meta, "rows": rows}


def print_report(report: dict) -> None:
    m = report["meta"]
    print(f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    print(f"customops.attention against F.scaled_dot_product_attention; {m['timer']}; "
          "vs SDPA = SDPA's time / customops' (above 1: customops is faster)")
    head = (f"{'shape':<36s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'SDPA ms':>8s} {'TFLOP/s':>8s} {'vs SDPA':>8s} "
            f"{'f+b ms':>8s} {'TFLOP/s':>8s} {'SDPA ms':>8s} {'TFLOP/s':>8s} {'vs SDPA':>8s} {'max err':>8s} {'SDPA':>8s}")
    print(head)

    def tf(x):
        return f"{x:8.1f}" if x >= 10 else f"{x:8.3f}"

    for r in report["rows"]:
        cells = [r["shape"].ljust(36)]
        for mode in ("fwd", "fwd_bwd"):
            cells += [f"{r[f'{mode}_customops_ms']:8.3f}", tf(r[f"{mode}_customops_tflops"]),
                      f"{r[f'{mode}_sdpa_ms']:8.3f}", tf(r[f"{mode}_sdpa_tflops"]), f"{r[f'{mode}_vs_sdpa']:7.2f}x"]
        cells += [f"{r['max_err_customops']:8.1e}", f"{r['max_err_sdpa']:8.1e}"]
        print(" ".join(cells))
    for name in m.get("variants", []):
        print(f"{name}, in the same run:")
        for r in report["rows"]:
            print(f"  {r['shape'].ljust(36)} forward {tf(r[f'fwd_{name}_tflops'])} TFLOP/s {r[f'fwd_{name}_vs_sdpa']:5.2f}x SDPA, "
                  f"forward+backward {tf(r[f'fwd_bwd_{name}_tflops'])} TFLOP/s {r[f'fwd_bwd_{name}_vs_sdpa']:5.2f}x, "
                  f"max err {r[f'max_err_{name}']:.1e}")
    for mode, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
        missed = [r["shape"] for r in report["rows"] if r[f"{mode}_vs_sdpa"] < 1.0]
        print(f"target {label} >= 1.0x SDPA: " + (f"missed at {len(missed)} of {len(report['rows'])} shapes"
                                                   if missed else "met at every shape"))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", action="store_true", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--shapes", nargs="+", type=Shape.parse, metavar="B,Hq,Hkv,S,D,MASK,DTYPE",
                   help="shapes to time (default: the issue's table on CUDA, two small ones on CPU)")
    p.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="also time customops with these environment variables set around its calls (repeatable)")
    p.add_argument("--quick", action="store_true", help="a few repetitions (a smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.device = pick_device(p, args.device)
    report = run(args)
    print_report(report)
    write_json(args.json, report)
    return 0
