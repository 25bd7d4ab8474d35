"""A Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3) with a static KV cache, as one module
that :func:`customops.export.package_causal_lm` exports into one AOTInductor package.

:class:`CachedCausalLM` holds the model's weights (shared with it, not copied) and, per layer, a key
and a value cache ``[max_batch, kv_heads, max_seq_len, head_dim]`` as buffers, which its forward
updates in place: exported, they are the package's own state, written by the graph, never copied
in or out. Its forward takes ``input_ids [B, T]`` (``B <= max_batch``; ``T`` varies, so the same
graph prefills a whole prompt and decodes with ``T = 1``), each sequence's start position
``start [B]`` (the tokens already in its cache), ``count [B]``, how many of the ``T`` ids are
its own (prompts of different lengths are right-padded to one ``T``), and ``slots [B]``, the row of
the cache each sequence is (distinct; a continuous-batching engine runs the decoding sequences of
some slots in one call and a prompt chunk of others in the next, so that the decoding rows do not
compute the chunk's length); it returns the logits of each sequence's last new token, ``[B, vocab]``,
in float32.

A sequence's queries see its keys at positions up to their own (causal), so the padding after a
short prompt is written to the cache but never read by its own tokens: the next call starts that
sequence at ``start + count`` and overwrites it.

The decoder layers are written here with customops ops and the layer structure of Hugging Face's
Llama family: this is what lets the cache be static and the graph have one dynamic length. A decode
step is a chain of small kernels whose latency, not their bytes, is most of its time, so a layer
has as few as it can (:class:`DecodeLayer`): q, k and v come from one matrix product and gate and up
from another (their weights concatenated once, when the module is built: the package holds them
and not the model's separate ones), and each of the four products is one customops.fused_linear
with the work around it: the norm before the qkv and gate-up products, SwiGLU before the down
product, the residual add after the output and down products. On CUDA a decode step's few rows
then run each product as one kernel that reads its weight once (prefill's many rows run the norm
or SwiGLU op, cuBLAS and the add). q and k are rotated and the new keys and values go into the
cache in one customops.rope_cache_write (in place: its schema declares the mutation, which export
and AOTInductor keep), and attention reads each sequence's filled part of the cache only
(customops.cache_attention, whose CUDA kernel reads the lengths on the device, so a CUDA graph can
replay a decode step).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._ops import cache_attention, fused_linear, quantize_fp8, quantize_int4, rms_norm, rope_cache_write

# config.model_type -> the family's name in the package's metadata
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _family(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    family = FAMILIES.get(getattr(cfg, "model_type", None))
    inner = getattr(model, "model", None)
    if family is None:
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise ValueError(f"customops.export.package_causal_lm: {kind!r} is not a causal LM of a family it knows "
                         f"(a Hugging Face *ForCausalLM of {', '.join(sorted(FAMILIES))})")
    if not hasattr(model, "lm_head") or not hasattr(inner, "layers"):
        raise ValueError(f"customops.export.package_causal_lm: {type(model).__name__} has no LM head (it is the bare "
                         f"decoder); pass the *ForCausalLM model, whose forward gives logits")
    return family


def _check_window(model: nn.Module, max_seq_len: int) -> None:
    """Refuses a sliding window that a sequence of max_seq_len tokens would reach (the package's
    attention has none). Qwen2 and Qwen3 slide only in the layers their layer_types name
    "sliding_attention"; Mistral in every layer where it has a window."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return
    if max_seq_len > window:
        raise ValueError(f"customops.export.package_causal_lm: the model attends within a sliding window of {window} "
                         f"tokens, which the package does not implement yet: max_seq_len ({max_seq_len}) must be at "
                         f"most the window (then the window never applies)")


def _check_activation(model: nn.Module) -> None:
    act = getattr(model.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"customops.export.package_causal_lm: the MLP's activation is {act!r}; the package's "
                         f"layers compute SwiGLU (silu), the activation of every family it knows")


def _concat_linear(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the outputs of ``linears`` side by side (a copy of their
    weights; a missing bias is zeros where another has one)."""
    w = torch.cat([m.weight.detach() for m in linears])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=any(m.bias is not None for m in linears), device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features)
                                             for m in linears]), requires_grad=False)
    return fused


class DecodeLayer(nn.Module):
    """The weights of one Hugging Face decoder layer, as the package's forward reads them: the
    norms and the output and down projections are the layer's own modules (shared, not copied);
    ``qkv`` is q_proj, k_proj and v_proj concatenated and ``gate_up`` gate_proj and up_proj."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _concat_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.scaling = attn.scaling
        self.gate_up = _concat_linear(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj


# The weight formats of package_causal_lm (its ``weights``): the model's dtype, float8 E4M3 with a
# scale an output feature, int4 in groups of INT4_GROUP inputs.
WEIGHTS = ("bf16", "fp8", "int4")
INT4_GROUP = 128


class QuantizedLinear(nn.Module):
    """A linear layer's weight quantized for fused_linear's ``weight_scale`` (buffers: the package
    holds them as constants), and its bias (the original's, shared)."""

    def __init__(self, linear: nn.Linear, weights: str, where: str):
        super().__init__()
        w = linear.weight.detach()
        if weights == "int4" and w.shape[1] % INT4_GROUP:
            raise ValueError(f"customops.export.package_causal_lm: weights='int4' quantizes in groups of {INT4_GROUP} "
                             f"inputs, but {where} has {w.shape[1]} in_features")
        with torch.no_grad():
            q, scale = quantize_fp8(w) if weights == "fp8" else quantize_int4(w, INT4_GROUP)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias


def _linear(linear: nn.Module, x: Tensor, *, norm: nn.Module | None = None, residual: Tensor | None = None,
            swiglu: bool = False) -> Tensor:
    """linear(norm(x)) (or linear(swiglu(x)), or linear(x)), plus residual: one fused_linear, whose
    weight is a parameter no kernel writes (constant_weight: on CUDA it streams while the kernel
    before it finishes)."""
    scale = getattr(linear, "weight_scale", None)  # a QuantizedLinear's
    if norm is not None:
        return fused_linear(x, linear.weight, linear.bias, residual, prologue="rms_norm", norm_weight=norm.weight,
                            eps=norm.variance_epsilon, constant_weight=True, weight_scale=scale)
    return fused_linear(x, linear.weight, linear.bias, residual, prologue="swiglu" if swiglu else "none",
                        constant_weight=True, weight_scale=scale)


class _Rotary(nn.Module):
    """The model's rotary embedding, computed per sequence as Hugging Face computes it for that
    sequence alone. Most rope types have fixed frequencies. Two change them with the sequence's
    length (the largest position of the call, plus one): "longrope" takes its long factors past
    original_max_position_embeddings and "dynamic" (NTK) grows its base past max_position_embeddings.
    Hugging Face decides both by the largest position in the whole batch (and, for "dynamic", by
    what the module saw before); here each sequence's own length decides, so that a prompt's ids
    never depend on its batch-mates, and the package needs no data-dependent branch."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.config = rotary.config
        self.rope_type = rotary.rope_type
        self.scaling = rotary.attention_scaling
        # the frequencies the module was built with (a forward on a long sequence may have changed inv_freq)
        inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)
        self.register_buffer("inv_freq", inv_freq.detach().clone().float(), persistent=False)
        params = getattr(self.config, "rope_parameters", None) or {}
        if self.rope_type == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.threshold = params["original_max_position_embeddings"]
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](self.config, inv_freq.device, seq_len=self.threshold + 1)
            self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        elif self.rope_type == "dynamic":
            self.threshold = rotary.original_max_seq_len

    def forward(self, positions: Tensor, lengths: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, T, rotary dims] of positions [B, T], for sequences of lengths [B]."""
        inv_freq = self.inv_freq[None]  # [1 or B, dims / 2]
        if self.rope_type == "longrope":
            inv_freq = torch.where((lengths > self.threshold)[:, None], self.long_inv_freq[None], inv_freq)
        elif self.rope_type == "dynamic":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.config, positions.device, seq_len=lengths[:, None])
            inv_freq = torch.where((lengths > self.threshold)[:, None], grown.float(), inv_freq)
        freqs = positions[:, :, None].float() * inv_freq[:, None, :]  # [B, T, dims / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class CachedCausalLM(nn.Module):
    """``model`` (a Hugging Face *ForCausalLM of the Llama family) with a static KV cache; see the
    module's docstring for the forward."""

    def __init__(self, model: nn.Module, *, max_batch: int = 1, max_seq_len: int = 2048, weights: str = "bf16",
                 quantize_lm_head: bool = False):
        super().__init__()
        if weights not in WEIGHTS:
            raise ValueError(f"customops.export.package_causal_lm: weights must be one of {', '.join(WEIGHTS)}, "
                             f"got {weights!r}")
        if quantize_lm_head and weights == "bf16":
            raise ValueError("customops.export.package_causal_lm: quantize_lm_head=True needs weights='fp8' or "
                             "'int4' (the LM head takes the decoder layers' format)")
        self.family = _family(model)
        _check_window(model, max_seq_len)
        _check_activation(model)
        cfg = model.config
        self.embed = model.model.embed_tokens
        self.layers = nn.ModuleList(DecodeLayer(layer) for layer in model.model.layers)
        self.norm = model.model.norm
        self.rotary = _Rotary(model.model.rotary_emb)
        self.lm_head = model.lm_head
        self.weights = weights
        if weights != "bf16":  # the decoder layers' four products (and the LM head where asked)
            for i, layer in enumerate(self.layers):
                for name in ("qkv", "o_proj", "gate_up", "down_proj"):
                    setattr(layer, name, QuantizedLinear(getattr(layer, name), weights, f"layer {i}'s {name}"))
            if quantize_lm_head:
                self.lm_head = QuantizedLinear(self.lm_head, weights, "the LM head")
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        p = next(model.parameters())
        shape = (max_batch, self.n_kv, max_seq_len, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=p.dtype, device=p.device))

    def forward(self, input_ids: Tensor, start: Tensor, count: Tensor, slots: Tensor | None = None) -> Tensor:
        b, t = input_ids.shape
        if slots is None:  # row b is slot b
            slots = torch.arange(b, device=input_ids.device)
        steps = torch.arange(t, device=input_ids.device)
        positions = start[:, None] + steps  # [B, T]
        h = self.embed(input_ids)
        cos, sin = self.rotary(positions, start + count, h.dtype)  # [B, T, rotary dims]
        lengths = start + t  # each sequence's filled length once the T new tokens are written
        for i, layer in enumerate(self.layers):
            qkv = _linear(layer.qkv, h, norm=layer.input_norm)
            o = self._attention(layer, qkv, cos, sin, getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"),
                                start, lengths, slots)
            h = _linear(layer.o_proj, o, residual=h)
            h = _linear(layer.down_proj, _linear(layer.gate_up, h, norm=layer.post_norm), residual=h, swiglu=True)
        last = (torch.arange(b, device=h.device), count - 1)  # each sequence's last new token
        return _linear(self.lm_head, h[last], norm=self.norm).float()

    def _attention(self, layer, qkv, cos, sin, k_cache, v_cache, start, lengths, slots):
        """The attention block's output before o_proj, [B, T, heads * D], from the qkv product."""
        b, t, _ = qkv.shape
        # [B, T, heads, D], split along the heads (slicing a view: reshaping a slice would make
        # Inductor guard on the batch size)
        qkv = qkv.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before the rotation
            q = rms_norm(q, layer.q_norm.weight, layer.q_norm.variance_epsilon)
            k = rms_norm(k, layer.k_norm.weight, layer.k_norm.variance_epsilon)
        q = rope_cache_write(k_cache, v_cache, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cos, sin, start,
                             slots=slots)
        o, _ = cache_attention(q, k_cache, v_cache, lengths, scale=layer.scaling, slots=slots)
        return o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
