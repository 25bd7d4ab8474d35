"""What every pattern family of the customops backend shares: the report of the graph being
rewritten, emitting a replacement, the canonical form the patterns match, the passes (applied in
order: a later pass sees the earlier one's customops ops) and the checks every match makes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import Match, PatternMatcherPass
from torch.fx import Node

aten = torch.ops.aten
cops = torch.ops.customops


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



def _why(e: BaseException) -> str:
    """An exception in one line (an assert's message may be empty)."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__

