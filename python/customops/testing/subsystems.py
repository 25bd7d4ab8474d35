"""Checks of one row of the op table under PyTorch's subsystems, each raising AssertionError on
failure: torch.func transforms, vmap through the op's batching rule, autocast policies and
compiled autograd.
"""

from __future__ import annotations

import functools

import torch

from .checks import _call, _grad_inputs, _loss, _outputs
from .core import OpInfo, Sample, clone_sample


def _func_samples(info: OpInfo, device) -> list[Sample]:
    """A few small float64 samples with gradients (Jacobians are numel x numel)."""
    out = []
    for s in info.samples(torch.device(device), torch.float64, True):
        xs = _grad_inputs(s.args)
        if xs and all(0 < x.numel() <= 256 for x in xs):
            out.append(s)
    return out[:3]


def _as_function(info: OpInfo, s: Sample, fn=None):
    """(f, xs): f(*xs) -> the differentiable outputs of fn (the op, or its reference) on s with
    its requires-grad tensors replaced by xs."""
    fn = info.run if fn is None else fn
    pos = [i for i, a in enumerate(s.args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def f(*xs):
        args = list(s.args)
        for i, x in zip(pos, xs):
            args[i] = x
        outs = _outputs(fn(*args, **s.kwargs))
        return tuple(outs[i] for i in info.diff_outputs)

    return f, tuple(s.args[i].detach() for i in pos)


def check_func(info: OpInfo, device) -> int:
    """torch.func transforms against the same transforms of the float64 reference: grad, vjp,
    jvp, jacrev, jacfwd, and hessian where double backward exists (a clear error where not)."""
    from torch import func

    if not info.differentiable:
        return 0
    samples = _func_samples(info, device)
    for s in samples:
        f, xs = _as_function(info, s)
        r, _ = _as_function(info, s, info.ref)
        msg = lambda what: (lambda m: f"{info.qualname} torch.func.{what} [{s.desc}]: {m}")  # noqa: E731
        close = lambda got, want, what: torch.testing.assert_close(got, want, msg=msg(what))  # noqa: E731
        cot = tuple(torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape) for y in r(*xs))
        tan = tuple(torch.randn_like(x) for x in xs)
        loss = lambda g: (lambda *a: sum((y * c).sum() for y, c in zip(g(*a), cot)))  # noqa: E731
        close(func.grad(loss(f), argnums=tuple(range(len(xs))))(*xs),
              func.grad(loss(r), argnums=tuple(range(len(xs))))(*xs), "grad")
        (y, pull), (yr, pull_r) = func.vjp(f, *xs), func.vjp(r, *xs)
        close(y, yr, "vjp output")
        close(pull(cot), pull_r(cot), "vjp")
        close(func.jvp(f, xs, tan), func.jvp(r, xs, tan), "jvp")
        argnums = tuple(range(len(xs)))
        jr = func.jacrev(r, argnums=argnums)(*xs)
        close(func.jacrev(f, argnums=argnums)(*xs), jr, "jacrev")
        close(func.jacfwd(f, argnums=argnums)(*xs), jr, "jacfwd")
        if info.double_backward:
            close(func.hessian(loss(f))(*xs), func.hessian(loss(r))(*xs), "hessian")
        else:
            try:
                func.hessian(loss(f))(*xs)
            except RuntimeError as e:
                assert f"double backward is not supported for {info.qualname}" in str(e), str(e)
            else:
                raise AssertionError(f"{info.qualname}: torch.func.hessian neither worked nor raised")
    return len(samples)


class no_vmap_fallback:
    """Within it, an op without a batching rule raises instead of taking functorch's per-entry
    fallback: proof that vmap calls the op once on the whole batch."""

    def __enter__(self):
        self._was = torch._C._functorch._is_vmap_fallback_enabled()
        torch._C._functorch._set_vmap_fallback_enabled(False)

    def __exit__(self, *exc):
        torch._C._functorch._set_vmap_fallback_enabled(self._was)


def _positional(info: OpInfo, s: Sample):
    """(fn, args): the op with keyword tensors (out=) passed positionally, for vmap's in_dims."""
    names = list(s.kwargs)
    n = len(s.args)

    def fn(*a):
        return info.run(*a[:n], **dict(zip(names, a[n:])))

    return fn, tuple(s.args) + tuple(s.kwargs[k] for k in names)


def check_vmap(info: OpInfo, device, dtype=torch.float64, entries=4) -> int:
    """vmap with the batching rules (the fallback disabled): batch dim first and last, shared
    (unbatched) arguments, per-entry weights, nested vmap, and vmap(grad) per-entry gradients,
    each against a loop of calls. Returns the number of variants checked."""
    from torch import func

    dev = torch.device(device)
    per_entry = [_positional(info, info.batch(dev, dtype, 3)) for _ in range(entries)]
    fn, first = per_entry[0]
    other = _positional(info, info.batch(dev, dtype, 5))[1]
    rows = [isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(first, other)]
    tensors = [isinstance(a, torch.Tensor) for a in first]
    loop = lambda argsets: tuple(torch.stack(ys) for ys in zip(*(_outputs(fn(*clone_sample(Sample(a)).args)) for a in argsets)))  # noqa: E731

    def stacked(batched, dim=0):
        return tuple(torch.stack([args[i] for _, args in per_entry], dim) if batched[i] else first[i]
                     for i in range(len(first)))

    def compare(got, want, what):
        for g, w in zip(_outputs(got), want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{info.qualname} vmap ({what}): {m}")

    variants = 0
    with no_vmap_fallback():
        # Rows batched, other tensors shared: batch dim first, then last.
        shared = [tuple(a if rows[i] else first[i] for i, a in enumerate(args)) for _, args in per_entry]
        want = loop(shared)
        in_dims = tuple(0 if r else None for r in rows)
        compare(func.vmap(fn, in_dims)(*stacked(rows)), want, "batch dim 0")
        in_last = tuple(-1 if r else None for r in rows)
        got = func.vmap(fn, in_last, out_dims=-1)(*stacked(rows, -1))
        compare(tuple(g.movedim(-1, 0) for g in _outputs(got)), want, "batch dim -1")
        variants += 2
        # Every tensor batched (per-entry weights), when some were shared above.
        if any(t and not r for t, r in zip(tensors, rows)):
            want_all = loop([args for _, args in per_entry])
            compare(func.vmap(fn, tuple(0 if t else None for t in tensors))(*stacked(tensors)), want_all,
                    "all tensors batched")
            variants += 1
        # Nested: entries as 2 x (entries / 2).
        nested = tuple(a.reshape(2, entries // 2, *a.shape[1:]) if r else a for a, r in zip(stacked(rows), rows))
        got = func.vmap(func.vmap(fn, in_dims), in_dims)(*nested)
        compare(tuple(g.flatten(0, 1) for g in _outputs(got)), want, "nested")
        variants += 1
        # Per-entry gradients of the row inputs.
        if info.differentiable:
            diff = [i for i, r in enumerate(rows) if r and first[i].is_floating_point()]

            def loss(*a):
                outs = _outputs(fn(*a))
                return sum((outs[k] * torch.linspace(-1, 1, outs[k].numel(), dtype=outs[k].dtype,
                                                     device=outs[k].device).reshape(outs[k].shape)).sum()
                           for k in info.diff_outputs)

            got = func.vmap(func.grad(loss, argnums=tuple(diff)), in_dims)(*stacked(rows))
            wants = []
            for args in shared:
                a = [x.detach().clone().requires_grad_(i in diff) if isinstance(x, torch.Tensor) else x
                     for i, x in enumerate(args)]
                wants.append(torch.autograd.grad(loss(*a), [a[i] for i in diff]))
            compare(got, tuple(torch.stack(ws) for ws in zip(*wants)), "vmap(grad)")
            variants += 1
    return variants


def _autocast_policy(policy: str, args: list, ti: list[int], low: torch.dtype) -> list:
    """args as an op of the given autocast policy computes with them: copies that require a
    gradient where args do (an op may compute its forward differently when one is needed:
    fused_linear takes itself apart)."""
    a = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in args]
    if policy == "promote":
        widest = functools.reduce(torch.promote_types, (a[i].dtype for i in ti))
        return [x.to(widest) if i in ti else x for i, x in enumerate(a)]
    if policy == "lower":  # as ATen's lower-precision ops: float32 tensors run in the autocast dtype
        return [x.to(low) if i in ti and x.dtype == torch.float32 else x for i, x in enumerate(a)]
    if policy == "first":
        return [x.to(a[ti[0]].dtype) if i in ti else x for i, x in enumerate(a)]
    if policy == "add_norm":  # x and residual promoted, then the weight as "norm"
        wide = torch.promote_types(a[ti[0]].dtype, a[ti[1]].dtype)
        a[ti[0]], a[ti[1]] = a[ti[0]].to(wide), a[ti[1]].to(wide)
        ti = [ti[0], ti[2]]
    if policy in ("norm", "add_norm"):
        x, w = a[ti[0]], a[ti[1]]
        half_x = x.dtype in (torch.float16, torch.bfloat16)
        if not (w.dtype == x.dtype or (half_x and w.dtype == torch.float32)):
            a[ti[1]] = w.to(torch.float32 if half_x else x.dtype)
    return a


def check_autocast(info: OpInfo, device) -> int:
    """Inside torch.autocast the op takes what autocast ops produce (mixed dtypes) and returns
    what its policy says, forward and backward (gradients in each input's own dtype)."""
    dev = torch.device(device)
    low_dtypes = [torch.bfloat16] + ([torch.float16] if dev.type == "cuda" else [])
    checked = 0
    for low in low_dtypes:
        s = info.batch(dev, torch.float32, 3)
        fn, args = _positional(info, s)
        ti = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if info.autocast == "promote":
            cases = [({ti[0]: low}, torch.float32), ({i: low for i in ti}, low)]
        elif info.autocast == "norm":
            cases = [({ti[0]: low}, low), ({ti[1]: low}, torch.float32), ({i: low for i in ti}, low)]
        elif info.autocast == "add_norm":
            cases = [({ti[0]: low}, torch.float32), ({ti[0]: low, ti[1]: low}, low), ({i: low for i in ti}, low)]
        elif info.autocast == "float32":  # computes in float32 whatever it is given, returns float32
            cases = [({}, torch.float32), ({i: low for i in ti}, torch.float32)]
        elif info.autocast == "as_is":  # inputs as they come, outputs of the op's own dtypes (a quantizer's)
            cases = [({}, None), ({i: low for i in ti}, None)]
        elif info.autocast == "lower":  # output dtype: the op's on the cast inputs (checked below)
            cases = [({}, None), ({ti[0]: low}, None), ({i: low for i in ti}, None)]
        elif info.autocast == "first":
            cases = [({ti[0]: low}, low), ({i: low for i in ti[1:]}, torch.float32), ({i: low for i in ti}, low)]
        else:
            cases = [({}, torch.float32), ({i: low for i in ti}, low)]
        for casts, want_dtype in cases:
            a = [x.detach().to(casts[i]).requires_grad_(info.differentiable_arg(i, x)) if i in casts else
                 (x.detach().clone().requires_grad_(info.differentiable_arg(i, x)) if isinstance(x, torch.Tensor) else x)
                 for i, x in enumerate(args)]
            with torch.autocast(dev.type, dtype=low):
                outs = _outputs(fn(*a))
            y = outs[0]
            if want_dtype is None:
                want_dtype = _outputs(fn(*_autocast_policy(info.autocast, a, ti, low)))[0].dtype
            assert y.dtype == want_dtype, (f"{info.qualname} under autocast({low}) with {casts}: output dtype "
                                           f"{y.dtype}, policy {info.autocast!r} says {want_dtype}")
            # Values: the op outside autocast on the inputs cast as the policy casts them.
            torch.testing.assert_close(y, _outputs(fn(*_autocast_policy(info.autocast, a, ti, low)))[0],
                                       msg=lambda m: f"{info.qualname} under autocast({low}): {m}")
            if info.differentiable:
                xs = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad]
                grads = torch.autograd.grad(_loss(outs, info.diff_outputs), xs)
                for x, g in zip(xs, grads):
                    assert g.dtype == x.dtype and bool(torch.isfinite(g).all()), (
                        f"{info.qualname} under autocast: gradient {g.dtype} for an input of {x.dtype}")
            checked += 1
    return checked


def check_compiled_autograd(info: OpInfo, device, backend="aot_eager") -> int:
    """The backward under compiled autograd (torch._dynamo.compiled_autograd) equals eager's."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    if not info.differentiable:
        return 0
    torch._dynamo.reset()
    samples = [s for s in info.samples(torch.device(device), torch.float32, True)
               if any(x.numel() for x in _grad_inputs(s.args))][:3]
    for s in samples:
        e = clone_sample(s)
        want = torch.autograd.grad(_loss(_outputs(_call(info, e)), info.diff_outputs), _grad_inputs(e.args))
        xs = _grad_inputs(s.args)
        for x in xs:
            x.grad = None
        with compiled_autograd._enable(torch.compile(backend=backend)):
            _loss(_outputs(_call(info, s)), info.diff_outputs).backward()
        for x, w in zip(xs, want):
            torch.testing.assert_close(x.grad, w, msg=lambda m: f"{info.qualname} compiled autograd [{s.desc}]: {m}")
    torch._dynamo.reset()
    return len(samples)
