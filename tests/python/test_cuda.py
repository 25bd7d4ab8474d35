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
    op = info.op
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
