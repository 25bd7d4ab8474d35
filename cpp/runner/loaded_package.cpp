// Loading and running an AOTInductor package, for customops-run and whatever else runs one: the
// package checked before it loads, unpacked in a folder of its own, every run waited for on its
// device. The process must have libcustomops.so loaded (customops-run links it), so that the proxy
// executor finds every customops:: schema when the package loads.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <customops/package.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <optional>
#include <string>
#include <vector>

#include "runner/runner.h"

namespace customops::runner {

namespace {

// Number of leaves of a pytree spec as torch serializes it (JSON; a leaf is {"type": null, ...}).
// The in_spec of an exported program flattens (args, kwargs); its leaves are the model's inputs,
// plus any non-tensor argument the export made a constant.
std::optional<size_t> count_spec_leaves(const std::string& spec) {
  const std::string leaf = "\"type\": null";
  if (spec.find("children_spec") == std::string::npos) return std::nullopt;
  size_t n = 0;
  for (size_t pos = spec.find(leaf); pos != std::string::npos; pos = spec.find(leaf, pos + leaf.size())) ++n;
  return n;
}

void synchronize(const c10::Device& device) {
  if (!device.is_cpu()) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

// Adds what to do to the proxy executor's error for an operator that is not registered.
std::string with_hint(const std::string& msg) {
  if (msg.find("Could not find schema for") == std::string::npos) return msg;
  return msg + " (the library that registers that operator must be loaded in this process before the package)";
}

}  // namespace

LoadedPackage::LoadedPackage(const std::string& path, const std::string& model_name, const c10::Device& device,
                             bool check_inputs)
    : path_(path), device_(device), unpacked_("customops-run") {
  // The generated model checks its inputs' dtypes, shapes, strides and devices only when this is
  // set (read once, on the first run); without it a wrong shape reads out of bounds.
  if (check_inputs) setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);
  customops::verify_package(path_);
  try {
    const TmpdirScope unpack_here(unpacked_.path());
    loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        path_, model_name, /*run_single_threaded=*/false, /*num_runners=*/1,
        device_.is_cpu() ? c10::DeviceIndex(-1) : device_.index());
  } catch (const std::exception& e) {
    throw UserError("cannot load " + path_ + ": " + with_hint(message_of(e)));
  }
}

LoadedPackage::~LoadedPackage() = default;

std::optional<size_t> LoadedPackage::spec_inputs() {
  if (auto spec = loader_->get_call_spec(); !spec.empty()) return count_spec_leaves(spec[0]);
  return std::nullopt;
}

std::vector<at::Tensor> LoadedPackage::run(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> outputs;
  try {
    outputs = loader_->run(inputs);
  } catch (const std::exception& e) {
    throw ModelError(message_of(e));
  }
  // torch 2.11 returns undefined outputs from a model whose operator call failed (it printed why)
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) {
      throw UserError("running " + path_ + " failed: it returned no output " + std::to_string(i) +
                      " (the model's own error is printed above)");
    }
  }
  synchronize(device_);
  return outputs;
}

}  // namespace customops::runner
