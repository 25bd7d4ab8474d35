// Internal: fused_linear's argument checks (shared by its Meta, CPU and CUDA kernels) and its
// unfused path, which the CUDA kernel takes for inputs its matrix-vector kernel does not cover.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace customops {

enum class Prologue { kNone, kRmsNorm, kSwiglu };

// Checks every argument; returns the prologue named by `prologue`.
Prologue check_fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view prologue,
                            const std::optional<at::Tensor>& norm_weight,
                            const std::optional<at::Tensor>& weight_scale);

// prologue(x) by customops' rms_norm or swiglu op (x itself for none).
at::Tensor apply_prologue(Prologue p, const at::Tensor& x, const std::optional<at::Tensor>& norm_weight, double eps);

// customops' rms_norm or swiglu, then a linear layer, then the add: the kernels the fused op
// stands for, called one after another (below autograd).
// A quantized weight (weight_scale given) is dequantized in float32 (float64 for float64 x) and
// the product computed there, then rounded to x's dtype.
at::Tensor fused_linear_unfused(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                const std::optional<at::Tensor>& norm_weight, double eps,
                                const std::optional<at::Tensor>& weight_scale);

// CPU kernels of a quantized weight (cpp/cpu/quantized_linear.cpp), for a contiguous weight whose
// int4 groups are whole bytes (quantized_cpu_fit):
// - quantized_rows_cpu: the product of a few rows, in [rows, in_features] (any float dtype), read
//   from the codes as stored; the result [rows, out_features] in float32, the dequantized
//   product's sums in another order;
// - quantized_matmul_cpu: the product of many rows (prefill), the result [rows, out_features] in
//   float32: the weight dequantized a row at a time to float32 (bit for bit as the ATen
//   decomposition does; then rounded to bfloat16 or float16 x's dtype) into blocks of up to 512
//   output features, each multiplied by BLAS in x's dtype.
bool quantized_cpu_fit(const at::Tensor& weight, const at::Tensor& weight_scale);
at::Tensor quantized_rows_cpu(const at::Tensor& in, const at::Tensor& weight, const at::Tensor& weight_scale);
at::Tensor quantized_matmul_cpu(const at::Tensor& in, const at::Tensor& weight, const at::Tensor& weight_scale);

}  // namespace customops
