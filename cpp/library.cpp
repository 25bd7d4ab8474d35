// The customops operator library: every schema, in one place. Kernels register elsewhere with
// TORCH_LIBRARY_IMPL (cpp/cpu for CPU, cuda/ for CUDA, cpp/ops for Meta and Autograd).
#include <torch/library.h>

TORCH_LIBRARY(customops, m) {
  // a * b + c elementwise (a, b: same shape, dtype, device); half types compute in float32.
  m.def("muladd(Tensor a, Tensor b, float c) -> Tensor");
  // a * b elementwise; muladd's backward is written with it.
  m.def("mul(Tensor a, Tensor b) -> Tensor");
  // a * b + c written into out (same shape, dtype, device as a); out may be a or b itself.
  m.def("muladd.out(Tensor a, Tensor b, float c, *, Tensor(a!) out) -> Tensor(a!)");

  // y = x * rsqrt(mean(x^2, -1) + eps) * weight over the last dim; also returns rstd (float32,
  // float64 for float64 x; shape x.shape[:-1]), which the backward reuses.
  m.def("rms_norm(Tensor x, Tensor? weight, float eps=1e-06) -> (Tensor, Tensor)");
  // (grad_x, grad_weight) of rms_norm; an output masked off by output_mask is an empty tensor.
  m.def("_rms_norm_backward(Tensor grad_y, Tensor x, Tensor? weight, Tensor rstd, bool[2] output_mask) -> (Tensor, Tensor)");
  // x * sigmoid(x).
  m.def("silu(Tensor x) -> Tensor");
  // grad_y * d silu(x) / dx.
  m.def("_silu_backward(Tensor grad_y, Tensor x) -> Tensor");
  // silu(gate) * up: the SwiGLU product; gate and up may be the halves of one tensor.
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  // (grad_gate, grad_up) of silu_mul.
  m.def("_silu_mul_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // silu(x[..., :n]) * x[..., n:] with n = x.size(-1) / 2: silu_mul of a fused gate-up tensor,
  // whose backward writes the gradient of x as one tensor (no concatenation of two halves).
  m.def("swiglu(Tensor x) -> Tensor");
  // grad of x for swiglu: [..., 2n], the gate half then the up half.
  m.def("_swiglu_backward(Tensor grad_y, Tensor x) -> Tensor");
  // clamp(x * scale, lo, hi).
  m.def("scale_clamp(Tensor x, float scale, float lo, float hi) -> Tensor");
  // grad_y * scale where lo < x * scale < hi, else 0.
  m.def("_scale_clamp_backward(Tensor grad_y, Tensor x, float scale, float lo, float hi) -> Tensor");
}
