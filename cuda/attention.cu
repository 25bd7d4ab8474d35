// The fused CUDA kernels of attention and _attention_backward (float16 and bfloat16, head dims 64
// and 128, sm_80 and newer; on compute capability 9.0 the forward is attention_sm90.cuh's
// warp-specialized wgmma kernel instead, which takes head dim 256 too, see use_sm90 and
// use_sm90_ws; the backward at head dim 256 is ATen's FlashAttention-2 one where lse has no gradient,
// attention_bwd_flash2, the blocked one else): tensor cores through mma.sync m16n8k16 for every matmul, scores and
// probabilities in registers, an online softmax across key blocks, k and v read once per group of
// query heads (grouped-query attention without repeating them). attention's CUDA kernels, registered
// at the end, run them for the inputs attention_cuda_fused() accepts and the blocked ATen kernels
// (cpp/ops/attention_blocked.cpp) for the rest.
//
// Shared memory holds tiles of [rows, D] elements in rows of D / 8 chunks of 16 bytes; chunk c of
// row r sits at c ^ (r % 8), so the 8 rows an ldmatrix reads at one column hit 8 different bank
// groups, and cp.async fills them 16 bytes a thread without conflicts.
//
// Forward: a block of 4 warps owns 16 * kRowTiles query rows a warp of one (batch, head); each warp
// keeps its rows' output (fp32), running max and sum in registers, and walks the key blocks with
// the next block's k and v loading (cp.async) while this one is computed. Scores go through
// exp2 with scale * log2(e) folded in; lse = (max + log2(sum)) * ln 2, -inf for a row that saw no
// key (its output is 0).
//
// Backward (FlashAttention-2's order): a block owns kBwdWarps * 16 keys of one (batch, kv head),
// with k and v in shared memory, and walks every query block of every query head of its group.
// Each warp computes its 16 keys' transposed scores S^T = K Q^T and dP^T = V dO^T, then
// P^T = exp2(S^T * scale * log2(e) - lse * log2(e)) and dS^T = P^T (dP^T - dt), where
// dt = rowsum(dO * out) - grad_lse (the lse gradient adds p_ij * grad_lse_i to ds_ij), and
// accumulates dV += P^T dO and dK += dS^T Q in registers. dS^T goes through shared memory for
// dQ = dS K, which the block adds to a float32 accumulator with atomics. A small kernel first
// computes dt and lse * log2(e) per query row, padded to whole query blocks.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>

#include "attention.cuh"
#include "attention_host.h"
#include "attention_sm90.cuh"
#include "attention_sm90_bwd.cuh"
#include "cp_async.cuh"
#include "env.cuh"
#include "ops/attention.h"
#include "ops/layout.h"

namespace customops {
namespace {

using namespace cuda::attention;
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;
using cuda::smem_addr;

// ---- forward ------------------------------------------------------------------------------------
constexpr int kFwdWarps = 4;

template <int D, int kRowTiles, int kKeys>
constexpr int fwd_smem_bytes() {
  return (16 * kRowTiles * kFwdWarps + 4 * kKeys) * D * 2;  // q, then k and v in two stages
}

template <typename T, int D, int kRowTiles, int kKeys, bool kCausal>
__global__ void __launch_bounds__(kFwdWarps * 32) attention_fwd_kernel(FwdParams p) {
  constexpr int kThreads = kFwdWarps * 32, kRows = 16 * kRowTiles * kFwdWarps;
  constexpr int kDT = D / 8, kNT = kKeys / 8;  // accumulator tiles across D and across a key block
  extern __shared__ __align__(128) char smem[];
  const uint32_t s0 = smem_addr(smem);
  constexpr uint32_t kKeyBytes = kKeys * D * 2;
  const Tile<D> sq{s0};
  // Stage st: k at kbase + st * 2 * kKeyBytes, v right after it.
  const uint32_t kbase = s0 + kRows * D * 2;
  auto k_tile = [&](int st) { return Tile<D>{kbase + st * 2 * kKeyBytes}; };
  auto v_tile = [&](int st) { return Tile<D>{kbase + st * 2 * kKeyBytes + kKeyBytes}; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const FwdBlock blk = fwd_block<kRows, kKeys, kCausal>(p);
  const int64_t m0 = blk.m0, shift = blk.shift;
  const int nblocks = blk.nblocks;
  const T* q = head_rows<const T>(p.q, p.qs, blk.b, blk.h);
  const T* k = head_rows<const T>(p.k, p.ks, blk.b, blk.hk);
  const T* v = head_rows<const T>(p.v, p.vs, blk.b, blk.hk);

  load_tile<kRows, D, kThreads>(sq, q, p.qs[2], m0, p.sq);
  if (nblocks > 0) {
    load_tile<kKeys, D, kThreads>(k_tile(0), k, p.ks[2], 0, p.sk);
    load_tile<kKeys, D, kThreads>(v_tile(0), v, p.vs[2], 0, p.sk);
  }
  cp_async_commit();

  float o[kRowTiles][kDT][4];
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -kInfF;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int warp_row = warp * 16 * kRowTiles;

  for (int j = 0; j < nblocks; ++j) {
    const int stage = j & 1;
    // Block j is in, and every warp is done with block j - 1: its stage takes block j + 1, which
    // loads while this one is computed.
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < nblocks) {
      load_tile<kKeys, D, kThreads>(k_tile(stage ^ 1), k, p.ks[2], int64_t(j + 1) * kKeys, p.sk);
      load_tile<kKeys, D, kThreads>(v_tile(stage ^ 1), v, p.vs[2], int64_t(j + 1) * kKeys, p.sk);
      cp_async_commit();
    }

    // s = q k^T over this key block.
    float s[kRowTiles][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kRowTiles][4];
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) ldmatrix_x4(a[mt], a_frag(sq, warp_row + mt * 16, kk * 16, lane));
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, b_frag(k_tile(stage), nt * 8, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          mma<T>(s[mt][nt], a[mt], bf[0], bf[1]);
          mma<T>(s[mt][nt + 1], a[mt], bf[2], bf[3]);
        }
      }
    }

    // Masked keys to -inf, online softmax (probabilities in place), what was accumulated rescaled.
    const int64_t n0 = int64_t(j) * kKeys;
    const bool masked = n0 + kKeys > p.sk || (kCausal && n0 + kKeys - 1 > m0 + shift);
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt) {
      if (masked) mask_scores<kNT, kCausal>(s[mt], m0 + warp_row + mt * 16, n0, p.sk, shift, lane);
      float corr[2];
      softmax_step(s[mt], row_max[mt], row_sum[mt], corr, p.scale_log2);
      scale_rows(o[mt], corr);
    }

    // o += p v.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a[kRowTiles][4];
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) accumulators_to_a<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < kDT; dt += 2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, bt_frag(v_tile(stage), kk * 16, dt * 8, lane));
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          mma<T>(o[mt][dt], a[mt], bf[0], bf[1]);
          mma<T>(o[mt][dt + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
  }
  if (nblocks == 0) cp_async_wait<0>();

  T* out = head_rows<T>(p.out, p.os, blk.b, blk.h);
  float* lse = p.lse + (blk.b * p.hq + blk.h) * p.sq;
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
    store_rows<T>(o[mt], row_max[mt], row_sum[mt], out, p.os[2], lse, m0 + warp_row + mt * 16, p.sq, lane);
  }
}

// ---- backward -----------------------------------------------------------------------------------
constexpr int kBwdRows = 64;  // query rows per step
// (the prep kernel's rows, padded to kBwdRows, are whole query blocks of the wgmma backward too)
static_assert(kBwdRows % kSm90BwdRows == 0, "the wgmma backward reads lse2 and dt in blocks of its rows");

// dt = rowsum(dO * out) - grad_lse and lse2 = lse * log2(e) (+inf for a row that saw no key, so
// its probabilities are 0), both [B, Hq, Sq_pad] with padding rows dt = 0, lse2 = +inf.
struct PrepParams {
  const void* go;
  const void* out;
  const float* lse;       // contiguous [B, Hq, Sq]
  const float* grad_lse;  // contiguous [B, Hq, Sq], or null
  float* dt;
  float* lse2;
  int64_t gs[3], os[3];
  int64_t hq, sq, sq_pad, rows;  // rows = B * Hq * Sq_pad
};

template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_prep_kernel(PrepParams p) {
  constexpr int kLanes = D / 8;  // threads per row, 8 elements each
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes;
  const int c = idx % kLanes;
  const int64_t i = row % p.sq_pad, bh = row / p.sq_pad;
  const bool valid = row < p.rows && i < p.sq;
  float acc = 0.f;
  if (valid) {
    const int64_t b = bh / p.hq, h = bh % p.hq;
    const T* go = static_cast<const T*>(p.go) + b * p.gs[0] + h * p.gs[1] + i * p.gs[2] + c * 8;
    const T* out = static_cast<const T*>(p.out) + b * p.os[0] + h * p.os[1] + i * p.os[2] + c * 8;
    const uint4 gv = *reinterpret_cast<const uint4*>(go), ov = *reinterpret_cast<const uint4*>(out);
    const T* ge = reinterpret_cast<const T*>(&gv);
    const T* oe = reinterpret_cast<const T*>(&ov);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(ge[e]) * static_cast<float>(oe[e]);
  }
#pragma unroll
  for (int w = kLanes / 2; w > 0; w /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, w);
  if (row < p.rows && c == 0) {
    if (valid) {
      const int64_t src = bh * p.sq + i;
      const float l = p.lse[src];
      p.dt[row] = acc - (p.grad_lse != nullptr ? p.grad_lse[src] : 0.f);
      p.lse2[row] = l == -kInfF ? kInfF : l * kLog2e;
    } else {
      p.dt[row] = 0.f;
      p.lse2[row] = kInfF;
    }
  }
}

template <int D, int kWarps>
constexpr int bwd_smem_bytes() {
  // k, v: [16 * kWarps, D]; q, dO: two stages of [kBwdRows, D]; dS^T: [16 * kWarps, kBwdRows];
  // dt, lse2: two stages of kBwdRows floats.
  return (2 * 16 * kWarps * D + 4 * kBwdRows * D + 16 * kWarps * kBwdRows) * 2 + 4 * kBwdRows * 4;
}

__device__ __forceinline__ void add_to_dq(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

template <typename T, int D, int kWarps, bool kCausal>
__global__ void __launch_bounds__(kWarps * 32) attention_bwd_kernel(BwdParams p) {
  constexpr int kThreads = kWarps * 32, kKeys = 16 * kWarps, kRows = kBwdRows;
  constexpr int kDT = D / 8, kNT = kRows / 8;
  // dQ's share of a warp: a 16-row tile of the query block and kDW of the D columns.
  constexpr int kDW = D * (kRows / 16) / kWarps;
  static_assert(kWarps % (kRows / 16) == 0 && kDW % 16 == 0, "dQ tiles must divide among the warps");
  extern __shared__ __align__(128) char smem[];
  const uint32_t s0 = smem_addr(smem);
  const Tile<D> sk{s0}, sv{s0 + kKeys * D * 2};
  const uint32_t s1 = s0 + 2 * kKeys * D * 2;
  // Stage st: q at s1 + st * 2 * kRowBytes, dO right after it.
  constexpr uint32_t kRowBytes = kRows * D * 2;
  auto q_tile = [&](int st) { return Tile<D>{s1 + st * 2 * kRowBytes}; };
  auto go_tile = [&](int st) { return Tile<D>{s1 + st * 2 * kRowBytes + kRowBytes}; };
  const Tile<kRows> sds{s1 + 4 * kRows * D * 2};
  char* const tail = smem + 2 * kKeys * D * 2 + 4 * kRows * D * 2 + kKeys * kRows * 2;
  float* const sdt = reinterpret_cast<float*>(tail);   // [2][kRows]
  float* const slse = sdt + 2 * kRows;                 // [2][kRows]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const GridTile g = grid_tile<kCausal>(p.dkdv_chunk);
  const int64_t n0 = g.rank * kKeys, hk = g.head % gridDim.y, b = g.head / gridDim.y;
  const int64_t shift = p.sk - p.sq;
  // Causal: query row i sees key n0 from i = n0 - shift on.
  const int64_t mb_first = kCausal ? std::max<int64_t>(0, n0 - shift) / kRows : 0;
  const int64_t mblocks = (p.sq + kRows - 1) / kRows;
  const int64_t per_head = std::max<int64_t>(0, mblocks - mb_first);
  const int64_t steps = per_head * p.group;

  const T* k = static_cast<const T*>(p.k) + b * p.ks[0] + hk * p.ks[1];
  const T* v = static_cast<const T*>(p.v) + b * p.vs[0] + hk * p.vs[1];
  load_tile<kKeys, D, kThreads>(sk, k, p.ks[2], n0, p.sk);
  load_tile<kKeys, D, kThreads>(sv, v, p.vs[2], n0, p.sk);

  // Step t: query head hk * group + t / per_head, query block mb_first + t % per_head.
  auto load_step = [&](int64_t t, int stage) {
    const int64_t h = hk * p.group + t / per_head, m0 = (mb_first + t % per_head) * kRows;
    load_tile<kRows, D, kThreads>(q_tile(stage), static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1], p.qs[2], m0,
                                  p.sq);
    load_tile<kRows, D, kThreads>(go_tile(stage), static_cast<const T*>(p.go) + b * p.gs[0] + h * p.gs[1], p.gs[2], m0,
                                  p.sq);
    const int64_t row0 = (b * p.hq + h) * p.sq_pad + m0;
    if (threadIdx.x < kRows / 4) {
      cp_async16(smem_addr(sdt + stage * kRows + threadIdx.x * 4), p.dt + row0 + threadIdx.x * 4, true);
    } else if (threadIdx.x < kRows / 2) {
      const int c = threadIdx.x - kRows / 4;
      cp_async16(smem_addr(slse + stage * kRows + c * 4), p.lse2 + row0 + c * 4, true);
    }
  };
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
  zero(dk);
  zero(dv);
  const int key_row = warp * 16;  // this warp's keys in the block

  for (int64_t t = 0; t < steps; ++t) {
    const int stage = t & 1;
    const int64_t h = hk * p.group + t / per_head, m0 = (mb_first + t % per_head) * kRows;
    // Step t is in, and every warp is done with step t - 1 (its stage and dS^T): that stage takes
    // step t + 1, which loads while this one is computed.
    cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < steps) {
      load_step(t + 1, stage ^ 1);
      cp_async_commit();
    }

    // s = K Q^T and dp = V dO^T for this warp's 16 keys (rows) and the block's query rows (columns).
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      ldmatrix_x4(ak, a_frag(sk, key_row, kk * 16, lane));
      ldmatrix_x4(av, a_frag(sv, key_row, kk * 16, lane));
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        uint32_t bq[4], bg[4];
        ldmatrix_x4(bq, b_frag(q_tile(stage), nt * 8, kk * 16, lane));
        ldmatrix_x4(bg, b_frag(go_tile(stage), nt * 8, kk * 16, lane));
        mma<T>(s[nt], ak, bq[0], bq[1]);
        mma<T>(s[nt + 1], ak, bq[2], bq[3]);
        mma<T>(dp[nt], av, bg[0], bg[1]);
        mma<T>(dp[nt + 1], av, bg[2], bg[3]);
      }
    }

    // p = exp2(s * scale * log2(e) - lse2) (0 where masked), ds = p (dp - dt), in place.
    const bool masked = n0 + kKeys > p.sk || (kCausal && n0 + kKeys - 1 > m0 + shift);
    const float* dts = sdt + stage * kRows;
    const float* lses = slse + stage * kRows;
    transposed_probs<kNT, kCausal>(s, lses, p.scale_log2, masked, n0 + key_row, m0 + shift, p.sk, lane);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - dts[nt * 8 + (lane % 4) * 2 + (e & 1)]);

    // dV += P^T dO and dK += dS^T Q (the block's query rows are k).
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk) {
      uint32_t ap[4], ads[4];
      accumulators_to_a<T>(ap, s[2 * kk], s[2 * kk + 1]);
      accumulators_to_a<T>(ads, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < kDT; dt += 2) {
        uint32_t bg[4], bq[4];
        ldmatrix_x4_trans(bg, bt_frag(go_tile(stage), kk * 16, dt * 8, lane));
        ldmatrix_x4_trans(bq, bt_frag(q_tile(stage), kk * 16, dt * 8, lane));
        mma<T>(dv[dt], ap, bg[0], bg[1]);
        mma<T>(dv[dt + 1], ap, bg[2], bg[3]);
        mma<T>(dk[dt], ads, bq[0], bq[1]);
        mma<T>(dk[dt + 1], ads, bq[2], bq[3]);
      }
    }

    // dS^T to shared memory ([keys, query rows]) for dQ.
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = key_row + lane / 4 + r * 8, col = nt * 8 + (lane % 4) * 2;
        const uint32_t addr = sds.at(row, col & ~7) + (col & 7) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(dp[nt][2 * r], dp[nt][2 * r + 1])));
      }
    __syncthreads();

    // dQ += dS K: this warp's 16 query rows and kDW columns.
    {
      const int qt = warp % (kRows / 16), c0 = (warp / (kRows / 16)) * kDW;
      float dq[kDW / 8][4];
#pragma unroll
      for (int dt = 0; dt < kDW / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, at_frag(sds, kk * 16, qt * 16, lane));
#pragma unroll
        for (int dt = 0; dt < kDW / 8; dt += 2) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, bt_frag(sk, kk * 16, c0 + dt * 8, lane));
          mma<T>(dq[dt], a, bk[0], bk[1]);
          mma<T>(dq[dt + 1], a, bk[2], bk[3]);
        }
      }
      float* dqh = p.dq + ((b * p.hq + h) * p.sq) * D;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = m0 + qt * 16 + lane / 4 + r * 8;
        if (row >= p.sq) continue;
#pragma unroll
        for (int dt = 0; dt < kDW / 8; ++dt) {
          add_to_dq(dqh + row * D + c0 + dt * 8 + (lane % 4) * 2, dq[dt][2 * r] * p.scale,
                    dq[dt][2 * r + 1] * p.scale);
        }
      }
    }
  }
  if (steps == 0) cp_async_wait<0>();

  // dk (scaled) and dv for this warp's keys.
  T* dkp = static_cast<T*>(p.dk) + b * p.dks[0] + hk * p.dks[1];
  T* dvp = static_cast<T*>(p.dv) + b * p.dvs[0] + hk * p.dvs[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = n0 + key_row + lane / 4 + r * 8;
    if (key >= p.sk) continue;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + (lane % 4) * 2;
      *reinterpret_cast<uint32_t*>(dkp + key * p.dks[2] + col) =
          pack2<T>(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvp + key * p.dvs[2] + col) = pack2<T>(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------
// One warp per 16 query rows and 64 keys a step in the forward: 16 rows a warp rather than 32 give
// 228-230 registers without spills and two blocks an SM, as fast as 32 without a mask and about 10%
// faster with the causal one (H100, head dim 128). The backward: 8 warps, 128 keys a block, one
// block an SM (145 KiB of shared memory), 15% faster than 4 warps and 64 keys.
constexpr int kFwdRowTiles = 1, kFwdKeys = 64, kFwdRows = 16 * kFwdRowTiles * kFwdWarps;
constexpr int kBwdWarps = 8;

// The kernel paths' switches below (env.cuh).
bool env_is(const char* name, std::string_view value) { return env::is(name, value); }
std::optional<int64_t> env_count(const char* name, const char* what) {
  return env::count("customops.attention", name, what);
}

// Heads a chunk of a causal grid's block order (order_tile in attention.cuh): as many as keep the
// `bytes` each head's blocks stream (k and v, or q and dO) within half the L2.
// CUSTOMOPS_ATTENTION_LPT=0 keeps launch order (0). Measured on an H100 (bf16, forward+backward, TFLOP/s
// against launch order): see docs/benchmarks.md.
int64_t causal_chunk(const at::Tensor& q, int64_t bytes) {
  if (env_is("CUSTOMOPS_ATTENTION_LPT", "0")) return 0;
  const int64_t l2 = at::cuda::getDeviceProperties(q.get_device())->l2CacheSize;
  return std::max<int64_t>(1, l2 / 2 / std::max<int64_t>(1, bytes));
}

// Heads a chunk of the causal dK/dV grid's order: causal_chunk's, but enough heads that every SM stays
// busy while a chunk's longest block runs (its walk is about twice a block's mean, so a chunk must hold
// at least 2 x SMs blocks: 2 SMs / ranks heads, ranks being a head's blocks), rounded up to a divisor of
// the heads (no short last chunk). At B4 H8 S2048 causal fp16 causal_chunk gave 25 heads, whose last
// chunk of 7 left SMs idle: our backward's forward+backward went from 307 to 333 TFLOP/s on an H100
// (docs/benchmarks.md). CUSTOMOPS_ATTENTION_BWD_CHUNK=N sets it (0: launch order).
int64_t dkdv_chunk(const at::Tensor& q, int64_t bytes, int64_t ranks, int64_t heads) {
  if (const auto n = env_count("CUSTOMOPS_ATTENTION_BWD_CHUNK", "heads (0: launch order)")) return *n;
  int64_t chunk = causal_chunk(q, bytes);
  if (chunk == 0 || heads <= 0) return chunk;
  const int64_t sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
  chunk = std::min(heads, std::max(chunk, (2 * sms + ranks - 1) / std::max<int64_t>(1, ranks)));
  while (heads % chunk != 0) ++chunk;
  return chunk;
}

// The wgmma forward (attention_sm90.cuh) on compute capability 9.0 when the build has sm_90a code;
// CUSTOMOPS_ATTENTION_SM80=1 keeps the mma.sync kernel there (the tests run both).
constexpr int kSm90Keys = 128;
bool use_sm90(const at::Tensor& q) {
#ifdef CUSTOMOPS_SM90A
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q.get_device());
  if (prop->major != 9 || prop->minor != 0) return false;
  return !env_is("CUSTOMOPS_ATTENTION_SM80", "1");
#else
  (void)q;
  return false;
#endif
}

// The warp-specialized forward (attention_fwd_sm90_ws_kernel) in place of the wgmma one where the
// TMA can read q, k and v (1.3-1.4x the wgmma kernel's speed on an H100, head dims 64 and 128); the
// only fused forward at head dim 256. CUSTOMOPS_ATTENTION_WS=0 keeps the wgmma one (the tests run
// both).
bool use_sm90_ws() {
  return !env_is("CUSTOMOPS_ATTENTION_WS", "0");
}

// The wgmma backward (attention_sm90_bwd.cuh) wherever the wgmma forward runs: 1.3x the mma.sync
// backward's forward+backward at head dim 128 and 1.2-1.3x at 64 on an H100.
// CUSTOMOPS_ATTENTION_BWD_SM90=0 keeps the mma.sync one there (where cuDNN's does not run: with it, as
// with CUSTOMOPS_ATTENTION_SM80=1, a loss of out alone takes cuDNN's at head dim 64 too; want_cudnn_bwd).
bool use_sm90_bwd(const at::Tensor& q) {
  return use_sm90(q) && !env_is("CUSTOMOPS_ATTENTION_BWD_SM90", "0");
}

// The wgmma backward's dQ. By default (CUSTOMOPS_ATTENTION_BWD_DQ=reduce) added through the TMA's
// reductions in the warp-specialized dK/dV kernel, issued by its dQ writer warp: at head dim 128
// 1.04-1.11x the forward+backward of a pass of its own on an H100, at 64 (128 query rows a step, each
// consumer warpgroup adding 64 rows) 1.08-1.11x (docs/benchmarks.md). Elsewhere, and at head dim 64
// with 64 query rows a step (0.90-0.95x of the pass there), a pass of its own (=pass). =atomic adds it
// in the cp.async dK/dV kernel with float32 atomics (+0-3% at head dim 128 before the writer warp, 10%
// slower at 64).
enum class DqMode { pass, atomic, reduce };
// At head dim 64 the warp-specialized dK/dV kernel takes 128 query rows a step (1.07-1.20x the
// forward+backward of 64 on an H100, docs/benchmarks.md), with the dQ pass or the reductions;
// CUSTOMOPS_ATTENTION_BWD_ROWS=64 keeps 64.
bool sm90_bwd_rows128() {
  return !env_is("CUSTOMOPS_ATTENTION_BWD_ROWS", "64");
}
// The wgmma dK/dV kernels mask only the steps that see a masked key (the diagonal's and the last key
// block's; masked_steps in attention_sm90_bwd.cuh). CUSTOMOPS_ATTENTION_BWD_MASK_SPLIT=0 masks every
// step, as before (to time the two in one run).
bool sm90_bwd_mask_split() {
  return !env_is("CUSTOMOPS_ATTENTION_BWD_MASK_SPLIT", "0");
}
// At head dim 64 the warp-specialized dQ kernel with 128 keys a step (CUSTOMOPS_ATTENTION_BWD_DQ_KEYS=128;
// 64 by default).
bool sm90_dq_keys128() {
  return env_is("CUSTOMOPS_ATTENTION_BWD_DQ_KEYS", "128");
}
DqMode sm90_dq_mode(int64_t d) {
  // (torch.use_deterministic_algorithms: the pass, whose sums run in one order; the reductions' and
  // the atomics' adds land in the order the blocks reach them)
  if (at::globalContext().deterministicAlgorithms()) return DqMode::pass;
  if (env_is("CUSTOMOPS_ATTENTION_BWD_DQ", "atomic")) return DqMode::atomic;
  if (env_is("CUSTOMOPS_ATTENTION_BWD_DQ", "reduce")) return DqMode::reduce;
  if (env_is("CUSTOMOPS_ATTENTION_BWD_DQ", "pass")) return DqMode::pass;
  return d == 128 || (d == 64 && sm90_bwd_rows128()) ? DqMode::reduce : DqMode::pass;
}

// The wgmma backward's kernels warp-specialized (attention_bwd_dkdv_sm90_ws_kernel, measured
// 1.06-1.10x the cp.async one's forward+backward at head dim 128 on an H100, and
// attention_bwd_dq_sm90_ws_kernel) where the TMA can read q, dO, k and v.
// CUSTOMOPS_ATTENTION_BWD_WS=0 keeps both cp.async kernels, =dkdv keeps the cp.async one for dQ
// only (the tests run each).
struct WsBwd {
  bool dkdv, dq;
};
WsBwd sm90_ws_bwd() {
  const bool off = env_is("CUSTOMOPS_ATTENTION_BWD_WS", "0");
  return {!off, !off && !env_is("CUSTOMOPS_ATTENTION_BWD_WS", "dkdv")};
}

// A tensor map of t ([B, H, S, D], unit last stride; float16, bfloat16 or float32) for the TMA:
// boxes of `rows` rows of 128 bytes (64 or 32 columns), swizzled by 128 bytes as the wgmma kernels'
// tiles are; nullopt where the TMA cannot read t (an address or stride not a multiple of 16 bytes,
// or a shape the driver refuses).
std::optional<CUtensorMap> tensor_map(const at::Tensor& t, int rows) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  // The driver's encode needs a context current on this thread, which a thread of the autograd
  // engine may not have yet when device 0 is the runtime's current one (c10's guards then leave it
  // unset): the encode failed there and the first backward of each such thread fell back to the
  // kernels without the TMA. A forced set binds the device's primary context, once per thread.
  thread_local bool bound = false;
  if (!bound) {
    C10_CUDA_CHECK(c10::cuda::SetDevice(t.get_device(), /*force=*/true));
    bound = true;
  }
  const auto es = static_cast<cuuint64_t>(t.element_size());
  if (encode == nullptr || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.stride(3) != 1) return std::nullopt;
  // (the kernels pass the TMA 32-bit coordinates, padded rows included)
  for (int i = 0; i < 4; ++i) {
    if (t.size(i) > std::numeric_limits<int32_t>::max() / 2) return std::nullopt;
  }
  for (int i = 0; i < 3; ++i) {
    if (t.stride(i) < 0 || (t.stride(i) * es) % 16 != 0) return std::nullopt;
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(t.size(3)), static_cast<cuuint64_t>(t.size(2)),
                              static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  // a dimension of size 1 may have any stride: its own is then the next one's bytes
  cuuint64_t strides[3];
  for (int i = 0; i < 3; ++i) {
    const int dim = 2 - i;  // S, H, B
    strides[i] = t.size(dim) == 1 && i > 0 ? strides[i - 1] * dims[i] : static_cast<cuuint64_t>(t.stride(dim)) * es;
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / es), static_cast<cuuint32_t>(rows), 1, 1},
                   unit[4] = {1, 1, 1, 1};
  const auto type = t.scalar_type() == at::kFloat  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                    : t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  CUtensorMap map{};
  const CUresult r = encode(&map, type, 4, t.data_ptr(), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return std::nullopt;
  return map;
}

// Tensor maps of q and dO (boxes of `rows` rows) and k and v (`keys` rows) for the warp-specialized
// backward kernels, where the TMA can read all four.
std::optional<std::array<CUtensorMap, 4>> bwd_maps(const at::Tensor& q, const at::Tensor& go, const at::Tensor& k,
                                                   const at::Tensor& v, int rows, int keys) {
  const auto mq = tensor_map(q, rows), mg = tensor_map(go, rows), mk = tensor_map(k, keys), mv = tensor_map(v, keys);
  if (!mq || !mg || !mk || !mv) return std::nullopt;
  return std::array<CUtensorMap, 4>{*mq, *mg, *mk, *mv};
}

// A kernel with `bytes` of dynamic shared memory (above the 48 KiB default) on `stream`.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, int threads, int bytes, cudaStream_t stream, const Args&... args) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, threads, bytes, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Fn>
void with_types(const at::Tensor& q, bool causal, Fn&& fn) {
  auto with_causal = [&](auto t, auto d) {
    if (causal) {
      fn(t, d, std::true_type{});
    } else {
      fn(t, d, std::false_type{});
    }
  };
  auto with_d = [&](auto t) {
    if (q.size(3) == 64) {
      with_causal(t, std::integral_constant<int, 64>{});
    } else {
      with_causal(t, std::integral_constant<int, 128>{});
    }
  };
  if (q.scalar_type() == at::kHalf) {
    with_d(__half{});
  } else {
    with_d(__nv_bfloat16{});
  }
}

// The fused kernels take float16 and bfloat16, head dims 64 and 128 (the forward 256 too, on the
// warp-specialized kernel), a positive scale, sm_80 or newer: whether they take q (k and v match it
// after check_attention).
bool attention_cuda_fused(const at::Tensor& q, double scale, bool forward = false) {
  if (!q.is_cuda() || (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16)) return false;
  if (!(scale > 0.0) || !std::isfinite(scale)) return false;
  if (q.size(0) > 65535 || q.size(1) > 65535) return false;
  if (q.size(3) == 256) return forward && use_sm90(q) && use_sm90_ws();
  if (q.size(3) != 64 && q.size(3) != 128) return false;
  return at::cuda::getDeviceProperties(q.get_device())->major >= 8;
}

// The blocks of a persistent warp-specialized kernel (the forward, the dQ kernel) for w's tiles: one an
// SM, each taking tiles until none is left, so that its producer loads the next tile while the
// consumers finish the last one. CUSTOMOPS_ATTENTION_WS_PERSISTENT=0 launches a block a tile instead
// (measured side by side in docs/benchmarks.md), =N at most N blocks (the tests pass every tile
// through one).
dim3 ws_grid(const TileCounter& w, const at::Tensor& q) {
  const int64_t n = env_count("CUSTOMOPS_ATTENTION_WS_PERSISTENT", "blocks (0: a block a tile)")
                        .value_or(at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount);
  return dim3(static_cast<unsigned>(n > 0 ? std::min(w.tiles, n) : w.tiles));
}

// w for q's query blocks of `rows` ([B, H, S, D]), its counter zeroed on `stream`: the tensor that
// holds it, to keep until the launch.
at::Tensor tile_counter(TileCounter& w, const at::Tensor& q, int64_t rows, cudaStream_t stream) {
  w.mblocks = (q.size(2) + rows - 1) / rows;
  w.heads = q.size(1) * q.size(0);
  w.tiles = w.mblocks * w.heads;
  at::Tensor counter = at::empty({1}, q.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(counter.data_ptr(), 0, sizeof(int64_t), stream));
  w.next = reinterpret_cast<unsigned long long*>(counter.data_ptr());
  return counter;
}

// The warp-specialized forward of p at head dim D, where the TMA can read q, k and v: whether it ran.
// kConsumers warpgroups of 64 query rows a block.
template <int D, int kConsumers = 2, int kKeys = ws_keys<D>()>
bool attention_fwd_ws(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                      const FwdParams& params, cudaStream_t stream) {
  constexpr int kRows = ws_rows(kConsumers), kSmem = sm90_ws_smem_bytes<D, kConsumers, kKeys>();
  const auto mq = tensor_map(q, kRows), mk = tensor_map(k, kKeys), mv = tensor_map(v, kKeys);
  if (!mq || !mk || !mv) return false;
  FwdParams p = params;
  const at::Tensor counter = tile_counter(p.work, q, kRows, stream);
  const dim3 grid = ws_grid(p.work, q);
  auto run = [&](auto t, auto c) {
    launch(attention_fwd_sm90_ws_kernel<decltype(t), D, decltype(c)::value, kConsumers, kKeys>, grid, ws_threads(kConsumers),
           kSmem, stream, *mq, *mk, *mv, p);
  };
  auto with_causal = [&](auto t) {
    if (causal) {
      run(t, std::true_type{});
    } else {
      run(t, std::false_type{});
    }
  };
  if (q.scalar_type() == at::kHalf) {
    with_causal(__half{});
  } else {
    with_causal(__nv_bfloat16{});
  }
  return true;
}

// Head dim 64 with blocks of 192 query rows (three consumer warpgroups, FlashAttention-3's tile
// there): 3-7% faster than 128 rows on an H100, where a key block's exponentials take about as long
// as its products. CUSTOMOPS_ATTENTION_WS_ROWS=128 keeps two consumers (the tests run both).
bool ws_rows_192() {
  return !env_is("CUSTOMOPS_ATTENTION_WS_ROWS", "128");
}

// Writes out (q's sizes, unit last stride) and lse (contiguous float32 [B, Hq, Sq]); false where
// no fused kernel takes the inputs (head dim 256 that the TMA cannot read), nothing written.
bool attention_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, bool causal,
                        double scale, const at::Tensor& out, const at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  strides_of(q, p.qs);
  strides_of(k, p.ks);
  strides_of(v, p.vs);
  strides_of(out, p.os);
  p.hq = q.size(1);
  p.group = q.size(1) / k.size(1);
  p.sq = q.size(2);
  p.sk = k.size(2);
  // (a query head's share of its kv head's k and v)
  p.chunk = causal_chunk(q, 2 * p.sk * q.size(3) * q.element_size() / std::max<int64_t>(1, p.group));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  if (q.numel() == 0) return true;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (q.size(3) == 256) {
    return env_is("CUSTOMOPS_ATTENTION_WS_KEYS256", "64") ? attention_fwd_ws<256, 2, 64>(q, k, v, causal, p, stream)
                                                          : attention_fwd_ws<256>(q, k, v, causal, p, stream);
  }
  if (use_sm90(q) && use_sm90_ws()) {
    const bool ran = q.size(3) == 128 ? attention_fwd_ws<128>(q, k, v, causal, p, stream)
                     : ws_rows_192()   ? attention_fwd_ws<64, 3>(q, k, v, causal, p, stream)
                                       : attention_fwd_ws<64>(q, k, v, causal, p, stream);
    if (ran) {
      return true;
    }
  }
  if (use_sm90(q)) {
    const dim3 grid((p.sq + kSm90Rows - 1) / kSm90Rows, p.hq, q.size(0));
    with_types(q, causal, [&](auto t, auto d, auto c) {
      using T = decltype(t);
      constexpr int D = decltype(d)::value;
      launch(attention_fwd_sm90_kernel<T, D, kSm90Keys, decltype(c)::value>, grid, kSm90Threads,
             sm90_fwd_smem_bytes<D, kSm90Keys>(), stream, p);
    });
    return true;
  }
  const dim3 grid((p.sq + kFwdRows - 1) / kFwdRows, p.hq, q.size(0));
  with_types(q, causal, [&](auto t, auto d, auto c) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    launch(attention_fwd_kernel<T, D, kFwdRowTiles, kFwdKeys, decltype(c)::value>, grid, kFwdWarps * 32,
           fwd_smem_bytes<D, kFwdRowTiles, kFwdKeys>(), stream, p);
  });
  return true;
}

// Writes dq, dk and dv (their inputs' sizes, unit last stride, 16-byte aligned rows).
void attention_bwd_cuda(const at::Tensor& go_in, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q_in,
                        const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
                        const at::Tensor& lse, bool causal, double scale, const at::Tensor& dq, const at::Tensor& dk,
                        const at::Tensor& dv) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
  const at::Tensor go = readable(go_in), out = readable(out_in);
  const int64_t bsz = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), sk = k.size(2);
  const bool sm90 = use_sm90_bwd(q);
  const DqMode dq_mode = sm90 ? sm90_dq_mode(d) : DqMode::pass;
  // The warp-specialized kernels' tensor maps (q, dO, k, v), where asked for and possible.
  std::optional<std::array<CUtensorMap, 4>> ws_maps, dq_maps;
  const WsBwd ws = sm90_ws_bwd();
  // (128 query rows a dK/dV step: asked for, head dim 64, dQ a pass of its own or the TMA's reductions)
  const bool rows128 =
      sm90 && ws.dkdv && d == 64 && (dq_mode == DqMode::pass || dq_mode == DqMode::reduce) && sm90_bwd_rows128();
  if (sm90 && dq_mode != DqMode::atomic && ws.dkdv) {
    ws_maps = bwd_maps(q, go, k, v, rows128 ? 128 : kSm90BwdRows, kSm90BwdKeys);
  }
  const bool atomic_dq = dq_mode == DqMode::atomic;
  // (the prep kernel's rows: whole query blocks of every backward kernel)
  const int64_t pad = rows128 ? 128 : kBwdRows, sq_pad = (sq + pad - 1) / pad * pad;
  const auto f32 = q.options().dtype(at::kFloat);
  // dQ through the TMA's reductions adds into a float32 accumulator of whole query blocks (padded rows
  // included; twice q's bytes at 16 bits), where memory and the TMA allow it: else the dQ pass, which
  // writes dq itself (an out-of-memory here falls back, as a long-context backward that fits without
  // the accumulator should run).
  bool reduce_dq = dq_mode == DqMode::reduce && ws_maps;
  at::Tensor dq_acc;
  std::optional<CUtensorMap> dq_acc_map;
  if (reduce_dq) {
    try {
      dq_acc = at::zeros({bsz, hq, sq_pad, d}, f32);
      dq_acc_map = tensor_map(dq_acc, kSm90DqTileRows);  // (boxes: a consumer's tile, 64 rows at either kRows)
    } catch (const c10::OutOfMemoryError&) {
    }
    reduce_dq = dq_acc_map.has_value();
    if (!reduce_dq) dq_acc = at::Tensor();
  }
  // (the mma.sync backward's and the atomic dQ's accumulator)
  if (!sm90 || atomic_dq) dq_acc = at::zeros({bsz, hq, atomic_dq ? sq_pad : sq, d}, f32);
  const at::Tensor dt = at::empty({bsz, hq, sq_pad}, f32), lse2 = at::empty({bsz, hq, sq_pad}, f32);
  const bool keys128 = d == 64 && sm90_dq_keys128();
  if (sm90 && !atomic_dq && !reduce_dq && ws.dq) dq_maps = bwd_maps(q, go, k, v, kSm90DqRows, keys128 ? 128 : kSm90DqKeys);
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor glse = grad_lse.has_value() && grad_lse->defined() ? grad_lse->contiguous() : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();

  PrepParams pp{};
  pp.go = go.data_ptr();
  pp.out = out.data_ptr();
  pp.lse = lse_c.data_ptr<float>();
  pp.grad_lse = glse.defined() ? glse.data_ptr<float>() : nullptr;
  pp.dt = dt.data_ptr<float>();
  pp.lse2 = lse2.data_ptr<float>();
  strides_of(go, pp.gs);
  strides_of(out, pp.os);
  pp.hq = hq;
  pp.sq = sq;
  pp.sq_pad = sq_pad;
  pp.rows = bsz * hq * sq_pad;

  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.go = go.data_ptr();
  p.dt = pp.dt;
  p.lse2 = pp.lse2;
  p.dq = dq_acc.defined() ? dq_acc.data_ptr<float>() : nullptr;
  p.dq_out = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  strides_of(q, p.qs);
  strides_of(k, p.ks);
  strides_of(v, p.vs);
  strides_of(go, p.gs);
  strides_of(dq, p.dqs);
  strides_of(dk, p.dks);
  strides_of(dv, p.dvs);
  p.hq = hq;
  p.group = hq / k.size(1);
  p.sq = sq;
  p.sk = sk;
  p.sq_pad = sq_pad;
  // (the dK/dV kernels' blocks stream q and dO of each query head of their group; the dQ kernel's, a
  // query head's share of k and v)
  p.dkdv_chunk = dkdv_chunk(q, 2 * p.group * sq * q.size(3) * q.element_size(), (sk + 127) / 128, bsz * k.size(1));
  p.dq_chunk = causal_chunk(q, 2 * sk * q.size(3) * q.element_size() / std::max<int64_t>(1, p.group));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.mask_split = sm90_bwd_mask_split();

  if (pp.rows > 0) {
    with_types(q, false, [&](auto t, auto dd, auto) {
      using T = decltype(t);
      constexpr int D = decltype(dd)::value;
      const int64_t threads = pp.rows * (D / 8);
      attention_bwd_prep_kernel<T, D><<<(threads + 255) / 256, 256, 0, stream>>>(pp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (sm90) {
    // (an empty batch or sequence: no grid, a zero grid dimension is a launch error; sk = 0 leaves
    // dq to the dQ kernel, which writes zeros, and sq = 0 dk and dv to the other)
    with_types(q, causal, [&](auto t, auto dd, auto c) {
      using T = decltype(t);
      constexpr int D = decltype(dd)::value;
      const dim3 grid((sk + kSm90BwdKeys - 1) / kSm90BwdKeys, k.size(1), bsz);
      if (sk > 0 && bsz > 0 && atomic_dq) {
        launch(attention_bwd_dkdv_sm90_kernel<T, D, decltype(c)::value, true>, grid, kSm90BwdThreads,
               sm90_dkdv_smem_bytes<D, true>(), stream, p);
      } else if (sk > 0 && bsz > 0 && reduce_dq) {
        const auto& m = *ws_maps;
        if constexpr (D == 64) {
          if (rows128) {
            launch(attention_bwd_dkdv_sm90_ws_kernel<T, D, decltype(c)::value, true, 128>, grid, kSm90BwdWsThreads,
                   sm90_dkdv_ws_smem_bytes<D, true, 128>(), stream, m[0], m[1], m[2], m[3], *dq_acc_map, p);
          }
        }
        if (D != 64 || !rows128) {
          launch(attention_bwd_dkdv_sm90_ws_kernel<T, D, decltype(c)::value, true>, grid, kSm90BwdWsThreads,
                 sm90_dkdv_ws_smem_bytes<D, true>(), stream, m[0], m[1], m[2], m[3], *dq_acc_map, p);
        }
      } else if (sk > 0 && bsz > 0 && ws_maps) {
        const auto& m = *ws_maps;  // (k's map in the unused dQ accumulator's place)
        if constexpr (D == 64) {
          if (rows128) {
            launch(attention_bwd_dkdv_sm90_ws_kernel<T, D, decltype(c)::value, false, 128>, grid, kSm90BwdWsThreads,
                   sm90_dkdv_ws_smem_bytes<D, false, 128>(), stream, m[0], m[1], m[2], m[3], m[2], p);
          }
        }
        if (D != 64 || !rows128) {
          launch(attention_bwd_dkdv_sm90_ws_kernel<T, D, decltype(c)::value>, grid, kSm90BwdWsThreads,
                 sm90_dkdv_ws_smem_bytes<D>(), stream, m[0], m[1], m[2], m[3], m[2], p);
        }
      } else if (sk > 0 && bsz > 0) {
        launch(attention_bwd_dkdv_sm90_kernel<T, D, decltype(c)::value>, grid, kSm90BwdThreads,
               sm90_dkdv_smem_bytes<D>(), stream, p);
      }
      if (sq > 0 && hq > 0 && bsz > 0 && !atomic_dq && !reduce_dq && dq_maps) {
        const auto& m = *dq_maps;
        const at::Tensor counter = tile_counter(p.dq_work, q, kSm90DqRows, stream);
        const dim3 dq_grid = ws_grid(p.dq_work, q);
        if constexpr (D == 64) {
          if (keys128) {
            launch(attention_bwd_dq_sm90_ws_kernel<T, D, decltype(c)::value, 128>, dq_grid, kSm90BwdWsThreads,
                   sm90_dq_ws_smem_bytes<D, 128>(), stream, m[0], m[1], m[2], m[3], p);
          }
        }
        if (D != 64 || !keys128) {
          launch(attention_bwd_dq_sm90_ws_kernel<T, D, decltype(c)::value>, dq_grid, kSm90BwdWsThreads,
                 sm90_dq_ws_smem_bytes<D>(), stream, m[0], m[1], m[2], m[3], p);
        }
      } else if (sq > 0 && hq > 0 && bsz > 0 && !atomic_dq && !reduce_dq) {
        launch(attention_bwd_dq_sm90_kernel<T, D, decltype(c)::value>,
               dim3((sq + kSm90DqRows - 1) / kSm90DqRows, hq, bsz), kSm90BwdThreads, sm90_dq_smem_bytes<D>(), stream,
               p);
      }
    });
    if (atomic_dq || reduce_dq) dq.copy_(dq_acc.narrow(2, 0, sq));
    return;
  }
  if (sk > 0 && bsz > 0) {  // an empty batch: no grid (a zero grid dimension is a launch error)
    constexpr int kKeys = 16 * kBwdWarps;
    const dim3 grid((sk + kKeys - 1) / kKeys, k.size(1), bsz);
    with_types(q, causal, [&](auto t, auto dd, auto c) {
      using T = decltype(t);
      constexpr int D = decltype(dd)::value;
      launch(attention_bwd_kernel<T, D, kBwdWarps, decltype(c)::value>, grid, kBwdWarps * 32,
             bwd_smem_bytes<D, kBwdWarps>(), stream, p);
    });
  }
  dq.copy_(dq_acc);
}

// ---- entry points: the fused kernels where they take the inputs, the blocked ATen kernels else --
std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, std::optional<double> scale_opt) {
  check_attention("customops::attention", q, k, v);
  auto [out, lse] = attention_outputs(q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const double scale = attention_scale(scale_opt, q.size(3));
  if (!attention_cuda_fused(q, scale, /*forward=*/true) || !attention_fwd_cuda(q, k, v, causal, scale, out, lse)) {
    attention_blocked::forward(q, k, v, causal, scale, out, lse);
  }
  return {out, lse};
}

// What both of ATen's backward kernels below (SDPA's own) take: float16 or bfloat16, a positive finite
// scale, no gradient of lse (their backward has no term for one), nonempty, batch and heads within a
// grid's 65535.
bool aten_backward_takes(const at::Tensor& q, const at::Tensor& k, double scale,
                         const std::optional<at::Tensor>& grad_lse) {
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) return false;
  if (!(scale > 0.0) || !std::isfinite(scale) || (grad_lse.has_value() && grad_lse->defined())) return false;
  return q.numel() != 0 && k.numel() != 0 && q.size(0) <= 65535 && q.size(1) <= 65535;
}

// Head dim 256's backward, which no kernel of ours takes yet: ATen's FlashAttention-2 backward (the
// kernel of SDPA's flash backend; bottom-right causal and grouped-query heads as ours), 7x the
// blocked one on an H100, where it takes the inputs: float16 or bfloat16, sm_80 or newer, a
// positive scale, no gradient of lse (its backward has no term for one), nonempty, batch and heads
// within a grid's 65535, and a torch built with it (ATen's errors fall back to the blocked one:
// nothing is written before it returns). q, k, v, dO and out go in with unit last stride and 16-byte
// aligned rows (readable()), lse as its log-sum-exp, a row that saw no key (-inf) as +inf so that its
// probabilities are 0 there too. Like SDPA's, its dQ is added by atomics (not bitwise reproducible
// unless torch.use_deterministic_algorithms, under which it takes its deterministic variant). Also
// every head dim up to 256 where asked (any_head_dim: the deterministic stand-in for the mma.sync
// backward, below). Whether it ran (dq, dk and dv written).
bool attention_bwd_flash2(const at::Tensor& go, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                          bool causal, double scale, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                          bool any_head_dim = false) {
  if (any_head_dim ? q.size(3) > 256 || q.size(3) % 8 != 0 : q.size(3) != 256) return false;
  if (!aten_backward_takes(q, k, scale, grad_lse)) return false;
  if (at::cuda::getDeviceProperties(q.get_device())->major < 8 || env_is("CUSTOMOPS_ATTENTION_FLASH2", "0")) return false;
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor lse_in = lse.masked_fill(lse == -std::numeric_limits<float>::infinity(),
                                            std::numeric_limits<float>::infinity()).contiguous();
  const at::Tensor none = at::empty({0}, q.options().dtype(at::kLong));
  at::Tensor gq, gk, gv;
  try {
    std::tie(gq, gk, gv) = at::_scaled_dot_product_flash_attention_backward(
        readable(go), readable(q), readable(k), readable(v), readable(out), lse_in, at::Tensor(), at::Tensor(),
        q.size(2), k.size(2), 0.0, causal, none, none, scale);
  } catch (const c10::Error&) {  // (a torch without it, a GPU its build has no kernel for)
    return false;
  }
  dq.copy_(gq);
  dk.copy_(gk);
  dv.copy_(gv);
  return true;
}

// The largest element offset of t, plus one, within int32 (cuDNN's graph keeps sizes and strides as int).
bool offsets_fit_int32(const at::Tensor& t) {
  int64_t end = 1;
  for (int64_t i = 0; i < t.dim(); ++i) end += (t.size(i) - 1) * t.stride(i);
  return end <= std::numeric_limits<int32_t>::max();
}
// t with the dense strides of `order_of`'s dimension order (innermost: the smallest stride).
at::Tensor dense_in_order_of(const at::Tensor& order_of, const at::Tensor& t) {
  std::array<int64_t, 4> order{0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return order_of.stride(a) < order_of.stride(b); });
  std::array<int64_t, 4> strides{};
  int64_t step = 1;
  for (const int64_t d : order) {
    strides[d] = step;
    step *= t.size(d);
  }
  if (t.strides() == at::IntArrayRef(strides)) return t;
  at::Tensor dense = at::empty_strided(t.sizes(), strides, t.options());
  dense.copy_(t);
  return dense;
}
// Whether cuDNN's backward (below) is the one to run where it computes ours: where ours is the slower.
bool want_cudnn_bwd(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  if (env_is("CUSTOMOPS_ATTENTION_BWD_CUDNN", "0")) return false;
  if (env_is("CUSTOMOPS_ATTENTION_BWD_CUDNN", "1")) return true;
  const bool ours = attention_cuda_fused(q, scale) && use_sm90_bwd(q);
  return !(ours && (q.size(3) == 64 || (causal && k.size(2) <= 2048)));
}
// ATen's cuDNN attention backward (the kernel of SDPA's cuDNN backend), given our forward's out and
// lse: the default where it computes our gradients and ours is not faster. On an H100, forward+backward
// with the functions interleaved, three runs (docs/benchmarks.md), ours against it: at head dim 64
// causal 1.04-1.06x (grouped heads 1.12-1.17x), full 1.01-1.02x; at 128 causal with 2k keys
// 1.04x, with 8k-16k 0.97-1.00x, full 0.96-0.99x; ATen's FlashAttention-2 backward at head dim 256 (no
// wgmma backward of ours there) 0.65x. So ours runs at head dim 64, and causal at 128 up to 2k keys,
// where our wgmma backward takes the shape; cuDNN's the rest (CUSTOMOPS_ATTENTION_BWD_CUDNN=0: ours
// everywhere, =1: cuDNN's wherever it computes ours).
// It runs where the loss has no gradient of lse (ours adds that term), float16 or bfloat16 on an H100/H200 (the
// GPUs it was measured on), a positive scale, causal only with Sq == Sk (its mask is top-left aligned,
// ours bottom-right), head dims up to 128 in multiples of 8 and 256 (as ATen's own checks allow its
// backward), more than one query and key (ATen refuses one key; cuDNN 9.25-9.26's backward gives NaN
// for one query), key counts other than 64 mod 128 (where cuDNN's SM90 backward is reported to give NaN
// for rows of very small lse), batch and heads within 65535, offsets within 32 bits (its graph keeps
// strides as int), not under torch.use_deterministic_algorithms (its dQ is added by atomics) nor during
// a CUDA-graph capture (a new shape builds a cuDNN graph), and a torch built with it (ATen's errors fall
// back: nothing is written before it returns; a sticky CUDA error is raised). Every row sees a key
// there, so lse is finite. ATen caches its graphs by q, k and v's layouts but builds them for out's and
// dO's too: both go in with the dense strides of q's dimension order (as ATen allocates its own out), so
// that one key always means one layout. Whether it ran; it then sets dq, dk and dv: ATen's where their
// layouts are ours (heads_layout_like), else copied into ours.
bool attention_bwd_cudnn(const at::Tensor& go, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                         bool causal, double scale, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t sq = q.size(2), sk = k.size(2), d = q.size(3);
  if (!want_cudnn_bwd(q, k, causal, scale) || !((d <= 128 && d % 8 == 0) || d == 256) || (causal && sq != sk)) {
    return false;
  }
  if (sq < 2 || sk < 2 || sk % 128 == 64 || !aten_backward_takes(q, k, scale, grad_lse)) return false;
  if (at::globalContext().deterministicAlgorithms()) return false;
  if (at::cuda::getDeviceProperties(q.get_device())->major != 9) return false;
  const c10::cuda::CUDAGuard guard(q.device());
  if (at::cuda::currentStreamCaptureStatusMayInitCtx() != at::cuda::CaptureStatus::None) return false;
  const at::Tensor qr = readable(q), kr = readable(k), vr = readable(v);
  const at::Tensor o = dense_in_order_of(qr, readable(out)), g = dense_in_order_of(qr, readable(go));
  for (const at::Tensor* t : {&qr, &kr, &vr, &o, &g}) {
    if (!offsets_fit_int32(*t)) return false;
  }
  const at::Tensor none;
  const at::Tensor seed = at::empty({0}, q.options().dtype(at::kLong));
  at::Tensor gq, gk, gv;
  try {
    std::tie(gq, gk, gv) = at::_scaled_dot_product_cudnn_attention_backward(
        g, qr, kr, vr, o, lse.contiguous().unsqueeze(-1), seed, seed, none, none, none, sq, sk, 0.0, causal, scale);
  } catch (const c10::Error&) {  // (a torch without it, a shape its cuDNN refuses)
    if (cudaPeekAtLastError() != cudaSuccess) throw;  // a sticky device error: never hidden by a fallback
    return false;
  }
  // Ours are allocated only here (not before ATen's: that would hold q + k + v bytes more at the peak).
  auto ours = [](const at::Tensor& like, const at::Tensor& aten) {
    if (heads_layout_like(like, like.options().device(at::kMeta)).strides() == aten.strides()) return aten;
    return heads_layout_like(like).copy_(aten);
  };
  dq = ours(q, gq);
  dk = ours(k, gk);
  dv = ours(v, gv);
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
    std::optional<double> scale_opt) {
  check_attention_backward(grad_out, grad_lse, q, k, v, out, lse);
  const double scale = attention_scale(scale_opt, q.size(3));
  const at::Tensor go = grad_out.has_value() && grad_out->defined() ? *grad_out : at::zeros_like(q);
  // The mma.sync backward (GPUs other than the H100/H200, or CUSTOMOPS_ATTENTION_BWD_SM90=0) adds dQ
  // by float32 atomics: under torch.use_deterministic_algorithms its inputs take ATen's
  // FlashAttention-2 backward in its deterministic variant, else the blocked one (sums in one order).
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  at::Tensor dq, dk, dv;
  if (attention_bwd_cudnn(go, grad_lse, q, k, v, out, lse, causal, scale, dq, dk, dv)) return {dq, dk, dv};
  dq = heads_layout_like(q), dk = heads_layout_like(k), dv = heads_layout_like(v);
  if (attention_cuda_fused(q, scale) && (!deterministic || use_sm90_bwd(q))) {
    attention_bwd_cuda(go, grad_lse, q, k, v, out, lse, causal, scale, dq, dk, dv);
  } else if (!attention_bwd_flash2(go, grad_lse, q, k, v, out, lse, causal, scale, dq, dk, dv, deterministic)) {
    attention_blocked::backward(go, q, k, v, attention_dterm(grad_out, grad_lse, out, lse), lse, causal, scale, dq,
                                dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace

// CUDA kernels of attention.
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("_attention_backward", &attention_backward_cuda);
}

}  // namespace customops
