// Run-time choice between the copies of a CPU kernel compiled for each instruction set
// (cmake/CustomopsCpuCapabilities.cmake). A kernel file defines its vectorized loops inside
// `namespace customops::CPU_CAPABILITY`; its at::Tensor-level entry points and registrations
// are compiled only in the DEFAULT copy and call CUSTOMOPS_CPU_DISPATCH(kernel, args...).
#pragma once

#include <ATen/Version.h>

#include <string>

namespace customops {

inline bool cpu_use_avx2() {
#ifdef CUSTOMOPS_HAVE_AVX2
  // ATen's own choice ("DEFAULT", "AVX2", "AVX512"; ATEN_CPU_CAPABILITY overrides it).
  static const bool use = at::get_cpu_capability() != "DEFAULT";
  return use;
#else
  return false;
#endif
}

}  // namespace customops

#ifdef CUSTOMOPS_HAVE_AVX2
#define CUSTOMOPS_CPU_KERNEL(ret, name, ...)  \
  namespace DEFAULT { ret name(__VA_ARGS__); } \
  namespace AVX2 { ret name(__VA_ARGS__); }
#define CUSTOMOPS_CPU_DISPATCH(name, ...) \
  (::customops::cpu_use_avx2() ? AVX2::name(__VA_ARGS__) : DEFAULT::name(__VA_ARGS__))
#else
#define CUSTOMOPS_CPU_KERNEL(ret, name, ...) \
  namespace DEFAULT { ret name(__VA_ARGS__); }
#define CUSTOMOPS_CPU_DISPATCH(name, ...) DEFAULT::name(__VA_ARGS__)
#endif
