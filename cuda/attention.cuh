// What the attention kernels share (cuda/attention.cu, the mma.sync kernels for sm_80 and newer, and
// cuda/attention_sm90.cuh, the wgmma forward for sm_90a): PTX wrappers for ldmatrix and mma.sync,
// swizzled shared-memory tiles, the forward's parameters. No ATen: a CUDA-only test program can
// include it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cp_async.cuh"

namespace customops::cuda::attention {

// ---- PTX wrappers -------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b for a 16x16 (row-major fragment) and b 16x8 (column-major fragment), float accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// exp2(min(x, 0)), NaN for NaN (fminf would drop it): a probability from a score less its row's
// lse, which float32 rounding of a huge lse can leave above 0.
__device__ __forceinline__ float exp2_nonpositive(float x) {
  float y;
  asm("min.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return exp2_approx(y);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// The A fragment (16x16, k = 16 columns kk*16...) made of two accumulator tiles (16x8 each, columns
// kk*16... and kk*16+8...): how a matmul's result feeds the next one without shared memory.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// ---- swizzled [rows, kCols] tiles in shared memory ----------------------------------------------
template <int kCols>
struct Tile {
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  uint32_t base;                             // shared address of row 0
  __device__ __forceinline__ uint32_t at(int row, int col) const {  // col: a multiple of 8
    return base + row * (kCols * 2) + (((col >> 3) ^ (row & 7)) << 4);
  }
};

// Copies rows [r0, r0 + kRows) of a row-major matrix (row stride `stride` elements, `n` rows) into
// the tile, zero-filling rows past n; every thread of the block takes part.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile(Tile<kCols> tile, const T* src, int64_t stride, int64_t r0, int64_t n) {
  constexpr int kChunks = kRows * Tile<kCols>::kChunks;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int idx = i * kThreads + threadIdx.x;
    const int row = idx / Tile<kCols>::kChunks, c = idx % Tile<kCols>::kChunks;
    const bool valid = r0 + row < n;
    const T* p = src + (valid ? r0 + row : 0) * stride + c * 8;
    cp_async16(tile.at(row, c * 8), p, valid);
  }
}

// ldmatrix addresses, per lane, of a 16x16 block at (r0, c0) of a tile:
// - a_frag: the A fragment of the block as stored (rows = m, columns = k);
// - b_frag: two B fragments (n-tiles c0.. and c0 + 8..) of a block stored as [n rows, k columns]
//   (K for S = Q K^T), loaded with ldmatrix (no .trans): rows r0.. are n, columns are k;
// - bt_frag: two B fragments (n-tiles c0.. and c0 + 8..) of a block stored as [k rows, n columns]
//   (V for O = P V), loaded with ldmatrix.trans;
// - at_frag: the A fragment of a block stored transposed ([k rows, m columns]), ldmatrix.trans.
template <int kCols>
__device__ __forceinline__ uint32_t a_frag(Tile<kCols> t, int r0, int c0, int lane) {
  return t.at(r0 + (lane & 15), c0 + ((lane >> 4) << 3));
}
template <int kCols>
__device__ __forceinline__ uint32_t b_frag(Tile<kCols> t, int n0, int k0, int lane) {
  return t.at(n0 + ((lane >> 4) << 3) + (lane & 7), k0 + (((lane >> 3) & 1) << 3));
}
template <int kCols>
__device__ __forceinline__ uint32_t bt_frag(Tile<kCols> t, int k0, int n0, int lane) {
  return t.at(k0 + (((lane >> 3) & 1) << 3) + (lane & 7), n0 + ((lane >> 4) << 3));
}
template <int kCols>
__device__ __forceinline__ uint32_t at_frag(Tile<kCols> t, int k0, int m0, int lane) {
  return t.at(k0 + ((lane >> 4) << 3) + (lane & 7), m0 + (((lane >> 3) & 1) << 3));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInfF = std::numeric_limits<float>::infinity();

// ---- the forward's arguments --------------------------------------------------------------------
// A persistent kernel's tiles (query blocks: mblocks a head, of B * H heads): each block takes
// blockIdx.x, then one from the counter (zeroed before the launch) after another (next_tile) until
// they run out.
struct TileCounter {
  int64_t tiles, heads, mblocks;  // tiles = heads * mblocks
  unsigned long long* next;
};

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;                       // contiguous [B, Hq, Sq]
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of B, H, S (D's is 1)
  int64_t hq, group, sq, sk;
  int64_t chunk;                    // causal: heads a chunk of the block order (order_tile)
  TileCounter work;                 // the warp-specialized forward's tiles
  float scale_log2;                 // scale * log2(e)
};

// ---- the backward's arguments (both backwards) ----------------------------------------------------
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* go;
  const float* dt;    // [B, Hq, Sq_pad]
  const float* lse2;  // [B, Hq, Sq_pad]
  float* dq;          // contiguous float32 [B, Hq, Sq, D] (mma.sync) or [B, Hq, Sq_pad, D] (wgmma, atomic or reduce dQ),
                      // zeroed; scale * dS K added. Null for the wgmma backward's own dQ pass.
  void* dq_out;       // the wgmma backward's: dq itself (q's sizes, unit last stride)
  void* dk;
  void* dv;
  int64_t qs[3], ks[3], vs[3], gs[3], dqs[3], dks[3], dvs[3];
  int64_t hq, group, sq, sk, sq_pad;
  int64_t dkdv_chunk, dq_chunk;  // causal: kv heads, query heads a chunk of the block order (order_tile)
  TileCounter dq_work;           // the warp-specialized dQ kernel's tiles
  float scale, scale_log2;
  bool mask_split;  // the wgmma dK/dV kernels: the mask only on the steps that need it (masked_steps)
};

// ---- the order of a causal grid's blocks --------------------------------------------------------
// Under a causal mask a head's blocks do unequal work: the forward's and the dQ kernel's query block m
// sees m + 1 key blocks, the dK/dV kernels' key block n the query blocks from n on. The GPU starts
// blocks in launch order as SMs free up, so in head order the long blocks of the last heads start
// late and run on a GPU that is emptying. With the longest blocks of every head first (the
// longest-processing-time rule) the last blocks to start are the shortest. Heads go in chunks of
// `chunk` (whose operand that each block of a head streams, k and v or q and dO, fits in half the L2
// together, so that blocks running at once read it from there), in a chunk by rank (0: the longest)
// and then head. A grid's heads are numbered blockIdx.y + gridDim.y * blockIdx.z and its ranks run
// along x; chunk 0 keeps launch order (rank blockIdx.x).
struct GridTile {
  int64_t head, rank;
};
// Tile t of `heads` x `ranks` in that order (chunk 0: head by head, rank 0 first).
__device__ __forceinline__ GridTile order_tile(int64_t t, int64_t heads, int64_t ranks, int64_t chunk) {
  if (chunk <= 0) return {t / ranks, t % ranks};
  const int64_t span = chunk * ranks, c = t / span, r = t - c * span;
  const int64_t size = std::min<int64_t>(chunk, heads - c * chunk);
  return {c * chunk + r % size, r / size};
}
// The next tile of a persistent block (past the last one: none left).
__device__ __forceinline__ int64_t next_tile(const TileCounter& w) {
  return gridDim.x + static_cast<int64_t>(atomicAdd(w.next, 1ull));
}
// A block's (head, rank): order_tile's order of the launch, by chunk causal, head by head without the mask
// (blocks of equal work).
template <bool kCausal>
__device__ __forceinline__ GridTile grid_tile(int64_t chunk) {
  const int64_t ranks = gridDim.x, heads = int64_t(gridDim.y) * gridDim.z;
  return order_tile(blockIdx.x + ranks * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z), heads, ranks,
                    kCausal ? chunk : 0);
}

// ---- the forward's row work (both forwards) -----------------------------------------------------
// The (batch, head, query block) a forward block of kRows rows owns, and how many key blocks of
// kKeys it walks (causal: only those its rows see; the last query blocks, which see the most keys,
// start first: order_tile).
struct FwdBlock {
  int64_t b, h, hk, m0, shift;
  int nblocks;
};
// Query block `rank` of head h of batch b (causal: rank 0 is the last query block, of ranks).
template <int kRows, int kKeys, bool kCausal>
__device__ __forceinline__ FwdBlock fwd_tile(const FwdParams& p, int64_t b, int64_t h, int64_t rank, int64_t ranks) {
  FwdBlock f;
  f.b = b;
  f.h = h;
  f.hk = f.h / p.group;
  f.m0 = (kCausal ? ranks - 1 - rank : rank) * int64_t(kRows);
  f.shift = p.sk - p.sq;
  const int64_t key_end = kCausal ? std::min<int64_t>(p.sk, f.m0 + kRows + f.shift) : p.sk;
  f.nblocks = key_end > 0 ? static_cast<int>((key_end + kKeys - 1) / kKeys) : 0;
  return f;
}
// A block of a [query blocks, Hq, B] grid.
template <int kRows, int kKeys, bool kCausal>
__device__ __forceinline__ FwdBlock fwd_block(const FwdParams& p) {
  const GridTile g = grid_tile<kCausal>(p.chunk);
  return fwd_tile<kRows, kKeys, kCausal>(p, g.head / gridDim.y, g.head % gridDim.y, g.rank, gridDim.x);
}

// Row 0 of (batch b, head h) of a [B, H, S, D] tensor with strides s (of B, H, S).
template <typename T, typename P>
__device__ __forceinline__ T* head_rows(P* base, const int64_t (&s)[3], int64_t b, int64_t h) {
  return static_cast<T*>(base) + b * s[0] + h * s[1];
}

// A thread holds two rows (row0 + lane / 4 and 8 below) of a 16-row tile: kNT accumulator tiles of
// 8 columns, mma.sync's C layout, which is also a warp's share of an m64 wgmma accumulator.

// Accumulator tiles to 0.
template <int N>
__device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
}

// Keys past sk, and (causal) past a row's limit (row + shift), to -inf; keys from n0.
template <int kNT, bool kCausal>
__device__ __forceinline__ void mask_scores(float (&s)[kNT][4], int64_t row0, int64_t n0, int64_t sk, int64_t shift,
                                            int lane) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t row = row0 + lane / 4 + (e >> 1) * 8;
      const int64_t col = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
      if (col >= sk || (kCausal && col > row + shift)) s[nt][e] = -kInfF;
    }
}

// The backward's P^T = exp2(S^T scale log2(e) - lse2) in place over transposed scores (rows: keys
// key0 + lane / 4 and 8 below; column c: query m0 + c, lse2[c] its row's lse * log2(e)); where
// kMasked and `masked` (the block has such keys) 0 for keys past sk and, causal, past a query's limit
// (m0 + c + shift). kMasked false: no mask code at all (a step that sees no such key).
template <int kNT, bool kCausal, bool kMasked = true>
__device__ __forceinline__ void transposed_probs(float (&s)[kNT][4], const float* lse2, float scale_log2, bool masked,
                                                 int64_t key0, int64_t m0_shift, int64_t sk, int lane) {
  // Key row r is masked in columns c < key - m0_shift (all past sk), as an int32 bound clamped to
  // [0, 8 kNT] (c runs over [0, 8 kNT)) less this thread's column offset: one compare an element
  // against a constant, not two 64-bit ones.
  [[maybe_unused]] int below[2];
  if constexpr (kMasked) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = key0 + lane / 4 + r * 8;
      const int64_t bound = key >= sk ? 8 * kNT : kCausal ? key - m0_shift : 0;
      below[r] = static_cast<int>(std::min<int64_t>(std::max<int64_t>(bound, 0), 8 * kNT)) - (lane % 4) * 2;
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + (lane % 4) * 2 + (e & 1);
      float pr = exp2_nonpositive(fmaf(s[nt][e], scale_log2, -lse2[c]));
      if constexpr (kMasked) {
        if (masked && nt * 8 + (e & 1) < below[e >> 1]) pr = 0.f;
      }
      s[nt][e] = pr;
    }
}

// One online-softmax step over a key block's scores: the rows' new running max (log2 units, scale
// folded in), probabilities in place, running sums; corr is what the output so far must be scaled by.
template <int kNT>
__device__ __forceinline__ void softmax_step(float (&s)[kNT][4], float (&row_max)[2], float (&row_sum)[2],
                                             float (&corr)[2], float scale_log2) {
  float m_use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -kInfF;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_max[r], mx * scale_log2);
    m_use[r] = m_new == -kInfF ? 0.f : m_new;
    corr[r] = exp2_approx(row_max[r] - m_use[r]);
    row_max[r] = m_new;
  }
  // fmaf(s, scale, -m) takes the exact product, which can miss the rounded max by half its ulp:
  // at |m| > 2^31 the max's own term overflows or underflows (a row summing to 0 would pass for
  // one with no key). Where a row passes 2^24 (rare: scores beyond float32's integers), the
  // products are rounded first, so the max's term is exactly 1; otherwise one FMA a score. (The
  // warp votes first: a branch that the whole warp takes or skips needs no convergence barrier on
  // the common path, where each thread's own branch took eleven instructions a key block.)
  float sl = scale_log2;
  const bool rounded = !(fabsf(m_use[0]) < 0x1p24f && fabsf(m_use[1]) < 0x1p24f);
  if (__any_sync(0xffffffffu, rounded)) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = rounded ? __fmul_rn(s[nt][e], scale_log2) : s[nt][e];
    sl = rounded ? 1.f : scale_log2;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float p0 = exp2_approx(fmaf(s[nt][2 * r], sl, -m_use[r]));
      const float p1 = exp2_approx(fmaf(s[nt][2 * r + 1], sl, -m_use[r]));
      s[nt][2 * r] = p0;
      s[nt][2 * r + 1] = p1;
      sum += p0 + p1;
    }
    row_sum[r] = row_sum[r] * corr[r] + sum;
  }
}

template <int kDT>
__device__ __forceinline__ void scale_rows(float (&o)[kDT][4], const float (&corr)[2]) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    o[dt][0] *= corr[0];
    o[dt][1] *= corr[0];
    o[dt][2] *= corr[1];
    o[dt][3] *= corr[1];
  }
}

// out = o / sum for rows below sq; lse = (max + log2(sum)) * ln 2, or -inf (and out 0) for a row
// that saw no key. out and lse point at the (batch, head)'s row 0.
template <typename T, int kDT>
__device__ __forceinline__ void store_rows(const float (&o)[kDT][4], const float (&row_max)[2], const float (&row_sum)[2],
                                           T* out, int64_t out_stride, float* lse, int64_t row0, int64_t sq, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int64_t row = row0 + lane / 4 + r * 8;
    if (row >= sq) continue;
    // sum is 0 only for a row that saw no key (out 0, even where 0 * v was NaN); a NaN score or
    // scale makes the sum, so the row, NaN
    const bool seen = sum != 0.f;
    const float inv = 1.f / sum;
    T* orow = out + row * out_stride + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      *reinterpret_cast<uint32_t*>(orow + dt * 8) =
          pack2<T>(seen ? o[dt][2 * r] * inv : 0.f, seen ? o[dt][2 * r + 1] * inv : 0.f);
    }
    if (lane % 4 == 0) lse[row] = seen ? (row_max[r] + __log2f(sum)) * kLn2 : -kInfF;
  }
}

}  // namespace customops::cuda::attention
