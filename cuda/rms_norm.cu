// CUDA kernels of rms_norm and _rms_norm_backward. 16-byte loads; a few threads per row, each
// keeping up to kCache vectors of it in registers between the reduction and the write, so a row
// is read from memory once. Forward: one block per row. Backward: grid-stride over rows. The weight gradient is accumulated per block in shared memory over all the rows that
// block visits (each thread owns fixed columns, so no atomics), then one small kernel sums the
// per-block partials: fast for tall (many rows) and wide (long rows) shapes alike.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "elementwise.cuh"
#include "ops/llm.h"

namespace customops {
namespace {

using cuda::Pack;

// Sum of v over the block; every thread gets the total. red: >= 32 elements of shared memory.
template <typename A>
__device__ A block_sum(A v, A* red) {
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

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

constexpr int kCache = 4;  // vectors per thread kept in registers between the two passes

template <typename T, int V>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                    at::opmath_type<T>* __restrict__ rstd, int64_t rows, int64_t n,
                                    at::opmath_type<T> eps) {
  using A = at::opmath_type<T>;
  __shared__ A red[32];
  const int64_t nv = n / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    Pack<T, V> cache[kCache], wcache[kCache];
    A ss = 0;
    // Every load first, then the math: a load used right away would wait a full memory round
    // trip before the next one is issued.
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < nv) {
        cache[k] = load<T, V>(xr + i * V);
        if (w != nullptr) wcache[k] = load<T, V>(w + i * V);
      }
    }
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) ss += A(cache[k].v[j]) * A(cache[k].v[j]);
      }
    }
    for (int64_t i = threadIdx.x + static_cast<int64_t>(kCache) * blockDim.x; i < nv; i += blockDim.x) {
      const auto p = load<T, V>(xr + i * V);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += A(p.v[j]) * A(p.v[j]);
    }
    const A rs = A(1) / sqrt(block_sum(ss, red) / A(n) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    T* yr = y + r * n;
    auto write = [&](int64_t i, const Pack<T, V>& p, const Pack<T, V>& pw) {
      Pack<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        out.v[j] = static_cast<T>(w != nullptr ? A(p.v[j]) * rs * A(pw.v[j]) : A(p.v[j]) * rs);
      }
      store<T, V>(yr + i * V, out);
    };
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < nv) write(i, cache[k], wcache[k]);
    }
    for (int64_t i = threadIdx.x + static_cast<int64_t>(kCache) * blockDim.x; i < nv; i += blockDim.x) {
      write(i, load<T, V>(xr + i * V), w != nullptr ? load<T, V>(w + i * V) : Pack<T, V>{});
    }
  }
}

// dx = rstd * (w*dy) - x * rstd^3 / n * sum(w*dy*x); dw_partial[block] += dy * x * rstd.
// The row's dy and x stay in registers (up to kCache vectors per thread) between the reduction
// and the write. dw accumulators: shared memory, element j of vector i at [j * nv + i], so a
// warp's 32 threads touch 32 consecutive words (no bank conflicts); each thread owns its columns
// in every row the block visits, so no atomics.
template <typename T, int V>
__global__ void rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                    const at::opmath_type<T>* __restrict__ rstd, T* __restrict__ dx,
                                    at::opmath_type<T>* __restrict__ dw_partial, int64_t rows, int64_t n) {
  using A = at::opmath_type<T>;
  extern __shared__ unsigned char smem_raw[];
  A* red = reinterpret_cast<A*>(smem_raw);
  A* dw_acc = red + 32;  // n accumulators when dw_partial != nullptr
  const int64_t nv = n / V;
  if (dw_partial != nullptr) {
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) dw_acc[c] = 0;
    __syncthreads();  // zeroed in a different thread-to-column mapping than they are accumulated
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* dyr = dy + r * n;
    const T* xr = x + r * n;
    const A rs = rstd[r];
    Pack<T, V> gc[kCache], xc[kCache];
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < nv) {
        gc[k] = load<T, V>(dyr + i * V);
        xc[k] = load<T, V>(xr + i * V);
      }
    }
    A coef = 0;
    if (dx != nullptr) {
      A s = 0;
      auto dot = [&](int64_t i, const Pack<T, V>& g, const Pack<T, V>& xv) {
        Pack<T, V> wv;
        if (w != nullptr) wv = load<T, V>(w + i * V);
#pragma unroll
        for (int j = 0; j < V; ++j) s += A(g.v[j]) * (w != nullptr ? A(wv.v[j]) : A(1)) * A(xv.v[j]);
      };
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (i < nv) dot(i, gc[k], xc[k]);
      }
      for (int64_t i = threadIdx.x + static_cast<int64_t>(kCache) * blockDim.x; i < nv; i += blockDim.x) {
        dot(i, load<T, V>(dyr + i * V), load<T, V>(xr + i * V));
      }
      coef = block_sum(s, red) * rs * rs * rs / A(n);
    }
    auto emit = [&](int64_t i, const Pack<T, V>& g, const Pack<T, V>& xv) {
      if (dx != nullptr) {
        Pack<T, V> wv, out;
        if (w != nullptr) wv = load<T, V>(w + i * V);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const A gw = A(g.v[j]) * (w != nullptr ? A(wv.v[j]) : A(1));
          out.v[j] = static_cast<T>(gw * rs - A(xv.v[j]) * coef);
        }
        store<T, V>(dx + r * n + i * V, out);
      }
      if (dw_partial != nullptr) {
#pragma unroll
        for (int j = 0; j < V; ++j) dw_acc[j * nv + i] += A(g.v[j]) * A(xv.v[j]) * rs;
      }
    };
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < nv) emit(i, gc[k], xc[k]);
    }
    for (int64_t i = threadIdx.x + static_cast<int64_t>(kCache) * blockDim.x; i < nv; i += blockDim.x) {
      emit(i, load<T, V>(dyr + i * V), load<T, V>(xr + i * V));
    }
  }
  if (dw_partial != nullptr) {
    __syncthreads();
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) dw_partial[blockIdx.x * n + c] = dw_acc[(c % V) * nv + c / V];
  }
}

template <typename T>
__global__ void sum_partials_kernel(const at::opmath_type<T>* __restrict__ partial, T* __restrict__ dw, int blocks,
                                    int64_t n) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  at::opmath_type<T> s = 0;
  for (int b = 0; b < blocks; ++b) s += partial[b * n + c];
  dw[c] = static_cast<T>(s);
}

// Threads per row: enough to hold the row in kCache vectors each (a multiple of
// 32, at most 1024); longer rows loop.
int cached_row_threads(int64_t nv) {
  const int64_t t = ((nv + kCache - 1) / kCache + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(t, 32, 1024));
}

template <typename T>
int vec_width(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (n % kVec != 0) return 1;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec;
}

at::Tensor weight_or_undefined(const std::optional<at::Tensor>& w) {
  return w.has_value() && w->defined() ? w->contiguous() : at::Tensor();
}

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
    const scalar_t* wp = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
    const int v = vec_width<scalar_t>(n, {x.const_data_ptr(), wp, y.const_data_ptr()});
    // Few threads per row, each caching up to kCache vectors: many rows per SM have their loads
    // in flight while others reduce, which a wide block per row (all threads waiting at the
    // reduction) does not give. One block per row; the hardware balances them.
    const int threads = cached_row_threads(n / v);
    const int64_t blocks = std::min<int64_t>(rows, std::numeric_limits<int32_t>::max());
    auto stream = at::cuda::getCurrentCUDAStream();
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (v == kVec) {
      rms_norm_fwd_kernel<scalar_t, kVec><<<blocks, threads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), wp, y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<A>(), rows, n,
          static_cast<A>(eps));
    } else {
      rms_norm_fwd_kernel<scalar_t, 1><<<blocks, threads, 0, stream>>>(
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
    const scalar_t* wp = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dxp = mask[0] ? dx.mutable_data_ptr<scalar_t>() : nullptr;
    const int v = vec_width<scalar_t>(n, {x.const_data_ptr(), dy.const_data_ptr(), wp, dxp});
    const int threads = cached_row_threads(n / v);
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    // Per-block dw accumulators live in shared memory; rows too long for it fall back to ATen.
    const size_t smem = (32 + (want_dw ? n : 0)) * sizeof(A);
    const bool dw_in_kernel = want_dw && smem <= prop->sharedMemPerBlockOptin;
    const size_t launch_smem = dw_in_kernel ? smem : 32 * sizeof(A);
    // Half the SM's threads: enough loads in flight, and half as many dw partials to write and sum
    // as full occupancy would give.
    const int64_t blocks = std::min<int64_t>(rows, std::max<int64_t>(1, cuda::max_resident_blocks(threads) / 2));
    at::Tensor partial = dw_in_kernel ? at::empty({blocks, n}, x.options().dtype(rstd.scalar_type())) : at::Tensor();
    auto stream = at::cuda::getCurrentCUDAStream();
    auto launch = [&](auto kernel) {
      if (launch_smem > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(launch_smem)));
      }
      kernel<<<blocks, threads, launch_smem, stream>>>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), wp,
                                                        rstd.const_data_ptr<A>(), dxp,
                                                        dw_in_kernel ? partial.mutable_data_ptr<A>() : nullptr, rows, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (dxp != nullptr || dw_in_kernel) {
      if (v == kVec) {
        launch(rms_norm_bwd_kernel<scalar_t, kVec>);
      } else {
        launch(rms_norm_bwd_kernel<scalar_t, 1>);
      }
    }
    if (dw_in_kernel) {
      const int t = 256;
      sum_partials_kernel<scalar_t><<<(n + t - 1) / t, t, 0, stream>>>(partial.const_data_ptr<A>(),
                                                                      dw.mutable_data_ptr<scalar_t>(),
                                                                      static_cast<int>(blocks), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (want_dw) {
      const at::Tensor xhat = x.to(rstd.scalar_type()) * rstd.unsqueeze(-1);
      dw.copy_((dy.to(rstd.scalar_type()) * xhat).reshape({rows, n}).sum(0));
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
