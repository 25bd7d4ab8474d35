"""Timers of the benchmarks: per call on CPU, triton's do_bench or CUDA events on CUDA (L2 cleared
between calls), the functions of one comparison interleaved in rounds on both; the per-call
overhead on tiny tensors, and the model benchmark's per-iteration timer.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import statistics
import time
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to time: per function, in seconds of repetitions (CPU) or ms for do_bench (CUDA)."""

    seconds: float
    min_reps: int
    rounds: int  # the functions of one comparison take turns this many times
    overhead_calls: int
    overhead_rounds: int


FULL = Budget(seconds=2.0, min_reps=20, rounds=10, overhead_calls=3000, overhead_rounds=30)
QUICK = Budget(seconds=0.05, min_reps=3, rounds=1, overhead_calls=200, overhead_rounds=3)


def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[8], "reps": len(ms)}


class _NoGC:
    def __enter__(self):
        gc.collect()
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.enabled:
            gc.enable()


def time_cpu(fns: dict[str, Callable], budget: Budget) -> dict[str, dict]:
    """time.perf_counter around each call, after a warm-up. The functions take turns (rounds), so
    a slow spell of a shared machine falls on all of them rather than on one."""
    reps = {}
    for name, fn in fns.items():
        start, n = time.perf_counter(), 0
        while n < 3 or (time.perf_counter() - start < budget.seconds / 10 and n < 50):
            fn()
            n += 1
        per_call = (time.perf_counter() - start) / n
        reps[name] = max(budget.min_reps, int(budget.seconds / per_call))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    with _NoGC():
        for _ in range(budget.rounds):
            for name, fn in fns.items():
                for _ in range(-(-reps[name] // budget.rounds)):
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: _stats(ms) for name, ms in samples.items()}


def time_cuda(fns: dict[str, Callable], budget: Budget) -> dict[str, dict]:
    """triton.testing.do_bench when triton is there (it clears L2 between calls), else CUDA events
    around each call with L2 cleared the same way. As on the CPU the functions take turns, in
    ``budget.rounds`` rounds of a share of the repetitions each, so that the GPU's clock and
    temperature drifting over a comparison fall on all of its functions rather than on the last."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    rep = max(10.0, budget.seconds * 250)  # ms of repetitions a function, all rounds together
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(budget.rounds):
        for name, fn in fns.items():
            if do_bench is not None:
                # warmed up for a quarter of the repetitions before its first round, briefly after
                warmup = rep / 4 if rnd == 0 else rep / (4 * budget.rounds)
                ms = do_bench(fn, warmup=warmup, rep=rep / budget.rounds, return_mode="all")
                samples[name] += ms if isinstance(ms, list) else [ms]
            else:
                samples[name] += _cuda_events(fn, budget, warm=rnd == 0)
    return {name: _stats(ms) for name, ms in samples.items()}


def _cuda_events(fn: Callable, budget: Budget, warm: bool = True) -> list[float]:
    """One round's share of the repetitions (after a warm-up in the first round)."""
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any L2
    for _ in range(5 if warm else 1):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        cache.zero_()
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / 5
    n = max(budget.min_reps, min(5000, int(budget.seconds / 4 / per_call))) // budget.rounds  # as long as do_bench
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(max(n, 1))]
    for start, end in ev:
        cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def timer(device: str):
    return time_cuda if device == "cuda" else time_cpu


def timer_name(device: str) -> str:
    if device == "cpu":
        return "time.perf_counter per call, median (functions interleaved in rounds)"
    try:
        import triton  # noqa: F401

        return "triton.testing.do_bench (L2 cleared between calls), median (functions interleaved in rounds)"
    except ImportError:
        return "CUDA events per call (L2 cleared between calls), median (functions interleaved in rounds)"


def sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def per_call_us(fns: dict[str, Callable], budget: Budget, sync) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with _NoGC():
        for f in fns.values():
            for _ in range(budget.overhead_calls // 4):
                f()
        for _ in range(budget.overhead_rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in itertools.repeat(None, budget.overhead_calls):
                    f()
                sync()
                samples[k].append((time.perf_counter() - t0) / budget.overhead_calls * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def iteration_timer(device: str):
    """time_ms(fn, iters): the milliseconds of each of `iters` calls of fn, from CUDA events on CUDA,
    time.perf_counter on CPU."""
    if device == "cuda":
        def time_ms(fn, iters):
            out = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b))
            return out
    else:
        def time_ms(fn, iters):
            out = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
            return out
    return time_ms
