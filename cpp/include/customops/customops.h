// Public C++ API of customops. Every function calls its operator through the dispatcher, so
// the CPU/CUDA kernel is picked by device and autograd and Meta apply from C++ as from Python.
// Link customops::customops (find_package(customops)); including this header also keeps the
// library from being dropped by --as-needed linkers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "customops/macros.h"

namespace customops {

// a * b + c, elementwise. a and b: same shape, dtype (float32/64, float16, bfloat16) and device.
CUSTOMOPS_API at::Tensor muladd(const at::Tensor& a, const at::Tensor& b, double c);
// Writes a * b + c into out (same shape, dtype and device as a) and returns out.
CUSTOMOPS_API at::Tensor& muladd_out(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out);
// a * b, elementwise, with the same rules as muladd.
CUSTOMOPS_API at::Tensor mul(const at::Tensor& a, const at::Tensor& b);

// RMSNorm over the last dim: x * rsqrt(mean(x^2, -1) + eps) * weight (weight optional, shape
// [x.size(-1)]). rms_norm_with_rstd also returns rstd (float32; float64 for float64 x).
CUSTOMOPS_API at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps = 1e-6);
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> rms_norm_with_rstd(const at::Tensor& x,
                                                                    const std::optional<at::Tensor>& weight,
                                                                    double eps = 1e-6);
// sum = x + residual, y = rms_norm(sum, weight, eps): returns (y, sum, rstd).
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                                          const at::Tensor& residual,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          double eps = 1e-6);
// Rotary embedding of q [B, Hq, S, D] and k [B, Hkv, S, D] with cos, sin [S, R] or [B or 1, S, R]:
// returns (q rotated, k rotated); rotate-half pairs, or GPT-J pairs when interleaved.
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                      const at::Tensor& sin, bool interleaved = false);
// softmax(q k^T * scale) v of q [B, Hq, Sq, D] over k, v [B, Hkv, Sk, D], Hq a multiple of Hkv
// (grouped-query attention, k and v never repeated); scale defaults to 1/sqrt(D); causal hides key
// j from query i when j > i + Sk - Sq. Returns (out [B, Hq, Sq, D], lse [B, Hq, Sq]): lse, the
// rows' log-sum-exp (float32; float64 for float64), is differentiable and merges partial
// attentions (merge_attention). A row that sees no key gives out 0 and lse -inf.
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, bool causal = false,
                                                           std::optional<double> scale = std::nullopt);
// The attention over the union of two disjoint key sets, from the (out, lse) of each: exact and
// differentiable. out [..., D], lse out.shape[:-1].
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                                 const at::Tensor& out_b, const at::Tensor& lse_b);
// Attention of q [B, Hq, T, D] against a KV cache k_cache, v_cache [Bc >= B, Hkv, S, D] that reads
// only each sequence's filled length: sequence b's keys are positions [0, lengths[b]) (lengths:
// int64 [B] on q's device, T <= lengths[b] <= S) and its T queries are the last T of them
// (causal). Returns (out, lse) as attention. Inference only (refuses inputs that require grad).
// On CUDA (float16/bfloat16, head dim 64/128/256, T <= 16) a split-KV kernel reads lengths on the
// device, so a CUDA graph can capture it; a length out of range gives NaN rows there, an error
// elsewhere. slots (int64 [B]), where given, maps row b onto the cache's sequence slots[b] (else
// b): a continuous-batching engine attends and writes the sequences of some slots alone. The
// writes' slots must be distinct.
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> cache_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                                 const at::Tensor& v_cache, const at::Tensor& lengths,
                                                                 std::optional<double> scale = std::nullopt,
                                                                 const std::optional<at::Tensor>& slots = std::nullopt);
// Writes k, v [B, Hkv, T, D] into k_cache, v_cache [Bc >= B, Hkv, S, D] at positions
// [start[b], start[b] + T) of each sequence b (start: int64 [B] on the cache's device), in place.
// A position outside the cache is an error, except on CUDA, where the kernel reads start on the
// device and writes no row outside the cache.
CUSTOMOPS_API void cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& start,
                               const std::optional<at::Tensor>& slots = std::nullopt);
// rope(q, k, cos, sin), then cache_write of the rotated k and v; returns the rotated q. One kernel
// on CUDA (rotate-half pairs over the whole head dim; other inputs run the two ops' kernels).
CUSTOMOPS_API at::Tensor rope_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                          const at::Tensor& sin, const at::Tensor& start,
                                          const std::optional<at::Tensor>& slots = std::nullopt);
// Cross-entropy of logits [N, V] (float32/64, float16, bfloat16; computed in float32) against
// target [N] (int64; rows whose target is ignore_index give 0). Returns (loss [N], lse [N]), both
// float32 (float64 for float64): lse, the rows' log-sum-exp, is differentiable (a z-loss needs no
// second pass).
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                               int64_t ignore_index = -100,
                                                               double label_smoothing = 0.0);
// cross_entropy(hidden @ weight.T + bias, target) reduced ("mean" over the counted rows, or "sum")
// without building the [N, V] logits: hidden [N, H], weight [V, H], bias [V] or none. It goes in
// tiles of tile_rows x tile_classes logits; the default (1024 rows, classes within hidden's size)
// keeps the extra memory at most hidden's, whole-vocabulary tiles (tile_classes = V) take three
// matmuls instead of four.
CUSTOMOPS_API at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                              const at::Tensor& target,
                                              const std::optional<at::Tensor>& bias = std::nullopt,
                                              int64_t ignore_index = -100, double label_smoothing = 0.0,
                                              std::string_view reduction = "mean",
                                              std::optional<int64_t> tile_rows = std::nullopt,
                                              std::optional<int64_t> tile_classes = std::nullopt);
// x * sigmoid(x).
CUSTOMOPS_API at::Tensor silu(const at::Tensor& x);
// silu(gate) * up (SwiGLU); gate and up may be the two halves of one tensor's last dim.
CUSTOMOPS_API at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
// silu(x[..., :n]) * x[..., n:] with n = x.size(-1) / 2: silu_mul of a fused gate-up tensor; its
// backward writes x's gradient as one tensor (faster than silu_mul on x.chunk(2, -1) in training).
CUSTOMOPS_API at::Tensor swiglu(const at::Tensor& x);
// prologue(x) @ weight.T + bias + residual, one kernel for a few rows on CUDA (decoding).
// prologue: "none", "rms_norm" (customops::rms_norm(x, norm_weight, eps)) or "swiglu"
// (customops::swiglu(x), x twice weight's in_features wide); bias and residual optional.
// constant_weight: weight (and weight_scale) are not written by a kernel still running on the
// stream (parameters), so the CUDA kernel may start reading them before the kernels ahead of it
// finish. weight_scale:
// weight is quantized (quantize_fp8's or quantize_int4's weight and scale), and the product reads
// the dequantized weight, accumulating in float32; such a weight takes no gradient. (On CUDA, fp8
// rows past 4 go through the FP8 tensor cores with x rounded to float8 a row: docs/quantization.md.)
CUSTOMOPS_API at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias = std::nullopt,
                                      const std::optional<at::Tensor>& residual = std::nullopt,
                                      std::string_view prologue = "none",
                                      const std::optional<at::Tensor>& norm_weight = std::nullopt, double eps = 1e-6,
                                      bool constant_weight = false,
                                      const std::optional<at::Tensor>& weight_scale = std::nullopt);
// A weight [out, in] (float32, float16, bfloat16) quantized to float8_e4m3fn with a float32 scale
// per output feature (the row's largest magnitude over 448): (weight, scale) for fused_linear.
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& weight);
// A weight [out, in] quantized to int4 in groups of group_size consecutive inputs (symmetric: a
// group's scale, in weight's dtype, is of its largest magnitude over 7 times 1, 0.95, ..., 0.7 the
// one leaving the least squared error): (packed uint8 [out, in / 2], scale [out, in / group_size])
// for fused_linear (see its schema for the packing). Both quantizers raise on a NaN or infinity,
// but inside a CUDA graph's capture, where that row's (group's) scale is NaN instead.
CUSTOMOPS_API std::tuple<at::Tensor, at::Tensor> quantize_int4(const at::Tensor& weight, int64_t group_size = 128);
// clamp(x * scale, lo, hi); requires lo <= hi.
CUSTOMOPS_API at::Tensor scale_clamp(const at::Tensor& x, double scale, double lo, double hi);

// Version of customops and of the torch it was built against, e.g. "0.1.0", "2.13.0".
CUSTOMOPS_API std::string version();
CUSTOMOPS_API std::string torch_version();
// True when libcustomops.so holds CUDA kernels.
CUSTOMOPS_API bool has_cuda();

namespace detail {
// Referencing an exported symbol from every program that includes this header keeps
// libcustomops.so (and so its operator registrations) in the link under --as-needed.
CUSTOMOPS_API int link_anchor();
[[maybe_unused]] static const int kLinkAnchor = link_anchor();
}  // namespace detail

}  // namespace customops
