// CPU kernels of rope and _rope_backward: one parallel loop over the rows (head vectors) of q and
// k together, each row in float32 (float64 for float64). q and k are read through their strides
// (views of a fused qkv projection stay in place), in their memory order: heads innermost when a
// head's stride is the smaller (a [B, S, H, D] layout), positions innermost otherwise, so reads
// stream either way; outputs are dense in the input's order (heads_layout_like). Rotate-half
// pairs (i, i + R/2) are two contiguous runs, so they go in vectors; GPT-J pairs (2i, 2i + 1) are
// interleaved and go element by element (a loop compilers vectorize). The backward is the same loop with the transposed rotation.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/dispatch.h"
#include "cpu/rows.h"
#include "ops/layout.h"
#include "ops/rope.h"

namespace customops {
namespace CPU_CAPABILITY {

// One of q or k: [B, H, S, D] with strides; cos/sin rows indexed by (b * cos_b_stride + s).
template <typename T>
struct RopeIn {
  const T* x;
  int64_t stride[3];  // of B, H, S (the last dim's is 1)
  int64_t h;
  bool heads_inner;   // rows in (b, s, h) order rather than (b, h, s)
  T* out;
  int64_t out_stride[3];
};

// y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2 (forward); y1 = x1*c1 + x2*s2, y2 = x2*c2 - x1*s1
// (inverse, the transpose).
template <typename T, bool kInverse>
void rope_row(const T* x, const T* c, const T* s, T* y, int64_t r, int64_t d, bool interleaved) {
  using A = acc_t<T>;
  if (interleaved) {
    for (int64_t i = 0; i < r; i += 2) {
      const A x1 = A(x[i]), x2 = A(x[i + 1]);
      const A c1 = A(c[i]), c2 = A(c[i + 1]), s1 = A(s[i]), s2 = A(s[i + 1]);
      y[i] = static_cast<T>(kInverse ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      y[i + 1] = static_cast<T>(kInverse ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
  } else {
    const int64_t h = r / 2;
    int64_t i = 0;
    for (; i + kStep<T> <= h; i += kStep<T>) {
      auto [x1a, x1b] = load2(x + i);
      auto [x2a, x2b] = load2(x + h + i);
      auto [c1a, c1b] = load2(c + i);
      auto [c2a, c2b] = load2(c + h + i);
      auto [s1a, s1b] = load2(s + i);
      auto [s2a, s2b] = load2(s + h + i);
      if constexpr (kInverse) {
        store2(y + i, x1a * c1a + x2a * s2a, x1b * c1b + x2b * s2b);
        store2(y + h + i, x2a * c2a - x1a * s1a, x2b * c2b - x1b * s1b);
      } else {
        store2(y + i, x1a * c1a - x2a * s1a, x1b * c1b - x2b * s1b);
        store2(y + h + i, x2a * c2a + x1a * s2a, x2b * c2b + x1b * s2b);
      }
    }
    for (; i < h; ++i) {
      const A x1 = A(x[i]), x2 = A(x[h + i]);
      const A c1 = A(c[i]), c2 = A(c[h + i]), s1 = A(s[i]), s2 = A(s[h + i]);
      y[i] = static_cast<T>(kInverse ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      y[h + i] = static_cast<T>(kInverse ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
  }
  if (d > r) std::memcpy(y + r, x + r, (d - r) * sizeof(T));  // dims past R pass through
}

template <typename T, bool kInverse>
void rope_rows(const RopeIn<T>& q, const RopeIn<T>& k, const T* cos, const T* sin, int64_t cos_b_stride, int64_t b,
               int64_t s, int64_t d, int64_t r, bool interleaved) {
  const int64_t q_rows = b * q.h * s, rows = q_rows + b * k.h * s;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bool is_q = row < q_rows;
      const RopeIn<T>& t = is_q ? q : k;
      const int64_t i = is_q ? row : row - q_rows;  // row within t, in its order
      const int64_t si = t.heads_inner ? (i / t.h) % s : i % s, hi = t.heads_inner ? i % t.h : (i / s) % t.h;
      const int64_t bi = i / (s * t.h);
      const int64_t cs = (bi * cos_b_stride + si) * r;
      rope_row<T, kInverse>(t.x + bi * t.stride[0] + hi * t.stride[1] + si * t.stride[2], cos + cs, sin + cs,
                            t.out + bi * t.out_stride[0] + hi * t.out_stride[1] + si * t.out_stride[2], r, d,
                            interleaved);
    }
  });
}

void rope_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& q_out, const at::Tensor& k_out, bool interleaved, bool inverse) {
  const int64_t b = q.size(0), s = q.size(2), d = q.size(3), r = cos.size(-1);
  const int64_t cos_b_stride = cos.dim() == 3 && cos.size(0) > 1 ? s : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "customops::rope", [&] {
    using T = scalar_t;
    auto in = [](const at::Tensor& t, const at::Tensor& out) {
      return RopeIn<T>{t.const_data_ptr<T>(), {t.stride(0), t.stride(1), t.stride(2)}, t.size(1),
                       t.stride(1) < t.stride(2), out.mutable_data_ptr<T>(),
                       {out.stride(0), out.stride(1), out.stride(2)}};
    };
    const RopeIn<T> qi = in(q, q_out), ki = in(k, k_out);
    if (inverse) {
      rope_rows<T, true>(qi, ki, cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), cos_b_stride, b, s, d, r, interleaved);
    } else {
      rope_rows<T, false>(qi, ki, cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), cos_b_stride, b, s, d, r, interleaved);
    }
  });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, rope_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, bool, bool)

namespace {

// t itself when its last dim is contiguous (any other strides are read in place), else a copy.
at::Tensor unit_last_stride(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

std::tuple<at::Tensor, at::Tensor> rope_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                              const at::Tensor& sin, bool interleaved, bool inverse) {
  at::Tensor q_out = heads_layout_like(q), k_out = heads_layout_like(k);
  if (q.numel() + k.numel() == 0) return {q_out, k_out};
  CUSTOMOPS_CPU_DISPATCH(rope_kernel, unit_last_stride(q), unit_last_stride(k), cos.contiguous(), sin.contiguous(), q_out,
                         k_out, interleaved, inverse);
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin, bool interleaved) {
  check_rope("customops::rope", q, k, cos, sin);
  return rope_apply(q, k, cos, sin, interleaved, /*inverse=*/false);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_cpu(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                     const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_rope_backward(grad_q, grad_k, cos, sin);
  return rope_apply(grad_q, grad_k, cos, sin, interleaved, /*inverse=*/true);
}

}  // namespace

// CPU kernels of rope.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("rope", &rope_cpu);
  m.impl("_rope_backward", &rope_backward_cpu);
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
