// CUDA kernels of rms_norm and _rms_norm_backward.
//
// Rows up to a few thousand vectors (every LLM hidden size) take the register path: a row is
// split over the threads of a block, each holding K 16-byte vectors of it in registers, so the
// row is read from memory once; every load of a row is issued before any math on it.
// - Forward: one block per row (about 256 threads); the hardware keeps several rows per SM in
//   flight while others reduce.
// - Backward: one wave of blocks, grid-stride over rows; the next row's dy and x are loaded
//   before the current row's reduction, so memory stays busy across it. Each thread owns fixed
//   columns in every row, so it accumulates their weight gradient in registers (no atomics); one
//   small kernel sums the per-block partials. Fast for tall (32768 x 4096) and wide (4096 x 8192)
//   shapes alike.
// Longer rows take a plain loop kernel that reads the row twice (and ATen ops for dw).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "elementwise.cuh"
#include "ops/llm.h"

namespace customops {
namespace {

using cuda::Pack;

// Sum of v over the block; every thread gets the total. red: >= 32 elements of shared memory.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? red[lane] : A(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- register path: nv <= K * blockDim.x vectors of V elements per row ----------------------------

template <typename T, int V, int K>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        at::opmath_type<T>* __restrict__ rstd, int64_t rows, int nv, at::opmath_type<T> eps) {
  using A = at::opmath_type<T>;
  using P = Pack<T, V>;
  __shared__ A red[32];
  const P* wp = reinterpret_cast<const P*>(w);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P* xr = reinterpret_cast<const P*>(x) + r * nv;
    P xv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nv) xv[k] = xr[i];
    }
    A ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + k * blockDim.x < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const A a = static_cast<A>(xv[k].v[j]);
          ss += a * a;
        }
      }
    }
    const A rs = A(1) / sqrt(block_sum(ss, red) / A(nv * V) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    P* yr = reinterpret_cast<P*>(y) + r * nv;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nv) {
        P o;
        if (wp != nullptr) {
          const P wv = wp[i];
#pragma unroll
          for (int j = 0; j < V; ++j) o.v[j] = static_cast<T>(static_cast<A>(xv[k].v[j]) * rs * static_cast<A>(wv.v[j]));
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) o.v[j] = static_cast<T>(static_cast<A>(xv[k].v[j]) * rs);
        }
        yr[i] = o;
      }
    }
  }
}

// dx = rstd * (w*dy) - x * rstd^3 / n * sum(w*dy*x); dw_partial[block] = sum over the block's rows of
// dy * x * rstd. dx and dw_partial may be null (not wanted).
template <typename T, int V, int K>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                        const at::opmath_type<T>* __restrict__ rstd, T* __restrict__ dx,
                        at::opmath_type<T>* __restrict__ dw_partial, int64_t rows, int nv) {
  using A = at::opmath_type<T>;
  using P = Pack<T, V>;
  __shared__ A red[32];
  const P* wp = reinterpret_cast<const P*>(w);
  P wv[K];
  A dw[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (wp != nullptr && i < nv) wv[k] = wp[i];
#pragma unroll
    for (int j = 0; j < V; ++j) dw[k][j] = 0;
  }
  P g[K], xv[K];
  int64_t r = blockIdx.x;
  if (r < rows) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nv) {
        g[k] = reinterpret_cast<const P*>(dy)[r * nv + i];
        xv[k] = reinterpret_cast<const P*>(x)[r * nv + i];
      }
    }
  }
  for (; r < rows; r += gridDim.x) {
    // The next row's loads go out now and land while this row reduces.
    const int64_t next = r + gridDim.x;
    P gn[K], xn[K];
    if (next < rows) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) {
          gn[k] = reinterpret_cast<const P*>(dy)[next * nv + i];
          xn[k] = reinterpret_cast<const P*>(x)[next * nv + i];
        }
      }
    }
    const A rs = rstd[r];
    if (dx != nullptr) {
      A s = 0;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (threadIdx.x + k * blockDim.x < nv) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const A gw = static_cast<A>(g[k].v[j]) * (wp != nullptr ? static_cast<A>(wv[k].v[j]) : A(1));
            s += gw * static_cast<A>(xv[k].v[j]);
          }
        }
      }
      const A coef = block_sum(s, red) * rs * rs * rs / A(nv * V);
      P* dxr = reinterpret_cast<P*>(dx) + r * nv;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) {
          P o;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const A gw = static_cast<A>(g[k].v[j]) * (wp != nullptr ? static_cast<A>(wv[k].v[j]) : A(1));
            o.v[j] = static_cast<T>(gw * rs - static_cast<A>(xv[k].v[j]) * coef);
          }
          dxr[i] = o;
        }
      }
    }
    if (dw_partial != nullptr) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int j = 0; j < V; ++j) dw[k][j] += static_cast<A>(g[k].v[j]) * static_cast<A>(xv[k].v[j]) * rs;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      g[k] = gn[k];
      xv[k] = xn[k];
    }
  }
  if (dw_partial != nullptr) {
    A* out = dw_partial + static_cast<int64_t>(blockIdx.x) * nv * V;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) out[i * V + j] = dw[k][j];
      }
    }
  }
}

// dw[c] = sum over b of partial[b, c]: 32 columns per block, 8 threads summing each.
template <typename T>
__global__ void sum_partials_kernel(const at::opmath_type<T>* __restrict__ partial, T* __restrict__ dw, int blocks,
                                    int64_t n) {
  using A = at::opmath_type<T>;
  __shared__ A tile[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (c < n) {
    for (int b = threadIdx.y; b < blocks; b += 8) s += partial[b * n + c];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
#pragma unroll
    for (int k = 1; k < 8; ++k) s += tile[k][threadIdx.x];
    dw[c] = static_cast<T>(s);
  }
}

// ---- loop path: rows too long for registers; each row is read twice --------------------------------

template <typename T>
__global__ void rms_norm_fwd_loop_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                         at::opmath_type<T>* __restrict__ rstd, int64_t rows, int64_t n,
                                         at::opmath_type<T> eps) {
  using A = at::opmath_type<T>;
  __shared__ A red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    A ss = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) ss += static_cast<A>(xr[c]) * static_cast<A>(xr[c]);
    const A rs = A(1) / sqrt(block_sum(ss, red) / A(n) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      y[r * n + c] = static_cast<T>(static_cast<A>(xr[c]) * rs * (w != nullptr ? static_cast<A>(w[c]) : A(1)));
    }
  }
}

template <typename T>
__global__ void rms_norm_dx_loop_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                        const at::opmath_type<T>* __restrict__ rstd, T* __restrict__ dx,
                                        int64_t rows, int64_t n) {
  using A = at::opmath_type<T>;
  __shared__ A red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* dyr = dy + r * n;
    const T* xr = x + r * n;
    const A rs = rstd[r];
    A s = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      s += static_cast<A>(dyr[c]) * (w != nullptr ? static_cast<A>(w[c]) : A(1)) * static_cast<A>(xr[c]);
    }
    const A coef = block_sum(s, red) * rs * rs * rs / A(n);
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const A gw = static_cast<A>(dyr[c]) * (w != nullptr ? static_cast<A>(w[c]) : A(1));
      dx[r * n + c] = static_cast<T>(gw * rs - static_cast<A>(xr[c]) * coef);
    }
  }
}

// ---- launch ----------------------------------------------------------------------------------------

template <typename T>
int vec_width(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (n % kVec != 0) return 1;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec;
}

// Vectors per thread (1, 2, 4 ... max_k) for about 256 threads per row, and the threads; 0 threads
// when the row does not fit in 1024 threads of max_k vectors.
std::pair<int, int> row_split(int64_t nv, int max_k) {
  int k = 1;
  while (k < max_k && (nv + k - 1) / k > 256) k *= 2;
  const int64_t threads = ((nv + k - 1) / k + 31) / 32 * 32;
  return {k, threads > 1024 ? 0 : static_cast<int>(threads)};
}

// Calls f(std::integral_constant<int, V>, std::integral_constant<int, K>) for the runtime v
// (kVec or 1) and k (1, 2, 4 ... kMaxK).
template <int kVec, int kMaxK, typename F>
void with_vk(int v, int k, F&& f) {
  auto with_k = [&](auto vc) {
    if (k == 1) {
      f(vc, std::integral_constant<int, 1>{});
    } else if (k == 2) {
      f(vc, std::integral_constant<int, 2>{});
    } else if (k == 4) {
      f(vc, std::integral_constant<int, 4>{});
    } else {
      if constexpr (kMaxK >= 8) f(vc, std::integral_constant<int, 8>{});
    }
  };
  if (v == kVec) {
    with_k(std::integral_constant<int, kVec>{});
  } else {
    with_k(std::integral_constant<int, 1>{});
  }
}

at::Tensor weight_or_undefined(const std::optional<at::Tensor>& w) {
  return w.has_value() && w->defined() ? w->contiguous() : at::Tensor();
}

constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();

std::tuple<at::Tensor, at::Tensor> rms_norm_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& weight,
                                                 double eps) {
  check_rms_norm("customops::rms_norm", x_in, weight);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = weight_or_undefined(weight);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd =
      at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())));
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  if (rows == 0) return {y, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "customops::rms_norm", [&] {
    using A = at::opmath_type<scalar_t>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const scalar_t* wp = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
    const int v = vec_width<scalar_t>(n, {x.const_data_ptr(), wp, y.const_data_ptr()});
    const auto [k, threads] = row_split(n / v, 8);
    const int64_t blocks = std::min(rows, kMaxGrid);
    auto stream = at::cuda::getCurrentCUDAStream();
    if (threads > 0) {
      with_vk<kVec, 8>(v, k, [&](auto V, auto K) {
        rms_norm_fwd_kernel<scalar_t, decltype(V)::value, decltype(K)::value><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
            x.const_data_ptr<scalar_t>(), wp, y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<A>(), rows,
            static_cast<int>(n / decltype(V)::value), static_cast<A>(eps));
      });
    } else {
      rms_norm_fwd_loop_kernel<scalar_t><<<static_cast<unsigned>(blocks), 1024, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), wp, y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<A>(), rows, n,
          static_cast<A>(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x_in,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd_in, std::array<bool, 2> mask) {
  check_rms_norm_backward(grad_y, x_in, weight, rstd_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_y.contiguous(), rstd = rstd_in.contiguous();
  const at::Tensor w = weight_or_undefined(weight);
  at::Tensor dx = mask[0] ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  const bool want_dw = mask[1] && w.defined();
  at::Tensor dw = want_dw ? at::empty(w.sizes(), w.options()) : at::empty({0}, x.options());
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  if (rows == 0 || (!mask[0] && !want_dw)) {
    if (want_dw) dw.zero_();
    return {dx, dw};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "customops::_rms_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const scalar_t* wp = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dxp = mask[0] ? dx.mutable_data_ptr<scalar_t>() : nullptr;
    const int v = vec_width<scalar_t>(n, {x.const_data_ptr(), dy.const_data_ptr(), wp, dxp});
    const auto [k, threads] = row_split(n / v, 4);  // two rows of K vectors in flight per thread
    auto stream = at::cuda::getCurrentCUDAStream();
    if (threads > 0) {
      with_vk<kVec, 4>(v, k, [&](auto V, auto K) {
        auto kernel = rms_norm_bwd_kernel<scalar_t, decltype(V)::value, decltype(K)::value>;
        int per_sm = 0;
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
        const int64_t blocks =
            std::min<int64_t>(rows, int64_t{std::max(per_sm, 1)} * at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
        at::Tensor partial = want_dw ? at::empty({blocks, n}, x.options().dtype(rstd.scalar_type())) : at::Tensor();
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), wp,
                                               rstd.const_data_ptr<A>(), dxp,
                                               want_dw ? partial.mutable_data_ptr<A>() : nullptr, rows,
                                               static_cast<int>(n / decltype(V)::value));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (want_dw) {
          sum_partials_kernel<scalar_t><<<static_cast<unsigned>((n + 31) / 32), dim3(32, 8), 0, stream>>>(
              partial.const_data_ptr<A>(), dw.mutable_data_ptr<scalar_t>(), static_cast<int>(blocks), n);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    } else {
      if (dxp != nullptr) {
        rms_norm_dx_loop_kernel<scalar_t><<<static_cast<unsigned>(std::min(rows, kMaxGrid)), 1024, 0, stream>>>(
            dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), wp, rstd.const_data_ptr<A>(), dxp, rows, n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (want_dw) {
        const at::Tensor xhat = x.to(rstd.scalar_type()) * rstd.unsqueeze(-1);
        dw.copy_((dy.to(rstd.scalar_type()) * xhat).reshape({rows, n}).sum(0));
      }
    }
  });
  return {dx, dw};
}

}  // namespace

// CUDA kernels of rms_norm.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("_rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace customops
