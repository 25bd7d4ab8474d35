// Elementwise CUDA launcher shared by the customops kernels. Every tensor is seen as rows x cols
// with a contiguous last dimension and its own row stride (ops/row_view.h), which covers
// contiguous tensors (one row) and the halves of a fused gate-up projection without a copy.
// Contiguous runs use 16-byte loads and stores, several per thread; indices are 64-bit (tensors
// past 2^31 elements).
// The functor computes in at::opmath_type<T> (float for half types): f(const acc* in, acc* out).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <cstdint>

#include "ops/row_view.h"

namespace customops::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <size_t NIn, size_t NOut, typename T>
struct RowsArgs {
  const T* in[NIn];
  int64_t in_stride[NIn];
  T* out[NOut];
  int64_t out_stride[NOut];
  int64_t rows;
  int64_t cols;
};

// Each thread moves kUnroll packs of V elements per tensor, all loads issued before any math, so
// enough bytes are in flight to keep HBM busy; a block covers kThreads * kUnroll packs of one row
// (grid x: column tiles, grid y: rows), so no thread divides to find its row.
constexpr int kThreads = 128;
constexpr int kUnroll = 4;

template <int V, size_t NIn, size_t NOut, typename T, typename F>
__global__ void __launch_bounds__(kThreads) rows_kernel(RowsArgs<NIn, NOut, T> p, F f) {
  using acc_t = at::opmath_type<T>;
  const int64_t cols_v = p.cols / V;  // packs per row
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    Pack<T, V> in[kUnroll][NIn];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kThreads;
      if (c < cols_v) {
#pragma unroll
        for (size_t k = 0; k < NIn; ++k) {
          in[u][k] = *reinterpret_cast<const Pack<T, V>*>(p.in[k] + r * p.in_stride[k] + c * V);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kThreads;
      if (c >= cols_v) break;
      Pack<T, V> out[NOut];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        acc_t x[NIn];
        acc_t y[NOut];
#pragma unroll
        for (size_t k = 0; k < NIn; ++k) x[k] = static_cast<acc_t>(in[u][k].v[j]);
        f(x, y);
#pragma unroll
        for (size_t k = 0; k < NOut; ++k) out[k].v[j] = static_cast<T>(y[k]);
      }
#pragma unroll
      for (size_t k = 0; k < NOut; ++k) {
        *reinterpret_cast<Pack<T, V>*>(p.out[k] + r * p.out_stride[k] + c * V) = out[k];
      }
    }
  }
}

// Runs f over same-shaped tensors of dtype T, all of them row views (customops::as_rows): inputs,
// and outputs this library allocated (contiguous, or the halves of one tensor).
template <typename T, size_t NIn, size_t NOut, typename F>
void launch_rows(F f, const std::array<at::Tensor, NIn>& in, const std::array<at::Tensor, NOut>& out) {
  const int64_t numel = out[0].numel();
  if (numel == 0) return;
  const RowLayout<NIn, NOut> L(in, out);
  RowsArgs<NIn, NOut, T> p;
  p.rows = L.rows;
  p.cols = L.cols;
  constexpr int kVec = 16 / sizeof(T);
  bool vec_ok = p.cols % kVec == 0;
  for (size_t k = 0; k < NIn; ++k) {
    p.in[k] = in[k].template const_data_ptr<T>();
    p.in_stride[k] = L.in_stride[k];
    vec_ok = vec_ok && L.in_stride[k] % kVec == 0 && reinterpret_cast<uintptr_t>(p.in[k]) % 16 == 0;
  }
  for (size_t k = 0; k < NOut; ++k) {
    p.out[k] = out[k].template mutable_data_ptr<T>();
    p.out_stride[k] = L.out_stride[k];
    vec_ok = vec_ok && L.out_stride[k] % kVec == 0 && reinterpret_cast<uintptr_t>(p.out[k]) % 16 == 0;
  }
  const int64_t cols_v = vec_ok ? p.cols / kVec : p.cols;
  const dim3 grid(static_cast<unsigned>((cols_v + kThreads * kUnroll - 1) / (kThreads * kUnroll)),
                  static_cast<unsigned>(std::min<int64_t>(p.rows, 65535)));
  TORCH_INTERNAL_ASSERT(cols_v / (kThreads * kUnroll) < (int64_t{1} << 31), "customops: row too long for one grid");
  auto stream = at::cuda::getCurrentCUDAStream();
  if (vec_ok) {
    rows_kernel<kVec, NIn, NOut, T><<<grid, kThreads, 0, stream>>>(p, f);
  } else {
    rows_kernel<1, NIn, NOut, T><<<grid, kThreads, 0, stream>>>(p, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace customops::cuda
