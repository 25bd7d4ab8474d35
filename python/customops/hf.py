"""``customops.optimize(model)``: customops ops in Hugging Face transformers' Llama, Mistral, Qwen2
and Qwen3 models, in one line.

Each known module keeps its object, parameters and ``state_dict``; only its class changes, to a
subclass whose forward calls customops ops. A forward is swapped only when its code is one this
file was checked against (a hash of its syntax tree, per transformers release), so a changed
transformers is left alone with a warning instead of being computed differently.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import sys
import textwrap
import types
import warnings
from collections import Counter

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _attention_choice
from ._ops import add_rms_norm, linear_cross_entropy, rms_norm, rope, silu_mul

_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}

# Syntax-tree hashes (see _form) of the forwards each swap restates or relies on, as in
# transformers 5.17, 5.23 and 5.24 (all four families share them; 5.24 renamed past_key_values to
# cache in the decoder layer's and the causal LM's forwards).
_KNOWN_FORMS = {
    "RMSNorm": {"9635bcd843f3"},
    "MLP": {"7d2027d4464e"},
    "DecoderLayer": {"1a8125909341", "223a3cfccaa8"},
    "ForCausalLM": {"30455d0ea27c", "bc1bb9f5b8f9", "ec53ebf95d1e"},
    "apply_rotary_pos_emb": {"4a8f8b85ee37"},
}


def _form(fn) -> str:
    """A hash of a function's syntax tree without docstring, annotations and decorators: what it
    computes, not how it is documented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    tree.decorator_list, tree.returns = [], None
    a = tree.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
        arg.annotation = None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        tree.body = body[1:]
    # unparse, not ast.dump: the dump's fields change between Python versions
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:12]


@dataclasses.dataclass
class Summary:
    """What :func:`optimize` did: modules replaced per kind, modules already optimized, and what
    it left alone and why."""

    replaced: Counter = dataclasses.field(default_factory=Counter)
    already: Counter = dataclasses.field(default_factory=Counter)
    left_alone: list[str] = dataclasses.field(default_factory=list)
    attention: str | None = None  # the attention policy of the swapped attention modules, if any

    def __str__(self) -> str:
        if not self.replaced and not self.already:
            lines = ["customops.optimize: no known modules (Hugging Face Llama, Mistral, Qwen2, Qwen3); "
                     "model unchanged"]
        else:
            lines = ["customops.optimize: " + (", ".join(f"{k} x{v}" for k, v in self.replaced.items())
                                               or "nothing new")]
            if self.already:
                lines.append("  already optimized: " + ", ".join(f"{k} x{v}" for k, v in self.already.items()))
        if self.attention is not None:
            lines.append("  attention: " + _ATTENTION_TEXT[self.attention])
            if self.attention == "auto":
                lines += [f"    {c[0]} {c[1]} batch<={c[9]} heads {c[2]}/{c[3]} dim {c[4]} causal={c[5]} q<={c[6]} "
                          f"k<={c[7]} {'fwd+bwd' if c[8] else 'fwd'}: {name}"
                          for c, name in _attention_choice.choices().items()]
        lines += [f"  left alone: {why}" for why in self.left_alone]
        return "\n".join(lines)


_ATTENTION_TEXT = {
    "sdpa": "SDPA (transformers' sdpa function, as before)",
    "customops": "customops.attention in place of SDPA wherever it computes the same attention (no mask, dropout "
                 "or bias); SDPA elsewhere, and a model set to another attention implementation keeps it",
    "auto": "per shape class, the faster of customops.attention and SDPA on this GPU, timed at first use (SDPA on "
            "other devices and for masked attention); decided so far:",
}


class _Swapped:
    """Marks a module whose class optimize() swapped."""


# ---- the forwards ------------------------------------------------------------------------------

def _rms_norm_forward(self, hidden_states):
    if hidden_states.dtype != self.weight.dtype:  # Hugging Face promotes; keep its arithmetic
        return self._customops_base.forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        # The backward recomputes silu(gate) * up, one elementwise pass, rather than keeping it for
        # down_proj's weight gradient: [tokens, intermediate] less memory per layer (128 MiB at
        # Llama-3.2-1B shapes, 4 x 2048 tokens). Recomputation stops before down_proj's matmul
        # (non-reentrant checkpointing stops once the saved tensors it needs are back).
        return checkpoint(_down_of_silu_mul, self.down_proj, gate, up, use_reentrant=False, preserve_rng_state=False)
    return self.down_proj(silu_mul(gate, up))


def _down_of_silu_mul(down_proj, gate, up):
    return down_proj(silu_mul(gate, up))


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, *, use_cache=False,
                           position_embeddings=None, **kwargs):
    # The cache travels in kwargs under the name this transformers gives it (past_key_values
    # before 5.24, cache from 5.24 on), to self_attn, which reads it.
    if kwargs.pop(_CAUSAL_ONLY, False):  # see _causal_lm_forward
        attention_mask = None
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    norm = self.post_attention_layernorm
    if hidden_states.dtype == residual.dtype == norm.weight.dtype and _called_plainly(norm):
        normed, hidden_states = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon)
    else:
        hidden_states = residual + hidden_states
        normed = norm(hidden_states)
    return hidden_states + self.mlp(normed)


def _called_plainly(module: nn.Module) -> bool:
    """Whether a fused forward may compute past ``module`` (read its weight instead of calling it):
    only when calling it would do nothing more. Forward hooks (DTensor's parallelize_module puts
    its layout changes there: SequenceParallel on a norm, ColwiseParallel on the LM head, and
    FSDP2 its all-gathers) or a weight of a tensor subclass (a DTensor) mean the module is called
    as Hugging Face calls it."""
    if module._forward_pre_hooks or module._forward_hooks or nn.modules.module._global_forward_hooks \
            or nn.modules.module._global_forward_pre_hooks:
        return False
    return type(getattr(module, "weight", None)) in (nn.Parameter, torch.Tensor, type(None))


def _rope_for(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1] or q.dim() != 4:
            return original(q, k, cos, sin, unsqueeze_dim)
        dtype = torch.promote_types(q.dtype, cos.dtype)  # Hugging Face's q * cos promotes
        q, k, cos, sin = (t.to(dtype) for t in (q, k, cos, sin))
        return rope(q, k, cos, sin)

    return apply_rotary_pos_emb


# A keyword argument _causal_lm_forward passes down to the decoder layers (through the model's
# **kwargs) when the mask is known to be the plain causal one.
_CAUSAL_ONLY = "customops_causal_only"


def _plain_causal(config, attention_mask, position_ids, cache) -> bool:
    """True when a training forward's attention is exactly causal: no padding mask, no cache, no
    packed positions, SDPA, and no sliding window or other layer type. Hugging Face builds that
    mask as an explicit tensor under torch.compile (on torch < 2.14 it cannot tell compiling from
    exporting), which keeps SDPA off its flash and cuDNN kernels; the decoder layers then pass no
    mask and SDPA's is_causal applies, the same attention."""
    return (attention_mask is None and position_ids is None and cache is None
            and getattr(config, "_attn_implementation", None) == "sdpa"
            and getattr(config, "sliding_window", None) is None
            and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ())))


# What transformers calls the KV cache, in arguments and outputs: past_key_values before 5.24,
# cache from 5.24 on (which still takes past_key_values as a deprecated argument).
_CACHE_NAMES = ("cache", "past_key_values")


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *, inputs_embeds=None,
                       labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    # In training with labels, the loss comes from the last hidden state through
    # linear_cross_entropy: the [tokens, vocabulary] logits are never built (logits is None, as
    # with Liger-Kernel). Otherwise Hugging Face's forward runs. As there, shift_labels (labels
    # already shifted) is read only beside labels: alone it gives no loss. The cache stays in
    # kwargs under whichever name the caller used; self.model takes either.
    if not (self.training and labels is not None and _called_plainly(self.lm_head)):
        return self._customops_base.forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
    if _plain_causal(self.config, attention_mask, position_ids, cache):
        kwargs[_CAUSAL_ONLY] = True
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # as Hugging Face's ForCausalLMLoss: predict token t + 1 at t
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    # Tiles of the whole vocabulary: three matmuls instead of four (about 10 ms of a Llama-3.2-1B
    # step on an H100) for 1024 x V logits (250 MiB there), little beside the step's activations.
    loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device), self.lm_head.bias,
                                ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
                                tile_classes=self.lm_head.weight.shape[0])
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    name = next(n for n in _CACHE_NAMES if n in CausalLMOutputWithPast.__dataclass_fields__)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{name: getattr(outputs, name)})


# ---- the swaps ---------------------------------------------------------------------------------

def _subclass(cls: type, forward) -> type:
    """``cls`` with ``forward`` swapped in, registered in this module so models still pickle."""
    name = f"Customops{cls.__name__}"
    existing = getattr(sys.modules[__name__], name, None)
    if isinstance(existing, type) and existing.__mro__[1] is cls:
        return existing
    # _customops_base: the class swapped out, whose forward a swapped one falls back on. Not
    # super(type(self), self): FSDP2's fully_shard subclasses the module's class again.
    sub = type(name, (cls, _Swapped), {"forward": forward, "_customops_base": cls, "__module__": __name__,
                                       "__qualname__": name})
    setattr(sys.modules[__name__], name, sub)
    return sub


def _with_globals(fn, patch: dict):
    """fn, with the same code, reading ``patch``'s names from its module's globals. A decorated fn
    (transformers 5.24 wraps forwards in deprecate_kwarg) keeps its wrappers: each wrapper is
    rebuilt around the rebuilt function it wraps, found among its closure's cells."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, _patched_globals(fn, patch), fn.__name__, fn.__defaults__,
                                 fn.__closure__)
        _copy_attributes(new, fn)
        return new
    cells = fn.__closure__ or ()
    holds = [i for i, c in enumerate(cells) if _cell(c) is inner]
    if len(holds) != 1:
        raise TypeError(f"{fn.__qualname__}: a wrapper whose wrapped function is not in its closure")
    new_inner = _with_globals(inner, patch)
    closure = tuple(types.CellType(new_inner) if i == holds[0] else c for i, c in enumerate(cells))
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    _copy_attributes(new, fn)
    new.__wrapped__ = new_inner
    return new


def _patched_globals(fn, patch: dict) -> dict:
    """fn's module globals with ``patch``'s names replaced: the namespace of a module registered in
    sys.modules under its own name (one per patched module and set of names, made once). Dynamo
    finds a function's globals through ``sys.modules[globals["__name__"]]`` when it guards on them,
    so the name must lead to these globals, not the unpatched module's."""
    base = fn.__globals__["__name__"]
    name = f"customops_hf_globals__{base.replace('.', '_')}__{'_'.join(sorted(patch))}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update(fn.__globals__)
        module.__dict__.update(patch, __name__=name)
        sys.modules[name] = module
    return module.__dict__


def _copy_attributes(new, fn) -> None:
    new.__kwdefaults__, new.__qualname__, new.__module__, new.__doc__ = (
        fn.__kwdefaults__, fn.__qualname__, fn.__module__, fn.__doc__)
    new.__dict__.update(fn.__dict__)


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def _attention_forward(cls: type, module: types.ModuleType):
    """cls.forward, with the same code, reading customops' rope where it reads
    ``apply_rotary_pos_emb``, and attention functions whose SDPA one may run customops' attention
    (the module's ``_customops_attention`` policy, set by optimize) where it reads
    ``ALL_ATTENTION_FUNCTIONS``."""
    patch = {"apply_rotary_pos_emb": _rope_for(module.apply_rotary_pos_emb)}
    if hasattr(module, "ALL_ATTENTION_FUNCTIONS"):
        patch["ALL_ATTENTION_FUNCTIONS"] = _attention_choice.AttentionFunctions(module.ALL_ATTENTION_FUNCTIONS)
    return _with_globals(cls.forward, patch)


def _check(kind: str, fn, summary: Summary, where: str, warned: set) -> bool:
    try:
        ok = _form(fn) in _KNOWN_FORMS[kind]
    except (OSError, TypeError, SyntaxError):
        ok = False
    if not ok:
        import transformers

        why = (f"{where}: its forward is not one customops was checked against (transformers "
               f"{transformers.__version__}); left as it is")
        summary.left_alone.append(why)
        if where not in warned:
            warned.add(where)
            warnings.warn(f"customops.optimize: {why}", stacklevel=3)
    return ok


def _plan(module: nn.Module, summary: Summary, warned: set):
    """(kind, new class) for a module optimize() knows, else None."""
    cls = type(module)
    for fam, prefix in _FAMILIES.items():
        mod_name = f"transformers.models.{fam}.modeling_{fam}"
        if not cls.__module__ == mod_name:
            continue
        mod = sys.modules[mod_name]
        kind = next((k for k in ("RMSNorm", "MLP", "Attention", "DecoderLayer", "ForCausalLM")
                     if getattr(mod, prefix + k, None) is cls), None)
        if kind is None:
            return None
        where = cls.__name__
        if kind == "RMSNorm":
            ok = _check("RMSNorm", cls.forward, summary, where, warned)
            return (kind, _subclass(cls, _rms_norm_forward)) if ok else None
        if kind == "MLP":
            act = getattr(module.config, "hidden_act", None) if hasattr(module, "config") else None
            if act not in ("silu", "swish") or type(getattr(module, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
                summary.left_alone.append(f"{where}: activation {act!r} is not SiLU")
                return None
            ok = _check("MLP", cls.forward, summary, where, warned)
            return (kind, _subclass(cls, _mlp_forward)) if ok else None
        if kind == "Attention":
            if "apply_rotary_pos_emb" not in inspect.unwrap(cls.forward).__code__.co_names:
                summary.left_alone.append(f"{where}: its forward does not call apply_rotary_pos_emb")
                return None
            ok = _check("apply_rotary_pos_emb", mod.apply_rotary_pos_emb, summary, f"{mod_name}.apply_rotary_pos_emb",
                        warned)
            if not ok:
                return None
            try:
                return kind, _subclass(cls, _attention_forward(cls, mod))
            except TypeError as e:
                summary.left_alone.append(f"{where}: {e}")
                return None
        if kind == "DecoderLayer":
            norm = getattr(module, "post_attention_layernorm", None)
            if type(norm) is not getattr(mod, prefix + "RMSNorm", None) and not isinstance(norm, _Swapped):
                return None
            ok = _check("DecoderLayer", cls.forward, summary, where, warned)
            return (kind, _subclass(cls, _decoder_layer_forward)) if ok else None
        from transformers.loss.loss_utils import ForCausalLMLoss

        if module.loss_function is not ForCausalLMLoss or module.lm_head.out_features != module.config.vocab_size:
            summary.left_alone.append(f"{where}: a loss other than Hugging Face's ForCausalLMLoss")
            return None
        ok = _check("ForCausalLM", cls.forward, summary, where, warned)
        if not ok:
            return None
        forward = _causal_lm_forward
        try:
            from transformers.utils import can_return_tuple

            forward = can_return_tuple(forward)
        except ImportError:
            pass
        return kind, _subclass(cls, forward)
    return None


_KIND_TEXT = {"RMSNorm": "RMSNorm -> rms_norm", "MLP": "SwiGLU MLP -> silu_mul",
              "Attention": "attention RoPE -> rope", "DecoderLayer": "residual add + norm -> add_rms_norm",
              "ForCausalLM": "LM head + loss -> linear_cross_entropy"}


def optimize(model: nn.Module, *, attention: str = "auto") -> tuple[nn.Module, Summary]:
    """Swaps customops ops into a Hugging Face Llama, Mistral, Qwen2 or Qwen3 model, in place.

    Replaced, per module: RMSNorm by ``rms_norm``; the SwiGLU MLP's ``act(gate) * up`` by
    ``silu_mul``, recomputed in the backward instead of kept for ``down_proj``'s; the rotary embedding of q and k by ``rope``; the residual add in front of each
    layer's second norm by ``add_rms_norm``; and, in training with labels, the LM head and loss by
    ``linear_cross_entropy`` (the logits are never built and come back as ``None``). Parameters,
    their names and ``state_dict`` stay as they were. Works on float32, bfloat16 and float16
    models, and on float32 models under autocast (where a dtype mix would change Hugging Face's
    arithmetic the original forward runs). Applying it twice changes nothing.

    Args:
        model: Any ``nn.Module``; its submodules of the classes above are optimized.
        attention: What the attention modules run where the model asks for SDPA: ``"auto"`` (the
            default: per shape class, whichever of SDPA and :func:`customops.attention` was timed
            faster on this GPU at its first call; SDPA on other devices), ``"sdpa"`` (SDPA, as
            without customops) or ``"customops"`` (:func:`customops.attention` wherever it computes
            the same attention: no mask, dropout, bias or softcap; SDPA elsewhere). The summary
            lists the decisions.

    Returns:
        ``(model, summary)``: the same model object, and a :class:`Summary` (print it) of what was
        replaced and what was left alone. A model with none of the known modules comes back
        unchanged, with a summary that says so.

    Warns:
        UserWarning: for a known class whose forward is not a form customops was checked against
        (another transformers release, or a patched model): it is left alone.
    """
    if attention not in _attention_choice.POLICIES:
        raise ValueError(f"customops.optimize: attention must be one of {', '.join(_attention_choice.POLICIES)}, "
                         f"got {attention!r}")
    summary, warned = Summary(), set()
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return model, summary
    # Norms first: a decoder layer's add + norm fusion is planned only over a swapped norm.
    modules = sorted(model.modules(), key=lambda m: not type(m).__name__.endswith("RMSNorm"))
    for m in modules:
        if isinstance(m, _Swapped):
            kind = next(k for k in _KIND_TEXT if m._customops_base.__name__.endswith(k))
            summary.already[_KIND_TEXT[kind]] += 1
            continue
        plan = _plan(m, summary, warned)
        if plan is not None:
            kind, new_cls = plan
            m.__class__ = new_cls
            summary.replaced[_KIND_TEXT[kind]] += 1
    for m in model.modules():
        if isinstance(m, _Swapped) and m._customops_base.__name__.endswith("Attention"):
            m._customops_attention = attention
            summary.attention = attention
    summary.left_alone = list(dict.fromkeys(summary.left_alone))
    return model, summary


__all__ = ["optimize", "Summary"]
