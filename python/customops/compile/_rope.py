"""Rotate-half RoPE of q and k: the rotation patterns of the customops backend. Matches are
collected during the pass and paired (q and k that share cos and sin become one customops.rope
call) by _rope_apply afterwards."""

from __future__ import annotations

import itertools

import torch
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match
from torch.fx import Node

from ._match import _emit, _last_dim, _register, _rope_pass, _skip, _val, aten, cops

_END = 2**63 - 1  # the end of an open slice (x[..., h:]) in ATen graphs


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


