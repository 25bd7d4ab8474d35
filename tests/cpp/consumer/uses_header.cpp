// Consumer check: customops::muladd, the generation API and the tokenizer through the installed
// headers and libraries (generation itself is tested from pytest, which makes the packages and the
// tokenizer model).
#include <ATen/ATen.h>
#include <customops/customops.h>
#include <customops/generate.h>
#include <customops/tokenizer.h>

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
  try {  // a missing file is named whatever formats the build reads
    customops::Tokenizer tok("no-such-tokenizer.model");
    std::cerr << "customops::Tokenizer loaded a model that does not exist\n";
    return 1;
  } catch (const std::exception& e) {
    const std::string want = "no-such-tokenizer.model";
    if (std::string(e.what()).find(want) == std::string::npos) {
      std::cerr << "customops::Tokenizer's error does not say '" << want << "': " << e.what() << "\n";
      return 1;
    }
  }
  std::cout << "ok: customops " << customops::version() << " on torch " << customops::torch_version() << "\n";
  return 0;
}
