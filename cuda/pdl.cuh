// Programmatic dependent launch (sm_90+): a kernel launched with launch_dependent may start while
// the kernel before it in the stream still runs, once each block of that kernel has called
// launch_dependents (or exited). Before wait_prerequisites it may touch only memory no kernel
// writes (weights, for example), or prefetch into L2 whatever it will read (a hint: cache_attention
// reads a length that may be stale there to pick what to prefetch); wait_prerequisites waits for
// the kernel before it to finish and its writes to be visible. A kernel that reads or writes any other memory calls
// wait_prerequisites first. After a kernel not launched this way, or before sm_90, both device
// functions are no-ops and launch_dependent is a plain launch.
//
// A decode step is a chain of small kernels, each a few microseconds: launched this way, a
// kernel's blocks are resident and its first loads in flight when the previous kernel's last
// blocks finish, instead of the GPU draining between them.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace customops::cuda {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether kernel's code on the current device was compiled for sm_90 or later (its griddepcontrol
// instructions are there). A build may run code compiled for an older architecture on a newer GPU
// (a later GPU JIT-compiles the sm_80 PTX, where griddepcontrol.wait is a no-op): that code must
// not be launched early. ptxVersion is the virtual architecture the running code came from; the
// answer is cached a kernel and device.
inline bool compiled_for_sm90(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = cache.try_emplace({kernel, device}, false);
  if (inserted) {
    cudaFuncAttributes attr{};
    it->second = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.ptxVersion >= 90;
  }
  return it->second;
}

// Lets kernel launch with as much dynamic shared memory as the current device gives a block (the
// opt-in limit less the kernel's static shared memory), set once a kernel and device. Setting the
// attribute to each launch's own size races between host threads launching the kernel with
// different sizes: one may lower it between another's setting and that one's launch, which then
// fails. (The attribute is a limit: the launch and its occupancy follow the launch's own size.)
inline void allow_dynamic_smem(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const auto limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin - attr.sharedSizeBytes;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  done.insert({kernel, device});
}

// kernel<<<grid, block, smem, stream>>>(args...), programmatically dependent on the kernel before
// it where the GPU and the kernel's code are sm_90 or later, the grid's x dimension in clusters of
// cluster_x blocks (which must divide it; more than 1 only where the GPU and the code are sm_90's).
template <typename... Params, typename... Args>
void launch_dependent_in_clusters(void (*kernel)(Params...), dim3 grid, unsigned cluster_x, dim3 block, size_t smem,
                                  cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (at::cuda::getCurrentDeviceProperties()->major >= 9 && compiled_for_sm90(reinterpret_cast<const void*>(kernel))) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = cluster_x;
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs++].val.clusterDim.z = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// The same without clusters.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  launch_dependent_in_clusters(kernel, grid, 1, block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace customops::cuda
