// Run-time choice between the copies of a CPU kernel compiled for each instruction set
// (cmake/CustomopsCpuCapabilities.cmake). A kernel file defines its vectorized loops inside
// `namespace customops::CPU_CAPABILITY`; its at::Tensor-level entry points and registrations
// are compiled only in the DEFAULT copy and call CUSTOMOPS_CPU_DISPATCH(kernel, args...).
#pragma once

#include <ATen/Config.h>
#include <ATen/Version.h>

#include <string>

namespace customops {

// ATen's own choice ("DEFAULT", "AVX2", "AVX512"; ATEN_CPU_CAPABILITY overrides it).
enum class CpuCapability { kDefault, kAvx2, kAvx512 };
inline CpuCapability cpu_capability() {
  static const CpuCapability cap = [] {
    const std::string c = at::get_cpu_capability();
    return c == "AVX512" ? CpuCapability::kAvx512 : c == "AVX2" ? CpuCapability::kAvx2 : CpuCapability::kDefault;
  }();
  return cap;
}

}  // namespace customops

// With torch's OpenMP backend, at::parallel_for is parallel only in code compiled with OpenMP
// (cmake/CustomopsTorch.cmake: customops_use_torch_threads); never run serially by accident.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP) && !defined(CUSTOMOPS_SERIAL_CPU)
#error "customops: torch parallelizes with OpenMP, so the CPU kernels must be compiled with -fopenmp"
#endif

#if defined(CUSTOMOPS_HAVE_AVX2) && defined(CUSTOMOPS_HAVE_AVX512)
#define CUSTOMOPS_CPU_KERNEL(ret, name, ...)  \
  namespace DEFAULT { ret name(__VA_ARGS__); } \
  namespace AVX2 { ret name(__VA_ARGS__); }    \
  namespace AVX512 { ret name(__VA_ARGS__); }
#define CUSTOMOPS_CPU_DISPATCH(name, ...)                                               \
  (::customops::cpu_capability() == ::customops::CpuCapability::kAvx512 ? AVX512::name(__VA_ARGS__) \
   : ::customops::cpu_capability() == ::customops::CpuCapability::kAvx2 ? AVX2::name(__VA_ARGS__)   \
                                                                         : DEFAULT::name(__VA_ARGS__))
#else
#define CUSTOMOPS_CPU_KERNEL(ret, name, ...) \
  namespace DEFAULT { ret name(__VA_ARGS__); }
#define CUSTOMOPS_CPU_DISPATCH(name, ...) DEFAULT::name(__VA_ARGS__)
#endif
