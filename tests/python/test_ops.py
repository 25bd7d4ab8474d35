"""Every generic check of customops.testing over the op table x device (x dtype)."""

import pytest
import torch

from customops import testing as T
from conftest import DEVICES

OPS = [pytest.param(o, id=o.name) for o in T.OPS]


def _skip_unless_differentiable(info):
    if not info.differentiable:
        pytest.skip(f"{info.name} is not differentiable (an out= variant or an inference op)")
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in T.FLOAT_DTYPES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("info", OPS)
def test_correctness(info, dtype, device):
    assert T.check_correctness(info, device, dtype) >= 5


@pytest.mark.parametrize("info", OPS)
def test_meta_matches_real_kernel(info):
    T.check_meta(info)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_autograd_matches_reference(info, device):
    _skip_unless_differentiable(info)
    T.check_autograd(info, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_opcheck(info, device):
    samples = T.opcheck_samples(info, device)
    descs = {s.desc.split()[0] for s in samples}
    assert {"contiguous", "transposed", "strided"} <= descs
    assert any(any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in s.args) for s in samples)
    if info.differentiable:
        assert any(any(isinstance(a, torch.Tensor) and a.requires_grad for a in s.args) for s in samples)
    T.check_opcheck(info, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_gradcheck_and_gradgradcheck(info, device):
    _skip_unless_differentiable(info)
    T.check_gradcheck(info, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_compile_fullgraph_dynamic_no_recompiles(info, device):
    T.check_compile(info, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_export_dynamic_batch(info, device):
    T.check_export(info, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_bad_inputs_raise_named_errors(info, device):
    assert T.check_bad_inputs(info, device) >= 4


# ---- subsystems: every op works under torch.func, vmap, autocast and compiled autograd ---------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_torch_func_transforms(info, device):
    _skip_unless_differentiable(info)
    assert T.check_func(info, device) >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_vmap_uses_batching_rule(info, device):
    assert T.check_vmap(info, device) >= 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_autocast_policy(info, device):
    assert T.check_autocast(info, device) >= 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_compiled_autograd(info, device):
    _skip_unless_differentiable(info)
    assert T.check_compiled_autograd(info, device) >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [(3, None), (3, 3), (None, 2)], ids=["rows", "rows-and-classes", "classes"])
def test_linear_cross_entropy_in_many_tiles(device, tile):
    # Real inputs fit one tile; 3 rows and/or 2-3 classes per tile run the loops: the first chunk of
    # rows writes the weight's gradient and the others add to it, pieces of the vocabulary merge
    # their log-sum-exps and add into the hidden gradient, short last tiles.
    import torch.nn.functional as F

    import customops

    torch.manual_seed(0)
    tiles = dict(tile_rows=tile[0], tile_classes=tile[1])
    for red, ls, bias in (("mean", 0.0, False), ("sum", 0.1, True)):
        h = torch.randn(10, 6, dtype=torch.float64, device=device, requires_grad=True)
        w = torch.randn(7, 6, dtype=torch.float64, device=device, requires_grad=True)
        b = torch.randn(7, dtype=torch.float64, device=device, requires_grad=True) if bias else None
        t = torch.randint(0, 7, (10,), device=device)
        t[3] = -100
        got = customops.linear_cross_entropy(h, w, t, b, label_smoothing=ls, reduction=red, **tiles)
        want = F.cross_entropy(F.linear(h, w, b), t, label_smoothing=ls, reduction=red)
        torch.testing.assert_close(got, want)
        ins = [x for x in (h, w, b) if x is not None]
        torch.testing.assert_close(torch.autograd.grad(got, ins), torch.autograd.grad(want, ins))
        with torch.no_grad():
            torch.testing.assert_close(customops.linear_cross_entropy(h, w, t, b, label_smoothing=ls, reduction=red,
                                                                      **tiles), want)
        if device == "cuda":  # an out-of-range target is not checked on CUDA (no sync): the loss is NaN
            t[0] = 7
            assert customops.linear_cross_entropy(h, w, t, b, label_smoothing=ls, reduction=red, **tiles).isnan()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_outputs_keep_the_inputs_memory_order(device):
    # q_proj(x).view(B, S, H, D).transpose(1, 2), as Hugging Face passes it: the outputs and the
    # backward's gradients stay in [B, S, H, D] order, so attention (which allocates its output in
    # q's order) gives an output whose transpose is contiguous: no copy before o_proj and none
    # kept for its backward (36 MiB per layer at Llama-3.2-1B shapes on the H100).
    import customops

    B, S, H, Hkv, D = 2, 5, 4, 2, 8
    x = torch.randn(B, S, (H + 2 * Hkv) * D, device=device)
    q = x[..., : H * D].view(B, S, H, D).transpose(1, 2).requires_grad_()
    k = x[..., H * D: (H + Hkv) * D].view(B, S, Hkv, D).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(2, B, S, D, device=device).unbind(0)
    qo, ko = customops.rope(q, k, cos, sin)
    assert qo.transpose(1, 2).is_contiguous() and ko.transpose(1, 2).is_contiguous()
    gq, gk = torch.autograd.grad((qo, ko), (q, k), (torch.randn_like(qo), torch.randn_like(ko)))
    assert gq.transpose(1, 2).is_contiguous() and gk.transpose(1, 2).is_contiguous()
    qo, ko = customops.rope(q.detach().contiguous(), k.detach().contiguous(), cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    with torch.device("meta"):  # the Meta kernel promises the same strides
        mq, mk = customops.rope(q.to("meta"), k.to("meta"), cos.to("meta"), sin.to("meta"))
    assert mq.stride() == customops.rope(q, k, cos, sin)[0].stride()


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_wrapper_takes_any_rows_and_names_a_bad_hidden(device):
    # hidden [..., H] with H = 0 (every logit is the bias) or a single row [H]; a 0-dim hidden gets
    # the op's own error, not reshape's or an IndexError
    import torch.nn.functional as F

    import customops

    w, b = torch.randn(5, 0, device=device), torch.randn(5, device=device)
    t = torch.randint(0, 5, (2, 3), device=device)
    want = F.cross_entropy(F.linear(torch.randn(6, 0, device=device), w, b), t.reshape(-1))
    torch.testing.assert_close(customops.linear_cross_entropy(torch.randn(2, 3, 0, device=device), w, t, b), want)
    h, w = torch.randn(4, device=device), torch.randn(5, 4, device=device)
    torch.testing.assert_close(customops.linear_cross_entropy(h, w, t[0, 0]), F.cross_entropy(F.linear(h, w), t[0, 0]))
    with pytest.raises(RuntimeError, match=r"customops::linear_cross_entropy: expected hidden of shape \[N, H\], but got \[\]"):
        customops.linear_cross_entropy(torch.tensor(1.0, device=device), w, t[0, 0])


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "swiglu"])
def test_fused_linear_cpu_splits_few_rows_over_threads(rows, prologue):
    # 1-8 rows on a weight of 1.5 MB: the CPU kernel splits the product over torch's threads by
    # output features (a BLAS call a block of weight rows); 9 rows take the unfused ops
    import customops
    from customops import testing as T

    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        g = torch.Generator().manual_seed(0)
        n, k = 1499, 256  # an odd feature count: blocks of unequal size
        x = torch.randn(2, rows, 2 * k if prologue == "swiglu" else k, generator=g)
        w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
        r = torch.randn(n, 2, rows, generator=g).permute(1, 2, 0)  # non-contiguous
        nw = torch.rand(k, generator=g) + 0.5 if prologue == "rms_norm" else None
        y = customops.fused_linear(x, w, b, r, prologue=prologue, norm_weight=nw)
        ref = T.OPS_BY_NAME["fused_linear"].ref(x.double(), w.double(), b.double(), r.double(), prologue=prologue,
                                                norm_weight=None if nw is None else nw.double())
        assert y.shape == (2, rows, n) and y.is_contiguous()
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)
