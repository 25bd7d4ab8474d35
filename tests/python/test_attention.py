"""attention and merge_attention beyond the op table: merging attentions over split keys equals
attention over all of them (values and gradients), rows that see no key, and lse's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import customops
from customops import testing as T
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merging_split_keys_equals_attention_over_all(device, dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 21, 16, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 21, 16, device=device, dtype=dtype, requires_grad=True)
    out, lse = customops.attention(q, k, v, return_lse=True)
    a = customops.attention(q, k[:, :, :8], v[:, :, :8], return_lse=True)
    b = customops.attention(q, k[:, :, 8:], v[:, :, 8:], return_lse=True)
    m_out, m_lse = customops.merge_attention(*a, *b)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(m_out, out, **tol)
    torch.testing.assert_close(m_lse, lse, **tol)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    want = torch.autograd.grad((out, lse), (q, k, v), (go, gl))
    got = torch.autograd.grad((m_out, m_lse), (q, k, v), (go, gl))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_see_no_key_give_zero_and_minus_inf_never_nan(device):
    # causal with Sq > Sk: query i sees keys j <= i + Sk - Sq, so the first Sq - Sk rows see none
    q = torch.randn(1, 2, 7, 8, device=device, requires_grad=True)
    k = torch.randn(1, 1, 4, 8, device=device, requires_grad=True)
    v = torch.randn(1, 1, 4, 8, device=device, requires_grad=True)
    out, lse = customops.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert bool((lse[:, :, :3] == float("-inf")).all()) and bool(torch.isfinite(lse[:, :, 3:]).all())
    want = T._attention_ref(*(t.detach().double() for t in (q, k, v)), True)
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out, lse.masked_fill(lse.isinf(), 0)), (q, k, v),
                                (torch.randn_like(out), torch.randn_like(lse)))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert torch.equal(grads[0][:, :, :3], torch.zeros_like(grads[0][:, :, :3]))
    # no key at all: every row empty
    out, lse = customops.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    # merging with an empty side changes nothing
    full = customops.attention(q, k, v, return_lse=True)
    merged = customops.merge_attention(*full, out, lse)
    torch.testing.assert_close(merged[0], full[0])
    torch.testing.assert_close(merged[1], full[1])


@pytest.mark.parametrize("device", DEVICES)
def test_matches_sdpa_and_reads_transposed_views_in_place(device):
    # [B, S, H, D] projections passed as .transpose(1, 2) views; GQA against SDPA with repeated kv
    torch.manual_seed(1)
    B, S, Hq, Hkv, D = 2, 33, 8, 2, 32
    q = torch.randn(B, S, Hq, D, device=device).transpose(1, 2)
    k, v = (torch.randn(B, S, Hkv, D, device=device).transpose(1, 2) for _ in range(2))
    for causal in (False, True):
        got = customops.attention(q, k, v, causal=causal)
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=causal)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert got.transpose(1, 2).is_contiguous()  # o_proj's [B, S, H * D] input is a view


def _assert_matches_reference(q, k, v, causal, tol, label):
    """customops.attention's out, lse and the gradients of both (q, k and v leaves) against the float32
    reference's, within tol times each tensor's largest magnitude (at least 1)."""
    out, lse = customops.attention(q, k, v, causal=causal, return_lse=True)
    go, gl = torch.randn_like(out), torch.randn_like(lse).masked_fill(lse.isinf(), 0)
    got = (out, lse, *torch.autograd.grad((out, lse), (q, k, v), (go, gl)))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want_out, want_lse = T._attention_ref(q32, k32, v32, causal)
    want = (want_out, want_lse,
            *torch.autograd.grad((want_out, want_lse.masked_fill(want_lse.isinf(), 0)), (q32, k32, v32), (go.float(), gl)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        scale = max(1.0, w.abs().masked_fill(w.isinf(), 0).max().item())
        torch.testing.assert_close(g.float(), w, atol=tol * scale, rtol=tol, msg=lambda m: f"{name} of {label}: {m}")


# The CUDA kernel paths the tests pin: name -> (the environment switches that select it, whether it
# exists on compute capability 9.0 only). On an H100 or H200 the default forward is the
# warp-specialized wgmma one (192 query rows a block at head dim 64; the only fused one at head dim
# 256, whose backward is ATen's cuDNN or FlashAttention-2 one where lse has no gradient, the blocked one else)
# and the default backward the wgmma one, its kernels warp-specialized.
PATHS = {
    "default": ({}, False),
    "sm80": ({"CUSTOMOPS_ATTENTION_SM80": "1"}, False),  # mma.sync forward and backward
    "wgmma": ({"CUSTOMOPS_ATTENTION_WS": "0"}, False),  # the wgmma forward without warp specialization
    "mma-bwd": ({"CUSTOMOPS_ATTENTION_BWD_SM90": "0"}, False),  # the mma.sync backward after the default forward
    "atomic-dq": ({"CUSTOMOPS_ATTENTION_BWD_DQ": "atomic"}, True),  # dQ by atomics in the dK/dV kernel
    "reduce-dq": ({"CUSTOMOPS_ATTENTION_BWD_DQ": "reduce"}, True),  # by the TMA's adds in the ws dK/dV kernel (the default; d 64: 128 rows a step)
    "reduce-dq64": ({"CUSTOMOPS_ATTENTION_BWD_DQ": "reduce", "CUSTOMOPS_ATTENTION_BWD_ROWS": "64"}, True),  # so, 64 rows a step at d 64
    "dq-pass": ({"CUSTOMOPS_ATTENTION_BWD_DQ": "pass"}, True),  # by a pass of its own (the default at d 64 with 64 rows a step)
    "mask-every-step": ({"CUSTOMOPS_ATTENTION_BWD_MASK_SPLIT": "0"}, True),  # the dK/dV mask on every step (else only where needed)
    "cp-bwd": ({"CUSTOMOPS_ATTENTION_BWD_WS": "0"}, False),  # the wgmma backward's kernels loading by cp.async
    "cp-dq": ({"CUSTOMOPS_ATTENTION_BWD_WS": "dkdv", "CUSTOMOPS_ATTENTION_BWD_DQ": "pass"}, False),  # its dQ pass only so
    "ws128": ({"CUSTOMOPS_ATTENTION_WS_ROWS": "128"}, True),  # 128 query rows a block at head dim 64
    "bwd64": ({"CUSTOMOPS_ATTENTION_BWD_ROWS": "64"}, True),  # 64 query rows a dK/dV step at head dim 64 (128 else)
    "dq128": ({"CUSTOMOPS_ATTENTION_BWD_DQ_KEYS": "128", "CUSTOMOPS_ATTENTION_BWD_DQ": "pass"}, True),  # 128 keys a dQ pass step at head dim 64 (64 else)
    "ws-one-block": ({"CUSTOMOPS_ATTENTION_WS_PERSISTENT": "1"}, True),  # every forward tile through one block
    "ws-grid": ({"CUSTOMOPS_ATTENTION_WS_PERSISTENT": "0"}, True),  # a block a forward tile
    "launch-order": ({"CUSTOMOPS_ATTENTION_LPT": "0"}, False),  # causal blocks in launch order, not longest first
    "keys64": ({"CUSTOMOPS_ATTENTION_WS_KEYS256": "64"}, True),  # 64-key blocks at head dim 256 (80 else)
    "bwd-ours": ({"CUSTOMOPS_ATTENTION_BWD_CUDNN": "0"}, False),  # a loss of out alone through our backward (d 256: FlashAttention-2's), not cuDNN's
}


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("forward", list(PATHS))
def test_fused_cuda_kernel_matches_float32_reference(dtype, d, causal, forward, monkeypatch):
    # The tensor-core kernel's shapes: grouped heads, lengths off the block sizes, Sq < Sk and
    # Sq > Sk (causal: rows that see no key), one query, one query block a head (a dK/dV block of one
    # step), causal dK/dV walks whose diagonal spans three 64-row query blocks, unmasked steps after
    # it (390 against 300); q as a [B, S, H, D] view; lse's gradient. Every kernel path of PATHS
    # (head dim 256: the default only, its one fused forward).
    if d == 256 and forward not in ("default", "ws-one-block", "ws-grid", "keys64"):
        pytest.skip("head dim 256 has one fused forward")
    if forward == "keys64" and d != 256:
        pytest.skip("keys64: a choice at head dim 256 only")
    if forward in ("ws128", "bwd64", "dq128", "reduce-dq64") and d != 64:
        pytest.skip(f"{forward}: a choice at head dim 64 only")
    if forward == "bwd-ours":
        pytest.skip("with lse's gradient (as here) the default backward is ours already")
    _kernel("cuda", forward, monkeypatch)
    torch.manual_seed(0)
    for b, hq, hkv, sq, sk in [(2, 4, 2, 256, 256), (1, 3, 1, 100, 300), (1, 2, 2, 300, 100), (2, 2, 1, 1, 77),
                               (1, 2, 2, 50, 200), (1, 4, 2, 390, 300)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        _assert_matches_reference(q, k, v, causal, 3e-2 if dtype == torch.bfloat16 else 5e-3, [b, hq, hkv, sq, sk])


def _dq_pass(d, dq, monkeypatch):
    # dq "pass": the dQ kernel where it is not the default (head dims 128 and 64); head dim 256 has none.
    if dq == "pass":
        if d not in (64, 128):
            pytest.skip("head dim 256's backward has no dQ pass")
        monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_DQ", "pass")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dq", ["default", "pass"])
def test_more_tiles_than_blocks(d, causal, dq, monkeypatch):
    # More query blocks than the GPU has SMs: the persistent kernels' blocks (the warp-specialized
    # forward and dQ kernel) take several each, from a counter (causal: longest first), Sq > Sk so
    # that some rows see no key; out, lse and the gradients against the float32 reference. At head
    # dim 128 dQ is added in the dK/dV kernel by default: "pass" runs the dQ kernel there.
    _dq_pass(d, dq, monkeypatch)
    torch.manual_seed(0)
    q = torch.randn(2, 72, 300, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 8, 290, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    _assert_matches_reference(q, k, v, causal, 3e-2, "2 x 72 x 300 against 8 x 290")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("order", ["longest-first", "launch"])
@pytest.mark.parametrize("dq", ["default", "pass"])
def test_tiles_without_keys_between_tiles_with_keys(d, order, dq, monkeypatch):
    # Causal with Sq >> Sk: most query blocks see no key. Every tile through one block of the persistent
    # kernels, in launch order (head by head: each head's keyless tiles before the next head's keyed
    # ones) or longest first; a bad block count is a named error.
    _kernel("cuda", "ws-one-block", monkeypatch)
    _dq_pass(d, dq, monkeypatch)
    if order == "launch":
        monkeypatch.setenv("CUSTOMOPS_ATTENTION_LPT", "0")
    torch.manual_seed(0)
    q = torch.randn(2, 3, 700, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 3, 100, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    _assert_matches_reference(q, k, v, True, 3e-2, "700 queries against 100 keys")
    monkeypatch.setenv("CUSTOMOPS_ATTENTION_WS_PERSISTENT", "many")
    with pytest.raises(RuntimeError, match="CUSTOMOPS_ATTENTION_WS_PERSISTENT"):
        customops.attention(q, k, v, causal=True)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(2085, 1500), (1500, 2085)])
@pytest.mark.parametrize("d, path", [(128, "reduce-dq"), (64, "reduce-dq"), (64, "reduce-dq64")])
def test_reduced_dq_matches_the_dq_pass_over_long_walks(causal, sq, sk, d, path, monkeypatch):
    # dQ through the TMA's reductions (the default; at head dim 64 with 128 query rows a step, each
    # consumer adding its 64 rows over the block's 128 keys, or with 64) over dK/dV blocks of many
    # steps (8 query heads a kv head, 12-33 query blocks each, sq off the block sizes) against the dQ
    # pass on the same inputs.
    _kernel("cuda", path, monkeypatch)
    torch.manual_seed(0)
    q = torch.randn(1, 16, sq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, sk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    go = torch.randn_like(q)
    reduced = torch.autograd.grad(customops.attention(q, k, v, causal=causal), (q, k, v), go)
    monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_DQ", "pass")
    passed = torch.autograd.grad(customops.attention(q, k, v, causal=causal), (q, k, v), go)
    for name, a, b in zip(("dq", "dk", "dv"), reduced, passed):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2 * max(1.0, b.abs().max().item()), rtol=1e-2,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("path", ["default", "reduce-dq", "atomic-dq", "mma-bwd"])
def test_backward_is_bitwise_reproducible_under_use_deterministic_algorithms(d, path, monkeypatch):
    # dQ summed by the TMA's reductions (the default at head dims 64 and 128) or float32 atomics (the mma.sync
    # backward) lands in the order the blocks reach it. Under torch.use_deterministic_algorithms the
    # backward takes the dQ pass (H100/H200) or ATen's deterministic FlashAttention-2 backward: two runs
    # give the same bits, and the values match the float32 reference.
    if d == 256 and path != "default":
        pytest.skip("head dim 256 has one backward here")
    _kernel("cuda", path, monkeypatch)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1000, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1000, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    go = torch.randn_like(q)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(customops.attention(q, k, v, causal=True), (q, k, v), go) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    for name, first, *others in zip(("dq", "dk", "dv"), *runs):
        for other in others:
            assert torch.equal(first, other), f"{name} differs between runs"
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(T._attention_ref(q32, k32, v32, True)[0], (q32, k32, v32), go.float())
    for name, g, w in zip(("dq", "dk", "dv"), runs[0], want):
        torch.testing.assert_close(g.float(), w, atol=3e-2 * max(1.0, w.abs().max().item()), rtol=3e-2,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, backward", [(256, "default"), (256, "flash2"), (256, "blocked"), (128, "default"),
                                         (128, "cudnn"), (128, "ours"), (64, "default"), (64, "cudnn"), (96, "default")])
def test_backward_of_out_alone(dtype, causal, d, backward, monkeypatch):
    # The backward where lse has no gradient (a training loss): ATen's cuDNN one where it computes ours
    # (full, or causal with Sq == Sk: its mask is top-left aligned; on an H100/H200; not for one query
    # or key, nor 64 mod 128 keys, where cuDNN versions are reported wrong), by default only where ours
    # is slower (at head dim 128 full, and causal past 2k keys; head dims ours has no wgmma backward
    # for: 96, 256; CUSTOMOPS_ATTENTION_BWD_CUDNN=1: wherever it computes ours); else ours at head dims
    # 64 and 128 (CUSTOMOPS_ATTENTION_BWD_CUDNN=0: always), at 256 FlashAttention-2's (the blocked one
    # with CUSTOMOPS_ATTENTION_FLASH2=0), at 96 the blocked one. The shapes of the test above, k and v
    # as views of stride 2 in the head dim (copied for the kernels), and which kernel ran.
    if backward != "default":
        monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_CUDNN", "1" if backward == "cudnn" else "0")
    if backward == "blocked":
        monkeypatch.setenv("CUSTOMOPS_ATTENTION_FLASH2", "0")
    hopper, sm90a = torch.cuda.get_device_capability()[0] == 9, _sm90a()
    torch.manual_seed(0)
    for b, hq, hkv, sq, sk in [(2, 4, 2, 256, 256), (1, 3, 1, 100, 300), (1, 2, 2, 300, 100), (2, 2, 1, 1, 77),
                               (1, 2, 1, 64, 80), (1, 2, 2, 192, 192)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        if sk == 80:
            k, v = (torch.randn(b, hkv, sk, 2 * d, device="cuda", dtype=dtype)[..., ::2].requires_grad_() for _ in range(2))
        out = customops.attention(q, k, v, causal=causal)
        go = torch.randn_like(out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = torch.autograd.grad(out, (q, k, v), go)
        names = {e.name for e in prof.events()}
        ran_cudnn = any("cudnn" in n.lower() or "sdpa" in n.lower() for n in names)
        ran_flash = any("flash_bwd" in n for n in names)
        cudnn_computes = hopper and (not causal or sq == sk) and min(sq, sk) > 1 and sk % 128 != 64
        ours_faster = sm90a and (d == 64 or (d == 128 and causal and sk <= 2048))
        want_cudnn = cudnn_computes and (backward == "cudnn" or (backward == "default" and not ours_faster))
        want_flash = d == 256 and backward != "blocked" and not want_cudnn
        assert (ran_cudnn, ran_flash) == (want_cudnn, want_flash), f"{[b, hq, hkv, sq, sk]}: {sorted(names)}"
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(T._attention_ref(q32, k32, v32, causal)[0], (q32, k32, v32), go.float())
        tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            scale = max(1.0, w.abs().max().item())
            torch.testing.assert_close(g.float(), w, atol=tol * scale, rtol=tol,
                                       msg=lambda m: f"{name} of {[b, hq, hkv, sq, sk]}: {m}")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
def test_cudnn_backward_holds_no_more_memory_than_sdpas(monkeypatch):
    # The cuDNN backward allocates dq, dk and dv itself: ours are not allocated beside them (q + k + v
    # bytes more at the peak), and its gradients come back in q's layout ([B, S, H, D] memory here).
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuDNN's backward runs on an H100/H200 only")
    monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_CUDNN", "1")  # (causal, 1k keys, head dim 128: ours by default)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    go = torch.randn_like(q)

    def peak(out):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.autograd.grad(out, (q, k, v), go)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, grads

    ours, got = peak(customops.attention(q, k, v, causal=True))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        theirs, want = peak(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert ours <= theirs + q.numel(), (ours, theirs)  # (slack: half of q's bytes)
    for g, w, t in zip(got, want, (q, k, v)):
        assert g.stride() == t.stride()
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
@pytest.mark.parametrize("cudnn", ["1", "0"])
def test_backward_takes_any_layout_of_the_output_gradient(cudnn, monkeypatch):
    # ATen caches cuDNN's backward graphs by q, k and v's layouts but builds them for dO's and out's
    # too: calls of one shape with dO in another layout each (dense in q's order, in the other order,
    # expanded from one element) must each give the reference's gradients; ours too.
    monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_CUDNN", cudnn)
    torch.manual_seed(0)
    q = torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = customops.attention(q, k, v, causal=True)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want_out = T._attention_ref(q32, k32, v32, True)[0]
    for go in (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
               torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16),
               torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16).expand(2, 4, 256, 64)):
        got = torch.autograd.grad(out, (q, k, v), go, retain_graph=True)
        want = torch.autograd.grad(want_out, (q32, k32, v32), go.float(), retain_graph=True)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g.float(), w, atol=3e-2 * max(1.0, w.abs().max().item()), rtol=3e-2,
                                       msg=lambda m: f"{name}, dO strides {go.stride()}: {m}")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs customops built with CUDA")
def test_cuda_shapes_off_the_fused_kernel_take_the_blocked_one():
    # head dim 32, a misaligned view and float32 go through the blocked ATen kernels or a copy
    torch.manual_seed(0)
    for d, dtype in ((32, torch.bfloat16), (64, torch.float32)):
        q, k, v = (torch.randn(1, 2, 50, d, device="cuda", dtype=dtype) for _ in range(3))
        want = T._attention_ref(q.double(), k.double(), v.double(), True)
        got = customops.attention(q, k, v, causal=True, return_lse=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=3e-2, rtol=3e-2)
    for d in (64, 256):  # rows 16-byte misaligned (at head dim 256: the TMA cannot read them)
        q = torch.randn(1, 2, 50, d + 1, device="cuda", dtype=torch.bfloat16)[..., 1:]
        want = T._attention_ref(q.double(), q.double(), q.double())
        torch.testing.assert_close(customops.attention(q, q, q).double(), want[0], atol=3e-2, rtol=3e-2)


# Every kernel: the CPU's flash kernel (float32, bfloat16) and blocked ATen one (float64); on CUDA
# the fused ones (bfloat16 and float16 at head dims 64 and 128; "sm80" keeps the mma.sync forward on
# an H100) and the blocked one (float32).
KERNELS = [pytest.param(dev, dt, d, fwd, id=f"{dev}-{str(dt).removeprefix('torch.')}-d{d}-{fwd}")
           for dev in DEVICES
           for dt, d, fwd in ([(torch.float32, 8, "default"), (torch.bfloat16, 8, "default"), (torch.float64, 8, "default")]
                              if dev == "cpu" else
                              [(torch.bfloat16, 64, "default"), (torch.float16, 128, "default"),
                               (torch.bfloat16, 64, "sm80"), (torch.bfloat16, 128, "wgmma"),
                               (torch.bfloat16, 256, "default"), (torch.bfloat16, 128, "mma-bwd"),
                               (torch.bfloat16, 128, "atomic-dq"), (torch.float16, 64, "atomic-dq"),
                               (torch.bfloat16, 128, "reduce-dq"), (torch.float16, 64, "reduce-dq"),
                               (torch.bfloat16, 64, "reduce-dq64"),
                               (torch.bfloat16, 128, "cp-bwd"), (torch.float16, 64, "cp-dq"),
                               (torch.float16, 64, "ws128"), (torch.bfloat16, 64, "bwd64"),
                               (torch.float16, 64, "dq128"), (torch.bfloat16, 128, "ws-one-block"),
                               (torch.float16, 64, "ws-one-block"),
                               (torch.bfloat16, 128, "dq-pass"), (torch.float16, 64, "dq-pass"),
                               (torch.bfloat16, 256, "bwd-ours"), (torch.float16, 128, "bwd-ours"),
                               (torch.float32, 64, "default")])]


def _sm90a() -> bool:
    """Whether the wgmma kernels run here: compute capability 9.0 and a build with sm_90a code."""
    return torch.cuda.get_device_capability() == (9, 0) and any(
        a.startswith("90a") for a in customops.build_info()["cuda_archs"].split(";"))


def _kernel(device, forward, monkeypatch):
    env, sm90_only = PATHS[forward]
    if sm90_only and not _sm90a():
        pytest.skip(f"{forward}: a kernel path of compute capability 9.0 and sm_90a builds only")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if forward != "default":  # (a loss of out alone takes cuDNN's backward at some shapes: the paths pin ours)
        monkeypatch.setenv("CUSTOMOPS_ATTENTION_BWD_CUDNN", "0")


@pytest.mark.parametrize("device, dtype, d, forward", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_scores_give_nan_rows_not_empty_ones(device, dtype, d, forward, causal, monkeypatch):
    # A NaN in k, +inf in q or a NaN scale: every row that sees it is NaN (out and lse), as in SDPA
    # and the float64 reference, never the out 0 / lse -inf of a row with no key; other rows stay
    # finite, and the gradients of NaN rows are NaN too.
    _kernel(device, forward, monkeypatch)
    b, h, sq, sk = 1, 2, 150, 150  # two key blocks of the CUDA kernels
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for s in (sq, sk, sk))
    k[0, 1, 100, 3] = float("nan")  # head 1's rows that see key 100 (causal: rows 100 and on)
    q[0, 0, 7, 0] = float("inf")  # head 0, row 7: a score of +inf
    for qq, kk, scale in ((q, k, None), (q[:, :1, :1], k[:, :1], float("nan"))):
        q_, k_, v_ = (t.detach().requires_grad_() for t in (qq, kk, v[:, :kk.shape[1]]))
        out, lse = customops.attention(q_, k_, v_, causal=causal, scale=scale, return_lse=True)
        want_out, want_lse = T._attention_ref(q_.double(), k_.double(), v_.double(), causal, scale)
        nan_rows = want_out.isnan().any(-1)
        assert bool(nan_rows.any())
        assert torch.equal(out.isnan().any(-1), nan_rows) and torch.equal(out.isnan().all(-1), nan_rows)
        assert torch.equal(lse.isnan(), want_lse.isnan())
        torch.testing.assert_close(out.double()[~nan_rows], want_out[~nan_rows], atol=3e-2, rtol=3e-2)
        dq, = torch.autograd.grad(out, q_, torch.ones_like(out))
        assert bool(dq.isnan().any(-1)[nan_rows].all())


@pytest.mark.parametrize("device, dtype, d, forward", KERNELS)
def test_huge_scores_match_the_reference(device, dtype, d, forward, monkeypatch):
    # Scores of 1e9 to 1e30 (a huge q or scale): the softmax is each row's argmax, which these
    # rows have by a wide margin, so float32 rounding of the scores cannot change it. Once the
    # exponent of a fused s * scale - max missed the rounded max by more than exp's range: inf or
    # NaN rows, or 0 with lse -inf.
    _kernel(device, forward, monkeypatch)
    torch.manual_seed(0)
    sk = 150
    k = torch.eye(sk, d, device=device).repeat(1, 1, 1, 1).to(dtype) * (1 + torch.arange(sk, device=device)[:, None] % 4).to(dtype)
    v = torch.randn(1, 1, sk, d, device=device, dtype=dtype)
    q = torch.zeros(1, 1, 70, d, device=device, dtype=dtype)
    q[0, 0, torch.arange(70), torch.arange(70) % min(sk, d)] = 1
    for scale, q_mult in ((1e9, 1.0), (1e30, 1.0), (1.0, 1e9 if dtype != torch.float16 else 3e4)):
        for causal in (False, True):
            out, lse = customops.attention(q * q_mult, k, v, causal=causal, scale=scale, return_lse=True)
            want_out, want_lse = T._attention_ref((q * q_mult).double(), k.double(), v.double(), causal, scale)
            seen = want_lse.isfinite()
            assert bool(out.isfinite().all()), f"scale {scale} q x{q_mult}: non-finite rows"
            torch.testing.assert_close(out.double(), want_out, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=0, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_attention_under_autocast_takes_mixed_precision_sides(device):
    # one side computed under autocast (bf16 out), the other not (fp32): merged in float32, out in
    # out_a's dtype, as the README's autocast table says; outside autocast mixed dtypes still raise
    oa, ob = torch.randn(2, 4, 8, device=device).bfloat16(), torch.randn(2, 4, 8, device=device)
    la, lb = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device, dtype=torch.float64)
    with torch.autocast(device, dtype=torch.bfloat16):
        out, lse = customops.merge_attention(oa, la, ob, lb)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    want = T._merge_attention_ref(oa.double(), la.double(), ob.double(), lb)
    torch.testing.assert_close(out.double(), want[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="customops::merge_attention: expected out_b to have the dtype of out_a"):
        customops.merge_attention(oa, la, ob, lb)
