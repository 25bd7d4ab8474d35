// Internal: argument checks of muladd, muladd.out and mul, used by their Meta, CPU and CUDA
// kernels alike.
#pragma once

#include "ops/checks.h"

namespace customops {

inline void check_binary(const char* op, const at::Tensor& a, const at::Tensor& b) {
  checks::float_dtype(op, "a", a);
  checks::float_dtype(op, "b", b);
  checks::same_device(op, "b", b, "a", a);
  checks::same_dtype(op, "b", b, "a", a);
  checks::same_shape(op, "b", b, "a", a);
}

inline void check_muladd_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  constexpr const char* op = "customops::muladd.out";
  check_binary(op, a, b);
  checks::out_tensor(op, out, a, {{"a", &a}, {"b", &b}});
}

}  // namespace customops
