"""The ``"customops"`` torch.compile backend: rewrites eager patterns into customops ops.

Dynamo's graph is traced once more into pre-dispatch ATen (above autograd and autocast, so the
rewritten graph still differentiates and autocasts like the original), the patterns below are
replaced with ``torch.pattern_matcher`` passes, and Inductor compiles the result. Autograd then
records customops' own backward ops, so training runs customops' backward kernels.
:func:`explain` shows per captured graph what matched and what was replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import operator
import warnings
from collections import Counter
from typing import Any, Callable

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import (MULTIPLE, CallFunction, CallFunctionVarArgs, KeywordArg, Match,
                                             PatternMatcherPass)
from torch.fx import GraphModule, Node

from ._ops import _reduce

aten = torch.ops.aten
cops = torch.ops.customops
_END = 2**63 - 1  # the end of an open slice (x[..., h:]) in ATen graphs


@dataclasses.dataclass
class GraphReport:
    """What the rewrite did to one graph that Dynamo captured."""

    index: int
    ops: Counter  # op -> count, before the rewrite
    matched: Counter = dataclasses.field(default_factory=Counter)  # pattern -> times replaced
    skipped: list[str] = dataclasses.field(default_factory=list)  # patterns found but left alone, and why
    customops_calls: Counter = dataclasses.field(default_factory=Counter)  # after the rewrite
    error: str | None = None  # why the graph was handed to Inductor unchanged

    def __str__(self) -> str:
        lines = [f"graph {self.index}: {sum(self.ops.values())} ops"
                 f" ({', '.join(f'{k} x{v}' for k, v in self.ops.most_common(8))}"
                 f"{', ...' if len(self.ops) > 8 else ''})"]
        if self.error:
            lines.append(f"  not rewritten: {self.error}")
        for name, n in self.matched.items():
            lines.append(f"  replaced {name} x{n}")
        for why in self.skipped:
            lines.append(f"  left alone: {why}")
        if not self.matched and not self.error:
            lines.append("  nothing to rewrite: plain Inductor")
        if self.customops_calls:
            lines.append("  customops calls: " + ", ".join(f"{k} x{v}" for k, v in self.customops_calls.items()))
        return "\n".join(lines)


_report: GraphReport | None = None  # the graph being rewritten (set by rewrite())


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, Node) else n


def _skip(why: str) -> bool:
    if _report is not None and why not in _report.skipped:
        _report.skipped.append(why)
    return False


# ----------------------------------------------------------------------------------------------
# Emitting a replacement: trace a Python function of the inputs' fake values into pre-dispatch
# ATen, copy its nodes into the graph and rewire the matched outputs to it.

def _emit(graph: torch.fx.Graph, fn: Callable, inputs: list[Node], olds: list[Node], name: str) -> list[Node]:
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    vals = [_val(n) for n in inputs]
    fake_mode = detect_fake_mode(vals)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        sub = make_fx(lambda *args: fn(*args), pre_dispatch=True)(*vals)  # defaults of fn stay defaults
    placeholders = sub.graph.find_nodes(op="placeholder")
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((n for n in olds if n is not None), key=lambda n: order[n])
    last_input = max(inputs, key=lambda n: order[n])
    # Before the first replaced node when every input is defined by then; else after the last
    # input, and a stable topological sort moves the users that now come too early.
    in_order = order[last_input] < order[first]
    where = graph.inserting_before(first) if in_order else graph.inserting_after(last_input)
    val_map = dict(zip(placeholders, inputs))
    with where:
        news = graph.graph_copy(sub.graph, val_map)
    for n in val_map.values():
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "customops":
            _fill_defaults(n)
    news = list(news) if isinstance(news, (tuple, list)) else [news]
    for old, new in zip(olds, news):
        if old is not None:
            old.replace_all_uses_with(new)
    if not in_order:
        pm.stable_topological_sort(graph)
    if _report is not None:
        _report.matched[name] += 1
    return news


def _same(a: Node, b: Node) -> bool:
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.shape == vb.shape)


def _cast_like(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y if y.dtype == like.dtype else y.to(like.dtype)


def _last_dim(dim: Any, ndim: int) -> bool:
    return dim in (-1, ndim - 1)


# ----------------------------------------------------------------------------------------------
# Canonical form: no-op casts removed, defaults spelled out, x * sigmoid(x) written as silu.

def _canonicalize(graph: torch.fx.Graph) -> None:
    filled = (aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.log_softmax.int)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            x, dtype = node.args
            if isinstance(_val(x), torch.Tensor) and _val(x).dtype == dtype:
                node.replace_all_uses_with(x)  # .to(own dtype) returns the tensor itself
                graph.erase_node(node)
        elif node.target in filled:
            _fill_defaults(node)


def _mark_requires_grad(graph: torch.fx.Graph, inputs_grad: list[bool], enabled: bool | None = None) -> None:
    """node.meta["customops_grad"]: whether the node's value may require grad (the traced fake
    values do not say: make_fx keeps them detached), given whether each input may. Grad mode
    starts as ``enabled`` (a checkpointed body: the mode at its region's call) or as it is now, and
    follows the graph's _set_grad_enabled calls; detach cuts. node.meta["customops_grad_mode"]:
    the mode at each call."""
    enabled = torch.is_grad_enabled() if enabled is None else enabled
    inputs = iter(inputs_grad)
    for node in graph.nodes:
        if node.op == "placeholder":
            node.meta["customops_grad"] = next(inputs, True)
        elif node.op == "get_attr":
            node.meta["customops_grad"] = bool(getattr(getattr(graph.owning_module, node.target, None),
                                                       "requires_grad", True))
        elif node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif node.op == "call_function":
            node.meta["customops_grad_mode"] = enabled
            grads = [a.meta.get("customops_grad", True) for a in node.all_input_nodes]
            node.meta["customops_grad"] = (enabled and any(grads)
                                           and node.target not in (aten.detach.default, aten.detach_.default))


def _fill_defaults(node: Node) -> None:
    """Spells out the arguments make_fx leaves off when they equal the schema's defaults, so that
    a pattern matches one form."""
    if not node.kwargs:
        args = node.target._schema.arguments
        node.args = tuple(node.args) + tuple(a.default_value for a in args[len(node.args):] if not a.kwarg_only)


# ----------------------------------------------------------------------------------------------
# The passes, applied in order: a later pass sees the earlier one's customops ops.

_norm_pass = PatternMatcherPass(pass_name="customops_norm")
_fuse_pass = PatternMatcherPass(pass_name="customops_fuse")
_rope_pass = PatternMatcherPass(pass_name="customops_rope")
_last_pass = PatternMatcherPass(pass_name="customops_last")
_PASSES = (_norm_pass, _fuse_pass, _rope_pass, _last_pass)


def _defaults_only(match: Match) -> bool:
    """The pattern matcher ignores keyword arguments that a pattern does not name (the patterns
    here name none): a match stands only where every matched node's keywords hold their
    defaults, so ``torch.add(x, r, alpha=2)`` or ``mean(..., dtype=torch.float64)`` stays as
    written."""
    for n in match.nodes:
        if not n.kwargs or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = {a.name: a for a in n.target._schema.arguments}
        for name, value in n.kwargs.items():
            arg = schema.get(name)
            if arg is None or not arg.has_default_value() or value != arg.default_value:
                return _skip(f"{str(n.target).removesuffix('.default')} with {name}={value!r}")
    return True


def _register(patterns, pass_dict, extra_check=None):
    check = (lambda m: _defaults_only(m) and extra_check(m)) if extra_check else _defaults_only

    def decorator(handler):
        for p in patterns:
            pm.register_graph_pattern(p, extra_check=check, pass_dict=pass_dict)(handler)
        return handler
    return decorator


# x * sigmoid(x) -> silu(x), so that the SwiGLU pattern sees one spelling.
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


# cross-entropy, and the linear layer (+ upcast, + flatten) in front of it.
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
# become one customops.rope call (a lone rotation gets an empty k).
def _rope_patterns():
    x = KeywordArg("x")
    half1 = CallFunction(aten.slice.Tensor, x, KeywordArg("d1"), 0, KeywordArg("h1"))
    half2 = CallFunction(aten.slice.Tensor, x, KeywordArg("d2"), KeywordArg("h2"), _END)
    rot = CallFunction(aten.cat.default, [CallFunction(aten.neg.default, half2), half1], KeywordArg("dc"))
    for cos_first, sin_first, cos_term_first in itertools.product((False, True), repeat=3):
        c = (CallFunction(aten.mul.Tensor, KeywordArg("cos"), x) if cos_first
             else CallFunction(aten.mul.Tensor, x, KeywordArg("cos")))
        s = (CallFunction(aten.mul.Tensor, KeywordArg("sin"), rot) if sin_first
             else CallFunction(aten.mul.Tensor, rot, KeywordArg("sin")))
        yield CallFunction(aten.add.Tensor, *((c, s) if cos_term_first else (s, c)))


def _rope_check(match: Match) -> bool:
    kw = match.kwargs
    x, cos, sin = _val(kw["x"]), _val(kw["cos"]), _val(kw["sin"])
    if not all(isinstance(v, torch.Tensor) for v in (x, cos, sin)) or x.dim() != 4:
        return False
    d = x.shape[-1]
    if not (all(_last_dim(kw[k], 4) for k in ("d1", "d2", "dc")) and kw["h1"] == kw["h2"] and 2 * kw["h1"] == d):
        return False
    if (cos.shape != sin.shape or cos.dim() != 4 or cos.shape[0] not in (1, x.shape[0]) or cos.shape[1] != 1
            or cos.shape[2] != x.shape[2] or cos.shape[-1] != d):
        return _skip(f"rotate-half RoPE with cos of shape {tuple(cos.shape)} (expected [B or 1, 1, S, {d}])")
    if kw["cos"].meta.get("customops_grad", True) or kw["sin"].meta.get("customops_grad", True):
        return _skip("RoPE whose cos/sin may require grad")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return _skip(f"RoPE of a {x.dtype} tensor with {cos.dtype} cos/sin")
    return True


_rope_found: list[tuple[Match, Node, Node, Node]] = []


@_register(list(_rope_patterns()), _rope_pass, _rope_check)
def _rope_collect(match: Match, x, cos, sin, **_):
    _rope_found.append((match, x, cos, sin))


def _depends(node: Node, on: Node, order: dict[Node, int]) -> bool:
    """Whether node's value is computed from on's (a walk up its inputs, none older than on)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is on:
            return True
        if n in seen or order[n] < order[on]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _rope_apply(graph: torch.fx.Graph) -> None:
    # Pairs are chosen on the graph as matched, then emitted in graph order; a rotation whose input
    # an earlier emission replaced (the same RoPE applied twice) reads the replacement.
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = sorted(_rope_found, key=lambda f: order[f[0].output_node()])
    _rope_found.clear()
    groups: dict[tuple[Node, Node], list] = {}
    for f in found:
        groups.setdefault((f[2], f[3]), []).append(f)

    def pairs_with(a, b) -> bool:  # one rope call computes both only if neither feeds the other
        xa, xb = _val(a[1]), _val(b[1])
        return (xa.shape[0] == xb.shape[0] and xa.shape[2:] == xb.shape[2:]
                and not _depends(b[1], a[0].output_node(), order) and not _depends(a[1], b[0].output_node(), order))

    plan = []
    for members in groups.values():
        while members:
            first, rest = members[0], members[1:]
            other = next((m for m in rest if pairs_with(first, m)), None)
            plan.append((first, other))
            members = [m for m in rest if m is not other]
    plan.sort(key=lambda p: order[p[0][0].output_node()])
    replaced: dict[Node, Node] = {}
    for (mq, q, cos, sin), other in plan:
        q = replaced.get(q, q)
        if other is not None:
            mk, k = other[0], replaced.get(other[1], other[1])
            matches = [mq, mk]
            fn = lambda q, k, c, s: tuple(cops.rope.default(q, k, c.squeeze(1), s.squeeze(1), False))
            news = _emit(graph, fn, [q, k, cos, sin], [m.output_node() for m in matches],
                         "rotate-half RoPE of q and k -> customops.rope")
        else:
            matches = [mq]
            fn = lambda q, c, s: cops.rope.default(q, q[:, :0], c.squeeze(1), s.squeeze(1), False)[0]
            news = _emit(graph, fn, [q, cos, sin], [mq.output_node()], "rotate-half RoPE -> customops.rope")
        replaced.update(zip((m.output_node() for m in matches), news))
        for m in matches:
            m.erase_nodes()


# A silu left on its own.
@_register([CallFunction(aten.silu.default, KeywordArg("x"))], _last_pass)
def _silu(match: Match, x):
    _emit(match.graph, cops.silu.default, [x], [match.output_node()], "silu -> customops.silu")
    match.erase_nodes()


# ----------------------------------------------------------------------------------------------
# Attention: SDPA -> customops.attention where the backend's attention option chooses it
# ("customops": wherever the two compute the same attention; "auto": per shape class, the faster
# on the device, as customops.optimize's attention= does).

_CAUSAL_MASK_KEY = "customops_causal_mask"
_MASK_MAX_ELEMENTS = 1 << 24


def _causal_mask(mask: Any, masks: dict) -> bool:
    """Whether an SDPA attn_mask is the causal mask customops.attention computes: boolean, of static
    shape [..., Sq, Sk] with Sq <= Sk, True where key j <= query i + Sk - Sq, alike along the
    leading dims. Hugging Face's forward under torch.compile builds this mask from aranges (it
    cannot tell while tracing that it could pass is_causal instead); a mask computed from no input
    of the graph is evaluated once, here. A checkpointed body's input that was such a mask in the
    calling graph is one too. ``masks`` caches the answers of a graph."""
    if not isinstance(mask, Node):
        return False
    if mask.op == "placeholder":
        return bool(mask.meta.get(_CAUSAL_MASK_KEY, False))
    if mask in masks:
        return masks[mask]
    masks[mask] = False
    val = _val(mask)
    if (not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() < 2
            or not all(isinstance(n, int) for n in val.shape) or val.numel() > _MASK_MAX_ELEMENTS
            or val.shape[-2] > val.shape[-1]):
        return False
    # The nodes it is computed from: aten calls (and getitems) only, none reading an input
    nodes, stack, seen = [], [mask], {mask}
    while stack:
        n = stack.pop()
        if n.op != "call_function" or not (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem):
            return False
        if isinstance(n.target, torch._ops.OpOverload) and (
                n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags):
            return False  # an in-place op, or a random one (its value now says nothing of the next call's)
        v = _val(n)
        if isinstance(v, torch.Tensor) and (not all(isinstance(d, int) for d in v.shape)
                                            or v.numel() > _MASK_MAX_ELEMENTS):
            return False  # an intermediate too large (or of a size unknown) to compute here
        nodes.append(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    # none of them (or a view of one) written in place later: the mask read is not the one computed
    stack, aliases = list(nodes), set(nodes)
    while stack:
        for u in stack.pop().users:
            t = u.target
            if not isinstance(t, torch._ops.OpOverload):
                continue
            if t._schema.is_mutable:
                return False
            if any(r.alias_info is not None for r in t._schema.returns) and u not in aliases:
                aliases.add(u)
                stack.append(u)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    sub = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for n in sorted(nodes, key=order.__getitem__):
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(env[mask])
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    sq, sk = val.shape[-2:]
    try:
        with unset_fake_temporarily(), torch.no_grad():
            got = GraphModule({}, sub)()
            want = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
            masks[mask] = bool(got.shape == val.shape and torch.equal(got.cpu(), want.expand(val.shape)))
    except Exception as e:  # noqa: BLE001  (a mask that cannot be computed here stays SDPA's)
        if isinstance(e, getattr(torch, "AcceleratorError", ())):
            raise  # a device error is sticky: never hidden
        return False
    return masks[mask]


def _attention_apply(graph: torch.fx.Graph, policy: str, masks: dict) -> None:
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    from . import _attention_choice

    sdpa = aten.scaled_dot_product_attention.default
    schema = sdpa._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    for node in list(graph.find_nodes(op="call_function", target=sdpa)):
        args = {**defaults, **dict(zip((a.name for a in schema), node.args)), **node.kwargs}
        q, k, v = args["query"], args["key"], args["value"]
        qv, kv, vv = (_val(n) for n in (q, k, v))
        mask, dropout, causal = args["attn_mask"], args["dropout_p"], args["is_causal"]
        scale, gqa = args["scale"], args["enable_gqa"]
        # a causal mask given as a tensor is causal=True, aligned bottom-right as customops' is
        masked_causal = mask is not None and causal is False and _causal_mask(mask, masks)
        if mask is not None and not masked_causal:
            _skip("SDPA with an attention mask other than the causal one (customops.attention takes none)")
            continue
        if isinstance(dropout, Node) or dropout != 0.0 or isinstance(causal, Node) or isinstance(scale, Node):
            _skip("SDPA with dropout, or a causal flag or scale computed in the graph")
            continue
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
            _skip("SDPA of inputs that are not [B, H, S, D]")
            continue
        same = (qv.dtype == kv.dtype == vv.dtype and known(qv.shape[-1] == kv.shape[-1])
                and known(vv.shape[-1] == qv.shape[-1]) and known(qv.shape[1] % kv.shape[1] == 0)
                and (gqa or known(qv.shape[1] == kv.shape[1])))
        if not same:
            _skip("SDPA with unequal head dims or dtypes, or heads that are not grouped-query")
            continue
        if not (known(qv.shape[0] == kv.shape[0]) and all(known(vv.shape[i] == kv.shape[i]) for i in range(3))):
            _skip("SDPA broadcasting a batch, or with k and v of different shapes")
            continue
        # customops.attention's output is dense in q's order ([B, S, H, D] for transposed views);
        # SDPA's (on CUDA [B, S, H, D] whatever q's) is what the graph was traced with: only the same
        # layout keeps every view after it valid
        out = _val(node)
        bshd = known(qv.stride(1) < qv.stride(2))
        if not (out.transpose(1, 2).is_contiguous() if bshd else out.is_contiguous()):
            _skip("SDPA whose output layout differs from customops.attention's for this q")
            continue
        if masked_causal:
            causal = True
            if not (known(qv.shape[2] == _val(mask).shape[-2]) and known(kv.shape[2] == _val(mask).shape[-1])):
                _skip("SDPA with a causal mask that is broadcast along the query or key positions")
                continue
        elif causal and not known(qv.shape[2] == kv.shape[2]):
            # SDPA's causal mask is aligned top-left, customops' bottom-right: the same when Sq == Sk
            _skip("causal SDPA whose query and key lengths may differ")
            continue
        backward = any(n.meta.get("customops_grad", True) for n in (q, k, v))
        name, why = _attention_choice.choose_in_graph(policy, qv, kv, vv, bool(causal), scale, backward)
        if name != "customops":
            _skip(why)
            continue
        try:
            _emit(graph, lambda q, k, v: cops.attention.default(q, k, v, bool(causal), scale)[0], [q, k, v], [node],
                  f"SDPA -> customops.attention (attention={policy!r})")
        except Exception as e:  # noqa: BLE001  (this call stays SDPA; the graph's other rewrites stand)
            if isinstance(e, getattr(torch, "AcceleratorError", ())):
                raise
            _skip(f"SDPA left as it is: customops.attention refused it ({_why(e)})")
            continue
        graph.erase_node(node)


# ----------------------------------------------------------------------------------------------

def _op_counts(gm: GraphModule) -> Counter:
    """The calls of gm's graph and of the graphs it calls (checkpointed regions' bodies)."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, GraphModule)]
    return Counter(str(getattr(n.target, "__name__", n.target)) if not isinstance(n.target, torch._ops.OpOverload)
                   else str(n.target).removesuffix(".default")
                   for g in graphs for n in g.nodes if n.op == "call_function")


_graph_count = itertools.count()


def _why(e: BaseException) -> str:
    """An exception in one line (an assert's message may be empty)."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


_CONTEXT_KEY = "_checkpoint_context_fn"


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _default_checkpoint_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _recompute_all)


@contextlib.contextmanager
def _checkpoint_bodies_with_context(gm: GraphModule):
    """Activation checkpointing under Dynamo is a tag_activation_checkpoint call on a body graph;
    its pre-dispatch trace reads the body's ``meta["_checkpoint_context_fn"]``, which Dynamo sets
    only for checkpoints given a context_fn (torch 2.11-2.13: a KeyError otherwise, so a graph of
    ``customops.optimize``'s training forward, which checkpoints the MLP, could not be rewritten).
    For the trace, bodies without one (nested ones too) get the policy torch runs them with,
    recompute everything; afterwards the key goes again, from them and from the traced copies
    (``traced()`` gives those), so that Inductor and AOTAutograd's cache see what torch made."""
    try:
        from torch._higher_order_ops.wrap import tag_activation_checkpoint
    except ImportError:
        yield lambda traced: None
        return
    added = []
    for mod in gm.modules():
        if not isinstance(mod, GraphModule):
            continue
        for node in mod.graph.find_nodes(op="call_function", target=tag_activation_checkpoint):
            body = node.args[0]
            sub = getattr(mod, body.target, None) if isinstance(body, Node) and body.op == "get_attr" else None
            if isinstance(sub, GraphModule) and _CONTEXT_KEY not in sub.meta:
                sub.meta[_CONTEXT_KEY] = _default_checkpoint_context()
                added.append(sub)
    traced_out = []
    try:
        yield traced_out.append
    finally:
        for sub in added:
            sub.meta.pop(_CONTEXT_KEY, None)
        for traced in traced_out:
            for mod in traced.modules():
                if isinstance(mod, GraphModule) and mod.meta.get(_CONTEXT_KEY) is _default_checkpoint_context():
                    del mod.meta[_CONTEXT_KEY]


def rewrite(gm: GraphModule, example_inputs: list, *, attention: str = "auto") -> tuple[GraphModule, GraphReport]:
    """Traces a graph Dynamo captured into pre-dispatch ATen and replaces the patterns customops
    computes faster with customops ops.

    Args:
        attention: What the graph's SDPA calls run, as ``customops.optimize``'s ``attention=``:
            ``"sdpa"`` (left as they are), ``"customops"`` (:func:`customops.attention` wherever
            it computes the same attention: no dropout, no mask but the causal one (a mask no
            input feeds, evaluated here), equal query and key lengths when causal) or ``"auto"`` (per shape class, the faster of the two on the device, timed
            now if no call has yet; static shapes on CUDA only).

    Returns:
        ``(graph module, report)``. When the graph cannot be traced, ``gm`` itself comes back and
        the report says why.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    global _report
    _check_attention(attention)
    report = GraphReport(next(_graph_count), _op_counts(gm))
    try:
        # Fakes of the inputs in the backend's fake mode (as compile_fx makes them); symbolic
        # sizes passed as inputs keep Dynamo's SymInt.
        fake_mode = detect_fake_mode(example_inputs)
        metas = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor)
                 else m if isinstance(m, torch.SymInt) else x
                 for x, m in zip(example_inputs, metas + [None] * (len(example_inputs) - len(metas)))]
        with _checkpoint_bodies_with_context(gm) as keep, (fake_mode if fake_mode is not None
                                                             else contextlib.nullcontext()):
            traced = make_fx(gm, pre_dispatch=True)(*fakes)
            keep(traced)
    except Exception as e:  # noqa: BLE001  (any tracing failure: leave the graph to Inductor as it is)
        report.error = f"pre-dispatch trace failed ({_why(e)})"
        return gm, report
    report.ops = _op_counts(traced)
    _report = report
    _rope_found.clear()
    from . import _attention_choice

    if attention == "auto" and not any(isinstance(x, torch.Tensor) and x.device.type in _attention_choice.TIMED_DEVICES
                                       for x in example_inputs):
        # nothing to time (the CPU): SDPA, as "sdpa" leaves it, without judging its masks
        if traced.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default):
            _skip(_attention_choice.untimed_reason())
        attention = "sdpa"
    try:
        _rewrite_graph(traced, [not isinstance(x, torch.Tensor) or x.requires_grad for x in example_inputs],
                       attention, set())
    except Exception as e:  # noqa: BLE001  (a rewrite that fails must not fail the user's compile)
        if isinstance(e, getattr(torch, "AcceleratorError", ())):
            raise  # a device error (from timing under attention="auto") is sticky: never hidden
        report.error = f"rewrite failed ({_why(e)})"
        report.matched.clear()
        return gm, report
    finally:
        _report = None
        _rope_found.clear()
    report.customops_calls = Counter({k: v for k, v in _op_counts(traced).items()
                                      if k.startswith("customops.")})
    return traced, report


def _rewrite_graph(gm: GraphModule, inputs_grad: list[bool], attention: str, done: set,
                   grad_mode: bool | None = None) -> None:
    """The passes on gm's graph, then on the body of each checkpointed region in it (a graph of its
    own, which Hugging Face's gradient checkpointing puts every decoder layer in), nested ones
    too; a body's inputs require grad as the region's operands do, and its grad mode starts as the
    region's call has it."""
    graph = gm.graph
    _canonicalize(graph)
    _mark_requires_grad(graph, inputs_grad, grad_mode)
    for p in _PASSES:  # dead code goes after each (unused outputs' getitems hide a node's one use)
        p.apply(graph)
        if p is _rope_pass:
            _rope_apply(graph)
        graph.eliminate_dead_code()
    # The regions' bodies, each once with what all the regions calling it pass: an input requires grad
    # where any region's operand may, and is a causal mask where every region's operand is one.
    calls: dict[int, tuple[GraphModule, list[Node]]] = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.higher_order.tag_activation_checkpoint):
        body = getattr(gm, node.args[0].target)
        calls.setdefault(id(body), (body, []))[1].append(node)
    masks: dict[Node, bool] = {}
    for key, (body, nodes) in calls.items():
        if key in done:
            continue
        done.add(key)
        operands = list(zip(*(n.args[1:] for n in nodes)))  # per body input, what each region passes
        if attention != "sdpa":
            for ph, passed in zip(body.graph.find_nodes(op="placeholder"), operands):
                if all(_causal_mask(a, masks) for a in passed):
                    ph.meta[_CAUSAL_MASK_KEY] = True
        _rewrite_graph(body, [any(a.meta.get("customops_grad", True) if isinstance(a, Node) else True for a in passed)
                              for passed in operands], attention, done,
                       any(n.meta.get("customops_grad_mode", torch.is_grad_enabled()) for n in nodes))
    if attention != "sdpa":
        _attention_apply(graph, attention, masks)  # (a mask judged for the bodies is not evaluated again)
        graph.eliminate_dead_code()  # the masks the calls no longer read
    graph.lint()
    gm.recompile()


def _check_attention(attention: str) -> None:
    from ._attention_choice import POLICIES

    if attention not in POLICIES:
        raise ValueError(f"customops backend: the attention option must be one of {', '.join(POLICIES)}, "
                         f"got {attention!r}")


def backend(gm: GraphModule, example_inputs: list, *, mode: str | None = None, options: dict | None = None):
    """The ``"customops"`` torch.compile backend: :func:`rewrite`, then Inductor (``compile_fx``).

    ``torch.compile(model, backend="customops", mode=..., options=...)``: ``options["attention"]``
    is :func:`rewrite`'s ``attention`` (default ``"auto"``); ``mode`` and the other options are
    Inductor's, as with ``backend="inductor"``. Graphs with nothing to rewrite, or that cannot be
    traced, go to Inductor unchanged.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = {k.replace("-", "_"): v for k, v in (options or {}).items()}  # as torch.compile's Inductor options
    attention = options.pop("attention", "auto")
    _check_attention(attention)
    known = inductor_config.get_config_copy()
    unknown = [k for k in options if k not in known]
    if unknown:
        raise RuntimeError(f"customops backend: unknown option(s) {', '.join(map(repr, unknown))}: the options are "
                           f"'attention' and Inductor's (torch._inductor.list_options())")
    patches = {**(list_mode_options(mode) if mode else {}), **options}
    new_gm, report = rewrite(gm, example_inputs, attention=attention)
    if report.error:
        warnings.warn(f"customops backend: {report.error}; compiling the graph with plain Inductor", stacklevel=2)
    return compile_fx(new_gm if report.matched else gm, example_inputs, config_patches=patches or None)


def explain(model: Callable, *args, print_report: bool = True, attention: str = "auto",
            **kwargs) -> list[GraphReport]:
    """Runs ``model(*args, **kwargs)`` once under torch.compile with the customops rewrite and
    reports, per graph Dynamo captured, its ops, what matched and what was replaced (the graph's
    SDPA calls as the backend's ``attention`` option would have them).

    The graphs run eagerly after the rewrite (no Inductor), so this is quick; the model's output
    is discarded.

    Returns:
        One :class:`GraphReport` per captured graph (also printed unless ``print_report=False``).
    """
    reports: list[GraphReport] = []

    _check_attention(attention)

    def recorder(gm, example_inputs):
        new_gm, report = rewrite(gm, example_inputs, attention=attention)
        reports.append(report)
        return new_gm

    compiled = torch.compile(model, backend=recorder)
    compiled(*args, **kwargs)
    for i, r in enumerate(reports):
        r.index = i
    if print_report:
        print("\n".join(str(r) for r in reports))
    return reports


def _register_backend() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "customops" not in _BACKENDS or _BACKENDS["customops"] is None:
        register_backend(name="customops")(backend)


__all__ = ["backend", "rewrite", "explain", "GraphReport"]
