"""Subsystem behaviour beyond the op table's generic checks: torch.func on modules, forward-mode
AD through torch.autograd.forward_ad, mixed-precision weights, and the errors transforms raise
where an op has no formula."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import func

import customops
from conftest import DEVICES


class Block(torch.nn.Module):
    """RMSNorm -> gate-up projection -> SwiGLU -> down projection, as in a Llama MLP."""

    def __init__(self, d=16, h=24):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.rand(d, dtype=torch.float64) + 0.5)
        self.up = torch.nn.Linear(d, 2 * h, dtype=torch.float64)
        self.down = torch.nn.Linear(h, d, dtype=torch.float64)

    def forward(self, x, ops=customops):
        if ops is customops:
            return self.down(customops.swiglu(self.up(customops.rms_norm(x, self.norm))))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        g, u = self.up(x).chunk(2, -1)
        return self.down(g * torch.sigmoid(g) * u)


def test_functional_call_per_sample_gradients():
    torch.manual_seed(0)
    model = Block()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3, 16, dtype=torch.float64)

    def loss(p, xb, ops):
        return func.functional_call(model, p, (xb,), {"ops": ops}).pow(2).sum()

    got = func.vmap(func.grad(loss), in_dims=(None, 0, None))(params, x, customops)
    want = func.vmap(func.grad(loss), in_dims=(None, 0, None))(params, x, torch)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_ad_dual_tensors(device):
    x = torch.randn(4, 10, dtype=torch.float64, device=device)
    t = torch.randn_like(x)
    w = torch.rand(10, dtype=torch.float64, device=device) + 0.5
    with fwAD.dual_level():
        y = customops.rms_norm(fwAD.make_dual(x, t), w)
        got = fwAD.unpack_dual(customops.silu(y)).tangent
    ref = lambda v: torch.nn.functional.silu(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w)  # noqa: E731
    torch.testing.assert_close(got, func.jvp(ref, (x,), (t,))[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_float32_weight_with_half_x(dtype, device):
    x = torch.randn(8, 64, device=device, dtype=dtype, requires_grad=True)
    w = (torch.rand(64, device=device) + 0.5).requires_grad_()
    y = customops.rms_norm(x, w)
    assert y.dtype == dtype
    g = torch.randn_like(y)
    y.backward(g)
    assert x.grad.dtype == dtype and w.grad.dtype == torch.float32
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=2e-2, rtol=2e-2)


def test_jvp_of_a_backward_op_without_formula_raises():
    x = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="double backward is not supported for customops::silu"):
        func.jacfwd(func.jacrev(lambda v: customops.silu(v).sum()))(x)


def test_out_variant_refuses_tangents():
    a = torch.randn(3)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="customops::muladd.out: out= arguments don't support"):
            customops.muladd(fwAD.make_dual(a, torch.ones(3)), a, 1.0, out=torch.empty(3))


def test_vmap_out_variant_needs_batched_out():
    a = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="customops::muladd.out: vmap: out is not batched"):
        func.vmap(lambda u: customops.muladd(u, u, 1.0, out=torch.empty(3)))(a)


def test_autocast_in_a_compiled_function():
    lin = torch.nn.Linear(16, 16)
    w = torch.rand(16) + 0.5

    def f(x):
        return customops.silu_mul(lin(customops.rms_norm(x, w)), x)

    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = f(x)
        got = torch.compile(f, fullgraph=True)(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
