"""The op benchmarks' registry, :data:`BENCHES`: per op (or way of calling it) its inputs, customops'
call, the eager code that torch.compile compiles too, Liger-Kernel's, the minimum bytes it moves,
its shapes and the goals it is held to. A new op benchmark is one row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F

import customops


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
OVERHEAD_MAX = 1.5  # customops' per-call time on tiny tensors, as a multiple of the ATen op's
IMPL_LABEL = {"customops": "customops", "customops_out": "customops out=", "eager": "eager",
              "compile": "torch.compile", "liger": "Liger-Kernel", "matmuls": "its matmuls (torch.mm)"}
