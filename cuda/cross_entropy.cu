// CUDA kernels of cross_entropy: the kernel-level entry points (cross_entropy_kernels_cuda) that
// the ops cross_entropy, _cross_entropy_backward and linear_cross_entropy run (cpp/ops). One block per row (grid-stride), 16-byte loads, four
// in flight per thread before any math; a row's few elements before its first 16-byte boundary
// and after its last whole pack go one by one, so every row start and every V get the packs.
// - Forward: one pass. Each thread keeps an online (max, sum of exp(x - max)) pair, rescaled once
//   per pack, and the sum of x (label smoothing); the block combines the pairs; the target's
//   logit is one more load, issued at the row's start.
// - Backward: one pass writing exp(x - lse) * (g_loss + g_lse) - g_loss * eps / V, the thread
//   that owns the target's element subtracting g_loss * (1 - eps) there. Every element is read
//   and written by the same thread, so the gradient may overwrite the logits in place.
// An out-of-range target (not ignore_index) cannot raise without a device sync: that row's loss
// and gradient are NaN, never a read out of bounds.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>

#include <cmath>
#include <limits>

#include "elementwise.cuh"
#include "ops/cross_entropy.h"

namespace customops {
namespace {

using cuda::Pack;
constexpr int kUnroll = 4;
// Threads per block at most (H100: best of 128 to 1024 at V of 32000 to 128256). Small blocks,
// many per SM, let some rows stream while others reduce or start; the backward, with twice the
// bytes per element, does best with 256.
constexpr int kFwdThreads = 128, kBwdThreads = 256;

// exp(x - m); for float the hardware's ex2 of (x - m) * log2(e), within 2 ulp like __expf
// (-inf gives 0, NaN stays NaN).
__device__ __forceinline__ float exp_minus(float x, float m) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"((x - m) * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ double exp_minus(double x, double m) { return exp(x - m); }

// (m, s): running max and sum of exp(x - m); a NaN logit makes s NaN. While m is -inf (every
// logit so far -inf) the exponentials subtract 0, so exp(-inf - -inf) is 0, not NaN.
template <typename A>
struct MaxSum {
  A m = -std::numeric_limits<A>::infinity(), s = 0;

  // Adds K values, rescaling s once for their max.
  template <int K>
  __device__ __forceinline__ void add(const A (&v)[K]) {
    A vm = v[0];
#pragma unroll
    for (int j = 1; j < K; ++j) vm = vm > v[j] ? vm : v[j];
    const A nm = m > vm ? m : vm, shift = isinf(nm) ? A(0) : nm;
    A e = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) e += exp_minus(v[j], shift);
    s = s * exp_minus(m, shift) + e;
    m = nm;
  }

  __device__ __forceinline__ void combine(A om, A os) {
    const A nm = m > om ? m : om, shift = isinf(nm) ? A(0) : nm;
    s = s * exp_minus(m, shift) + os * exp_minus(om, shift);
    m = nm;
  }

  // log(sum of exp(x)): +inf when a logit is +inf, -inf when all are -inf.
  __device__ __forceinline__ A lse() const { return isinf(m) ? m : m + log(s); }
};

// The block's combined (m, s) and sum of x, valid in thread 0. blockDim.x: a multiple of 32.
template <typename A>
__device__ void block_reduce(MaxSum<A>& ms, A& sx) {
  __shared__ A sm[32], ss[32], sxs[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ms.combine(__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o));
    sx += __shfl_xor_sync(0xffffffffu, sx, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // the shared arrays may still be read by the previous row's reduction
  if (lane == 0) {
    sm[warp] = ms.m;
    ss[warp] = ms.s;
    sxs[warp] = sx;
  }
  __syncthreads();
  if (warp == 0) {
    ms = lane < warps ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>{};
    sx = lane < warps ? sxs[lane] : A(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ms.combine(__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o));
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
    }
  }
}

// Elements of a row before its first 16-byte boundary (all of them when VEC == 1: no packs).
template <typename T, int VEC>
__device__ __forceinline__ int64_t head_of(const T* row, int64_t n) {
  if constexpr (VEC == 1) {
    return n;
  } else {
    const int64_t h = ((16 - reinterpret_cast<uintptr_t>(row) % 16) % 16) / sizeof(T);
    return h < n ? h : n;
  }
}

// Rows of n elements at row_stride: VEC-wide packs from the row's first 16-byte boundary, the
// elements before it and after the last pack one by one.
template <typename T, int VEC>
__global__ void __launch_bounds__(kFwdThreads) ce_fwd_kernel(const T* __restrict__ x, int64_t row_stride,
                                                             const int64_t* __restrict__ target, int64_t rows,
                                                             int64_t n, int64_t ignore_index, at::opmath_type<T> eps,
                                                             at::opmath_type<T>* __restrict__ loss,
                                                             at::opmath_type<T>* __restrict__ lse) {
  using A = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * row_stride;
    const int64_t t = target[r];
    const bool counted = t != ignore_index, in_range = t >= 0 && t < n;
    // Thread 0 reads the target's logit now; it is used after the reduction.
    const A xt = threadIdx.x == 0 && counted && in_range ? static_cast<A>(xr[t]) : A(0);
    const int64_t head = head_of<T, VEC>(xr, n), nv = (n - head) / VEC;
    const P* xp = reinterpret_cast<const P*>(xr + head);
    MaxSum<A> ms;
    A sx = 0;
    for (int64_t i0 = threadIdx.x; i0 < nv; i0 += int64_t{blockDim.x} * kUnroll) {
      P v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * blockDim.x;
        if (i < nv) v[u] = xp[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + int64_t{u} * blockDim.x < nv) {
          A a[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            a[j] = static_cast<A>(v[u].v[j]);
            sx += a[j];
          }
          ms.add(a);
        }
      }
    }
    for (int64_t k = threadIdx.x; k < n - nv * VEC; k += blockDim.x) {
      const int64_t c = k < head ? k : k + nv * VEC;
      const A a[1] = {static_cast<A>(xr[c])};
      sx += a[0];
      ms.add(a);
    }
    block_reduce(ms, sx);
    if (threadIdx.x == 0) {
      const A l = ms.lse();
      lse[r] = l;
      A out = 0;
      if (counted) {
        // eps == 0 drops the smoothing term: 0 * sum_x is NaN when a logit is -inf.
        out = in_range ? l - (A(1) - eps) * xt - (eps == A(0) ? A(0) : eps * sx / A(n))
                       : std::numeric_limits<A>::quiet_NaN();
      }
      loss[r] = out;
    }
  }
}

// g, h: per-row loss and lse gradients (nullptr: zero) with their strides (0: one for all rows).
// The n columns are classes [offset, offset + n) of n_classes. With VEC > 1, every row of x
// and dx has the same offset from a 16-byte boundary.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBwdThreads) ce_bwd_kernel(
    const at::opmath_type<T>* __restrict__ g, int64_t g_stride, const at::opmath_type<T>* __restrict__ h,
    int64_t h_stride, const T* x, int64_t x_stride, const int64_t* __restrict__ target,
    const at::opmath_type<T>* __restrict__ lse, int64_t rows, int64_t n, int64_t offset, int64_t n_classes,
    int64_t ignore_index, at::opmath_type<T> eps, T* dx, int64_t dx_stride) {
  // x and dx may be the same memory (in place): no __restrict__ on them.
  using A = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    T* dr = dx + r * dx_stride;
    const int64_t t = target[r], local = t - offset;  // local: the target's column, if in [0, n)
    const bool counted = t != ignore_index;
    const bool bad = counted && (t < 0 || t >= n_classes);
    const A gl = counted && g != nullptr ? g[r * g_stride] : A(0);
    const A p_scale = bad ? std::numeric_limits<A>::quiet_NaN() : gl + (h != nullptr ? h[r * h_stride] : A(0));
    const A uniform = gl * eps / A(n_classes), at_target = gl * (A(1) - eps), l = lse[r];
    const int64_t head = head_of<T, VEC>(xr, n), nv = (n - head) / VEC;
    // The pack holding the target's column (-1: none) and the column's place in it.
    const int64_t in_packs = local - head;
    const int64_t tp = in_packs >= 0 && in_packs < nv * VEC ? in_packs / VEC : -1;
    const int tj = static_cast<int>(in_packs - tp * VEC);
    const P* xp = reinterpret_cast<const P*>(xr + head);
    P* dp = reinterpret_cast<P*>(dr + head);
    for (int64_t i0 = threadIdx.x; i0 < nv; i0 += int64_t{blockDim.x} * kUnroll) {
      P v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * blockDim.x;
        if (i < nv) v[u] = xp[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * blockDim.x;
        if (i < nv) {
          A y[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) y[j] = exp_minus(static_cast<A>(v[u].v[j]), l) * p_scale - uniform;
          if (i == tp) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) y[j] -= j == tj ? at_target : A(0);
          }
          P o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) o.v[j] = static_cast<T>(y[j]);
          dp[i] = o;
        }
      }
    }
    for (int64_t k = threadIdx.x; k < n - nv * VEC; k += blockDim.x) {
      const int64_t c = k < head ? k : k + nv * VEC;
      const A y = exp_minus(static_cast<A>(xr[c]), l) * p_scale - uniform;
      dr[c] = static_cast<T>(c == local ? y - at_target : y);
    }
  }
}

constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();

// Threads for rows of nv packs: about kUnroll packs each, a multiple of 32, at most max_threads.
int threads_for(int64_t nv, int max_threads) {
  return static_cast<int>(std::clamp<int64_t>((nv / kUnroll + 31) / 32 * 32, 32, max_threads));
}

// f(std::integral_constant<int, VEC>): VEC = 16 / sizeof(T) (16-byte packs) when vector, else 1.
template <typename T, typename F>
void with_vec(bool vector, F&& f) {
  if (vector) {
    f(std::integral_constant<int, 16 / sizeof(T)>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

void forward_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double eps,
                  const at::Tensor& loss, const at::Tensor& lse) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  if (rows == 0) return;
  c10::cuda::CUDAGuard guard(logits.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "customops::cross_entropy", [&] {
    using A = at::opmath_type<scalar_t>;
    constexpr int V = 16 / sizeof(scalar_t);
    ce_fwd_kernel<scalar_t, V><<<static_cast<unsigned>(std::min(rows, kMaxGrid)), threads_for(n / V, kFwdThreads), 0,
                                 at::cuda::getCurrentCUDAStream()>>>(
        logits.const_data_ptr<scalar_t>(), logits.stride(0), target.const_data_ptr<int64_t>(), rows, n, ignore_index,
        static_cast<A>(eps), loss.mutable_data_ptr<A>(), lse.mutable_data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void backward_cuda(const at::Tensor& grad_loss, const at::Tensor& grad_lse, const at::Tensor& logits,
                   const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index, double eps,
                   int64_t class_offset, int64_t n_classes, const at::Tensor& grad_logits) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  if (rows == 0) return;
  c10::cuda::CUDAGuard guard(logits.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "customops::_cross_entropy_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    // Packs need every row of logits and grad_logits at the same offset from a 16-byte boundary.
    const auto apart = reinterpret_cast<uintptr_t>(logits.const_data_ptr()) -
                       reinterpret_cast<uintptr_t>(grad_logits.const_data_ptr());
    const int64_t stride_apart = (logits.stride(0) - grad_logits.stride(0)) * static_cast<int64_t>(sizeof(scalar_t));
    with_vec<scalar_t>(apart % 16 == 0 && (rows == 1 || stride_apart % 16 == 0), [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      ce_bwd_kernel<scalar_t, V><<<static_cast<unsigned>(std::min(rows, kMaxGrid)), threads_for(n / V, kBwdThreads), 0,
                                   at::cuda::getCurrentCUDAStream()>>>(
          grad_loss.defined() ? grad_loss.const_data_ptr<A>() : nullptr, grad_loss.defined() ? grad_loss.stride(0) : 0,
          grad_lse.defined() ? grad_lse.const_data_ptr<A>() : nullptr, grad_lse.defined() ? grad_lse.stride(0) : 0,
          logits.const_data_ptr<scalar_t>(), logits.stride(0), target.const_data_ptr<int64_t>(), lse.const_data_ptr<A>(),
          rows, n, class_offset, n_classes, ignore_index, static_cast<A>(eps), grad_logits.data_ptr<scalar_t>(),
          grad_logits.stride(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

const CrossEntropyKernels& cross_entropy_kernels_cuda() {
  static const CrossEntropyKernels k{&forward_cuda, &backward_cuda};
  return k;
}

}  // namespace customops
