// customops-run's checks of a package before it is loaded: a regular file and a zip archive, and
// the model and device its metadata names (every member against its CRC-32 is
// customops::verify_package's, which customops::CausalLM runs too).
#include <ATen/Context.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <fstream>
#include <sstream>
#include <string>
#include <unordered_map>

#include <sys/stat.h>

#include "runner/runner.h"

namespace customops::runner {
namespace {

bool is_zip(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

// The model names the loader's error for a name it lacks lists, comma-separated ("" when it lists
// none): one per line after its "Available models:" (torch 2.13) or "Available models in the
// archive:" (torch 2.11) line, up to an empty line.
std::string models_in(const std::string& error) {
  auto at = error.find("Available models");
  if (at == std::string::npos) return "";
  std::istringstream lines(error.substr(at));
  std::string line, models;
  std::getline(lines, line);  // the heading
  while (std::getline(lines, line) && !line.empty()) models += (models.empty() ? "" : ", ") + line;
  return models;
}

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw UserError(what + " not found: " + path);
  if (!S_ISREG(st.st_mode)) throw UserError(what + " is not a regular file: " + path);
}

std::unordered_map<std::string, std::string> read_metadata(const Options& o) {
  require_regular_file(o.package, "package");
  if (!is_zip(o.package)) {
    throw UserError("cannot load " + o.package +
                    ": not an AOTInductor package (a .pt2 is a zip archive; this file is not one)");
  }
  std::unordered_map<std::string, std::string> meta;
  try {
    meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(o.package, o.model_name);
  } catch (const std::exception& e) {
    std::string models = models_in(e.what());
    if (!models.empty() && (" " + models + ",").find(" " + o.model_name + ",") == std::string::npos) {
      throw UserError(o.package + " holds no model named '" + o.model_name + "' (it holds: " + models +
                      "); pick one with --model-name");
    }
    std::string msg = message_of(e);
    msg = msg.substr(0, msg.find(" Available models"));  // then a list of every file in the package
    throw UserError("cannot read " + o.package + " (model '" + o.model_name +
                    "'): not a valid AOTInductor package, or it holds no model of that name: " + msg);
  }
  if (meta["AOTI_DEVICE_KEY"].empty()) {
    throw UserError("cannot load " + o.package + ": its metadata names no device (AOTI_DEVICE_KEY)");
  }
  return meta;
}

c10::Device pick_device(const Options& o, const std::string& package_device) {
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(package_device);
  } catch (const std::exception&) {
    throw UserError(o.package + " was compiled for device '" + package_device + "', which customops-run does not know");
  }
  if (o.device) {
    c10::Device asked(c10::kCPU);
    try {
      asked = c10::Device(*o.device);
    } catch (const std::exception&) {
      throw UserError("--device expects cpu, cuda or cuda:N, got '" + *o.device + "'");
    }
    if (asked.type() != device.type()) {
      throw UserError(o.package + " was compiled for " + package_device + " and cannot run on " + *o.device +
                      "; compile it for " + c10::DeviceTypeName(asked.type(), true) +
                      " (inputs and module on that device when exporting), or run it with --device " +
                      package_device);
    }
    if (asked.is_cpu() && asked.has_index() && asked.index() != 0) {
      throw UserError("--device " + *o.device + ": there is one cpu device; use --device cpu");
    }
    device = asked;
  }
  if (device.is_cuda()) {
    if (!at::hasCUDA()) {
      throw UserError(o.package + " was compiled for cuda, but this process has no CUDA device " +
                      "(libtorch built without CUDA, or no GPU visible)");
    }
    if (!device.has_index()) device.set_index(0);
    auto n = static_cast<int>(at::getNumGPUs());
    if (device.index() >= n) {
      throw UserError("--device " + device.str() + ": this machine has " + std::to_string(n) + " CUDA device(s)");
    }
  } else if (!device.is_cpu()) {
    throw UserError(o.package + " was compiled for " + package_device + "; customops-run runs cpu and cuda packages");
  }
  return device;
}

}  // namespace customops::runner
