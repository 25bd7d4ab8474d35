// Consumer check: runs an AOTInductor package made in Python (tests/python/test_aoti.py) and
// compares its outputs with the expected ones. Built twice from this one source: linked with
// customops::customops (must pass) and with libtorch alone (must fail: when the package loads, the
// proxy executor finds no customops:: schema). `--copy IN OUT` re-saves a tensor file, to check
// that torch.save and torch::jit::pickle_save/pickle_load read each other's files.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  c10::IValue v = torch::jit::pickle_load(bytes);
  std::vector<c10::IValue> items = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
  std::vector<at::Tensor> tensors;
  for (const auto& item : items) tensors.push_back(item.toTensor());
  return tensors;
}

void save_tensors(const std::vector<at::Tensor>& tensors, const std::string& path) {
  std::vector<c10::IValue> items(tensors.begin(), tensors.end());
  auto bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

int run(const std::string& package, const std::string& inputs_path, const std::string& expected_path) {
  torch::inductor::AOTIModelPackageLoader loader(package);
  c10::Device device(loader.get_metadata()["AOTI_DEVICE_KEY"]);
  std::vector<at::Tensor> inputs;
  for (const auto& t : load_tensors(inputs_path)) inputs.push_back(t.to(device));
  auto expected = load_tensors(expected_path);
  auto outputs = loader.run(inputs);
  for (auto& t : outputs) t = t.cpu();
  if (outputs.size() != expected.size()) {
    std::cerr << "got " << outputs.size() << " outputs, expected " << expected.size() << "\n";
    return 1;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].sizes().equals(expected[i].sizes()) || !at::allclose(outputs[i], expected[i], 1e-5, 1e-6)) {
      std::cerr << "output " << i << " differs from the expected one\n";
      return 1;
    }
  }
  std::cout << "ok: " << outputs.size() << " outputs match\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 4 && std::string(argv[1]) == "--copy") {
      save_tensors(load_tensors(argv[2]), argv[3]);
      return 0;
    }
    if (argc != 4) {
      std::cerr << "usage: run_package PACKAGE.pt2 INPUTS.pt EXPECTED.pt | run_package --copy IN.pt OUT.pt\n";
      return 2;
    }
    return run(argv[1], argv[2], argv[3]);
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
  }
  return 1;
}
