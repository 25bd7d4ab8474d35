// Elementwise CUDA launcher shared by the customops kernels. Every tensor is seen as rows x cols
// with a contiguous last dimension and its own row stride, which covers contiguous tensors
// (one row) and the halves of a fused gate-up projection (row stride 2*cols) without a copy.
// Contiguous runs use 16-byte loads and stores; indices are 64-bit (tensors past 2^31 elements).
// The functor computes in at::opmath_type<T> (float for half types): f(const acc* in, acc* out).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <cstdint>

namespace customops::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int NIn, int NOut, typename T>
struct RowsArgs {
  const T* in[NIn];
  int64_t in_stride[NIn];
  T* out[NOut];
  int64_t out_stride[NOut];
  int64_t rows;
  int64_t cols;
};

template <int V, int NIn, int NOut, typename T, typename F>
__global__ void rows_kernel(RowsArgs<NIn, NOut, T> p, F f) {
  using acc_t = at::opmath_type<T>;
  const int64_t cols_v = p.cols / V;
  const int64_t total = p.rows * cols_v;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t r = p.rows == 1 ? 0 : i / cols_v;
    const int64_t c = (i - r * cols_v) * V;
    Pack<T, V> in[NIn];
#pragma unroll
    for (int k = 0; k < NIn; ++k) {
      in[k] = *reinterpret_cast<const Pack<T, V>*>(p.in[k] + r * p.in_stride[k] + c);
    }
    Pack<T, V> out[NOut];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      acc_t x[NIn];
      acc_t y[NOut];
#pragma unroll
      for (int k = 0; k < NIn; ++k) x[k] = static_cast<acc_t>(in[k].v[j]);
      f(x, y);
#pragma unroll
      for (int k = 0; k < NOut; ++k) out[k].v[j] = static_cast<T>(y[k]);
    }
#pragma unroll
    for (int k = 0; k < NOut; ++k) {
      *reinterpret_cast<Pack<T, V>*>(p.out[k] + r * p.out_stride[k] + c) = out[k];
    }
  }
}

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

// t itself when the launcher can read it in place, else a contiguous copy.
inline at::Tensor as_rows(const at::Tensor& t) {
  int64_t s;
  return is_row_view(t, s) ? t : t.contiguous();
}

// Runs f over tensors of one shape and dtype T. Inputs must satisfy is_row_view (use as_rows);
// outputs are contiguous tensors this library allocated.
template <typename T, int NIn, int NOut, typename F>
void launch_rows(F f, std::array<at::Tensor, NIn> in, std::array<at::Tensor, NOut> out) {
  const at::Tensor& ref = out[0];
  const int64_t numel = ref.numel();
  if (numel == 0) return;
  bool all_contiguous = true;
  for (auto& t : in) all_contiguous = all_contiguous && t.is_contiguous();
  RowsArgs<NIn, NOut, T> p;
  p.cols = all_contiguous || ref.dim() == 0 ? numel : ref.size(-1);
  p.rows = numel / p.cols;
  constexpr int kVec = 16 / sizeof(T);
  bool vec_ok = p.cols % kVec == 0;
  for (int k = 0; k < NIn; ++k) {
    int64_t s = p.cols;
    if (!all_contiguous) TORCH_INTERNAL_ASSERT(is_row_view(in[k], s));
    p.in[k] = in[k].template data_ptr<T>();
    p.in_stride[k] = s;
    vec_ok = vec_ok && s % kVec == 0 && reinterpret_cast<uintptr_t>(p.in[k]) % 16 == 0;
  }
  for (int k = 0; k < NOut; ++k) {
    p.out[k] = out[k].template data_ptr<T>();
    p.out_stride[k] = p.cols;
    vec_ok = vec_ok && reinterpret_cast<uintptr_t>(p.out[k]) % 16 == 0;
  }
  const int threads = 256;
  const int64_t work = vec_ok ? numel / kVec : numel;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((work + threads - 1) / threads, static_cast<int64_t>(sms) * 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (vec_ok) {
    rows_kernel<kVec, NIn, NOut, T><<<blocks, threads, 0, stream>>>(p, f);
  } else {
    rows_kernel<1, NIn, NOut, T><<<blocks, threads, 0, stream>>>(p, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace customops::cuda
