"""SDPA -> customops.attention where the backend's attention option chooses it ("customops":
wherever the two compute the same attention; "auto": per shape class, the faster on the device,
as customops.optimize's attention= does), a causal mask given as a tensor included."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from ._match import _emit, _skip, _val, _why, aten, cops

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

    from .. import _attention_choice

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

