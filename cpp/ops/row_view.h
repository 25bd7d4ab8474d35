// Internal: tensors seen as rows x cols with a contiguous last dim and one stride between rows.
// Contiguous tensors are one row; the halves of a fused gate-up projection (x[..., :n] and
// x[..., n:]) are rows with stride 2n, so kernels read them in place. Shared by CPU and CUDA.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

namespace customops {

// True when t is rows x t.size(-1) with a contiguous last dim and one stride between rows.
inline bool is_row_view(const at::Tensor& t, int64_t& row_stride) {
  if (t.is_contiguous()) {
    row_stride = t.dim() == 0 ? 1 : t.size(-1);
    return true;
  }
  if (t.dim() < 2 || t.stride(-1) != 1) return false;
  row_stride = t.stride(-2);
  int64_t expect = row_stride;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != expect) return false;
    expect *= t.size(d);
  }
  return true;
}

// t itself when kernels can read it in place, else a contiguous copy.
inline at::Tensor as_rows(const at::Tensor& t) {
  int64_t s;
  return is_row_view(t, s) ? t : t.contiguous();
}

// The common rows x cols of some same-shaped row views (inputs) and contiguous outputs. When all
// inputs are contiguous everything is one row of numel elements.
template <size_t NIn, size_t NOut>
struct RowLayout {
  int64_t rows = 1, cols = 0;
  std::array<int64_t, NIn> in_stride{};
  std::array<int64_t, NOut> out_stride{};

  RowLayout(const std::array<at::Tensor, NIn>& in, const std::array<at::Tensor, NOut>& out) {
    const at::Tensor& ref = out[0];
    bool all_contiguous = true;
    for (const auto& t : in) all_contiguous = all_contiguous && t.is_contiguous();
    cols = (all_contiguous || ref.dim() == 0) ? ref.numel() : ref.size(-1);
    rows = cols == 0 ? 0 : ref.numel() / cols;
    for (size_t k = 0; k < NIn; ++k) {
      int64_t s = cols;
      if (!all_contiguous) TORCH_INTERNAL_ASSERT(is_row_view(in[k], s), "customops: input is not a row view");
      in_stride[k] = s;
    }
    for (size_t k = 0; k < NOut; ++k) {
      TORCH_INTERNAL_ASSERT(out[k].is_contiguous());
      out_stride[k] = cols;
    }
  }
};

}  // namespace customops
