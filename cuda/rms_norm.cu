// CUDA kernels of rms_norm, add_rms_norm and their backward ops. 16-byte loads; every load of a
// row is issued before any math on it. add_rms_norm is rms_norm of sum = x + residual: the
// forward also reads residual and writes sum (rounded to x's dtype, and normalized as rounded);
// its backward adds the gradient that reached sum directly to dx in the same write.
// - Forward: one block per row (about 256 threads), each thread holding K vectors of the row in
//   registers, so the row is read once; the hardware keeps several rows per SM in flight while
//   others reduce. Rows longer than 1024 threads x 8 vectors take a loop kernel that reads them twice.
// - Backward: one wave of blocks, grid-stride over rows. dy and x (and add_rms_norm's gradient of
//   sum) of a row wait in a ring of rows in shared memory, filled by cp.async rows ahead, so
//   loads never stop while a row reduces; rows whose ring does not fit (or unaligned rows) are
//   cached in registers instead (kCache vectors per thread) between the reduction and the write.
//   Each thread owns fixed columns in every row, so it accumulates their weight gradient without
//   atomics: in registers (ring kernel) or in shared memory (register kernel; element j of vector
//   i at [j * nv + i]: no bank conflicts); a column-tiled kernel, launched to wait on the backward
//   (sm_90+), sums the per-block partials. Rows whose accumulators fit neither use ATen for dw.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "cp_async.cuh"
#include "elementwise.cuh"
#include "ops/llm.h"
#include "pdl.cuh"

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

// W, the weight's element type, is T or (for half types) float.
template <typename T, typename W, int V, int K>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ w, T* __restrict__ y,
                        T* __restrict__ sum, at::opmath_type<T>* __restrict__ rstd, int64_t rows, int nv,
                        at::opmath_type<T> eps) {
  using A = at::opmath_type<T>;
  using P = Pack<T, V>;
  using PW = Pack<W, V>;
  __shared__ A red[32];
  const PW* wp = reinterpret_cast<const PW*>(w);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P* xr = reinterpret_cast<const P*>(x) + r * nv;
    P xv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < nv) xv[k] = xr[i];
    }
    if (res != nullptr) {  // add_rms_norm: normalize sum = x + res, rounded as it is stored
      const P* rr = reinterpret_cast<const P*>(res) + r * nv;
      P rv[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) rv[k] = rr[i];
      }
      P* sr = reinterpret_cast<P*>(sum) + r * nv;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) {
#pragma unroll
          for (int j = 0; j < V; ++j) xv[k].v[j] = static_cast<T>(static_cast<A>(xv[k].v[j]) + static_cast<A>(rv[k].v[j]));
          sr[i] = xv[k];
        }
      }
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
          const PW wv = wp[i];
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

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// ---- backward ----------------------------------------------------------------------------------

constexpr int kCache = 4;  // backward: vectors of each row tensor per thread kept in registers

// Backward, one block per row at a time (grid-stride over rows).
// dx = rstd * (w*dy) - x * rstd^3 / n * sum(w*dy*x); dw_partial[block] += dy * x * rstd.
// The row's dy and x (and add_rms_norm's gradient of sum, dadd, added to dx) stay in registers
// (up to kCache vectors per thread) between the reduction and the write: every load of that part
// of the row is issued before the reduction, so the write waits on none. dw accumulators: shared
// memory, element j of vector i at [j * nv + i], so a warp's 32 threads touch 32 consecutive words
// (no bank conflicts); each thread owns its columns in every row the block visits, so no atomics.
// In-row indices are 32-bit (the launch checks that a row has fewer than 2^31 vectors).
template <typename T, typename W, int V, int kCache>
__global__ void __launch_bounds__(512) rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                                    const at::opmath_type<T>* __restrict__ rstd, const T* __restrict__ dadd,
                                    T* __restrict__ dx, at::opmath_type<T>* __restrict__ dw_partial, int64_t rows,
                                    int64_t n) {
  cuda::launch_dependents();  // sum_partials_kernel may take the SMs this wave leaves idle
  using A = at::opmath_type<T>;
  using P = Pack<T, V>;
  using PW = Pack<W, V>;
  extern __shared__ unsigned char smem_raw[];
  A* red = reinterpret_cast<A*>(smem_raw);
  A* dw_acc = red + 32;  // n accumulators when dw_partial != nullptr
  const int nv = static_cast<int>(n / V);
  const int tid = threadIdx.x, nt = blockDim.x;
  const PW* wp = reinterpret_cast<const PW*>(w);
  const bool with_dx = dx != nullptr, with_add = dadd != nullptr && dx != nullptr;
  if (dw_partial != nullptr) {
    for (int c = tid; c < nv * V; c += nt) dw_acc[c] = 0;
    __syncthreads();  // zeroed in a different thread-to-column mapping than they are accumulated
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P* dyr = reinterpret_cast<const P*>(dy + r * n);
    const P* xr = reinterpret_cast<const P*>(x + r * n);
    const P* ar = with_add ? reinterpret_cast<const P*>(dadd + r * n) : nullptr;
    const A rs = rstd[r];
    P gc[kCache], xc[kCache], ac[kCache];
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int i = tid + k * nt;
      if (i < nv) {
        gc[k] = dyr[i];
        xc[k] = xr[i];
        if (with_add) ac[k] = ar[i];
      }
    }
    A coef = 0;
    if (with_dx) {
      A s = 0;
      auto dot = [&](int i, const P& g, const P& xv) {
        PW wv;
        if (wp != nullptr) wv = wp[i];
#pragma unroll
        for (int j = 0; j < V; ++j) s += A(g.v[j]) * (wp != nullptr ? A(wv.v[j]) : A(1)) * A(xv.v[j]);
      };
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int i = tid + k * nt;
        if (i < nv) dot(i, gc[k], xc[k]);
      }
      for (int i = tid + kCache * nt; i < nv; i += nt) dot(i, dyr[i], xr[i]);
      coef = block_sum(s, red) * rs * rs * rs / A(n);
    }
    P* dxr = with_dx ? reinterpret_cast<P*>(dx + r * n) : nullptr;
    auto emit = [&](int i, const P& g, const P& xv, const P& da) {
      if (with_dx) {
        PW wv;
        P out;
        if (wp != nullptr) wv = wp[i];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const A gw = A(g.v[j]) * (wp != nullptr ? A(wv.v[j]) : A(1));
          out.v[j] = static_cast<T>(gw * rs - A(xv.v[j]) * coef + (with_add ? A(da.v[j]) : A(0)));
        }
        dxr[i] = out;
      }
      if (dw_partial != nullptr) {
        A* acc = dw_acc + i;
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j * nv] += A(g.v[j]) * A(xv.v[j]) * rs;
      }
    };
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int i = tid + k * nt;
      if (i < nv) emit(i, gc[k], xc[k], ac[k]);
    }
    for (int i = tid + kCache * nt; i < nv; i += nt) emit(i, dyr[i], xr[i], with_add ? ar[i] : P{});
  }
  if (dw_partial != nullptr) {
    __syncthreads();
    for (int c = tid; c < nv * V; c += nt) dw_partial[blockIdx.x * n + c] = dw_acc[(c % V) * nv + c / V];
  }
}

// Rows of the backward's ring in shared memory, and the most vectors of a row a thread of the ring
// kernel takes. Measured on an H100 (add_rms_norm, bf16, rows of 1024 to 16384): two stages beat
// three by up to 10% (more blocks fit an SM, and there are enough of them for the bytes in flight).
constexpr int kStages = 2;
constexpr int kRingVectors = 4;

// Backward through a ring of kStages rows in shared memory (16-byte vectors only): cp.async
// fetches rows r + G ... r + (kStages - 1) * G (G = gridDim.x) while the block reduces and writes
// row r, so HBM never waits for a reduction. Same math as rms_norm_bwd_kernel. Thread tid owns
// vectors tid + k * nt (k < K) of every row, so it keeps their dw in registers: measured against
// accumulators in shared memory (H100, add_rms_norm, bf16), within 1% at 32768x4096 and 4096x8192,
// 2-3% faster at 8192x2048 and 16384x1024, and 9% at 2048x16384, whose ring fits only without them.
// Each thread copies and reads only its own vectors of a row, so its cp_async_wait makes them
// visible to it; the row's rstd (copied by thread 0) is read after the reduction's barrier. The
// copy into a stage is issued after that barrier in the next row, when every thread has read it.
// Shared memory: [kStages][dy, x, dadd][nv] vectors, rstd[kStages], red[32].
template <typename T, typename W, int K>
__global__ void __launch_bounds__(512) rms_norm_bwd_ring_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                                    const at::opmath_type<T>* __restrict__ rstd, const T* __restrict__ dadd,
                                    T* __restrict__ dx, at::opmath_type<T>* __restrict__ dw_partial, int64_t rows,
                                    int64_t n) {
  cuda::launch_dependents();  // sum_partials_kernel may take the SMs this wave leaves idle
  using A = at::opmath_type<T>;
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  using PW = Pack<W, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const bool with_dx = dx != nullptr, with_add = dadd != nullptr && dx != nullptr, with_dw = dw_partial != nullptr;
  const int nv = static_cast<int>(n / V), tensors = with_add ? 3 : 2;
  const int tid = threadIdx.x, nt = blockDim.x;
  P* ring = reinterpret_cast<P*>(smem_raw);
  A* rs_ring = reinterpret_cast<A*>(ring + kStages * tensors * nv);
  A* red = rs_ring + kStages;
  const PW* wp = reinterpret_cast<const PW*>(w);
  A acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int j = 0; j < V; ++j) acc[k][j] = 0;
  }
  const int64_t G = gridDim.x;
  auto fetch = [&](int64_t r, int stage) {
    if (r < rows) {
      P* st = ring + stage * tensors * nv;
      const P* gs = reinterpret_cast<const P*>(dy + r * n);
      const P* xs = reinterpret_cast<const P*>(x + r * n);
      const P* as = with_add ? reinterpret_cast<const P*>(dadd + r * n) : nullptr;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = tid + k * nt;
        if (i < nv) {
          cuda::cp_async16(cuda::smem_addr(st + i), gs + i);
          cuda::cp_async16(cuda::smem_addr(st + nv + i), xs + i);
          if (with_add) cuda::cp_async16(cuda::smem_addr(st + 2 * nv + i), as + i);
        }
      }
      if (tid == 0) cuda::cp_async_ca<sizeof(A)>(cuda::smem_addr(rs_ring + stage), rstd + r);
    }
    cuda::cp_async_commit();  // empty past the last row, so every iteration waits on the same count
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) fetch(blockIdx.x + s * G, s);
  int stage = 0;
  for (int64_t r = blockIdx.x; r < rows; r += G) {
    cuda::cp_async_wait<kStages - 2>();  // row r's copies have landed
    const P* gr = ring + stage * tensors * nv;
    const P* xr = gr + nv;
    const P* ar = gr + 2 * nv;
    A s = 0;
    if (with_dx) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = tid + k * nt;
        if (i < nv) {
          const P g = gr[i], xv = xr[i];
          PW wv;
          if (wp != nullptr) wv = wp[i];
#pragma unroll
          for (int j = 0; j < V; ++j) s += A(g.v[j]) * (wp != nullptr ? A(wv.v[j]) : A(1)) * A(xv.v[j]);
        }
      }
      s = block_sum(s, red);  // its barriers also publish thread 0's rstd copy
    } else {
      __syncthreads();
    }
    // Every thread is past the previous row, so its stage takes the row kStages - 1 ahead.
    fetch(r + (kStages - 1) * G, (stage + kStages - 1) % kStages);
    const A rs = rs_ring[stage];
    const A coef = s * rs * rs * rs / A(n);
    P* dxr = with_dx ? reinterpret_cast<P*>(dx + r * n) : nullptr;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = tid + k * nt;
      if (i < nv) {
        const P g = gr[i], xv = xr[i];
        if (with_dx) {
          PW wv;
          P da, out;
          if (wp != nullptr) wv = wp[i];
          if (with_add) da = ar[i];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const A gw = A(g.v[j]) * (wp != nullptr ? A(wv.v[j]) : A(1));
            out.v[j] = static_cast<T>(gw * rs - A(xv.v[j]) * coef + (with_add ? A(da.v[j]) : A(0)));
          }
          dxr[i] = out;
        }
        if (with_dw) {
#pragma unroll
          for (int j = 0; j < V; ++j) acc[k][j] += A(g.v[j]) * A(xv.v[j]) * rs;
        }
      }
    }
    stage = (stage + 1) % kStages;
  }
  cuda::cp_async_wait<0>();
  if (with_dw) {
    using PA = Pack<A, V>;
    PA* out = reinterpret_cast<PA*>(dw_partial + blockIdx.x * n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = tid + k * nt;
      if (i < nv) {
        PA o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = acc[k][j];
        out[i] = o;
      }
    }
  }
}

// dw[c] = sum over b of partial[b, c]: 32 columns per block, kY threads summing each.
template <typename T, int kY>
__global__ void sum_partials_kernel(const at::opmath_type<T>* __restrict__ partial, T* __restrict__ dw, int blocks,
                                    int64_t n) {
  using A = at::opmath_type<T>;
  __shared__ A tile[kY][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  cuda::wait_prerequisites();
  A s = 0;
  if (c < n) {
#pragma unroll 4
    for (int b = threadIdx.y; b < blocks; b += kY) s += partial[b * n + c];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
#pragma unroll
    for (int k = 1; k < kY; ++k) s += tile[k][threadIdx.x];
    dw[c] = static_cast<T>(s);
  }
}

// ---- loop path: rows too long for registers; each row is read twice --------------------------------

// With res != nullptr, the first pass writes sum = x + res and the second reads it back (each
// thread its own elements).
template <typename T, typename W>
__global__ void rms_norm_fwd_loop_kernel(const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ w,
                                         T* __restrict__ y, T* __restrict__ sum, at::opmath_type<T>* __restrict__ rstd,
                                         int64_t rows, int64_t n, at::opmath_type<T> eps) {
  using A = at::opmath_type<T>;
  __shared__ A red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    A ss = 0;
    if (res != nullptr) {
      for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
        const T s = static_cast<T>(static_cast<A>(xr[c]) + static_cast<A>(res[r * n + c]));
        sum[r * n + c] = s;
        ss += static_cast<A>(s) * static_cast<A>(s);
      }
      xr = sum + r * n;
    } else {
      for (int64_t c = threadIdx.x; c < n; c += blockDim.x) ss += static_cast<A>(xr[c]) * static_cast<A>(xr[c]);
    }
    const A rs = A(1) / sqrt(block_sum(ss, red) / A(n) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      y[r * n + c] = static_cast<T>(static_cast<A>(xr[c]) * rs * (w != nullptr ? static_cast<A>(w[c]) : A(1)));
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

// 1 unless the weight, read V = kVec(T) elements at a time, is aligned for it.
template <typename T, typename W>
int weight_vec_width(int v, const W* w) {
  return w != nullptr && reinterpret_cast<uintptr_t>(w) % (sizeof(W) * v) != 0 ? 1 : v;
}

constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();

// The forward of rms_norm (res and sum undefined) and of add_rms_norm; checks are the caller's.
void rms_norm_forward(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, const at::Tensor& y,
                      const at::Tensor& sum, const at::Tensor& rstd, double eps) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  if (n == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());  // no mean square: rsqrt(mean([]) + eps)
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "customops::rms_norm", [&] {
   with_weight_type<scalar_t>(w, [&](auto w_tag) {
    using W = decltype(w_tag);
    using A = at::opmath_type<scalar_t>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const W* wp = w.defined() ? w.const_data_ptr<W>() : nullptr;
    const scalar_t* rp = res.defined() ? res.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = sum.defined() ? sum.mutable_data_ptr<scalar_t>() : nullptr;
    const int v = weight_vec_width<scalar_t>(vec_width<scalar_t>(n, {x.const_data_ptr(), y.const_data_ptr(), rp, sp}), wp);
    // add_rms_norm holds x and residual: at most 2 packs of each per thread (more threads instead),
    // which keeps the kernel within the 64 registers a 1024-thread block allows.
    const auto [k, threads] = row_split(n / v, rp != nullptr ? 2 : 8);
    const int64_t blocks = std::min(rows, kMaxGrid);
    auto stream = at::cuda::getCurrentCUDAStream();
    if (threads > 0) {
      with_vk<kVec, 8>(v, k, [&](auto V, auto K) {
        rms_norm_fwd_kernel<scalar_t, W, decltype(V)::value, decltype(K)::value><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
            x.const_data_ptr<scalar_t>(), rp, wp, y.mutable_data_ptr<scalar_t>(), sp, rstd.mutable_data_ptr<A>(), rows,
            static_cast<int>(n / decltype(V)::value), static_cast<A>(eps));
      });
    } else {
      rms_norm_fwd_loop_kernel<scalar_t, W><<<static_cast<unsigned>(blocks), 1024, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), rp, wp, y.mutable_data_ptr<scalar_t>(), sp, rstd.mutable_data_ptr<A>(), rows, n,
          static_cast<A>(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
   });
  });
}

at::Tensor empty_rstd(const at::Tensor& x) {
  return at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& weight,
                                                 double eps) {
  check_rms_norm("customops::rms_norm", x_in, weight);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options()), rstd = empty_rstd(x);
  rms_norm_forward(x, at::Tensor(), weight_or_undefined(weight), y, at::Tensor(), rstd, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x_in, const at::Tensor& residual,
                                                                 const std::optional<at::Tensor>& weight, double eps) {
  check_add_rms_norm("customops::add_rms_norm", x_in, residual, weight);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options()), rstd = empty_rstd(x);
  rms_norm_forward(x, residual.contiguous(), weight_or_undefined(weight), y, sum, rstd, eps);
  return {y, sum, rstd};
}

// The backward of rms_norm (dadd undefined) and of add_rms_norm; checks are the caller's.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_common(const at::Tensor& grad_y, const at::Tensor& x_in,
                                                            const std::optional<at::Tensor>& weight,
                                                            const at::Tensor& rstd_in, const at::Tensor& dadd_in,
                                                            std::array<bool, 2> mask) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_y.contiguous(), rstd = rstd_in.contiguous();
  const at::Tensor dadd = mask[0] && dadd_in.defined() ? dadd_in.contiguous() : at::Tensor();
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
   with_weight_type<scalar_t>(w, [&](auto w_tag) {
    using W = decltype(w_tag);
    using A = at::opmath_type<scalar_t>;
    const W* wp = w.defined() ? w.const_data_ptr<W>() : nullptr;
    scalar_t* dxp = mask[0] ? dx.mutable_data_ptr<scalar_t>() : nullptr;
    const scalar_t* dap = dadd.defined() ? dadd.const_data_ptr<scalar_t>() : nullptr;
    const int v = weight_vec_width<scalar_t>(
        vec_width<scalar_t>(n, {x.const_data_ptr(), dy.const_data_ptr(), dxp, dap}), wp);
    TORCH_CHECK(n / v < std::numeric_limits<int32_t>::max(), "customops::_rms_norm_backward: rows of ", n,
                " elements are not supported (at most 2^31 - 1 vectors of ", v, ")");
    auto stream = at::cuda::getCurrentCUDAStream();
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    constexpr int kVec = 16 / sizeof(scalar_t);
    const int64_t nv = n / v;
    // The ring kernel: 16-byte vectors, rows in shared memory, a thread per vector up to 512
    // (measured: 3-20% faster than two vectors a thread at rows of 1024 to 4096), at most
    // kRingVectors a thread. Otherwise the register kernel, whose dw accumulators live in shared
    // memory; rows too long for those leave dw to ATen.
    const int ring_threads = static_cast<int>(std::clamp<int64_t>((nv + 31) / 32 * 32, 32, 512));
    const int64_t ring_k = (nv + ring_threads - 1) / ring_threads;
    const size_t ring_smem =
        kStages * (dap != nullptr && dxp != nullptr ? 3 : 2) * n * sizeof(scalar_t) + (kStages + 32) * sizeof(A);
    const bool ring = v == kVec && ring_k <= kRingVectors && ring_smem <= prop->sharedMemPerBlockOptin;
    const bool dw_in_kernel = want_dw && (ring || (32 + n) * sizeof(A) <= prop->sharedMemPerBlockOptin);
    at::Tensor partial;
    int64_t blocks = 0;
    auto launch = [&](auto kernel, int threads, size_t smem) {
      if (smem > 48 * 1024) {
        cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
      }
      // One wave: as many blocks as the SMs hold at once (registers and shared memory permitting),
      // each looping over rows. Measured on an H100 (add_rms_norm, bf16, 32768x4096 and 4096x8192):
      // 3-8% faster than the former count (blocks for half the SM's thread slots, which at 128
      // registers a thread do not all fit: two waves), 32-35% faster than half a wave (fewer
      // weight-gradient partials to sum do not pay for the idle warps). Then as few blocks as give
      // every block the same number of rows: 4096 rows take 128 blocks of 32, not 132 of 31 or 32
      // (fewer partials, and the last row's wait is the same).
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      blocks = std::min<int64_t>(rows, int64_t{prop->multiProcessorCount} * std::max(per_sm, 1));
      const int64_t rows_per_block = (rows + blocks - 1) / blocks;
      blocks = (rows + rows_per_block - 1) / rows_per_block;
      partial = dw_in_kernel ? at::empty({blocks, n}, x.options().dtype(rstd.scalar_type())) : at::Tensor();
      kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), wp,
                                                        rstd.const_data_ptr<A>(), dap, dxp,
                                                        dw_in_kernel ? partial.mutable_data_ptr<A>() : nullptr, rows, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (ring && (dxp != nullptr || dw_in_kernel)) {
      auto ring_launch = [&](auto k_tag) {
        launch(rms_norm_bwd_ring_kernel<scalar_t, W, decltype(k_tag)::value>, ring_threads, ring_smem);
      };
      static_assert(kRingVectors == 4, "one instantiation per vector count below");
      if (ring_k == 1) {
        ring_launch(std::integral_constant<int, 1>{});
      } else if (ring_k == 2) {
        ring_launch(std::integral_constant<int, 2>{});
      } else {
        ring_launch(std::integral_constant<int, 4>{});
      }
    } else if (dxp != nullptr || dw_in_kernel) {
      // At most 512 threads, so the kernel's registers fit any GPU (longer rows loop past the cache).
      const int threads = static_cast<int>(std::clamp<int64_t>(((nv + kCache - 1) / kCache + 31) / 32 * 32, 32, 512));
      const size_t smem = (32 + (dw_in_kernel ? n : 0)) * sizeof(A);
      if (v == kVec) {
        launch(rms_norm_bwd_kernel<scalar_t, W, kVec, kCache>, threads, smem);
      } else {
        launch(rms_norm_bwd_kernel<scalar_t, W, 1, kCache>, threads, smem);
      }
    }
    if (dw_in_kernel) {
      // 32 threads a column: 8 left the sum latency-bound where there are many partials (8-15 us
      // of a 70 us backward at 8192x2048 and 16384x1024 on an H100; ATen's sum was no faster).
      // Launched programmatically dependent on the backward kernel (sm_90+), so it is resident
      // and waiting when the backward's last rows finish: with the even row split above, 3-5%
      // off add_rms_norm's backward at rows of 1024 to 8192 on an H100 (2% for this launch alone).
      cuda::launch_dependent(sum_partials_kernel<W, 32>, dim3(static_cast<unsigned>((n + 31) / 32)), dim3(32, 32), 0,
                             stream, partial.const_data_ptr<A>(), dw.mutable_data_ptr<W>(), static_cast<int>(blocks), n);
    } else if (want_dw) {
      const at::Tensor xhat = x.to(rstd.scalar_type()) * rstd.unsqueeze(-1);
      dw.copy_((dy.to(rstd.scalar_type()) * xhat).reshape({rows, n}).sum(0));
    }
   });
  });
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_rms_norm_backward(grad_y, x, weight, rstd);
  return rms_norm_backward_common(grad_y, x, weight, rstd, at::Tensor(), mask);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_cuda(const at::Tensor& grad_y,
                                                              const std::optional<at::Tensor>& grad_sum,
                                                              const at::Tensor& sum,
                                                              const std::optional<at::Tensor>& weight,
                                                              const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_add_rms_norm_backward(grad_y, grad_sum, sum, weight, rstd);
  return rms_norm_backward_common(grad_y, sum, weight, rstd, grad_sum.value_or(at::Tensor()), mask);
}

}  // namespace

// CUDA kernels of rms_norm and add_rms_norm.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("_rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
  m.impl("_add_rms_norm_backward", &add_rms_norm_backward_cuda);
}

}  // namespace customops
