// CUDA kernels of rope and _rope_backward: one launch for the rows (head vectors) of q and k
// together. A thread owns one unit of a row: for rotate-half pairs, the 16-byte pack at i in the
// first half and the pack at i + R/2 in the second; for GPT-J pairs, one pack of adjacent pairs;
// past R, one pack copied through. q and k are read through their strides (views of a fused qkv
// projection stay in place); cos and sin rows, shared by every head, come mostly from L2.
// Outputs are contiguous. Rows or strides not aligned to 16 bytes take the same kernel one
// element at a time. The backward is the transposed rotation.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <limits>

#include "elementwise.cuh"
#include "ops/rope.h"

namespace customops {
namespace {

using cuda::Pack;

template <typename T>
struct RopeArgs {
  const T* x[2];          // q, k
  int64_t stride[2][3];   // their strides of B, H, S (the last dim's is 1)
  int64_t heads[2];
  T* out[2];              // contiguous
  const T* cos;
  const T* sin;
  int64_t cos_b_stride;   // rows of cos per batch entry: S, or 0 when shared
  int64_t b, s, d, r;
  int64_t q_rows, rows;
};

// One pair of packs (rotate-half) or one pack (interleaved): y = x * c -/+ partner * s.
template <typename T, int V, bool kInverse, bool kInterleaved>
__device__ __forceinline__ void rotate(const T* x, const T* c, const T* s, T* y, int64_t i, int64_t h) {
  using A = at::opmath_type<T>;
  using P = Pack<T, V>;
  if constexpr (kInterleaved) {  // pairs (2j, 2j + 1): V / 2 of them in one pack (V = 1: one pair, unpacked)
    constexpr int W = V < 2 ? 2 : V;
    using PW = Pack<T, W>;
    PW xv, cv, sv, o;
    if constexpr (V >= 2) {
      xv = *reinterpret_cast<const PW*>(x + i);
      cv = *reinterpret_cast<const PW*>(c + i);
      sv = *reinterpret_cast<const PW*>(s + i);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        xv.v[j] = x[i + j];
        cv.v[j] = c[i + j];
        sv.v[j] = s[i + j];
      }
    }
#pragma unroll
    for (int j = 0; j < W; j += 2) {
      const A x1 = A(xv.v[j]), x2 = A(xv.v[j + 1]), c1 = A(cv.v[j]), c2 = A(cv.v[j + 1]), s1 = A(sv.v[j]),
              s2 = A(sv.v[j + 1]);
      o.v[j] = static_cast<T>(kInverse ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      o.v[j + 1] = static_cast<T>(kInverse ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
    if constexpr (V >= 2) {
      *reinterpret_cast<PW*>(y + i) = o;
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) y[i + j] = o.v[j];
    }
  } else {  // pairs (j, j + h): the pack at i and the pack at i + h
    const P x1v = *reinterpret_cast<const P*>(x + i), x2v = *reinterpret_cast<const P*>(x + i + h);
    const P c1v = *reinterpret_cast<const P*>(c + i), c2v = *reinterpret_cast<const P*>(c + i + h);
    const P s1v = *reinterpret_cast<const P*>(s + i), s2v = *reinterpret_cast<const P*>(s + i + h);
    P o1, o2;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const A x1 = A(x1v.v[j]), x2 = A(x2v.v[j]), c1 = A(c1v.v[j]), c2 = A(c2v.v[j]), s1 = A(s1v.v[j]),
              s2 = A(s2v.v[j]);
      o1.v[j] = static_cast<T>(kInverse ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      o2.v[j] = static_cast<T>(kInverse ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
    *reinterpret_cast<P*>(y + i) = o1;
    *reinterpret_cast<P*>(y + i + h) = o2;
  }
}

template <typename T, int V, bool kInverse, bool kInterleaved>
__global__ void __launch_bounds__(256) rope_kernel(RopeArgs<T> a) {
  using P = Pack<T, V>;
  const int64_t h = a.r / 2;
  constexpr int kRot = kInterleaved && V < 2 ? 2 : V;  // elements a rotating unit starts apart
  const int64_t rot_units = (kInterleaved ? a.r : h) / kRot, units = rot_units + (a.d - a.r) / V;
  const int64_t total = a.rows * units;
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < total; g += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = g / units, u = g % units;
    const int which = row < a.q_rows ? 0 : 1;
    const int64_t i = which == 0 ? row : row - a.q_rows;  // ((bi * H) + hi) * S + si within q or k
    const int64_t si = i % a.s, hi = (i / a.s) % a.heads[which], bi = i / (a.s * a.heads[which]);
    const T* x = a.x[which] + bi * a.stride[which][0] + hi * a.stride[which][1] + si * a.stride[which][2];
    T* y = a.out[which] + i * a.d;
    if (u < rot_units) {
      const int64_t cs = (bi * a.cos_b_stride + si) * a.r;
      rotate<T, V, kInverse, kInterleaved>(x, a.cos + cs, a.sin + cs, y, u * kRot, h);
    } else {
      const int64_t c = a.r + (u - rot_units) * V;  // dims past R pass through
      *reinterpret_cast<P*>(y + c) = *reinterpret_cast<const P*>(x + c);
    }
  }
}

// t itself when its last dim is contiguous (any other strides are read in place), else a copy.
at::Tensor unit_last_stride(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

bool aligned16(const void* p, std::initializer_list<int64_t> byte_offsets) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  for (int64_t o : byte_offsets) {
    if (o % 16 != 0) return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> rope_apply(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                              const at::Tensor& sin_in, bool interleaved, bool inverse) {
  c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor q_out = at::empty(q_in.sizes(), q_in.options()), k_out = at::empty(k_in.sizes(), k_in.options());
  if (q_in.numel() + k_in.numel() == 0) return {q_out, k_out};
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "customops::rope", [&] {
    using T = scalar_t;
    RopeArgs<T> a{};
    const at::Tensor* in[2] = {&q, &k};
    const at::Tensor* out[2] = {&q_out, &k_out};
    for (int w = 0; w < 2; ++w) {
      a.x[w] = in[w]->const_data_ptr<T>();
      for (int dim = 0; dim < 3; ++dim) a.stride[w][dim] = in[w]->stride(dim);
      a.heads[w] = in[w]->size(1);
      a.out[w] = out[w]->mutable_data_ptr<T>();
    }
    a.cos = cos.const_data_ptr<T>();
    a.sin = sin.const_data_ptr<T>();
    a.b = q.size(0);
    a.s = q.size(2);
    a.d = q.size(3);
    a.r = cos.size(-1);
    a.cos_b_stride = cos.dim() == 3 && cos.size(0) > 1 ? a.s : 0;
    a.q_rows = a.b * a.heads[0] * a.s;
    a.rows = a.q_rows + a.b * a.heads[1] * a.s;
    constexpr int kVec = 16 / sizeof(T);
    const int64_t e = sizeof(T);
    const bool vec = a.r % (2 * kVec) == 0 && (a.d - a.r) % kVec == 0 &&
                     aligned16(a.x[0], {a.stride[0][0] * e, a.stride[0][1] * e, a.stride[0][2] * e, a.d * e}) &&
                     aligned16(a.x[1], {a.stride[1][0] * e, a.stride[1][1] * e, a.stride[1][2] * e}) &&
                     aligned16(a.cos, {a.r * e}) && aligned16(a.sin, {}) && aligned16(a.out[0], {}) &&
                     aligned16(a.out[1], {});
    auto launch = [&](auto kernel, int v) {
      const int64_t units = (interleaved ? a.r / std::max(v, 2) : a.r / 2 / v) + (a.d - a.r) / v;
      const int64_t blocks = std::min<int64_t>((a.rows * units + 255) / 256, std::numeric_limits<int32_t>::max());
      if (blocks == 0) return;
      kernel<<<static_cast<unsigned>(blocks), 256, 0, at::cuda::getCurrentCUDAStream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto with_flags = [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      if (inverse) {
        interleaved ? launch(rope_kernel<T, V, true, true>, V) : launch(rope_kernel<T, V, true, false>, V);
      } else {
        interleaved ? launch(rope_kernel<T, V, false, true>, V) : launch(rope_kernel<T, V, false, false>, V);
      }
    };
    if (vec) {
      with_flags(std::integral_constant<int, kVec>{});
    } else {
      with_flags(std::integral_constant<int, 1>{});
    }
  });
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, bool interleaved) {
  check_rope("customops::rope", q, k, cos, sin);
  return rope_apply(q, k, cos, sin, interleaved, /*inverse=*/false);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_cuda(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                      const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_rope_backward(grad_q, grad_k, cos, sin);
  return rope_apply(grad_q, grad_k, cos, sin, interleaved, /*inverse=*/true);
}

}  // namespace

// CUDA kernels of rope.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("rope", &rope_cuda);
  m.impl("_rope_backward", &rope_backward_cuda);
}

}  // namespace customops
