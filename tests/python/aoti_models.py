"""The models the AOTInductor tests package: one that calls every op of the op table (built from
each row's batch sample, so a new row is covered without editing the tests), and an ATen-only
twin for telling customops' part in a failure from AOTInductor's."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from customops import testing as T

# Batch sizes the packages are run at; the export's batch range covers them.
BATCH_SIZES = (1, 6, 33)


@dataclasses.dataclass
class Case:
    module: torch.nn.Module
    inputs: Callable[[int], tuple]  # batch size -> the module's positional inputs
    dynamic_shapes: object  # for torch.export.export(module, inputs(n), dynamic_shapes=...)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class EveryOp(torch.nn.Module):
    """Calls each op once, on its own slice of the (flat, tensor-only) inputs; returns every output.

    Each row's non-tensor arguments are constants of the module. Arguments the op writes (out=,
    in-place) get a clone of their input, so the module never mutates what it is given.
    """

    def __init__(self, rows: list[T.OpInfo], samples: list[T.Sample]):
        super().__init__()
        self.plans = []
        for info, s in zip(rows, samples):
            written = {a.name for a in info.op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
            positional = [a.name for a in info.op._schema.arguments]
            args = [("tensor", positional[i] in written) if _is_tensor(a) else ("const", a) for i, a in enumerate(s.args)]
            kwargs = {k: ("tensor", k in written) if _is_tensor(v) else ("const", v) for k, v in s.kwargs.items()}
            self.plans.append((info.op, args, kwargs, info.writes))

    def forward(self, *flat):
        it = iter(flat)

        def take(kind, x):
            if kind == "const":
                return x
            t = next(it)
            return t.clone() if x else t

        outs = []
        for op, args, kwargs, writes in self.plans:
            # Positional first: in op(*gen, **{...}) Python builds the dict before it drains gen.
            a = [take(*x) for x in args]
            y = op(*a, **{k: take(*v) for k, v in kwargs.items()})
            y = T.with_written(y, a, writes)  # what it wrote (into clones of the inputs) after what it returns
            outs.extend(y if isinstance(y, (tuple, list)) else (y,))
        # float8 outputs (quantize_fp8's) as their bytes: the tensor files the runner writes and
        # reads (torch.save / pickle_save) carry no float8 in torch 2.13 (torch.load(weights_only)
        # refuses its storage; the C++ unpickler, its rebuild)
        return tuple(o.view(torch.uint8) if o.is_floating_point() and o.element_size() == 1 else o for o in outs)


def _flat_tensors(samples: list[T.Sample]) -> tuple:
    return tuple(x for s in samples for x in (*s.args, *s.kwargs.values()) if _is_tensor(x))


def every_op(device, dtype=torch.float32) -> Case:
    """Every row of customops.testing.OPS in one module, batch dimension dynamic."""
    device = torch.device(device)
    rows = list(T.OPS)

    def inputs(n):
        return _flat_tensors([info.batch(device, dtype, n) for info in rows])

    module = EveryOp(rows, [info.batch(device, dtype, 3) for info in rows])
    return Case(module, inputs, _dynamic_shapes(inputs, varargs=True))


class AtenOnly(torch.nn.Module):
    """The same kind of elementwise work as muladd and mul, in ATen ops only."""

    def forward(self, a, b):
        y = a * b + 0.75
        return y, y * b


def aten_only(device, dtype=torch.float32) -> Case:
    device = torch.device(device)

    def inputs(n):
        return (torch.randn(n, 8, device=device, dtype=dtype), torch.randn(n, 8, device=device, dtype=dtype))

    return Case(AtenOnly(), inputs, _dynamic_shapes(inputs, varargs=False))


def _dynamic_shapes(inputs: Callable[[int], tuple], varargs: bool):
    """The export spec: every dimension that differs between two batch sizes is the batch
    (keyed "flat" for a forward that takes *flat)."""
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    a, b = inputs(3), inputs(5)
    spec = tuple({d: batch for d in range(x.dim()) if x.shape[d] != y.shape[d]} or None for x, y in zip(a, b))
    return {"flat": spec} if varargs else spec


def eager(case: Case, inputs: tuple) -> tuple:
    with torch.no_grad():
        y = case.module(*(x.clone() for x in inputs))
    return tuple(y)
