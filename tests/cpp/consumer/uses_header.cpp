// Consumer check: customops::muladd through the installed header and library.
#include <ATen/ATen.h>
#include <customops/customops.h>

#include <iostream>

int main() {
  at::Tensor a = at::rand({4, 5});
  at::Tensor b = at::rand({4, 5});
  at::Tensor y = customops::muladd(a, b, 2.0);
  if (!at::allclose(y, a * b + 2.0)) {
    std::cerr << "customops::muladd gave a wrong result\n";
    return 1;
  }
  std::cout << "ok: customops " << customops::version() << " on torch " << customops::torch_version() << "\n";
  return 0;
}
