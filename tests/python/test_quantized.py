"""Quantized weights (issue 52): quantize_fp8 and quantize_int4, and fused_linear reading their
weights (float8 E4M3 with a float32 scale per output feature; int4 two a byte with a scale per
group of inputs). fused_linear's quantized samples run through the op table (test_ops,
test_subsystems, test_fuzz); the quantizers are checked here: their values against the rounding
they promise, their errors, opcheck, torch.compile and torch.export."""

from __future__ import annotations

import pytest
import torch

import customops
from conftest import DEVICES
from customops.testing.references import _dequantized_ref, _quantize_fp8_ref, _quantize_int4_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_fp8_rounds_each_row_to_its_scale(device, dtype):
    w = torch.randn(40, 96, device=device, dtype=dtype) * torch.logspace(-3, 2, 40, device=device, dtype=dtype)[:, None]
    w[3] = 0  # a row of zeros: scale 1, weight 0
    q, s = customops.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (40,)
    want_q, want_s = _quantize_fp8_ref(w)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert s[3] == 1 and not q[3].float().any()
    # every element within half an E4M3 step: a relative 2^-4, or scale * 2^-10 for subnormals
    back = q.float() * s[:, None]
    err = (back - w.float()).abs()
    assert bool((err <= w.float().abs() * 2 ** -4 + s[:, None] * 2 ** -10).all())
    # each row's largest magnitude is exact: it is 448 x its scale
    torch.testing.assert_close(back.abs().amax(1), w.float().abs().amax(1), rtol=2 ** -20, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_fp8_says_what_it_cannot_take(device):
    op = "customops::quantize_fp8"
    with pytest.raises(RuntimeError, match=f"{op}: weight has dtype Long"):
        customops.quantize_fp8(torch.ones(2, 2, dtype=torch.long, device=device))
    with pytest.raises(RuntimeError, match=rf"{op}: expected weight of shape \[out_features, in_features\]"):
        customops.quantize_fp8(torch.ones(4, device=device))
    with pytest.raises(RuntimeError, match=f"{op}: weight holds NaN or infinite values"):
        customops.quantize_fp8(torch.tensor([[1.0, float("inf")]], device=device))
    with pytest.raises(RuntimeError, match=f"{op} is not differentiable"):
        customops.quantize_fp8(torch.ones(2, 2, device=device, requires_grad=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_quantized_weight_is_frozen_and_named_in_errors(device):
    op = "customops::fused_linear"
    q, s = customops.quantize_fp8(torch.randn(8, 16, device=device))
    x = torch.randn(2, 16, device=device)
    with pytest.raises(RuntimeError, match=f"{op}: weight is float8_e4m3fn but no weight_scale is given"):
        customops.fused_linear(x, q)
    with pytest.raises(RuntimeError, match=f"{op}: weight_scale must be float32"):
        customops.fused_linear(x, q, weight_scale=s.double())
    with pytest.raises(RuntimeError, match=rf"{op}: expected weight_scale of shape \[8\]"):
        customops.fused_linear(x, q, weight_scale=s[:4])
    with pytest.raises(RuntimeError, match=f"{op}: with weight_scale, weight must be float8_e4m3fn"):
        customops.fused_linear(x, q.float(), weight_scale=s)
    with pytest.raises(RuntimeError, match=f"{op}: a quantized weight is frozen"):
        customops.fused_linear(x, q, weight_scale=s.clone().requires_grad_())
    # x, bias and residual still take gradients (adapters trained beside a frozen quantized base)
    x.requires_grad_()
    b = torch.zeros(8, device=device, requires_grad=True)
    customops.fused_linear(x, q, b, weight_scale=s).square().sum().backward()
    assert x.grad is not None and b.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_fp8_passes_opcheck_compile_and_export(device):
    w = torch.randn(12, 32, device=device)
    torch.library.opcheck(torch.ops.customops.quantize_fp8.default, (w,))

    def f(w):
        return customops.quantize_fp8(w)

    got = torch.compile(f, fullgraph=True, dynamic=True)(w)
    want = f(w)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])

    class M(torch.nn.Module):
        def forward(self, w, x):
            q, s = customops.quantize_fp8(w)
            return customops.fused_linear(x, q, weight_scale=s)

    x = torch.randn(3, 32, device=device)
    ep = torch.export.export(M(), (w, x))
    torch.testing.assert_close(ep.module()(w, x), M()(w, x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_int4_rounds_each_group_to_its_scale(device, dtype):
    w = torch.randn(6, 256, device=device, dtype=dtype) * torch.logspace(-2, 1, 6, device=device, dtype=dtype)[:, None]
    w[2, 128:] = 0  # a group of zeros: scale 1, elements 0
    packed, scale = customops.quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 128) and scale.dtype == dtype and scale.shape == (6, 2)
    want_p, want_s = _quantize_int4_ref(w)
    assert torch.equal(packed, want_p) and torch.equal(scale, want_s)
    assert scale[2, 1] == 1 and bool((packed[2, 64:] == 0x88).all())
    back = _dequantized_ref(packed, scale, torch.float64)
    # within half a step of each element, but the largest that a smaller scale clipped (the codes
    # rounded against the scale as stored in dtype)
    step = scale.double().repeat_interleave(128, 1)
    amax = w.double().abs().reshape(6, 2, 128).amax(2).repeat_interleave(128, 1)
    bound = torch.maximum(step * 0.5, amax - 7 * step) * (1 + 2 ** -20)
    assert bool(((back - w.double()).abs() <= bound).all())
    # the search: no group's squared error above that of the plain largest magnitude / 7 (in float32;
    # a half type's candidates are that rounded to it, which moves each element by up to 1/64 of a step)
    plain = (w.double().abs().reshape(6, 2, 128).amax(2) / 7).clamp_min(1e-30).repeat_interleave(128, 1)
    plain_back = (w.double() / plain).round().clamp(-8, 7) * plain
    per_group = lambda b: ((b - w.double()) ** 2).reshape(6, 2, 128).sum(2)  # noqa: E731
    margin = 1e-3 if dtype == torch.float32 else 2 ** -3
    assert bool((per_group(back) <= per_group(plain_back) * (1 + margin) + 1e-12).all())
    # group size 32 packs the same way, with 8 scales a row
    p32, s32 = customops.quantize_int4(w, 32)
    assert s32.shape == (6, 8) and torch.equal(p32, _quantize_int4_ref(w, 32)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_quantizers_take_tiny_weights_and_big_ones(device):
    """A float16 group of magnitudes whose scale would round to 0 in float16 keeps its values (the
    scale no smaller than float16's smallest subnormal), and so a row of fp8 whose largest
    magnitude over 448 is 0 in float32 (not NaN codes); a weight larger than the quantizers' slice
    of rows quantizes as its slices do, rows being independent."""
    w = torch.full((2, 128), 1e-7, dtype=torch.float16, device=device)
    w[1, ::2] = -3e-8
    packed, scale = customops.quantize_int4(w)
    assert bool((scale > 0).all())
    back = _dequantized_ref(packed, scale, torch.float64)
    assert bool(((back - w.double()).abs() <= 0.5 * scale.double().repeat_interleave(128, 1) + 1e-30).all())
    q, s = customops.quantize_fp8(torch.tensor([[1e-44, -5e-45, 0.0]], device=device))
    assert s.item() == 1 and not q.float().isnan().any()
    big = torch.randn(4200, 1024, device=device)  # (4.3M elements: two slices of rows)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for quantize in (customops.quantize_fp8, customops.quantize_int4):
        whole = quantize(big)
        parts = [quantize(big[:2000]), quantize(big[2000:])]
        for got, want in zip(whole, (torch.cat([p[i] for p in parts]) for i in range(2))):
            assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_int4_says_what_it_cannot_take(device):
    op = "customops::quantize_int4"
    with pytest.raises(RuntimeError, match=rf"{op}: weight's in_features \(100\) must be a positive multiple of "
                                           rf"group_size \(128\)"):
        customops.quantize_int4(torch.ones(2, 100, device=device))
    with pytest.raises(RuntimeError, match=f"{op}: group_size must be an even number >= 2, but it is 3"):
        customops.quantize_int4(torch.ones(2, 6, device=device), 3)
    with pytest.raises(RuntimeError, match=f"{op}: weight holds NaN or infinite values"):
        customops.quantize_int4(torch.full((1, 128), float("nan"), device=device))
    q, s = customops.quantize_int4(torch.randn(8, 64, device=device), 32)
    with pytest.raises(RuntimeError, match=r"customops::fused_linear: weight_scale's 3 groups do not divide the 64"):
        customops.fused_linear(torch.randn(2, 64, device=device), q, weight_scale=torch.ones(8, 3, device=device))
    with pytest.raises(RuntimeError, match=r"customops::fused_linear: x's last dim must be weight's in_features \(64\)"):
        customops.fused_linear(torch.randn(2, 32, device=device), q, weight_scale=s)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_int4_passes_opcheck_compile_and_export(device):
    w = torch.randn(12, 64, device=device)
    torch.library.opcheck(torch.ops.customops.quantize_int4.default, (w, 32))

    class M(torch.nn.Module):
        def forward(self, w, x):
            q, s = customops.quantize_int4(w, 32)
            return customops.fused_linear(x, q, weight_scale=s)

    x = torch.randn(3, 64, device=device)
    want = M()(w, x)
    torch.testing.assert_close(torch.compile(M(), fullgraph=True, dynamic=True)(w, x), want)
    torch.testing.assert_close(torch.export.export(M(), (w, x)).module()(w, x), want)


@pytest.mark.parametrize("k", [88, 128])
@pytest.mark.parametrize("rows", [1, 5, 40], ids=lambda r: f"{r}-rows")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_code_of_a_quantized_weight_reads_as_its_value(rows, dtype, k):
    """fused_linear on the CPU reads the codes as stored (decoding rows, the codes decoded in
    vectors; many rows, blocks of the weight dequantized for BLAS): output feature j of a weight
    whose row j repeats one code, times x of ones, is k times that code's value times the scale,
    exactly, for each of the 256 float8 codes (NaN ones give NaN) and the 16 int4 ones. k = 88:
    whole vectors and a tail at every width the CPU kernels take (8, 16 or 32 floats or halves);
    128: whole vectors of one bfloat16 row's kernels (32 float8 codes, int4 groups of 64 inputs)."""
    x = torch.ones(rows, k, dtype=dtype)
    fp8 = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, k).contiguous().view(torch.float8_e4m3fn)
    scale = torch.full((256,), 0.5)
    got = torch.ops.customops.fused_linear(x, fp8, None, None, "none", None, 1e-6, True, scale)
    want = (fp8.float()[:, 0] * 0.5 * k).to(dtype)
    torch.testing.assert_close(got, want.expand(rows, 256), rtol=0, atol=0, equal_nan=True)
    assert got[:, [0x7F, 0xFF]].isnan().all() and got.isnan().sum() == 2 * rows
    codes = torch.arange(16, dtype=torch.uint8)
    int4 = (codes | (codes << 4))[:, None].expand(16, k // 2).contiguous()
    int4_scale = torch.full((16, 2), 0.25, dtype=dtype)  # groups of k / 2 inputs
    got = torch.ops.customops.fused_linear(x, int4, None, None, "none", None, 1e-6, True, int4_scale)
    torch.testing.assert_close(got, ((codes.float() - 8) * 0.25 * k).to(dtype).expand(rows, 16), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 20], ids=lambda r: f"{r}-rows")
def test_a_quantized_product_keeps_zeros_infinities_and_large_scales(rows):
    """The CPU kernels multiply each dequantized weight as the reference does: a zero int4 weight
    under a large x gives 0 (not what is left of a sum of x taken off), an infinity in x reaches the
    result as one, and a scale near float's largest does not overflow before the sum is scaled."""
    op = torch.ops.customops.fused_linear
    zero = torch.full((1, 32), 0x88, dtype=torch.uint8)  # int4 codes 8: every weight 0
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0)) * 1000
    assert op(x, zero, None, None, "none", None, 1e-6, True, torch.ones(1, 1)).eq(0).all()
    one = zero.clone()
    one[0, 0] = 0x98  # the weight under x[:, 1] is 1
    x = torch.zeros(rows, 64)
    x[:, 1] = float("inf")
    assert op(x, one, None, None, "none", None, 1e-6, True, torch.ones(1, 1)).eq(float("inf")).all()
    ones = torch.ones(rows, 4)
    got = op(ones, torch.full((1, 2), 0x99, dtype=torch.uint8), None, None, "none", None, 1e-6, True,
             torch.full((1, 1), 1e32))
    torch.testing.assert_close(got, torch.full((rows, 1), 4e32))
    fp8 = torch.full((1, 4), 1, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2^-9 each
    got = op(ones, fp8, None, None, "none", None, 1e-6, True, torch.full((1,), 2e36))
    torch.testing.assert_close(got, torch.full((rows, 1), 4 * 2**-9 * 2e36))


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8], ids=lambda r: f"{r}-rows")
@pytest.mark.parametrize("k, group", [(4096, 128), (354, 118), (8192, 8192)],
                         ids=["4096-by-128", "354-by-118", "8192-by-8192"])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_bfloat16_rows_by_the_cpus_bfloat16_dot_products(fmt, rows, k, group, monkeypatch):
    """bfloat16 x with quantized weights at 2-8 rows (one row: int4 whose groups are whole 32-byte
    vectors, decoded in registers) multiplies by AVX512_BF16's dot products where the CPU has them
    (exact products, float32 sums): within float32 sums' rounding of the float64 product of the
    dequantized weight, as the float32 path is (CUSTOMOPS_CPU_BF16_DOT=0); a zero weight under a
    large x gives 0, an infinite x reaches the result and times 0 gives NaN. (Where the CPU has no
    AVX512_BF16 both runs take the float32 path.) 354 inputs: pairs past whole vectors (and int4
    groups of 59 bytes); one int4 group of 8192 inputs: longer than a decoded block. 98 features:
    one row's kernel takes 4 at once, and 2 more alone. An int4 result near float's largest over its
    scale does not overflow before the scale, nor one whose scale times 2^24 overflows."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(98, k, generator=g).bfloat16()
    q, s = customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w, group_size=group)
    bias = torch.randn(98, generator=g).bfloat16()
    ref = x.double() @ _dequantized_ref(q, s, torch.float64).T
    got = customops.fused_linear(x, q, bias, weight_scale=s)
    monkeypatch.setenv("CUSTOMOPS_CPU_BF16_DOT", "0")
    floats = customops.fused_linear(x, q, bias, weight_scale=s)
    monkeypatch.delenv("CUSTOMOPS_CPU_BF16_DOT")
    want = (ref + bias.double()).bfloat16()
    for y in (got, floats):  # (one bfloat16 step: the float32 sums and the rounding to bfloat16)
        torch.testing.assert_close(y, want, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item() * 1e-2)
    x = torch.full((rows, k), 1e30, dtype=torch.bfloat16)
    if fmt == "fp8":
        w = torch.zeros(2, k, dtype=torch.uint8)  # every weight 0 ...
        w[1, 0] = 0x38  # ... but feature 1's first, which is 1
        w, scale = w.view(torch.float8_e4m3fn), torch.ones(2)
    else:
        w = torch.full((2, k // 2), 0x88, dtype=torch.uint8)
        w[1, 0] = 0x89
        scale = torch.ones(2, k // group, dtype=torch.bfloat16)
    y = customops.fused_linear(x, w, weight_scale=scale)
    assert y[:, 0].eq(0).all() and y[:, 1].eq(x[0, 0]).all(), y
    x[:, 0] = float("inf")
    y = customops.fused_linear(x, w, weight_scale=scale)
    assert y[:, 0].isnan().all() and y[:, 1].eq(float("inf")).all(), y  # (feature 0: inf times 0)
    if fmt == "int4":
        w = torch.full((1, k // 2), 0x88, dtype=torch.uint8)
        w[0, 0] = 0x80  # the weight under x[:, 0] is -8
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        x[:, 0] = 1e38
        scale = torch.full((1, k // group), 0.01, dtype=torch.bfloat16)
        want = (x[:, :1].double() * -8 * scale[0, 0].double()).bfloat16()  # -8e36
        torch.testing.assert_close(customops.fused_linear(x, w, weight_scale=scale), want, rtol=2 ** -7, atol=0)
        w = torch.full((1, k // 2), 0x99, dtype=torch.uint8)  # every weight 1
        scale = torch.full((1, k // group), 1e32, dtype=torch.bfloat16)  # (times 2^24: past float's largest)
        want = torch.full((rows, 1), k * scale[0, 0].double()).bfloat16()
        got = customops.fused_linear(torch.ones(rows, k, dtype=torch.bfloat16), w, weight_scale=scale)
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_float16_product_of_many_rows_adds_its_bias_before_rounding(fmt):
    """On the CPU past 8 rows the weight is multiplied dequantized: float16 x in float32, so that a
    product past float16's largest (70,400) comes back under it with its bias (50,400), as at 8 rows."""
    w = torch.ones(2, 128)
    q, s = customops.quantize_fp8(w) if fmt == "fp8" else customops.quantize_int4(w.half())
    bias = torch.tensor([-20000.0, 0.0], dtype=torch.half)
    decoded, dequantized = (customops.fused_linear(torch.full((rows, 128), 550.0, dtype=torch.half), q, bias,
                                                   weight_scale=s) for rows in (8, 9))
    assert bool(dequantized[:, 0].isfinite().all()) and abs(decoded[0, 0].item() - 50400) <= 64, decoded
    torch.testing.assert_close(dequantized[:8, 0], decoded[:, 0], rtol=2 ** -10, atol=0)  # (feature 1: inf)


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_a_quantized_package_generates_what_its_module_computes(weights, tmp_path):
    """package_causal_lm(..., weights=...): the decoder layers' products read quantized weights
    (the LM head stays in the model's dtype); customops-run generate's greedy ids are the eager
    quantized module's, its logits the module's, and --info names the format."""
    import causal_lms as lms
    from customops.causal_lm import CachedCausalLM
    from test_aoti import run
    from test_generate import _greedy

    model = lms.llama(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    path = customops.export.package_causal_lm(model, tmp_path / f"{weights}.pt2", max_batch=2, max_seq_len=24,
                                              weights=weights)
    lm = CachedCausalLM(model, max_batch=2, max_seq_len=24, weights=weights)
    layer = lm.layers[0]
    assert layer.qkv.weight.dtype == (torch.float8_e4m3fn if weights == "fp8" else torch.uint8)
    assert lm.lm_head.weight.dtype == torch.float32
    ps = lms.prompts(7, 5, seed=2)
    want = _greedy(lm, ps, 6)
    r = lms.generate(path, *[a for p in ps for a in ("--prompt", " ".join(map(str, p)))], "--max-new-tokens", "6",
                     "--ignore-eos")
    assert r.returncode == 0 and lms.ids_of(r.stdout) == [w[:6] for w in want], r.stderr
    packaged = torch._inductor.aoti_load_package(path)
    ids, longs = torch.tensor([ps[0]]), dict(dtype=torch.long)
    args = (ids, torch.zeros(1, **longs), torch.full((1,), 7, **longs), torch.zeros(1, **longs))
    with torch.no_grad():
        torch.testing.assert_close(packaged(*args), CachedCausalLM(model, max_seq_len=24, weights=weights)(*args),
                                   atol=1e-4, rtol=1e-4)
    info = dict(line.split(": ", 1) for line in run([customops.runner_path(), path, "--info"]).stdout.splitlines())
    # (this model is float32: its unquantized LM head is named so, never by the argument's "bf16")
    assert (info["weights"], info["lm_head_weights"]) == (weights, "float32"), info


def test_package_causal_lm_says_which_weights_it_cannot_make(tmp_path):
    import causal_lms as lms

    with pytest.raises(ValueError, match="package_causal_lm: weights must be one of bf16, fp8, int4, got 'int8'"):
        customops.export.package_causal_lm(lms.llama(), tmp_path / "x.pt2", weights="int8")
    with pytest.raises(ValueError, match="weights='int4' quantizes in groups of 128 inputs, but layer 0's qkv has 64"):
        customops.export.package_causal_lm(lms.llama(hidden_size=64), tmp_path / "x.pt2", weights="int4")
    with pytest.raises(ValueError, match="quantize_lm_head=True needs weights='fp8' or 'int4'"):
        customops.export.package_causal_lm(lms.llama(), tmp_path / "x.pt2", quantize_lm_head=True)


@pytest.fixture(scope="module")
def trained():
    """(model, held-out sequences): a 2-layer Llama (hidden 128, 64 ids) trained for 600 steps
    (about 30 s on two CPU cores) on a Markov chain of order 2 whose every context has three
    successors (probabilities 0.6, 0.3, 0.1): random weights say little about what rounding them
    costs, a model that learned structure does."""
    import transformers

    vocab, g = 64, torch.Generator().manual_seed(1)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:3] for _ in range(vocab * vocab)]).view(vocab, vocab, 3)
    probs = torch.tensor([0.6, 0.3, 0.1])

    def sample(n, length):
        x = torch.zeros(n, length, dtype=torch.long)
        x[:, :2] = torch.randint(vocab, (n, 2), generator=g)
        for t in range(2, length):
            pick = torch.multinomial(probs.expand(n, 3), 1, generator=g)[:, 0]
            x[:, t] = succ[x[:, t - 2], x[:, t - 1], pick]
        return x

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=vocab,
                                   max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(600):
        x = sample(32, 64)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), sample(64, 64)


def test_quantized_weights_cost_little_perplexity_on_a_trained_model(trained):
    """Perplexity of held-out sequences (teacher-forced through the cached module, one position a
    step) over the unquantized model's: fp8 within 1% and int4 within 5% (issue 52's targets), and
    the greedy next id mostly the same. Measured 2026-11-28 (torch 2.13, CPU): fp8 1.0039x (97.3%
    of next ids the same), int4 1.034x (89.8%)."""
    import math

    from customops.causal_lm import CachedCausalLM

    model, test = trained
    n, length = test.shape
    with torch.no_grad():
        ref = model(test).logits[:, :-1].float()
    base = torch.nn.functional.cross_entropy(ref.reshape(-1, ref.shape[-1]), test[:, 1:].reshape(-1)).item()
    longs = dict(dtype=torch.long)
    for weights, most, agree in (("fp8", 1.01, 0.95), ("int4", 1.05, 0.85)):
        lm = CachedCausalLM(model, max_batch=n, max_seq_len=length, weights=weights)
        with torch.no_grad():
            got = torch.stack([lm(test[:, t:t + 1], torch.full((n,), t, **longs), torch.ones(n, **longs))
                               for t in range(length - 1)], 1)
        ce = torch.nn.functional.cross_entropy(got.reshape(-1, got.shape[-1]), test[:, 1:].reshape(-1)).item()
        ratio = math.exp(ce - base)
        same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{weights}: perplexity {ratio:.4f}x, next id the same {same:.1%}")
        assert ratio <= most and same >= agree, (weights, ratio, same)


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_each_quantized_product_stays_within_its_format_s_bound(trained, weights):
    """Each quantized layer's output against the float64 product with the unquantized weight:
    within sum_k |x_k| d_nk, d the format's rounding bound of each weight element (fp8: half an
    E4M3 step, a relative 2^-4, or scale * 2^-10 among its subnormals; int4: half a step,
    scale / 2, or amax - 7 * scale for the largest elements a smaller scale clipped), plus
    float32's accumulation."""
    from customops.causal_lm import CachedCausalLM

    model, _ = trained
    lm = CachedCausalLM(model, max_seq_len=64, weights=weights)
    plain = CachedCausalLM(model, max_seq_len=64)
    torch.manual_seed(3)
    for layer, orig in zip(lm.layers, plain.layers):
        for name in ("qkv", "o_proj", "gate_up", "down_proj"):
            q, w = getattr(layer, name), getattr(orig, name).weight.detach().double()
            x = torch.randn(16, w.shape[1])
            got = customops.fused_linear(x, q.weight, weight_scale=q.weight_scale).double()
            want = x.double() @ w.T
            if weights == "fp8":
                d = torch.maximum(w.abs() * 2 ** -4, q.weight_scale.double()[:, None] * 2 ** -10)
            else:
                s = q.weight_scale.double().repeat_interleave(128, 1)
                amax = w.abs().reshape(w.shape[0], -1, 128).amax(2).repeat_interleave(128, 1)
                d = torch.maximum(s / 2, amax - 7 * s)
            bound = x.double().abs() @ d.T + w.shape[1] * 2 ** -23 * (x.double().abs() @ w.abs().T)
            assert bool(((got - want).abs() <= bound * 1.0001).all()), (weights, name)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
def test_a_non_finite_weight_quantized_in_a_cuda_graph_gets_nan_scales():
    """Capture cannot wait for the finiteness check on the host: the row (fp8) or group (int4)
    holding a NaN or infinity gets a NaN scale instead, the others their own."""
    w = torch.randn(4, 256, device="cuda")
    w[1, 3], w[2, 200] = float("nan"), float("inf")
    customops.quantize_fp8(torch.ones(2, 2, device="cuda"))  # (loads the kernels before the capture)
    customops.quantize_int4(torch.ones(2, 128, device="cuda"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q8, s8 = customops.quantize_fp8(w)
        q4, s4 = customops.quantize_int4(w)
    g.replay()
    torch.cuda.synchronize()
    assert s8.isnan().tolist() == [False, True, True, False]
    assert s4.isnan().tolist() == [[False, False], [True, False], [False, True], [False, False]]
    with pytest.raises(RuntimeError, match="weight holds NaN or infinite values"):
        customops.quantize_fp8(w)
