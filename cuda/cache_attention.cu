// The CUDA kernels of cache_attention, cache_write and rope_cache_write, which read each sequence's length and start
// position on the device: no host sync, so a CUDA graph can capture a decode step.
//
// cache_attention (float16/bfloat16, head dims 64/128/256, up to kCacheAttentionChunkQueries new
// queries a sequence, or CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES; other inputs go through
// cache_attention_generic) is split-KV attention
// ("flash-decoding"): decoding reads a long cache for a handful of query rows, so the keys, not the
// rows, are spread over the GPU. A block owns one (sequence, kv head, split) and the grouped query
// rows of that kv head (Hq / Hkv heads x T queries, 16 rows a block, padded with zero rows): k and
// v are read once for all the heads of a group. Its split is an equal share of the sequence's
// filled length, read on the device, in whole tiles of kKeys keys, so the work follows each
// sequence's length while the grid depends only on shapes. The block's warps (4 or 8: block_warps)
// each take 16 keys of every tile (loaded by cp.async into a ring of kStages tiles, the next ones in
// flight while this one is computed) with their own online softmax: the tensor cores compute S = Q K^T and
// O += P V (mma.sync m16n8k16, the rows in the M dimension), and the warps' partials merge through
// shared memory at the end. With one split the block writes out and lse. With more, the splits
// merge: on sm_90 the splits of a (sequence, kv head, rows) are one thread-block cluster, whose
// blocks merge their partials through distributed shared memory (one kernel, nothing in global
// memory between); before sm_90 each block writes a float32 partial (out normalized, lse) and a
// second kernel merges the splits of each row.
//
// A length outside [T, S], or a slot outside the cache, makes its sequence's rows NaN (the generic
// kernel raises; raising here would need the host to wait). Other inputs go through the generic
// kernel, or, while a CUDA graph is captured, cache_attention_masked: every path of the op can be
// captured.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "attention.cuh"
#include "attention_host.h"
#include "cp_async.cuh"
#include "elementwise.cuh"
#include "env.cuh"
#include "ops/attention.h"
#include "ops/cache_attention.h"
#include "ops/layout.h"
#include "pdl.cuh"

namespace customops {
namespace {

using namespace cuda::attention;
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;
using cuda::launch_dependent;
using cuda::launch_dependent_in_clusters;
using cuda::launch_dependents;
using cuda::Pack;
using cuda::smem_addr;
using cuda::wait_prerequisites;

constexpr int kRows = 16;               // query rows a block (one mma M tile)
constexpr int kMaxSplits = 64;          // splits merged by the merge kernel
constexpr int kMaxClusterSplits = 16;   // splits merged in a cluster (16: a non-portable cluster size)

// A block's warps (16 keys of each tile a warp) and its tiles' keys.
constexpr int tile_keys(int warps) {
  return 16 * warps;
}
// Shared memory of a block: q, then a ring of `stages` tiles of k and v.
constexpr int ring_bytes(int d, int stages, int warps) {
  return (kRows + 2 * stages * tile_keys(warps)) * d * 2;
}
// Tiles of k and v in the ring: two in flight while one is computed (D = 64 and 128), one at D = 256
// (whose 64 KiB a tile already keep the loads of one block per SM in flight), and at D = 128 on
// GPUs whose blocks take less than the 100 KiB three tiles need (compute capability 8.6, 8.9, 12).
template <int D>
constexpr int max_stages() {
  return D == 256 ? 2 : 3;
}

struct CacheParams {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* lengths;
  const int64_t* slots;  // row b's sequence of the cache (nullptr: b)
  void* out;          // q's sizes, unit last stride
  float* lse;         // contiguous [B, Hq, T]
  float* part_o;      // [splits, B * Hq * T, D] (splits > 1, no cluster)
  float* part_lse;    // [splits, B * Hq * T]
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of B, H, T/S (D's is 1)
  // (32-bit: the host takes the kernel where the cache's positions fit in 2^30 and its position
  // strides in 2^31 bytes)
  int hq, hkv, group, t, s, rows;  // rows = group * t: the query rows of one kv head
  int64_t bc;                      // the cache's sequences
  int kstep, vstep;                // bytes from one position of k's (v's) cache to the next (>= 0)
  int splits;
  bool prefetch;                   // a split's first tiles into L2 before the wait (positions dense)
  float scale_log2;
};

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

// Row r of a kv head's rows: its head in the group and its query (r / t, r % t; no division when
// decoding, t = 1).
struct RowOf {
  int head, query;
};
__device__ __forceinline__ RowOf row_of(int r, int t) {
  if (t == 1) return {r, 0};
  return {r / t, r % t};
}

// A split's keys [k0, k1) of a sequence's len: an equal share, in whole tiles of kKeys.
template <int kKeys>
__device__ __forceinline__ int2 split_keys(int len, int splits, int split) {
  const int per = ((unsigned(len) + splits - 1) / unsigned(splits) + kKeys - 1) / kKeys * kKeys;
  const int k0 = min(len, split * per);
  return make_int2(k0, min(len, k0 + per));
}

// i * step for non-negative 32-bit i and step, in one 32 x 32 -> 64-bit multiply.
__device__ __forceinline__ uint64_t wide(int i, int step) {
  return static_cast<uint64_t>(static_cast<uint32_t>(i)) * static_cast<uint32_t>(step);
}

__device__ __forceinline__ float4 operator*(float a, float4 x) {
  return make_float4(a * x.x, a * x.y, a * x.z, a * x.w);
}
__device__ __forceinline__ float4 operator+(float4 x, float4 y) {
  return make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
}

// kCluster: the splits (gridDim.x of them) are one cluster and merge in it (sm_90 code only).
// kStages: tiles in the ring (ring_bytes(D, kStages, kWarps) of shared memory). kWarps: 4, or 8 (see
// block_warps).
//
// A call with a short cache is a chain of latencies, not a stream of bytes: at batch 1 with 1k
// positions a block reads two tiles, and its one warp a scheduler issues an instruction every 6
// cycles or so (Nsight Compute, H100). So the instructions outside the tile loop count as much as
// those in it: offsets within a sequence's cache are 32-bit, a thread's copies step a pointer, the
// merges move four columns an instruction.
template <typename T, int D, bool kCluster, int kStages, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) cache_attention_kernel(CacheParams p) {
  constexpr int kThreads = kWarps * 32, kKeys = tile_keys(kWarps);
  constexpr int kDT = D / 8, kD4 = D / 4;
  constexpr uint32_t kTileBytes = kKeys * D * 2;
  // A thread copies one 16-byte column chunk of rows crow, crow + kPass, ... of each tile.
  constexpr int kPass = kThreads / (D / 8);
  static_assert(kThreads % (D / 8) == 0 && kKeys % kPass == 0, "a tile's chunks divide evenly among the threads");
  extern __shared__ __align__(128) char smem[];
  const uint32_t s0 = smem_addr(smem);
  const Tile<D> sq{s0};
  const uint32_t kvbase = s0 + kRows * D * 2;
  auto k_tile = [&](int st) { return Tile<D>{kvbase + st * 2 * kTileBytes}; };
  auto v_tile = [&](int st) { return Tile<D>{kvbase + st * 2 * kTileBytes + kTileBytes}; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x;
  const int r0 = blockIdx.y * kRows;  // this block's first row of the kv head's rows
  const int b = blockIdx.z / p.hkv, hk = blockIdx.z % p.hkv;
  // This row's sequence of the cache (a hint before the wait below, read again after it)
  int64_t cb = p.slots == nullptr || p.bc == 0 ? b : std::clamp<int64_t>(p.slots[b], 0, p.bc - 1);
  // Position `key` of this block's sequence and kv head in a cache (k or v, with its strides).
  auto cache_at = [&](const void* cache, const int64_t(&st)[3], int key) {
    return static_cast<const T*>(cache) + cb * st[0] + hk * st[1] + key * st[2];
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched programmatically dependent, the blocks start while the kernel before still runs: the
  // split's first tiles of k and v are prefetched into L2 meanwhile, so that the copies after the
  // wait find them there. A hint only: the length read here may be older than the one read after
  // the wait, and a write to the cache after the prefetch reaches L2 as any write does. Blocks of 4
  // warps prefetch only a split that the tiles hold whole: where they read more, two sit on an SM
  // and the next call's prefetch slowed this one's reads (H100, in a graph, prefetch / none: batch
  // 1 with 1k positions 5.7 / 6.1 us, but 4k 11.0 / 10.4, batch 4 with 4k 28.5 / 27.5; 8 warps,
  // batch 8 with 1k 14.3 / 15.3, batch 16 with 1k 27.8 / 29.0).
  if (p.prefetch && threadIdx.x < 2) {
    const int len = static_cast<int>(std::clamp<int64_t>(p.lengths[b], 0, p.s));
    const int2 keys = split_keys<kKeys>(len, p.splits, split);
    const int n = min(keys.y - keys.x, (kStages - 1) * kKeys);
    if (n > 0 && (kWarps == 8 || n == keys.y - keys.x)) {
      const T* src = threadIdx.x == 0 ? cache_at(p.k, p.ks, keys.x) : cache_at(p.v, p.vs, keys.x);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(n * D * 2) : "memory");
    }
  }
#endif
  wait_prerequisites();
  launch_dependents();
  // q's rows (gathered from their heads and positions; padding rows zero) start loading before the
  // length is read: the two reads overlap.
  {
    constexpr int kChunks = kRows * (D / 8);
#pragma unroll
    for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
      const int idx = it * kThreads + threadIdx.x;
      if (kChunks % kThreads != 0 && idx >= kChunks) break;
      const int i = idx / (D / 8), c = idx % (D / 8);
      const bool valid = r0 + i < p.rows;
      const RowOf w = row_of(valid ? r0 + i : 0, p.t);
      const T* src =
          static_cast<const T*>(p.q) + b * p.qs[0] + (hk * p.group + w.head) * p.qs[1] + w.query * p.qs[2] + c * 8;
      cp_async16(sq.at(i, c * 8), src, valid);
    }
  }
  const int64_t len64 = p.lengths[b];
  if (p.slots != nullptr) cb = p.slots[b];
  const int64_t total = int64_t(gridDim.z / p.hkv) * p.hq * p.t;  // rows of out: B * Hq * T
  // Whether this block writes out and lse (else a partial for the merge kernel).
  const bool direct = kCluster || p.splits == 1;
  // Rows of this block that are not padding.
  const int valid = min(kRows, p.rows - r0);

  // Writes columns c.. c + 3 of row i's result, and its lse with c = 0: to out and lse, or to the
  // split's partial.
  auto store4 = [&](int i, int c, float4 o, float l) {
    const RowOf w = row_of(r0 + i, p.t);
    const int h = hk * p.group + w.head;
    const int64_t row = (int64_t(b) * p.hq + h) * p.t + w.query;
    if (direct) {
      // (out is attention_outputs': its rows start at multiples of D elements)
      T* dst = static_cast<T*>(p.out) + b * p.os[0] + h * p.os[1] + w.query * p.os[2] + c;
      *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
      if (c == 0) p.lse[row] = l;
    } else {
      *reinterpret_cast<float4*>(p.part_o + (int64_t(split) * total + row) * D + c) = o;
      if (c == 0) p.part_lse[int64_t(split) * total + row] = l;
    }
  };

  if (len64 < p.t || len64 > p.s || cb < 0 || cb >= p.bc) {  // no valid keys to read: NaN rows, which the merge keeps
    cp_async_commit();  // (q's copies land before the block leaves)
    cp_async_wait<0>();
    // (a cluster's blocks share the sequence, so all of them return here, and its first writes)
    if (kCluster && split != 0) return;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int idx = threadIdx.x; idx < valid * kD4; idx += kThreads) {
      store4(idx / kD4, idx % kD4 * 4, make_float4(nan, nan, nan, nan), nan);
    }
    return;
  }
  const int2 keys = split_keys<kKeys>(static_cast<int>(len64), p.splits, split);
  const int len = static_cast<int>(len64), k0 = keys.x;
  // Keys past the bound of the block's last query are masked for every one of its rows: the blocks
  // of a prefill chunk's early queries stop short of the split's end. (Rows that span two heads, as
  // with fewer than 16 queries, reach query t - 1: the whole split, as decoding's one query does.)
  const int first_query = row_of(r0, p.t).query;
  const int last_query = first_query + valid - 1 < p.t ? first_query + valid - 1 : p.t - 1;
  const int k1 = max(k0, min(keys.y, len - p.t + 1 + last_query));
  const int nblocks = (k1 - k0 + kKeys - 1) / kKeys;
  // This thread's chunk of the split's first key; key j (relative to k0) is p.kstep * j bytes on.
  const int crow = threadIdx.x / (D / 8), ccol = threadIdx.x % (D / 8) * 8;
  const char* kc = reinterpret_cast<const char*>(cache_at(p.k, p.ks, k0) + ccol);
  const char* vc = reinterpret_cast<const char*>(cache_at(p.v, p.vs, k0) + ccol);
  const int last = k1 - k0 - 1;  // the split's last key

  float o[kDT][4];
  float row_max[2] = {-kInfF, -kInfF}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

  // Tile j of the split into its stage of the ring (nothing past the split's tiles). Rows past the
  // split's keys are zero: their copies read nothing (from the last key's address, in the cache).
  auto load_kv = [&](int j) {
    if (j < nblocks) {
      const int st = j % kStages;
#pragma unroll
      for (int m = 0; m < kKeys / kPass; ++m) {
        const int key = j * kKeys + crow + m * kPass, row = min(key, last);
        cp_async16(k_tile(st).at(crow + m * kPass, ccol), kc + wide(row, p.kstep), key <= last);
        cp_async16(v_tile(st).at(crow + m * kPass, ccol), vc + wide(row, p.vstep), key <= last);
      }
    }
  };
  // The first tiles, a commit group each (q's copies join the first; empty groups past the split's
  // tiles keep the count the loop waits on).
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    load_kv(j);
    cp_async_commit();
  }

  // q's A fragments stay in registers for D <= 128; at D = 256 they would spill (with o's 128
  // accumulators), so each tile reads them again from shared memory.
  constexpr bool kQInRegisters = D <= 128;
  uint32_t qa[kQInRegisters ? D / 16 : 1][4];
  // Row i of the block (i = lane / 4 + 8 e) sees the keys below min(k1, len - T + 1 + its query):
  // bound[e], relative to k0. Every row sees the keys below `unmasked` (the first query's bound), so
  // a warp's keys below it need no mask.
  int bound[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + lane / 4 + 8 * e;
    const int query = r < p.rows ? row_of(r, p.t).query : p.t - 1;
    bound[e] = min(k1, len - p.t + 1 + query) - k0;
  }
  const int unmasked = min(k1, len - p.t + 1) - k0;
  for (int j = 0; j < nblocks; ++j) {
    const int st = j % kStages;
    cp_async_wait<kStages - 2>();  // tile j is here
    __syncthreads();               // for every thread, and every warp is done with tile j - 1
    if constexpr (kQInRegisters) {
      if (j == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], a_frag(sq, 0, kk * 16, lane));
      }
    }
    load_kv(j + kStages - 1);  // into tile j - 1's stage
    cp_async_commit();
    // s = q k^T over this warp's 16 keys of the tile, the even and odd 16-column steps of D in two
    // accumulators (two chains of dependent products half as long).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int qi = kQInRegisters ? kk : 0;
      if constexpr (!kQInRegisters) ldmatrix_x4(qa[0], a_frag(sq, 0, kk * 16, lane));
      uint32_t bf[4];
      ldmatrix_x4(bf, b_frag(k_tile(st), warp * 16, kk * 16, lane));
      float(&acc)[2][4] = kk % 2 == 0 ? s : s2;
      mma<T>(acc[0], qa[qi], bf[0], bf[1]);
      mma<T>(acc[1], qa[qi], bf[2], bf[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];
    const int n0 = j * kKeys + warp * 16;  // relative to k0
    if (n0 + 16 > unmasked) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (n0 + nt * 8 + (lane % 4) * 2 + (e & 1) >= bound[e >> 1]) s[nt][e] = -kInfF;
        }
    }
    float corr[2];
    softmax_step(s, row_max, row_sum, corr, p.scale_log2);
    scale_rows(o, corr);
    // o += p v over the same 16 keys.
    uint32_t a[4];
    accumulators_to_a<T>(a, s[0], s[1]);
#pragma unroll
    for (int dt = 0; dt < kDT; dt += 2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, bt_frag(v_tile(st), warp * 16, dt * 8, lane));
      mma<T>(o[dt], a, bf[0], bf[1]);
      mma<T>(o[dt + 1], a, bf[2], bf[3]);
    }
  }
  cp_async_wait<0>();  // no copy lands in the ring after this

  // The warps' partials (their own max and sum per row) merge through shared memory, which the
  // tiles no longer need: o [warp][row][D + 8] in float32 (the padding puts a warp's stores of 8
  // rows in distinct banks), then max and sum [warp][row]; in a cluster the block's result follows,
  // out [row][D] in float32 and lse [row].
  __syncthreads();
  constexpr int kStride = D + 8;
  float* mo = reinterpret_cast<float*>(smem);
  float* mm = mo + kWarps * kRows * kStride;
  float* ml = mm + kWarps * kRows;
  float* fo = ml + kWarps * kRows;
  float* fl = fo + kRows * D;
  static_assert((kWarps * kRows * (kStride + 2) + kRows * (D + 1)) * 4 <= ring_bytes(D, kStages, kWarps),
                "the merge fits the ring");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    const int row = lane / 4 + r * 8;
    if (row >= valid) continue;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      *reinterpret_cast<float2*>(mo + (warp * kRows + row) * kStride + dt * 8 + (lane % 4) * 2) =
          make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
    }
    if (lane % 4 == 0) {
      mm[warp * kRows + row] = row_max[r];
      ml[warp * kRows + row] = row_sum[r];
    }
  }
  __syncthreads();
  // Four columns a thread: the block's out and lse of row i, columns c..: to out, or to the
  // partials (the merge kernel's or the cluster's).
  for (int idx = threadIdx.x; idx < valid * kD4; idx += kThreads) {
    const int i = idx / kD4, c = idx % kD4 * 4;
    float m = -kInfF;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, mm[w * kRows + i]);
    float sum = 0.f, l;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m == -kInfF) {  // no key seen: 0 and -inf, unless a NaN score made a sum NaN
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += ml[w * kRows + i];
      const float x = sum == 0.f ? 0.f : sum;
      acc = make_float4(x, x, x, x);
      l = sum == 0.f ? -kInfF : sum;
    } else {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2_approx(mm[w * kRows + i] - m);
        sum += ml[w * kRows + i] * f;
        acc = acc + f * *reinterpret_cast<const float4*>(mo + (w * kRows + i) * kStride + c);
      }
      acc = (1.f / sum) * acc;
      l = (m + __log2f(sum)) * kLn2;
    }
    if constexpr (kCluster) {
      *reinterpret_cast<float4*>(fo + i * D + c) = acc;
      if (c == 0) fl[i] = l;
    } else {
      store4(i, c, acc, l);
    }
  }
  if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The cluster's blocks (its splits) merge. Block `split` takes every n-th group of four of the
    // rows' columns (an item), `lanes` threads an item (n rounded up to a power of two), thread r of
    // them reading split r's out and lse from that block's shared memory; the max, the weights' sum
    // and the weighted columns are shuffles among the item's threads. A NaN lse (a NaN score) makes
    // the row NaN; no key in any split, 0 and -inf. (Every thread of the block takes each step of
    // the loop: the shuffles need the whole warp.)
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's result is in its shared memory
    const int n = static_cast<int>(cluster.num_blocks());
    const int lanes = n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : 16;
    static_assert(kMaxClusterSplits <= 16, "an item's threads are at most 16 of a warp");
    const int items = (valid * kD4 - split + n - 1) / n;  // this block's
    for (int base = 0; base < items * lanes; base += kThreads) {
      const int r = (base + threadIdx.x) % lanes, item = (base + threadIdx.x) / lanes;
      const int idx = split + n * min(item, items - 1);  // (threads past the last item repeat it)
      const int i = idx / kD4, c = idx % kD4 * 4;
      float l = -kInfF;
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < n) {
        l = cluster.map_shared_rank(fl, r)[i];
        x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(fo, r) + i * D + c);
      }
      bool nan = isnan(l);
      float m = l;
      for (int off = 1; off < lanes; off *= 2) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        nan |= __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), off) != 0;
      }
      const float w = m == -kInfF ? 0.f : __expf(l - m);
      float sum = w;
      x = w * x;
      for (int off = 1; off < lanes; off *= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
        x.x += __shfl_xor_sync(0xffffffffu, x.x, off);
        x.y += __shfl_xor_sync(0xffffffffu, x.y, off);
        x.z += __shfl_xor_sync(0xffffffffu, x.z, off);
        x.w += __shfl_xor_sync(0xffffffffu, x.w, off);
      }
      if (r == 0 && item < items) {
        const float nanf = std::numeric_limits<float>::quiet_NaN();
        const float z = nan ? nanf : 0.f;
        store4(i, c, nan || m == -kInfF ? make_float4(z, z, z, z) : (1.f / sum) * x,
               nan ? nanf : m == -kInfF ? -kInfF : m + __logf(sum));
      }
    }
    cluster.sync();  // no block leaves while another reads its shared memory
#else
    __trap();  // launched only where the code is sm_90's
#endif
  }
}

// Merges the splits of each row: a warp a row. Lane i holds the lse of splits i and i + 32, so the
// max, the weights and their sum are warp reductions; then each lane sums D / 32 columns over the
// splits, the weight of each shuffled from its lane (the partials' loads do not wait on each other).
struct MergeParams {
  const float* part_o;
  const float* part_lse;
  void* out;
  float* lse;
  int64_t os[3];
  int64_t hq, t, rows;
  int splits;
};
static_assert(kMaxSplits <= 64, "the merge holds two splits a lane");

template <typename T, int D>
__global__ void __launch_bounds__(128) cache_attention_merge_kernel(MergeParams p) {
  wait_prerequisites();
  launch_dependents();
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  constexpr unsigned kAll = 0xffffffffu;
  float l[2], w[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int s = lane + 32 * e;
    l[e] = s < p.splits ? p.part_lse[int64_t(s) * p.rows + row] : -kInfF;
  }
  const bool nan = __any_sync(kAll, isnan(l[0]) || isnan(l[1]));
  float m = fmaxf(l[0], l[1]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(kAll, m, off));
  const bool empty = m == -kInfF;  // no split saw a key
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    w[e] = empty ? 0.f : __expf(l[e] - m);
    sum += w[e];
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(kAll, sum, off);
  constexpr int kPer = D / 32;
  float acc[kPer] = {};
  if (!nan && !empty) {
#pragma unroll 4
    for (int s = 0; s < p.splits; ++s) {
      const float ws = __shfl_sync(kAll, s < 32 ? w[0] : w[1], s & 31);
      const float* src = p.part_o + (int64_t(s) * p.rows + row) * D + lane;
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += ws * src[e * 32];
    }
  }
  const float nanf = std::numeric_limits<float>::quiet_NaN();
  const int64_t bh = row / p.t, tq = row % p.t;
  T* dst = static_cast<T*>(p.out) + (bh / p.hq) * p.os[0] + (bh % p.hq) * p.os[1] + tq * p.os[2] + lane;
#pragma unroll
  for (int e = 0; e < kPer; ++e) dst[e * 32] = from_float<T>(nan ? nanf : empty ? 0.f : acc[e] / sum);
  if (lane == 0) p.lse[row] = nan ? nanf : empty ? -kInfF : m + __logf(sum);
}

// ---- host side ----------------------------------------------------------------------------------
template <typename Fn>
void with_types(const at::Tensor& q, Fn&& fn) {
  auto with_d = [&](auto t) {
    switch (q.size(3)) {
      case 64: fn(t, std::integral_constant<int, 64>{}); break;
      case 128: fn(t, std::integral_constant<int, 128>{}); break;
      default: fn(t, std::integral_constant<int, 256>{}); break;
    }
  };
  if (q.scalar_type() == at::kHalf) {
    with_d(__half{});
  } else {
    with_d(__nv_bfloat16{});
  }
}

// Inputs the kernel does not take, while a CUDA graph is being captured (where the generic kernel's
// host read of lengths cannot run): attention over each sequence's whole cache with the keys past
// its length masked out, in ATen ops on the device. It reads every position of the cache, not the
// filled ones only; a length out of range gives NaN rows, as the kernel does.
std::tuple<at::Tensor, at::Tensor> cache_attention_masked(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& lengths,
                                                          double scale, const Slots& slots) {
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3), hkv = k_cache.size(1),
                s = k_cache.size(2), g = hq / hkv;
  const at::ScalarType acc = attention_lse_dtype(q.scalar_type());
  const auto opts = q.options().dtype(at::kLong);
  // [B, Hkv, G * T, D]: the rows of a kv head's group
  const at::Tensor qg = q.to(acc).reshape({b, hkv, g * t, d});
  // each row's sequence of the cache (a slot out of range reads sequence 0, and its row is NaN below)
  const int64_t bc = k_cache.size(0);
  const at::Tensor slot = slots ? slots->clamp(0, bc - 1) : at::Tensor();
  auto rows = [&](const at::Tensor& c) { return (slots ? c.index_select(0, slot) : c.narrow(0, 0, b)).to(acc); };
  const at::Tensor k = rows(k_cache), v = rows(v_cache);
  at::Tensor scores = at::matmul(qg, k.transpose(-2, -1)) * scale;  // [B, Hkv, G * T, S]
  const at::Tensor len = lengths.view({b, 1, 1, 1});
  const at::Tensor query = at::arange(t, opts).repeat({g}).view({1, 1, g * t, 1});
  const at::Tensor hidden = at::arange(s, opts).view({1, 1, 1, s}) > len - t + query;
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  at::Tensor lse = at::logsumexp(scores, -1, /*keepdim=*/true);
  const at::Tensor empty = lse == -std::numeric_limits<double>::infinity();
  const at::Tensor p = at::exp(scores - at::where(empty, at::zeros_like(lse), lse));
  at::Tensor out = at::matmul(p, v);
  at::Tensor bad = (lengths < t) | (lengths > s);
  if (slots) bad = bad | (*slots < 0) | (*slots >= bc);
  bad = bad.view({b, 1, 1, 1});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  out = out.masked_fill(bad, nan);
  lse = lse.masked_fill(bad, nan).squeeze(-1);
  auto [o, l] = attention_outputs(q);
  o.copy_(out.view({b, hq, t, d}));
  l.copy_(lse.view({b, hq, t}));
  return {o, l};
}

// Splits a sequence's keys go in: as many as give each SM at most one block (all SMs busy where the
// work allows, none with more keys to stream than another), at least a tile of keys each, at most
// max_splits.
int choose_splits(int sms, int64_t work, int64_t s, int max_splits, int keys) {
  return static_cast<int>(std::clamp<int64_t>(sms / work, 1, std::min<int64_t>(max_splits, (s + keys - 1) / keys)));
}

// Warps a block: 8 (tiles of 128 keys) at head dims 64 and 128 where three such tiles fit (the
// H100: 200 KiB at 128), else 4 (tiles of 64). With one block an SM, 4 warps leave each scheduler one
// warp, so every latency of a tile's work (the copies' addresses, the products' chains, the
// softmax's shuffles) is exposed and a tile takes longer than its bytes; two warps a scheduler hide
// each other's. And 4 warps' 100 KiB blocks sit two to an SM, so a cluster of them streams through
// half as many SMs. But where a sequence's many splits (work: the (sequence, kv head, rows) blocks
// before splitting) each stream under 2048 positions of the cache, 4 warps stay: their 64-key tiles
// pipeline the few tiles such a block has. Measured on the H100 (Hq/Hkv 32/8, head dim 128, bf16,
// calls in a CUDA graph, us a call, 8 warps / 4 warps, 2026-11-26): batch 1 with 1k positions
// 7.0 / 6.3, 4k 11.6 / 10.5, 16k 27.5 / 28.2, 32k 49.5 / 50.9; batch 4 with 4k 28.1 / 27.6, 32k
// 179.5 / 183.6; batch 8 and 16 within 1% of each other from 1k to 32k positions.
// CUSTOMOPS_CACHE_ATTENTION_WARPS=4 or =8 takes that count where it fits (the tests run each).
int block_warps(int d, int smem_optin, int sms, int64_t work, int64_t s) {
  if (d > 128 || ring_bytes(d, 3, 8) > smem_optin) return 4;
  if (env::is("CUSTOMOPS_CACHE_ATTENTION_WARPS", "4")) return 4;
  if (env::is("CUSTOMOPS_CACHE_ATTENTION_WARPS", "8")) return 8;
  // The splits launch_cache_attention will take, about: a cluster's 8 at most, unless a sequence wants
  // more than twice that (then the merge kernel's, as before sm_90, where this undercounts them)
  int64_t splits = sms / work;
  if (splits <= 16) splits = std::min<int64_t>(splits, 8);
  return splits > 2 && s / splits < 2048 ? 4 : 8;
}

// Clusters of `size` blocks of the kernel (smem bytes, threads a block) the current device seats at
// once; 0 where it takes none.
int active_clusters(const void* kernel, int smem, int threads, int size) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find({kernel, device, size});
  if (it != cache.end()) return it->second;
  // (cached only once both calls succeeded: a failure is raised, and the next call asks again)
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(size);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = size;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // a size the device does not take
    clusters = 0;
  }
  cache.emplace(std::make_tuple(kernel, device, size), clusters);
  return clusters;
}

// The largest cluster the kernel's splits merge in on the current device: 8, or 0 where clusters
// are not there (before sm_90, or code compiled for an older architecture).
// CUSTOMOPS_CACHE_ATTENTION_CLUSTER sets it instead, up to 16 (a non-portable size, where the GPU
// takes it) or 0 (the merge kernel, as before sm_90; the tests run every path on one GPU with it).
// 8 rather than 16: on the H100, batch 1 with 8 kv heads, 600-32k positions, 8 splits of a
// sequence in clusters were as fast as 16 or faster.
int cluster_limit(const void* kernel, int smem, int threads) {
  int limit = 0;
  if (at::cuda::getCurrentDeviceProperties()->major >= 9 && cuda::compiled_for_sm90(kernel)) {
    for (const int size : {kMaxClusterSplits, 8}) {
      if (active_clusters(kernel, smem, threads, size) > 0) {
        limit = size;
        break;
      }
    }
  }
  const int64_t cap = env::count("customops::cache_attention", "CUSTOMOPS_CACHE_ATTENTION_CLUSTER", "blocks a cluster")
                          .value_or(8);
  return static_cast<int>(std::clamp<int64_t>(cap, 0, limit));
}

// The kernel (clustered, or with the merge kernel after it) for p, whose fields but the split count
// and the partials are set.
template <typename T, int D, int kStages, int kWarps>
void launch_cache_attention(CacheParams& p, int64_t b, int64_t groups, int64_t s, int sms, const at::Tensor& out,
                            cudaStream_t stream) {
  constexpr int kSmem = ring_bytes(D, kStages, kWarps), kThreads = kWarps * 32;
  auto kernel = cache_attention_kernel<T, D, false, kStages, kWarps>;
  auto clustered = cache_attention_kernel<T, D, true, kStages, kWarps>;
  const int64_t work = b * p.hkv * groups;
  int limit = cluster_limit(reinterpret_cast<const void*>(clustered), kSmem, kThreads);
  // A few (sequence, kv head)s (batch 1 of a model with one or two kv heads) want more splits
  // than a cluster holds: the merge kernel takes up to 64.
  if (sms / work > 2 * limit) limit = 0;
  // Where the GPU cannot seat every cluster at once, the rest would wait for a second wave: the
  // merge kernel instead (with a block an SM, as 8 warps at head dim 128 are: batch 4 with 8 kv
  // heads, 32 clusters of 4 blocks; H100, 16k positions: 94.4 us against 95.7 in clusters, SDPA
  // 94.8). Blocks of 4 warps were no answer there: two of a cluster share an SM, so half the SMs
  // stream (96.6 us; batch 1 with 32k positions 58.2 against 51.3).
  if (limit > 0) {
    const int splits = choose_splits(sms, work, s, limit, tile_keys(kWarps));
    if (splits > 1 && work > active_clusters(reinterpret_cast<const void*>(clustered), kSmem, kThreads, splits)) {
      limit = 0;
    }
  }
  p.splits = choose_splits(sms, work, s, limit > 0 ? limit : kMaxSplits, tile_keys(kWarps));
  const dim3 grid(p.splits, groups, b * p.hkv);
  if (p.splits > 1 && limit > 0) {  // the splits merge in their cluster
    launch_dependent_in_clusters(clustered, grid, p.splits, dim3(kThreads), kSmem, stream, p);
    return;
  }
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int64_t rows = b * p.hq * p.t;
  at::Tensor part_o, part_lse;
  if (p.splits > 1) {
    part_o = at::empty({p.splits, rows, D}, out.options().dtype(at::kFloat));
    part_lse = at::empty({p.splits, rows}, out.options().dtype(at::kFloat));
    p.part_o = part_o.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  launch_dependent(kernel, grid, dim3(kThreads), kSmem, stream, p);
  if (p.splits > 1) {
    MergeParams mp{part_o.data_ptr<float>(), part_lse.data_ptr<float>(), p.out, p.lse, {}, p.hq, p.t, rows, p.splits};
    strides_of(out, mp.os);
    launch_dependent(cache_attention_merge_kernel<T, D>, dim3(static_cast<unsigned>((rows + 3) / 4)), dim3(128), 0,
                     stream, mp);
  }
}

std::tuple<at::Tensor, at::Tensor> cache_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                        const at::Tensor& v_in, const at::Tensor& lengths_in,
                                                        std::optional<double> scale_in, const Slots& slots_in) {
  check_cache_attention(q_in, k_in, v_in, lengths_in, slots_in);
  const double scale = attention_scale(scale_in, q_in.size(3));
  const int64_t b = q_in.size(0), hq = q_in.size(1), t = q_in.size(2), hkv = k_in.size(1), s = k_in.size(2);
  const int64_t rows = hq / hkv * t, groups = (rows + kRows - 1) / kRows;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q_in.get_device());
  const int smem_optin = static_cast<int>(prop->sharedMemPerBlockOptin);
  // The kernel takes up to kCacheAttentionChunkQueries new queries a sequence (decoding, drafts and
  // short prefill chunks, one launch for every row with the lengths on the device), or
  // CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES where set (an experiment switch), or more within the
  // thread's CacheAttentionChunks (the serving engine's prefill chunks beside decoding rows, where
  // the generic path's host reads would keep the device waiting).
  const int64_t max_queries = std::max(env::count("customops::cache_attention", "CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES",
                                                  "new queries a sequence")
                                           .value_or(kCacheAttentionChunkQueries),
                                       CacheAttentionChunks::current());
  // (a GPU whose blocks cannot take two tiles, D = 256 below compute capability 9.0 but 8.0's, and a
  // cache of more than 2^30 positions, past the kernel's 32-bit positions, take the other paths)
  if (!cache_attention_on_device(q_in.scalar_type(), q_in.size(3), std::min(t, kCacheAttentionMaxQueries)) ||
      t > max_queries || !(scale > 0.0) || !std::isfinite(scale) ||
      b * hkv > 65535 || groups > 65535 || s > (int64_t{1} << 30) || hq > (int64_t{1} << 30) || prop->major < 8 ||
      ring_bytes(static_cast<int>(q_in.size(3)), 2, 4) > smem_optin) {
    if (at::cuda::currentStreamCaptureStatusMayInitCtx() != at::cuda::CaptureStatus::None) {
      return cache_attention_masked(q_in, k_in, v_in, lengths_in, scale, slots_in);
    }
    return cache_attention_generic(q_in, k_in, v_in, lengths_in, scale_in, slots_in);
  }
  const c10::cuda::CUDAGuard guard(q_in.device());
  auto [out, lse] = attention_outputs(q_in);
  if (q_in.numel() == 0) return {out, lse};
  // (a cache whose positions lie 2^31 bytes apart or more is copied: the kernel's steps are 32-bit)
  auto cache = [](const at::Tensor& c) {
    const at::Tensor r = readable(c);
    return r.stride(2) * r.element_size() > std::numeric_limits<int>::max() ? r.clone(at::MemoryFormat::Contiguous) : r;
  };
  const at::Tensor q = readable(q_in), k = cache(k_in), v = cache(v_in), lengths = lengths_in.contiguous();
  const at::Tensor slots = slots_in ? slots_in->contiguous() : at::Tensor();
  CacheParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.slots = slots.defined() ? slots.const_data_ptr<int64_t>() : nullptr;
  p.bc = k.size(0);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  strides_of(q, p.qs);
  strides_of(k, p.ks);
  strides_of(v, p.vs);
  strides_of(out, p.os);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.group = static_cast<int>(hq / hkv);
  p.t = static_cast<int>(t);
  p.s = static_cast<int>(s);
  p.rows = static_cast<int>(rows);
  p.kstep = static_cast<int>(k.stride(2) * k.element_size());
  p.vstep = static_cast<int>(v.stride(2) * v.element_size());
  // (CUSTOMOPS_CACHE_ATTENTION_PREFETCH=0: none)
  p.prefetch = k.stride(2) == k.size(3) && v.stride(2) == v.size(3) && !env::is("CUSTOMOPS_CACHE_ATTENTION_PREFETCH", "0");
  const int sms = prop->multiProcessorCount;
  const auto stream = at::cuda::getCurrentCUDAStream();
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  with_types(q, [&](auto tag, auto d) {
    using T = decltype(tag);
    constexpr int D = decltype(d)::value;
    if constexpr (D <= 128) {
      if (block_warps(D, smem_optin, sms, b * hkv * groups, s) == 8) {
        launch_cache_attention<T, D, 3, 8>(p, b, groups, s, sms, out, stream);
        return;
      }
    }
    if constexpr (max_stages<D>() == 3 && D == 128) {
      if (ring_bytes(D, 3, 4) > smem_optin) {
        launch_cache_attention<T, D, 2, 4>(p, b, groups, s, sms, out, stream);
        return;
      }
    }
    launch_cache_attention<T, D, max_stages<D>(), 4>(p, b, groups, s, sms, out, stream);
  });
  return {out, lse};
}

// ---- cache_write: a thread an element, start read on the device --------------------------------
struct WriteParams {
  const char* src[2];  // k, v
  char* dst[2];        // k_cache, v_cache
  const int64_t* start;
  const int64_t* slots;        // row b's sequence of the cache (nullptr: b)
  int64_t ss[2][4], ds[2][4];  // element strides of src and dst (B, H, T/S, D)
  int64_t h, t, d, s, n, bc;   // n = B * H * T * D; bc: the cache's sequences
};

template <int kBytes>
__global__ void cache_write_kernel(WriteParams p) {
  wait_prerequisites();
  launch_dependents();
  using Word = std::conditional_t<kBytes == 2, uint16_t, std::conditional_t<kBytes == 4, uint32_t, uint64_t>>;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n) return;
  const int which = blockIdx.y;
  const int64_t d = idx % p.d, t = idx / p.d % p.t, h = idx / (p.d * p.t) % p.h, b = idx / (p.d * p.t * p.h);
  const int64_t pos = p.start[b] + t, c = p.slots == nullptr ? b : p.slots[b];
  if (pos < 0 || pos >= p.s || c < 0 || c >= p.bc) return;  // outside the cache: nothing written
  const auto* src = reinterpret_cast<const Word*>(p.src[which]);
  auto* dst = reinterpret_cast<Word*>(p.dst[which]);
  dst[c * p.ds[which][0] + h * p.ds[which][1] + pos * p.ds[which][2] + d * p.ds[which][3]] =
      src[b * p.ss[which][0] + h * p.ss[which][1] + t * p.ss[which][2] + d * p.ss[which][3]];
}

void cache_write_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& start_in, const Slots& slots_in) {
  check_cache_write(k_cache, v_cache, k, v, start_in, slots_in);
  if (k.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  const at::Tensor start = start_in.contiguous();
  const at::Tensor slots = slots_in ? slots_in->contiguous() : at::Tensor();
  WriteParams p{};
  const at::Tensor* srcs[2] = {&k, &v};
  const at::Tensor* dsts[2] = {&k_cache, &v_cache};
  for (int i = 0; i < 2; ++i) {
    p.src[i] = static_cast<const char*>(srcs[i]->const_data_ptr());
    p.dst[i] = static_cast<char*>(dsts[i]->data_ptr());
    for (int d = 0; d < 4; ++d) {
      p.ss[i][d] = srcs[i]->stride(d);
      p.ds[i][d] = dsts[i]->stride(d);
    }
  }
  p.start = start.const_data_ptr<int64_t>();
  p.slots = slots.defined() ? slots.const_data_ptr<int64_t>() : nullptr;
  p.bc = k_cache.size(0);
  p.h = k.size(1);
  p.t = k.size(2);
  p.d = k.size(3);
  p.s = k_cache.size(2);
  p.n = k.numel();
  const dim3 grid(static_cast<unsigned>((p.n + 255) / 256), 2);
  const auto stream = at::cuda::getCurrentCUDAStream();
  switch (k.element_size()) {
    case 2: launch_dependent(cache_write_kernel<2>, grid, dim3(256), 0, stream, p); break;
    case 4: launch_dependent(cache_write_kernel<4>, grid, dim3(256), 0, stream, p); break;
    default: launch_dependent(cache_write_kernel<8>, grid, dim3(256), 0, stream, p); break;
  }
}

// ---- rope_cache_write: rope of q and k and the cache write of k and v in one launch -------------
// A thread owns a unit of one head of one position: the 16-byte packs at u*V and D/2 + u*V, the
// rotate-half pairs between them (q and k rotated in float32, as rope's kernel; v copied). Heads
// are innermost (q's, k's, then v's), so consecutive threads read consecutive packs of a fused
// qkv projection's [B, T, H, D] rows. The rotated q goes to a new tensor, k and v to the caches at
// start[b] + t (read on the device; a row outside the cache is not written, as cache_write).
template <typename T>
struct RopeWriteParams {
  const T* src[3];       // q, k, v
  int64_t ss[3][3];      // their strides of B, H, T (D's is 1)
  T* dst[3];             // q_out, k_cache, v_cache
  int64_t ds[3][3];      // strides of B, H, T (q_out) or S (the caches)
  const T* cos;          // contiguous [Bc, T, D]
  const T* sin;
  int64_t cos_b;         // elements between batch entries of cos: T * D, or 0 when shared
  const int64_t* start;
  const int64_t* slots;  // row b's sequence of the caches (nullptr: b)
  int64_t hq, hkv, t, s, d, units, n;  // units: packs a half head; n: B * T * (Hq + 2 Hkv) * units
  int64_t bc;            // the caches' sequences
};

template <typename T, int V>
__global__ void __launch_bounds__(256) rope_cache_write_kernel(RopeWriteParams<T> p) {
  wait_prerequisites();
  launch_dependents();
  using P = Pack<T, V>;
  using A = at::opmath_type<T>;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n) return;
  const int64_t heads = p.hq + 2 * p.hkv;
  const int64_t u = idx % p.units, hh = idx / p.units % heads, bt = idx / (p.units * heads);
  const int64_t t = bt % p.t, b = bt / p.t;
  const int w = hh < p.hq ? 0 : hh < p.hq + p.hkv ? 1 : 2;
  const int64_t h = w == 0 ? hh : w == 1 ? hh - p.hq : hh - p.hq - p.hkv;
  int64_t row = t, c = b;
  if (w > 0) {
    row = p.start[b] + t;
    if (p.slots != nullptr) c = p.slots[b];
    if (row < 0 || row >= p.s || c < 0 || c >= p.bc) return;  // outside the cache: nothing written
  }
  const int64_t half = p.d / 2, i1 = u * V, i2 = half + u * V;
  const T* src = p.src[w] + b * p.ss[w][0] + h * p.ss[w][1] + t * p.ss[w][2];
  T* dst = p.dst[w] + c * p.ds[w][0] + h * p.ds[w][1] + row * p.ds[w][2];
  P x1 = *reinterpret_cast<const P*>(src + i1), x2 = *reinterpret_cast<const P*>(src + i2);
  if (w < 2) {
    const int64_t c0 = b * p.cos_b + t * p.d;
    const P c1 = *reinterpret_cast<const P*>(p.cos + c0 + i1), c2 = *reinterpret_cast<const P*>(p.cos + c0 + i2);
    const P s1 = *reinterpret_cast<const P*>(p.sin + c0 + i1), s2 = *reinterpret_cast<const P*>(p.sin + c0 + i2);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const A a1 = A(x1.v[j]), a2 = A(x2.v[j]);
      x1.v[j] = static_cast<T>(a1 * A(c1.v[j]) - a2 * A(s1.v[j]));
      x2.v[j] = static_cast<T>(a2 * A(c2.v[j]) + a1 * A(s2.v[j]));
    }
  }
  *reinterpret_cast<P*>(dst + i1) = x1;
  *reinterpret_cast<P*>(dst + i2) = x2;
}

at::Tensor rope_cache_write_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos_in,
                                 const at::Tensor& sin_in, const at::Tensor& start_in, const Slots& slots_in) {
  check_rope_cache_write(k_cache, v_cache, q, k, v, cos_in, sin_in, start_in, slots_in);
  const at::ScalarType dt = q.scalar_type();
  const int64_t d = q.size(3), v16 = 16 / q.element_size();
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  // The kernel's inputs: rotate-half over the whole head dim in 16-byte packs, unit last strides,
  // 16-byte aligned rows (cos and sin dense: a contiguous one may still start mid-pack).
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor* ts[5] = {&q, &k, &v, &k_cache, &v_cache};
  bool fits = (dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat) && cos.size(-1) == d &&
              d % (2 * v16) == 0 && q.numel() > 0 && aligned(cos) && aligned(sin);
  for (const at::Tensor* t : ts) {
    if (!fits) break;
    fits = t->stride(3) == 1 && aligned(*t);
    for (int i = 0; i < 3 && fits; ++i) fits = t->stride(i) % v16 == 0;
  }
  if (!fits) return rope_cache_write_composite(k_cache, v_cache, q, k, v, cos_in, sin_in, start_in, slots_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = heads_layout_like(q);
  const at::Tensor start = start_in.contiguous();
  const at::Tensor slots = slots_in ? slots_in->contiguous() : at::Tensor();
  const int64_t b = q.size(0), t = q.size(2), hq = q.size(1), hkv = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "customops::rope_cache_write", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      constexpr int V = 16 / sizeof(scalar_t);
      RopeWriteParams<scalar_t> p{};
      const at::Tensor* srcs[3] = {&q, &k, &v};
      at::Tensor* dsts[3] = {&q_out, const_cast<at::Tensor*>(&k_cache), const_cast<at::Tensor*>(&v_cache)};
      for (int w = 0; w < 3; ++w) {
        p.src[w] = srcs[w]->const_data_ptr<scalar_t>();
        p.dst[w] = dsts[w]->mutable_data_ptr<scalar_t>();
        for (int i = 0; i < 3; ++i) {
          p.ss[w][i] = srcs[w]->stride(i);
          p.ds[w][i] = dsts[w]->stride(i);
        }
      }
      p.cos = cos.const_data_ptr<scalar_t>();
      p.sin = sin.const_data_ptr<scalar_t>();
      p.cos_b = cos.dim() == 3 && cos.size(0) > 1 ? t * d : 0;
      p.start = start.const_data_ptr<int64_t>();
      p.slots = slots.defined() ? slots.const_data_ptr<int64_t>() : nullptr;
      p.bc = k_cache.size(0);
      p.hq = hq;
      p.hkv = hkv;
      p.t = t;
      p.s = k_cache.size(2);
      p.d = d;
      p.units = d / 2 / V;
      p.n = b * t * (hq + 2 * hkv) * p.units;
      launch_dependent(rope_cache_write_kernel<scalar_t, V>, dim3(static_cast<unsigned>((p.n + 255) / 256)), dim3(256),
                       0, at::cuda::getCurrentCUDAStream(), p);
    }
  });
  return q_out;
}

}  // namespace

TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("cache_attention", &cache_attention_cuda);
  m.impl("cache_write", &cache_write_cuda);
  m.impl("rope_cache_write", &rope_cache_write_cuda);
}

}  // namespace customops
