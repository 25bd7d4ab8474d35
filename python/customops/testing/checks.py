"""The generic checks, each on one row of the op table, raising AssertionError (or the op's own
error) on failure: correctness against the float64 reference, the Meta kernel, autograd, opcheck,
gradcheck, torch.compile, torch.export and bad inputs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from .core import OpInfo, Sample, _to64, clone_sample


def _outputs(y) -> tuple:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _call(info: OpInfo, s: Sample):
    return info.run(*s.args, **s.kwargs)


def check_correctness(info: OpInfo, device, dtype) -> int:
    """The op against its float64 reference on every sample; returns the number of samples."""
    atol, rtol = info.tolerances[dtype]
    samples = info.samples(torch.device(device), dtype, False)
    for s in samples:
        got = _outputs(_call(info, clone_sample(s)))
        ref_args = s if info.ref_in_dtype else Sample(*tree_map(_to64, (s.args, s.kwargs)))
        want = _outputs(info.ref(*ref_args.args, **ref_args.kwargs))
        assert len(got) == len(want), f"{info.qualname}: {len(got)} outputs, reference has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.device.type == torch.device(device).type, f"{info.qualname}: output on {g.device}"
            assert g.shape == w.shape, f"{info.qualname} [{s.desc}] output {i}: shape {g.shape} != {w.shape}"
            torch.testing.assert_close(g.to(torch.float64), w.to(torch.float64), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{info.qualname} {dtype} [{s.desc}] output {i}: {m}")
    return len(samples)


def check_meta(info: OpInfo, device="cpu") -> None:
    """Meta kernel: the same shapes, dtypes and strides as the real kernel, on every sample."""
    for s in info.samples(torch.device(device), torch.float32, False):
        real = _outputs(_call(info, clone_sample(s)))
        meta = _outputs(_call(info, Sample(*tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x,
                                                     (s.args, s.kwargs)))))
        for r, m in zip(real, meta):
            assert m.device.type == "meta"
            assert (m.shape, m.dtype) == (r.shape, r.dtype), f"{info.qualname} [{s.desc}]: meta {m.shape} {m.dtype}"
            if r.numel() > 1:
                assert m.stride() == r.stride(), f"{info.qualname} [{s.desc}]: meta strides {m.stride()} != {r.stride()}"


def _grad_inputs(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _loss(outputs, which=None) -> torch.Tensor:
    # A fixed weighting per differentiable output, so every output's gradient is exercised.
    total = 0
    for i, y in enumerate(outputs):
        if which is not None and i not in which:
            continue
        if y.is_floating_point():
            w = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).reshape(y.shape)
            total = total + (y * w).sum() * (i + 1)
    return total


def check_autograd(info: OpInfo, device, dtype=torch.float32) -> None:
    """Gradients of the op equal the reference's (autograd of the float64 reference)."""
    if not info.differentiable:
        return
    atol, rtol = info.tolerances[dtype]
    for s in info.samples(torch.device(device), dtype, True):
        xs = _grad_inputs(s.args)
        got = torch.autograd.grad(_loss(_outputs(_call(info, s)), info.diff_outputs), xs, allow_unused=True) if xs and any(
            x.numel() for x in xs) else None
        s64 = Sample(tree_map(lambda x: _to64(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x,
                              s.args), {}, s.desc)
        xs64 = _grad_inputs(s64.args)
        if got is None:
            continue
        want = torch.autograd.grad(_loss(_outputs(info.ref(*s64.args)), info.diff_outputs), xs64, allow_unused=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.to(torch.float64), w, atol=atol * 10, rtol=rtol * 10,
                                       msg=lambda m: f"{info.qualname} grad [{s.desc}]: {m}")


def opcheck_samples(info: OpInfo, device) -> list[Sample]:
    """Contiguous, non-contiguous and empty samples, with and without requires_grad."""
    samples = info.samples(torch.device(device), torch.float32, False)
    if info.differentiable:
        samples = samples + info.samples(torch.device(device), torch.float32, True)
    return samples


def _float8(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype.itemsize == 1


def check_opcheck(info: OpInfo, device) -> int:
    """torch.library.opcheck with all four default tests on every opcheck sample. With a float8
    input (a quantized weight) torch's schema test cannot run (it compares inputs with a multiply
    that float8 lacks): the other three run, and a bytewise comparison checks that the op wrote
    none of its inputs, as the schema says."""
    samples = opcheck_samples(info, device)
    for s in samples:
        if not any(_float8(a) for a in s.args):
            torch.library.opcheck(info.op, s.args, s.kwargs)
            continue
        torch.library.opcheck(info.op, s.args, s.kwargs,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
        before = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in s.args]
        info.op(*s.args, **s.kwargs)
        for i, (a, b) in enumerate(zip(s.args, before)):
            if isinstance(a, torch.Tensor) and i not in info.writes:
                assert torch.equal(a.detach().view(torch.uint8), b.view(torch.uint8)) if a.numel() and a.is_contiguous() \
                    else torch.equal(a.detach().float(), b.float()), f"{info.qualname} [{s.desc}] wrote its input {i}"
    return len(samples)


def check_gradcheck(info: OpInfo, device) -> None:
    """gradcheck and gradgradcheck in float64 (or a clear error where double backward is unsupported)."""
    if not info.differentiable:
        return
    for s in info.samples(torch.device(device), torch.float64, True)[:3]:
        xs = _grad_inputs(s.args)
        pos = [i for i, a in enumerate(s.args) if isinstance(a, torch.Tensor) and a.requires_grad]

        def fn(*ts, s=s, pos=pos):
            args = list(s.args)
            for i, t in zip(pos, ts):
                args[i] = t
            outs = _outputs(info.run(*args, **s.kwargs))
            return tuple(outs[i] for i in info.diff_outputs)

        assert torch.autograd.gradcheck(fn, xs, check_forward_ad=True), f"{info.qualname}: gradcheck failed [{s.desc}]"
        if info.double_backward:
            assert torch.autograd.gradgradcheck(fn, xs, check_fwd_over_rev=True), (
                f"{info.qualname}: gradgradcheck failed [{s.desc}]")
        else:
            y = _loss(_outputs(fn(*xs)))
            grads = torch.autograd.grad(y, xs, create_graph=True)
            try:
                torch.autograd.grad(sum(g.sum() for g in grads if g is not None), xs, allow_unused=True)
            except RuntimeError as e:
                assert f"double backward is not supported for {info.qualname}" in str(e), str(e)
            else:
                raise AssertionError(f"{info.qualname}: double backward neither worked nor raised")


def _dynamic_dims(info: OpInfo, device, dtype) -> tuple[Sample, Sample, object]:
    """Two batch samples and the export dynamic_shapes spec derived from where they differ."""
    a, b = info.batch(device, dtype, 3), info.batch(device, dtype, 5)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)

    def spec(x, y):
        if not isinstance(x, torch.Tensor):
            return None
        dims = {d: batch for d in range(x.dim()) if x.shape[d] != y.shape[d]}
        return dims or None

    args_spec = tuple(spec(x, y) for x, y in zip(a.args, b.args))
    kw_spec = {k: spec(a.kwargs[k], b.kwargs[k]) for k in a.kwargs}
    return a, b, (args_spec, kw_spec)


def check_compile(info: OpInfo, device, backend="inductor", sizes=(3, 5, 17)) -> int:
    """torch.compile(fullgraph=True, dynamic=True): equal to eager forward and backward on three
    sizes, with no recompilation after the first. Returns the number of graphs compiled."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    op = info.run

    def fn(*args, **kwargs):
        return op(*args, **kwargs)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    first = None
    for n in sizes:
        s = info.batch(torch.device(device), torch.float32, n)
        if info.differentiable:
            s = Sample(tuple(x.requires_grad_() if info.differentiable_arg(i, x) else x for i, x in enumerate(s.args)),
                       s.kwargs)
        e = clone_sample(s)
        got, want = _outputs(compiled(*s.args, **s.kwargs)), _outputs(fn(*e.args, **e.kwargs))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} compiled forward, batch {n}: {m}")
        if info.differentiable:
            gg = torch.autograd.grad(_loss(got, info.diff_outputs), _grad_inputs(s.args))
            gw = torch.autograd.grad(_loss(want, info.diff_outputs), _grad_inputs(e.args))
            for g, w in zip(gg, gw):
                torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} compiled backward, batch {n}: {m}")
        # Dynamo may trace the first call twice (it retries with float arguments specialized);
        # what matters is that no later size compiles again.
        first = counter.frame_count if first is None else first
    assert counter.frame_count == first, f"{info.qualname}: recompiled for sizes {sizes} ({counter.frame_count} graphs)"
    return counter.frame_count


class _OpModule(torch.nn.Module):
    """Calls op with keyword arguments passed positionally after the others (export-friendly)."""

    def __init__(self, op, n_args: int, kwnames: Sequence[str]):
        super().__init__()
        self.op, self.n_args, self.kwnames = op, n_args, tuple(kwnames)

    def forward(self, *flat):
        return self.op(*flat[: self.n_args], **dict(zip(self.kwnames, flat[self.n_args:])))


def export(info: OpInfo, device, dtype=torch.float32) -> tuple[torch.export.ExportedProgram, Callable]:
    """torch.export of the op alone with a dynamic batch dimension; also returns how to turn a
    Sample into the exported program's positional inputs."""
    a, _, (args_spec, kw_spec) = _dynamic_dims(info, torch.device(device), dtype)
    names = list(a.kwargs)
    flat = lambda s: tuple(s.args) + tuple(s.kwargs[k] for k in names)  # noqa: E731
    mod = _OpModule(info.run, len(a.args), names)
    spec = {"flat": tuple(args_spec) + tuple(kw_spec[k] for k in names)}
    return torch.export.export(mod, flat(a), dynamic_shapes=spec), flat


def check_export(info: OpInfo, device, sizes=(2, 7, 33)) -> None:
    """The exported program runs at several batch sizes and equals eager."""
    ep, flat = export(info, device)
    mod = ep.module()
    for n in sizes:
        s = info.batch(torch.device(device), torch.float32, n)
        e = clone_sample(s)
        for g, w in zip(_outputs(mod(*flat(s))), _outputs(info.run(*e.args, **e.kwargs))):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} exported, batch {n}: {m}")


def check_bad_inputs(info: OpInfo, device) -> int:
    """Every bad input raises RuntimeError naming the op and the argument."""
    import re

    cases = info.bad_inputs(torch.device(device))
    for s, pattern in cases:
        try:
            _call(info, s)
        except RuntimeError as e:
            assert re.search(pattern, str(e)), f"{info.qualname}: error {str(e)!r} does not match {pattern!r}"
        else:
            raise AssertionError(f"{info.qualname}: no error for bad input, expected {pattern!r}")
    return len(cases)
