// Consumer check: customops::muladd and the generation API through the installed headers and
// library (generation itself is tested from pytest, which makes the packages).
#include <ATen/ATen.h>
#include <customops/customops.h>
#include <customops/generate.h>

#include <iostream>
#include <string>

int main() {
  at::Tensor a = at::rand({4, 5});
  at::Tensor b = at::rand({4, 5});
  at::Tensor y = customops::muladd(a, b, 2.0);
  if (!at::allclose(y, a * b + 2.0)) {
    std::cerr << "customops::muladd gave a wrong result\n";
    return 1;
  }
  try {
    customops::CausalLM lm("no-such-package.pt2");
    std::cerr << "customops::CausalLM loaded a package that does not exist\n";
    return 1;
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("no-such-package.pt2") == std::string::npos) {
      std::cerr << "customops::CausalLM's error does not name the package: " << e.what() << "\n";
      return 1;
    }
  }
  std::cout << "ok: customops " << customops::version() << " on torch " << customops::torch_version() << "\n";
  return 0;
}
