"""Cross-entropy (F.cross_entropy, and log_softmax + nll_loss) and the linear layer in front of it:
the loss patterns of the customops backend."""

from __future__ import annotations

import functools

import torch
from torch._inductor.pattern_matcher import CallFunction, CallFunctionVarArgs, KeywordArg, Match
from torch.fx import Node

from .._ops import _reduce
from ._match import _cast_like, _emit, _fuse_pass, _last_dim, _last_pass, _register, _skip, _val, aten, cops


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _ce_args():
    return (KeywordArg("t"), KeywordArg("weight"), KeywordArg("reduction"), KeywordArg("ii"), KeywordArg("ls"))


def _logits_patterns():
    lin = CallFunctionVarArgs(aten.linear.default)
    to = functools.partial(CallFunction, aten.to.dtype)
    for view in (aten.view.default, aten.reshape.default):
        yield CallFunction(view, to(lin, KeywordArg("up")), KeywordArg("shape"))
        yield to(CallFunction(view, lin, KeywordArg("shape")), KeywordArg("up"))
        yield CallFunction(view, lin, KeywordArg("shape"))
    yield to(lin, KeywordArg("up"))
    yield lin


def _ce_common(match: Match, logits: Node) -> bool:
    kw = match.kwargs
    x = _val(logits)
    if kw["weight"] is not None:
        return _skip("cross_entropy with class weights")
    return isinstance(x, torch.Tensor) and x.dim() == 2 and kw["reduction"] in _REDUCTIONS


def _linear_ce_check(match: Match) -> bool:
    kw = match.kwargs
    lin = next(n for n in match.nodes if n.target is aten.linear.default)
    logits = match.output_node().args[0]
    if not _ce_common(match, logits) or kw.get("up", torch.float32) != torch.float32:
        return False
    if kw["reduction"] == 0:
        return _skip("linear + cross_entropy with reduction='none' (customops.cross_entropy used instead)")
    h, w = _val(lin.args[0]), _val(lin.args[1])
    return (isinstance(h, torch.Tensor) and w.dim() == 2 and h.dtype == w.dtype
            and _val(logits).shape[-1] == w.shape[0])


@_register([CallFunction(aten.cross_entropy_loss.default, lg, *_ce_args()) for lg in _logits_patterns()],
           _fuse_pass, _linear_ce_check)
def _linear_cross_entropy(match: Match, *_linear_args, t, weight, reduction, ii, ls, **_):
    lin = next(n for n in match.nodes if n.target is aten.linear.default)
    h, w, *b = lin.args
    b = b[0] if b else None
    out = _val(match.output_node())
    red = _REDUCTIONS[reduction]
    inputs = [h, w, t] + ([b] if b is not None else [])

    def fn(h, w, t, b=None):
        # Tiles of the whole vocabulary (three matmuls, not four): the graph held all the logits.
        v = w.shape[0]
        loss = cops.linear_cross_entropy.default(h.reshape(-1, h.shape[-1]), w, t.reshape(-1), b, ii, ls, red, None,
                                                 v if isinstance(v, int) else None)
        return _cast_like(loss, out)

    _emit(match.graph, fn, inputs, [match.output_node()], "linear + cross_entropy -> customops.linear_cross_entropy")
    match.erase_nodes()


def _ce_check(match: Match) -> bool:
    logits = match.kwargs["x"]
    if not _ce_common(match, logits):
        return False
    return match.output_node().target is not aten.nll_loss_nd.default or _last_dim(match.kwargs["dim"], 2)


def _emit_cross_entropy(match: Match, x: Node, t: Node, ii: int, ls: float, reduction: int, name: str) -> None:
    out = _val(match.output_node())
    red = _REDUCTIONS[reduction]
    _emit(match.graph, lambda x, t: _cast_like(_reduce(cops.cross_entropy.default(x, t, ii, ls)[0], t, ii, red), out),
          [x, t], [match.output_node()], name)
    match.erase_nodes()


@_register([CallFunction(aten.cross_entropy_loss.default, KeywordArg("x"), *_ce_args())], _last_pass, _ce_check)
def _cross_entropy(match: Match, x, t, weight, reduction, ii, ls):
    # Half logits upcast only for the loss: customops reads them as they are (it computes in
    # float32), so the float32 copy is never written.
    if (x.op == "call_function" and x.target is aten.to.dtype and x.args[1] == torch.float32 and len(x.users) == 1
            and _val(x.args[0]).dtype in (torch.bfloat16, torch.float16)):
        x = x.args[0]
    _emit_cross_entropy(match, x, t, ii, ls, reduction, "cross_entropy -> customops.cross_entropy")


@_register([CallFunction(aten.nll_loss_nd.default, CallFunction(aten.log_softmax.int, KeywordArg("x"),
                                                                KeywordArg("dim"), None),
                         KeywordArg("t"), KeywordArg("weight"), KeywordArg("reduction"), KeywordArg("ii"))],
           _last_pass, _ce_check)
def _log_softmax_nll(match: Match, x, dim, t, weight, reduction, ii):
    _emit_cross_entropy(match, x, t, ii, 0.0, reduction, "log_softmax + nll_loss -> customops.cross_entropy")


# Rotate-half RoPE: x * cos + cat(-x2, x1) * sin for q and for k; q and k that share cos and sin
