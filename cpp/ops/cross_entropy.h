// Internal: argument checks of cross_entropy, _cross_entropy_backward and linear_cross_entropy,
// shared by the Meta, CPU and CUDA kernels; and the kernel-level entry points that
// linear_cross_entropy runs on each chunk of rows (no dispatcher call, gradients written in place).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>

#include "ops/checks.h"
#include "ops/llm.h"

namespace customops {

// loss and lse: float32 (float64 for float64 logits).
inline at::ScalarType cross_entropy_acc_dtype(at::ScalarType logits) { return rms_norm_acc_dtype(logits); }

inline void check_cross_entropy(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                double label_smoothing) {
  checks::float_dtype(op, "logits", logits);
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have at least one dimension (the classes, last), but it is a scalar");
  TORCH_SYM_CHECK(logits.sym_size(-1).sym_ge(1), op, ": logits must have at least one class (last dim), but has shape ",
                  logits.sym_sizes());
  checks::defined(op, "target", target);
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": expected target of dtype Long (int64) holding class indices, but got ",
              target.scalar_type());
  checks::same_device(op, "target", target, "logits", logits);
  bool rank_ok = target.dim() == logits.dim() - 1;
  TORCH_CHECK(rank_ok, op, ": expected target of shape logits.shape[:-1] (logits: ", logits.sym_sizes(), "), but got ",
              target.sym_sizes());
  for (int64_t i = 0; i < target.dim(); ++i) {
    TORCH_SYM_CHECK(target.sym_size(i).sym_eq(logits.sym_size(i)), op, ": expected target of shape logits.shape[:-1] (logits: ",
                    logits.sym_sizes(), "), but got ", target.sym_sizes());
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], but got ",
              label_smoothing);
}

// A per-row tensor (grad_loss, grad_lse, lse): shaped like target, of the accumulation dtype.
inline void check_per_row(const char* op, const char* name, const at::Tensor& t, const at::Tensor& logits,
                          const at::Tensor& target) {
  checks::defined(op, name, t);
  checks::same_device(op, name, t, "logits", logits);
  TORCH_CHECK(t.scalar_type() == cross_entropy_acc_dtype(logits.scalar_type()), op, ": expected ", name, " of dtype ",
              cross_entropy_acc_dtype(logits.scalar_type()), ", but got ", t.scalar_type());
  checks::same_shape(op, name, t, "target", target);
}

inline void check_cross_entropy_backward(const std::optional<at::Tensor>& grad_loss,
                                         const std::optional<at::Tensor>& grad_lse, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& lse, double label_smoothing) {
  constexpr const char* op = "customops::_cross_entropy_backward";
  check_cross_entropy(op, logits, target, label_smoothing);
  if (grad_loss.has_value() && grad_loss->defined()) check_per_row(op, "grad_loss", *grad_loss, logits, target);
  if (grad_lse.has_value() && grad_lse->defined()) check_per_row(op, "grad_lse", *grad_lse, logits, target);
  check_per_row(op, "lse", lse, logits, target);
}

inline void check_linear_cross_entropy(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                       const at::Tensor& target, const std::optional<at::Tensor>& bias,
                                       double label_smoothing, std::string_view reduction,
                                       std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  TORCH_CHECK(!tile_rows.has_value() || *tile_rows > 0, op, ": tile_rows must be positive, but got ", tile_rows.value_or(0));
  TORCH_CHECK(!tile_classes.has_value() || *tile_classes > 0, op, ": tile_classes must be positive, but got ",
              tile_classes.value_or(0));
  checks::float_dtype(op, "hidden", hidden);
  checks::float_dtype(op, "weight", weight);
  checks::same_dtype(op, "weight", weight, "hidden", hidden);
  checks::same_device(op, "weight", weight, "hidden", hidden);
  TORCH_CHECK(hidden.dim() == 2, op, ": expected hidden of shape [N, H], but got ", hidden.sym_sizes());
  TORCH_CHECK(weight.dim() == 2, op, ": expected weight of shape [V, H], but got ", weight.sym_sizes());
  TORCH_SYM_CHECK(weight.sym_size(1).sym_eq(hidden.sym_size(1)), op, ": expected weight of shape [V, H] with H = ",
                  hidden.sym_size(1), " (hidden's last dim), but got ", weight.sym_sizes());
  TORCH_SYM_CHECK(weight.sym_size(0).sym_ge(1), op, ": weight must have at least one row (class), but has shape ",
                  weight.sym_sizes());
  checks::defined(op, "target", target);
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": expected target of dtype Long (int64) holding class indices, but got ",
              target.scalar_type());
  checks::same_device(op, "target", target, "hidden", hidden);
  TORCH_CHECK(target.dim() == 1, op, ": expected target of shape [N] with N = ", hidden.sym_size(0), ", but got ",
              target.sym_sizes());
  TORCH_SYM_CHECK(target.sym_size(0).sym_eq(hidden.sym_size(0)), op, ": expected target of shape [N] with N = ",
                  hidden.sym_size(0), ", but got ", target.sym_sizes());
  if (bias.has_value() && bias->defined()) {
    checks::same_dtype(op, "bias", *bias, "hidden", hidden);
    checks::same_device(op, "bias", *bias, "hidden", hidden);
    TORCH_CHECK(bias->dim() == 1, op, ": expected bias of shape [V] with V = ", weight.sym_size(0), ", but got ",
                bias->sym_sizes());
    TORCH_SYM_CHECK(bias->sym_size(0).sym_eq(weight.sym_size(0)), op, ": expected bias of shape [V] with V = ",
                    weight.sym_size(0), ", but got ", bias->sym_sizes());
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], but got ",
              label_smoothing);
  TORCH_CHECK(reduction == "mean" || reduction == "sum", op, ": reduction must be \"mean\" or \"sum\", but got \"",
              reduction, "\"");
}

// The cross-entropy kernels of one device, called on 2-D tensors: logits [rows, width] (any row
// stride, unit last stride), target [rows] contiguous int64, per-row tensors 1-D of the
// accumulation dtype with any stride (0 too: one value for every row).
struct CrossEntropyKernels {
  // Writes loss[r] and lse[r] (contiguous, preallocated) of rows holding every class.
  void (*forward)(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                  const at::Tensor& loss, const at::Tensor& lse);
  // Writes grad_logits [rows, width] (any row stride, unit last stride); it may be logits itself
  // (each element is read before it is written). grad_loss or grad_lse may be undefined (zero).
  // The rows may hold a slice of the classes, [class_offset, class_offset + width) of n_classes
  // (linear_cross_entropy's vocabulary chunks): target and lse are the whole row's.
  void (*backward)(const at::Tensor& grad_loss, const at::Tensor& grad_lse, const at::Tensor& logits,
                   const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
                   int64_t class_offset, int64_t n_classes, const at::Tensor& grad_logits);
};

// Raises, naming op, when target holds a class outside [0, V) other than ignore_index. It reads
// target's values: CPU kernels call it (CUDA ones cannot without a device sync; they give NaN).
void check_target_range(const char* op, const at::Tensor& target, int64_t v, int64_t ignore_index);

// The cross-entropy kernels of each device (cpp/cpu/cross_entropy.cpp, cuda/cross_entropy.cu).
const CrossEntropyKernels& cross_entropy_kernels_cpu();
#ifdef CUSTOMOPS_WITH_CUDA
const CrossEntropyKernels& cross_entropy_kernels_cuda();
#endif

// linear_cross_entropy and _linear_cross_entropy_with_grads on a device whose cross-entropy
// kernels are ce (cpp/ops/linear_cross_entropy.cpp; the matmuls go through ATen).
at::Tensor linear_cross_entropy_impl(const CrossEntropyKernels& ce, const at::Tensor& hidden, const at::Tensor& weight,
                                     const at::Tensor& target, const std::optional<at::Tensor>& bias,
                                     int64_t ignore_index, double label_smoothing, c10::string_view reduction,
                                     std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grads_impl(
    const CrossEntropyKernels& ce, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing, c10::string_view reduction,
    std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes, std::array<bool, 3> output_mask);

}  // namespace customops
