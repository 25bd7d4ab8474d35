// customops-run's command line: the help text and the options.
#include <customops/customops.h>
#include <customops/tokenizer.h>

#include <cstdlib>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "runner/runner.h"

namespace customops::runner {
namespace {

constexpr const char* kUsage = R"(usage: customops-run [options] PACKAGE.pt2 INPUTS.pt OUTPUTS.pt
       customops-run --info PACKAGE.pt2
       customops-run generate PACKAGE.pt2 --prompt "ID ID ..." [options]   (see generate --help)
       customops-run serve PACKAGE.pt2 --tokenizer PATH [options]       (see serve --help)

Runs an AOTInductor package that may call customops operators, without Python.

  INPUTS.pt   the model's inputs: a tensor, or a list or tuple of tensors in the order
              torch.export flattens them (positional arguments, then keyword arguments),
              written by torch.save (or torch::jit::pickle_save). Inputs are moved to the
              package's device and made contiguous.
  OUTPUTS.pt  written with the model's outputs as a tuple of CPU tensors (read with torch.load);
              its folder must exist. Nothing is written when the run fails.

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

int parse_count(const std::string& flag, const std::string& value, int min) {
  return static_cast<int>(parse_integer(flag, value, min, std::numeric_limits<int>::max()));
}

}  // namespace

int64_t parse_integer(const std::string& flag, const std::string& value, int64_t min, int64_t max) {
  const std::string expects = flag + " expects an integer >= " + std::to_string(min);
  const std::string too_large = expects + " and <= " + std::to_string(max) + ", got " + runner::quoted(value);
  try {
    size_t used = 0;
    const int64_t n = std::stoll(value, &used);
    if (used == value.size() && n > max) throw UsageError(too_large);
    if (used == value.size() && n >= min) return n;
  } catch (const std::out_of_range&) {
    throw UsageError(too_large);
  } catch (const std::invalid_argument&) {
  }
  throw UsageError(expects + ", got " + runner::quoted(value));
}

std::string option_value(int argc, char** argv, int& i) {
  if (i + 1 >= argc) throw UsageError(std::string(argv[i]) + " expects a value");
  return argv[++i];
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&] { return option_value(argc, argv, i); };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "--version") {
      std::cout << "customops-run " << customops::version() << " (torch " << customops::torch_version()
                << (customops::has_cuda() ? ", CUDA kernels" : ", CPU kernels only")
                << (customops::Tokenizer::available("tokenizer.json") ? ", tokenizer.json" : "")
                << (customops::Tokenizer::available("sentencepiece") ? ", SentencePiece tokenizer" : "")
#ifdef CUSTOMOPS_WITH_SERVE
                << ", serve"
#endif
                << ")\n";
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
  const char* names[] = {"PACKAGE.pt2", "INPUTS.pt", "OUTPUTS.pt"};
  for (size_t i = 0; i < positional.size(); ++i) {
    if (positional[i].empty()) throw UsageError(std::string(names[i]) + " is an empty string (see --help)");
  }
  o.package = positional[0];
  if (!o.info) {
    o.inputs = positional[1];
    o.outputs = positional[2];
  }
  return o;
}

}  // namespace customops::runner
