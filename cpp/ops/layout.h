// Internal: the memory order of outputs shaped [B, H, S, D] (rope, attention), shared by the Meta
// and device kernels.
#pragma once

#include <ATen/ATen.h>

namespace customops {

// An empty tensor with t's sizes [B, H, S, D], dense in t's memory order: [B, S, H, D] when t's
// heads are inside its positions (t.stride(1) < t.stride(2), as for
// q_proj(x).view(B, S, H, D).transpose(1, 2)), else [B, H, S, D]. Attention kernels allocate their
// output in q's order, so keeping q in [B, S, H, D] order makes the attention output's
// transpose(1, 2) contiguous, and o_proj's [B, S, H * D] input a view rather than a copy. Ops
// whose outputs follow this rule carry the needs_fixed_stride_order tag, so Inductor keeps the
// order their inputs were traced with.
inline at::Tensor heads_layout_like(const at::Tensor& t, const at::TensorOptions& options) {
  const auto s = t.sym_sizes();
  if (t.sym_stride(1) < t.sym_stride(2)) {
    return at::empty_symint({s[0], s[2], s[1], s[3]}, options).transpose(1, 2);
  }
  return at::empty_symint(s, options);
}
inline at::Tensor heads_layout_like(const at::Tensor& t) { return heads_layout_like(t, t.options()); }

}  // namespace customops
