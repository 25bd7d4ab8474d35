// Internal: argument checks of rms_norm, add_rms_norm, silu, silu_mul, scale_clamp and their backward ops,
// shared by the Meta, CPU and CUDA kernels; and the typed calls of the private backward ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <optional>
#include <tuple>
#include <type_traits>

#include "ops/checks.h"

namespace customops {

// wname: what the op calls the weight (fused_linear's is norm_weight).
inline void check_rms_norm(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const char* wname = "weight") {
  checks::float_dtype(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (the one normalized), but it is a scalar");
  if (weight.has_value() && weight->defined()) {
    const at::Tensor& w = *weight;
    checks::same_device(op, wname, w, "x", x);
    // A float32 weight with a half-type x (mixed-precision training keeps norm weights in float32)
    // is read as it is; the gradient of the weight comes back in the weight's dtype.
    const bool mixed = w.scalar_type() == at::kFloat && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16);
    TORCH_CHECK(w.scalar_type() == x.scalar_type() || mixed, op, ": expected ", wname, " to have the dtype of x (",
                x.scalar_type(), "), or float32 when x is float16 or bfloat16, but got ", w.scalar_type());
    TORCH_CHECK(w.dim() == 1, op, ": expected ", wname, " of shape [", x.sym_size(-1), "] (x's last dim), but got ",
                w.sym_sizes());
    TORCH_SYM_CHECK(w.sym_size(0).sym_eq(x.sym_size(-1)), op, ": expected ", wname, " of shape [", x.sym_size(-1),
                    "] (x's last dim), but got ", w.sym_sizes());
  }
}

// Calls f(W{}) with W the element type of rms_norm's weight: T itself, or float for a float32
// weight with a half-type x (check_rms_norm allows no other mix), which kernels read as it is.
template <typename T, typename F>
void with_weight_type(const at::Tensor& w, F&& f) {
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    if (w.defined() && w.scalar_type() == at::kFloat) return f(float{});
  }
  f(T{});
}

// rstd: the accumulation dtype of x (float32; float64 for float64 x).
inline at::ScalarType rms_norm_acc_dtype(at::ScalarType x) { return x == at::kDouble ? at::kDouble : at::kFloat; }

// x is the normalized input: rms_norm's x, or add_rms_norm's sum.
inline void check_rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                    const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                                    const char* op = "customops::_rms_norm_backward", const char* xname = "x") {
  check_rms_norm(op, x, weight);
  checks::defined(op, "grad_y", grad_y);
  checks::same_device(op, "grad_y", grad_y, xname, x);
  checks::same_dtype(op, "grad_y", grad_y, xname, x);
  checks::same_shape(op, "grad_y", grad_y, xname, x);
  checks::defined(op, "rstd", rstd);
  checks::same_device(op, "rstd", rstd, "x", x);
  TORCH_CHECK(rstd.scalar_type() == rms_norm_acc_dtype(x.scalar_type()), op, ": expected rstd of dtype ",
              rms_norm_acc_dtype(x.scalar_type()), ", but got ", rstd.scalar_type());
  TORCH_CHECK(rstd.dim() == x.dim() - 1, op, ": expected rstd of shape ", xname, ".shape[:-1], but got ", rstd.sym_sizes());
  for (int64_t i = 0; i < rstd.dim(); ++i) {
    TORCH_SYM_CHECK(rstd.sym_size(i).sym_eq(x.sym_size(i)), op, ": expected rstd of shape ", xname,
                    ".shape[:-1], but got ", rstd.sym_sizes());
  }
}

inline void check_add_rms_norm(const char* op, const at::Tensor& x, const at::Tensor& residual,
                               const std::optional<at::Tensor>& weight) {
  check_rms_norm(op, x, weight);
  checks::defined(op, "residual", residual);
  checks::same_device(op, "residual", residual, "x", x);
  checks::same_dtype(op, "residual", residual, "x", x);
  checks::same_shape(op, "residual", residual, "x", x);
}

inline void check_add_rms_norm_backward(const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum,
                                        const at::Tensor& sum, const std::optional<at::Tensor>& weight,
                                        const at::Tensor& rstd) {
  constexpr const char* op = "customops::_add_rms_norm_backward";
  check_rms_norm_backward(grad_y, sum, weight, rstd, op, "sum");
  if (grad_sum.has_value() && grad_sum->defined()) {
    checks::same_device(op, "grad_sum", *grad_sum, "sum", sum);
    checks::same_dtype(op, "grad_sum", *grad_sum, "sum", sum);
    checks::same_shape(op, "grad_sum", *grad_sum, "sum", sum);
  }
}

inline void check_unary(const char* op, const at::Tensor& x) { checks::float_dtype(op, "x", x); }

inline void check_grad_like(const char* op, const at::Tensor& grad_y, const char* name, const at::Tensor& x) {
  checks::float_dtype(op, "grad_y", grad_y);
  checks::same_device(op, "grad_y", grad_y, name, x);
  checks::same_dtype(op, "grad_y", grad_y, name, x);
  checks::same_shape(op, "grad_y", grad_y, name, x);
}

inline void check_silu_mul(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  checks::float_dtype(op, "gate", gate);
  checks::float_dtype(op, "up", up);
  checks::same_device(op, "up", up, "gate", gate);
  checks::same_dtype(op, "up", up, "gate", gate);
  checks::same_shape(op, "up", up, "gate", gate);
}

// swiglu's x holds gate and up side by side in its last dim.
inline void check_swiglu(const char* op, const at::Tensor& x) {
  checks::float_dtype(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (gate and up are the halves of its last), "
              "but it is a scalar");
  TORCH_SYM_CHECK((x.sym_size(-1) % 2).sym_eq(0), op, ": x's last dimension holds gate and up side by side, so its ",
                  "size must be even, but x has shape ", x.sym_sizes());
}

inline void check_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x) {
  constexpr const char* op = "customops::_swiglu_backward";
  check_swiglu(op, x);
  checks::float_dtype(op, "grad_y", grad_y);
  checks::same_device(op, "grad_y", grad_y, "x", x);
  checks::same_dtype(op, "grad_y", grad_y, "x", x);
  bool same_rank = grad_y.dim() == x.dim();
  TORCH_CHECK(same_rank, op, ": expected grad_y of shape x.shape[:-1] + [x.shape[-1] / 2] (x: ", x.sym_sizes(),
              "), but got ", grad_y.sym_sizes());
  for (int64_t i = 0; i < x.dim(); ++i) {
    const c10::SymInt want = i == x.dim() - 1 ? x.sym_size(i) / 2 : x.sym_size(i);
    TORCH_SYM_CHECK(grad_y.sym_size(i).sym_eq(want), op, ": expected grad_y of shape x.shape[:-1] + [x.shape[-1] / 2] (x: ",
                    x.sym_sizes(), "), but got ", grad_y.sym_sizes());
  }
}

inline void check_scale_clamp(const char* op, const at::Tensor& x, double lo, double hi) {
  checks::float_dtype(op, "x", x);
  TORCH_CHECK(lo <= hi, op, ": expected lo <= hi, but got lo=", lo, " and hi=", hi);
}

// t as an optional argument: nullopt when undefined.
std::optional<at::Tensor> optional_defined(const at::Tensor& t);

// vmap of a norm with a per-entry weight (cpp/ops/rms_norm.cpp): rows [B, ..., D] times w [B, D]
// in rows' dtype; and each entry's weight gradient, the sum of gy * x * rstd over its rows.
at::Tensor scale_rows(const at::Tensor& rows, at::Tensor w);
at::Tensor per_entry_weight_grad(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& rstd,
                                 at::ScalarType w_dtype);

// Typed calls of the private backward ops, through the dispatcher.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const std::optional<at::Tensor>& weight,
                                                     const at::Tensor& rstd, std::array<bool, 2> output_mask);
at::Tensor silu_backward(const at::Tensor& grad_y, const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_y, const at::Tensor& gate,
                                                     const at::Tensor& up);
at::Tensor swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x);
at::Tensor scale_clamp_backward(const at::Tensor& grad_y, const at::Tensor& x, double scale, double lo, double hi);

}  // namespace customops
