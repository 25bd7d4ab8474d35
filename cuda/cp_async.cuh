// cp.async (sm_80+): copies global -> shared memory without passing through registers, so a kernel
// can have the next tile (or row) in flight while it computes on this one. A thread's copies are
// visible to it after cp_async_wait; other threads need a barrier after that wait as well.
#pragma once

#include <cstdint>

namespace customops::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read). Bypasses L1.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// kBytes (4, 8 or 16) global -> shared, through L1.
template <int kBytes>
__device__ __forceinline__ void cp_async_ca(uint32_t dst, const void* src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(kBytes));
}

// Closes the group of copies issued since the last commit (an empty group is allowed).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace customops::cuda
