// The attention forward on Hopper's warpgroup MMA (wgmma, sm_90a): FlashAttention-3's data flow
// without its warp specialization. A block of two warpgroups owns 128 query rows of one (batch,
// head), 64 a warpgroup; k and v blocks of kKeys keys stream through shared memory in two stages
// (cp.async, the next block loading while this one is computed) and are read by both warpgroups.
// Per key block a warpgroup computes S = Q K^T with Q and K both in shared memory (an m64 x kKeys
// wgmma per 16 columns of D), runs the online softmax on S in registers (the layout of an m64nN
// accumulator is mma.sync's 16x8 tiles, warp w holding rows 16w..16w+15), packs P to 16-bit A
// fragments in registers and adds P V (an m64 x D wgmma per 16 keys, V read N-major from shared
// memory). The tensor cores read B from shared memory once per warpgroup (64 rows) instead of once
// per warp (16 rows) as mma.sync does: what limited the sm_80 kernel.
//
// Shared-memory tiles are [D / 64][rows][64] elements with the 128-byte swizzle wgmma's descriptors
// name: 16-byte chunk c of row r of a 64-column panel sits at c ^ (r % 8), panels 1024-byte
// aligned. A K-major operand (Q, K) steps through a panel 32 bytes (16 columns) at a time; V, N-major,
// steps 16 rows (2048 bytes) at a time, its 64-column panels kKeys * 128 bytes apart.
//
// The kernel is compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the host calls it when the
// build has sm_90a code (CUSTOMOPS_SM90A) and the device is compute capability 9.0.
#pragma once

#include <cstdint>

#include "attention.cuh"
#include "cp_async.cuh"
#include "tma.cuh"

namespace customops::cuda::attention {

// ---- wgmma wrappers -----------------------------------------------------------------------------
// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets (see the PTX ISA, "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (1ull << 62);
}
// desc (sw128_desc of an address a) moved on by `bytes` (a multiple of 16): sw128_desc(a + bytes)
// bit for bit, as shared addresses stay below 2^18 (the start address field, bits 0-13, never carries
// out). A 32-bit add on the low word, which ptxas keeps to one uniform add a wgmma, where a descriptor
// built from each address took five (add, mask, shift, or and a move; CUTLASS's DescriptorIterator
// adds the same way).
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4), hi = static_cast<uint32_t>(desc >> 32);
  return (uint64_t(hi) << 32) | lo;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulators after wgmma_wait: the compiler must not read them earlier.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
// cp.async writes (generic proxy) become visible to wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= a b, m64nNk16 with float accumulators (N / 2 a thread, as N / 8 tiles of 4). a: a K-major descriptor, or an A
// fragment in registers (warp w of the warpgroup: rows 16w..16w+15); b: a descriptor, K-major
// (kTransB 0) or N-major (kTransB 1). accumulate 0 ignores d's old value.
#define CUSTOMOPS_F8(i)                                                                                       \
  "+f"(d[i / 4][0]), "+f"(d[i / 4][1]), "+f"(d[i / 4][2]), "+f"(d[i / 4][3]), "+f"(d[i / 4 + 1][0]), "+f"(d[i / 4 + 1][1]), \
      "+f"(d[i / 4 + 1][2]), "+f"(d[i / 4 + 1][3])
// (kTransA 1: a M-major, which the SS m64n64 form takes for the backward's dQ = dS K from dS^T.)
template <typename T, int kTransB, int kTransA = 0>
__device__ __forceinline__ void wgmma(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
#define CUSTOMOPS_WGMMA_SS(TY)                                                                         \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "%32, %33, p, 1, 1, %36, %35;\n}\n"                                                          \
      : CUSTOMOPS_F8(0), CUSTOMOPS_F8(8), CUSTOMOPS_F8(16), CUSTOMOPS_F8(24)                                                                                   \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB), "n"(kTransA))
  if constexpr (std::is_same_v<T, __half>) {
    CUSTOMOPS_WGMMA_SS("f16");
  } else {
    CUSTOMOPS_WGMMA_SS("bf16");
  }
#undef CUSTOMOPS_WGMMA_SS
}
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define CUSTOMOPS_WGMMA_RS(TY)                                                                         \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                  \
      : CUSTOMOPS_F8(0), CUSTOMOPS_F8(8), CUSTOMOPS_F8(16), CUSTOMOPS_F8(24)                                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (std::is_same_v<T, __half>) {
    CUSTOMOPS_WGMMA_RS("f16");
  } else {
    CUSTOMOPS_WGMMA_RS("bf16");
  }
#undef CUSTOMOPS_WGMMA_RS
}

template <typename T, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[16][4], uint64_t a, uint64_t b, int accumulate) {
#define CUSTOMOPS_WGMMA_SS(TY)                                                                         \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "%64, %65, p, 1, 1, 0, %67;\n}\n"                                                          \
      : CUSTOMOPS_F8(0), CUSTOMOPS_F8(8), CUSTOMOPS_F8(16), CUSTOMOPS_F8(24), CUSTOMOPS_F8(32), CUSTOMOPS_F8(40), CUSTOMOPS_F8(48), CUSTOMOPS_F8(56)                                                                                   \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (std::is_same_v<T, __half>) {
    CUSTOMOPS_WGMMA_SS("f16");
  } else {
    CUSTOMOPS_WGMMA_SS("bf16");
  }
#undef CUSTOMOPS_WGMMA_SS
}
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define CUSTOMOPS_WGMMA_RS(TY)                                                                         \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                  \
      : CUSTOMOPS_F8(0), CUSTOMOPS_F8(8), CUSTOMOPS_F8(16), CUSTOMOPS_F8(24), CUSTOMOPS_F8(32), CUSTOMOPS_F8(40), CUSTOMOPS_F8(48), CUSTOMOPS_F8(56)                                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (std::is_same_v<T, __half>) {
    CUSTOMOPS_WGMMA_RS("f16");
  } else {
    CUSTOMOPS_WGMMA_RS("bf16");
  }
#undef CUSTOMOPS_WGMMA_RS
}

// m64n80k16, A and B descriptors: S of the head dim 256 forward's 80-key blocks.
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[10][4], uint64_t a, uint64_t b, int accumulate) {
#define CUSTOMOPS_WGMMA_SS(TY)                                                                         \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." TY "." TY " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "  \
      "%40, %41, p, 1, 1, 0, %43;\n}\n"                                                          \
      : CUSTOMOPS_F8(0), CUSTOMOPS_F8(8), CUSTOMOPS_F8(16), CUSTOMOPS_F8(24), CUSTOMOPS_F8(32)                 \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (std::is_same_v<T, __half>) {
    CUSTOMOPS_WGMMA_SS("f16");
  } else {
    CUSTOMOPS_WGMMA_SS("bf16");
  }
#undef CUSTOMOPS_WGMMA_SS
}

#undef CUSTOMOPS_F8

// ---- swizzled [D / 64][rows][64] tiles ----------------------------------------------------------
template <int kRows>
__device__ __forceinline__ uint32_t sw128_at(uint32_t base, int row, int col) {  // col: a multiple of 8
  return base + (col >> 6) * (kRows * 128) + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4);
}

// Rows [r0, r0 + kRows) of a row-major [n, D] matrix (row stride `stride`) into a tile, zero past n.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void load_sw128(uint32_t base, const T* src, int64_t stride, int64_t r0, int64_t n) {
  constexpr int kRowChunks = D / 8, kChunks = kRows * kRowChunks;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int idx = i * kThreads + threadIdx.x;
    const int row = idx / kRowChunks, c = idx % kRowChunks;
    const bool valid = r0 + row < n;
    cp_async16(sw128_at<kRows>(base, row, c * 8), src + (valid ? r0 + row : 0) * stride + c * 8, valid);
  }
}

// ---- products over swizzled tiles (the forwards' and the backward's) -----------------------------
// d (m64 x 8 kNT) = A B^T over D with both operands K-major swizzled tiles: A a warpgroup's 64 rows
// at a (panels kARows * 128 bytes apart), B 8 kNT rows at b (panels kBRows * 128 bytes apart).
template <typename T, int D, int kARows, int kBRows, int kNT>
__device__ __forceinline__ void wgmma_over_d(float (&d)[kNT][4], uint32_t a, uint32_t b) {
  const uint64_t da = sw128_desc(a, 16, 1024), db = sw128_desc(b, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = (kk % 4) * 32;  // 16 columns into the panel
    wgmma<T, 0>(d, desc_plus(da, (kk / 4) * (kARows * 128) + off), desc_plus(db, (kk / 4) * (kBRows * 128) + off), kk > 0);
  }
}

// d (m64 x 8 kNT) += A B with A the register fragments of kK / 16 k-steps and B the first 8 kNT
// columns from b of a [kK, D] tile, N-major.
template <typename T, int kK, int kNT>
__device__ __forceinline__ void wgmma_rs_n_major(float (&d)[kNT][4], const uint32_t (&a)[kK / 16][4], uint32_t b) {
  const uint64_t db = sw128_desc(b, kK * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) wgmma<T, 1>(d, a[kk], desc_plus(db, kk * 16 * 128), 1);
}

// ---- forward ------------------------------------------------------------------------------------
constexpr int kSm90Rows = 128, kSm90Threads = 256;  // two warpgroups of 64 query rows

template <int D, int kKeys>
constexpr int sm90_fwd_smem_bytes() {
  return (kSm90Rows + 4 * kKeys) * D * 2 + 1024;  // q, k and v in two stages; 1024 to align
}

template <typename T, int D, int kKeys, bool kCausal>
__global__ void __launch_bounds__(kSm90Threads, 1) attention_fwd_sm90_kernel(FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kRows = kSm90Rows, kThreads = kSm90Threads, kDT = D / 8, kNT = kKeys / 8;
  constexpr uint32_t kQBytes = kRows * D * 2, kKVBytes = kKeys * D * 2;
  extern __shared__ char smem[];
  const uint32_t sq = (smem_addr(smem) + 1023) & ~1023u;
  auto k_base = [&](int st) { return sq + kQBytes + st * 2 * kKVBytes; };
  auto v_base = [&](int st) { return sq + kQBytes + st * 2 * kKVBytes + kKVBytes; };

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const FwdBlock blk = fwd_block<kRows, kKeys, kCausal>(p);
  const int64_t m0 = blk.m0, shift = blk.shift;
  const int nblocks = blk.nblocks;
  const T* q = head_rows<const T>(p.q, p.qs, blk.b, blk.h);
  const T* k = head_rows<const T>(p.k, p.ks, blk.b, blk.hk);
  const T* v = head_rows<const T>(p.v, p.vs, blk.b, blk.hk);
  load_sw128<kRows, D, kThreads>(sq, q, p.qs[2], m0, p.sq);
  if (nblocks > 0) {
    load_sw128<kKeys, D, kThreads>(k_base(0), k, p.ks[2], 0, p.sk);
    load_sw128<kKeys, D, kThreads>(v_base(0), v, p.vs[2], 0, p.sk);
  }
  cp_async_commit();

  float o[kDT][4];
  zero(o);
  float row_max[2] = {-kInfF, -kInfF}, row_sum[2] = {0.f, 0.f};
  const int warp_row = wg * 64 + warp * 16;  // this thread's rows: warp_row + lane / 4 (+ 8)
  const uint32_t q_wg = sq + wg * 64 * 128;   // this warpgroup's 64 rows of each q panel

  for (int j = 0; j < nblocks; ++j) {
    const int stage = j & 1;
    // Block j is in (and visible to wgmma), every warpgroup is done with block j - 1: its stage
    // takes block j + 1, which loads while this one is computed.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (j + 1 < nblocks) {
      load_sw128<kKeys, D, kThreads>(k_base(stage ^ 1), k, p.ks[2], int64_t(j + 1) * kKeys, p.sk);
      load_sw128<kKeys, D, kThreads>(v_base(stage ^ 1), v, p.vs[2], int64_t(j + 1) * kKeys, p.sk);
      cp_async_commit();
    }

    // s = q k^T over this key block: q and k K-major in shared memory, 16 columns of D a step.
    float s[kNT][4];
    wgmma_fence();
    wgmma_over_d<T, D, kRows, kKeys>(s, q_wg, k_base(stage));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s);

    // Masked keys to -inf, online softmax (probabilities in place), what was accumulated rescaled.
    const int64_t n0 = int64_t(j) * kKeys;
    if (n0 + kKeys > p.sk || (kCausal && n0 + kKeys - 1 > m0 + shift)) {
      mask_scores<kNT, kCausal>(s, m0 + warp_row, n0, p.sk, shift, lane);
    }
    float corr[2];
    softmax_step(s, row_max, row_sum, corr, p.scale_log2);
    scale_rows(o, corr);

    // o += p v: p as A fragments (16 keys each), v N-major from shared memory, 16 keys a step.
    uint32_t a[kKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) accumulators_to_a<T>(a[kk], s[2 * kk], s[2 * kk + 1]);
    wgmma_fence();
    wgmma_rs_n_major<T, kKeys>(o, a, v_base(stage));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
  }
  if (nblocks == 0) cp_async_wait<0>();

  store_rows<T>(o, row_max, row_sum, head_rows<T>(p.out, p.os, blk.b, blk.h), p.os[2],
                p.lse + (blk.b * p.hq + blk.h) * p.sq, m0 + warp_row, p.sq, lane);
#else
  __trap();  // launched only on sm_90a builds for compute capability 9.0 (see the host side)
#endif
}


// ---- forward, warp-specialized (FlashAttention-3's structure) ------------------------------------
// 1 + kConsumers warpgroups. The first produces: one thread loads a tile's 64 kConsumers query
// rows once and then each key block's k and v through the tensor memory accelerator (TMA: tensor
// maps of q, k and v, the 128-byte swizzle done by the copy, zeros past the edges) into a ring of
// kWsStages stages, on mbarriers (full: the copy landed; empty: every consumer is done with the
// stage). The others consume, 64 query rows each, as the kernel above computes, but never meet at a
// block barrier, and take turns on the tensor cores ("ping-pong" with two, round robin with three;
// a named barrier each): a warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back,
// lets the next issue its two, and computes the softmax of S_j while the others' products run. P_{j-1} V_{j-1} in the same turn as Q K_j^T is the in-warpgroup
// overlap: the softmax never waits for its own product of P and V. The producer gives up registers
// (setmaxnreg) for the consumers' accumulators. Head dims 64 and 128 take key blocks of 128; 256
// takes 80 (its two stages of k and v, 160 KiB, and q, 64 KiB, fill a block's
// shared memory; its O, 128 registers a thread, leaves room for S of 80 keys; 4-7% faster than 64-key
// blocks on an H100, CUSTOMOPS_ATTENTION_WS_KEYS256=64 keeps those), its P V as two m64n128 halves of O.
// kConsumers 3 (192 query rows a block, FlashAttention-3's tile at head dim 64, where a key block's
// products are short beside its softmax) gives each consumer fewer registers (setmaxnreg 160).
// Blocks are persistent (one an SM by default, attention.cu's ws_grid): each takes tiles (query
// blocks of a head, order_tile's order) from a counter until none is left, the producer handing
// each tile's index to the consumers and loading the next tile's q as soon as the last Q K^T of the
// current one has read it, k and v through the same ring from tile to tile.
constexpr int kWsStages = 2;
template <int D>
constexpr int ws_keys() {
  return D == 256 ? 80 : 128;
}
constexpr int ws_rows(int consumers) { return 64 * consumers; }
constexpr int ws_threads(int consumers) { return 128 * (consumers + 1); }

template <int D, int kConsumers = 2, int kKeys = ws_keys<D>()>
constexpr int sm90_ws_smem_bytes() {
  // tiles; barriers (q's two, the ring's) and the tile slots; align
  return (ws_rows(kConsumers) + 2 * kWsStages * kKeys) * D * 2 + 8 * (2 + 4 * kWsStages) + tma::TileSlots::kBytes + 1024;
}

// Columns [128 h, 128 h + 128) of an m64 x D accumulator, as the m64n128 wgmma takes them.
template <int H, int kDT>
__device__ __forceinline__ float (&o_half(float (&o)[kDT][4]))[16][4] {
  static_assert(kDT % 16 == 0 && H < kDT / 16, "a half of 128 columns");
  return *reinterpret_cast<float(*)[16][4]>(&o[H * 16]);
}

template <typename T, int D, bool kCausal, int kConsumers = 2, int kKeys = ws_keys<D>()>
__global__ void __launch_bounds__(ws_threads(kConsumers), 1)
    attention_fwd_sm90_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                                 const __grid_constant__ CUtensorMap tv, FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kConsumers == 2 || (kConsumers == 3 && D == 64), "two consumer warpgroups, or three at head dim 64 "
                "(160 registers a consumer thread: O, S and P of head dim 128 would spill)");
  static_assert(kKeys % 16 == 0 && (kKeys * 128) % 1024 == 0, "key blocks of 16-row steps, 1024-byte panels");
  constexpr int kRows = ws_rows(kConsumers), kStages = kWsStages, kDT = D / 8, kNT = kKeys / 8;
  constexpr uint32_t kConsumerThreads = 128 * kConsumers;
  constexpr int kPanels = D / 64;
  constexpr uint32_t kQBytes = kRows * D * 2, kKVBytes = kKeys * D * 2;
  extern __shared__ char smem[];
  const uint32_t sq = (smem_addr(smem) + 1023) & ~1023u;
  auto k_base = [&](int st) { return sq + kQBytes + st * 2 * kKVBytes; };
  auto v_base = [&](int st) { return sq + kQBytes + st * 2 * kKVBytes + kKVBytes; };
  const uint32_t bars = sq + kQBytes + kStages * 2 * kKVBytes;
  // q is loaded once a tile (full_q) and reloaded once every consumer's last Q K^T read it (empty_q)
  const uint32_t full_q = bars, empty_q = bars + 8;
  auto full_k = [&](int st) { return bars + 8 * (2 + st); };
  auto full_v = [&](int st) { return bars + 8 * (2 + kStages + st); };
  // a stage's k and v are released apart: k once S = Q K^T is in, v once P V is
  auto empty_k = [&](int st) { return bars + 8 * (2 + 2 * kStages + st); };
  auto empty_v = [&](int st) { return bars + 8 * (2 + 3 * kStages + st); };
  const tma::TileSlots tiles{bars + 8 * (2 + 4 * kStages)};  // each tile's index, producer to consumers

  const int wg = tma::warpgroup();
  if (threadIdx.x == 0) {
    tma::mbar_init(full_q, 1);
    tma::mbar_init(empty_q, kConsumerThreads);
    for (int st = 0; st < kStages; ++st) {
      tma::mbar_init(full_k(st), 1);
      tma::mbar_init(full_v(st), 1);
      tma::mbar_init(empty_k(st), kConsumerThreads);  // every consumer thread, once its reads of the stage are done
      tma::mbar_init(empty_v(st), kConsumerThreads);
    }
    tiles.init(kConsumerThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the last block-wide barrier: the warpgroups part here

  // The block's tiles: blockIdx.x first, then each one the counter hands out, until the tiles run
  // out (the index past the last, handed to the consumers too, ends their loop).
  auto tile_of = [&](int64_t t) {
    const GridTile g = order_tile(t, p.work.heads, p.work.mblocks, kCausal ? p.chunk : 0);
    return fwd_tile<kRows, kKeys, kCausal>(p, g.head / p.hq, g.head % p.hq, g.rank, p.work.mblocks);
  };
  if (wg == 0) {  // the producer
    tma::regs_down<kConsumers == 2 ? 40 : 32>();
    if (threadIdx.x != 0) return;
    int64_t tile = blockIdx.x;
    uint32_t handed = 0, qs = 0;  // tiles handed to the consumers, q loads
    int g = 0;                    // key blocks loaded (the ring's position)
    for (;; ++handed) {
      tiles.put(handed, std::min(tile, p.work.tiles));
      if (tile >= p.work.tiles) break;  // (no copy in flight when the block exits: the consumers waited for each)
      const FwdBlock blk = tile_of(tile);
      if (blk.nblocks > 0) {
        const int b = static_cast<int>(blk.b), h = static_cast<int>(blk.h), hk = static_cast<int>(blk.hk);
        if (qs > 0) tma::mbar_wait(empty_q, (qs - 1) & 1);
        ++qs;
        tma::mbar_arrive_expect_tx(full_q, kQBytes);
#pragma unroll
        for (int pc = 0; pc < kPanels; ++pc) {
          tma::tensor_load_4d(sq + pc * kRows * 128, &tq, pc * 64, static_cast<int>(blk.m0), h, b, full_q);
        }
        for (int j = 0; j < blk.nblocks; ++j, ++g) {
          const int st = g % kStages;
          const auto phase = static_cast<uint32_t>((g / kStages - 1) & 1);
          if (g >= kStages) tma::mbar_wait(empty_k(st), phase);
          tma::mbar_arrive_expect_tx(full_k(st), kKVBytes);
#pragma unroll
          for (int pc = 0; pc < kPanels; ++pc) {
            tma::tensor_load_4d(k_base(st) + pc * kKeys * 128, &tk, pc * 64, j * kKeys, hk, b, full_k(st));
          }
          if (g >= kStages) tma::mbar_wait(empty_v(st), phase);
          tma::mbar_arrive_expect_tx(full_v(st), kKVBytes);
#pragma unroll
          for (int pc = 0; pc < kPanels; ++pc) {
            tma::tensor_load_4d(v_base(st) + pc * kKeys * 128, &tv, pc * 64, j * kKeys, hk, b, full_v(st));
          }
        }
      }
      tile = next_tile(p.work);
    }
    return;
  }

  tma::regs_up<kConsumers == 2 ? 232 : 160>();
  const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int warp_row = c * 64 + warp * 16;  // this thread's rows: warp_row + lane / 4 (+ 8)
  const uint32_t q_wg = sq + c * 64 * 128;  // this warpgroup's 64 rows of each q panel
  // Turns on the tensor cores, round robin: named barrier 1 + c is this warpgroup's; the first
  // consumer goes first (the last one's arrive before the first tile stands for a turn before it).
  // Each turn ends with an arrive on the next one's barrier, the last one's last turn too (of a tile,
  // or of the block: the first consumer takes one more wait at the end), so that every barrier's
  // arrivals are matched.
  constexpr uint32_t kPair = 256;  // a barrier's waiting warpgroup and the one that arrives
  const uint32_t next = 1 + (c + 1) % kConsumers;
  if (c == kConsumers - 1) tma::named_arrive(1, kPair);

  uint32_t taken = 0, qs = 0;  // tiles taken from the producer, q loads waited for
  int g = 0;                   // key blocks consumed (the ring's position)
  for (;; ++taken) {
    const int64_t tile = tiles.take(taken);
    if (tile >= p.work.tiles) break;
    const FwdBlock blk = tile_of(tile);
    const int64_t m0 = blk.m0, shift = blk.shift;
    const int nblocks = blk.nblocks;
    // A warpgroup whose 64 rows all lie past sq (in a head's last query block where sq is not a
    // multiple of kRows: head dim 64's 192-row blocks pad 1024 rows to 1152) computes nothing. It
    // still takes its turns, so that the others keep theirs, and releases q and each stage once they
    // have landed (so that its arrivals never run ahead of a barrier's phase), but issues no product
    // and stores nothing; the others' turns then find the tensor cores free.
    if (m0 + c * 64 >= p.sq) {
      if (nblocks > 0) {
        tma::mbar_wait(full_q, qs & 1);
        ++qs;
      }
      for (int j = 0; j < nblocks; ++j) {
        const int gj = g + j, st = gj % kStages;
        const auto phase = static_cast<uint32_t>((gj / kStages) & 1);
        tma::mbar_wait(full_k(st), phase);
        tma::named_sync(1 + c, kPair);
        tma::named_arrive(next, kPair);
        tma::mbar_arrive(empty_k(st));
        if (j == nblocks - 1) tma::mbar_arrive(empty_q);
        tma::mbar_wait(full_v(st), phase);
        tma::mbar_arrive(empty_v(st));
      }
      g += nblocks;
      continue;  // (the next tile: a return would leave the turns and the slots short of this warpgroup)
    }

    float o[kDT][4];
    zero(o);
    float row_max[2] = {-kInfF, -kInfF}, row_sum[2] = {0.f, 0.f};
    uint32_t a[kKeys / 16][4];  // P of the last key block, 16-bit A fragments
    float s[kNT][4];
    // Key blocks j >= mask_from have keys to mask: past sk, or (causal) past a row's limit m0 + shift
    // + row. (j + 1) kKeys > min(sk, m0 + shift + 1) is the test on n0 = j kKeys it replaces, once a
    // tile instead of in 64 bits a block.
    const int64_t key_lim = kCausal ? std::min<int64_t>(p.sk, m0 + shift + 1) : p.sk;
    const int mask_from = key_lim > 0 ? static_cast<int>(std::min<int64_t>(key_lim / kKeys, nblocks)) : 0;

    auto issue_qk = [&](int st) { wgmma_over_d<T, D, kRows, kKeys>(s, q_wg, k_base(st)); };
    auto issue_pv = [&](int st) {
      if constexpr (D <= 128) {
        wgmma_rs_n_major<T, kKeys>(o, a, v_base(st));
      } else {  // two m64n128 halves of O: v's panels 0-1 and 2-3
        wgmma_rs_n_major<T, kKeys>(o_half<0>(o), a, v_base(st));
        wgmma_rs_n_major<T, kKeys>(o_half<1>(o), a, v_base(st) + 2 * kKeys * 128);
      }
    };
    // Block 0 (S_0 only) before the loop, and no condition around a product inside it: ptxas
    // serializes every wgmma of a loop whose branches it cannot pair (an issue in one, its wait in
    // another).
    if (nblocks > 0) {
      tma::mbar_wait(full_q, qs & 1);
      ++qs;
      const int st = g % kStages;
      tma::mbar_wait(full_k(st), static_cast<uint32_t>((g / kStages) & 1));
      tma::named_sync(1 + c, kPair);
      wgmma_fence();
      issue_qk(st);
      wgmma_commit();
      tma::named_arrive(next, kPair);
      wgmma_wait<0>();
      wgmma_fence_operands(s);
      tma::mbar_arrive(empty_k(st));
      if (nblocks == 1) tma::mbar_arrive(empty_q);  // (q's last read)
      if (mask_from == 0) {
        mask_scores<kNT, kCausal>(s, m0 + warp_row, 0, p.sk, shift, lane);
      }
      float corr[2];
      softmax_step(s, row_max, row_sum, corr, p.scale_log2);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) accumulators_to_a<T>(a[kk], s[2 * kk], s[2 * kk + 1]);
    }
    for (int j = 1; j < nblocks; ++j) {
      const int gj = g + j, st = gj % kStages, prev = (gj - 1) % kStages;
      tma::mbar_wait(full_k(st), static_cast<uint32_t>((gj / kStages) & 1));
      tma::named_sync(1 + c, kPair);
      wgmma_fence();
      issue_qk(st);
      wgmma_commit();
      tma::mbar_wait(full_v(prev), static_cast<uint32_t>(((gj - 1) / kStages) & 1));
      wgmma_fence();
      issue_pv(prev);
      wgmma_commit();
      tma::named_arrive(next, kPair);
      wgmma_wait<1>();  // S_j is in (k_j is free); P_{j-1} V_{j-1} may still run
      wgmma_fence_operands(s);
      tma::mbar_arrive(empty_k(st));
      if (j == nblocks - 1) tma::mbar_arrive(empty_q);  // (q's last read: the next tile's may load)
      // Masked keys to -inf, the online softmax (probabilities in place).
      if (j >= mask_from) {
        mask_scores<kNT, kCausal>(s, m0 + warp_row, int64_t(j) * kKeys, p.sk, shift, lane);
      }
      float corr[2];
      softmax_step(s, row_max, row_sum, corr, p.scale_log2);
      wgmma_wait<0>();  // O has P_{j-1} V_{j-1}: v_{j-1} is free, and a and O may change
      wgmma_fence_operands(o);
      tma::mbar_arrive(empty_v(prev));
      scale_rows(o, corr);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) accumulators_to_a<T>(a[kk], s[2 * kk], s[2 * kk + 1]);
    }
    if (nblocks > 0) {  // the last block's P V, outside the turns
      const int gl = g + nblocks - 1, final_stage = gl % kStages;
      tma::mbar_wait(full_v(final_stage), static_cast<uint32_t>((gl / kStages) & 1));
      wgmma_fence();
      issue_pv(final_stage);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      tma::mbar_arrive(empty_v(final_stage));
    }
    g += nblocks;
    store_rows<T>(o, row_max, row_sum, head_rows<T>(p.out, p.os, blk.b, blk.h), p.os[2],
                  p.lse + (blk.b * p.hq + blk.h) * p.sq, m0 + warp_row, p.sq, lane);
  }
  if (c == 0) tma::named_sync(1, kPair);  // (the last consumer's last arrive)
#else
  __trap();  // launched only on sm_90a builds for compute capability 9.0 (see the host side)
#endif
}


}  // namespace customops::cuda::attention
