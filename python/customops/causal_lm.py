"""A Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3) with a static KV cache, as one module
that :func:`customops.export.package_causal_lm` exports into one AOTInductor package.

:class:`CachedCausalLM` holds the model's weights (shared with it, not copied) and, per layer, a key
and a value cache ``[max_batch, kv_heads, max_seq_len, head_dim]`` as buffers, which its forward
updates in place: exported, they are the package's own state, written by the graph, never copied
in or out. Its forward takes ``input_ids [B, T]`` (``B <= max_batch``; ``T`` varies, so the same
graph prefills a whole prompt and decodes with ``T = 1``), each sequence's start position
``start [B]`` (the tokens already in its cache) and ``count [B]``, how many of the ``T`` ids are
its own (prompts of different lengths are right-padded to one ``T``); it returns the logits of each
sequence's last new token, ``[B, vocab]``, in float32.

A sequence's queries see its keys at positions up to their own (causal), so the padding after a
short prompt is written to the cache but never read by its own tokens: the next call starts that
sequence at ``start + count`` and overwrites it.

The decoder layers are written here with the model's own modules and customops ops (rms_norm,
rope, silu_mul), the layer structure of Hugging Face's Llama family: this is what lets the cache be
static and the graph have one dynamic length. The new keys and values go into the cache through
customops.cache_write (in place: its schema declares the mutation, which export and AOTInductor
keep), and attention reads each sequence's filled part of the cache only (customops.cache_attention,
whose CUDA kernel reads the lengths on the device, so a CUDA graph can replay a decode step).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._ops import cache_attention, cache_write, rms_norm, rope, silu_mul

# config.model_type -> the family's name in the package's metadata
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _family(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    family = FAMILIES.get(getattr(cfg, "model_type", None))
    inner = getattr(model, "model", None)
    if family is None or not hasattr(model, "lm_head") or not hasattr(inner, "layers"):
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise ValueError(f"customops.export.package_causal_lm: {kind!r} is not a causal LM of a family it knows "
                         f"(a Hugging Face *ForCausalLM of {', '.join(sorted(FAMILIES))})")
    return family


def _check_window(model: nn.Module, max_seq_len: int) -> None:
    cfg = model.config
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window is not None and max_seq_len > window:
        raise ValueError(f"customops.export.package_causal_lm: the model attends within a sliding window of {window} "
                         f"tokens, which the package does not implement yet: max_seq_len ({max_seq_len}) must be at "
                         f"most the window (then the window never applies)")


class CachedCausalLM(nn.Module):
    """``model`` (a Hugging Face *ForCausalLM of the Llama family) with a static KV cache; see the
    module's docstring for the forward."""

    def __init__(self, model: nn.Module, *, max_batch: int = 1, max_seq_len: int = 2048):
        super().__init__()
        self.family = _family(model)
        _check_window(model, max_seq_len)
        cfg = model.config
        self.embed = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.rotary = model.model.rotary_emb
        self.lm_head = model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        p = next(model.parameters())
        shape = (max_batch, self.n_kv, max_seq_len, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))

    def forward(self, input_ids: Tensor, start: Tensor, count: Tensor) -> Tensor:
        b, t = input_ids.shape
        steps = torch.arange(t, device=input_ids.device)
        positions = start[:, None] + steps  # [B, T]
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions)  # [B, T, D]
        lengths = start + t  # each sequence's filled length once the T new tokens are written
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            h = h + self._attention(layer.self_attn, rms_norm(h, layer.input_layernorm.weight,
                                                              layer.input_layernorm.variance_epsilon),
                                    cos, sin, k_cache, v_cache, start, lengths)
            x = rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            mlp = layer.mlp
            h = h + mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        last = h[torch.arange(b, device=h.device), count - 1]  # [B, hidden]: each sequence's last new token
        return self.lm_head(rms_norm(last, self.norm.weight, self.norm.variance_epsilon)).float()

    def _attention(self, attn, x, cos, sin, k_cache, v_cache, start, lengths):
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = attn.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        if self.family == "qwen3":  # per-head RMSNorm of q and k before the rotation
            q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache_write(k_cache, v_cache, k, v.transpose(1, 2), start)
        o, _ = cache_attention(q, k_cache, v_cache, lengths, scale=attn.scaling)
        return attn.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
