// customops-run: runs an AOTInductor package (.pt2) that calls customops operators, with no
// Python. It links libcustomops.so, so the proxy executor finds every customops:: schema when it
// loads the package, and libtorch (AOTIModelPackageLoader), never libpython. Tensors go in and out
// in the torch.save / torch::jit::pickle_save format, so torch.load reads the outputs directly.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "runner/runner.h"

namespace customops::runner {
namespace {

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

// The message for a failed run: the model's own words where torch passes them on (newer torch);
// older torch passes on only which call failed, after the model printed its error on stderr.
std::string run_error(const Options& o, std::string msg, size_t given, std::optional<size_t> spec_inputs) {
  const std::string count_error = "expected inputs vector size to be ";
  if (auto at = msg.find(count_error); at != std::string::npos) {
    size_t want = std::strtoull(msg.c_str() + at + count_error.size(), nullptr, 10);
    return o.package + " takes " + std::to_string(want) + " input tensor(s), but " + o.inputs + " holds " +
           std::to_string(given);
  }
  // Inductor's check of an input's size against one the model already took from another input
  // (e.g. the batch): "expected size 2==3, stride 16==16 at dim=0 Error in op: input ...".
  const std::string size_error = "expected size ";
  if (auto at = msg.find(size_error); at != std::string::npos && msg.find("Error in op: input") != std::string::npos) {
    long long got = 0, want = 0, dim = 0;
    auto dim_at = msg.find("at dim=", at);
    if (std::sscanf(msg.c_str() + at + size_error.size(), "%lld==%lld", &got, &want) == 2 && got != want &&
        dim_at != std::string::npos && std::sscanf(msg.c_str() + dim_at, "at dim=%lld", &dim) == 1) {
      return "running " + o.package + " failed: an input of " + o.inputs + " has size " + std::to_string(got) +
             " in dim " + std::to_string(dim) + " where the model expects " + std::to_string(want) +
             " (inputs that share a dynamic dimension, such as the batch, must agree on its size)";
    }
  }
  if (msg.find("API call failed") != std::string::npos) {
    if (spec_inputs && *spec_inputs != given) {
      return o.package + " takes " + std::to_string(*spec_inputs) + " input tensor(s) by its call spec, but " +
             o.inputs + " holds " + std::to_string(given) + " (the model's own error is printed above)";
    }
    msg += " (the model's own error is printed above)";
  }
  if (!o.check_inputs) msg += " (run without --no-check-inputs to have the model check its inputs)";
  return "running " + o.package + " failed: " + msg;
}

int run(const Options& o) {
  // SIGINT or SIGTERM ends it at once, the unpacked package removed
  StopSignals signals("interrupted");
  std::unordered_map<std::string, std::string> meta;
  {
    const TempFolder unpacked("customops-run");  // (torch unpacks the package to read its metadata)
    const TmpdirScope unpack_here(unpacked.path());
    meta = read_metadata(o);
  }
  if (o.info) {
    std::map<std::string, std::string> sorted(meta.begin(), meta.end());
    for (const auto& [k, v] : sorted) std::cout << k << ": " << v << "\n";
    return 0;
  }
  c10::Device device = pick_device(o, meta["AOTI_DEVICE_KEY"]);
  check_outputs_path(o.outputs);
  auto inputs = read_inputs(o.inputs, device);

  auto load_start = std::chrono::steady_clock::now();
  LoadedPackage package(o.package, o.model_name, device, o.check_inputs);
  double load_ms = ms_since(load_start);
  const std::optional<size_t> spec_inputs = package.spec_inputs();

  std::vector<at::Tensor> outputs;
  auto run_once = [&] {
    try {
      outputs = package.run(inputs);
    } catch (const ModelError& e) {
      throw UserError(run_error(o, e.what(), inputs.size(), spec_inputs));
    }
  };
  double total_ms = 0, best_ms = 0;
  without_backtraces([&] {
    for (int i = 0; i < o.warmup; ++i) run_once();
    for (int i = 0; i < o.runs; ++i) {
      auto start = std::chrono::steady_clock::now();
      run_once();
      double ms = ms_since(start);
      total_ms += ms;
      best_ms = i == 0 ? ms : std::min(best_ms, ms);
    }
  });
  write_outputs(o.outputs, outputs);

  if (o.time) {
    std::printf("load: %.3f ms\n", load_ms);
    std::printf("run: %.3f ms mean, %.3f ms best, %d run(s) on %s\n", total_ms / o.runs, best_ms, o.runs,
                device.str().c_str());
  }
  if (o.show_libraries) {
    for (const auto& lib : loaded_libraries()) std::printf("library: %s\n", lib.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace customops::runner

int main(int argc, char** argv) {
  using namespace customops::runner;
  report_crashes();
  try {
    if (argc > 1 && std::string(argv[1]) == "generate") return generate_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "serve") return serve_main(argc - 1, argv + 1);
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
  } catch (...) {
    std::cerr << "customops-run: failed with an exception that is not a std::exception\n";
    return 1;
  }
}
