// customops-run: runs an AOTInductor package (.pt2) that calls customops operators, with no
// Python. It links libcustomops.so, so the proxy executor finds every customops:: schema when it
// loads the package, and libtorch (AOTIModelPackageLoader), never libpython. Tensors go in and out
// in the torch.save / torch::jit::pickle_save format, so torch.load reads the outputs directly.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <customops/customops.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/stat.h>

namespace {

constexpr const char* kUsage = R"(usage: customops-run [options] PACKAGE.pt2 INPUTS.pt OUTPUTS.pt
       customops-run --info PACKAGE.pt2

Runs an AOTInductor package that may call customops operators, without Python.

  INPUTS.pt   the model's inputs: a tensor, or a list or tuple of tensors in the order
              torch.export flattens them (positional arguments, then keyword arguments),
              written by torch.save (or torch::jit::pickle_save). Inputs are moved to the
              package's device and made contiguous.
  OUTPUTS.pt  written with the model's outputs as a tuple of CPU tensors (read with torch.load).

options:
  --device DEVICE     cpu, cuda or cuda:N; must match the device the package was compiled for
                      (default: that device, index 0)
  --model-name NAME   the model inside the package (default: model)
  --time              print the load time and the run time
  --runs N            run N times and report the mean and best run time (default: 1);
                      OUTPUTS.pt holds the last run's outputs
  --warmup N          untimed runs before the timed ones (default: 0)
  --no-check-inputs   skip the package's checks of input dtypes, shapes and strides
                      (they are on unless AOTI_RUNTIME_CHECK_INPUTS=0 is set)
  --show-libraries    print every shared library the process has loaded, after the run
  --info              print the package's metadata and exit
  --version           print the versions of customops and of the torch it was built with
  -h, --help          print this help
)";

// An error the user can act on; main prints "customops-run: <message>" and exits with status 1.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wrong command line; exits with status 2.
struct UsageError : UserError {
  using UserError::UserError;
};

struct Options {
  std::string package, inputs, outputs;
  std::optional<std::string> device;
  std::string model_name = "model";
  bool time = false, check_inputs = true, show_libraries = false, info = false;
  int runs = 1, warmup = 0;
};

int parse_count(const std::string& flag, const std::string& value, int min) {
  try {
    size_t used = 0;
    int n = std::stoi(value, &used);
    if (used == value.size() && n >= min) return n;
  } catch (const std::exception&) {
  }
  throw UsageError(flag + " expects an integer >= " + std::to_string(min) + ", got '" + value + "'");
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " expects a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "--version") {
      std::cout << "customops-run " << customops::version() << " (torch " << customops::torch_version()
                << (customops::has_cuda() ? ", CUDA kernels" : ", CPU kernels only") << ")\n";
      std::exit(0);
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--model-name") {
      o.model_name = value();
    } else if (a == "--runs") {
      o.runs = parse_count(a, value(), 1);
    } else if (a == "--warmup") {
      o.warmup = parse_count(a, value(), 0);
    } else if (a == "--time") {
      o.time = true;
    } else if (a == "--no-check-inputs") {
      o.check_inputs = false;
    } else if (a == "--show-libraries") {
      o.show_libraries = true;
    } else if (a == "--info") {
      o.info = true;
    } else if (a.size() > 1 && a[0] == '-') {
      throw UsageError("unknown option " + a + " (see --help)");
    } else {
      positional.push_back(a);
    }
  }
  size_t want = o.info ? 1 : 3;
  if (positional.size() != want) {
    throw UsageError(o.info ? "--info expects one argument, PACKAGE.pt2 (see --help)"
                           : "expected PACKAGE.pt2 INPUTS.pt OUTPUTS.pt, got " + std::to_string(positional.size()) +
                                 " arguments (see --help)");
  }
  o.package = positional[0];
  if (!o.info) {
    o.inputs = positional[1];
    o.outputs = positional[2];
  }
  return o;
}

// The first line of a c10::Error or std::exception, without the C++ backtrace torch appends.
std::string message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10_error ? c10_error->what_without_backtrace() : e.what();
  // An operator's error that crossed the model's C ABI arrives as text, backtrace included.
  auto trace = msg.find("Exception raised from ");
  if (trace != std::string::npos) msg.erase(trace);
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  return msg;
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw UserError(what + " not found: " + path);
  if (!S_ISREG(st.st_mode)) throw UserError(what + " is not a regular file: " + path);
}

std::vector<char> read_file(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError("cannot open " + what + " " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool is_zip(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

// The package's metadata (AOTI_DEVICE_KEY etc.), read without loading the model.
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
    throw UserError("cannot read " + o.package + " (model '" + o.model_name +
                    "'): not a valid AOTInductor package, or it holds no model of that name: " + message_of(e));
  }
  if (meta["AOTI_DEVICE_KEY"].empty()) {
    throw UserError("cannot load " + o.package + ": its metadata names no device (AOTI_DEVICE_KEY)");
  }
  return meta;
}

// The device to run on: the package's, checked against --device and against this process.
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

std::vector<at::Tensor> read_inputs(const std::string& path, const c10::Device& device) {
  auto bytes = read_file(path, "inputs file");
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw UserError("cannot read the inputs file " + path +
                    " (expected a tensor, or a list or tuple of tensors, written by torch.save): " + message_of(e));
  }
  std::vector<c10::IValue> items;
  if (value.isTensor()) {
    items.push_back(value);
  } else if (value.isTuple()) {
    items = value.toTupleRef().elements().vec();
  } else if (value.isList()) {
    items = value.toListRef().vec();
  } else {
    throw UserError("the inputs file " + path + " holds a " + value.tagKind() +
                    "; expected a tensor, or a list or tuple of tensors");
  }
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].isTensor()) {
      throw UserError("input " + std::to_string(i) + " in " + path + " is not a tensor but " + items[i].tagKind() +
                      " (an AOTInductor model takes tensors only)");
    }
    tensors.push_back(items[i].toTensor().to(device).contiguous());
  }
  return tensors;
}

void write_outputs(const std::string& path, const std::vector<at::Tensor>& outputs) {
  std::vector<c10::IValue> items;
  items.reserve(outputs.size());
  for (const auto& t : outputs) items.emplace_back(t.cpu());
  // A tuple, not a c10::List<Tensor>: torch.load(weights_only=True) reads a pickled tuple of tensors.
  auto bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f || !f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
    throw UserError("cannot write the outputs file " + path);
  }
}

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

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// Every shared object mapped into this process (what /proc/<pid>/maps would show from outside).
std::vector<std::string> loaded_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> seen;
  std::vector<std::string> libs;
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    auto name = path.substr(path.rfind('/') + 1);
    if (name.find(".so") == std::string::npos) continue;
    if (seen.insert(path).second) libs.push_back(path);
  }
  return libs;
}

// Adds what to do to the proxy executor's error for an operator that is not registered.
std::string with_hint(const std::string& msg) {
  if (msg.find("Could not find schema for") == std::string::npos) return msg;
  return msg + "\n(the library that registers that operator must be loaded in this process before the package)";
}

// The message for a failed run: the model's own words where torch passes them on (newer torch);
// older torch passes on only which call failed, after the model printed its error on stderr.
std::string run_error(const Options& o, std::string msg, size_t given, std::optional<size_t> spec_inputs) {
  const std::string count_error = "expected inputs vector size to be ";
  if (auto at = msg.find(count_error); at != std::string::npos) {
    size_t want = std::strtoull(msg.c_str() + at + count_error.size(), nullptr, 10);
    return o.package + " takes " + std::to_string(want) + " input tensor(s), but " + o.inputs + " holds " +
           std::to_string(given);
  }
  if (msg.find("API call failed") != std::string::npos) {
    if (spec_inputs && *spec_inputs != given) {
      return o.package + " takes " + std::to_string(*spec_inputs) + " input tensor(s) by its call spec, but " +
             o.inputs + " holds " + std::to_string(given) + " (the model's own error is printed above)";
    }
    msg += "\n(the model's own error is printed above)";
  }
  if (!o.check_inputs) msg += "\n(run without --no-check-inputs to have the model check its inputs)";
  return "running " + o.package + " failed: " + msg;
}

int run(const Options& o) {
  auto meta = read_metadata(o);
  if (o.info) {
    std::map<std::string, std::string> sorted(meta.begin(), meta.end());
    for (const auto& [k, v] : sorted) std::cout << k << ": " << v << "\n";
    return 0;
  }
  c10::Device device = pick_device(o, meta["AOTI_DEVICE_KEY"]);
  auto inputs = read_inputs(o.inputs, device);

  // The generated model checks its inputs' dtypes, shapes, strides and devices only when this is
  // set (read once, on the first run); without it a wrong shape reads out of bounds.
  if (o.check_inputs) setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);

  auto load_start = std::chrono::steady_clock::now();
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        o.package, o.model_name, /*run_single_threaded=*/false, /*num_runners=*/1,
        device.is_cpu() ? c10::DeviceIndex(-1) : device.index());
  } catch (const std::exception& e) {
    throw UserError("cannot load " + o.package + ": " + with_hint(message_of(e)));
  }
  double load_ms = ms_since(load_start);

  // Inputs by the call spec: exact for tensor inputs (the model itself checks the count when run).
  std::optional<size_t> spec_inputs;
  if (auto spec = loader->get_call_spec(); !spec.empty()) spec_inputs = count_spec_leaves(spec[0]);

  std::vector<at::Tensor> outputs;
  auto run_once = [&] {
    try {
      outputs = loader->run(inputs);
    } catch (const std::exception& e) {
      throw UserError(run_error(o, message_of(e), inputs.size(), spec_inputs));
    }
    synchronize(device);
  };
  for (int i = 0; i < o.warmup; ++i) run_once();
  std::vector<double> run_ms;
  for (int i = 0; i < o.runs; ++i) {
    auto start = std::chrono::steady_clock::now();
    run_once();
    run_ms.push_back(ms_since(start));
  }
  write_outputs(o.outputs, outputs);

  if (o.time) {
    double total = 0;
    for (double t : run_ms) total += t;
    std::printf("load: %.3f ms\n", load_ms);
    std::printf("run: %.3f ms mean, %.3f ms best, %d run(s) on %s\n", total / run_ms.size(),
                *std::min_element(run_ms.begin(), run_ms.end()), o.runs, device.str().c_str());
  }
  if (o.show_libraries) {
    for (const auto& lib : loaded_libraries()) std::printf("library: %s\n", lib.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::cerr << "customops-run: " << e.what() << "\n";
    return 2;
  } catch (const UserError& e) {
    std::cerr << "customops-run: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "customops-run: " << message_of(e) << "\n";
    return 1;
  }
}
