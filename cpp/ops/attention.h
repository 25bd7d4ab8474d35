// Internal: argument checks, outputs and default scale of attention and _attention_backward,
// shared by the Meta and device kernels; and the blocked ATen kernels (cpp/ops/attention_blocked.cpp)
// that the CPU kernels (cpp/cpu/attention.cpp) and CUDA kernels (cuda/attention.cu) fall back on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "ops/checks.h"
#include "ops/layout.h"

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

// attention's outputs, empty: out in q's memory order, lse [B, Hq, Sq]. The Meta and device kernels
// all allocate them here, so their shapes and strides agree.
inline std::tuple<at::Tensor, at::Tensor> attention_outputs(const at::Tensor& q) {
  return {heads_layout_like(q),
          at::empty_symint(q.sym_sizes().slice(0, 3), q.options().dtype(attention_lse_dtype(q.scalar_type())))};
}

// 1/sqrt(D) unless given; 1 for D = 0 (every score is 0 then).
inline double attention_scale(std::optional<double> scale, int64_t d) {
  return scale.has_value() ? *scale : (d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0);
}

// dterm = rowsum(grad_out * out) - grad_lse per query row, in lse's dtype: the backward's ds is
// p * (dout v^T - dterm). ATen ops (cpp/ops/attention_blocked.cpp).
at::Tensor attention_dterm(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& out, const at::Tensor& lse);

// ---- the blocked kernels (cpp/ops/attention_blocked.cpp) ---------------------------------------
// ATen ops on blocks, on any device: the CPU and CUDA kernels' fallback for the inputs their own
// kernels do not take, and the reference of those kernels. Blocks and parallel_tasks are shared
// with the CPU flash kernels (cpp/cpu/attention.cpp).
namespace attention_blocked {

// Tensors come grouped: q, out and their gradients as [B', Hkv', G, M, D] (G query heads per kv
// head, M query rows starting at row i0 of Sq), k and v as [B', Hkv', Sk, D], lse-shaped ones as
// [B', Hkv', G, M]. Query row i sees key j when j <= i + Sk - Sq (causal; bottom-right aligned).
struct Blocks {
  int64_t i0, sq, sk;
  bool causal;
  double scale;
  int64_t block_k;
  int64_t keys_from = 0, keys_to = std::numeric_limits<int64_t>::max();  // the keys to go over

  int64_t shift() const { return sk - sq; }
  // The keys [keys_from, end) that some row of the block sees.
  int64_t key_end(int64_t m) const {
    return std::min(causal ? std::clamp<int64_t>(i0 + m + shift(), 0, sk) : sk, keys_to);
  }
  // s ([B', Hkv', G * M, N], keys from j0) with the keys a row must not see at -inf.
  void mask(at::Tensor& s, int64_t m, int64_t j0) const;
};

// fn(task) for task in [0, n) in parallel on the CPU. The ATen calls of a task must dispatch as
// this thread's do (below autograd): worker threads take this thread's dispatch-key and
// grad-mode state.
void parallel_tasks(int64_t n, c10::function_ref<void(int64_t)> fn);

// out and lse (allocated, q's sizes and [B, Hq, Sq]) of attention; any device, any float dtype.
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
             const at::Tensor& out, const at::Tensor& lse);

// dq, dk and dv (allocated, their inputs' sizes) of attention (go: grad_out, zeros where it is
// None; dterm: attention_dterm).
void backward(const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& dterm, const at::Tensor& lse, bool causal, double scale, const at::Tensor& dq,
              const at::Tensor& dk, const at::Tensor& dv);

}  // namespace attention_blocked

}  // namespace customops
