// CPU kernels of muladd, muladd.out and mul: one TensorIterator pass over any strides,
// multi-threaded by at::parallel_for and vectorized with at::vec on contiguous runs.
// Half types are widened to float32, computed, and rounded once.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Loops.h>
#include <torch/library.h>

#include "cpu/dispatch.h"
#include "ops/muladd.h"

namespace customops {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

// Applies f elementwise over iter's two inputs of dtype scalar_t, in float for half types.
template <typename scalar_t, typename F>
void binary_float_loop_typed(at::TensorIteratorBase& iter, F f) {
  if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
    at::native::cpu_kernel_vec(
        iter, [f](scalar_t a, scalar_t b) -> scalar_t { return f(float(a), float(b)); },
        [f](Vectorized<scalar_t> a, Vectorized<scalar_t> b) {
          auto [a0, a1] = at::vec::convert_to_float<scalar_t>(a);
          auto [b0, b1] = at::vec::convert_to_float<scalar_t>(b);
          return at::vec::convert_from_float<scalar_t>(f(a0, b0), f(a1, b1));
        });
  } else {
    at::native::cpu_kernel_vec(
        iter, [f](scalar_t a, scalar_t b) -> scalar_t { return f(a, b); },
        [f](Vectorized<scalar_t> a, Vectorized<scalar_t> b) { return f(a, b); });
  }
}

template <typename F>
void binary_float_loop(at::TensorIteratorBase& iter, F f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, iter.common_dtype(), "customops",
                                  [&] { binary_float_loop_typed<scalar_t>(iter, f); });
}

void muladd_kernel(at::TensorIteratorBase& iter, double c) {
  if (iter.common_dtype() == at::kDouble) {
    binary_float_loop(iter, [c](auto a, auto b) { return a * b + decltype(a)(c); });
  } else {
    const float cf = static_cast<float>(c);
    binary_float_loop(iter, [cf](auto a, auto b) { return a * b + decltype(a)(cf); });
  }
}

void mul_kernel(at::TensorIteratorBase& iter) {
  binary_float_loop(iter, [](auto a, auto b) { return a * b; });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, muladd_kernel, at::TensorIteratorBase&, double)
CUSTOMOPS_CPU_KERNEL(void, mul_kernel, at::TensorIteratorBase&)

namespace {

at::TensorIterator binary_iter(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return at::TensorIteratorConfig()
      .add_output(out)
      .add_const_input(a)
      .add_const_input(b)
      .resize_outputs(false)
      .build();
}

at::Tensor& muladd_out_cpu(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  check_muladd_out(a, b, out);
  auto iter = binary_iter(out, a, b);
  CUSTOMOPS_CPU_DISPATCH(muladd_kernel, iter, c);
  return out;
}

at::Tensor muladd_cpu(const at::Tensor& a, const at::Tensor& b, double c) {
  check_binary("customops::muladd", a, b);
  at::Tensor out = at::empty(a.sizes(), a.options());
  auto iter = binary_iter(out, a, b);
  CUSTOMOPS_CPU_DISPATCH(muladd_kernel, iter, c);
  return out;
}

at::Tensor mul_cpu(const at::Tensor& a, const at::Tensor& b) {
  check_binary("customops::mul", a, b);
  at::Tensor out = at::empty(a.sizes(), a.options());
  auto iter = binary_iter(out, a, b);
  CUSTOMOPS_CPU_DISPATCH(mul_kernel, iter);
  return out;
}

}  // namespace

// CPU kernels of the multiply-add family.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("muladd", &muladd_cpu);
  m.impl("muladd.out", &muladd_out_cpu);
  m.impl("mul", &mul_cpu);
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
