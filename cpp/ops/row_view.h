// Internal: tensors seen as rows x cols with a contiguous last dim and one stride between rows.
// Contiguous tensors are one row; the halves of a fused gate-up projection (x[..., :n] and
// x[..., n:]) are rows with stride 2n, so kernels read (and write) them in place. Shared by CPU
// and CUDA.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

namespace customops {

// True when t is rows x t.size(-1) with a contiguous last dim and one stride between rows. Dims
// of size 1 have no meaningful stride: the row stride is that of the innermost leading dim of
// size > 1 (x[..., :1] of a [2, 1, 2] tensor has strides (2, 1, 1) and rows 2 apart).
inline bool is_row_view(const at::Tensor& t, int64_t& row_stride) {
  if (t.is_contiguous()) {
    row_stride = t.dim() == 0 ? 1 : t.size(-1);
    return true;
  }
  if (t.dim() < 2 || (t.size(-1) != 1 && t.stride(-1) != 1)) return false;
  row_stride = t.size(-1);  // a single row: any stride will do
  int64_t expect = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (expect < 0) row_stride = expect = t.stride(d);
    if (t.stride(d) != expect) return false;
    expect *= t.size(d);
  }
  return true;
}

// t itself when kernels can read it in place, else a contiguous copy.
inline at::Tensor as_rows(const at::Tensor& t) {
  int64_t s;
  return is_row_view(t, s) ? t : t.contiguous();
}

// The two halves of t's last dim, t[..., :n] and t[..., n:] (n = t.size(-1) / 2): gate and up of
// a fused gate-up tensor, or the two gradients written into one. Row views when t is one.
inline std::array<at::Tensor, 2> halves(const at::Tensor& t) {
  const int64_t n = t.size(-1) / 2;
  return {t.narrow(-1, 0, n), t.narrow(-1, n, n)};
}

// The common rows x cols of some same-shaped row views (inputs, and outputs written in place).
// When all of them are contiguous everything is one row of numel elements.
template <size_t NIn, size_t NOut>
struct RowLayout {
  int64_t rows = 1, cols = 0;
  std::array<int64_t, NIn> in_stride{};
  std::array<int64_t, NOut> out_stride{};

  RowLayout(const std::array<at::Tensor, NIn>& in, const std::array<at::Tensor, NOut>& out) {
    const at::Tensor& ref = out[0];
    bool all_contiguous = true;
    for (const auto& t : in) all_contiguous = all_contiguous && t.is_contiguous();
    for (const auto& t : out) all_contiguous = all_contiguous && t.is_contiguous();
    cols = (all_contiguous || ref.dim() == 0) ? ref.numel() : ref.size(-1);
    rows = cols == 0 ? 0 : ref.numel() / cols;
    auto stride_of = [&](const at::Tensor& t) {
      int64_t s = cols;
      if (!all_contiguous) TORCH_INTERNAL_ASSERT(is_row_view(t, s), "customops: tensor is not a row view");
      return s;
    };
    for (size_t k = 0; k < NIn; ++k) in_stride[k] = stride_of(in[k]);
    for (size_t k = 0; k < NOut; ++k) out_stride[k] = stride_of(out[k]);
  }
};

}  // namespace customops
