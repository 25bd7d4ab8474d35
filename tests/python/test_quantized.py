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
    with pytest.raises(RuntimeError, match=f"{op}: weight must be float32, float16 or bfloat16, but it is Long"):
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
    # within half a step of each element (the scale rounded to dtype: a step of its rounding more)
    step = scale.double().repeat_interleave(128, 1)
    assert bool(((back - w.double()).abs() <= step * (0.5 + 7 * torch.finfo(dtype).eps)).all())
    # group size 32 packs the same way, with 8 scales a row
    p32, s32 = customops.quantize_int4(w, 32)
    assert s32.shape == (6, 8) and torch.equal(p32, _quantize_int4_ref(w, 32)[0])


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
    info = run([customops.runner_path(), path, "--info"]).stdout
    assert f"weights: {weights}" in info and "lm_head_weights: bf16" in info, info


def test_package_causal_lm_says_which_weights_it_cannot_make(tmp_path):
    import causal_lms as lms

    with pytest.raises(ValueError, match="package_causal_lm: weights must be one of bf16, fp8, int4, got 'int8'"):
        customops.export.package_causal_lm(lms.llama(), tmp_path / "x.pt2", weights="int8")
    with pytest.raises(ValueError, match="weights='int4' quantizes in groups of 128 inputs, but layer 0's qkv has 64"):
        customops.export.package_causal_lm(lms.llama(hidden_size=64), tmp_path / "x.pt2", weights="int4")
