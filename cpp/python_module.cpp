// customops._C: the tiny Python extension that loads libcustomops.so (by linking it, so the
// library and its registrations load exactly once) and reports how it was built. It binds no
// operators: they are reached through torch.ops.customops like any other dispatcher op.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "customops/build_config.h"
#include "customops/customops.h"

namespace nb = nanobind;

namespace {

std::string library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&customops::version), &info) == 0 || info.dli_fname == nullptr) {
    return {};
  }
  return info.dli_fname;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "Loads libcustomops.so and reports its build information.";
  m.def("library_path", &library_path, "Absolute path of the loaded libcustomops.so.");
  m.def("build_info", [] {
    nb::dict d;
    d["version"] = customops::version();
    d["torch_version"] = std::string(CUSTOMOPS_TORCH_PY_VERSION);
    d["libtorch_version"] = customops::torch_version();
    d["cuda"] = customops::has_cuda();
    d["cuda_version"] = std::string(CUSTOMOPS_CUDA_COMPILER);
    d["cuda_archs"] = customops::has_cuda() ? std::string(CUSTOMOPS_CUDA_ARCHS) : std::string();
    d["compiler"] = std::string(CUSTOMOPS_COMPILER);
    d["cpu_threads"] = std::string(CUSTOMOPS_CPU_THREADS);
    return d;
  }, "How libcustomops.so was built: versions, CUDA architectures, compiler, CPU threading.");
}
