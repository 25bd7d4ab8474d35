"""Applying customops to models nobody here wrote: customops.optimize on Hugging Face Llama,
Mistral, Qwen2 and Qwen3 (built from small configs, no download), the "customops" torch.compile
backend and its pattern rewrites, customops.explain, and an optimized Llama packaged with
AOTInductor and run by customops-run."""

from __future__ import annotations

import copy
import functools
import io
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F

import customops
from customops import compile as cc
from conftest import DEVICES

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=256, attn_implementation="sdpa", use_cache=False)
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")


def model(family: str = "Llama", dtype=torch.float32, device="cpu", **over):
    cfg = getattr(transformers, f"{family}Config")(**{**SMALL, **over})
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(cfg).to(device=device, dtype=dtype)


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def step(m, ids, params_of=None, **kw):
    """Loss and parameter gradients of one training step (forward with labels + backward)."""
    out = m(ids, labels=ids, **kw)
    out.loss.backward()
    src = params_of or m
    grads = {n: p.grad.clone() for n, p in src.named_parameters()}
    src.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def assert_same_step(a, b, dtype):
    torch.testing.assert_close(a[0], b[0], **tol(dtype))
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        torch.testing.assert_close(a[1][n], b[1][n], **tol(dtype), msg=lambda m: f"{n}: {m}")


# ---- customops.optimize ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_optimize_trains_like_eager(family, dtype, device):
    m = model(family, dtype, device).train()
    ids = torch.randint(0, 256, (2, 16), device=device)
    want = step(m, ids)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    got_model, summary = customops.optimize(m)
    assert got_model is m
    kinds = dict(summary.replaced)
    layers = SMALL["num_hidden_layers"]
    assert kinds["SwiGLU MLP -> silu_mul"] == layers and kinds["attention RoPE -> rope"] == layers
    assert kinds["residual add + norm -> add_rms_norm"] == layers
    assert kinds["LM head + loss -> linear_cross_entropy"] == 1
    assert kinds["RMSNorm -> rms_norm"] == 2 * layers + 1 + (2 * layers if family == "Qwen3" else 0)
    assert not summary.left_alone, summary
    out = m(ids, labels=ids)
    assert out.logits is None  # in training with labels the logits are never built
    assert_same_step(step(m, ids), want, dtype)
    assert m.state_dict().keys() == state.keys()
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    # eval mode: Hugging Face's forward, logits included, on the swapped modules
    m.eval()
    with torch.no_grad():
        logits = m(ids).logits
        m_ref = model(family, dtype, device).eval()
        torch.testing.assert_close(logits, m_ref(ids).logits, **tol(dtype))


def test_optimize_reads_shift_labels_as_hugging_face_does():
    # shift_labels alone: no loss (Hugging Face computes one only with labels); beside labels it
    # replaces the shifted labels, the same loss as Hugging Face's
    m_ref, m = model().train(), customops.optimize(model().train())[0]
    ids = torch.randint(0, 256, (2, 16))
    shifted = torch.randint(0, 256, (2, 16))
    alone, want = m(ids, shift_labels=shifted), m_ref(ids, shift_labels=shifted)
    assert want.loss is None and alone.loss is None
    torch.testing.assert_close(alone.logits, want.logits, **tol(torch.float32))
    torch.testing.assert_close(m(ids, labels=ids, shift_labels=shifted).loss,
                               m_ref(ids, labels=ids, shift_labels=shifted).loss, **tol(torch.float32))


def test_optimize_twice_changes_nothing_and_the_model_still_saves():
    m, first = customops.optimize(model())
    classes = [type(x) for x in m.modules()]
    _, second = customops.optimize(m)
    assert not second.replaced and second.already == first.replaced
    assert [type(x) for x in m.modules()] == classes
    assert "already optimized" in str(second)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(loaded.eval()(ids).logits, m.eval()(ids).logits)
    copy.deepcopy(m)


def _saved_activations(m, ids) -> dict[tuple, int]:
    """{(shape, dtype): count} of the distinct non-parameter storages one training forward saves
    for the backward."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, (tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(ids, labels=ids)
    counts = {}
    for key in seen.values():
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_optimize_keeps_less_for_the_backward():
    # Per layer, the MLP keeps gate and up for silu_mul's backward but not silu(gate) * up for
    # down_proj's: the backward recomputes it (eager keeps gate, up, silu(gate) and the product).
    ids = torch.randint(0, 256, (2, 24))
    m = model(dtype=torch.bfloat16, num_hidden_layers=1).train()
    wide = lambda c: sum(n for (shape, _), n in c.items() if shape[-1:] == (SMALL["intermediate_size"],))
    assert wide(_saved_activations(m, ids)) == 4
    customops.optimize(m)
    assert wide(_saved_activations(m, ids)) == 2
    want = step(model(dtype=torch.bfloat16, num_hidden_layers=1).train(), ids)
    assert_same_step(step(m, ids), want, torch.bfloat16)  # and the recomputation trains alike


def test_optimize_gives_compiled_training_sdpa_is_causal_instead_of_a_mask():
    # Under torch.compile Hugging Face builds the causal mask as a tensor, which keeps SDPA off its
    # flash and cuDNN kernels; optimize's training forward passes none when the mask is the plain
    # causal one (no padding, cache or packed positions), and trains alike.
    calls = []

    def backend(gm, example_inputs):
        calls.extend((n.kwargs.get("attn_mask"), n.kwargs.get("is_causal")) for n in gm.graph.nodes
                     if "scaled_dot_product_attention" in str(n.target))
        return gm

    ids = torch.randint(0, 256, (2, 16))
    want = step(model().train(), ids)
    m = customops.optimize(model().train())[0]
    got = step(torch.compile(m, backend=backend, fullgraph=True), ids, params_of=m)
    assert calls and all(mask is None and causal is True for mask, causal in calls), calls
    assert_same_step(got, want, torch.float32)
    calls.clear()  # a padding mask keeps the mask
    torch._dynamo.reset()
    torch.compile(m, backend=backend, fullgraph=True)(ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert calls and all(mask is not None for mask, _ in calls), calls


def test_optimize_float32_model_under_autocast():
    m = model().train()
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step(m, ids)
        customops.optimize(m)
        got = step(m, ids)
    assert_same_step(got, want, torch.bfloat16)


def test_optimize_calls_the_norms_and_lm_head_that_have_hooks():
    # Fused forwards compute past post_attention_layernorm and lm_head; hooks on them (a user's, or
    # the ones DTensor's parallelize_module installs) must still run, so they are called instead.
    m = model().train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 256, (2, 16))
    customops.optimize(m)
    for mm in (m, ref):
        for layer in mm.model.layers:
            layer.post_attention_layernorm.register_forward_hook(lambda mod, args, out: out * 2)
        mm.lm_head.register_forward_pre_hook(lambda mod, args: (args[0] / 2,))
    assert_same_step(step(m, ids), step(ref, ids), torch.float32)


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_optimize_generates_like_eager_with_a_kv_cache(family):
    # Decoding reads and fills the model's KV cache through the swapped decoder layers and
    # attention (whatever this transformers calls the cache: past_key_values, or cache from 5.24).
    m = model(family).eval()
    ids = torch.randint(0, 256, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = m.generate(ids, **kw)
    customops.optimize(m)
    assert type(m.model.layers[0].self_attn).__name__.startswith("Customops")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the cache passed under its deprecated name
        got = m.generate(ids, **kw)
    assert torch.equal(got, want)
    # A training forward given a cache: Hugging Face's own path (not a plain causal mask), alike.
    cache = transformers.DynamicCache(config=m.config)
    m.train()
    name = "cache" if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__ \
        else "past_key_values"
    got_loss = m(ids, labels=ids, use_cache=True, **{name: cache}).loss
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(got_loss, type(m).__mro__[1].forward(m, ids, labels=ids).loss, **tol(torch.float32))


def test_optimize_leaves_unknown_models_and_forms_alone(monkeypatch):
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    same, summary = customops.optimize(lin)
    assert same is lin and not summary.replaced and "model unchanged" in str(summary)
    monkeypatch.setitem(customops.hf._KNOWN_FORMS, "MLP", set())
    m = model()
    with pytest.warns(UserWarning, match="LlamaMLP: its forward is not one customops was checked against"):
        _, summary = customops.optimize(m)
    assert "SwiGLU MLP -> silu_mul" not in summary.replaced
    assert type(m.model.layers[0].mlp) is transformers.models.llama.modeling_llama.LlamaMLP
    assert summary.replaced["RMSNorm -> rms_norm"] == 5


def _attention_calls(fn) -> int:
    """How many customops::attention forwards fn runs (the profiler's op events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        fn()
    return sum(e.name == "customops::attention" for e in p.events())


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen3"])  # Mistral: a sliding window (4096) hiding nothing
def test_optimize_attention_customops_trains_and_evaluates_like_eager(family):
    m_ref, m = model(family).train(), model(family).train()
    _, summary = customops.optimize(m, attention="customops")
    assert summary.attention == "customops" and "attention: customops.attention" in str(summary)
    ids = torch.randint(0, 256, (2, 16))
    assert_same_step(step(m, ids), step(m_ref, ids), torch.float32)
    layers = SMALL["num_hidden_layers"]
    assert _attention_calls(lambda: m(ids, labels=ids)) == layers
    m.eval(), m_ref.eval()
    with torch.no_grad():
        assert _attention_calls(lambda: m(ids)) == layers
        torch.testing.assert_close(m(ids).logits, m_ref(ids).logits, **tol(torch.float32))
        # a padding mask is not customops.attention's: SDPA runs it, the same result as Hugging Face's
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        assert _attention_calls(lambda: m(ids, attention_mask=mask)) == 0
        torch.testing.assert_close(m(ids, attention_mask=mask).logits, m_ref(ids, attention_mask=mask).logits,
                                   **tol(torch.float32))


def test_optimize_attention_auto_keeps_sdpa_on_one_rank_of_several(monkeypatch):
    # ranks would each time and could decide apart (rank-specific compiled graphs): SDPA, untimed
    from customops import _attention_choice as ac

    monkeypatch.setattr(ac, "TIMED_DEVICES", {"cpu"})
    monkeypatch.setattr(ac, "_choices", {})
    monkeypatch.setattr(ac, "_faster", lambda *a: pytest.fail("one rank of several must not time"))
    monkeypatch.setattr(ac, "_ranks_apart", lambda: True)
    m = customops.optimize(model().eval())[0]  # (the default policy: "auto")
    with torch.no_grad():
        assert _attention_calls(lambda: m(torch.randint(0, 256, (2, 16)))) == 0
    q = torch.randn(2, 4, 16, 16)
    assert ac.choose_in_graph("auto", q, q, q, True, None, False)[0] == "sdpa"


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "selective"])
def test_optimize_attention_auto_times_for_real_under_checkpointing_and_compile(checkpoint, monkeypatch):
    # the real timing (on the CPU here) inside a training step with non-reentrant activation
    # checkpointing, without touching the global random stream; then a fullgraph trace reads the
    # decision without timing. Selective checkpointing saves the attention ops' outputs in its
    # dispatch mode, to hand to the recompute in order: the timing's must not be among them.
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from customops import _attention_choice as ac

    monkeypatch.setattr(ac, "TIMED_DEVICES", {"cpu"})
    monkeypatch.setattr(ac, "_choices", {})
    m_ref, m = model().train(), model().train()
    kw = {"use_reentrant": False}
    if checkpoint == "selective":
        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if "attention" in str(op) else CheckpointPolicy.PREFER_RECOMPUTE

        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    with warnings.catch_warnings():  # transformers 5.24 renames it; 5.17 has only this name
        warnings.simplefilter("ignore", FutureWarning)
        for x in (m_ref, m):
            x.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    customops.optimize(m, attention="auto")
    ids = torch.randint(0, 256, (2, 16))
    torch.manual_seed(1)
    got = step(m, ids)
    after = torch.rand(3)
    torch.manual_seed(1)
    want = step(m_ref, ids)
    torch.testing.assert_close(after, torch.rand(3))  # the timing drew nothing from the global stream
    assert_same_step(got, want, torch.float32)
    [(key, _)] = ac.choices().items()
    assert key[0] == "cpu" and key[8] is True  # forward+backward
    if checkpoint == "selective":
        return
    monkeypatch.setattr(ac, "_faster", lambda *a: pytest.fail("a trace must not time"))
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert_same_step(step(compiled, ids, params_of=m), want, torch.float32)


def test_optimize_attention_customops_compiles_fullgraph():
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    ids = torch.randint(0, 256, (2, 16))
    want = step(model().train(), ids)
    m = customops.optimize(model().train(), attention="customops")[0]
    got = step(torch.compile(m, backend=backend, fullgraph=True), ids, params_of=m)
    assert sum("customops.attention" in o for o in ops) == SMALL["num_hidden_layers"], ops
    assert not any("scaled_dot_product_attention" in o for o in ops)
    assert_same_step(got, want, torch.float32)


def test_optimize_attention_auto_times_each_shape_class_once(monkeypatch):
    from customops import _attention_choice as ac

    m = model().eval()
    _, summary = customops.optimize(m, attention="auto")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():  # on a device "auto" does not time (the CPU here): SDPA
        assert _attention_calls(lambda: m(ids)) == 0
    timed = []
    monkeypatch.setattr(ac, "TIMED_DEVICES", {"cpu"})
    monkeypatch.setattr(ac, "_choices", {})
    monkeypatch.setattr(ac, "_faster", lambda q, k, v, causal, scale, backward: timed.append(
        (tuple(q.shape), causal, backward)) or ("customops" if q.shape[2] <= 16 else "sdpa"))
    with torch.no_grad():
        want = model().eval()(ids).logits
        assert _attention_calls(lambda: m(ids)) == 2  # timed once, for both layers
        torch.testing.assert_close(m(ids).logits, want, **tol(torch.float32))
        assert _attention_calls(lambda: m(ids[:, :12])) == 2  # 12 tokens: the 16-token class again
        assert _attention_calls(lambda: m(torch.randint(0, 256, (2, 40)))) == 0  # a longer class, SDPA's
    assert timed == [((2, 4, 16, 16), True, False), ((2, 4, 40, 16), True, False)]
    assert len(ac.choices()) == 2 and "q<=16 k<=16 fwd: customops" in str(summary)
    # a timing that fails (out of memory, an input the kernel refuses) leaves that class to SDPA, with a warning
    def fail(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ac, "_faster", fail)
    with torch.no_grad(), pytest.warns(UserWarning, match="timing .* failed .*OutOfMemoryError.*; SDPA runs it"):
        assert _attention_calls(lambda: m(torch.randint(0, 256, (2, 100)))) == 0
    with pytest.raises(ValueError, match="customops.optimize: attention must be one of sdpa, auto, customops"):
        customops.optimize(model(), attention="flash")


# ---- the "customops" compile backend -----------------------------------------------------------

def rewritten(fn, *args):
    """fn compiled with the rewrite only (no Inductor): (compiled fn, reports)."""
    reports = []

    def backend(gm, example_inputs):
        new, report = cc.rewrite(gm, example_inputs)
        reports.append(report)
        return new

    return torch.compile(fn, backend=backend, fullgraph=True), reports


def _rms_hf(x, w):
    dt = x.dtype
    x = x.to(torch.float32)
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)


def _rope_hf(q, k, cos, sin):
    def rot(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


PATTERNS = {
    # name: (function, inputs, the replacement explain reports)
    "silu": (lambda x: x * torch.sigmoid(x), lambda: (torch.randn(4, 8),), "silu -> customops.silu"),
    "swiglu": (lambda g, u: F.silu(g) * u, lambda: (torch.randn(4, 8), torch.randn(4, 8)),
               "silu(gate) * up -> customops.silu_mul"),
    "rms_norm_hf": (_rms_hf, lambda: (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)),
                    "RMSNorm -> customops.rms_norm"),
    "F.rms_norm": (lambda x, w: F.rms_norm(x, (8,), w, 1e-6), lambda: (torch.randn(4, 8), torch.randn(8)),
                   "F.rms_norm -> customops.rms_norm"),
    "add_rms_norm": (lambda a, b, w: (lambda s: (F.rms_norm(s, (8,), w, 1e-6), s * 2))(a + b),
                     lambda: (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)),
                     "residual add + RMSNorm -> customops.add_rms_norm"),
    "rope": (_rope_hf, lambda: (torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 6, 8),
                                torch.randn(2, 6, 8)), "rotate-half RoPE of q and k -> customops.rope"),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t, ignore_index=2, label_smoothing=0.1),
                      lambda: (torch.randn(6, 10), torch.randint(0, 10, (6,))), "cross_entropy -> customops.cross_entropy"),
    "cross_entropy_upcast": (lambda x, t: F.cross_entropy(x.float(), t),
                             lambda: (torch.randn(6, 10, dtype=torch.bfloat16), torch.randint(0, 10, (6,))),
                             "cross_entropy -> customops.cross_entropy"),
    "log_softmax_nll": (lambda x, t: F.nll_loss(F.log_softmax(x, -1), t, reduction="sum"),
                        lambda: (torch.randn(6, 10), torch.randint(0, 10, (6,))),
                        "log_softmax + nll_loss -> customops.cross_entropy"),
    "linear_cross_entropy": (lambda h, w, t: F.cross_entropy(F.linear(h, w).float().view(-1, 10), t),
                             lambda: (torch.randn(2, 3, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))),
                             "linear + cross_entropy -> customops.linear_cross_entropy"),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_rewrite_matches_eager_forward_and_backward(name):
    fn, make, replacement = PATTERNS[name]
    args = list(make())
    for a in args[:2] if name == "rope" else args:  # rope's cos and sin come from positions
        if a.is_floating_point():
            a.requires_grad_()
    compiled, reports = rewritten(fn, *args)
    got = compiled(*args)
    got_grads = torch.autograd.grad([g.float().sum() for g in torch.utils._pytree.tree_leaves(got)],
                                    [a for a in args if a.requires_grad])
    want = fn(*args)
    want_grads = torch.autograd.grad([w.float().sum() for w in torch.utils._pytree.tree_leaves(want)],
                                     [a for a in args if a.requires_grad])
    t = tol(args[0].dtype)
    torch.testing.assert_close(got, want, **t)
    torch.testing.assert_close(got_grads, want_grads, **t)
    assert reports[0].matched[replacement] >= 1, reports[0]
    assert reports[0].customops_calls, reports[0]


def test_rewrite_leaves_lookalikes_alone():
    # mean over another dim, pow 4, a broadcast multiply: not an RMSNorm / SwiGLU
    def f(x, g, u):
        a = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)
        b = x * torch.rsqrt(x.pow(4).mean(-1, keepdim=True) + 1e-6)
        return a, b, F.silu(g) * u

    args = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(1, 8))
    compiled, reports = rewritten(f, *args)
    torch.testing.assert_close(compiled(*args), f(*args))
    assert not any(k.startswith("RMSNorm") or k.startswith("silu(gate)") for k in reports[0].matched), reports[0]
    # RoPE whose cos/sin require grad: customops.rope would refuse them, so it stays as written
    _, make, _ = PATTERNS["rope"]
    args = [a.requires_grad_() for a in make()]
    compiled, reports = rewritten(_rope_hf, *args)
    torch.testing.assert_close(compiled(*args), _rope_hf(*args))
    assert not reports[0].matched and "RoPE whose cos/sin may require grad" in str(reports[0])


def _rot(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def test_rewrite_leaves_keywords_off_their_defaults_alone():
    # add(x, r, alpha=2) in front of a norm, and a RoPE combined with alpha=-1 (an inverse rotation
    # written as the forward one): once replaced as if alpha were 1, silently wrong (issue 26)
    def add_norm(x, r, w):
        h = torch.add(x, r, alpha=2.0)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h

    def inverse_rope(q, k, cos, sin):
        return torch.add(q * cos, _rot(q) * sin, alpha=-1), k * cos + _rot(k) * sin

    for fn, args, said in ((add_norm, (torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)), "alpha=2.0"),
                           (inverse_rope, (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8),
                                           torch.randn(1, 1, 5, 8)), "alpha=-1")):
        compiled, reports = rewritten(fn, *args)
        torch.testing.assert_close(compiled(*args), fn(*args))
        assert f"left alone: aten.add.Tensor with {said}" in str(reports[0]), reports[0]


def test_rewrite_pairs_only_independent_rotations():
    # the same RoPE applied twice, and k computed from the rotated q: pairing either into one
    # rope(q, k) call made a cycle and failed the user's compile (issue 26)
    def twice(q, cos, sin):
        q = q * cos + _rot(q) * sin
        return q * cos + _rot(q) * sin

    def k_from_q(q, cos, sin):
        q = q * cos + _rot(q) * sin
        k = q * 0.5
        return q, k * cos + _rot(k) * sin

    args = (torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    for fn in (twice, k_from_q):
        compiled, reports = rewritten(fn, *args)
        torch.testing.assert_close(compiled(*args), fn(*args))
        assert reports[0].matched["rotate-half RoPE -> customops.rope"] == 2 and not reports[0].error, reports[0]


def test_backend_falls_back_to_inductor_with_a_warning_when_the_rewrite_fails(monkeypatch):
    # any failure inside the pass, an empty assert included, leaves the graph to Inductor as it is
    def fail(graph):
        raise AssertionError()

    monkeypatch.setattr(cc._backend, "_rope_apply", fail)  # the driver calls it after the rope pass
    torch._dynamo.reset()
    q, cos, sin = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    fn = lambda q, cos, sin: q * cos + _rot(q) * sin  # noqa: E731
    with pytest.warns(UserWarning, match=r"customops backend: rewrite failed \(AssertionError\); compiling the "
                                         r"graph with plain Inductor"):
        got = torch.compile(fn, backend="customops")(q, cos, sin)
    torch.testing.assert_close(got, fn(q, cos, sin))


def test_backend_trains_llama_like_eager_with_customops_backward_kernels():
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend

    m = model().train()
    ids = torch.randint(0, 256, (2, 16))
    want = step(m, ids)
    # the rewrite, then AOTAutograd: the backward graph calls customops' backward ops
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    backend = lambda gm, ex: aot_autograd(fw_compiler=keep, bw_compiler=keep)(cc.rewrite(gm, ex)[0], ex)
    assert_same_step(step(torch.compile(m, backend=backend, fullgraph=True), ids, params_of=m), want, torch.float32)
    backward = str(graphs[-1].graph)
    for op in ("_rms_norm_backward", "_add_rms_norm_backward", "_silu_mul_backward", "_rope_backward",
               "_cross_entropy_backward"):
        assert f"customops.{op}" in backward, op
    # the registered backend (rewrite + Inductor), dynamic shapes: no recompile for a new size
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("customops")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    assert_same_step(step(compiled, ids, params_of=m), want, torch.float32)
    compiles = counter.frame_count  # Inductor itself restarts this model's first compile once
    ids2 = torch.randint(0, 256, (3, 24))
    assert_same_step(step(compiled, ids2, params_of=m), step(m, ids2), torch.float32)
    assert counter.frame_count == compiles


def test_backend_is_registered_and_falls_back_for_graphs_with_nothing_to_rewrite():
    assert "customops" in torch._dynamo.list_backends()
    f = torch.compile(lambda x: x.sin() + 1, backend="customops", fullgraph=True)
    x = torch.randn(8)
    torch.testing.assert_close(f(x), x.sin() + 1)
    reports = customops.explain(lambda x: x.sin() + 1, x, print_report=False)
    assert len(reports) == 1 and not reports[0].matched
    assert "nothing to rewrite" in str(reports[0])


def test_explain_on_llama(capsys):
    m = model().train()
    ids = torch.randint(0, 256, (2, 16))
    reports = customops.explain(m, ids, labels=ids)
    text = capsys.readouterr().out
    assert "replaced RMSNorm -> customops.rms_norm" in text and "customops calls:" in text
    matched = reports[0].matched
    # every residual add (one cross-layer), both RoPEs, both MLPs, the loss
    assert matched["residual add + RMSNorm -> customops.add_rms_norm"] == 4
    assert matched["rotate-half RoPE of q and k -> customops.rope"] == 2
    assert matched["silu(gate) * up -> customops.silu_mul"] == 2
    assert matched["cross_entropy -> customops.cross_entropy"] == 1


def test_backend_attention_option_puts_customops_attention_in_place_of_sdpa(monkeypatch):
    """options={"attention": "customops"}: SDPA calls that compute what customops.attention does
    become it; "sdpa" (the default) leaves them; masked ones and causal ones of unequal lengths stay
    SDPA, and the report says why; "auto" times each static shape class once (here on the CPU,
    with a stub for the timing) and follows it."""
    from customops import _attention_choice as ac

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    graphs = []

    def keep(gm, example_inputs):
        new, report = cc.rewrite(gm, example_inputs, attention="customops")
        graphs.append(str(new.graph))
        return new

    torch._dynamo.reset()
    torch.compile(attend, backend=keep, fullgraph=True)(q, k, v)
    assert "customops.attention" in graphs[0] and "scaled_dot_product_attention" not in graphs[0], graphs[0]
    [r] = customops.explain(attend, q, k, v, print_report=False, attention="customops")
    assert r.matched["SDPA -> customops.attention (attention='customops')"] == 1, r
    [r] = customops.explain(attend, q, k, v, print_report=False)
    assert not r.customops_calls and r.ops["aten.scaled_dot_product_attention"] == 1
    torch._dynamo.reset()
    got = torch.compile(attend, backend="customops", options={"attention": "customops"}, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, attend(q, k, v), **tol(torch.float32))
    # left alone, with the reason: a mask; causal with fewer queries than keys (SDPA aligns top-left)
    masked = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))  # noqa: E731
    [r] = customops.explain(masked, q[:, :2], k, v, print_report=False, attention="customops")
    assert not r.customops_calls
    assert "SDPA with an attention mask other than the causal one (customops.attention takes none)" in r.skipped
    # a constant mask that is causal aligned bottom-right (2 queries, the last of 16 keys) is causal=True
    bottom_right = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=torch.ones(2, 16, dtype=torch.bool).tril(14), enable_gqa=True)
    [r] = customops.explain(bottom_right, q[:, :, :2], k, v, print_report=False, attention="customops")
    assert r.customops_calls["customops.attention"] == 1, r
    torch.testing.assert_close(torch.compile(bottom_right, backend="customops", options={"attention": "customops"})(
        q[:, :, :2], k, v), customops.attention(q[:, :, :2], k, v, causal=True), **tol(torch.float32))
    [r] = customops.explain(attend, q[:, :, :5], k, v, print_report=False, attention="customops")
    assert not r.customops_calls and "causal SDPA whose query and key lengths may differ" in r.skipped
    [r] = customops.explain(attend, q, k[:1], v[:1], print_report=False, attention="customops")  # k, v broadcast
    assert not r.customops_calls and "SDPA broadcasting a batch, or with k and v of different shapes" in r.skipped
    # auto: the CPU is not timed (SDPA stays); with it timed, once per shape class
    torch._dynamo.reset()
    [r] = customops.explain(attend, q, k, v, print_report=False, attention="auto")
    assert not r.customops_calls and "attention='auto' times on cuda only" in r.skipped
    timed = []
    monkeypatch.setattr(ac, "TIMED_DEVICES", {"cpu"})
    monkeypatch.setattr(ac, "_choices", {})
    monkeypatch.setattr(ac, "_faster", lambda q, k, v, causal, scale, backward: timed.append(
        (tuple(q.shape), causal, backward, isinstance(torch.empty(1), torch._subclasses.FakeTensor))) or
        ("customops" if q.shape[2] <= 16 else "sdpa"))  # (timing runs outside the fake mode: real tensors)
    long = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    for n, calls in ((16, 1), (12, 1), (40, 0)):  # 12 falls in 16's class: timed once
        torch._dynamo.reset()  # (a second length would make Dynamo's next graph dynamic)
        [r] = customops.explain(attend, *(t[:, :, :n] for t in long), print_report=False, attention="auto")
        assert r.customops_calls["customops.attention"] == calls, (n, r)
    assert timed == [((2, 4, 16, 8), True, False, False), ((2, 4, 40, 8), True, False, False)]
    assert any("attention='auto': SDPA timed faster" in s for s in r.skipped), r.skipped
    with pytest.raises(ValueError, match="customops backend: the attention option must be one of sdpa, auto, "
                                         "customops, got 'flash'"):
        customops.explain(attend, q, k, v, attention="flash")


def test_backend_attention_option_trains_an_optimized_llama_like_eager():
    # optimize's training forward gives SDPA is_causal and no mask: the backend's option then
    # puts customops.attention in each layer, gradients and all
    m = customops.optimize(model().train())[0]
    ids = torch.randint(0, 256, (2, 16))
    want = step(model().train(), ids)
    [r] = customops.explain(m, ids, labels=ids, print_report=False, attention="customops")
    assert r.customops_calls["customops.attention"] == SMALL["num_hidden_layers"], r
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="customops", options={"attention": "customops"}, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(step(compiled, ids, params_of=m), want, torch.float32)
    assert not [w for w in caught if "customops backend" in str(w.message)], [str(w.message) for w in caught]
    # Hugging Face's own checkpointing around each layer nests optimize's MLP checkpoint in it: the
    # layers' bodies are rewritten too
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    [r] = customops.explain(m, ids, labels=ids, print_report=False, attention="customops")
    assert r.error is None, r
    assert r.customops_calls["customops.attention"] == SMALL["num_hidden_layers"], r


def test_backend_attention_option_takes_hugging_faces_causal_mask_as_causal():
    # Under torch.compile Hugging Face's forward passes SDPA a boolean causal mask built from aranges
    # (it cannot see while tracing that is_causal would do): the pass evaluates a mask computed from
    # no input and, being the causal one, drops it for causal=True. A padding mask (an input) stays.
    ids = torch.randint(0, 256, (2, 16))
    layers = SMALL["num_hidden_layers"]
    m = model().eval()
    with torch.no_grad():
        want = m(ids).logits
        torch._dynamo.reset()
        [r] = customops.explain(m, ids, print_report=False, attention="customops")
        assert r.customops_calls["customops.attention"] == layers, r
        torch._dynamo.reset()
        got = torch.compile(m, backend="customops", options={"attention": "customops"}, fullgraph=True)(ids).logits
        torch.testing.assert_close(got, want, **tol(torch.float32))
        padding = torch.ones(2, 16, dtype=torch.long)
        padding[0, :3] = 0
        torch._dynamo.reset()
        [r] = customops.explain(m, ids, attention_mask=padding, print_report=False, attention="customops")
        assert "customops.attention" not in r.customops_calls, r
        assert any("mask other than the causal one" in why for why in r.skipped), r.skipped
    # with each layer checkpointed, the mask reaches SDPA as an input of the layer's body
    m = model().train()
    want = step(model().train(), ids)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    [r] = customops.explain(m, ids, labels=ids, print_report=False, attention="customops")
    assert r.customops_calls["customops.attention"] == layers, r
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="customops", options={"attention": "customops"}, fullgraph=True)
    assert_same_step(step(compiled, ids, params_of=m), want, torch.float32)


def test_backend_attention_option_keeps_a_sliding_window_that_is_not_causal():
    # Mistral's sliding-window mask is the causal one only while the sequence fits the window: the mask
    # is evaluated for the graph's (static) length, so a window of 4 over 16 positions stays SDPA and
    # one of 64 becomes customops.attention, both with eager's logits
    ids = torch.randint(0, 256, (2, 16))
    for window, replaced in ((4, 0), (64, SMALL["num_hidden_layers"])):
        m = model("Mistral", sliding_window=window).eval()
        with torch.no_grad():
            want = m(ids).logits
            torch._dynamo.reset()
            [r] = customops.explain(m, ids, print_report=False, attention="customops")
            assert r.customops_calls["customops.attention"] == replaced, (window, r)
            torch._dynamo.reset()
            got = torch.compile(m, backend="customops", options={"attention": "customops"}, fullgraph=True)(ids).logits
        torch.testing.assert_close(got, want, **tol(torch.float32))


def test_backend_judges_a_mask_by_what_sdpa_reads_and_a_body_by_its_grad_mode():
    # Review findings: a causal mask written in place afterwards (prefix-LM: the first keys seen by every
    # query) and a random mask (its value now says nothing of the next call's) stay SDPA with eager's
    # result; a checkpointed body entered under enable_grad inside no_grad keeps its RoPE with a cos
    # that requires grad (the body's grad mode is the region's, not the caller's), and trains
    from torch.utils.checkpoint import checkpoint

    def prefix_lm(q, k, v):
        m = torch.ones(8, 8, dtype=torch.bool).tril()
        m[:, :3] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def dropped_keys(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(8, 8) < 2)  # all True, by chance or not

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for fn in (prefix_lm, dropped_keys):
        torch._dynamo.reset()
        [r] = customops.explain(fn, q, k, v, print_report=False, attention="customops")
        assert "customops.attention" not in r.customops_calls, (fn.__name__, r)
    torch._dynamo.reset()
    got = torch.compile(prefix_lm, backend="customops", options={"attention": "customops"})(q, k, v)
    torch.testing.assert_close(got, prefix_lm(q, k, v), **tol(torch.float32))

    freq = torch.nn.Parameter(torch.randn(8))

    def body(x, freq):
        ang = torch.arange(8, dtype=x.dtype)[:, None] * freq[None, :]
        emb = torch.cat((ang, ang), -1)[None, None]
        return x * emb.cos() + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * emb.sin()

    def rotate(x):
        with torch.enable_grad():
            return checkpoint(body, x, freq, use_reentrant=False)

    with torch.no_grad():
        want = rotate(q)
    want.sum().backward()
    want_grad, freq.grad = freq.grad.clone(), None
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(rotate, backend="customops", fullgraph=True)(q)
    got.sum().backward()
    torch.testing.assert_close(got, want, **tol(torch.float32))
    torch.testing.assert_close(freq.grad, want_grad, **tol(torch.float32))


def test_backend_rewrites_inside_gradient_checkpointed_layers():
    # Hugging Face's gradient checkpointing puts each decoder layer in a checkpointed region, whose
    # body is a graph of its own: the norms, SwiGLU and RoPE in it are rewritten as outside, and a
    # step (the bodies recomputed in the backward) matches eager's
    ids = torch.randint(0, 256, (2, 16))
    want = step(model().train(), ids)
    m = model().train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    [r] = customops.explain(m, ids, labels=ids, print_report=False)
    layers = SMALL["num_hidden_layers"]
    assert r.ops["tag_activation_checkpoint"] == layers, r
    for op in ("customops.silu_mul", "customops.rope", "customops.add_rms_norm"):
        assert r.customops_calls[op] == layers, r
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="customops", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(step(compiled, ids, params_of=m), want, torch.float32)
    assert not [w for w in caught if "customops backend" in str(w.message)], [str(w.message) for w in caught]


def test_backend_passes_mode_and_other_options_to_inductor(monkeypatch):
    import torch._inductor.compile_fx as cf

    seen = []
    monkeypatch.setattr(cf, "compile_fx", lambda gm, ex, config_patches=None: seen.append(config_patches) or gm)
    torch._dynamo.reset()
    x = torch.randn(8)
    torch.compile(lambda x: x.sin() + 1, backend="customops", mode="max-autotune-no-cudagraphs")(x)
    assert seen[-1]["max_autotune"] is True
    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 2, backend="customops", options={"attention": "customops",
                                                                      "epilogue-fusion": False})(x)
    assert seen[-1] == {"epilogue_fusion": False}  # spelled with a dash too, as Inductor's options
    torch._dynamo.reset()
    with pytest.raises(Exception, match="customops backend: unknown option\\(s\\) 'fusion_of_everything'"):
        torch.compile(lambda x: x.sin() + 3, backend="customops", options={"fusion_of_everything": True})(x)


# ---- deployment: an optimized Llama in an AOTInductor package ---------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_package_optimized_llama_runs_in_customops_run(tmp_path, device):
    from test_aoti import describe, run

    m = model(num_hidden_layers=1, device=device).eval()
    ids = torch.randint(0, 256, (1, 8), device=device)
    with torch.no_grad():
        want = m(ids).logits

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids).logits

    path = customops.export.package(Logits(m), (ids,), tmp_path / "llama.pt2", optimize=True)
    assert type(m.model.norm).__name__ == "CustomopsLlamaRMSNorm"
    with zipfile.ZipFile(path) as z:  # the compiled model calls customops ops (through the proxy executor)
        assert any(b"customops::" in z.read(name) for name in z.namelist())
    customops.export.save_inputs((ids,), tmp_path / "in.pt")
    r = run([customops.runner_path(), path, tmp_path / "in.pt", tmp_path / "out.pt"])
    assert r.returncode == 0, f"customops-run {describe(r.returncode)}:\n{r.stderr}"
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want.cpu(), atol=1e-4, rtol=1e-4)
