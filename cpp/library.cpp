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
}
