// CUDA kernels of rope and _rope_backward: one launch for q and k together. A thread owns one unit
// of a position (b, s) in kHeads heads of q or of k, so each cos/sin load serves kHeads rows and
// every x load of those rows is in flight before any math. Blocks in launch order take a tile of
// positions x units in each head chunk (q's first), then the next tile. A rotating unit is two
// 16-byte packs, at i and i + R/2: rotate-half pairs (j, j + R/2) span them, GPT-J pairs
// (2j, 2j + 1) lie inside each; dims past R go through one pack a unit. Consecutive threads read
// consecutive packs. q and k are read through their strides (views of a fused qkv projection stay
// in place); outputs are dense in the input's order (heads_layout_like). Rows, strides or R/2 not
// aligned to 16 bytes take the same kernel one pair (or element) a unit. The backward is the
// transposed rotation.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "elementwise.cuh"
#include "pdl.cuh"
#include "ops/layout.h"
#include "ops/rope.h"

namespace customops {
namespace {

using cuda::Pack;

constexpr int kThreads = 256;
// Heads per thread. Measured on an H100 (bf16, B 4, Hq 32, Hkv 8, S 2048, D 128): 4 heads 64.3 us a
// pass, 2 heads 68.3, 8 heads 65.5 (224 registers); 8-byte packs instead of 16: no faster.
constexpr int kHeads = 4;

template <typename T>
struct RopeArgs {
  const T* x[2];         // q, k
  int64_t stride[2][3];  // their strides of B, H, S (the last dim's is 1)
  int64_t heads[2];
  T* out[2];
  int64_t out_stride[2][3];
  const T* cos;          // contiguous [Bc, S, R]
  const T* sin;
  int64_t cos_b_stride;  // rows of cos per batch entry: S, or 0 when shared
  int64_t s, d, r;
  int64_t positions;     // B * S
  int64_t rot_units;     // units per position that rotate; then (d - r) / V that copy
  int64_t units;
  int64_t q_chunks;      // head chunks of q, then those of k
  int64_t chunks;
};

// Forward: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2; inverse (its transpose): y1 = x1*c1 + x2*s2,
// y2 = x2*c2 - x1*s1.
template <typename T, bool kInverse>
__device__ __forceinline__ void rotate_pair(T x1, T x2, T c1, T c2, T s1, T s2, T& y1, T& y2) {
  using A = at::opmath_type<T>;
  const A a1 = A(x1), a2 = A(x2);
  y1 = static_cast<T>(kInverse ? a1 * A(c1) + a2 * A(s2) : a1 * A(c1) - a2 * A(s1));
  y2 = static_cast<T>(kInverse ? a2 * A(c2) - a1 * A(s1) : a2 * A(c2) + a1 * A(s2));
}

// V = 16 / sizeof(T): a unit is the packs at u*V and R/2 + u*V. V = 1: a unit is one pair, loaded
// element by element.
template <typename T, int V, bool kInverse, bool kInterleaved>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeArgs<T> a) {
  cuda::wait_prerequisites();
  cuda::launch_dependents();
  using P = Pack<T, V>;
  constexpr bool kAdjacent = kInterleaved && V > 1;  // each pack holds whole pairs
  const int64_t h = a.r / 2, total = a.positions * a.units;
  const int64_t tiles = (total + kThreads - 1) / kThreads;
  // Blocks in launch order take every head chunk of a tile of positions before the next tile, so
  // the blocks running at once stream through q and k in memory order ([B, S, H, D] views too).
  for (int64_t bid = blockIdx.x; bid < tiles * a.chunks; bid += gridDim.x) {
    const int64_t chunk = bid % a.chunks, g = (bid / a.chunks) * kThreads + threadIdx.x;
    if (g < total) {
      const int w = chunk < a.q_chunks ? 0 : 1;
      const int64_t h0 = (w == 0 ? chunk : chunk - a.q_chunks) * kHeads;
      const int nh = static_cast<int>(std::min<int64_t>(kHeads, a.heads[w] - h0));
      const int64_t x_hstride = a.stride[w][1], y_hstride = a.out_stride[w][1];
      const int64_t p = g / a.units, u = g % a.units, bi = p / a.s, si = p % a.s;
      const T* x = a.x[w] + bi * a.stride[w][0] + h0 * x_hstride + si * a.stride[w][2];
      T* y = a.out[w] + bi * a.out_stride[w][0] + h0 * y_hstride + si * a.out_stride[w][2];
      if (u < a.rot_units) {
        const int64_t o1 = V == 1 && kInterleaved ? 2 * u : u * V;
        const int64_t o2 = V == 1 && kInterleaved ? 2 * u + 1 : h + u * V;
        P x1[kHeads], x2[kHeads];
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
          if (k < nh) {
            x1[k] = *reinterpret_cast<const P*>(x + k * x_hstride + o1);
            x2[k] = *reinterpret_cast<const P*>(x + k * x_hstride + o2);
          }
        }
        const int64_t cs = (bi * a.cos_b_stride + si) * a.r;
        const P c1 = *reinterpret_cast<const P*>(a.cos + cs + o1), c2 = *reinterpret_cast<const P*>(a.cos + cs + o2);
        const P s1 = *reinterpret_cast<const P*>(a.sin + cs + o1), s2 = *reinterpret_cast<const P*>(a.sin + cs + o2);
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
          if (k < nh) {
            P y1, y2;
            if constexpr (kAdjacent) {
#pragma unroll
              for (int j = 0; j < V; j += 2) {
                rotate_pair<T, kInverse>(x1[k].v[j], x1[k].v[j + 1], c1.v[j], c1.v[j + 1], s1.v[j], s1.v[j + 1],
                                         y1.v[j], y1.v[j + 1]);
                rotate_pair<T, kInverse>(x2[k].v[j], x2[k].v[j + 1], c2.v[j], c2.v[j + 1], s2.v[j], s2.v[j + 1],
                                         y2.v[j], y2.v[j + 1]);
              }
            } else {
#pragma unroll
              for (int j = 0; j < V; ++j) {
                rotate_pair<T, kInverse>(x1[k].v[j], x2[k].v[j], c1.v[j], c2.v[j], s1.v[j], s2.v[j], y1.v[j], y2.v[j]);
              }
            }
            *reinterpret_cast<P*>(y + k * y_hstride + o1) = y1;
            *reinterpret_cast<P*>(y + k * y_hstride + o2) = y2;
          }
        }
      } else {  // dims past R pass through
        const int64_t o = a.r + (u - a.rot_units) * V;
        P v[kHeads];
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
          if (k < nh) v[k] = *reinterpret_cast<const P*>(x + k * x_hstride + o);
        }
#pragma unroll
        for (int k = 0; k < kHeads; ++k) {
          if (k < nh) *reinterpret_cast<P*>(y + k * y_hstride + o) = v[k];
        }
      }
    }
  }
}

// t itself when its last dim is contiguous (any other strides are read in place), else a copy.
at::Tensor unit_last_stride(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::tuple<at::Tensor, at::Tensor> rope_apply(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                              const at::Tensor& sin_in, bool interleaved, bool inverse) {
  c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor q_out = heads_layout_like(q_in), k_out = heads_layout_like(k_in);
  if (q_in.numel() + k_in.numel() == 0) return {q_out, k_out};
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "customops::rope", [&] {
    using T = scalar_t;
    constexpr int kVec = 16 / sizeof(T);
    RopeArgs<T> a{};
    a.s = q.size(2);
    a.d = q.size(3);
    a.r = cos.size(-1);
    a.positions = q.size(0) * a.s;
    a.cos = cos.const_data_ptr<T>();
    a.sin = sin.const_data_ptr<T>();
    a.cos_b_stride = cos.dim() == 3 && cos.size(0) > 1 ? a.s : 0;
    bool vec = (a.r / 2) % kVec == 0 && a.d % kVec == 0 && aligned16(a.cos) && aligned16(a.sin);
    const at::Tensor* in[2] = {&q, &k};
    const at::Tensor* out[2] = {&q_out, &k_out};
    int64_t chunks[2];
    for (int w = 0; w < 2; ++w) {
      const at::Tensor& t = *in[w];
      a.x[w] = t.const_data_ptr<T>();
      a.out[w] = out[w]->mutable_data_ptr<T>();
      a.heads[w] = t.size(1);
      chunks[w] = t.numel() == 0 ? 0 : (a.heads[w] + kHeads - 1) / kHeads;
      for (int dim = 0; dim < 3; ++dim) {
        a.stride[w][dim] = t.size(dim) == 1 ? 0 : t.stride(dim);  // a size-1 dim's stride is never used
        a.out_stride[w][dim] = t.size(dim) == 1 ? 0 : out[w]->stride(dim);
        vec = vec && (chunks[w] == 0 || (a.stride[w][dim] % kVec == 0 && a.out_stride[w][dim] % kVec == 0));
      }
      vec = vec && (chunks[w] == 0 || (aligned16(a.x[w]) && aligned16(a.out[w])));
    }
    a.q_chunks = chunks[0];
    a.chunks = chunks[0] + chunks[1];
    auto launch = [&](auto kernel, int v) {
      a.rot_units = a.r / 2 / v;
      a.units = a.rot_units + (a.d - a.r) / v;
      const int64_t blocks = std::min<int64_t>((a.positions * a.units + kThreads - 1) / kThreads * a.chunks,
                                               std::numeric_limits<int32_t>::max());
      if (blocks == 0) return;
      cuda::launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                             at::cuda::getCurrentCUDAStream(), a);
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