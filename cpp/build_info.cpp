// Build information and the link anchor of the public API (customops/customops.h).
#include "customops/build_config.h"
#include "customops/customops.h"

namespace customops {

std::string version() { return CUSTOMOPS_VERSION; }
std::string torch_version() { return CUSTOMOPS_TORCH_VERSION; }
bool has_cuda() {
#ifdef CUSTOMOPS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace detail {
int link_anchor() { return 0; }
}  // namespace detail

}  // namespace customops
