// Internal: argument checks of rope and _rope_backward, shared by the Meta, CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/checks.h"

namespace customops {

inline void check_rope(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin, const char* qname = "q", const char* kname = "k") {
  checks::float_dtype(op, qname, q);
  checks::defined(op, kname, k);
  checks::same_dtype(op, kname, k, qname, q);
  checks::same_device(op, kname, k, qname, q);
  TORCH_CHECK(q.dim() == 4, op, ": expected ", qname, " of shape [B, Hq, S, D], but got ", q.sym_sizes());
  TORCH_CHECK(k.dim() == 4, op, ": expected ", kname, " of shape [B, Hkv, S, D], but got ", k.sym_sizes());
  for (int64_t d : {0, 2, 3}) {
    TORCH_SYM_CHECK(k.sym_size(d).sym_eq(q.sym_size(d)), op, ": expected ", kname, " of shape [B, Hkv, S, D] with B, S and D of ",
                    qname, " ", q.sym_sizes(), ", but got ", k.sym_sizes());
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"cos", &cos}, {"sin", &sin}}) {
    checks::defined(op, name, *t);
    checks::same_dtype(op, name, *t, qname, q);
    checks::same_device(op, name, *t, qname, q);
    TORCH_CHECK(t->dim() == 2 || t->dim() == 3, op, ": expected ", name, " of shape [S, R] or [B, S, R], but got ",
                t->sym_sizes());
  }
  checks::same_shape(op, "sin", sin, "cos", cos);
  const c10::SymInt r = cos.sym_size(-1);
  TORCH_SYM_CHECK(cos.sym_size(-2).sym_eq(q.sym_size(2)), op, ": expected cos of shape [S, R] or [B, S, R] with S = ",
                  q.sym_size(2), " (", qname, ".shape[2]), but got ", cos.sym_sizes());
  TORCH_SYM_CHECK(r.sym_le(q.sym_size(3)), op, ": cos's last dim (", r, ", the rotated dims) must be at most D = ",
                  q.sym_size(3));
  TORCH_SYM_CHECK((r % 2).sym_eq(0), op, ": cos's last dim (", r, ", the rotated dims) must be even");
  if (cos.dim() == 3) {
    TORCH_SYM_CHECK(cos.sym_size(0).sym_eq(1).sym_or(cos.sym_size(0).sym_eq(q.sym_size(0))), op,
                    ": expected cos of shape [B, S, R] with B = 1 or ", q.sym_size(0), " (", qname, ".shape[0]), but got ",
                    cos.sym_sizes());
  }
}

inline void check_rope_backward(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& cos,
                                const at::Tensor& sin) {
  check_rope("customops::_rope_backward", grad_q, grad_k, cos, sin, "grad_q", "grad_k");
}

}  // namespace customops
