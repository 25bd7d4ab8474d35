// The customops operator library: every schema, in one place. Kernels register elsewhere with
// TORCH_LIBRARY_IMPL (cpp/cpu for CPU, cuda/ for CUDA, cpp/ops for Meta and Autograd).
#include <torch/library.h>

TORCH_LIBRARY(customops, m) {
  // a * b + c elementwise (a, b: same shape, dtype, device); half types compute in float32.
  m.def("muladd(Tensor a, Tensor b, float c) -> Tensor");
  // a * b elementwise; muladd's backward is written with it.
  m.def("mul(Tensor a, Tensor b) -> Tensor");
  // a * b + c written into out (same shape, dtype, device as a); out may be a or b itself.
  m.def("muladd.out(Tensor a, Tensor b, float c, *, Tensor(a!) out) -> Tensor(a!)");

  // y = x * rsqrt(mean(x^2, -1) + eps) * weight over the last dim; also returns rstd (float32,
  // float64 for float64 x; shape x.shape[:-1]), which the backward reuses.
  m.def("rms_norm(Tensor x, Tensor? weight, float eps=1e-06) -> (Tensor, Tensor)");
  // (grad_x, grad_weight) of rms_norm; an output masked off by output_mask is an empty tensor.
  m.def("_rms_norm_backward(Tensor grad_y, Tensor x, Tensor? weight, Tensor rstd, bool[2] output_mask) -> (Tensor, Tensor)");
  // x * sigmoid(x).
  m.def("silu(Tensor x) -> Tensor");
  // grad_y * d silu(x) / dx.
  m.def("_silu_backward(Tensor grad_y, Tensor x) -> Tensor");
  // silu(gate) * up: the SwiGLU product; gate and up may be the halves of one tensor.
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  // (grad_gate, grad_up) of silu_mul.
  m.def("_silu_mul_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // silu(x[..., :n]) * x[..., n:] with n = x.size(-1) / 2: silu_mul of a fused gate-up tensor,
  // whose backward writes the gradient of x as one tensor (no concatenation of two halves).
  m.def("swiglu(Tensor x) -> Tensor");
  // grad of x for swiglu: [..., 2n], the gate half then the up half.
  m.def("_swiglu_backward(Tensor grad_y, Tensor x) -> Tensor");
  // prologue(x) @ weight.T (+ bias) (+ residual): a linear layer with the work around it fused,
  // for decoding, where a step is a chain of matrix-vector products. prologue is "none",
  // "rms_norm" (rms_norm(x, norm_weight, eps), as customops.rms_norm rounds it) or "swiglu"
  // (swiglu(x): x holds gate then up, twice weight's in_features). weight [N, K]; residual is
  // shaped like the result, x.shape[:-1] + [N]. A few rows on CUDA read each weight element
  // once in one kernel; more rows run the prologue, a GEMM and the add. constant_weight: no kernel
  // still running before this one in the stream writes weight (a parameter), so on CUDA the kernel
  // may read it before they finish (programmatic dependent launch); otherwise it waits for them.
  // weight_scale: weight is quantized (quantize_fp8 and quantize_int4 make both): float8_e4m3fn
  // [out, in] with a float32 scale [out] per output feature, the product reading weight *
  // weight_scale[:, None]; or int4, two a byte (uint8 [out, in / 2], element 2j in byte j's low
  // nibble, 2j + 1 in its high one, each stored plus 8) with a scale [out, in / group] per group
  // of consecutive inputs, the product reading (nibble - 8) * its group's scale.
  m.def("fused_linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, str prologue=\"none\", "
        "Tensor? norm_weight=None, float eps=1e-06, bool constant_weight=False, Tensor? weight_scale=None) -> Tensor");
  // A weight [out, in] (float32, float16 or bfloat16) as float8_e4m3fn with a float32 scale per
  // output feature (its largest magnitude over 448, E4M3's largest finite): (weight, scale).
  m.def("quantize_fp8(Tensor weight) -> (Tensor, Tensor)");
  // A weight [out, in] as int4 in groups of group_size consecutive inputs, symmetric: each group's
  // scale (weight's dtype) its largest magnitude over 7, its elements rounded to [-7, 7]:
  // (packed uint8 [out, in / 2], scale [out, in / group_size]) as fused_linear reads them.
  m.def("quantize_int4(Tensor weight, int group_size=128) -> (Tensor, Tensor)");
  // clamp(x * scale, lo, hi).
  m.def("scale_clamp(Tensor x, float scale, float lo, float hi) -> Tensor");
  // grad_y * scale where lo < x * scale < hi, else 0.
  m.def("_scale_clamp_backward(Tensor grad_y, Tensor x, float scale, float lo, float hi) -> Tensor");

  // ---- a transformer step's other memory-bound work ----
  // Per row of logits [..., V] (classes last; computed in float32, float64 for float64):
  // loss = lse - (1 - label_smoothing) * logits[target] - label_smoothing * mean(logits), 0 where
  // target == ignore_index; lse = logsumexp(logits, -1). Both shaped like target, both
  // differentiable (lse too: a z-loss lse**2 needs no second pass); the backward reuses lse.
  m.def("cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0) -> (Tensor, Tensor)");
  // grad of logits for cross_entropy from the gradients of loss and lse (either may be None).
  m.def("_cross_entropy_backward(Tensor? grad_loss, Tensor? grad_lse, Tensor logits, Tensor target, Tensor lse, int ignore_index, float label_smoothing) -> Tensor");
  // cross-entropy of hidden @ weight.T + bias against target, reduced ("mean" over the rows whose
  // target is not ignore_index, or "sum"), without materializing the [N, V] logits: it goes in
  // tiles of tile_rows x tile_classes logits (by default 1024 rows x as many classes as fit in
  // hidden's size), each living only while its loss and gradients are computed.
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\", int? tile_rows=None, int? tile_classes=None) -> Tensor");
  // linear_cross_entropy's loss with the gradients of hidden, weight and bias for a unit
  // gradient of the loss, computed chunk by chunk in the forward (the backward scales them);
  // an output masked off by output_mask is an empty tensor.
  m.def("_linear_cross_entropy_with_grads(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing, str reduction, int? tile_rows, int? tile_classes, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // (grad_hidden, grad_weight, grad_bias) * grad_loss: the backward of linear_cross_entropy from
  // the gradients its forward computed for a unit loss gradient.
  m.def("_linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias) -> (Tensor, Tensor, Tensor)");
  // Rotary embedding of q [B, Hq, S, D] and k [B, Hkv, S, D] in one launch, with cos and sin of
  // shape [S, R] or [B or 1, S, R] (R <= D, even): the first R dims of each head rotate, the rest
  // pass through. Rotate-half pairs (i, i + R/2) by default, GPT-J pairs (2i, 2i + 1) when
  // interleaved: y = x * cos + rotate(x) * sin.
  // The outputs are dense in the inputs' memory order ([B, S, H, D] when the heads are inside the
  // positions), so the op carries needs_fixed_stride_order: Inductor keeps that order for inputs it
  // lays out itself, including where a graph pass inserted the op.
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> (Tensor, Tensor)",
        {at::Tag::needs_fixed_stride_order});
  // (grad_q, grad_k) of rope: the inverse rotation of the output gradients.
  m.def("_rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
        {at::Tag::needs_fixed_stride_order});
  // sum = x + residual (rounded to x's dtype), y = rms_norm(sum) * weight, in one pass; returns
  // (y, sum, rstd). The next residual connection takes sum; the backward reuses rstd.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps=1e-06) -> (Tensor, Tensor, Tensor)");
  // (grad of sum, grad_weight) of add_rms_norm: rms_norm's backward on sum plus grad_sum (the
  // gradient that reached sum directly, or None); x and residual both take the first.
  m.def("_add_rms_norm_backward(Tensor grad_y, Tensor? grad_sum, Tensor sum, Tensor? weight, Tensor rstd, bool[2] output_mask) -> (Tensor, Tensor)");
  // softmax(q k^T * scale) v for q [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] (Hq a multiple of Hkv:
  // grouped-query attention); scale defaults to 1/sqrt(D); causal hides key j from query i when
  // j > i + Sk - Sq (bottom-right aligned). Returns (out [B, Hq, Sq, D] in q's memory order, lse
  // [B, Hq, Sq] in float32, float64 for float64): a row that sees no key gives out 0, lse -inf.
  m.def("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> (Tensor, Tensor)",
        {at::Tag::needs_fixed_stride_order});
  // (dq, dk, dv) of attention from the gradients of out and of lse (either may be None), reusing
  // out and lse; dk and dv sum over each kv head's group of query heads.
  m.def("_attention_backward(Tensor? grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float? scale) -> (Tensor, Tensor, Tensor)",
        {at::Tag::needs_fixed_stride_order});
  // The attention over the union of two disjoint key sets from the attentions (out, lse) over each.
  m.def("merge_attention(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  // ---- a static KV cache (decoding; customops.export.package_causal_lm) ----
  // attention of q [B, Hq, T, D] against a KV cache [Bc >= B, Hkv, S, D] that reads only each
  // sequence's filled length: sequence b's keys are positions [0, lengths[b]) and its T queries the
  // last T of them (causal, bottom-right). Returns (out [B, Hq, T, D], lse [B, Hq, T]) as attention
  // (out in q's memory order). slots [B] (int64), where given, maps the batch onto the cache's
  // sequences: row b reads cache sequence slots[b] (else b); the same for the writes below, whose
  // slots must be distinct (a continuous-batching engine runs the sequences of some slots alone).
  m.def("cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float? scale=None, "
        "Tensor? slots=None) -> (Tensor, Tensor)");
  // k, v [B, Hkv, T, D] written into the caches at positions [start[b], start[b] + T) of each
  // sequence b, in place (the mutation is in the schema, so export and AOTInductor keep it there).
  m.def("cache_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor start, Tensor? slots=None) -> ()");
  // rope then cache_write, one launch on CUDA (a decode step's): q and k [B, H, T, D] rotated by
  // cos, sin ([T, R] or [B, T, R], rotate-half pairs as rope's default), the rotated k and v written
  // into the caches at [start[b], start[b] + T); returns the rotated q (in q's memory order, as rope).
  m.def("rope_cache_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor q, Tensor k, Tensor v, Tensor cos, "
        "Tensor sin, Tensor start, Tensor? slots=None) -> Tensor");
}
