"""The op table's types and what every part of customops.testing shares: :class:`Sample`,
:class:`OpInfo` (one row of the table), :class:`FuzzSource` (what a row's fuzz maker draws from),
the dtypes and tolerances rows use, copying samples, and the devices to test.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import torch
from torch.utils._pytree import tree_map


FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# (atol, rtol) of a result rounded once to the dtype, compared with a float64 reference.
ROUNDED_ONCE = {
    torch.float32: (1e-5, 1.3e-6 * 4),
    torch.float64: (1e-10, 1e-10),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 8e-3),
}

# A sum (over a row, or over keys) in float32 before the final rounding: a little looser.
SUMMED_THEN_ROUNDED = {**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
                       torch.bfloat16: (2e-2, 1.6e-2)}


class FuzzSource(Protocol):
    """What a row's ``fuzz`` maker draws from; tests/python/test_fuzz.py implements it with
    hypothesis, so a failing case shrinks to a small one. Sizes are 0, 1, small odd numbers or a
    few thousand; every tensor comes in a drawn layout (contiguous, transposed, sliced with a step,
    expanded with stride 0, offset into its storage, channels-last) and, unless ``values`` says
    otherwise, holds NaN, +-inf, huge, tiny and denormal values among normal ones. ``gradients``
    is true when the sample is for a gradient check: makers then keep off the points where the op
    is not differentiable (eps = 0 on a row of one element, clamp bounds that tie)."""

    gradients: bool

    def choice(self, options: Sequence): ...

    def size(self, most: int | None = None) -> int: ...

    def shape(self, min_rank: int = 0, max_rank: int = 5, most: int | None = None) -> tuple[int, ...]: ...

    # values: "any" (NaN and inf too), "finite" (huge, tiny, denormal), "nonfinite" (NaN, inf, tiny
    # and denormal but nothing huge: for ops ill-conditioned in huge inputs, as softmax's near-ties
    # are) or "normal" (randn only);
    # writable=False allows expanded layouts, whose elements share memory.
    def tensor(self, shape, dtype, device, values: str = "any", writable: bool = False) -> torch.Tensor: ...

    # int64 class indices in [0, high), some of them ignore_index
    def index(self, shape, high: int, device, ignore_index: int | None = None) -> torch.Tensor: ...


@dataclasses.dataclass
class Sample:
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    desc: str = ""
    error: str | None = None  # a drawn sample the op must reject: the regex of its error


def with_written(y, args, writes: tuple):
    """An op's result y followed by (copies of) the arguments it wrote in place."""
    if not writes:
        return y
    returned = () if y is None else tuple(y) if isinstance(y, (tuple, list)) else (y,)
    return returned + tuple(args[i].clone() for i in writes)


@dataclasses.dataclass
class OpInfo:
    name: str  # "muladd" or "muladd.out": the row's label and the overload it tests
    samples: Callable[[torch.device, torch.dtype, bool], list[Sample]]  # (device, dtype, requires_grad)
    ref: Callable  # float64 reference with the op's signature; returns what the op returns
    batch: Callable[[torch.device, torch.dtype, int], Sample]  # a sample whose leading size is n
    bad_inputs: Callable[[torch.device], list[tuple[Sample, str]]]  # (sample, regex of the error)
    tolerances: dict = dataclasses.field(default_factory=lambda: dict(ROUNDED_ONCE))
    differentiable: bool = True  # out= variants are not
    double_backward: bool = True  # else: double backward must raise a clear error
    diff_outputs: tuple = (0,)  # outputs that carry gradients (rms_norm's rstd does not)
    # Under torch.autocast: "promote" (mixed inputs go to the widest dtype), "norm" (x keeps its
    # dtype, a float32 weight is taken as it is), "add_norm" (x and residual promoted, then
    # "norm"), "first" (every tensor cast to the first one's dtype), "lower" (float32 tensors run
    # in the autocast dtype, as a linear layer), "float32" (any dtype read as it is, computed and
    # returned in float32), "as_is" (inputs taken as they come, outputs in dtypes of the op's own:
    # the quantizers) or "none" (runs in its input's dtype).
    autocast: str = "none"
    # Positions of the differentiable tensor arguments; None: every floating-point tensor.
    grad_args: tuple | None = None
    # Outputs are sums of terms that can cancel (x + residual, lse - logit, a rotation): where
    # inputs are huge, the fuzz suite allows an error of a few float32 ulps of the largest one.
    cancels: bool = False
    # Draws one random sample from a FuzzSource (the property-based suite, test_fuzz.py).
    fuzz: Callable[[FuzzSource, torch.device, torch.dtype], Sample] | None = None
    # Positions of the arguments the op writes in place (cache_write, rope_cache_write): the checks
    # take their new values (copies) as outputs after what it returns, and the reference returns
    # them there too.
    writes: tuple = ()
    # The reference takes the sample in its own dtype, not float64: a rounding op whose result
    # depends on that dtype (quantize_int4 rounds against its scale as stored in the weight's).
    ref_in_dtype: bool = False

    def run(self, *args, **kwargs):
        """The op's outputs: what it returns, then copies of what it wrote (``writes``)."""
        y = self.op(*args, **kwargs)
        return with_written(y, args, self.writes)

    def differentiable_arg(self, i: int, x) -> bool:
        if not (self.differentiable and isinstance(x, torch.Tensor) and x.is_floating_point()):
            return False
        if x.dtype.itemsize == 1:  # a quantized weight (float8): frozen
            return False
        return self.grad_args is None or i in self.grad_args

    @property
    def op(self) -> torch._ops.OpOverload:
        name, _, overload = self.name.partition(".")
        return getattr(getattr(torch.ops.customops, name), overload or "default")

    @property
    def qualname(self) -> str:
        return f"customops::{self.name}"


def _to64(x):
    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _clone(x):
    return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def clone_sample(s: Sample) -> Sample:
    return Sample(tree_map(_clone, s.args), tree_map(_clone, s.kwargs), s.desc)


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and _built_with_cuda() else [])


def _built_with_cuda() -> bool:
    import customops

    return bool(customops.build_info()["cuda"])
