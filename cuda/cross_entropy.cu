// CUDA kernels of cross_entropy and _cross_entropy_backward, and the kernel-level entry points
// linear_cross_entropy runs on its chunks. One block per row (grid-stride), 16-byte loads, four
// in flight per thread before any math.
// - Forward: one pass. Each thread keeps an online (max, sum of exp(x - max)) pair and the sum
//   of x (label smoothing); the block combines the pairs; the target's logit is one more load.
// - Backward: one pass writing exp(x - lse) * (g_loss + g_lse) - g_loss * eps / V, the thread
//   that owns the target's element subtracting g_loss * (1 - eps) there. Every element is read
//   and written by the same thread, so the gradient may overwrite the logits in place.
// An out-of-range target (not ignore_index) cannot raise without a device sync: that row's loss
// and gradient are NaN, never a read out of bounds.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "elementwise.cuh"
#include "ops/cross_entropy.h"
#include "ops/row_view.h"

namespace customops {
namespace {

using cuda::Pack;
constexpr int kUnroll = 4;

template <typename A>
__device__ __forceinline__ A fast_exp(A x) {
  if constexpr (std::is_same_v<A, float>) {
    return __expf(x);  // ex2.approx: within 2 ulp over the range softmax uses (x <= 0)
  } else {
    return exp(x);
  }
}

// (m, s): running max and sum of exp(x - m); combining two keeps the larger max. m starts at the
// lowest finite value, not -inf, so -inf logits add exp(-inf) = 0 instead of exp(-inf + inf).
template <typename A>
struct MaxSum {
  A m, s;
};

template <typename A>
__device__ __forceinline__ MaxSum<A> combine(MaxSum<A> a, MaxSum<A> b) {
  const A m = a.m > b.m ? a.m : b.m;
  return {m, a.s * fast_exp(a.m - m) + b.s * fast_exp(b.m - m)};
}

// The block's combined (m, s) and sum of x; every thread gets them. blockDim.x: a multiple of 32.
template <typename A>
__device__ void block_reduce(MaxSum<A>& ms, A& sx) {
  __shared__ A sm[32], ss[32], sxs[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ms = combine(ms, MaxSum<A>{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)});
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
  ms = lane < warps ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>{std::numeric_limits<A>::lowest(), A(0)};
  sx = lane < warps ? sxs[lane] : A(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ms = combine(ms, MaxSum<A>{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)});
    sx += __shfl_xor_sync(0xffffffffu, sx, o);
  }
}

template <typename A>
__device__ __forceinline__ void accumulate(MaxSum<A>& ms, A& sx, A x) {
  if (x > ms.m) {
    ms.s = ms.s * fast_exp(ms.m - x) + A(1);
    ms.m = x;
  } else {
    ms.s += fast_exp(x - ms.m);
  }
  sx += x;
}

// Rows of V elements at row_stride; the first nv * VEC of a row in VEC-wide packs (row starts
// aligned to them), the rest one by one.
template <typename T, int VEC>
__global__ void __launch_bounds__(512) ce_fwd_kernel(const T* __restrict__ x, int64_t row_stride,
                                                     const int64_t* __restrict__ target, int64_t rows, int64_t n,
                                                     int64_t ignore_index, at::opmath_type<T> eps,
                                                     at::opmath_type<T>* __restrict__ loss,
                                                     at::opmath_type<T>* __restrict__ lse) {
  using A = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  const int64_t nv = n / VEC;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * row_stride;
    const P* xp = reinterpret_cast<const P*>(xr);
    MaxSum<A> ms{std::numeric_limits<A>::lowest(), A(0)};
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
#pragma unroll
          for (int j = 0; j < VEC; ++j) accumulate(ms, sx, static_cast<A>(v[u].v[j]));
        }
      }
    }
    for (int64_t c = nv * VEC + threadIdx.x; c < n; c += blockDim.x) accumulate(ms, sx, static_cast<A>(xr[c]));
    block_reduce(ms, sx);
    if (threadIdx.x == 0) {
      const A l = isinf(ms.m) ? ms.m : ms.m + log(ms.s);  // all -inf: lowest + log(0) = -inf
      lse[r] = l;
      const int64_t t = target[r];
      A out = 0;
      if (t != ignore_index) {
        out = (t < 0 || t >= n) ? std::numeric_limits<A>::quiet_NaN()
                                : l - (A(1) - eps) * static_cast<A>(xr[t]) - eps * sx / A(n);
      }
      loss[r] = out;
    }
  }
}

// g, h: per-row loss and lse gradients (nullptr: zero) with their strides (0: one for all rows).
// The n columns are classes [offset, offset + n) of n_classes.
template <typename T, int VEC>
__global__ void __launch_bounds__(512) ce_bwd_kernel(const at::opmath_type<T>* __restrict__ g, int64_t g_stride,
                                                     const at::opmath_type<T>* __restrict__ h, int64_t h_stride,
                                                     const T* x, int64_t x_stride, const int64_t* __restrict__ target,
                                                     const at::opmath_type<T>* __restrict__ lse, int64_t rows,
                                                     int64_t n, int64_t offset, int64_t n_classes, int64_t ignore_index,
                                                     at::opmath_type<T> eps, T* dx, int64_t dx_stride) {
  // x and dx may be the same memory (in place): no __restrict__ on them.
  using A = at::opmath_type<T>;
  using P = Pack<T, VEC>;
  const int64_t nv = n / VEC;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * x_stride;
    T* dr = dx + r * dx_stride;
    const int64_t t = target[r], local = t - offset;  // local: the target's column, if in [0, n)
    const bool counted = t != ignore_index;
    const bool bad = counted && (t < 0 || t >= n_classes);
    const A gl = counted && g != nullptr ? g[r * g_stride] : A(0);
    const A p_scale = bad ? std::numeric_limits<A>::quiet_NaN() : gl + (h != nullptr ? h[r * h_stride] : A(0));
    const A uniform = gl * eps / A(n_classes), at_target = gl * (A(1) - eps), l = lse[r];
    auto grad = [&](A xv, int64_t c) {
      return fast_exp(xv - l) * p_scale - uniform - (c == local ? at_target : A(0));
    };
    for (int64_t i0 = threadIdx.x; i0 < nv; i0 += int64_t{blockDim.x} * kUnroll) {
      P v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * blockDim.x;
        if (i < nv) v[u] = reinterpret_cast<const P*>(xr)[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * blockDim.x;
        if (i < nv) {
          P o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) o.v[j] = static_cast<T>(grad(static_cast<A>(v[u].v[j]), i * VEC + j));
          reinterpret_cast<P*>(dr)[i] = o;
        }
      }
    }
    for (int64_t c = nv * VEC + threadIdx.x; c < n; c += blockDim.x) dr[c] = static_cast<T>(grad(static_cast<A>(xr[c]), c));
  }
}

constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();

// Threads for rows of nv packs: up to 512, about four packs each, a multiple of 32.
int threads_for(int64_t nv) {
  return static_cast<int>(std::clamp<int64_t>((nv / kUnroll + 31) / 32 * 32, 32, 512));
}

// VEC when every row of t (and of out) starts 16-byte aligned, else 1.
template <typename T>
bool aligned_rows(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.stride(0) * sizeof(T)) % 16 == 0;
}

template <typename T, typename F>
void with_vec(bool aligned, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  if (aligned) {
    f(std::integral_constant<int, kVec>{});
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
    with_vec<scalar_t>(aligned_rows<scalar_t>(logits), [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      ce_fwd_kernel<scalar_t, V><<<static_cast<unsigned>(std::min(rows, kMaxGrid)), threads_for(n / V), 0,
                                   at::cuda::getCurrentCUDAStream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), target.const_data_ptr<int64_t>(), rows, n, ignore_index,
          static_cast<A>(eps), loss.mutable_data_ptr<A>(), lse.mutable_data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
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
    const bool aligned = aligned_rows<scalar_t>(logits) && aligned_rows<scalar_t>(grad_logits);
    with_vec<scalar_t>(aligned, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      ce_bwd_kernel<scalar_t, V><<<static_cast<unsigned>(std::min(rows, kMaxGrid)), threads_for(n / V), 0,
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

// logits as [rows, V] with a unit last stride (read in place when its rows have one stride).
at::Tensor as_2d(const at::Tensor& logits) {
  const at::Tensor r = as_rows(logits);
  return r.dim() == 2 ? r : r.view({-1, r.size(-1)});
}

at::Tensor flat(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous().view(-1) : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& target,
                                                      int64_t ignore_index, double eps) {
  check_cross_entropy("customops::cross_entropy", logits, target, eps);
  const auto opts = logits.options().dtype(cross_entropy_acc_dtype(logits.scalar_type()));
  at::Tensor loss = at::empty(target.sizes(), opts), lse = at::empty(target.sizes(), opts);
  forward_cuda(as_2d(logits), target.contiguous().view(-1), ignore_index, eps, loss.view(-1), lse.view(-1));
  return {loss, lse};
}

at::Tensor cross_entropy_backward_cuda(const std::optional<at::Tensor>& grad_loss,
                                       const std::optional<at::Tensor>& grad_lse, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                                       double eps) {
  check_cross_entropy_backward(grad_loss, grad_lse, logits, target, lse, eps);
  at::Tensor grad = at::empty(logits.sizes(), logits.options());
  backward_cuda(flat(grad_loss), flat(grad_lse), as_2d(logits), target.contiguous().view(-1), lse.contiguous().view(-1),
                ignore_index, eps, 0, logits.size(-1), grad.view({-1, logits.size(-1)}));
  return grad;
}

}  // namespace

const CrossEntropyKernels& cross_entropy_kernels_cuda() {
  static const CrossEntropyKernels k{&forward_cuda, &backward_cuda};
  return k;
}

// CUDA kernels of cross_entropy.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("cross_entropy", &cross_entropy_cuda);
  m.impl("_cross_entropy_backward", &cross_entropy_backward_cuda);
}

}  // namespace customops
