// The attention backward on Hopper's warpgroup MMA (wgmma, sm_90a), head dims 64 and 128: two
// kernels after attention.cu's prep kernel (dt = rowsum(dO * out) - grad_lse and lse2 = lse *
// log2(e), +inf for a row that saw no key), so that no gradient is accumulated across blocks:
//
// - dK, dV: a block of two warpgroups owns 128 keys of one (batch, kv head), 64 a warpgroup, with
//   k and v in shared memory, and walks the query blocks (64 rows; 128 at head dim 64 in the
//   warp-specialized kernel, below) of every query head of its group
//   that see one of its keys, q, dO, lse2 and dt loading (cp.async, two stages) while the last are
//   computed. Per query block a warpgroup computes S^T = K Q^T and dP^T = V dO^T (both operands
//   K-major in shared memory, m64 x 64 queries), then P^T = exp2(S^T scale log2(e) - lse2) and
//   dS^T = P^T (dP^T - dt) in registers, and adds dV += P^T dO and dK += dS^T Q with P^T and dS^T
//   as register A fragments (the layout of an m64 accumulator is the A fragments' once packed) and
//   dO and Q N-major from shared memory. dK and dV stay in registers over the whole walk and are
//   written once (dK times the scale).
// - dQ (a pass of its own; CUSTOMOPS_ATTENTION_BWD_DQ=pass, the default only at head dim 64 with 64
//   query rows a dK/dV step and under torch.use_deterministic_algorithms): a block of two warpgroups owns 128 query rows of one (batch, head), 64 a warpgroup, with q
//   and dO in shared memory, and walks the key blocks (64 keys) its rows see: S = Q K^T, dP = dO V^T,
//   P and dS as above, dQ += dS K (dS as A fragments, K N-major); dQ is written once, times the
//   scale. S and dP are computed twice (here and above): 7 products instead of 5, and no float32
//   dQ accumulator in memory, no atomics.
// - Or dQ in the dK/dV kernel (kAtomicDq, CUSTOMOPS_ATTENTION_BWD_DQ=atomic): 5 products. Each step
//   stores dS^T to shared memory (keys x queries, the M-major A of dQ += dS K) and adds its dQ into
//   a zeroed float32 [B, Hq, Sq_pad, D] with 8-byte atomic adds: at head dim 128 warpgroup w takes
//   columns [64 w, 64 w + 64) over the block's 128 keys (both warpgroups' dS^T, a block barrier), at
//   64 every column over its own 64 keys; either way an m64n64 product, 32 registers.
//
// - Or dQ in the warp-specialized dK/dV kernel (kReduceDq, CUSTOMOPS_ATTENTION_BWD_DQ=reduce; the
//   default at head dims 128 and 64): the same shares, written to shared memory and added
//   to the accumulator by the TMA, issued by a dQ writer warp (see that kernel). At head dim 64 with
//   128 query rows a step (the default step there) the shares split the step's rows instead: warpgroup
//   w takes rows [64 w, 64 w + 64) over the block's 128 keys (both warpgroups' dS^T, a block barrier).
//   Its sums land in the order the blocks reach them (not bitwise reproducible run to run).
//
// The warp-specialized kernels (attention_bwd_*_ws_kernel, the default where the TMA reads the
// inputs) take the steps of the cp.async ones (dkdv_step, dq_step) with a producer warpgroup loading.
// At head dim 64 the dK/dV kernel takes 128 query rows a step (the products are short there, and a
// step's waits cost as much as its work); CUSTOMOPS_ATTENTION_BWD_DQ_KEYS=128 gives the dQ kernel 128
// keys a step there too.
//
// Compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL), launched where the forward's wgmma kernels
// are (use_sm90 in attention.cu).
#pragma once

#include <cstdint>

#include "attention.cuh"
#include "attention_sm90.cuh"
#include "cp_async.cuh"

namespace customops::cuda::attention {

constexpr int kSm90BwdKeys = 128, kSm90BwdRows = 64;  // dK, dV: keys a block, query rows a step
constexpr int kSm90DqRows = 128, kSm90DqKeys = 64;    // dQ: query rows a block, keys a step
constexpr int kSm90BwdThreads = 256;                  // two warpgroups

template <int D, bool kAtomicDq = false>
constexpr int sm90_dkdv_smem_bytes() {
  // k, v: [128, D]; q, dO: two stages of [64, D]; lse2, dt: two stages of 64 floats; dS^T: [128, 64]
  // (kAtomicDq); 1024 to align
  return (2 * kSm90BwdKeys + 4 * kSm90BwdRows) * D * 2 + 4 * kSm90BwdRows * 4 +
         (kAtomicDq ? kSm90BwdKeys * kSm90BwdRows * 2 : 0) + 1024;
}
template <int D>
constexpr int sm90_dq_smem_bytes() {
  // q, dO: [128, D]; k, v: two stages of [64, D]; 1024 to align
  return (2 * kSm90DqRows + 4 * kSm90DqKeys) * D * 2 + 1024;
}

// acc * scale (a warp's 16 rows of an m64 x D accumulator, rows from row0) into rows below n of a
// row-major matrix (row stride `stride`).
template <typename T, int kDT>
__device__ __forceinline__ void store_accumulator(const float (&acc)[kDT][4], float scale, T* base, int64_t stride,
                                                  int64_t row0, int64_t n, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + lane / 4 + r * 8;
    if (row >= n) continue;
    T* dst = base + row * stride + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack2<T>(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
    }
  }
}

// kAtomicDq or kReduceDq, before dK's product is issued (which reads da: no other instruction may until it is
// waited for): dS^T (da, this thread's keys' A fragments) into the tile at sds, [kRows / 64][kKeys][64]
// (128 query rows: two panels of 64).
template <int kKeys, int kRows>
__device__ __forceinline__ void store_ds_t(const uint32_t (&da)[kRows / 16][4], uint32_t sds, int wg, int warp,
                                           int lane) {
  static_assert(kRows == 64 || kRows == 128, "a key row of dS^T is one or two 128-byte panels");
  if constexpr (kRows == 128) {
    // stmatrix: 8 instructions, not 32 scalar stores; lane l gives row l % 8 of 8x8 matrix l / 8 (da[kk][l / 8]:
    // keys + 8 (l / 8 % 2), columns 16 kk + 8 (l / 16)). The swizzle's chunk (2 kk + l / 16) ^ (key % 8), with
    // key % 8 = l % 8, is (2 kk % 8) ^ (l / 16 ^ l % 8): immediate XORs on one row address (the scalar
    // stores' 8 swizzled addresses, held across the walk, spilled at 240 registers).
    const int key = wg * 64 + warp * 16 + (lane / 8 % 2) * 8 + lane % 8;
    const uint32_t row = (sds + key * 128) | (((lane / 16) ^ (lane % 8)) << 4);
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk) {
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       (row ^ ((2 * kk % 8) << 4)) + (kk / 4) * kKeys * 128),
                   "r"(da[kk][0]), "r"(da[kk][1]), "r"(da[kk][2]), "r"(da[kk][3])
                   : "memory");
    }
    return;
  }
  const int key_row = wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk)
#pragma unroll
    for (int half = 0; half < 2; ++half)  // accumulator tile 2 kk + half, rows key_row (+ 8)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = key_row + r * 8, col = (2 * kk + half) * 8 + (lane % 4) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sw128_at<kKeys>(sds, key, col & ~7) + (col & 7) * 2),
                     "r"(da[kk][half * 2 + r])
                     : "memory");
      }
}

// The backward kernels' named barriers (0 is __syncthreads'). Each id is a constant where a barrier
// is used: ptxas reserves all 16 for an id known only at run time.
enum BwdBarrier : uint32_t {
  kBarDs = 1,         // dS^T written (dq_share): both consumer warpgroups at head dim 128, kBarDs + wg at 64
  kBarDqWritten = 3,  // + c: consumer c's dQ tile written, for the writer warp (kReduceDq)
  kBarDqFree = 5,     // + c: that tile free again (the TMA has read it)
};
constexpr uint32_t kHandoffThreads = 128 + 32;  // a consumer warpgroup and the dQ writer warp
static_assert(kBarDqFree + 1 < 16, "16 named barriers a block");

// bar.sync / bar.arrive on barrier base + c (c: 0 or 1), the id a constant on either branch.
__device__ __forceinline__ void sync_of(uint32_t base, int c, uint32_t threads) {
  if (c == 0) {
    tma::named_sync(base, threads);
  } else {
    tma::named_sync(base + 1, threads);
  }
}
__device__ __forceinline__ void arrive_of(uint32_t base, int c, uint32_t threads) {
  if (c == 0) {
    tma::named_arrive(base, threads);
  } else {
    tma::named_arrive(base + 1, threads);
  }
}

// kAtomicDq or kReduceDq, after every thread's store_ds_t (dS^T at sds): issues and commits this
// warpgroup's share of dQ = dS K (see the top; unscaled), K's tile at k_tile, not waited for (its
// accumulator: no instruction may touch dq until then). wg: the consumer warpgroup (0 or 1); named
// barriers kBarDs and kBarDs + 1. kRows 128 (head dim 64, kReduceDq): the share is warpgroup w's
// query rows [64 w, 64 w + 64) (dS^T's panel w) over the block's 128 keys, as FlashAttention-3 splits it.
template <typename T, int D, int kKeys, int kRows = kSm90BwdRows>
__device__ __forceinline__ void dq_share(float (&dq)[8][4], uint32_t sds, uint32_t k_tile, int wg) {
  static_assert(D == 64 || D == 128, "m64n64 dQ shares: a 64-column panel of K a warpgroup");
  static_assert(kRows == kSm90BwdRows || (kRows == 128 && D == 64), "128 query rows: head dim 64");
  constexpr bool kAllKeys = D == 128 || kRows == 128;  // over the block's keys: both warpgroups' dS^T
  fence_proxy_async();
  constexpr int kDqKeys = kAllKeys ? kKeys : 64;  // keys a warpgroup's dQ share sums over
  if constexpr (kAllKeys) {
    tma::named_sync(kBarDs, 256);  // both warpgroups' dS^T
  } else {
    sync_of(kBarDs, wg, 128);  // this warpgroup's
  }
  const uint32_t a = sds + (kRows == 128 ? wg * kKeys * 128 : D == 128 ? 0 : wg * 64 * 128);  // dS^T's panel w
  const uint32_t b = k_tile + (D == 128 ? wg * kKeys * 128 : kRows == 128 ? 0 : wg * 64 * 128);  // K's panel w, or this warpgroup's keys
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kDqKeys / 16; ++kk) {
    wgmma<T, 1, 1>(dq, sw128_desc(a + kk * 16 * 128, kKeys * 128, 1024), sw128_desc(b + kk * 16 * 128, kKeys * 128, 1024),
                   kk > 0);
  }
  wgmma_commit();
}

// kAtomicDq: a dQ share times the scale added to p.dq from row `row0` of the padded [B * Hq * Sq_pad,
// D] accumulator by 8-byte atomics.
template <int D>
__device__ __forceinline__ void atomic_add_dq(const float (&dq)[8][4], const BwdParams& p, int wg, int warp, int lane,
                                              int64_t row0) {
  float* dst = p.dq + (row0 + warp * 16 + lane / 4) * D + (D == 128 ? wg * 64 : 0) + (lane % 4) * 2;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      atomicAdd(reinterpret_cast<float2*>(dst + r * 8 * D + nt * 8),
                make_float2(dq[nt][2 * r] * p.scale, dq[nt][2 * r + 1] * p.scale));
    }
}

// kReduceDq: a dQ share times the scale into the [64, 64] float32 tile at tile as two boxes of 32
// columns (64 rows of 128 bytes, 8 KiB apart) in the TMA's 128-byte swizzle (16-byte chunk c of row
// r at chunk c ^ (r % 8)), for the TMA to add to the accumulator: a warp's stores hit every bank.
__device__ __forceinline__ void store_dq_tile(const float (&dq)[8][4], float scale, uint32_t tile, int warp,
                                              int lane) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + lane / 4 + r * 8, col = nt * 8 + (lane % 4) * 2;
      const uint32_t at = tile + (col / 32) * 8192 + row * 128 + ((((col % 32) / 4) ^ (row % 8)) << 4) + (col % 4) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(dq[nt][2 * r] * scale),
                   "f"(dq[nt][2 * r + 1] * scale)
                   : "memory");
    }
}

// How many steps of each query head's walk (its query blocks from m_first on, per_head of them) must
// mask, the first ones: every step where keys [n0, n0 + kKeys) pass sk; else, causal, those whose
// rows hold one (r) that misses a key, r + shift < n0 + kKeys - 1: rows below `last`, so the query
// blocks below ceil(last / kRows) (one to three a head by how shift falls on the blocks). Rows past
// sq need none (lse2 +inf, dt 0). The other steps (all but about 2 of 65 a head at 8k tokens) take
// no mask code: as a run-time `if` it was predicated code on every step, before S^T's product (the
// warp-specialized kernel's causal step at head dim 128: 880 SASS instructions, 599 unmasked; the
// full mask's 621). split false (CUSTOMOPS_ATTENTION_BWD_MASK_SPLIT=0): every step, as before.
template <int kKeys, int kRows, bool kCausal>
__device__ __forceinline__ int64_t masked_steps(bool split, int64_t n0, int64_t m_first, int64_t per_head,
                                                int64_t shift, int64_t sk) {
  if (!split || n0 + kKeys > sk) return per_head;
  if (!kCausal) return 0;
  const int64_t last = n0 + kKeys - 1 - shift;
  const int64_t blocks = last > 0 ? (last + kRows - 1) / kRows : 0;
  return std::min(per_head, std::max<int64_t>(0, blocks - m_first));
}

// A step of the dK/dV walk for a warpgroup's 64 keys (k_wg, v_wg: its rows of the k and v tiles;
// q_tile, g_tile: the step's q and dO; lse2, dt: their rows' floats) with four commit groups, each
// waited for as late as its result is needed (P^T computed while dP^T runs, dS^T while dV's product
// does): S^T = K Q^T, dP^T = V dO^T, P^T, dV += P^T dO, dS^T = P^T (dP^T - dt), before_dk(dS^T's
// A fragments), dK += dS^T Q. Returns with dV's and dK's products committed, not waited for.
// kMasked: the step may see a masked key (past sk or, causal, past a query's limit: key0, m0_shift
// and sk say which); the others take no mask code (see masked_steps).
// kDvAfterDs: dV's product issued once dS^T is computed (as FlashAttention-3 orders it), so that P^T's
// A fragments are not live beside S^T and dP^T (128 query rows: 240 registers; with the dQ pass too
// once the walk holds both variants of the step, which spilled 96 bytes and serialized the wgmma).
template <typename T, int D, int kKeys, int kRows, bool kCausal, bool kMasked, bool kDvAfterDs = false,
          typename BeforeDk>
__device__ __forceinline__ void dkdv_step(float (&dk)[D / 8][4], float (&dv)[D / 8][4], uint32_t k_wg, uint32_t v_wg,
                                          uint32_t q_tile, uint32_t g_tile, const float* lse2, const float* dt,
                                          float scale_log2, int64_t key0, int64_t m0_shift, int64_t sk, int lane,
                                          BeforeDk&& before_dk) {
  constexpr int kNT = kRows / 8;
  float s[kNT][4], dp[kNT][4];
  wgmma_fence();
  wgmma_over_d<T, D, kKeys, kRows>(s, k_wg, q_tile);  // S^T = K Q^T
  wgmma_commit();
  wgmma_over_d<T, D, kKeys, kRows>(dp, v_wg, g_tile);  // dP^T = V dO^T
  wgmma_commit();
  wgmma_wait<1>();
  wgmma_fence_operands(s);
  transposed_probs<kNT, kCausal, kMasked>(s, lse2, scale_log2, true, key0, m0_shift, sk, lane);  // P^T in place
  uint32_t pa[kRows / 16][4], da[kRows / 16][4];
  if constexpr (!kDvAfterDs) {
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk) accumulators_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
    wgmma_fence();
    wgmma_rs_n_major<T, kRows>(dv, pa, g_tile);  // dV += P^T dO
    wgmma_commit();
    wgmma_wait<1>();  // dP^T is in (dV's product may still run)
  } else {
    wgmma_wait<0>();  // dP^T is in
  }
  wgmma_fence_operands(dp);
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - dt[nt * 8 + (lane % 4) * 2 + (e & 1)]);
  if constexpr (kDvAfterDs) {
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk) accumulators_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
  }
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) accumulators_to_a<T>(da[kk], dp[2 * kk], dp[2 * kk + 1]);
  if constexpr (kDvAfterDs) {
    wgmma_fence();
    wgmma_rs_n_major<T, kRows>(dv, pa, g_tile);  // dV += P^T dO
    wgmma_commit();
  }
  before_dk(da);
  wgmma_fence();
  wgmma_rs_n_major<T, kRows>(dk, da, q_tile);  // dK += dS^T Q
  wgmma_commit();
}

template <typename T, int D, bool kCausal, bool kAtomicDq = false>
__global__ void __launch_bounds__(kSm90BwdThreads, 1) attention_bwd_dkdv_sm90_kernel(BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kKeys = kSm90BwdKeys, kRows = kSm90BwdRows, kThreads = kSm90BwdThreads;
  constexpr int kDT = D / 8;
  constexpr uint32_t kKBytes = kKeys * D * 2, kQBytes = kRows * D * 2;
  extern __shared__ char smem[];
  const uint32_t pad = ((smem_addr(smem) + 1023) & ~1023u) - smem_addr(smem);
  const uint32_t sk = smem_addr(smem) + pad, sv = sk + kKBytes;
  auto q_base = [&](int st) { return sv + kKBytes + st * 2 * kQBytes; };
  auto g_base = [&](int st) { return sv + kKBytes + st * 2 * kQBytes + kQBytes; };
  float* const stats = reinterpret_cast<float*>(smem + pad + 2 * kKBytes + 4 * kQBytes);  // [stage][lse2, dt][kRows]
  [[maybe_unused]] const uint32_t sds = sv + kKBytes + 4 * kQBytes + 4 * kRows * 4;  // dS^T [kKeys][kRows] (kAtomicDq), 1024-aligned

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const GridTile g = grid_tile<kCausal>(p.dkdv_chunk);  // (causal: key block 0, the longest walk, first)
  const int64_t b = g.head / gridDim.y, hk = g.head % gridDim.y, n0 = g.rank * kKeys;
  const int64_t shift = p.sk - p.sq;
  // The query blocks that see a key of this block (causal: rows from n0 - shift on), per head of
  // the group; the walk goes head by head.
  const int64_t m_first = kCausal ? std::max<int64_t>(0, n0 - shift) / kRows : 0;
  const int64_t per_head = std::max<int64_t>(0, (p.sq + kRows - 1) / kRows - m_first);
  const int64_t steps = per_head * p.group;
  const int64_t mask_steps = masked_steps<kKeys, kRows, kCausal>(p.mask_split, n0, m_first, per_head, shift, p.sk);

  load_sw128<kKeys, D, kThreads>(sk, head_rows<const T>(p.k, p.ks, b, hk), p.ks[2], n0, p.sk);
  load_sw128<kKeys, D, kThreads>(sv, head_rows<const T>(p.v, p.vs, b, hk), p.vs[2], n0, p.sk);
  // Step i's q and dO rows and their lse2 and dt into stage st (rows past sq: zeros, and lse2 +inf
  // and dt 0 from the prep kernel, whose rows run to a multiple of 64).
  auto load_step = [&](int64_t i, int st) {
    const int64_t h = hk * p.group + i / per_head, m0 = (m_first + i % per_head) * kRows;
    load_sw128<kRows, D, kThreads>(q_base(st), head_rows<const T>(p.q, p.qs, b, h), p.qs[2], m0, p.sq);
    load_sw128<kRows, D, kThreads>(g_base(st), head_rows<const T>(p.go, p.gs, b, h), p.gs[2], m0, p.sq);
    if (threadIdx.x < kRows / 2) {  // 16 chunks of 4 floats each of lse2 and dt
      const int which = threadIdx.x / (kRows / 4), c = threadIdx.x % (kRows / 4);
      const float* src = (which == 0 ? p.lse2 : p.dt) + (b * p.hq + h) * p.sq_pad + m0 + c * 4;
      cp_async16(smem_addr(stats + (st * 2 + which) * kRows + c * 4), src);
    }
  };
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
  zero(dk);
  zero(dv);
  const int key_row = wg * 64 + warp * 16;  // this thread's keys: n0 + key_row + lane / 4 (+ 8)
  const uint32_t k_wg = sk + wg * 64 * 128, v_wg = sv + wg * 64 * 128;  // this warpgroup's 64 rows of each panel

  for (int64_t i = 0; i < steps; ++i) {
    const int st = static_cast<int>(i & 1);
    // Step i is in (and visible to wgmma), both warpgroups are done with step i - 1, whose stage
    // takes step i + 1.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (i + 1 < steps) {
      load_step(i + 1, st ^ 1);
      cp_async_commit();
    }
    const int64_t m0 = (m_first + i % per_head) * kRows;

    const float* lse2 = stats + st * 2 * kRows;
    auto step = [&](auto mask) {
      dkdv_step<T, D, kKeys, kRows, kCausal, decltype(mask)::value>(
          dk, dv, k_wg, v_wg, q_base(st), g_base(st), lse2, lse2 + kRows, p.scale_log2, n0 + key_row, m0 + shift,
          p.sk, lane, [&](const uint32_t(&da)[kRows / 16][4]) {
            if constexpr (kAtomicDq) store_ds_t<kKeys, kRows>(da, sds, wg, warp, lane);
          });
      if constexpr (kAtomicDq) {
        float dq[8][4];
        dq_share<T, D, kKeys>(dq, sds, sk, wg);
        wgmma_wait<0>();
        wgmma_fence_operands(dq);
        atomic_add_dq<D>(dq, p, wg, warp, lane, (b * p.hq + hk * p.group + i / per_head) * p.sq_pad + m0);
      }
      wgmma_wait<0>();
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
    };
    // (no product in flight where the two variants join: else ptxas serializes the wgmma)
    if (i % per_head < mask_steps) {
      step(std::true_type{});
    } else {
      step(std::false_type{});
    }
  }
  cp_async_wait<0>();  // (no step: k and v may still be landing)

  store_accumulator<T>(dk, p.scale, head_rows<T>(p.dk, p.dks, b, hk), p.dks[2], n0 + key_row, p.sk, lane);
  store_accumulator<T>(dv, 1.f, head_rows<T>(p.dv, p.dvs, b, hk), p.dvs[2], n0 + key_row, p.sk, lane);
#else
  __trap();  // launched only on sm_90a builds for compute capability 9.0 (see the host side)
#endif
}

// The dK/dV kernel warp-specialized (FlashAttention-3's structure): a producer warpgroup whose one
// thread loads k and v once and each step's q and dO (the TMA, 128-byte swizzle) and lse2 and dt
// (bulk copies) into two stages on mbarriers, and two consumer warpgroups of 64 keys that run
// dkdv_step and release a stage once their products have read it: no block barrier and no loads
// issued by the computing threads. Registers: producer 24, consumers 240 (setmaxnreg).
//
// kReduceDq (CUSTOMOPS_ATTENTION_BWD_DQ=reduce): dQ here too, 5 products and no dQ kernel. Each step
// a consumer stores dS^T (two buffers by the step's parity: a warpgroup rewrites one only after both
// have passed the next step's barrier, so after both read it), takes its dQ share as kAtomicDq does
// (dq_share), writes it times the scale to its own [64, 64] float32 tile and hands it to the dQ
// writer warp (the producer warpgroup's second), which adds the tile to the zeroed float32 [B, Hq,
// Sq_pad, D] accumulator through the TMA (tdq: boxes of 64 rows of 32 columns), a reduction in L2
// nobody waits for, and hands the tile back once the copy has read it (named barriers kBarDqWritten and kBarDqFree).
// With 128 query rows a step (head dim 64) consumer c's tile is rows [64 c, 64 c + 64) of the step
// over every column (dq_share), added at row m0 + 64 c: a dQ row is reduced once a step, not once
// a warpgroup, and the accumulator's rows run to a multiple of 128.
constexpr int kSm90BwdWsThreads = 384;
constexpr int kSm90DqTileRows = 64;  // a consumer's dQ tile: [64, 64] float32 (the accumulator's map: boxes of 64 rows)
constexpr uint32_t kSm90DqTileBytes = kSm90DqTileRows * 64 * 4;
template <int kRows = kSm90BwdRows>
constexpr uint32_t sm90_ds_bytes() {  // a dS^T buffer: [kRows / 64][128 keys][64] 16-bit
  return kSm90BwdKeys * kRows * 2;
}
template <int D, bool kReduceDq = false, int kRows = kSm90BwdRows>
constexpr int sm90_dkdv_ws_smem_bytes() {
  // k, v: [128, D]; two stages of q, dO: [kRows, D] and lse2, dt: kRows floats; barriers; 1024 to
  // align; kReduceDq: two dS^T buffers and a dQ tile a consumer
  return (2 * kSm90BwdKeys + 4 * kRows) * D * 2 + 4 * kRows * 4 + 8 * 8 + 1024 +
         (kReduceDq ? 2 * sm90_ds_bytes<kRows>() + 2 * kSm90DqTileBytes : 0);
}
static_assert(sm90_dkdv_ws_smem_bytes<64, true, 128>() <= 227 * 1024, "shared memory: 227 KiB a block");
static_assert(sm90_dkdv_ws_smem_bytes<128, true>() <= 227 * 1024, "shared memory: 227 KiB a block");

// kRows: query rows a step, 64 (kSm90BwdRows) or, at head dim 64 (the default there), 128: twice
// the work a step for the same waits.
template <typename T, int D, bool kCausal, bool kReduceDq = false, int kRows = kSm90BwdRows>
__global__ void __launch_bounds__(kSm90BwdWsThreads, 1)
    attention_bwd_dkdv_sm90_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tg,
                                      const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                                      const __grid_constant__ CUtensorMap tdq, BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kRows == kSm90BwdRows || (kRows == 128 && D == 64), "128 query rows a step at head dim 64");
  constexpr int kKeys = kSm90BwdKeys, kStages = 2, kPanels = D / 64;
  constexpr int kDT = D / 8;
  constexpr uint32_t kKBytes = kKeys * D * 2, kQBytes = kRows * D * 2, kStatBytes = kRows * 4;
  constexpr uint32_t kConsumerThreads = 256;
  extern __shared__ char smem[];
  const uint32_t sk = (smem_addr(smem) + 1023) & ~1023u, sv = sk + kKBytes;
  auto q_base = [&](int st) { return sv + kKBytes + st * 2 * kQBytes; };
  auto g_base = [&](int st) { return q_base(st) + kQBytes; };
  // kReduceDq: dS^T [kRows / 64][kKeys][64] of steps of parity i & 1, and consumer c's dQ tile
  constexpr uint32_t kDsBytes = sm90_ds_bytes<kRows>();
  const uint32_t sds = sv + kKBytes + kStages * 2 * kQBytes, sdq = sds + 2 * kDsBytes;
  const uint32_t stats = sds + (kReduceDq ? 2 * kDsBytes + 2 * kSm90DqTileBytes : 0);  // [stage][lse2, dt][kRows] floats
  auto lse2_base = [&](int st) { return stats + st * 2 * kStatBytes; };
  const uint32_t bars = stats + kStages * 2 * kStatBytes;
  const uint32_t full_kv = bars;
  auto full = [&](int st) { return bars + 8 * (1 + st); };
  auto empty = [&](int st) { return bars + 8 * (1 + kStages + st); };
  const float* const stats_ptr = reinterpret_cast<const float*>(smem + (stats - smem_addr(smem)));

  const int wg = tma::warpgroup();
  const GridTile g = grid_tile<kCausal>(p.dkdv_chunk);  // (causal: key block 0, the longest walk, first)
  const int64_t b = g.head / gridDim.y, hk = g.head % gridDim.y, n0 = g.rank * kKeys;
  const int64_t shift = p.sk - p.sq;
  const int64_t m_first = kCausal ? std::max<int64_t>(0, n0 - shift) / kRows : 0;
  const int64_t per_head = std::max<int64_t>(0, (p.sq + kRows - 1) / kRows - m_first);
  const int64_t steps = per_head * p.group;
  // (128 rows with kReduceDq: the producer counts the walk's head and query block as the writer warp
  // and the consumers do, for the int64 divisions' call (its return address on the stack) and registers)
  constexpr bool kCountedWalk = kReduceDq && kRows == 128;
  tma::init_ring<kStages>(bars, kConsumerThreads);  // (empty: once a consumer's products read the stage)

  // kReduceDq: consumer c's dQ tile is handed to the writer warp at kBarDqWritten + c (the consumer's
  // 128 threads arrive, the writer's 32 wait) and back at kBarDqFree + c (the TMA has read it: the
  // writer arrives, the consumer waits before writing the next one).
  if (wg == 0) {  // the producer
    tma::regs_down<24>();
    if constexpr (kReduceDq) {
      if (threadIdx.x / 32 == 1) {  // the dQ writer warp: adds each consumer's tile to the accumulator
        if (steps == 0) return;
        const int lane = threadIdx.x % 32;
        arrive_of(kBarDqFree, 0, kHandoffThreads);  // both tiles free at first
        arrive_of(kBarDqFree, 1, kHandoffThreads);
        int h = static_cast<int>(hk * p.group), mb = 0;  // step i's head and query block (of per_head)
        for (int64_t i = 0; i < steps; ++i, mb = mb + 1 == per_head ? 0 : mb + 1, h += mb == 0) {
          const int m0 = static_cast<int>((m_first + mb) * kRows);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            sync_of(kBarDqWritten, c, kHandoffThreads);
            if (lane == 0) {
#pragma unroll
              for (int box = 0; box < 2; ++box) {
                // (head dim 128: c's columns; 128 rows a step: c's rows)
                tma::tensor_add_4d(&tdq, (D == 128 ? c * 64 : 0) + box * 32, m0 + (kRows == 128 ? c * 64 : 0), h,
                                   static_cast<int>(b), sdq + c * kSm90DqTileBytes + box * 8192);
              }
              tma::bulk_commit();
              tma::bulk_wait_read<0>();
            }
            __syncwarp();
            if (i + 1 < steps) arrive_of(kBarDqFree, c, kHandoffThreads);  // (the last tiles: no consumer waits for them)
          }
        }
        if (lane == 0) tma::bulk_wait<0>();  // (the adds done before the block's shared memory goes)
        return;
      }
    }
    if (threadIdx.x != 0 || steps == 0) return;  // (no copy in flight when the block exits)
    uint64_t policy;  // lse2 and dt: read again by every key block of the head
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    tma::mbar_arrive_expect_tx(full_kv, 2 * kKBytes);
#pragma unroll
    for (int pc = 0; pc < kPanels; ++pc) {
      tma::tensor_load_4d(sk + pc * kKeys * 128, &tk, pc * 64, static_cast<int>(n0), static_cast<int>(hk),
                          static_cast<int>(b), full_kv);
      tma::tensor_load_4d(sv + pc * kKeys * 128, &tv, pc * 64, static_cast<int>(n0), static_cast<int>(hk),
                          static_cast<int>(b), full_kv);
    }
    [[maybe_unused]] int wh = 0, wmb = 0;  // kCountedWalk: step i's i / per_head and i % per_head
    for (int64_t i = 0; i < steps; ++i) {
      const int st = static_cast<int>(i % kStages);
      if (i >= kStages) tma::mbar_wait(empty(st), static_cast<uint32_t>((i / kStages - 1) & 1));
      const int64_t h = hk * p.group + (kCountedWalk ? wh : i / per_head);
      const int64_t m0 = (m_first + (kCountedWalk ? wmb : i % per_head)) * kRows;
      if constexpr (kCountedWalk) {
        wmb = wmb + 1 == per_head ? 0 : wmb + 1;
        wh += wmb == 0;
      }
      tma::mbar_arrive_expect_tx(full(st), 2 * kQBytes + 2 * kStatBytes);
#pragma unroll
      for (int pc = 0; pc < kPanels; ++pc) {  // (rows past sq: zeros, the TMA's fill)
        tma::tensor_load_4d(q_base(st) + pc * kRows * 128, &tq, pc * 64, static_cast<int>(m0), static_cast<int>(h),
                            static_cast<int>(b), full(st));
        tma::tensor_load_4d(g_base(st) + pc * kRows * 128, &tg, pc * 64, static_cast<int>(m0), static_cast<int>(h),
                            static_cast<int>(b), full(st));
      }
      // (rows past sq: lse2 +inf and dt 0 from the prep kernel, whose rows run to a multiple of 64)
      const int64_t at = (b * p.hq + h) * p.sq_pad + m0;
      tma::bulk_load(lse2_base(st), p.lse2 + at, kStatBytes, full(st), policy);
      tma::bulk_load(lse2_base(st) + kStatBytes, p.dt + at, kStatBytes, full(st), policy);
    }
    return;
  }

  tma::regs_up<240>();
  const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float dk[kDT][4], dv[kDT][4];
  zero(dk);
  zero(dv);
  const int key_row = c * 64 + warp * 16;  // this thread's keys: n0 + key_row + lane / 4 (+ 8)
  const uint32_t k_wg = sk + c * 64 * 128, v_wg = sv + c * 64 * 128;  // this warpgroup's 64 rows of each panel
  if (steps > 0) tma::mbar_wait(full_kv, 0);
  const int mask_steps =
      static_cast<int>(masked_steps<kKeys, kRows, kCausal>(p.mask_split, n0, m_first, per_head, shift, p.sk));
  int wmb = 0;  // step i's i % per_head, counted (no 64-bit division before S^T's product)
  for (int64_t i = 0; i < steps; ++i) {
    const int st = static_cast<int>(i % kStages);
    tma::mbar_wait(full(st), static_cast<uint32_t>((i / kStages) & 1));
    const int64_t m0 = (m_first + wmb) * kRows;
    const bool masked = wmb < mask_steps;
    wmb = wmb + 1 == per_head ? 0 : wmb + 1;
    const float* lse2 = stats_ptr + st * 2 * kRows;
    const uint32_t ds = sds + static_cast<uint32_t>(i & 1) * kDsBytes;
    [[maybe_unused]] float dq[8][4];
    // (kReduceDq: dQ's product issued before dK's, so that dQ's tile is written while dK's runs)
    auto step = [&](auto mask) {
      dkdv_step<T, D, kKeys, kRows, kCausal, decltype(mask)::value, kRows == 128>(
          dk, dv, k_wg, v_wg, q_base(st), g_base(st), lse2, lse2 + kRows, p.scale_log2, n0 + key_row, m0 + shift,
          p.sk, lane, [&](const uint32_t(&da)[kRows / 16][4]) {
            if constexpr (kReduceDq) {
              store_ds_t<kKeys, kRows>(da, ds, c, warp, lane);
              __syncwarp();  // (converged for the aligned barrier and wgmma)
              dq_share<T, D, kKeys, kRows>(dq, ds, sk, c);
            }
          });
      if constexpr (kReduceDq) {
        wgmma_wait<1>();  // dQ's product (dK's may still run)
        wgmma_fence_operands(dq);
        sync_of(kBarDqFree, c, kHandoffThreads);  // the tile is free (the writer warp saw the TMA read the last one)
        store_dq_tile(dq, p.scale, sdq + c * kSm90DqTileBytes, warp, lane);
        fence_proxy_async();
        __syncwarp();
        arrive_of(kBarDqWritten, c, kHandoffThreads);  // written: the writer warp adds it
      }
      wgmma_wait<0>();
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
    };
    // (no product in flight where the two variants join: else ptxas serializes the wgmma)
    if (masked) {
      step(std::true_type{});
    } else {
      step(std::false_type{});
    }
    tma::mbar_arrive(empty(st));
  }
  store_accumulator<T>(dk, p.scale, head_rows<T>(p.dk, p.dks, b, hk), p.dks[2], n0 + key_row, p.sk, lane);
  store_accumulator<T>(dv, 1.f, head_rows<T>(p.dv, p.dvs, b, hk), p.dvs[2], n0 + key_row, p.sk, lane);
#else
  __trap();  // launched only on sm_90a builds for compute capability 9.0 (see the host side)
#endif
}

// The dQ kernels: lse2 and dt of this thread's two rows (row0 + lane / 4, and 8 below) of head bh
// (b * Hq + h); rows past sq, +inf and 0.
__device__ __forceinline__ void load_row_stats(const BwdParams& p, int64_t bh, int64_t row0, int lane, float (&lse2)[2],
                                               float (&dt)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + lane / 4 + r * 8;
    const int64_t at = bh * p.sq_pad + row;
    lse2[r] = row < p.sq ? p.lse2[at] : kInfF;
    dt[r] = row < p.sq ? p.dt[at] : 0.f;
  }
}

// A step of the dQ walk for a warpgroup's 64 query rows (q_wg, g_wg: its rows of the q and dO tiles;
// rows row0 + lane / 4 (+ 8), their lse2 and dt in registers) over a key block (k_tile, v_tile; keys
// from n0): S = Q K^T, dP = dO V^T (P computed while dP's product runs), dS = P (dP - dt),
// dQ += dS K; waited for.
template <typename T, int D, int kRows, int kKeys, bool kCausal>
__device__ __forceinline__ void dq_step(float (&dq)[D / 8][4], uint32_t q_wg, uint32_t g_wg, uint32_t k_tile,
                                        uint32_t v_tile, const float (&lse2)[2], const float (&dt)[2],
                                        float scale_log2, int64_t row0, int64_t n0, int64_t sk, int64_t shift,
                                        bool masked, int lane) {
  constexpr int kNT = kKeys / 8;
  float s[kNT][4], dp[kNT][4];
  wgmma_fence();
  wgmma_over_d<T, D, kRows, kKeys>(s, q_wg, k_tile);  // S = Q K^T
  wgmma_commit();
  wgmma_over_d<T, D, kRows, kKeys>(dp, g_wg, v_tile);  // dP = dO V^T
  wgmma_commit();
  wgmma_wait<1>();
  wgmma_fence_operands(s);
  if (masked) mask_scores<kNT, kCausal>(s, row0, n0, sk, shift, lane);
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = exp2_nonpositive(fmaf(s[nt][e], scale_log2, -lse2[e >> 1]));
  wgmma_wait<0>();
  wgmma_fence_operands(dp);
  uint32_t da[kKeys / 16][4];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - dt[e >> 1]);
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) accumulators_to_a<T>(da[kk], dp[2 * kk], dp[2 * kk + 1]);
  wgmma_fence();
  wgmma_rs_n_major<T, kKeys>(dq, da, k_tile);  // dQ += dS K
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(dq);
}

template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kSm90BwdThreads, 1) attention_bwd_dq_sm90_kernel(BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kRows = kSm90DqRows, kKeys = kSm90DqKeys, kThreads = kSm90BwdThreads;
  constexpr int kDT = D / 8;
  constexpr uint32_t kQBytes = kRows * D * 2, kKBytes = kKeys * D * 2;
  extern __shared__ char smem[];
  const uint32_t sq = (smem_addr(smem) + 1023) & ~1023u, sg = sq + kQBytes;
  auto k_base = [&](int st) { return sg + kQBytes + st * 2 * kKBytes; };
  auto v_base = [&](int st) { return sg + kQBytes + st * 2 * kKBytes + kKBytes; };

  const int wg = tma::warpgroup(), warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  // (causal: the last query blocks, which see the most keys, first)
  const GridTile g = grid_tile<kCausal>(p.dq_chunk);
  const int64_t b = g.head / gridDim.y, h = g.head % gridDim.y, hk = h / p.group;
  const int64_t m0 = (kCausal ? gridDim.x - 1 - g.rank : g.rank) * int64_t(kRows);
  const int64_t shift = p.sk - p.sq;
  const int64_t key_end = kCausal ? std::min<int64_t>(p.sk, m0 + kRows + shift) : p.sk;
  const int nblocks = key_end > 0 ? static_cast<int>((key_end + kKeys - 1) / kKeys) : 0;
  const T* k = head_rows<const T>(p.k, p.ks, b, hk);
  const T* v = head_rows<const T>(p.v, p.vs, b, hk);

  load_sw128<kRows, D, kThreads>(sq, head_rows<const T>(p.q, p.qs, b, h), p.qs[2], m0, p.sq);
  load_sw128<kRows, D, kThreads>(sg, head_rows<const T>(p.go, p.gs, b, h), p.gs[2], m0, p.sq);
  if (nblocks > 0) {
    load_sw128<kKeys, D, kThreads>(k_base(0), k, p.ks[2], 0, p.sk);
    load_sw128<kKeys, D, kThreads>(v_base(0), v, p.vs[2], 0, p.sk);
  }
  cp_async_commit();

  const int warp_row = wg * 64 + warp * 16;  // this thread's rows: m0 + warp_row + lane / 4 (+ 8)
  float lse2[2], dt[2];
  load_row_stats(p, b * p.hq + h, m0 + warp_row, lane, lse2, dt);
  float dq[kDT][4];
  zero(dq);
  const uint32_t q_wg = sq + wg * 64 * 128, g_wg = sg + wg * 64 * 128;

  for (int j = 0; j < nblocks; ++j) {
    const int st = j & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (j + 1 < nblocks) {
      load_sw128<kKeys, D, kThreads>(k_base(st ^ 1), k, p.ks[2], int64_t(j + 1) * kKeys, p.sk);
      load_sw128<kKeys, D, kThreads>(v_base(st ^ 1), v, p.vs[2], int64_t(j + 1) * kKeys, p.sk);
      cp_async_commit();
    }
    const int64_t n0 = int64_t(j) * kKeys;
    dq_step<T, D, kRows, kKeys, kCausal>(dq, q_wg, g_wg, k_base(st), v_base(st), lse2, dt, p.scale_log2,
                                         m0 + warp_row, n0, p.sk, shift,
                                         n0 + kKeys > p.sk || (kCausal && n0 + kKeys - 1 > m0 + shift), lane);
  }
  cp_async_wait<0>();

  store_accumulator<T>(dq, p.scale, head_rows<T>(p.dq_out, p.dqs, b, h), p.dqs[2], m0 + warp_row, p.sq, lane);
#else
  __trap();
#endif
}

// The dQ kernel warp-specialized as the dK/dV one: the producer's one thread loads a tile's q and dO
// once and each key block's k and v (64 keys) through the TMA into two stages on mbarriers;
// two consumer warpgroups of 64 query rows run dq_step and release a stage once its products have
// read it.
template <int D, int kKeys = kSm90DqKeys>
constexpr int sm90_dq_ws_smem_bytes() {
  // q, dO: [128, D]; two stages of k, v: [kKeys, D]; barriers (the ring's, empty_q) and tile slots; 1024 to align
  return (2 * kSm90DqRows + 4 * kKeys) * D * 2 + 8 * 6 + tma::TileSlots::kBytes + 1024;
}

// kKeys: keys a step, 64 (kSm90DqKeys) or, at head dim 64 (CUSTOMOPS_ATTENTION_BWD_DQ_KEYS=128), 128.
// Persistent as the forward is (p.dq_work: blocks take query blocks from a counter, the producer
// handing each one's index to the consumers and loading the next one's q and dO once both consumers'
// last step has read them).
template <typename T, int D, bool kCausal, int kKeys = kSm90DqKeys>
__global__ void __launch_bounds__(kSm90BwdWsThreads, 1)
    attention_bwd_dq_sm90_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tg,
                                    const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                                    BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kKeys == kSm90DqKeys || (kKeys == 128 && D == 64), "128 keys a dQ step at head dim 64");
  constexpr int kRows = kSm90DqRows, kStages = 2, kPanels = D / 64, kDT = D / 8;
  constexpr uint32_t kQBytes = kRows * D * 2, kKBytes = kKeys * D * 2, kConsumerThreads = 256;
  extern __shared__ char smem[];
  const uint32_t sq = (smem_addr(smem) + 1023) & ~1023u, sg = sq + kQBytes;
  auto k_base = [&](int st) { return sg + kQBytes + st * 2 * kKBytes; };
  auto v_base = [&](int st) { return k_base(st) + kKBytes; };
  const uint32_t bars = sg + kQBytes + kStages * 2 * kKBytes;
  const uint32_t full_q = bars;  // (empty_q: once both consumers' last step of a tile read q and dO)
  const uint32_t empty_q = bars + 8 * (1 + 2 * kStages);
  auto full = [&](int st) { return bars + 8 * (1 + st); };
  auto empty = [&](int st) { return bars + 8 * (1 + kStages + st); };
  const tma::TileSlots tiles{empty_q + 8};  // each tile's index, producer to consumers

  const int wg = tma::warpgroup();
  if (threadIdx.x == 0) {
    tma::mbar_init(empty_q, kConsumerThreads);
    tiles.init(kConsumerThreads);
  }
  tma::init_ring<kStages>(bars, kConsumerThreads);  // (empty: once a consumer's products read the stage)
  const int64_t shift = p.sk - p.sq;
  // Tile t: (batch, head, first row, key blocks); causal: the last query blocks, which see the most
  // keys, first (order_tile).
  struct Tile {
    int64_t b, h, m0;
    int nblocks;
  };
  auto tile_of = [&](int64_t t) {
    const GridTile g = order_tile(t, p.dq_work.heads, p.dq_work.mblocks, kCausal ? p.dq_chunk : 0);
    Tile f;
    f.b = g.head / p.hq;
    f.h = g.head % p.hq;
    f.m0 = (kCausal ? p.dq_work.mblocks - 1 - g.rank : g.rank) * int64_t(kRows);
    const int64_t key_end = kCausal ? std::min<int64_t>(p.sk, f.m0 + kRows + shift) : p.sk;
    f.nblocks = key_end > 0 ? static_cast<int>((key_end + kKeys - 1) / kKeys) : 0;
    return f;
  };

  if (wg == 0) {  // the producer
    tma::regs_down<40>();
    if (threadIdx.x != 0) return;
    int64_t tile = blockIdx.x;
    uint32_t handed = 0, qs = 0;  // tiles handed to the consumers, q and dO loads
    int g = 0;                    // key blocks loaded (the ring's position)
    for (;; ++handed) {
      tiles.put(handed, std::min(tile, p.dq_work.tiles));
      if (tile >= p.dq_work.tiles) break;  // (no copy in flight when the block exits: the consumers waited for each)
      const Tile f = tile_of(tile);
      if (f.nblocks > 0) {
        const int bi = static_cast<int>(f.b), hi = static_cast<int>(f.h), hki = static_cast<int>(f.h / p.group);
        if (qs > 0) tma::mbar_wait(empty_q, (qs - 1) & 1);
        ++qs;
        tma::mbar_arrive_expect_tx(full_q, 2 * kQBytes);
#pragma unroll
        for (int pc = 0; pc < kPanels; ++pc) {  // (rows past sq: zeros, the TMA's fill)
          tma::tensor_load_4d(sq + pc * kRows * 128, &tq, pc * 64, static_cast<int>(f.m0), hi, bi, full_q);
          tma::tensor_load_4d(sg + pc * kRows * 128, &tg, pc * 64, static_cast<int>(f.m0), hi, bi, full_q);
        }
        for (int j = 0; j < f.nblocks; ++j, ++g) {
          const int st = g % kStages;
          if (g >= kStages) tma::mbar_wait(empty(st), static_cast<uint32_t>((g / kStages - 1) & 1));
          tma::mbar_arrive_expect_tx(full(st), 2 * kKBytes);
#pragma unroll
          for (int pc = 0; pc < kPanels; ++pc) {  // (keys past sk: zeros, masked)
            tma::tensor_load_4d(k_base(st) + pc * kKeys * 128, &tk, pc * 64, j * kKeys, hki, bi, full(st));
            tma::tensor_load_4d(v_base(st) + pc * kKeys * 128, &tv, pc * 64, j * kKeys, hki, bi, full(st));
          }
        }
      }
      tile = next_tile(p.dq_work);
    }
    return;
  }

  tma::regs_up<232>();
  const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int warp_row = c * 64 + warp * 16;  // this thread's rows: m0 + warp_row + lane / 4 (+ 8)
  const uint32_t q_wg = sq + c * 64 * 128, g_wg = sg + c * 64 * 128;
  uint32_t taken = 0, qs = 0;  // tiles taken from the producer, q and dO loads waited for
  int g = 0;                   // key blocks consumed (the ring's position)
  for (;; ++taken) {
    const int64_t tile = tiles.take(taken);
    if (tile >= p.dq_work.tiles) break;
    const Tile f = tile_of(tile);
    float lse2[2], dt[2];
    load_row_stats(p, f.b * p.hq + f.h, f.m0 + warp_row, lane, lse2, dt);
    float dq[kDT][4];
    zero(dq);
    if (f.nblocks > 0) {
      tma::mbar_wait(full_q, qs & 1);
      ++qs;
    }
    for (int j = 0; j < f.nblocks; ++j) {
      const int gj = g + j, st = gj % kStages;
      tma::mbar_wait(full(st), static_cast<uint32_t>((gj / kStages) & 1));
      const int64_t n0 = int64_t(j) * kKeys;
      dq_step<T, D, kRows, kKeys, kCausal>(dq, q_wg, g_wg, k_base(st), v_base(st), lse2, dt, p.scale_log2,
                                           f.m0 + warp_row, n0, p.sk, shift,
                                           n0 + kKeys > p.sk || (kCausal && n0 + kKeys - 1 > f.m0 + shift), lane);
      tma::mbar_arrive(empty(st));
    }
    if (f.nblocks > 0) tma::mbar_arrive(empty_q);  // (the last step, waited for, read q and dO)
    g += f.nblocks;
    store_accumulator<T>(dq, p.scale, head_rows<T>(p.dq_out, p.dqs, f.b, f.h), p.dqs[2], f.m0 + warp_row, p.sq,
                         lane);
  }
#else
  __trap();
#endif
}

}  // namespace customops::cuda::attention
