"""CUDA-only checks: kernels run on the current stream (a non-default stream and CUDA graphs catch
launches on the wrong one), and indexing past 2^31 elements."""

import pytest
import torch

import customops
from customops import testing as T

pytestmark = pytest.mark.skipif("cuda" not in T.devices(), reason="needs CUDA and a CUDA build of customops")

OPS = [pytest.param(o, id=o.name) for o in T.OPS]


def _big_sample(info):
    return info.batch(torch.device("cuda"), torch.float32, 1 << 14)


@pytest.mark.parametrize("info", OPS)
def test_non_default_stream(info):
    s = info.batch(torch.device("cuda"), torch.float32, 1 << 14)
    want = [t.clone() for t in T._outputs(T._call(info, T.clone_sample(s)))]
    late = T.clone_sample(s)
    for t in late.args:
        if isinstance(t, torch.Tensor):
            t.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the inputs get their values late on this stream
        for dst, src in zip(late.args, s.args):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        got = T._outputs(T._call(info, late))
    side.synchronize()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} on a side stream: {m}")


@pytest.mark.parametrize("info", [p for p in OPS if not p.values[0].name.endswith(".out")])
def test_cuda_graphs_reduce_overhead(info):
    torch._dynamo.reset()
    op = info.run
    compiled = torch.compile(lambda *a: op(*a), mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        s = info.batch(torch.device("cuda"), torch.float32, 64)
        want = T._outputs(op(*T.clone_sample(s).args))
        got = T._outputs(compiled(*s.args))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} under CUDA graphs: {m}")


def test_more_than_2_31_elements():
    n = (1 << 31) + 1000
    need = 3 * n * 2  # three bf16 tensors
    if torch.cuda.mem_get_info()[0] < need * 1.2:
        pytest.skip("not enough GPU memory")
    a = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    b = torch.full((n,), 2.0, device="cuda", dtype=torch.bfloat16)
    a[-7:] = 3.0
    y = customops.muladd(a, b, 1.0)
    assert y[-7:].eq(7.0).all() and y[:5].eq(3.0).all() and y[(1 << 31) - 3:(1 << 31) + 3].eq(3.0).all()
    del y
    y = customops.silu_mul(a, b)
    assert torch.isclose(y[-1].float(), torch.tensor(3.0 / (1 + torch.exp(torch.tensor(-3.0))) * 2, device="cuda"),
                         rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [
    (3, 4096 * 8 + 8),  # float32: longer than the forward's registers (8 vectors x 1024 threads): loop kernel
    (5, 8193),  # odd: scalar loads, forward loop kernel, backward past its cached vectors
    (7, 4097),  # odd: forward registers with K = 8
    (40000, 64),  # more rows than the backward has blocks: grid-stride, its ring of rows wraps often
    (6, 16384),  # bfloat16: the backward ring of rows in shared memory at its largest; float32: too large for it
    (9, 8192),  # the backward ring with 2 (bfloat16) and 4 (float32) vectors a thread
    (9, 8512),  # ... and with some threads' last vector past the row
    (1, 24),  # fewer vectors than threads
])
def test_rms_norm_kernel_paths(rows, n, dtype):
    x = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    y = customops.rms_norm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(dx.double(), dx64, **tol)
    # dw sums `rows` products: its rounding error grows about as the square root of their number.
    torch.testing.assert_close(dw.double(), dw64, atol=tol["atol"] * 4 * rows**0.5, rtol=tol["rtol"] * 4)
    # add_rms_norm: the backward also reads the gradient that reached sum (a third row in the ring).
    r = torch.randn(rows, n, device="cuda", dtype=dtype)
    ds = torch.randn(rows, n, device="cuda", dtype=dtype)
    y, s = customops.add_rms_norm(x, r, w, 1e-6)
    dx, dw = torch.autograd.grad((y, s), (x, w), (dy, ds))
    s64 = (x.detach() + r).double().requires_grad_()
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    ds64, dw64 = torch.autograd.grad(y64, (s64, w64), dy.double())
    torch.testing.assert_close(dx.double(), ds64 + ds.double(), **tol)
    torch.testing.assert_close(dw.double(), dw64, atol=tol["atol"] * 4 * rows**0.5, rtol=tol["rtol"] * 4)


def _dense_linear_case(m, n, k, dtype, prologue, bias, residual):
    """fused_linear's inputs for m rows of a dense [n, k] weight (seeded; x twice as wide for SwiGLU,
    a float32 norm weight for RMSNorm), and its float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    r = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) if residual else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.float32, generator=g)) if prologue == "rms_norm" else None
    ref = T.OPS_BY_NAME["fused_linear"].ref(*(t.double() if t is not None else None for t in (x, w, b, r)),
                                            prologue=prologue, norm_weight=None if nw is None else nw.double())
    return x, w, b, r, nw, ref


@pytest.mark.parametrize("constant_weight", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n, k, dtype, prologue, bias, residual", [
    (2048, 8192, torch.bfloat16, "swiglu", False, True),  # a decode step's down product: 4 chunks a row
    (14001, 1056, torch.bfloat16, "rms_norm", True, False),  # rows of 2112 bytes, an odd row count
    (3001, 2312, torch.float32, "rms_norm", True, True),  # 3 chunks a row, the last one short
    (4099, 4096, torch.float16, "none", False, True),
])
def test_fused_linear_kernel_paths(monkeypatch, m, n, k, dtype, prologue, bias, residual, constant_weight):
    """Weights of 25-34 MB: the Hopper kernel (1-2 rows: a producer streaming the weight into shared
    memory in chunks of rows) and the register kernel (4 rows), which bf16 and half take at 2-4 rows
    only where the tensor cores do not (CUSTOMOPS_LINEAR_DENSE_MMA=0 here; the tensor cores' test is
    below); small weights are the op table's."""
    monkeypatch.setenv("CUSTOMOPS_LINEAR_DENSE_MMA", "0")
    x, w, b, r, nw, ref = _dense_linear_case(m, n, k, dtype, prologue, bias, residual)
    y = customops.fused_linear(x, w, b, r, prologue=prologue, norm_weight=nw, constant_weight=constant_weight)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y.double(), ref, **tol)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 12, 16, 24, 40])
@pytest.mark.parametrize("n, k, dtype, prologue, bias, residual, group", [
    (1000, 4096, torch.bfloat16, "rms_norm", True, False, 128),  # vectors of 16 / 32 weights, 2 / 1 segments a row
    (2064, 14336, torch.bfloat16, "swiglu", False, True, 128),  # a down product of Llama-3-8B: 8 rows of x fill shared memory
    (48, 256, torch.float16, "rms_norm", True, True, 64),  # a float32 int4 scale (below), groups of 2 vectors:
    # the register kernel, 8 rows a launch
    (48, 208, torch.bfloat16, "swiglu", False, True, 16),  # fp8: in_features not whole chunks (the register
    # kernel); int4 groups of 16 (ATen's dequantized product)
    (40, 512, torch.float16, "rms_norm", False, True, 128),  # a last tile of 8 features
    (1024, 256, torch.bfloat16, "none", True, True, 128),  # more outputs than inputs: fp8's 9-16 rows on the
    # FP8 tensor cores
])
def test_fused_linear_quantized_kernel_paths(fmt, m, n, k, dtype, prologue, bias, residual, group):
    """A float8 or int4 weight through the tensor-core kernel (up to 16 float8 rows, 8 where there are
    more outputs than inputs, 16 int4 rows where quant_gemm_kernel takes more, else 32, in
    launches of up to 8 rows or one of 9-16, the wide kernel; the register kernel where it does not
    apply), and more rows: float8 on the FP8 tensor cores (the rows rounded to float8: their own,
    larger, error) where they apply but up to 64 rows with no more outputs than inputs, int4 and other
    float8 decoded in a tensor-core product's tiles
    (quant_gemm_kernel: in_features a multiple of 64; int4 scales in x's dtype, groups of 64k) or
    dequantized into a copy for cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g) / k**0.5
    q, s = customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w.to(dtype), group)
    if fmt == "int4" and n == 48:
        s = s.float()
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    r = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) if residual else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.float32, generator=g)) if prologue == "rms_norm" else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = customops.fused_linear(x, q, b, r, prologue=prologue, norm_weight=nw, constant_weight=True, weight_scale=s)
    ops = {e.name for e in prof.events()}
    tiles = n <= k and m <= 64 and k % 64 == 0  # (float8: quant_gemm_kernel on Hopper too)
    tensor_cores = (fmt == "fp8" and (m > 16 or (m > 8 and n > k)) and n % 16 == 0 and not tiles
                    and torch.cuda.get_device_capability()[0] >= 9)
    assert ("aten::_scaled_mm" in ops) == tensor_cores, sorted(ops)
    ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q, *(t.double() if t is not None else None for t in (b, r)),
                                            prologue=prologue, norm_weight=None if nw is None else nw.double(),
                                            weight_scale=s)
    assert y.dtype == dtype and y.shape == ref.shape
    # relative to the outputs' spread: float8 activations round each to 2^-4 of itself
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < (0.05 if tensor_cores else 0.01), err


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("m, n, k, prologue, dtype, group", [
    (1, 1000, 4096, "rms_norm", torch.bfloat16, 128),  # one tile a block (63 tiles), a last tile of 8 features
    (3, 1000, 4096, "rms_norm", torch.bfloat16, 128),
    (8, 1000, 4096, "rms_norm", torch.bfloat16, 128),
    (1, 40, 14336 + 128, "swiglu", torch.bfloat16, 128),  # the last slab of a row partial
    (3, 40, 14336 + 128, "swiglu", torch.bfloat16, 128),
    # 265 tiles, two or three a block, the last one 6 features (rows g = 6, 7 of it past N too); fp8's 7
    # slabs a tile go round the ring of 4 stages more than twice; float16 x, float32 int4 scales in
    # groups of 256 (two chunks a group)
    (2, 4230, 14336, "none", torch.float16, 256),
])
def test_fused_linear_quantized_streams_through_the_tensor_memory_accelerator(monkeypatch, fmt, m, n, k, prologue,
                                                                              dtype, group):
    """On Hopper a float8 weight's few rows stream through the tensor memory accelerator into the
    tensor cores (gemv_tma_mma_kernel; an int4 weight with CUSTOMOPS_LINEAR_QUANT_TMA=1): a tile's
    rows in slabs of 2 KiB, four stages in a ring; CUSTOMOPS_LINEAR_QUANT_TMA=0 takes the kernel
    that loads through registers (gemv_mma_kernel, int4's default), which computes the same sums.
    CUSTOMOPS_LINEAR_QUANT_WARPS picks 8 or 16 consumer warps (default 16; any other count is an
    error). The weight is read before the kernel ahead ends only with constant_weight (one run
    without)."""
    if torch.cuda.get_device_capability()[0] < 9 or not any(
            a.startswith("90") for a in customops.build_info()["cuda_archs"].split(";")):
        pytest.skip("the kernel runs on compute capability 9.0+ with sm_90 code only")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g) / k**0.5
    q, s = customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w.to(dtype), group)
    if fmt == "int4" and dtype == torch.float16:
        s = s.float()
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    r = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
    nw = torch.ones(k, device="cuda", dtype=dtype) if prologue == "rms_norm" else None
    ys = {}
    for switch, warps, constant in (("", "", True), ("1", "", True), ("1", "", False), ("1", "8", True),
                                    ("0", "", True)):
        monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_TMA", switch)
        monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_WARPS", warps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = customops.fused_linear(x, q, b, r, prologue=prologue, norm_weight=nw, constant_weight=constant,
                                       weight_scale=s)
            torch.cuda.synchronize()
        ys.setdefault(switch + warps, y)
        names = " ".join(e.name for e in prof.events())
        tma = switch == "1" or (switch == "" and fmt == "fp8")
        assert ("gemv_tma_mma_kernel" in names) == tma, names
        assert ("gemv_mma_kernel" in names) == (not tma), names
        if switch == "1" and not constant:
            assert torch.equal(y, ys["1"])  # (the same sums in the same order)
    ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q, b.double(), r.double(), prologue=prologue,
                                            norm_weight=None if nw is None else nw.double(), weight_scale=s)
    for y in ys.values():
        assert ((y.double() - ref).norm() / ref.norm()).item() < 0.01
    # the same products in another order of the same float32 sums: within the output dtype's rounding
    torch.testing.assert_close(ys["1"], ys["0"], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ys["18"], ys["1"], atol=2e-2, rtol=2e-2)
    monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_TMA", "1")
    monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_WARPS", "12")
    with pytest.raises(RuntimeError, match="customops.fused_linear: CUSTOMOPS_LINEAR_QUANT_WARPS must be 8 or 16"):
        customops.fused_linear(x, q, b, r, prologue=prologue, norm_weight=nw, weight_scale=s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, prologue, bias, residual", [
    (1, 1000, 4096, "rms_norm", True, False),  # a last tile of 8 features
    (4, 1000, 4096, "rms_norm", True, False),  # x in 32 KiB: the tensor cores by default
    (2, 2064, 14336, "swiglu", False, True),  # a down product's 2 rows, x in 56 KiB: also by default
    (3, 2064, 14336, "swiglu", False, True),  # 3 rows in 84 KiB: the register kernel by default
    (5, 1000, 4096, "rms_norm", True, False),  # past the register kernel's 4 rows
    (8, 4096, 4096, "none", False, True),
    (7, 2064, 14336, "swiglu", False, True),  # x's 7 rows fill most of shared memory
])
def test_fused_linear_dense_weight_through_the_tensor_cores(monkeypatch, dtype, m, n, k, prologue, bias, residual):
    """A bfloat16 or half weight's 2-4 rows go through the quantized weights' tensor-core kernel
    (gemv_mma_kernel, nothing to decode) where x takes at most 64 KiB; CUSTOMOPS_LINEAR_DENSE_MMA=1
    sends it 1-8 rows wherever it applies, =0 none. Norm, SwiGLU, bias and residual fused; within the
    output dtype's rounding of float64 every way."""
    x, w, b, r, nw, ref = _dense_linear_case(m, n, k, dtype, prologue, bias, residual)
    by_default = 2 <= m <= 4 and m * k * 2 <= 64 * 1024
    for switch, mma in (("1", True), ("0", False), ("", by_default)):
        monkeypatch.setenv("CUSTOMOPS_LINEAR_DENSE_MMA", switch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = customops.fused_linear(x, w, b, r, prologue=prologue, norm_weight=nw, constant_weight=True)
            torch.cuda.synchronize()
        assert any("gemv_mma_kernel" in e.name for e in prof.events()) == mma, switch
        torch.testing.assert_close(y.double(), ref, atol=3e-2, rtol=2e-2, msg=f"switch {switch!r}")


def _one_element_in(t):
    """t's values in a buffer one element past a 16-byte boundary (as a flat buffer's views are)."""
    buf = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    moved = buf[1:].view(t.shape).copy_(t)
    assert moved.is_contiguous() and moved.data_ptr() % 16 != 0
    return moved


@pytest.mark.parametrize("operand", ["norm_weight", "x"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("m", [1, 4])
def test_fused_linear_reads_an_operand_one_element_into_its_buffer(operand, fmt, m):
    """A norm weight of x's dtype is read as 16-byte vectors by every decoding kernel's prologue
    where it is aligned, element by element where it is one element into a buffer; x, which they
    read in 16-byte packs, is copied first where it is (contiguous() returns such an x as it is, a
    review found). Either way the same output as aligned operands', not a misaligned load."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    q, s = (w, None) if fmt == "bf16" else customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w)
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    assert x.data_ptr() % 16 == 0 and nw.data_ptr() % 16 == 0
    ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q.double() if s is None else q, None, None,
                                            prologue="rms_norm", norm_weight=nw.double(), weight_scale=s)
    moved = {"x": x, "norm_weight": nw, operand: _one_element_in(x if operand == "x" else nw)}
    ys = [customops.fused_linear(a["x"], q, None, None, prologue="rms_norm", norm_weight=a["norm_weight"],
                                 constant_weight=True, weight_scale=s) for a in ({"x": x, "norm_weight": nw}, moved)]
    torch.cuda.synchronize()
    torch.testing.assert_close(ys[0].double(), ref, atol=3e-2, rtol=2e-2)
    assert torch.equal(ys[0], ys[1])


def _quantized_case(fmt, m, n, k, prologue, dtype, group, residual_transposed=False, device="cuda"):
    """A quantized product's operands (random, seeded) and its float64 reference: x, the quantized
    weight and its scale (int4 groups of 256 with float32 scales), bias, residual (a transposed view
    where asked), the norm weight, ref."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, 2 * k if prologue == "swiglu" else k, device=device, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g) / k**0.5
    b = torch.randn(n, device=device, dtype=dtype, generator=g)
    r = (torch.randn(n, m, device=device, dtype=dtype, generator=g).t() if residual_transposed
         else torch.randn(m, n, device=device, dtype=dtype, generator=g))
    nw = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype, generator=g) if prologue == "rms_norm" else None
    q, s = customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w, group)
    if fmt == "int4" and group == 256:
        s = s.float()
    ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q, b.double(), r.double(), prologue=prologue,
                                            norm_weight=None if nw is None else nw.double(), weight_scale=s)
    return x, q, s, b, r, nw, ref


def _profiled_product(x, q, s, b, r, prologue, nw):
    """fused_linear of a quantized case (constant weight) under the profiler: y and the names of the
    CUDA kernels it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = customops.fused_linear(x, q, b, r, prologue=prologue, norm_weight=nw, constant_weight=True, weight_scale=s)
        torch.cuda.synchronize()
    return y, [e.name for e in prof.events()]


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("m, n, k, prologue, dtype, group, auto_splits", [
    (1, 1000, 4096, "rms_norm", torch.bfloat16, 128, 1),  # split only when asked (x in 8 KiB)
    (3, 2064, 14336, "swiglu", torch.bfloat16, 128, 1),   # down's inputs, x in 84 KiB: two blocks an SM unsplit
    (4, 1000, 14336, "swiglu", torch.bfloat16, 128, 2),   # x in 112 KiB: one block an SM unless split
    (8, 1000, 14336, "swiglu", torch.bfloat16, 128, 4),   # 8 rows in one launch only as four ranges
    # a shorter last range (int4: 114 chunks, 29 + 29 + 29 + 27 when forced to four; two ranges by
    # themselves, the second from the middle of a group), half x, float32 int4 scales in groups of two
    # chunks, no prologue
    (6, 1000, 14336 + 256, "none", torch.float16, 256, 2),
])
def test_fused_linear_inputs_split_over_blocks(monkeypatch, fmt, m, n, k, prologue, dtype, group, auto_splits):
    """gemv_mma_kernel's k_splits: a quantized weight's inputs in 2 or 4 ranges over the blocks where
    x would leave room for one block an SM, each range's sums added (bias and residual once) by
    split_k_epilogue; chosen as expected, one launch for up to 8 rows, and within the unsplit kernel's
    error of float64 whatever the split."""
    x, q, s, b, r, nw, ref = _quantized_case(fmt, m, n, k, prologue, dtype, group)
    monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_TMA", "0")  # (fp8 through gemv_mma_kernel too)

    def run(splits):
        monkeypatch.setenv("CUSTOMOPS_LINEAR_K_SPLITS", str(splits))
        if splits == 0:
            monkeypatch.delenv("CUSTOMOPS_LINEAR_K_SPLITS")
        y, names = _profiled_product(x, q, s, b, r, prologue, nw)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        return err, sum("gemv_mma_kernel" in e for e in names), sum("split_k_epilogue" in e for e in names)

    unsplit = run(1)
    assert unsplit[0] < 0.01 and unsplit[2] == 0, unsplit
    err, launches, epilogues = run(0)
    # (the ranges chosen by themselves as listed where an SM has 228 KiB of shared memory, as H100s
    # and H200s do; fewer KiB leave room for fewer rows and split sooner)
    if torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor >= 228 * 1024:
        assert (launches, epilogues) == (1, 0 if auto_splits == 1 else 1), (launches, epilogues)
    assert err < max(1.5 * unsplit[0], 0.005), (err, unsplit)
    for splits in (2, 4):
        err, launches, epilogues = run(splits)
        assert (launches, epilogues) == (1, 1), (splits, launches, epilogues)
        assert err < max(1.5 * unsplit[0], 0.005), (splits, err, unsplit)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("m, n, k, prologue, dtype, group", [
    (9, 1000, 4096, "rms_norm", torch.bfloat16, 128),
    (16, 2064, 14336, "swiglu", torch.bfloat16, 128),  # x of 16 rows in ranges of the inputs
    # float32 int4 scales in groups of two chunks, half x, 3 tiles (the last of 8 features)
    (12, 40, 14336 + 256, "none", torch.float16, 256),
])
def test_fused_linear_9_to_16_rows_in_one_wide_launch(monkeypatch, fmt, m, n, k, prologue, dtype, group):
    """9-16 rows of a quantized weight's product in one launch of the wide tensor-core kernel (x the
    A operand, each weight decoded once for all rows; int4's scales passed between the lanes), within
    the 8-row launches' error of float64, bias and residual added once; CUSTOMOPS_LINEAR_WIDE=0 takes
    launches of up to 8 rows."""
    x, q, s, b, r, nw, ref = _quantized_case(fmt, m, n, k, prologue, dtype, group)

    def run(wide):
        monkeypatch.setenv("CUSTOMOPS_LINEAR_WIDE", "1" if wide else "0")
        y, names = _profiled_product(x, q, s, b, r, prologue, nw)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        return err, sum("gemv_mma_kernel" in e or "gemv_tma_mma_kernel" in e for e in names)

    narrow_err, narrow_launches = run(False)
    assert narrow_err < 0.01 and narrow_launches == 2, (narrow_err, narrow_launches)
    wide_err, wide_launches = run(True)
    assert wide_launches == 1, wide_launches
    assert wide_err < max(1.5 * narrow_err, 0.005), (wide_err, narrow_err)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("m, n, k, prologue, dtype, group, auto_splits", [
    (20, 1000, 4096, "swiglu", torch.bfloat16, 128, 8),  # a block of 32 rows (all 8 warps along N), 8 ranges
    (33, 999, 4096, "rms_norm", torch.bfloat16, 128, 4),  # one block of 64 rows, 33 of them; odd features;
    # 8 tiles: the inputs in ranges (int4 4, fp8 8: more would make the float32 sums outweigh the weight)
    (300, 12288, 512, "none", torch.float16, 64, 1),  # blocks of 128 rows (their tiles fill the SMs), the last of 44
    (300, 12289, 128, "none", torch.bfloat16, 64, 1),  # the same in bf16, two k-blocks, a last tile of 1 feature
    (40, 133, 64, "rms_norm", torch.float16, 64, 1),  # one k-block, fp16 blocks of 64 rows
    (40, 1000, 4352, "none", torch.bfloat16, 128, 4),  # 68 k-blocks: forced to 8 ranges, 7 of 9 and one of 5
    (130, 2064, 14336, "swiglu", torch.bfloat16, 128, 4),  # down's inputs, a last tile of 16 features
])
def test_fused_linear_quantized_prefill_decodes_in_the_tiles(monkeypatch, fmt, m, n, k, prologue, dtype, group,
                                                              auto_splits):
    """Past the decoding kernels' rows (here CUSTOMOPS_LINEAR_QUANT_MAX_ROWS=16) and up to 128 an int4
    product runs in quant_gemm_kernel, each weight decoded in the tiles of a tensor-core product (the
    dequantized copy's weights, bit for bit) instead of a dequantized copy for cuBLAS, past 128 rows
    the copy (CUSTOMOPS_LINEAR_INT4_GEMM=1: the kernel at any rows), and so does a float8 one where
    the FP8 tensor cores do not apply or CUSTOMOPS_LINEAR_FP8_GEMM=1 (its codes exact in bf16/fp16,
    the sums scaled at the end): within the
    copy's error of float64, bias and residual (a transposed view) added once in its epilogue, or in
    split_k_epilogue's where the inputs split over blocks (by themselves where the tiles leave SMs
    idle, as listed for 132 SMs; CUSTOMOPS_LINEAR_K_SPLITS=1 and =8 too). The product alone: int4
    within 0.2% of the copy's (CUSTOMOPS_LINEAR_INT4_GEMM=0: the same weights, sums in another
    order), float8 within 1% of float64 (x's rounding by the prologue). Hopper's deeper pipelines
    (CUSTOMOPS_LINEAR_TILE_STAGES=deep) give 4 stages' bits."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("mma.sync on bf16: compute capability 8.0+")
    x, q, s, b, r, nw, ref = _quantized_case(fmt, m, n, k, prologue, dtype, group, residual_transposed=True)
    monkeypatch.setenv("CUSTOMOPS_LINEAR_QUANT_MAX_ROWS", "16")

    def run(b=b, r=r):
        y, names = _profiled_product(x, q, s, b, r, prologue, nw)
        return y, {kern for kern in ("quant_gemm_kernel", "dequantize_kernel", "split_k_epilogue")
                   if any(kern in e for e in names)}

    if fmt == "int4" and m > 128:
        _, kernels = run()
        assert "dequantize_kernel" in kernels and "quant_gemm_kernel" not in kernels, kernels
    # (float8: on Hopper too, not the FP8 tensor cores)
    monkeypatch.setenv("CUSTOMOPS_LINEAR_INT4_GEMM" if fmt == "int4" else "CUSTOMOPS_LINEAR_FP8_GEMM", "1")
    y, kernels = run()
    assert "quant_gemm_kernel" in kernels and "dequantize_kernel" not in kernels, kernels
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:  # (H100, H200: the split as listed)
        assert ("split_k_epilogue" in kernels) == (auto_splits > 1), kernels
    assert y.dtype == dtype and y.shape == (m, n)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 0.01, err
    # (deeper cp.async pipelines where shared memory holds them: the same sums in the same order)
    monkeypatch.setenv("CUSTOMOPS_LINEAR_TILE_STAGES", "deep")
    assert torch.equal(run()[0], y)
    monkeypatch.delenv("CUSTOMOPS_LINEAR_TILE_STAGES")
    for splits in ("1", "8"):
        monkeypatch.setenv("CUSTOMOPS_LINEAR_K_SPLITS", splits)
        ys, _ = run()
        err = ((ys.double() - ref).norm() / ref.norm()).item()
        assert err < 0.01, (splits, err)
    monkeypatch.delenv("CUSTOMOPS_LINEAR_K_SPLITS")
    product, _ = run(None, None)
    if fmt == "fp8":
        alone = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q, None, None, prologue=prologue,
                                                  norm_weight=None if nw is None else nw.double(), weight_scale=s)
        err = ((product.double() - alone).norm() / alone.norm()).item()
        assert err < 0.01, err
        return
    monkeypatch.setenv("CUSTOMOPS_LINEAR_INT4_GEMM", "0")
    copy, kernels = run(None, None)
    assert "dequantize_kernel" in kernels and "quant_gemm_kernel" not in kernels, kernels
    diff = ((product.double() - copy.double()).norm() / copy.double().norm()).item()
    assert diff < 2e-3, diff


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "swiglu"])
def test_fused_linear_fp8_prefill_quantizes_the_prologue_s_rows_from_any_x(prologue):
    """Past the decoding kernels' rows a float8 product runs on the FP8 tensor cores after one kernel
    that computes prologue(x)'s rows and quantizes them (quantize_rows_kernel, reading x by 16-byte
    packs): x one element into a buffer, or rows a stride of their own apart, gives what a copy of x
    gives, within the float8 rows' error of float64."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 tensor cores: compute capability 9.0+")
    g = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 80, 256, 512  # (up to 64 rows, no more outputs than inputs: quant_gemm_kernel)
    k_in = 2 * k if prologue == "swiglu" else k
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    q, s = customops.quantize_fp8(w)
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g) if prologue == "rms_norm" else None
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    buf = torch.randn(m * k_in + 1, device="cuda", dtype=torch.bfloat16, generator=g)
    offset = buf[1:].view(m, k_in)
    strided = torch.randn(m, k_in + 8, device="cuda", dtype=torch.bfloat16, generator=g)[:, :k_in]
    assert offset.data_ptr() % 16 != 0 and not strided.is_contiguous()
    for x in (offset, strided):
        y = customops.fused_linear(x, q, b, r, prologue=prologue, norm_weight=nw, weight_scale=s)
        assert torch.equal(y, customops.fused_linear(x.clone(), q, b, r, prologue=prologue, norm_weight=nw,
                                                     weight_scale=s))
        ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), q, b.double(), r.double(), prologue=prologue,
                                                norm_weight=None if nw is None else nw.double(), weight_scale=s)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 0.05, err


def test_fused_linear_under_deterministic_algorithms_sums_in_one_order():
    """The Hopper kernel adds its warps' partial sums in shared memory by atomics (order varies run to
    run); under torch.use_deterministic_algorithms the register kernel runs instead, same values, the
    same bits each time."""
    if torch.cuda.get_device_capability()[0] < 9 or not any(
            a.startswith("90") for a in customops.build_info()["cuda_archs"].split(";")):
        pytest.skip("the Hopper kernel runs on compute capability 9.0+ with sm_90 code only")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16, generator=g) / 8192**0.5
    ran = {}
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                y = customops.fused_linear(x, w)
                torch.cuda.synchronize()
            if deterministic:
                assert torch.equal(customops.fused_linear(x, w), y)
        finally:
            torch.use_deterministic_algorithms(False)
        ran[deterministic] = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=3e-2, rtol=2e-2)
    assert any("gemv_tma_kernel" in n for n in ran[False]), ran[False]
    assert not any("gemv_tma_kernel" in n for n in ran[True]) and any("gemv_kernel" in n for n in ran[True]), ran[True]


def test_rope_cache_write_runs_one_kernel_and_writes_no_row_outside_the_cache():
    """A decode step's layout (q, k, v views of one qkv projection, HF's [B, T, D] cos and sin)
    takes the one-kernel path; a sequence whose last row falls outside the cache (start read on the
    device) gets its rotated q and the rows inside written, nothing past the cache (the op's
    contract on CUDA, where it cannot raise); a cos that starts mid-pack takes the two ops, with the
    same values."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, hq, hkv, d, s = 2, 3, 8, 2, 128, 6
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([hq, hkv, hkv], dim=2))
    buf = torch.randn(b * t * d + 1, device="cuda", dtype=torch.bfloat16, generator=g)
    cos, sin = buf[:-1].view(b, t, d).cos(), buf[:-1].view(b, t, d).sin()
    start = torch.tensor([1, 4], device="cuda")  # the second's 3 rows would end past the 6 positions
    kc, vc = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k0, v0 = kc.clone(), vc.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        got = customops.rope_cache_write(kc, vc, q, k, v, cos, sin, start)
        torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("rope_cache_write_kernel" in n for n in names) and not any("rope_kernel" in n for n in names), names
    q_ref, k_ref = customops.rope(q, k, cos, sin)
    torch.testing.assert_close(got, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(kc[0, :, 1:4], k_ref[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(vc[0, :, 1:4], v[0], atol=0, rtol=0)
    torch.testing.assert_close(kc[1, :, 4:], k_ref[1, :, :2], atol=1e-2, rtol=1e-2)  # positions 4 and 5, not 6
    torch.testing.assert_close(vc[1, :, 4:], v[1, :, :2], atol=0, rtol=0)
    for c, c0 in ((kc, k0), (vc, v0)):
        torch.testing.assert_close(c[1, :, :4], c0[1, :, :4], atol=0, rtol=0)
        torch.testing.assert_close(c[0, :, [0, 4, 5]], c0[0, :, [0, 4, 5]], atol=0, rtol=0)
    # cos and sin starting 2 bytes into a 16-byte pack: the two ops, not a misaligned load
    cos1, sin1 = buf[1:].view(b, t, d).cos(), buf[1:].view(b, t, d).sin()
    cos1, sin1 = torch.empty_like(buf)[1:].view(b, t, d).copy_(cos1), torch.empty_like(buf)[1:].view(b, t, d).copy_(sin1)
    kc2 = k0.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        got = customops.rope_cache_write(kc2, vc.clone(), q, k, v, cos1, sin1, torch.tensor([0, 0], device="cuda"))
        torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("rope_cache_write_kernel" in n for n in names), names
    q_ref, k_ref = customops.rope(q, k, cos1, sin1)
    torch.testing.assert_close(got, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(kc2[:, :, :t], k_ref, atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 4])
def test_fused_linear_reads_a_weight_written_just_before(m):
    """A weight computed by the kernel just before the product (rope here, which lets its successor
    launch before it ends) is read as written: without constant_weight the product waits for that
    kernel before its first weight load. 32 MB: the Hopper kernel at 1 row, the register one at 4."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s, d = 4096, 128
    cos = torch.randn(1, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sin = torch.randn(1, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(m, s, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for i in range(4):  # a new weight each time, in memory the last one may still hold
        q = torch.randn(1, 32, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        w = customops.rope(q, k, cos, sin)[0].view(s, s)  # 32 x 4096 x 128 = 4096 x 4096
        y = customops.fused_linear(x, w)
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=3e-2, rtol=2e-2, msg=f"weight {i}")
