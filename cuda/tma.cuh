// Hopper's asynchronous copies and the barriers they complete on (sm_90; used only in code
// compiled for it): mbarriers in shared memory, bulk copies (cp.async.bulk, contiguous bytes) and
// tensor copies (cp.async.bulk.tensor through a CUtensorMap, which also swizzles and zero-fills
// past the tensor's edges), and named barriers among some warps of a block.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace customops::cuda::tma {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// bytes (a multiple of 16, 16-byte aligned ends) global -> shared, completing on bar.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// The box of a 4-d tensor map at coordinates (c0 innermost) global -> shared, completing on bar
// with the box's bytes (zeros past the tensor's edges count too).
__device__ __forceinline__ void tensor_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                               uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The box at src (shared) added element-wise to a 4-d tensor map's box at coordinates (c0
// innermost), in the bulk group this thread commits next; src may be written again once
// bulk_wait_read has seen that group read.
__device__ __forceinline__ void tensor_add_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3, uint32_t src) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::
                   "l"(reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// At most N of this thread's committed bulk groups still reading shared memory (bulk_wait_read) or
// not yet done (bulk_wait).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// A producer/consumer ring's barriers at bars (8 bytes each): first (the loads made once, one
// arrival), then kStages full barriers (one arrival, the producer's expect_tx) and kStages empty ones
// (`consumers` arrivals, once each consumer thread's reads of the stage are done); set up by thread 0,
// then the block meets, for the last time before its warpgroups part.
template <int kStages>
__device__ __forceinline__ void init_ring(uint32_t bars, uint32_t consumers) {
  if (threadIdx.x == 0) {
    mbar_init(bars, 1);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(bars + 8 * (1 + st), 1);
      mbar_init(bars + 8 * (1 + kStages + st), consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// A persistent block's tiles, from its producer thread to its consumers: two slots of a tile index
// (int64) at `at`, each with a full barrier (the producer's arrival) and an empty one (`consumers`
// arrivals): kBytes of shared memory, 8-byte aligned. Thread 0 inits them before the block's last
// __syncthreads.
struct TileSlots {
  static constexpr uint32_t kBytes = 48;  // four barriers, two slots
  uint32_t at;
  __device__ __forceinline__ uint32_t full(int slot) const { return at + 8 * slot; }
  __device__ __forceinline__ uint32_t empty(int slot) const { return at + 16 + 8 * slot; }
  __device__ __forceinline__ void init(uint32_t consumers) const {
    for (int slot = 0; slot < 2; ++slot) {
      mbar_init(full(slot), 1);
      mbar_init(empty(slot), consumers);
    }
  }
  // Hands out the n-th tile (0, 1, ...), once every consumer has taken the one before in its slot.
  __device__ __forceinline__ void put(uint32_t n, int64_t tile) const {
    const int slot = n & 1;
    if (n >= 2) mbar_wait(empty(slot), ((n >> 1) - 1) & 1);
    asm volatile("st.shared.b64 [%0], %1;" ::"r"(at + 32 + 8 * slot), "l"(tile) : "memory");
    mbar_arrive(full(slot));  // (release: the consumers' wait sees the index)
  }
  // The n-th tile handed out; each consumer thread takes every one.
  __device__ __forceinline__ int64_t take(uint32_t n) const {
    const int slot = n & 1;
    mbar_wait(full(slot), (n >> 1) & 1);
    int64_t tile;
    asm volatile("ld.shared.b64 %0, [%1];" : "=l"(tile) : "r"(at + 32 + 8 * slot) : "memory");
    mbar_arrive(empty(slot));
    return tile;
  }
};

// Named barrier `id` (1-15; 0 is __syncthreads') among `threads` threads: sync waits for all of
// them, arrive counts this warp's threads without waiting.
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A warpgroup's registers a thread, set by all its warps (a multiple of 8, 24-256).
template <int N>
__device__ __forceinline__ void regs_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// This thread's warpgroup (threadIdx.x / 128), broadcast from lane 0 so that the compiler knows it
// is the same across the warp: values derived from it (shared-memory addresses, wgmma descriptors,
// barrier ids and the branches on it) can then live in the uniform datapath (CUTLASS does the same).
__device__ __forceinline__ int warpgroup() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

}  // namespace customops::cuda::tma
