"""RMSNorm (as Hugging Face writes it, and F.rms_norm), the residual add in front of it, SwiGLU
and silu: the norm and activation patterns of the customops backend."""

from __future__ import annotations

import itertools
import operator

import torch
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg, Match
from torch.fx import Node

from ._match import _emit, _fuse_pass, _last_pass, _norm_pass, _register, _same, _skip, _val, aten, cops


@_register([CallFunction(aten.mul.Tensor, KeywordArg("x"), CallFunction(aten.sigmoid.default, KeywordArg("x"))),
            CallFunction(aten.mul.Tensor, CallFunction(aten.sigmoid.default, KeywordArg("x")), KeywordArg("x"))],
           _norm_pass)
def _silu_spelled_out(match: Match, x):
    _emit(match.graph, aten.silu.default, [x], [match.output_node()], "x * sigmoid(x) -> silu")
    match.erase_nodes()


# RMSNorm as Hugging Face writes it (optional float32 upcast and downcast, pow or x * x,
# weight on either side or none).
def _rms_patterns():
    for upcast, square, downcast, weight in itertools.product((True, False), ("pow", "mul"), (True, False),
                                                              ("left", "right", None)):
        xf = CallFunction(aten.to.dtype, KeywordArg("x"), KeywordArg("up"), _users=2) if upcast else KeywordArg("x")
        sq = (CallFunction(aten.pow.Tensor_Scalar, xf, 2) if square == "pow"
              else CallFunction(aten.mul.Tensor, xf, xf))
        mean = CallFunction(aten.mean.dim, sq, KeywordArg("dims"), True)
        rstd = CallFunction(aten.rsqrt.default, CallFunction(aten.add.Tensor, mean, KeywordArg("eps")))
        y = CallFunction(aten.mul.Tensor, xf, rstd, _users=1)
        if downcast:
            y = CallFunction(aten.to.dtype, y, KeywordArg("down"))
        if weight == "left":
            y = CallFunction(aten.mul.Tensor, KeywordArg("w"), y)
        elif weight == "right":
            y = CallFunction(aten.mul.Tensor, y, KeywordArg("w"))
        yield y


def _rms_check(match: Match) -> bool:
    kw = match.kwargs
    x, w, eps = _val(kw["x"]), _val(kw.get("w")), kw["eps"]
    out = _val(match.output_node())
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(eps, float):
        return False
    if list(kw["dims"]) not in ([-1], [x.dim() - 1]):
        return False
    if "up" in kw and kw["up"] != torch.float32 or "down" in kw and kw["down"] != x.dtype:
        return False
    if w is not None:
        if not isinstance(w, torch.Tensor) or w.shape != x.shape[-1:] or w.dtype != x.dtype:
            return _skip(f"RMSNorm with a {getattr(w, 'dtype', type(w))} weight of shape "
                         f"{tuple(getattr(w, 'shape', ()))} on a {x.dtype} input")
    return out.dtype == x.dtype and out.shape == x.shape


@_register(list(_rms_patterns()), _norm_pass, _rms_check)
def _rms_norm(match: Match, x, eps, w=None, **_):
    _emit_rms_norm(match, x, w, eps, "RMSNorm -> customops.rms_norm")


def _emit_rms_norm(match: Match, x: Node, w: Node | None, eps: float, name: str) -> None:
    inputs = [x] if w is None else [x, w]
    _emit(match.graph, lambda x, w=None: cops.rms_norm.default(x, w, eps)[0], inputs, [match.output_node()], name)
    match.erase_nodes()


# F.rms_norm over the last dim.
def _aten_rms_check(match: Match) -> bool:
    x, shape = _val(match.kwargs["x"]), match.kwargs["shape"]
    w = _val(match.kwargs["w"])
    return (isinstance(x, torch.Tensor) and list(shape) == [x.shape[-1]]
            and (w is None or (w.dtype == x.dtype and w.shape == x.shape[-1:])))


@_register([CallFunction(aten.rms_norm.default, KeywordArg("x"), KeywordArg("shape"), KeywordArg("w"),
                         KeywordArg("eps"))], _norm_pass, _aten_rms_check)
def _aten_rms_norm(match: Match, x, shape, w, eps):
    eps = torch.finfo(_val(x).dtype).eps if eps is None else eps
    _emit_rms_norm(match, x, w, eps, "F.rms_norm -> customops.rms_norm")


# silu(gate) * up -> silu_mul(gate, up).
def _silu_mul_check(match: Match) -> bool:
    return _same(match.kwargs["g"], match.kwargs["u"])


@_register([CallFunction(aten.mul.Tensor, CallFunction(aten.silu.default, KeywordArg("g")), KeywordArg("u")),
            CallFunction(aten.mul.Tensor, KeywordArg("u"), CallFunction(aten.silu.default, KeywordArg("g")))],
           _fuse_pass, _silu_mul_check)
def _silu_mul(match: Match, g, u):
    _emit(match.graph, cops.silu_mul.default, [g, u], [match.output_node()], "silu(gate) * up -> customops.silu_mul")
    match.erase_nodes()


# residual add in front of a norm -> add_rms_norm (the sum's other uses read its second output).
_add = CallFunction(aten.add.Tensor, KeywordArg("a"), KeywordArg("b"), _users=MULTIPLE)


def _add_rms_check(match: Match) -> bool:
    a, b = match.kwargs["a"], match.kwargs["b"]
    if not _same(a, b):
        return _skip("residual add of tensors of different dtypes or shapes in front of a norm")
    return True


@_register([CallFunction(operator.getitem, CallFunction(cops.rms_norm.default, _add, KeywordArg("w"),
                                                        KeywordArg("eps")), 0)], _fuse_pass, _add_rms_check)
def _add_rms_norm(match: Match, a, b, w, eps):
    add = next(n for n in match.nodes if n.target is aten.add.Tensor)
    inputs = [a, b] if w is None else [a, b, w]

    def fn(a, b, w=None):
        y, s, _ = cops.add_rms_norm.default(a, b, w, eps)
        return y, s

    _emit(match.graph, fn, inputs, [match.output_node(), add], "residual add + RMSNorm -> customops.add_rms_norm")
    match.erase_nodes()




@_register([CallFunction(aten.silu.default, KeywordArg("x"))], _last_pass)
def _silu(match: Match, x):
    _emit(match.graph, cops.silu.default, [x], [match.output_node()], "silu -> customops.silu")
    match.erase_nodes()

