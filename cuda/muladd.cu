// CUDA kernels of muladd, muladd.out and mul (see elementwise.cuh for the launcher).
// Strided inputs that are not a row view are made contiguous first: one extra copy, then the
// vectorized path; a non-contiguous out= receives the result by copy_.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "elementwise.cuh"
#include "ops/muladd.h"

namespace customops {
namespace {

template <typename acc_t>
struct MulAdd {
  acc_t c;
  __device__ void operator()(const acc_t* x, acc_t* y) const { y[0] = x[0] * x[1] + c; }
};

template <typename acc_t>
struct Mul {
  __device__ void operator()(const acc_t* x, acc_t* y) const { y[0] = x[0] * x[1]; }
};

void muladd_into(const at::Tensor& a, const at::Tensor& b, double c, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "customops::muladd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    cuda::launch_rows<scalar_t, 2, 1>(MulAdd<acc_t>{static_cast<acc_t>(c)}, {as_rows(a), as_rows(b)},
                                      {out});
  });
}

at::Tensor muladd_cuda(const at::Tensor& a, const at::Tensor& b, double c) {
  check_binary("customops::muladd", a, b);
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty(a.sizes(), a.options());
  muladd_into(a, b, c, out);
  return out;
}

at::Tensor& muladd_out_cuda(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  check_muladd_out(a, b, out);
  c10::cuda::CUDAGuard guard(a.device());
  if (out.is_contiguous()) {
    muladd_into(a, b, c, out);  // also when out is a or b: each element is read before it is written
  } else {
    out.copy_(muladd_cuda(a, b, c));
  }
  return out;
}

at::Tensor mul_cuda(const at::Tensor& a, const at::Tensor& b) {
  check_binary("customops::mul", a, b);
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty(a.sizes(), a.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "customops::mul", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    cuda::launch_rows<scalar_t, 2, 1>(Mul<acc_t>{}, {as_rows(a), as_rows(b)}, {out});
  });
  return out;
}

}  // namespace

// CUDA kernels of the multiply-add family.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("muladd", &muladd_cuda);
  m.impl("muladd.out", &muladd_out_cuda);
  m.impl("mul", &mul_cuda);
}

}  // namespace customops
