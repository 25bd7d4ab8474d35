"""Which attention an optimized Hugging Face model runs: SDPA, customops' ``attention``, or, per
shape class, whichever was timed faster on the device.

:func:`customops.optimize` (``attention=``) stores its policy on each attention module; the
attention function a swapped forward finds for ``"sdpa"`` (:func:`sdpa_or_customops`) reads it:
- ``"sdpa"``: transformers' SDPA function, as without customops.
- ``"customops"``: :func:`customops.attention` wherever it computes the same attention (no mask,
  no dropout, no bias or softcap, equal query and key lengths when causal); SDPA elsewhere.
- ``"auto"``: the same inputs, on a device in ``TIMED_DEVICES``: each shape class (device, dtype,
  heads, head dim, causal, lengths rounded up to powers of two, forward or forward+backward) is
  timed once, at its first call outside tracing and CUDA-graph capture, with both functions on
  inputs of its shape; the faster runs from then on. A class not timed yet runs SDPA in a trace
  (and a trace with dynamic lengths always does: a bucket would specialize them).
  The decisions are visible in :func:`choices` and in the optimize summary. One rank of several
  (torch.distributed) keeps SDPA: ranks would time apart and could choose differently (in a
  compiled model, rank-specific graphs). The timing runs outside the dispatch modes around the
  call (selective activation checkpointing's would keep its outputs for the recompute).

The ``"customops"`` compile backend takes the same policies (``options={"attention": ...}``) for
the SDPA calls of a graph (:func:`choose_in_graph`); its "auto" times a class when it rewrites the
graph (static shapes; dynamic ones keep SDPA) and shares the decisions with optimize's.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

POLICIES = ("sdpa", "auto", "customops")
TIMED_DEVICES = {"cuda"}  # where "auto" times; elsewhere it keeps SDPA
_REPEATS = 5
_choices: dict[tuple, str] = {}  # shape class -> "customops" or "sdpa"


def choices() -> dict[tuple, str]:
    """The shape classes "auto" has timed so far and what each runs: ``(device, dtype, q heads, kv
    heads, head dim, causal, query length bucket, key length bucket, backward, batch bucket) ->
    name``."""
    return dict(_choices)


def _bucket(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _shape_class(q, k, causal: bool, backward: bool) -> tuple:
    # the device as q names it (a device query would break a trace), the rest from shapes
    return (str(q.device), str(q.dtype).removeprefix("torch."), q.shape[1], k.shape[1], q.shape[-1], causal,
            _bucket(q.shape[2]), _bucket(k.shape[2]), backward, _bucket(q.shape[0]))


def _time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn, after two warm-up calls: CUDA events on CUDA, else the clock."""
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()
    times = []
    for _ in range(_REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _faster(q, k, v, causal: bool, scale, backward: bool) -> str:
    """"customops" or "sdpa": the faster on new inputs of q, k and v's shapes (forward, or forward
    and backward), SDPA on a tie."""
    from . import _ops

    # a generator of its own (the global random stream stays where the model left it)
    g = torch.Generator(device=q.device).manual_seed(0)
    qs, ks, vs = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=g).requires_grad_(backward)
                  for t in (q, k, v)]
    gqa = q.shape[1] != k.shape[1]

    def run(fn):
        def go():
            with torch.enable_grad() if backward else torch.no_grad():
                out = fn()
                if backward:
                    out.backward(torch.ones_like(out))
        return go

    custom = run(lambda: _ops.attention(qs, ks, vs, causal=causal, scale=scale))
    sdpa = run(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa))
    # outside any saved-tensor hooks of the model's forward (non-reentrant activation checkpointing
    # counts the tensors a forward saves: the timing's must not be among them)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return "customops" if _time_ms(custom, q.device) < _time_ms(sdpa, q.device) else "sdpa"


def untimed_reason() -> str:
    """Why "auto" keeps SDPA on a device it does not time."""
    return f"attention='auto' times on {', '.join(sorted(TIMED_DEVICES))} only"


def _ranks_apart() -> bool:
    """Whether this process is one rank of several (torch.distributed): "auto" keeps SDPA there."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _choose(policy: str, q, k, v, causal: bool, scale) -> str:
    if policy != "auto":
        return policy
    if q.device.type not in TIMED_DEVICES:
        return "sdpa"
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if torch.compiler.is_compiling():
        # a trace reads the decision of an eager call before it, for static shapes only (reading a
        # dynamic length's bucket would specialize it), and never times
        if not all(isinstance(n, int) for n in (*q.shape, *k.shape)):
            return "sdpa"
        return _choices.get(_shape_class(q, k, causal, backward), "sdpa")
    key = _shape_class(q, k, causal, backward)
    if key in _choices:
        return _choices[key]
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "sdpa"  # no timing inside a CUDA-graph capture; a later call decides
    return _decide(key, q, k, v, causal, scale, backward, "customops.optimize(attention='auto')")


def _decide(key: tuple, q, k, v, causal: bool, scale, backward: bool, who: str) -> str:
    """Times the class key once (on inputs of q, k and v's shapes) and keeps the decision."""
    from torch.utils._python_dispatch import _disable_current_modes

    if _ranks_apart():
        _choices[key] = "sdpa"  # ranks would each time, and could decide apart (rank-specific graphs)
        return _choices[key]
    try:
        # outside the dispatch modes around the call: selective activation checkpointing's would
        # keep the timing's outputs and hand them to the recompute as the model's
        with _disable_current_modes():
            _choices[key] = _faster(q, k, v, causal, scale, backward)
    except RuntimeError as e:  # out of memory, an input the kernel refuses: never fail the model's forward
        if isinstance(e, getattr(torch, "AcceleratorError", ())):
            raise  # a device error (an illegal address, ...) is sticky: never hidden
        warnings.warn(f"{who}: timing {key} failed ({type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:200]}); SDPA runs it", stacklevel=4)
        _choices[key] = "sdpa"
    return _choices[key]


def choose_in_graph(policy: str, q, k, v, causal: bool, scale, backward: bool) -> tuple[str, str | None]:
    """For a compile pass: what an SDPA call of a graph runs under ``policy``, given the fake
    values of its inputs; ``(name, why SDPA stays)``. "auto" times the shape class now, on real
    inputs of those shapes, if no call has yet (static shapes on a timed device only)."""
    if policy != "auto":
        return policy, None
    if q.device.type not in TIMED_DEVICES:
        return "sdpa", untimed_reason()
    if not all(isinstance(n, int) for n in (*q.shape, *k.shape)):
        return "sdpa", "attention='auto' with dynamic shapes (one graph serves every length)"
    if _ranks_apart():
        return "sdpa", "attention='auto' under torch.distributed (ranks would time apart and could differ)"
    key = _shape_class(q, k, causal, backward)
    if key not in _choices:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            _decide(key, q, k, v, causal, scale, backward, "customops backend (attention='auto')")
    if _choices[key] == "sdpa":
        return "sdpa", f"attention='auto': SDPA timed faster for {key}"
    return "customops", None


def sdpa_or_customops(sdpa, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature: ``sdpa``'s result, or customops.attention's
    where the module's policy chooses it and the two compute the same attention."""
    from . import _ops

    policy = getattr(module, "_customops_attention", "sdpa")
    if policy == "sdpa":  # before any test of the shapes, which would guard a trace on them
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)))
    # A sliding window acts through the mask: without one (the window hides nothing) SDPA ignores it too.
    plain = (attention_mask is None and not dropout and not any(kwargs.get(n) is not None for n in (
        "position_bias", "softcap", "s_aux")) and not kwargs.get("output_attentions", False)
             and (not causal or q_len == kv_len) and query.shape[-1] == value.shape[-1]
             and query.shape[1] % key.shape[1] == 0 and query.dtype == key.dtype == value.dtype)
    if not plain or _choose(policy, query, key, value, causal, scaling) != "customops":
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    out = _ops.attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class AttentionFunctions:
    """Stands for transformers' ``ALL_ATTENTION_FUNCTIONS`` in a swapped attention forward: the same
    functions (what a forward reads of it: ``get_interface``, ``[name]``, ``in``), its ``"sdpa"``
    one through :func:`sdpa_or_customops`."""

    def __init__(self, functions):
        self.functions = functions

    def get_interface(self, name, default):
        return _wrap(name, self.functions.get_interface(name, default))

    def __getitem__(self, name):
        return _wrap(name, self.functions[name])

    def __contains__(self, name):
        return name in self.functions


def _wrap(name, fn):
    if name != "sdpa":
        return fn
    return functools.partial(sdpa_or_customops, fn)
