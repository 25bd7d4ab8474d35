// Internal: argument checks of attention and _attention_backward, shared by the Meta and device
// kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/checks.h"

namespace customops {

// lse's dtype, and the kernels' accumulation dtype: float32, float64 for float64 inputs.
inline at::ScalarType attention_lse_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  checks::float_dtype(op, "q", q);
  checks::defined(op, "k", k);
  checks::defined(op, "v", v);
  checks::same_dtype(op, "k", k, "q", q);
  checks::same_dtype(op, "v", v, "q", q);
  checks::same_device(op, "k", k, "q", q);
  checks::same_device(op, "v", v, "q", q);
  TORCH_CHECK(q.dim() == 4, op, ": expected q of shape [B, Hq, Sq, D], but got ", q.sym_sizes());
  TORCH_CHECK(k.dim() == 4, op, ": expected k of shape [B, Hkv, Sk, D], but got ", k.sym_sizes());
  checks::same_shape(op, "v", v, "k", k);
  TORCH_SYM_CHECK(k.sym_size(0).sym_eq(q.sym_size(0)).sym_and(k.sym_size(3).sym_eq(q.sym_size(3))), op,
                  ": expected k of shape [B, Hkv, Sk, D] with B and D of q ", q.sym_sizes(), ", but got ",
                  k.sym_sizes());
  TORCH_SYM_CHECK(k.sym_size(1).sym_ge(1), op, ": k must have at least one head, but got ", k.sym_sizes());
  TORCH_SYM_CHECK((q.sym_size(1) % k.sym_size(1)).sym_eq(0), op, ": q's heads (", q.sym_size(1),
                  ") must be a multiple of k's (", k.sym_size(1), ") for grouped-query attention");
}

inline void check_attention_backward(const std::optional<at::Tensor>& grad_out,
                                     const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                     const at::Tensor& lse) {
  constexpr const char* op = "customops::_attention_backward";
  check_attention(op, q, k, v);
  checks::defined(op, "out", out);
  checks::same_shape(op, "out", out, "q", q);
  checks::same_dtype(op, "out", out, "q", q);
  checks::defined(op, "lse", lse);
  TORCH_CHECK(lse.scalar_type() == attention_lse_dtype(q.scalar_type()), op, ": expected lse of dtype ",
              attention_lse_dtype(q.scalar_type()), ", but got ", lse.scalar_type());
  TORCH_CHECK(lse.dim() == 3, op, ": expected lse of shape [B, Hq, Sq], but got ", lse.sym_sizes());
  for (int64_t d = 0; d < 3; ++d) {
    TORCH_SYM_CHECK(lse.sym_size(d).sym_eq(q.sym_size(d)), op, ": expected lse of shape [B, Hq, Sq] = ",
                    q.sym_sizes().slice(0, 3), ", but got ", lse.sym_sizes());
  }
  if (grad_out.has_value() && grad_out->defined()) {
    checks::same_shape(op, "grad_out", *grad_out, "q", q);
    checks::same_dtype(op, "grad_out", *grad_out, "q", q);
    checks::same_device(op, "grad_out", *grad_out, "q", q);
  }
  if (grad_lse.has_value() && grad_lse->defined()) {
    checks::same_shape(op, "grad_lse", *grad_lse, "lse", lse);
    checks::same_dtype(op, "grad_lse", *grad_lse, "lse", lse);
    checks::same_device(op, "grad_lse", *grad_lse, "q", q);
  }
}

// The CPU block kernels (cpp/cpu/attention.cpp), on float32 blocks of scores [rows, n] with row
// stride ld, written out to width >= n columns (the ones past n as 0: the padding of the block's
// matmuls). Row r of a block stacks a group's query rows (m of them, repeated per query head); it
// sees the block's keys up to index first_limit + r % m (its causal limit; any n - 1 or more means
// all of them).
struct AttentionCpuKernels {
  // Online-softmax step, in place: s <- exp(scale * s - m_new) over the visible keys, 0 past them;
  // per row, mx (running max of scale * s) and l (running sum) updated, and the row of o ([rows, d],
  // the output so far; null: none yet) multiplied by exp(mx_old - m_new) (0 where the row saw no
  // key before).
  void (*softmax_step)(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                       double scale, float* mx, float* l, float* o, int64_t d);
  // s <- exp(scale * s - lse) over the visible keys, 0 past them and in rows with lse -inf.
  void (*probs)(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                double scale, const float* lse);
  // dp <- p * (dp - dt[r]), the scores' gradient (dt: rowsum(grad_out * out) - grad_lse).
  void (*dscores)(float* dp, const float* p, int64_t rows, int64_t n, int64_t ld, const float* dt);
  // dst[c, r] <- src[r, c] for a [rows, cols] src.
  void (*transpose)(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst);
  // dst <- a * src, [rows, cols] (in place when dst is src).
  void (*scale_rows)(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float a, float* dst,
                     int64_t ld_dst);
  // The forward's last step: out <- o / l and lse <- mx + log(l) per row; out 0 and lse -inf in rows
  // that saw no key (l = 0). o is [rows, d] dense.
  void (*finish_rows)(const float* o, int64_t rows, int64_t d, const float* mx, const float* l, float* out,
                      int64_t ld_out, float* lse);
};
const AttentionCpuKernels& attention_kernels_cpu();

#ifdef CUSTOMOPS_WITH_CUDA
// The fused CUDA kernels (cuda/attention.cu): float16 and bfloat16, head dims 64 and 128, a
// positive scale, sm_80 or newer. attention_cuda_fused says whether they take q (k and v match it
// after check_attention); the others go through the blocked ATen kernels.
bool attention_cuda_fused(const at::Tensor& q, double scale);
// Writes out (q's sizes, unit last stride) and lse (contiguous float32 [B, Hq, Sq]).
void attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                        const at::Tensor& out, const at::Tensor& lse);
// Writes dq, dk and dv (their inputs' sizes, unit last stride, 16-byte aligned rows).
void attention_bwd_cuda(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        bool causal, double scale, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv);
#endif

}  // namespace customops
