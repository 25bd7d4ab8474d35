"""``python -m customops bench``: customops against PyTorch eager, torch.compile and Liger-Kernel.

For each op of :data:`BENCHES` and a few realistic shapes, forward and forward+backward: median
time, effective bandwidth from the minimum bytes the op must move, that bandwidth as a share of a
device-to-device copy timed in the same run, and customops' speed-up over each alternative. Then
the per-call overhead on tiny tensors against the closest single ATen op. Output: a table, and on
request JSON, a PNG bar chart and the device's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import math
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch._dynamo
import torch.nn.functional as F

import customops

# ---- the registry: one Bench per op (or per way of calling it) ----------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    dims: tuple[int, ...]
    device: str  # "cpu" or "cuda"
    dtypes: tuple[torch.dtype, ...]  # --dtype replaces these


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal set by an issue, checked and printed, never failing the run."""

    device: str
    # "eager", "compile", "liger": customops' speed-up over that; "fastest": over the faster of
    # torch.compile and Liger-Kernel; "copy": share of copy bandwidth; "liger_memory": Liger-Kernel's
    # peak memory over customops' (CUDA)
    against: str
    at_least: float
    pass_: str = "fwd"


@dataclasses.dataclass(frozen=True)
class Overhead:
    """The closest single ATen op, for the per-call overhead on tiny tensors: `python` is what
    users call (torch.add), `op` the torch.ops overload; `args` maps the bench's inputs to its."""

    name: str
    python: Callable
    op: Callable
    args: Callable[..., tuple[tuple, dict]]


@dataclasses.dataclass(frozen=True)
class Bench:
    name: str  # the label of its rows
    op: str  # torch.ops.customops.<op>: the bench is skipped with a note while it is missing
    inputs: Callable[[tuple, torch.device, torch.dtype], tuple]  # random inputs for dims
    customops: Callable[[], Callable]  # -> fn(*inputs); resolved once the op is known to exist
    eager: Callable  # fn(*inputs), PyTorch written the usual way; torch.compile compiles it too
    bytes: Callable[[tuple, int], tuple[int, int]]  # (dims, itemsize) -> minimum (forward, backward) bytes
    shapes: tuple[Shape, ...]
    quick_dims: tuple[int, ...]  # --quick: one small shape per bench
    liger: Callable[[], Callable] | None = None  # -> fn(*inputs); imports liger_kernel
    out: Callable[[], Callable] | None = None  # -> fn(*inputs, out=): customops' out= variant
    overhead: Overhead | None = None
    targets: tuple[Target, ...] = ()
    no_grad: tuple[int, ...] = ()  # positions of floating-point inputs that take no gradient (rope's cos, sin)
    # fwd+bwd only: -> fn(*inputs) timed beside the others as impl "matmuls" (the matmuls an op is
    # built on, so its table shows their share)
    matmuls: Callable[[], Callable] | None = None
    # dims -> (forward, backward) FLOPs of an op bound by its matmuls: its rows show TFLOP/s too
    flops: Callable[[tuple], tuple[float, float]] | None = None


def _randn(dims, device, dtype):
    return torch.randn(dims, device=device, dtype=dtype)


def _elementwise_bytes(n_in: int, n_out: int):
    """Forward reads n_in tensors and writes n_out; backward reads the output gradients and the
    n_in inputs, and writes n_in input gradients."""

    def count(dims, itemsize):
        n = math.prod(dims) * itemsize
        return (n_in + n_out) * n, (n_out + 2 * n_in) * n

    return count


def _rms_norm_bytes(dims, itemsize):
    # Forward reads x and w, writes y; backward reads dy, x and w, writes dx and dw. rstd, which
    # a kernel may save to spare the backward a reduction, is not counted: it is not needed.
    xs, w = math.prod(dims) * itemsize, dims[-1] * itemsize
    return 2 * xs + w, 3 * xs + 2 * w


def _wrapper(name: str, fallback: Callable) -> Callable[[], Callable]:
    """customops.<name> (what users call) when the package has it, else the torch.ops op."""
    return lambda: getattr(customops, name, None) or fallback()


def _rms_norm_eager(x, w, eps):
    # Hugging Face's LlamaRMSNorm: normalize in float32, round to x's dtype, then scale.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def _liger(module: str, attr: str, *extra):
    def load():
        import importlib

        fn = getattr(importlib.import_module(module), attr).apply
        return lambda *args: fn(*args, *extra)

    return load


def _chunked(fn):
    # gate and up as the two halves of one [M, 2N] projection output, as in fused-MLP models.
    return lambda x: fn(*x.chunk(2, -1))


def _add_rms_norm_eager(x, residual, w, eps):
    # Hugging Face's decoder layer: the residual add in the activations' dtype, then LlamaRMSNorm.
    h = x + residual
    return _rms_norm_eager(h, w, eps), h


def _add_rms_norm_bytes(dims, itemsize):
    # Forward reads x, residual and w, writes y and sum; backward reads dy, the gradient of sum,
    # sum and w, writes one gradient (x's and residual's are the same tensor) and dw.
    xs, w = math.prod(dims) * itemsize, dims[-1] * itemsize
    return 4 * xs + w, 4 * xs + 2 * w


def _rope_inputs(dims, dev, dt):
    # dims (B, Hq, Hkv, S, D); cos and sin [1, S, D] as Hugging Face's rotary module makes them.
    b, hq, hkv, s, d = dims
    theta = torch.randn(1, s, d // 2, device=dev).repeat(1, 1, 2)
    # q and k as Hugging Face's attention makes them: [B, S, H, D] projections viewed as [B, H, S, D],
    # the layout Liger-Kernel rotates in place (a contiguous [B, H, S, D] would cost it a copy).
    q, k = _randn((b, s, hq, d), dev, dt).transpose(1, 2), _randn((b, s, hkv, d), dev, dt).transpose(1, 2)
    return q, k, theta.cos().to(dt), theta.sin().to(dt)


def _rope_eager(q, k, cos, sin):
    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _rope_bytes(dims, itemsize):
    # Each pass reads q and k (or their gradients) and writes as much; cos and sin once.
    b, hq, hkv, s, d = dims
    qk, cs = b * (hq + hkv) * s * d * itemsize, 2 * s * d * itemsize
    return 2 * qk + cs, 2 * qk + cs


def _liger_rope():
    from liger_kernel.ops.rope import LigerRopeFunction

    return lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)


def _cross_entropy_bytes(dims, itemsize):
    # Forward reads the logits once; backward reads them once and writes their gradient.
    n = math.prod(dims) * itemsize
    return n, 2 * n


def _liger_functional(name: str):
    def load():
        import importlib

        return getattr(importlib.import_module("liger_kernel.transformers.functional"), name)

    return load


def _linear_ce_inputs(dims, dev, dt):
    n, h, v = dims
    return (_randn((n, h), dev, dt), _randn((v, h), dev, dt) * h ** -0.5, torch.randint(0, v, (n,), device=dev))


def _linear_ce_bytes(dims, itemsize):
    # What any implementation must move at least: hidden and weight in, their gradients out (the
    # op is bound by its matmuls; % of copy says little here).
    n, h, v = dims
    return (n * h + v * h) * itemsize, 2 * (n * h + v * h) * itemsize


def _attention_bytes(dims, itemsize):
    # q, k, v in and out (forward); plus out's gradient in and three gradients out (backward).
    # Attention is bound by its matmuls: % of copy says little; compare the speed-ups over SDPA.
    n = math.prod(dims) * itemsize
    return 4 * n, 8 * n


def _attention_flops(causal: bool):
    # Two matmuls of [S, D] x [D, S] a head forward (half of them under the causal mask), five
    # backward (the scores again, dP, dV, dK, dQ): the usual count, which FlashAttention reports.
    def count(dims):
        b, h, s, d = dims
        fwd = 4 * b * h * s * s * d / (2 if causal else 1)
        return fwd, 2.5 * fwd

    return count


def _attention_bench(causal: bool) -> "Bench":
    return Bench(
        name="attention" + (" causal" if causal else ""),
        op="attention",
        inputs=lambda d, dev, dt: tuple(_randn(d, dev, dt) for _ in range(3)),
        customops=lambda: (lambda q, k, v: customops.attention(q, k, v, causal=causal)),
        # "eager" is F.scaled_dot_product_attention (flash or cuDNN on CUDA, its flash kernel on CPU)
        eager=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        bytes=_attention_bytes,
        flops=_attention_flops(causal),
        shapes=(Shape((2, 8, 1024, 64), "cpu", (_F32, _BF16)), Shape((4, 16, 4096, 128), "cuda", (_BF16,))),
        quick_dims=(1, 2, 128, 32),
        targets=(Target("cpu", "eager", 1.0), Target("cpu", "eager", 1.0, "fwd+bwd"), Target("cuda", "eager", 0.5),
                 Target("cuda", "eager", 0.5, "fwd+bwd")),
    )


def _linear_ce_matmuls():
    # The three matmuls a fused linear cross-entropy cannot avoid: logits, grad_hidden, grad_weight.
    def run(hidden, weight, target):
        logits = hidden @ weight.T
        return logits @ weight, logits.T @ hidden

    return run


_OPS = torch.ops.customops
_BF16, _F32 = torch.bfloat16, torch.float32
_MLP = (16384, 11008)  # Llama-7B's intermediate activations: tokens x ffn width
# The LLM ops issue's GPU goals: forward at 90% of copy bandwidth or more; forward+backward no
# slower than the faster of torch.compile and Liger-Kernel.
_GPU_TARGETS = (Target("cuda", "copy", 0.9), Target("cuda", "fastest", 1.0, "fwd+bwd"))

# SwiGLU on one [M, 2N] tensor x whose halves are gate and up (dims are the output's, [M, N]).
_GATE_UP = dict(
    inputs=lambda d, dev, dt: (_randn((*d[:-1], 2 * d[-1]), dev, dt),),
    eager=_chunked(lambda gate, up: F.silu(gate) * up),
    bytes=_elementwise_bytes(2, 1),
    shapes=(Shape((4096, 4096), "cpu", (_F32,)), Shape(_MLP, "cuda", (_BF16,))),
    quick_dims=(256, 1024),
    liger=lambda: _chunked(_liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")()),
    targets=(Target("cpu", "eager", 1.3), Target("cpu", "compile", 1.0), *_GPU_TARGETS),
)

BENCHES: list[Bench] = [
    Bench(
        name="add_rms_norm",
        op="add_rms_norm",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), _randn(d, dev, dt), 1 + 0.1 * _randn(d[-1:], dev, dt), 1e-6),
        customops=_wrapper("add_rms_norm", lambda: lambda x, r, w, eps: _OPS.add_rms_norm.default(x, r, w, eps)[:2]),
        eager=_add_rms_norm_eager,
        bytes=_add_rms_norm_bytes,
        shapes=(Shape((4096, 4096), "cpu", (_F32, _BF16)),
                Shape((32768, 4096), "cuda", (_BF16,)), Shape((4096, 8192), "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        targets=(Target("cpu", "eager", 2.0), Target("cpu", "compile", 1.0), Target("cuda", "copy", 0.9),
                 Target("cuda", "copy", 0.9, "fwd+bwd"), Target("cuda", "compile", 1.0, "fwd+bwd")),
    ),
    Bench(
        name="rope",
        op="rope",
        inputs=_rope_inputs,
        customops=_wrapper("rope", lambda: lambda q, k, c, s: _OPS.rope.default(q, k, c, s, False)),
        eager=_rope_eager,
        bytes=_rope_bytes,
        shapes=(Shape((1, 32, 8, 1024, 128), "cpu", (_F32,)), Shape((4, 32, 8, 2048, 128), "cuda", (_BF16,))),
        quick_dims=(1, 4, 2, 64, 64),
        # Liger-Kernel rotates q and k in place (and, in the backward, the output gradients): the
        # values the others read later change, their timing does not.
        liger=_liger_rope,
        no_grad=(2, 3),
        targets=(Target("cpu", "eager", 2.0), Target("cpu", "compile", 1.0), Target("cuda", "copy", 0.9, "fwd+bwd"),
                 Target("cuda", "fastest", 1.0, "fwd+bwd")),
    ),
    Bench(
        name="cross_entropy",
        op="cross_entropy",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), torch.randint(0, d[-1], d[:-1], device=dev)),
        customops=lambda: customops.cross_entropy,
        # Hugging Face's loss: the logits upcast to float32, then F.cross_entropy.
        eager=lambda logits, target: F.cross_entropy(logits.float(), target),
        bytes=_cross_entropy_bytes,
        shapes=(Shape((4096, 32000), "cpu", (_F32, _BF16)), Shape((8192, 128256), "cuda", (_BF16,))),
        quick_dims=(64, 1000),
        # Liger writes the gradient into the logits during the forward; later repetitions read
        # those values instead (the timing is the same).
        liger=_liger_functional("liger_cross_entropy"),
        targets=(Target("cpu", "eager", 2.0), Target("cpu", "compile", 1.0), Target("cuda", "copy", 0.9, "fwd+bwd"),
                 Target("cuda", "fastest", 1.0, "fwd+bwd")),
    ),
    Bench(
        name="linear_cross_entropy",
        op="linear_cross_entropy",
        inputs=_linear_ce_inputs,
        customops=lambda: customops.linear_cross_entropy,
        eager=lambda hidden, weight, target: F.cross_entropy((hidden @ weight.T).float(), target),
        bytes=_linear_ce_bytes,
        shapes=(Shape((512, 512, 8192), "cpu", (_F32,)), Shape((8192, 2048, 128256), "cuda", (_BF16,))),
        quick_dims=(64, 32, 1000),
        liger=_liger_functional("liger_fused_linear_cross_entropy"),
        matmuls=_linear_ce_matmuls,
        targets=(Target("cpu", "compile", 1.0), Target("cuda", "liger", 1.0, "fwd+bwd"),
                 Target("cuda", "liger_memory", 1.0, "fwd+bwd")),
    ),
    _attention_bench(causal=False),
    _attention_bench(causal=True),
    Bench(
        name="muladd",
        op="muladd",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), _randn(d, dev, dt), 0.75),
        customops=_wrapper("muladd", lambda: _OPS.muladd.default),
        eager=lambda a, b, c: a * b + c,
        bytes=_elementwise_bytes(2, 1),
        shapes=(Shape((1 << 24,), "cpu", (_F32,)), Shape((1 << 24,), "cuda", (_F32,))),
        quick_dims=(1 << 18,),
        out=lambda: lambda a, b, c, out: _OPS.muladd.out(a, b, c, out=out),
        overhead=Overhead("torch.add(a, b, alpha=c)", torch.add, torch.ops.aten.add.Tensor,
                          lambda a, b, c: ((a, b), {"alpha": c})),
        targets=(Target("cpu", "eager", 1.5), Target("cpu", "compile", 0.9), Target("cuda", "copy", 0.9)),
    ),
    Bench(
        name="rms_norm",
        op="rms_norm",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), 1 + 0.1 * _randn(d[-1:], dev, dt), 1e-6),
        customops=_wrapper("rms_norm", lambda: lambda x, w, eps: _OPS.rms_norm.default(x, w, eps)[0]),
        eager=_rms_norm_eager,
        bytes=_rms_norm_bytes,
        shapes=(Shape((4096, 4096), "cpu", (_F32, _BF16)),
                Shape((32768, 4096), "cuda", (_BF16,)), Shape((4096, 8192), "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        # Positional (X, W, eps, offset, casting_mode, in_place): in_place=False leaves dy intact,
        # and allocates dx as customops does.
        liger=_liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction", 0.0, "llama", False),
        overhead=Overhead("F.rms_norm(x, (n,), w, eps)", F.rms_norm, torch.ops.aten.rms_norm.default,
                          lambda x, w, eps: ((x, [x.shape[-1]], w, eps), {})),
        targets=(Target("cpu", "eager", 2.0), Target("cpu", "compile", 1.0), *_GPU_TARGETS),
    ),
    # Mixed precision: half-type activations with the norm weight kept in float32, read as it is.
    Bench(
        name="rms_norm(float32 weight)",
        op="rms_norm",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), 1 + 0.1 * _randn(d[-1:], dev, _F32), 1e-6),
        customops=_wrapper("rms_norm", lambda: lambda x, w, eps: _OPS.rms_norm.default(x, w, eps)[0]),
        eager=lambda x, w, eps: _rms_norm_eager(x, w, eps).to(x.dtype),
        bytes=_rms_norm_bytes,
        shapes=(Shape((4096, 4096), "cpu", (_BF16,)), Shape((32768, 4096), "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        liger=_liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction", 0.0, "llama", False),
        targets=(Target("cpu", "compile", 1.0), *_GPU_TARGETS),
    ),
    Bench(
        name="silu",
        op="silu",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt),),
        customops=_wrapper("silu", lambda: _OPS.silu.default),
        eager=F.silu,
        bytes=_elementwise_bytes(1, 1),
        shapes=(Shape((4096, 4096), "cpu", (_F32,)), Shape(_MLP, "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        overhead=Overhead("F.silu(x)", F.silu, torch.ops.aten.silu.default, lambda x: ((x,), {})),
        targets=(Target("cpu", "compile", 1.0),),
    ),
    Bench(
        name="silu_mul",
        op="silu_mul",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), _randn(d, dev, dt)),
        customops=_wrapper("silu_mul", lambda: _OPS.silu_mul.default),
        eager=lambda gate, up: F.silu(gate) * up,
        bytes=_elementwise_bytes(2, 1),
        shapes=(Shape((4096, 4096), "cpu", (_F32,)), Shape(_MLP, "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        liger=_liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
        overhead=Overhead("torch.mul(gate, up)", torch.mul, torch.ops.aten.mul.Tensor, lambda g, u: ((g, u), {})),
        targets=(Target("cpu", "eager", 1.3), Target("cpu", "compile", 1.0), *_GPU_TARGETS),
    ),
    # The same computation twice: silu_mul on the halves of x, and swiglu on x itself, whose
    # backward writes the gradient of x in one pass where autograd's backward of x.chunk
    # concatenates the two halves' gradients.
    Bench(
        name="silu_mul(x.chunk(2))",
        op="silu_mul",
        customops=lambda: _chunked(getattr(customops, "silu_mul", None) or _OPS.silu_mul.default),
        **_GATE_UP,
    ),
    Bench(
        name="swiglu",
        op="swiglu",
        customops=_wrapper("swiglu", lambda: _OPS.swiglu.default),
        **_GATE_UP,
    ),
    Bench(
        name="scale_clamp",
        op="scale_clamp",
        inputs=lambda d, dev, dt: (_randn(d, dev, dt), 0.5, -1.0, 1.0),
        customops=_wrapper("scale_clamp", lambda: _OPS.scale_clamp.default),
        eager=lambda x, scale, lo, hi: torch.clamp(x * scale, lo, hi),
        bytes=_elementwise_bytes(1, 1),
        shapes=(Shape((4096, 4096), "cpu", (_F32,)), Shape(_MLP, "cuda", (_BF16,))),
        quick_dims=(256, 1024),
        overhead=Overhead("torch.clamp(x, lo, hi)", torch.clamp, torch.ops.aten.clamp.default,
                          lambda x, scale, lo, hi: ((x, lo, hi), {})),
        targets=(Target("cpu", "compile", 1.0),),
    ),
]

BENCHES_BY_NAME = {b.name: b for b in BENCHES}
IMPLS = ("customops", "customops_out", "eager", "compile", "liger", "matmuls")
ALTERNATIVES = ("eager", "compile", "liger")  # what customops' speed-up is measured against
PASSES = ("fwd", "fwd+bwd")
# Allocator settings that change what a fresh output costs; recorded with the results when set.
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")
OVERHEAD_MAX = 1.5  # customops' per-call time on tiny tensors, as a multiple of the ATen op's

# ---- timers ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to time: per function, in seconds of repetitions (CPU) or ms for do_bench (CUDA)."""

    seconds: float
    min_reps: int
    rounds: int  # CPU: the functions of one comparison take turns this many times
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


def _time_cpu(fns: dict[str, Callable], budget: Budget) -> dict[str, dict]:
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


def _time_cuda(fns: dict[str, Callable], budget: Budget) -> dict[str, dict]:
    """triton.testing.do_bench when triton is there (it clears L2 between calls), else CUDA events
    around each call with L2 cleared the same way."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    out = {}
    for name, fn in fns.items():
        if do_bench is not None:
            rep = max(10.0, budget.seconds * 250)  # ms of repetitions, after a quarter of that warming up
            q = do_bench(fn, warmup=rep / 4, rep=rep, quantiles=[0.5, 0.1, 0.9])
            out[name] = {"median_ms": q[0], "p10_ms": q[1], "p90_ms": q[2], "reps": None}
        else:
            out[name] = _stats(_cuda_events(fn, budget))
    return out


def _cuda_events(fn: Callable, budget: Budget) -> list[float]:
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any L2
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        cache.zero_()
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / 5
    n = max(budget.min_reps, min(5000, int(budget.seconds / 4 / per_call)))  # as long as do_bench
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in ev:
        cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def _timer(device: str):
    return _time_cuda if device == "cuda" else _time_cpu


def _timer_name(device: str) -> str:
    if device == "cpu":
        return "time.perf_counter per call, median (functions interleaved in rounds)"
    try:
        import triton  # noqa: F401

        return "triton.testing.do_bench (L2 cleared between calls), median"
    except ImportError:
        return "CUDA events per call (L2 cleared between calls), median"


# ---- one comparison ---------------------------------------------------------------------------------


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


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

    def summary(self, device: str, budget: Budget) -> dict:
        if not self.ms:  # nothing else ran
            self.record(_timer(device)({"copy": self}, budget)["copy"])
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


def _run_case(bench: Bench, dims: tuple, dtype: torch.dtype, device: str, budget: Budget, copy: _Copy,
              notes: list[str], failures: list[str]) -> list[dict]:
    args = bench.inputs(dims, torch.device(device), dtype)
    fns = _impls(bench, device, notes)
    with torch.no_grad():
        ref = bench.eager(*args)
    fwd_bytes, bwd_bytes = bench.bytes(dims, torch.empty((), dtype=dtype).element_size())
    fwd_flops, bwd_flops = bench.flops(dims) if bench.flops is not None else (0, 0)
    timer, sync = _timer(device), _sync(device)
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


def _per_call_us(fns: dict[str, Callable], budget: Budget, sync) -> dict[str, float]:
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


def _overhead(bench: Bench, device: str, budget: Budget) -> list[dict]:
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
        us = _per_call_us(calls, budget, _sync(device))
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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions(device: str) -> dict:
    v = {"torch": torch.__version__, "customops": customops.__version__, "python": platform.python_version()}
    if device != "cuda":
        return v
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    for mod, dist in (("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:
            m = importlib.import_module(mod)
        except Exception:
            continue
        try:
            v[mod] = version(dist)
        except PackageNotFoundError:  # e.g. a source tree on PYTHONPATH
            v[mod] = getattr(m, "__version__", "unknown version")
    return v


def _cases(benches: list[Bench], device: str, dtypes: list[torch.dtype] | None, quick: bool):
    for b in benches:
        shapes = [s for s in b.shapes if s.device == device]
        if quick:
            shapes = [Shape(b.quick_dims, device, shapes[0].dtypes if shapes else (_F32,))]
        for s in shapes:
            for dt in dtypes or s.dtypes:
                yield b, s.dims, dt


def run(ops: list[str] | None = None, device: str = "cpu", dtypes: list[torch.dtype] | None = None,
        quick: bool = False, progress: bool = True) -> dict:
    """Runs the benchmarks and returns the report (what --json writes)."""
    budget = QUICK if quick else FULL
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
        "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "threads": torch.get_num_threads(),
        "versions": _versions(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "timer": _timer_name(device),
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


# ---- output -------------------------------------------------------------------------------------------


def _fmt_ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.2f} ms"


def _shape(r: dict) -> str:
    return "x".join(map(str, r["shape"]))


IMPL_LABEL = {"customops": "customops", "customops_out": "customops out=", "eager": "eager",
              "compile": "torch.compile", "liger": "Liger-Kernel", "matmuls": "its matmuls (torch.mm)"}
AGAINST_LABEL = {"eager": "eager", "compile": "torch.compile", "liger": "Liger-Kernel", "copy": "copy bandwidth",
                 "liger_memory": "Liger-Kernel's peak memory over customops'"}


def _flops_column(report: dict) -> tuple:
    return (("TFLOP/s", "right"),) if any("tflops" in r for r in report["rows"]) else ()


def _tflops_cell(r: dict) -> str:
    return f"{r['tflops']:.3g}" if "tflops" in r else ""


def _peak_cell(r: dict) -> str:
    return "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"


def _speedup_cell(rows_of_case: list[dict], r: dict) -> str:
    if r["impl"] not in ALTERNATIVES:
        return ""
    base = next(x for x in rows_of_case if x["impl"] == "customops")
    return f"{base['speedup'][r['impl']]:.2f}x"


def _groups(rows: list[dict]):
    key = lambda r: (r["op"], _shape(r), r["dtype"], r["pass"])  # noqa: E731
    for k, g in itertools.groupby(rows, key):
        yield k, list(g)


def _target_line(t: dict) -> str:
    v = f"{100 * t['value']:.0f}% of" if t["against"] == "copy" else f"{t['value']:.2f}x"
    against = " and ".join(AGAINST_LABEL[a] for a in t["compared"])
    if len(t["compared"]) > 1:
        against = f"the faster of {against}"
    want = f"{100 * t['at_least']:.0f}%" if t["against"] == "copy" else f"{t['at_least']}x"
    return (f"{t['op']} {'x'.join(map(str, t['shape']))} {t['dtype']} {t['pass']}: {v} {against} "
            f"(target >= {want}): {'met' if t['met'] else 'NOT met'}")


def _header(report: dict) -> str:
    m, v = report["meta"], report["meta"]["versions"]
    extra = "".join(f", {k} {v[k]}" for k in ("triton", "liger_kernel") if k in v)
    env = "".join(f" | {k}={val}" for k, val in m.get("env", {}).items())
    return (f"{m['device_name']} ({m['device']}, {m['threads']} threads) | torch {v['torch']}, customops "
            f"{v['customops']}{extra} | {m['date']}{env}{' | --quick: timings not meaningful' if m['quick'] else ''}")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    c = report["copy"]
    t = Table(title=_header(report), title_justify="left")
    for col, just in (("op", "left"), ("shape", "left"), ("dtype", "left"), ("pass", "left"), ("impl", "left"),
                      ("median", "right"), ("GB/s", "right"), ("% of copy", "right"),
                      ("customops speed-up", "right"), ("peak MiB", "right")) + _flops_column(report):
        t.add_column(col, justify=just)
    for _, g in _groups(report["rows"]):
        for i, r in enumerate(g):
            sp = _speedup_cell(g, r)
            if sp:
                sp = f"[{'green' if float(sp[:-1]) >= 1 else 'red'}]{sp}[/]"
            first = i == 0
            t.add_row(r["op"] if first else "", _shape(r) if first else "", r["dtype"] if first else "",
                      r["pass"] if first else "", IMPL_LABEL[r["impl"]], _fmt_ms(r["median_ms"]),
                      f"{r['gbps']:.1f}", f"{r['pct_of_copy']:.0f}%", sp, _peak_cell(r),
                      *([_tflops_cell(r)] if _flops_column(report) else []),
                      style="bold" if r["impl"] == "customops" else None, end_section=i == len(g) - 1)
    console.print(t)
    console.print(f"copy roofline: dst.copy_(src), {c['bytes'] / 2**20:.0f} MiB moved: {c['gbps']:.1f} GB/s (median of "
                  f"{c['comparisons']} comparisons, {c['gbps_range'][0]:.1f} to {c['gbps_range'][1]:.1f}); each row's "
                  "% of copy is against the copy timed with it", highlight=False)
    if report["overhead"]:
        t = Table(title=f"per-call overhead on tiny tensors (limit: {OVERHEAD_MAX}x the ATen op)", title_justify="left")
        for col in ("op", "path", "requires_grad", "customops", "ATen op", "ATen", "ratio"):
            t.add_column(col, justify="right" if col in ("customops", "ATen", "ratio") else "left")
        for r in report["overhead"]:
            ratio = f"[{'green' if r['within_limit'] else 'red'}]{r['ratio']:.2f}x[/]"
            t.add_row(r["op"], r["path"], str(r["requires_grad"]), f"{r['customops_us']:.2f} µs", r["aten"],
                      f"{r['aten_us']:.2f} µs", ratio)
        console.print(t)
    for tg in report["targets"]:
        console.print(("[green]" if tg["met"] else "[red]") + _target_line(tg) + "[/]", highlight=False)
    for n in report["notes"]:
        console.print(f"[dim]note: {n}[/]", highlight=False)
    for n in report["failures"]:
        console.print(f"[bold red]FAILED: {n}[/]", highlight=False)


def plot(report: dict, path: str) -> None:
    """Bar chart of effective bandwidth per case and implementation, with the copy roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [p for p in PASSES if any(r["pass"] == p for r in report["rows"])]
    fig, axes = plt.subplots(len(passes) or 1, 1, figsize=(11, 3.6 * max(1, len(passes))), squeeze=False)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in report["rows"])]
    colors = dict(zip(IMPLS, ("tab:blue", "tab:cyan", "tab:gray", "tab:orange", "tab:green", "tab:purple")))
    for ax, p in zip(axes[:, 0], passes):
        groups = [(k, g) for k, g in _groups(report["rows"]) if k[3] == p]
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            xs, ys, pct = [], [], []
            for i, (_, g) in enumerate(groups):
                for r in g:
                    if r["impl"] == impl:
                        xs.append(i + (j - (len(impls) - 1) / 2) * width)
                        ys.append(r["gbps"])
                        pct.append(f"{r['pct_of_copy']:.0f}%")
            bars = ax.bar(xs, ys, width, label=IMPL_LABEL[impl], color=colors[impl])
            ax.bar_label(bars, pct, fontsize=7, padding=1)
        for i, (_, g) in enumerate(groups):  # the copy timed with this comparison
            ax.hlines(g[0]["copy_gbps"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                      label="copy" if i == 0 else None)
        ax.set_xticks(range(len(groups)), [f"{k[0]}\n{k[1]} {k[2]}" for k, _ in groups], fontsize=8)
        ax.set_xlim(-0.5, max(len(groups), 2) - 0.5)
        ax.set_ylim(0, 1.15 * max(max(r["copy_gbps"], r["gbps"]) for _, g in groups for r in g))
        ax.set_ylabel("effective GB/s (labels: % of copy)")
        ax.set_title(p, fontsize=10, loc="left")
    axes[0, 0].legend(fontsize=8, loc="upper right", ncols=len(impls) + 1)
    fig.suptitle(_header(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict, image: str | None = None) -> str:
    """The device's section of docs/benchmarks.md."""
    m, v, c = report["meta"], report["meta"]["versions"], report["copy"]
    extra = "".join(f", {k} {v[k]}" for k in ("triton", "liger_kernel") if k in v)
    lines = [
        f"**{m['device_name']}** ({m['threads']} threads), torch {v['torch']}, customops {v['customops']}{extra}, "
        f"{m['date']}. Timer: {m['timer']}.",
        "",
        f"Generated by `{m['command'] or 'python -m customops bench'}`.",
        "",
        f"Copy roofline (`dst.copy_(src)`, {c['bytes'] / 2**20:.0f} MiB moved, timed within every comparison): "
        f"**{c['gbps']:.1f} GB/s** (median; {c['gbps_range'][0]:.1f} to {c['gbps_range'][1]:.1f}). Each row's "
        "% of copy is against the copy timed alongside it.",
        "",
        "| op | shape | dtype | pass | impl | median | GB/s | % of copy | customops speed-up | peak MiB |"
        + (" TFLOP/s |" if _flops_column(report) else ""),
        "|---|---|---|---|---|--:|--:|--:|--:|--:|" + ("--:|" if _flops_column(report) else ""),
    ]
    for _, g in _groups(report["rows"]):
        for r in g:
            name = f"**{IMPL_LABEL[r['impl']]}**" if r["impl"] == "customops" else IMPL_LABEL[r["impl"]]
            lines.append(f"| {r['op']} | {_shape(r)} | {r['dtype']} | {r['pass']} | {name} | {_fmt_ms(r['median_ms'])} "
                         f"| {r['gbps']:.1f} | {r['pct_of_copy']:.0f}% | {_speedup_cell(g, r)} | {_peak_cell(r)} |"
                         + (f" {_tflops_cell(r)} |" if _flops_column(report) else ""))
    if image:
        lines += ["", f"![effective bandwidth, {m['device_name']}]({image})"]
    if report["overhead"]:
        lines += ["", f"Per-call overhead on tiny tensors (limit {OVERHEAD_MAX}x the ATen op):", "",
                  "| op | path | requires_grad | customops | ATen op | ATen | ratio |", "|---|---|---|--:|---|--:|--:|"]
        for r in report["overhead"]:
            flag = "" if r["within_limit"] else " (over)"
            lines.append(f"| {r['op']} | {r['path']} | {r['requires_grad']} | {r['customops_us']:.2f} µs | "
                         f"`{r['aten']}` | {r['aten_us']:.2f} µs | {r['ratio']:.2f}x{flag} |")
    if report["targets"]:
        lines += ["", "Targets:", ""] + [f"- {_target_line(t)}" for t in report["targets"]]
    if report["notes"] or report["failures"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]] + [f"- FAILED: {n}" for n in report["failures"]]
    return "\n".join(lines)


def update_doc(path: str, name: str, section: str) -> None:
    """Replaces what lies between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in path."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    with open(path) as f:
        text = f.read()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"customops bench: --doc {path} has no '{begin}' ... '{end}' markers to write between")
    with open(path, "w") as f:
        f.write(text[: i + len(begin)] + "\n" + section + "\n" + text[j:])


# ---- command line -------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


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
    budget = QUICK if quick else Budget(seconds=0.5, min_reps=10, rounds=5, overhead_calls=0, overhead_rounds=0)
    timer = _time_cuda if device == "cuda" else _time_cpu
    sync = _sync(device)
    out = []
    for b in BENCHES:
        if b.name != b.op or not hasattr(_OPS, b.op) or len(b.quick_dims) > 2:
            continue
        for dims in ((32, 64) if len(b.quick_dims) == 2 else (2048,), b.quick_dims):
            out.append(_vmap_case(b, dims, device, entries, budget, timer, sync))
    return out


def _vmap_case(b: Bench, dims: tuple, device: str, entries: int, budget: Budget, timer, sync) -> dict:
    dtype = _BF16 if device == "cuda" else _F32
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
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        from .bench_model import main as model_main

        return model_main(argv)
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
    from .__main__ import require

    require("python -m customops bench", {"rich": "cli", "tqdm": "cli", **({"matplotlib": "cli"} if args.plot else {})})

    cuda_ok = torch.cuda.is_available() and customops.build_info()["cuda"]
    device = args.device or ("cuda" if cuda_ok else "cpu")
    if device == "cuda" and not cuda_ok:
        p.error("--device cuda: " + ("customops was built without CUDA" if torch.cuda.is_available()
                                     else "no CUDA device is available"))
    if args.vmap:
        rows = vmap_report(device, args.vmap, args.quick)
        print(f"vmap over {args.vmap} entries on {device} (forward, median ms):")
        print(f"{'op':14s} {'entry':>10s} {'vmap':>9s} {'loop':>9s} {'one call':>9s} {'loop/vmap':>9s} {'vmap/one':>9s}")
        for r in rows:
            print(f"{r['op']:14s} {'x'.join(map(str, r['entry'])):>10s} {r['vmap']:9.3f} {r['loop']:9.3f} "
                  f"{r['one call']:9.3f} {r['loop'] / r['vmap']:8.1f}x {r['vmap'] / r['one call']:8.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    unknown = [o for o in args.ops if o not in BENCHES_BY_NAME]
    if unknown:
        p.error(f"unknown op {', '.join(unknown)}; one of {', '.join(BENCHES_BY_NAME)}")
    report = run(list(dict.fromkeys(args.ops)) or None, device, args.dtype, args.quick,
                 progress=not args.no_progress)
    env = [f"{k}={v}" for k, v in report["meta"]["env"].items()]
    report["meta"]["command"] = " ".join([*env, "python -m customops bench", *argv])
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    if args.doc:
        image = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.doc))) if args.plot else None
        update_doc(args.doc, args.section or device, markdown(report, image))
    return 1 if report["failures"] else 0
