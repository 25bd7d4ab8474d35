// CPU kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops: one multi-threaded,
// vectorized pass (cpu/rows.h) that reads and writes strided row views such as the halves of a
// gate-up tensor in place (swiglu is silu_mul's kernels on them). Half types compute in float32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>

#include "cpu/dispatch.h"
#include "cpu/rows.h"
#include "ops/llm.h"

namespace customops {
namespace CPU_CAPABILITY {
namespace {

// One function for the vector body and the scalar tail. exp_u20 (within 20 ULP) is several
// times cheaper than Sleef's exp, and sigmoid damps its error far below float32's tolerance;
// float64 keeps the exact exp.
template <typename V>
inline V sigmoid(const V& x) {
  if constexpr (std::is_arithmetic_v<V>) {
    return V(1) / (V(1) + std::exp(-x));
  } else {
    using A = typename V::value_type;
    V e;
    if constexpr (std::is_same_v<A, float>) {
      e = x.neg().exp_u20();
    } else {
      e = x.neg().exp();
    }
    return V(A(1)) / (V(A(1)) + e);
  }
}

// Scalar-or-vector helpers so one lambda serves the vector body and the scalar tail.
template <typename V>
inline V splat(double v) {
  if constexpr (std::is_arithmetic_v<V>) {
    return static_cast<V>(v);
  } else {
    return V(static_cast<typename V::value_type>(v));
  }
}
template <typename V>
inline V clamp(const V& x, const V& lo, const V& hi) {
  if constexpr (std::is_arithmetic_v<V>) {
    return std::min(std::max(x, lo), hi);
  } else {
    return at::vec::clamp(x, lo, hi);
  }
}
// 1 where lo <= x <= hi, else 0 (NaN too): torch.clamp's gradient passes at the bounds.
template <typename V>
inline V inside(const V& x, const V& lo, const V& hi) {
  if constexpr (std::is_arithmetic_v<V>) {
    return (x >= lo && x <= hi) ? V(1) : V(0);
  } else {
    return (x >= lo) & (x <= hi) & V(1);
  }
}

#define CUSTOMOPS_DISPATCH_FLOAT(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

}  // namespace

void silu_kernel(const at::Tensor& x, const at::Tensor& y) {
  CUSTOMOPS_DISPATCH_FLOAT(x.scalar_type(), "customops::silu", [&] {
    rows_loop<scalar_t, 1, 1>([](const auto& v) { return std::array{v[0] * sigmoid(v[0])}; }, {x}, {y});
  });
}

void silu_backward_kernel(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx) {
  CUSTOMOPS_DISPATCH_FLOAT(x.scalar_type(), "customops::_silu_backward", [&] {
    rows_loop<scalar_t, 2, 1>(
        [](const auto& v) {
          using V = std::decay_t<decltype(v[0])>;
          const auto s = sigmoid(v[1]);
          return std::array{v[0] * s * (splat<V>(1) + v[1] * (splat<V>(1) - s))};
        },
        {dy, x}, {dx});
  });
}

void silu_mul_kernel(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& y) {
  CUSTOMOPS_DISPATCH_FLOAT(gate.scalar_type(), "customops::silu_mul", [&] {
    rows_loop<scalar_t, 2, 1>([](const auto& v) { return std::array{v[0] * sigmoid(v[0]) * v[1]}; }, {gate, up},
                              {y});
  });
}

void silu_mul_backward_kernel(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                              const at::Tensor& dgate, const at::Tensor& dup) {
  CUSTOMOPS_DISPATCH_FLOAT(gate.scalar_type(), "customops::_silu_mul_backward", [&] {
    rows_loop<scalar_t, 3, 2>(
        [](const auto& v) {
          using V = std::decay_t<decltype(v[0])>;
          const auto s = sigmoid(v[1]);
          const auto silu = v[1] * s;
          return std::array{v[0] * v[2] * s * (splat<V>(1) + v[1] * (splat<V>(1) - s)), v[0] * silu};
        },
        {dy, gate, up}, {dgate, dup});
  });
}

void scale_clamp_kernel(const at::Tensor& x, const at::Tensor& y, double scale, double lo, double hi) {
  CUSTOMOPS_DISPATCH_FLOAT(x.scalar_type(), "customops::scale_clamp", [&] {
    rows_loop<scalar_t, 1, 1>(
        [=](const auto& v) {
          using V = std::decay_t<decltype(v[0])>;
          return std::array{clamp(v[0] * splat<V>(scale), splat<V>(lo), splat<V>(hi))};
        },
        {x}, {y});
  });
}

void scale_clamp_backward_kernel(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx, double scale,
                                 double lo, double hi) {
  CUSTOMOPS_DISPATCH_FLOAT(x.scalar_type(), "customops::_scale_clamp_backward", [&] {
    rows_loop<scalar_t, 2, 1>(
        [=](const auto& v) {
          using V = std::decay_t<decltype(v[0])>;
          const V sx = v[1] * splat<V>(scale);
          return std::array{v[0] * splat<V>(scale) * inside(sx, splat<V>(lo), splat<V>(hi))};
        },
        {dy, x}, {dx});
  });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, silu_kernel, const at::Tensor&, const at::Tensor&)
CUSTOMOPS_CPU_KERNEL(void, silu_backward_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&)
CUSTOMOPS_CPU_KERNEL(void, silu_mul_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&)
CUSTOMOPS_CPU_KERNEL(void, silu_mul_backward_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&)
CUSTOMOPS_CPU_KERNEL(void, scale_clamp_kernel, const at::Tensor&, const at::Tensor&, double, double, double)
CUSTOMOPS_CPU_KERNEL(void, scale_clamp_backward_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     double, double, double)

namespace {

at::Tensor silu_cpu(const at::Tensor& x) {
  check_unary("customops::silu", x);
  at::Tensor y = at::empty(x.sizes(), x.options());
  CUSTOMOPS_CPU_DISPATCH(silu_kernel, as_rows(x), y);
  return y;
}

at::Tensor silu_backward_cpu(const at::Tensor& dy, const at::Tensor& x) {
  check_unary("customops::_silu_backward", x);
  check_grad_like("customops::_silu_backward", dy, "x", x);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  CUSTOMOPS_CPU_DISPATCH(silu_backward_kernel, as_rows(dy), as_rows(x), dx);
  return dx;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul("customops::silu_mul", gate, up);
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  CUSTOMOPS_CPU_DISPATCH(silu_mul_kernel, as_rows(gate), as_rows(up), y);
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cpu(const at::Tensor& dy, const at::Tensor& gate,
                                                         const at::Tensor& up) {
  check_silu_mul("customops::_silu_mul_backward", gate, up);
  check_grad_like("customops::_silu_mul_backward", dy, "gate", gate);
  at::Tensor dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(gate.sizes(), gate.options());
  CUSTOMOPS_CPU_DISPATCH(silu_mul_backward_kernel, as_rows(dy), as_rows(gate), as_rows(up), dgate, dup);
  return {dgate, dup};
}

at::Tensor swiglu_cpu(const at::Tensor& x) {
  check_swiglu("customops::swiglu", x);
  const auto [gate, up] = halves(as_rows(x));
  at::Tensor y = at::empty(gate.sizes(), x.options());
  CUSTOMOPS_CPU_DISPATCH(silu_mul_kernel, gate, up, y);
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& dy, const at::Tensor& x) {
  check_swiglu_backward(dy, x);
  const auto [gate, up] = halves(as_rows(x));
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const auto [dgate, dup] = halves(dx);
  CUSTOMOPS_CPU_DISPATCH(silu_mul_backward_kernel, as_rows(dy), gate, up, dgate, dup);
  return dx;
}

at::Tensor scale_clamp_cpu(const at::Tensor& x, double scale, double lo, double hi) {
  check_scale_clamp("customops::scale_clamp", x, lo, hi);
  at::Tensor y = at::empty(x.sizes(), x.options());
  CUSTOMOPS_CPU_DISPATCH(scale_clamp_kernel, as_rows(x), y, scale, lo, hi);
  return y;
}

at::Tensor scale_clamp_backward_cpu(const at::Tensor& dy, const at::Tensor& x, double scale, double lo, double hi) {
  check_scale_clamp("customops::_scale_clamp_backward", x, lo, hi);
  check_grad_like("customops::_scale_clamp_backward", dy, "x", x);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  CUSTOMOPS_CPU_DISPATCH(scale_clamp_backward_kernel, as_rows(dy), as_rows(x), dx, scale, lo, hi);
  return dx;
}

}  // namespace

// CPU kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("silu", &silu_cpu);
  m.impl("_silu_backward", &silu_backward_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("_silu_mul_backward", &silu_mul_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("_swiglu_backward", &swiglu_backward_cpu);
  m.impl("scale_clamp", &scale_clamp_cpu);
  m.impl("_scale_clamp_backward", &scale_clamp_backward_cpu);
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
