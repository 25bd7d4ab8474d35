"""The customops backend's driver: the pre-dispatch trace, the passes in order (on checkpointed
regions' bodies too), :func:`rewrite`, :func:`backend` and :func:`explain`."""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections import Counter
from typing import Callable

import torch
from torch.fx import GraphModule, Node

# importing a family registers its patterns (in the order the patterns were written)
from . import _match, _norms, _losses, _rope  # noqa: F401, I001
from ._attention import _CAUSAL_MASK_KEY, _attention_apply, _causal_mask
from ._match import _PASSES, GraphReport, _canonicalize, _mark_requires_grad, _rope_pass, _skip, _why
from ._rope import _rope_apply, _rope_found


def _op_counts(gm: GraphModule) -> Counter:
    """The calls of gm's graph and of the graphs it calls (checkpointed regions' bodies)."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, GraphModule)]
    return Counter(str(getattr(n.target, "__name__", n.target)) if not isinstance(n.target, torch._ops.OpOverload)
                   else str(n.target).removesuffix(".default")
                   for g in graphs for n in g.nodes if n.op == "call_function")


_graph_count = itertools.count()


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
    _match._report = report
    _rope_found.clear()
    from .. import _attention_choice

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
        _match._report = None
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
    from .._attention_choice import POLICIES

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

