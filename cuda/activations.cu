// CUDA kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops: functors over the
// shared row-view launcher (elementwise.cuh), so gate/up halves of one tensor are read and written
// in place (swiglu is silu_mul's functors on them).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <type_traits>

#include "elementwise.cuh"
#include "ops/llm.h"

namespace customops {
namespace {

// Half types round the result to 8 or 11 bits, far coarser than the few-ulp error of the fast
// hardware exp and divide, which keep these kernels memory-bound instead of ALU-bound (an accurate
// expf and division cost about as long as moving a bf16 element on an H100/H200); float32 and
// float64 use the accurate functions.
template <typename T>
__device__ __forceinline__ at::opmath_type<T> sigmoid(at::opmath_type<T> x) {
  using A = at::opmath_type<T>;
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    return __fdividef(1.0f, 1.0f + __expf(-x));
  } else {
    return A(1) / (A(1) + exp(-x));
  }
}

// Functors over the storage type T, computing in A = at::opmath_type<T>.
template <typename T>
struct Silu {
  using A = at::opmath_type<T>;
  __device__ void operator()(const A* x, A* y) const { y[0] = x[0] * sigmoid<T>(x[0]); }
};
template <typename T>
struct SiluBackward {  // (dy, x) -> dx
  using A = at::opmath_type<T>;
  __device__ void operator()(const A* in, A* out) const {
    const A s = sigmoid<T>(in[1]);
    out[0] = in[0] * s * (A(1) + in[1] * (A(1) - s));
  }
};
template <typename T>
struct SiluMul {  // (gate, up) -> y
  using A = at::opmath_type<T>;
  __device__ void operator()(const A* in, A* out) const { out[0] = in[0] * sigmoid<T>(in[0]) * in[1]; }
};
template <typename T>
struct SiluMulBackward {  // (dy, gate, up) -> (dgate, dup)
  using A = at::opmath_type<T>;
  __device__ void operator()(const A* in, A* out) const {
    const A s = sigmoid<T>(in[1]);
    out[0] = in[0] * in[2] * s * (A(1) + in[1] * (A(1) - s));
    out[1] = in[0] * in[1] * s;
  }
};
template <typename T>
struct ScaleClamp {
  using A = at::opmath_type<T>;
  A scale, lo, hi;
  __device__ void operator()(const A* x, A* y) const {
    const A sx = x[0] * scale;
    y[0] = sx != sx ? sx : fmin(fmax(sx, lo), hi);  // NaN stays NaN, as in torch.clamp
  }
};
template <typename T>
struct ScaleClampBackward {  // (dy, x) -> dx
  using A = at::opmath_type<T>;
  A scale, lo, hi;
  __device__ void operator()(const A* in, A* out) const {
    const A sx = in[1] * scale;
    out[0] = (sx >= lo && sx <= hi) ? in[0] * scale : A(0);  // torch.clamp's gradient passes at the bounds
  }
};

// Runs Functor<scalar_t> over the inputs, writing the outputs (row views) in place.
template <template <typename> class Functor, size_t NIn, size_t NOut, typename... Args>
void run_into(const std::array<at::Tensor, NIn>& in, const std::array<at::Tensor, NOut>& out, Args... args) {
  c10::cuda::CUDAGuard guard(out[0].device());
  std::array<at::Tensor, NIn> rows;
  for (size_t k = 0; k < NIn; ++k) rows[k] = as_rows(in[k]);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out[0].scalar_type(), "customops", [&] {
    using A = at::opmath_type<scalar_t>;
    cuda::launch_rows<scalar_t, NIn, NOut>(Functor<scalar_t>{static_cast<A>(args)...}, rows, out);
  });
}

// Allocates the outputs (contiguous, shaped like ref) and runs Functor<scalar_t> over the inputs.
template <template <typename> class Functor, size_t NIn, size_t NOut, typename... Args>
std::array<at::Tensor, NOut> run(const at::Tensor& ref, const std::array<at::Tensor, NIn>& in,
                                 Args... args) {
  std::array<at::Tensor, NOut> out;
  for (auto& o : out) o = at::empty(ref.sizes(), ref.options());
  run_into<Functor>(in, out, args...);
  return out;
}

at::Tensor silu_cuda(const at::Tensor& x) {
  check_unary("customops::silu", x);
  return run<Silu, 1, 1>(x, {x})[0];
}

at::Tensor silu_backward_cuda(const at::Tensor& dy, const at::Tensor& x) {
  check_unary("customops::_silu_backward", x);
  check_grad_like("customops::_silu_backward", dy, "x", x);
  return run<SiluBackward, 2, 1>(x, {dy, x})[0];
}

at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul("customops::silu_mul", gate, up);
  return run<SiluMul, 2, 1>(gate, {gate, up})[0];
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cuda(const at::Tensor& dy, const at::Tensor& gate,
                                                          const at::Tensor& up) {
  check_silu_mul("customops::_silu_mul_backward", gate, up);
  check_grad_like("customops::_silu_mul_backward", dy, "gate", gate);
  auto out = run<SiluMulBackward, 3, 2>(gate, {dy, gate, up});
  return {out[0], out[1]};
}

at::Tensor swiglu_cuda(const at::Tensor& x) {
  check_swiglu("customops::swiglu", x);
  c10::cuda::CUDAGuard guard(x.device());
  const auto [gate, up] = halves(as_rows(x));
  return run<SiluMul, 2, 1>(gate, {gate, up})[0];
}

at::Tensor swiglu_backward_cuda(const at::Tensor& dy, const at::Tensor& x) {
  check_swiglu_backward(dy, x);
  c10::cuda::CUDAGuard guard(x.device());
  const auto [gate, up] = halves(as_rows(x));
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const auto [dgate, dup] = halves(dx);
  run_into<SiluMulBackward>(std::array<at::Tensor, 3>{dy, gate, up}, std::array<at::Tensor, 2>{dgate, dup});
  return dx;
}

at::Tensor scale_clamp_cuda(const at::Tensor& x, double scale, double lo, double hi) {
  check_scale_clamp("customops::scale_clamp", x, lo, hi);
  return run<ScaleClamp, 1, 1>(x, {x}, scale, lo, hi)[0];
}

at::Tensor scale_clamp_backward_cuda(const at::Tensor& dy, const at::Tensor& x, double scale, double lo, double hi) {
  check_scale_clamp("customops::_scale_clamp_backward", x, lo, hi);
  check_grad_like("customops::_scale_clamp_backward", dy, "x", x);
  return run<ScaleClampBackward, 2, 1>(x, {dy, x}, scale, lo, hi)[0];
}

}  // namespace

// CUDA kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("silu", &silu_cuda);
  m.impl("_silu_backward", &silu_backward_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("_silu_mul_backward", &silu_mul_backward_cuda);
  m.impl("swiglu", &swiglu_cuda);
  m.impl("_swiglu_backward", &swiglu_backward_cuda);
  m.impl("scale_clamp", &scale_clamp_cuda);
  m.impl("_scale_clamp_backward", &scale_clamp_backward_cuda);
}

}  // namespace customops
