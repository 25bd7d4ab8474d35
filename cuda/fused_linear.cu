// CUDA kernels of fused_linear for a few rows (decoding): y = prologue(x) @ weight.T + bias +
// residual in one launch, each weight element read once. At these sizes the op is a stream over
// the weight (a 2048 x 8192 bfloat16 weight is 32 MiB against a few 16 KiB rows of input). Two
// kernels, chosen by launch_r (the measurements are there):
// - The register kernel (gemv_kernel): every block writes prologue(x) for all rows into shared
//   memory, rounded to x's dtype as customops' rms_norm and swiglu round it (rms_norm: the block
//   reduces each row's squares first); blocks are at most one wave, so it runs once per block.
//   Each warp walks rows n0, n0 + stride, ... in segments of kUnroll 16-byte vectors per lane
//   (not cached in L1: read once), with two register buffers: the next segment's loads are issued
//   before this one's math, and the first two before the prologue. A row's last segment ends in a
//   butterfly reduction; lane 0 adds bias and residual in float32 and writes.
// - The Hopper kernel (gemv_tma_kernel, sm_90): a producer thread streams the weight into a ring
//   of shared memory through the tensor memory accelerator, for the larger weights at 1-2 rows.
// Both are launched programmatically dependent (pdl.cuh): a product launched after another kernel
// starts its blocks on the SMs the other frees and, given constant_weight (a parameter, which no
// kernel before it writes), loads its first weights before waiting for it, so a decode step's chain
// of kernels does not drain and refill the memory pipeline between them. Without constant_weight
// it waits first: a weight written by the kernel just before would be read stale.
// Other inputs (more than kMaxRows rows, rows that do not fit shared memory, float64, widths that
// are not a whole number of 16-byte vectors, unaligned weights) take the unfused path: the
// prologue op, cuBLAS, the add. Measured on an H100 (README): a Llama-3.2-1B decode step at batch
// 1 replays in 1.20 ms with these kernels (constant_weight), 1.28 when they wait before reading.
// A quantized weight (weight_scale given: float8 e4m3 with a float32 scale a row, or int4 two a
// byte with a scale a group) streams through the register kernel too, a 16-byte vector holding 16
// or 32 weights, decoded in registers (float8 by the cvt instruction; a nibble q into the float
// 2^23 + q by one byte permute, less 2^23 + 8) and dotted in float32; an int4 vector's partial
// sums are scaled by its group's scale, a float8 row's sum by the row's. The activations sit in
// shared memory in the order a vector's weights meet them (pack j of vector c at j * K/E + c), so
// that the 32 lanes' loads of one pack are contiguous. Where it applies, the tensor-core kernel
// (gemv_mma_kernel, below) takes a quantized weight's rows instead, and on Hopper a float8 weight's
// go through the same math on weights streamed into shared memory by the tensor memory accelerator
// (gemv_tma_mma_kernel). Up to kMaxQuantRows rows, in launches of up to 8 rows or one of 9-16 (the wide
// kernel; each launch streams the weight once); more rows (prefill) take quantized_rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "elementwise.cuh"
#include "env.cuh"
#include "quant_gemm.cuh"
#include "pdl.cuh"
#include "tma.cuh"
#include "ops/fused_linear.h"

namespace customops {
namespace {

using cuda::Pack;
using cuda::launch_dependent;
using cuda::launch_dependents;
using cuda::smem_addr;
using cuda::wait_prerequisites;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRows = 4;  // more rows do as well or better through cuBLAS (bench --decode)
constexpr int kUnroll = 4;
constexpr int64_t kMaxSmem = 96 * 1024;
// x's bytes past which a bf16 or fp16 weight's 3-4 rows leave the register kernel for cuBLAS (and
// 2-4 rows stay out of gemv_mma_kernel): on an H200 down's 3 rows (14,336 inputs, x in 84 KiB) took
// 65 us in the register kernel, its 4 rows 36 us through cuBLAS (bench --linear, 2026-11-29).
constexpr int64_t kMaxSmemManyRows = 64 * 1024;
// Rows of a quantized weight's product through the register kernel: int4's alternative is a
// dequantized copy of the weight (its bytes 4x over, written and read), float8's the FP8 tensor
// cores, which read the weight once for any number of rows.
// Measured on an H200 (bench --linear, Llama-3-8B layer shapes, in a graph, 2026-11-29): a layer's
// four float8 products at 8 rows took 96 us here against 146 us on the FP8 tensor cores, at 16
// rows (the wide kernel) 138 us against 144 (qkv and gate_up slower here, o_proj and down faster);
// int4 at 24 and 32 rows, launches of 16, 0.39-0.92x the time of the dequantized copy, at 64 rows
// 0.98-1.85x. But where quant_gemm_kernel applies, int4 takes it past 16 rows: a layer's four
// products at 20, 24 and 32 rows took 142, 142 and 145 us there against 196, 208 and 252 in
// launches of 16 (bf16: 130-133; H200, 2026-11-29).
constexpr int kMaxQuantRows[] = {0, 16, 32};  // by Format: (dense: kMaxRows), float8, int4
constexpr int kMaxInt4RowsBeforeTiles = 16;
constexpr int kQuantRowsALaunch = 8;
// 9-16 rows of a quantized weight's product: one launch of the wide tensor-core kernel (gemv_mma_kernel
// with kWide) where it applies
constexpr int kWideRows = 16;
static_assert(kWideRows >= kQuantRowsALaunch && kQuantRowsALaunch >= kMaxRows, "prologue's rstd holds every kernel's rows");
// The Hopper kernel (gemv_tma_kernel): consumer warps, one producer warp, chunks of weight rows.
constexpr int kConsumers = 8;
constexpr int kTmaThreads = (kConsumers + 1) * 32;
constexpr int kChunkBytes = 4096;
constexpr int kBarBytes = 128;  // the stages' barriers, before the ring
constexpr int kStages = 4;
constexpr int64_t kTmaMinBytesPerSm = 192 * 1024;  // weight bytes an SM from which it is used

// A weight's format: T itself, float8 e4m3 (a byte a weight, a float32 scale a row), or int4 (two
// a byte, low nibble first, stored + 8; a scale a group of inputs).
enum class Format { kDense, kFp8, kInt4 };

// Weights a 16-byte vector holds.
template <typename T, Format W>
constexpr int kElems = W == Format::kDense ? 16 / static_cast<int>(sizeof(T)) : W == Format::kFp8 ? 16 : 32;

template <typename T>
struct GemvArgs {
  const T* x;  // [M, K] (none, rms_norm) or [M, 2K] (swiglu: gate then up), rows x_stride apart
  int64_t x_stride;
  const void* weight;  // [N, K] weights of the format, contiguous
  const void* scale;   // float8: [N] float32; int4: [N, K / group] (T or float32); strides scale_s0, scale_s1
  int64_t scale_s0, scale_s1;
  bool scale_float;
  int group_vectors;  // int4: 16-byte vectors a group
  const T* bias;    // [N] (bias_stride apart) or null
  int64_t bias_stride;
  const T* residual;  // [M, N] with strides (r_stride0, r_stride1), or null
  int64_t r_stride0, r_stride1;
  const void* norm_weight;  // [K] (norm_stride apart; T, or float with a half-type T) or null
  int64_t norm_stride;
  bool norm_weight_float;
  T* out;  // [M, N], contiguous
  int M;
  int64_t N;
  int K;
  float eps;
  bool constant_weight;  // no kernel still running writes weight: it may be read before they end
  // gemv_mma_kernel over k_splits ranges of the inputs (blockIdx.y, k_splits > 1): each range's sums
  // into partial ([k_splits, M, N] float32), which split_k_epilogue adds and finishes
  int k_splits;
  float* partial;
};

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The V weights of pack j (weights j V ... j V + V - 1) of a 16-byte vector, as floats (before
// their scale).
template <typename T, Format W, int V>
__device__ __forceinline__ void decode(const uint4& v, int j, float* f) {
  if constexpr (W == Format::kDense) {
    const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(&v);
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = static_cast<float>(p.v[i]);
  } else if constexpr (W == Format::kFp8) {
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      const int pair = (j * V + i) / 2;  // two bytes of word pair / 2
      const auto bytes = static_cast<__nv_fp8x2_storage_t>(word(v, pair / 2) >> (16 * (pair % 2)));
      const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(bytes, __NV_E4M3));
      const float2 g = __half22float2(h);
      f[i] = g.x;
      f[i + 1] = g.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = j * V + i;  // weight e: byte e / 2 (word e / 8), the high nibble for odd e
      const uint32_t w = word(v, e / 8), nibbles = (e % 2 ? w >> 4 : w) & 0x0F0F0F0Fu;
      // the nibble q as the low byte of the float 2^23 + q, then q - 8 exactly
      f[i] = __int_as_float(__byte_perm(nibbles, 0x4B000000u, 0x7650u | ((e / 2) % 4))) - 8388616.f;
    }
  }
}

template <typename T>
__device__ __forceinline__ float scale_value(const GemvArgs<T>& a, int64_t i) {
  return a.scale_float ? static_cast<const float*>(a.scale)[i] : static_cast<float>(static_cast<const T*>(a.scale)[i]);
}

template <typename T>
__device__ __forceinline__ float scale_at(const GemvArgs<T>& a, int64_t n, int64_t g) {
  return scale_value(a, n * a.scale_s0 + g * a.scale_s1);
}

// An int4 group scale as loaded (T's bits, or float32's), made a float where it is used
// (scale_of): a load issued a task ahead then has no instruction waiting for it until that task.
// (ncu on an H200, 2026-11-29: converting the scales as they were loaded stalled each warp of
// gemv_mma_kernel for its next task's scales, and so its weights, before it used the current one:
// a quarter of the stall samples of gate_up's int4 product at 1 row.)
template <typename T>
__device__ __forceinline__ uint32_t scale_bits(const GemvArgs<T>& a, int64_t i) {
  if constexpr (sizeof(T) == 2) {
    return a.scale_float ? static_cast<const uint32_t*>(a.scale)[i] : uint32_t{static_cast<const uint16_t*>(a.scale)[i]};
  } else {
    return __float_as_uint(scale_value(a, i));
  }
}

template <typename T>
__device__ __forceinline__ float scale_of(const GemvArgs<T>& a, uint32_t bits) {
  if constexpr (sizeof(T) == 2) {
    if (!a.scale_float) return static_cast<float>(T(static_cast<uint16_t>(bits), T::from_bits()));
  }
  return __uint_as_float(bits);
}

template <typename T>
__device__ __forceinline__ float norm_weight_at(const GemvArgs<T>& a, int64_t k) {
  if (a.norm_weight == nullptr) return 1.f;
  if (a.norm_weight_float) return static_cast<const float*>(a.norm_weight)[k * a.norm_stride];
  return static_cast<float>(static_cast<const T*>(a.norm_weight)[k * a.norm_stride]);
}

// The norm weights of pack c (weights c V ... c V + V - 1) as floats: one vector load where they are
// T, contiguous and 16-byte aligned (a slice of a larger buffer may not be).
template <typename T, int V>
__device__ __forceinline__ void norm_weights_at(const GemvArgs<T>& a, int c, float* w) {
  if (a.norm_weight == nullptr) {
#pragma unroll
    for (int j = 0; j < V; ++j) w[j] = 1.f;
  } else if (!a.norm_weight_float && a.norm_stride == 1 && reinterpret_cast<uintptr_t>(a.norm_weight) % 16 == 0) {
    const Pack<T, V> p = reinterpret_cast<const Pack<T, V>*>(a.norm_weight)[c];
#pragma unroll
    for (int j = 0; j < V; ++j) w[j] = static_cast<float>(p.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) w[j] = norm_weight_at(a, int64_t{c} * V + j);
  }
}

// prologue(x) for every row, each pack of V rounded to T and handed to store(m, c, pack) (row m,
// pack c of the row; packs [lo, hi) of each row, hi < 0: to the row's end), by the block's first kN
// threads; sync() is a barrier over them. rms_norm's sums of squares (over the whole row) are shared
// by all kN threads (each row's packs strided over them, the warps' sums added in warp order by
// thread m), so that the block waits for one round of x's loads, not a warp's walk over a row.
template <typename T, int V, Prologue P, int kN, typename Store, typename Sync>
__device__ void prologue_packs(const GemvArgs<T>& a, Store store, Sync sync, int lo = 0, int hi = -1) {
  using PackT = Pack<T, V>;
  constexpr int kWarpsN = kN / 32;
  const int kv = a.K / V;
  __shared__ float rstd[kWideRows];  // (a.M: up to kMaxRows, or a quantized launch's rows)
  if constexpr (P == Prologue::kRmsNorm) {
    __shared__ float part[kWarpsN][kWideRows];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int m = 0; m < a.M; ++m) {
      const PackT* row = reinterpret_cast<const PackT*>(a.x + m * a.x_stride);
      float ss = 0.f;
      for (int c = threadIdx.x; c < kv; c += kN) {
        const PackT p = row[c];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float v = static_cast<float>(p.v[j]);
          ss += v * v;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) part[warp][m] = ss;
    }
    sync();
    if (threadIdx.x < a.M) {
      float ss = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsN; ++w) ss += part[w][threadIdx.x];
      rstd[threadIdx.x] = rsqrtf(ss / static_cast<float>(a.K) + a.eps);
    }
    sync();
  }
  if (hi < 0) hi = kv;
  for (int m = 0; m < a.M; ++m) {
    const T* row = a.x + m * a.x_stride;
    for (int c = lo + static_cast<int>(threadIdx.x); c < hi; c += kN) {
      const PackT p = reinterpret_cast<const PackT*>(row)[c];
      PackT y;
      if constexpr (P == Prologue::kNone) {
        y = p;
      } else if constexpr (P == Prologue::kRmsNorm) {
        float w[V];
        norm_weights_at<T, V>(a, c, w);
#pragma unroll
        for (int j = 0; j < V; ++j) y.v[j] = static_cast<T>(static_cast<float>(p.v[j]) * rstd[m] * w[j]);
      } else {
        const PackT u = reinterpret_cast<const PackT*>(row + a.K)[c];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float g = static_cast<float>(p.v[j]);
          y.v[j] = static_cast<T>(g / (1.f + __expf(-g)) * static_cast<float>(u.v[j]));
        }
      }
      store(m, c, y);
    }
  }
  sync();
}

// prologue(x) for every row, into xs ([M, K] of T, each row's packs of V in the order vectors of E
// weights meet them: pack j of vector c at j * K/E + c).
template <typename T, int V, Prologue P, int kN, int E, typename Sync>
__device__ void prologue(const GemvArgs<T>& a, T* xs, Sync sync) {
  constexpr int kPacks = E / V;  // packs of x a vector of weights meets
  const int kv = a.K / V, kw = a.K / E;
  prologue_packs<T, V, P, kN>(
      a,
      [&](int m, int c, const Pack<T, V>& y) {
        reinterpret_cast<Pack<T, V>*>(xs)[m * kv + (c % kPacks) * kw + c / kPacks] = y;
      },
      sync);
}

// A warp's rows: n0, n0 + stride, ... (stride: all warps of the grid); each row is split into
// segments of kUnroll 16-byte vectors per lane, and the warp walks its (row, segment) tasks with
// two register buffers: the next task's loads are issued before this one's math, so every warp
// keeps weight bytes in flight all the time, its reductions and writes included. The first two
// tasks are loaded before the prologue, which then runs while they arrive.
template <Format W>
struct Segment {
  uint4 w[kUnroll];
  uint32_t scale[W == Format::kInt4 ? kUnroll : 1];  // int4: each vector's group's (scale_bits)
};

template <typename T, Format W>
struct Tasks {
  const GemvArgs<T>& a;
  int64_t n0, stride;
  int segments, kv, count;  // kv: 16-byte vectors a weight row

  __device__ int64_t row(int t) const { return n0 + static_cast<int64_t>(t / segments) * stride; }

  __device__ __forceinline__ void load(int t, Segment<W>& seg) const {
    if (t >= count) return;
    const int64_t n = row(t);
    const uint4* r = static_cast<const uint4*>(a.weight) + n * kv;
    const int s = t % segments, lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = (s * kUnroll + u) * 32 + lane;
      if (c < kv) {
        seg.w[u] = load_streaming(r + c);
        if constexpr (W == Format::kInt4) seg.scale[u] = scale_bits(a, n * a.scale_s0 + c / a.group_vectors * a.scale_s1);
      }
    }
  }
};

// acc += w . x over task t's segment; at a row's last segment, reduce, write and reset acc.
template <typename T, Format W, int V, int R>
__device__ __forceinline__ void consume(const Tasks<T, W>& k, int t, const Segment<W>& seg, const Pack<T, V>* xp,
                                        float* acc) {
  constexpr int kPacks = kElems<T, W> / V;
  const GemvArgs<T>& a = k.a;
  const int s = t % k.segments, lane = threadIdx.x % 32, kx = a.K / V;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int c = (s * kUnroll + u) * 32 + lane;
    if (c < k.kv) {
      float part[R];  // int4: the vector's sums, then times its group's scale
#pragma unroll
      for (int m = 0; m < R; ++m) part[m] = 0.f;
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        float wf[V];
        decode<T, W, V>(seg.w[u], j, wf);
#pragma unroll
        for (int m = 0; m < R; ++m) {
          if (m < a.M) {
            const Pack<T, V> xv = xp[m * kx + j * k.kv + c];
#pragma unroll
            for (int i = 0; i < V; ++i) part[m] += wf[i] * static_cast<float>(xv.v[i]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < R; ++m) acc[m] += W == Format::kInt4 ? part[m] * scale_of(a, seg.scale[u]) : part[m];
    }
  }
  if (s != k.segments - 1) return;
#pragma unroll
  for (int m = 0; m < R; ++m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  }
  if (lane == 0) {
    const int64_t n = k.row(t);
    const float b = a.bias != nullptr ? static_cast<float>(a.bias[n * a.bias_stride]) : 0.f;
    const float rs = W == Format::kFp8 ? static_cast<const float*>(a.scale)[n * a.scale_s0] : 1.f;
#pragma unroll
    for (int m = 0; m < R; ++m) {
      if (m < a.M) {
        float y = acc[m] * rs + b;
        if (a.residual != nullptr) y += static_cast<float>(a.residual[m * a.r_stride0 + n * a.r_stride1]);
        a.out[m * a.N + n] = static_cast<T>(y);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
}

// R: rows the kernel is compiled for (a.M <= R). (8 rows need more registers: one block an SM.)
template <typename T, Format W, int R, Prologue P>
__global__ void __launch_bounds__(kThreads, R > 4 ? 1 : 2) gemv_kernel(GemvArgs<T> a) {
  constexpr int V = 16 / sizeof(T), E = kElems<T, W>;
  using PackT = Pack<T, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  const int warp = threadIdx.x / 32;
  Tasks<T, W> k{a, int64_t{blockIdx.x} * kWarps + warp, int64_t{gridDim.x} * kWarps, 0, a.K / E, 0};
  k.segments = (k.kv + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t rows = k.n0 < a.N ? (a.N - k.n0 + k.stride - 1) / k.stride : 0;
  k.count = static_cast<int>(rows * k.segments);

  Segment<W> wa, wb;
  if (!a.constant_weight) wait_prerequisites();
  k.load(0, wa);
  k.load(1, wb);
  launch_dependents();
  wait_prerequisites();
  // (ends at a block barrier: no warp returns before it)
  prologue<T, V, P, kThreads, E>(a, xs, [] { __syncthreads(); });

  const PackT* xp = reinterpret_cast<const PackT*>(xs);
  float acc[R];
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
  for (int t = 0; t < k.count; t += 2) {
    consume<T, W, V, R>(k, t, wa, xp, acc);
    k.load(t + 2, wa);
    if (t + 1 < k.count) {
      consume<T, W, V, R>(k, t + 1, wb, xp, acc);
      k.load(t + 3, wb);
    }
  }
}

// ---- Hopper: the weight streamed by the tensor memory accelerator -------------------------------
// One block an SM: kConsumers warps compute and one producer thread keeps kStages stages of weight
// in flight, each stage kConsumers chunks (a chunk: up to 4 KiB of one weight row), copied global ->
// shared memory by cp.async.bulk with an L2 evict-first hint (the weight is read once a step; the
// activations and the KV cache stay in L2). A block owns a contiguous range of output rows; its
// chunks run row-major through the stages, warp w taking chunk w of each. Partial sums go to a
// float32 accumulator per (row, input row) in shared memory, which starts at bias + residual; the
// block writes its rows at the end. The producer never reads activations, so it streams from the
// moment the block is resident (given constant_weight), while the kernel before it in the stream
// still runs (launched programmatically dependent); the consumers wait for that kernel before the
// prologue.
namespace tma {

using cuda::tma::bulk_load;
using cuda::tma::mbar_arrive;
using cuda::tma::mbar_arrive_expect_tx;
using cuda::tma::mbar_init;
using cuda::tma::mbar_wait;

__device__ __forceinline__ uint64_t evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// A barrier among the C consumer warps (named barrier 1; the producer warp is not in it).
template <int C = kConsumers>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(C * 32) : "memory");
}

// The ring's S full barriers at full (one arrival: the producer's expect_tx) and S empty ones at
// empty (each of the C consumer warps' threads, once its reads of the stage are done), 8 bytes
// each, set up by thread 0; then the block meets, and the kernel after it in the stream may launch.
template <int S, int C = kConsumers>
__device__ __forceinline__ void start_ring(uint32_t full, uint32_t empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, C * 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  launch_dependents();
}

}  // namespace tma

template <int S>
constexpr int64_t ring_bytes() {
  return kBarBytes + int64_t{S} * kConsumers * kChunkBytes;
}

// R: rows the kernel is compiled for (a.M <= R); S: stages in flight.
template <typename T, int R, Prologue P, int S>
__global__ void __launch_bounds__(kTmaThreads, 1) gemv_tma_kernel(GemvArgs<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int V = 16 / sizeof(T);
  constexpr int CE = kChunkBytes / sizeof(T);  // elements a chunk
  using PackT = Pack<T, V>;
  static_assert(2 * S * 8 <= kBarBytes, "the barriers fit their space");
  extern __shared__ __align__(128) unsigned char tma_smem[];
  const uint32_t full = smem_addr(tma_smem), empty = full + S * 8;  // barrier of stage s: + 8 s
  unsigned char* ring = tma_smem + kBarBytes;
  T* xs = reinterpret_cast<T*>(tma_smem + ring_bytes<S>());
  float* acc = reinterpret_cast<float*>(xs + int64_t{a.M} * a.K);  // [rows, R]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = blockIdx.x * a.N / gridDim.x, r1 = (blockIdx.x + 1) * a.N / gridDim.x;
  const int cpr = (a.K + CE - 1) / CE;  // chunks a row
  const int chunks = static_cast<int>(r1 - r0) * cpr, stages = (chunks + kConsumers - 1) / kConsumers;
  // The block's rows are one contiguous range of bytes; chunk c starts at offset(c) in it, and a
  // stage's chunks are one contiguous range too, copied as one.
  const int64_t row_bytes = int64_t{a.K} * sizeof(T);
  auto offset = [&](int c) { return (c / cpr) * row_bytes + (c % cpr) * int64_t{kChunkBytes}; };
  const char* wblock = static_cast<const char*>(a.weight) + r0 * row_bytes;

  tma::start_ring<S>(full, empty);

  if (warp == kConsumers) {  // the producer
    if (lane != 0) return;
    if (!a.constant_weight) wait_prerequisites();
    const uint64_t policy = tma::evict_first();
    int64_t start = 0;
    for (int i = 0; i < stages; ++i) {
      const int s = i % S;
      if (i >= S) tma::mbar_wait(empty + 8 * s, static_cast<uint32_t>((i / S - 1) & 1));
      const int64_t end = offset(min(chunks, (i + 1) * kConsumers));
      const auto bytes = static_cast<uint32_t>(end - start);
      tma::mbar_arrive_expect_tx(full + 8 * s, bytes);
      tma::bulk_load(smem_addr(ring + s * kConsumers * kChunkBytes), wblock + start, bytes, full + 8 * s, policy);
      start = end;
    }
    return;
  }

  // The consumers: bias + residual into the accumulators, the prologue, then the stages.
  wait_prerequisites();
  const int tid = threadIdx.x;
  const int rows = static_cast<int>(r1 - r0);
  for (int i = tid; i < rows * a.M; i += kConsumers * 32) {
    const int r = i % rows, m = i / rows;
    const int64_t n = r0 + r;
    float y = a.bias != nullptr ? static_cast<float>(a.bias[n * a.bias_stride]) : 0.f;
    if (a.residual != nullptr) y += static_cast<float>(a.residual[m * a.r_stride0 + n * a.r_stride1]);
    acc[r * R + m] = y;
  }
  prologue<T, V, P, kConsumers * 32, V>(a, xs, [] { tma::consumers_sync(); });

  const PackT* xp = reinterpret_cast<const PackT*>(xs);
  const int kv = a.K / V;
  for (int i = 0; i < stages; ++i) {
    const int s = i % S;
    tma::mbar_wait(full + 8 * s, static_cast<uint32_t>((i / S) & 1));
    const int c = i * kConsumers + warp;
    if (c < chunks) {
      const int kc = c % cpr;
      const auto* w = reinterpret_cast<const PackT*>(ring + s * kConsumers * kChunkBytes +
                                                     (offset(c) - offset(i * kConsumers)));
      const int nv = min(CE, a.K - kc * CE) / V, x0 = kc * (CE / V);
      float part[R];
#pragma unroll
      for (int m = 0; m < R; ++m) part[m] = 0.f;
#pragma unroll 4
      for (int v = lane; v < nv; v += 32) {
        const PackT wv = w[v];
        float wf[V];
#pragma unroll
        for (int j = 0; j < V; ++j) wf[j] = static_cast<float>(wv.v[j]);
#pragma unroll
        for (int m = 0; m < R; ++m) {
          if (m < a.M) {
            const PackT xv = xp[m * kv + x0 + v];
#pragma unroll
            for (int j = 0; j < V; ++j) part[m] += wf[j] * static_cast<float>(xv.v[j]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < R; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) part[m] += __shfl_xor_sync(0xffffffffu, part[m], o);
      }
      if (lane == 0) {
        const int r = c / cpr;
#pragma unroll
        for (int m = 0; m < R; ++m) {
          if (m < a.M) atomicAdd(&acc[r * R + m], part[m]);
        }
      }
    }
    tma::mbar_arrive(empty + 8 * s);  // (each thread's own reads: the producer's next copy waits for them)
  }
  tma::consumers_sync();
  for (int i = tid; i < rows * a.M; i += kConsumers * 32) {
    const int r = i % rows, m = i / rows;
    a.out[m * a.N + r0 + r] = static_cast<T>(acc[r * R + m]);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launch_tma launches only code compiled for sm_90+: never here
#endif
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The decode kernels' experiment switches (env.cuh): a count, 0 where unset.
int64_t env_count(const char* name) {
  return env::count("customops.fused_linear", name, "blocks, rows or warps").value_or(0);
}

// The blocks of a matrix-vector kernel's one wave: per_sm blocks an SM (as many as fit), or fewer
// where CUSTOMOPS_LINEAR_BLOCKS_PER_SM says. A wave that leaves room on every SM lets the next
// kernel's first blocks start there while this one streams (programmatic dependent launch),
// loading their first weights before this kernel ends, where a full wave has them wait for its
// blocks to exit; it streams with fewer warps. The fixed cost a product pays in a CUDA graph, 5-21
// us on an H200 (Llama-3-8B's products), is what it was for; measured there (bench --linear's graph
// column, Llama-3.2-1B shapes, 1 row, 2026-11-29) it costs more than it saves: qkv 8.4 us against
// 6.5, o_proj 5.2 against 3.6. (gemv_tma_kernel, one block an SM already, is not capped.)
int64_t wave_blocks(int64_t work, int per_sm) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  if (const int64_t n = env_count("CUSTOMOPS_LINEAR_BLOCKS_PER_SM"); n > 0) {
    per_sm = static_cast<int>(std::min<int64_t>(per_sm, n));
  }
  return std::min<int64_t>(work, int64_t{prop->multiProcessorCount} * std::max(per_sm, 1));
}

template <typename T, Format W, int R, Prologue P>
void launch_gemv(const GemvArgs<T>& a, int64_t smem, cudaStream_t stream) {
  auto* kernel = &gemv_kernel<T, W, R, P>;
  if (smem > 48 * 1024) {
    cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
  }
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t blocks = wave_blocks((a.N + kWarps - 1) / kWarps, per_sm);
  // At most one wave, all resident at once: the next kernel's blocks (launched once all of these
  // have started) take the SMs these leave, load their first weights and wait for these to end.
  launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem), stream, a);
}

// Launches Kernel (a Hopper kernel of Threads threads a block) with smem bytes of dynamic shared
// memory; false where it cannot run: only code compiled for sm_90 has the kernel's body (a later
// GPU may run the sm_80 PTX), and the dynamic shared memory must fit beside the static (the same for
// every device: asked once).
template <auto Kernel, int Threads = kTmaThreads, typename T>
bool launch_sm90(int64_t blocks, int64_t smem, cudaStream_t stream, const GemvArgs<T>& a) {
  if (!cuda::compiled_for_sm90(reinterpret_cast<const void*>(Kernel))) return false;
  static const int64_t static_smem = [] {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, Kernel));
    return static_cast<int64_t>(attr.sharedSizeBytes);
  }();
  if (smem + static_smem > static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin)) {
    return false;
  }
  cuda::allow_dynamic_smem(reinterpret_cast<const void*>(Kernel));
  launch_dependent(Kernel, dim3(static_cast<unsigned>(blocks)), dim3(Threads), static_cast<size_t>(smem), stream, a);
  return true;
}

// Launches gemv_tma_kernel; false where it does not apply (before sm_90 or code not compiled for
// it, or more shared memory than a block gets).
template <typename T, int R, Prologue P, int S>
bool launch_tma(const GemvArgs<T>& a, cudaStream_t stream) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major < 9) return false;
  const int64_t blocks = std::min<int64_t>(a.N, prop->multiProcessorCount);
  const int64_t rows = (a.N + blocks - 1) / blocks;
  if (rows * ((a.K * int64_t{sizeof(T)} + kChunkBytes - 1) / kChunkBytes) > INT32_MAX / 2) return false;
  const int64_t smem = ring_bytes<S>() + int64_t{a.M} * a.K * sizeof(T) + rows * R * sizeof(float);
  return launch_sm90<&gemv_tma_kernel<T, R, P, S>>(blocks, smem, stream, a);
}

// The Hopper kernel keeps more bytes in flight an SM (kStages x 32 KiB) and streams while the
// kernel before it finishes, which pays where each SM has many stages to stream; the register
// kernel starts sooner (its warps' first loads are issued at once), which pays on small weights.
// With 4 rows the Hopper kernel's consumers fall behind (each weight vector meets 4 rows of x from
// shared memory). Measured on an H100 (decode products at Llama-3.2-1B shapes, cold weights, 1
// row): qkv (12 MiB) 7.1 us registers / 7.2 Hopper, o (8 MiB) 4.2 / 4.9, gate_up (64 MiB) 27.0 /
// 24.3, down (32 MiB) 15.9 / 14.6, LM head (501 MiB) 186.7 / 178.0 (2.95 TB/s).
template <typename T, int R, Prologue P>
void launch_r(const GemvArgs<T>& a, int64_t smem, cudaStream_t stream) {
  const int64_t per_sm = a.N * a.K * int64_t{sizeof(T)} / at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // (The Hopper kernel's warps add their partial dot products in shared memory by atomics, in no fixed
  // order: under torch.use_deterministic_algorithms the register kernel, which sums in one order.)
  if (R <= 2 && per_sm >= kTmaMinBytesPerSm && !at::globalContext().deterministicAlgorithms() &&
      launch_tma<T, R, P, kStages>(a, stream)) {
    return;
  }
  launch_gemv<T, Format::kDense, R, P>(a, smem, stream);
}

template <typename T, Prologue P>
void launch_rows(const GemvArgs<T>& a, int64_t smem, cudaStream_t stream) {
  if (a.M == 1) return launch_r<T, 1, P>(a, smem, stream);
  if (a.M == 2) return launch_r<T, 2, P>(a, smem, stream);
  launch_r<T, 4, P>(a, smem, stream);
}

// ---- Tensor cores for a quantized weight's few rows ---------------------------------------------
// The register kernel's float32 math is the bound for a quantized weight (decoding 16 or 32 weights
// a 16-byte vector, a multiply-add a weight a row of x). Here the warps run mma.sync m16n8k16
// (bfloat16 or half in, float32 accumulate) with the weight as the A operand (a tile of 16 output
// features) and up to 8 rows of x as the B operand, so one instruction takes 16 x 16 weights for
// every row at once. A thread of group g (lane / 4) and slice c (lane % 4) loads 16 bytes of rows g
// and g + 8 of the tile at vector 4 j + c of chunk j (4 vectors of a row: 64 float8 or 128 int4
// weights), and decodes them into pairs of 16-bit values by bit operations (int4: a nibble q into
// 128 + q or 1024 + q, less 136 or 1032; float8 into bfloat16 bits times 2^120, or half by cvt).
// The reduction order inside an instruction is free, so a pair is whatever two weights decode
// together (int4: nibbles p and p + 4 of a word); the prologue writes x in shared memory in that
// pair order, so each thread's B fragments are plain loads. The 8 warps split a tile's chunks; at
// the tile's end their sums meet in shared memory, where bias, residual and the float8 row scale are
// added. An int4 chunk lies in one group (groups of 128, or a multiple): its sums take the group's
// scale before they are added.
constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaChunks = 4;  // chunks a task (a load of 2 x kMmaChunks 16-byte vectors a thread)
constexpr int kMmaRowPad = 16;  // bytes after each row of x in shared memory (fewer bank conflicts)

// The position of weight e (of a 16-byte vector) in its vector's pair order.
template <typename T, Format W>
__host__ __device__ constexpr int pair_position(int e) {
  if constexpr (W == Format::kDense) {
    return e;  // word e / 2: weights 2q and 2q + 1, as they lie
  } else if constexpr (W == Format::kInt4) {
    return e / 8 * 8 + e % 4 * 2 + e % 8 / 4;  // word e / 8: nibbles p and p + 4 a pair
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return e / 4 * 4 + e % 2 * 2 + e % 4 / 2;  // word e / 4: bytes p and p + 2 a pair
  } else {
    return e;  // (half: bytes 2q and 2q + 1, the cvt's pair)
  }
}

// a * b + c on two bfloat16 (or half) in 32-bit words
template <typename T>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

// Pair q (0 ... E / 2 - 1) of a vector as two 16-bit values of T, in a 32-bit word.
template <typename T, Format W>
__device__ __forceinline__ uint32_t decode_pair(const uint4& v, int q) {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  if constexpr (W == Format::kDense) {
    return word(v, q);  // (a bfloat16 or half weight is its own pair: nothing to decode)
  } else if constexpr (W == Format::kInt4) {
    const uint32_t w = word(v, q / 4) >> (4 * (q % 4));
    uint32_t r;
    // (w & 0x000F000F) | magic: 128 + q (bfloat16) or 1024 + q (half); then 1 x that - 136 or - 1032
    constexpr uint32_t magic = bf16 ? 0x43004300u : 0x64006400u;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(0x000F000F), "n"(magic));
    return bf16 ? fma2<T>(r, 0x3F803F80u, 0xC308C308u) : fma2<T>(r, 0x3C003C00u, 0xE408E408u);
  } else if constexpr (bf16) {
    // bytes p and p + 2 of word q / 2, each sign-extended into 16 bits, shifted left 4: the sign at
    // bit 15 and the 7 bits of exponent and mantissa at bits 4-10, a bfloat16 of the value times
    // 2^-120 (subnormals too); times 2^120 (exact; + -0 keeps a +0)
    const uint32_t sel = q % 2 == 0 ? 0xA280u : 0xB391u;
    uint32_t r;  // (prmt itself: __byte_perm ignores the selector's sign-replicate bit)
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(word(v, q / 2)), "r"(sel));
    r = (r << 4) & 0x87F087F0u;
    return fma2<T>(r, 0x7B807B80u, 0x80008000u);
  } else {
    const auto bytes = static_cast<__nv_fp8x2_storage_t>(word(v, q / 2) >> (16 * (q % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(bytes, __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  }
}

template <typename T>
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// prologue(x) for every row into xs ([M, row_elems] of T), each pack of V permuted into its
// vector's pair order (a pack lies within a vector's slice): the tensor-core kernels' B operand.
// Packs [lo, hi) of each row (hi < 0: to its end), pack lo at the row's start.
template <typename T, Format W, Prologue P, int kN, typename Sync>
__device__ void prologue_pairs(const GemvArgs<T>& a, T* xs, int row_elems, Sync sync, int lo = 0, int hi = -1) {
  constexpr int V = 16 / sizeof(T);
  static_assert(V % 8 == 0 && kElems<T, W> % V == 0, "a pack of x is whole periods of its vector's pair order");
  using PackT = Pack<T, V>;
  prologue_packs<T, V, P, kN>(
      a,
      [&](int m, int pc, const PackT& y) {
        PackT o;  // (a pack starts a period of the pair order: its permutation is pack 0's)
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[pair_position<T, W>(j)] = y.v[j];
        *reinterpret_cast<PackT*>(xs + int64_t{m} * row_elems + (pc - lo) * V) = o;
      },
      sync, lo, hi);
}

// acc (rows g, g, g + 8, g + 8 of a tile of 16 output features; tokens 2c, 2c + 1) += one chunk of
// this thread's: w0 and w1, its 16-byte vectors of rows g and g + 8, times x, token g's E values of
// the same vector in pair order. (A thread past the last token reads the last token's x: the
// tensor cores' column g of the sums depends on column g of x alone, and the tile's end writes only
// the first M columns.) An int4 chunk lies in one group: its sums take the rows' scales s0 and s1
// before they are added.
template <typename T, Format W>
__device__ __forceinline__ void mma_chunk(const uint4& w0, const uint4& w1, const T* x, float s0, float s1, float* acc) {
  constexpr int E = kElems<T, W>;
  uint32_t xw[E / 2];
  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int i = 0; i < E / 8; ++i) {
    const uint4 v = xv[i];
    xw[4 * i] = v.x;
    xw[4 * i + 1] = v.y;
    xw[4 * i + 2] = v.z;
    xw[4 * i + 3] = v.w;
  }
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < E / 4; ++s) {  // steps: pairs 2s and 2s + 1 of each row
    const uint32_t fa[4] = {decode_pair<T, W>(w0, 2 * s), decode_pair<T, W>(w1, 2 * s),
                            decode_pair<T, W>(w0, 2 * s + 1), decode_pair<T, W>(w1, 2 * s + 1)};
    if constexpr (W == Format::kInt4) {
      mma16816<T>(d, fa, xw[2 * s], xw[2 * s + 1]);
    } else {
      mma16816<T>(acc, fa, xw[2 * s], xw[2 * s + 1]);
    }
  }
  if constexpr (W == Format::kInt4) {
    acc[0] += d[0] * s0;
    acc[1] += d[1] * s0;
    acc[2] += d[2] * s1;
    acc[3] += d[3] * s1;
  }
}

// mma_chunk for 9-16 rows of x (the wide kernel): x is the A operand (tokens g and g + 8, x0 and x1,
// each E values of vector c in pair order), the weights the B operand (rows g, then rows g + 8: a
// tile's features 0-7, then 8-15), the same pairs decoded in the same order, two instructions a step.
// acc[0..3]: tokens g, g, g + 8, g + 8 of features 2c, 2c + 1, 2c, 2c + 1; acc[4..7] the same of
// features 8 + 2c and 9 + 2c. An int4 chunk's sums take their features' scales, from the threads
// that loaded them (feature r's, r < 8: s0 of group r; 8 + r: s1 of group r).
template <typename T, Format W>
__device__ __forceinline__ void mma_chunk_wide(const uint4& w0, const uint4& w1, const T* x0, const T* x1, float s0,
                                               float s1, float* acc) {
  constexpr int E = kElems<T, W>;
  const uint4* xa = reinterpret_cast<const uint4*>(x0);  // pairs 4i ... 4i + 3 of token g
  const uint4* xb = reinterpret_cast<const uint4*>(x1);  // of token g + 8
  float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float* sums = W == Format::kInt4 ? d : acc;
#pragma unroll
  for (int i = 0; i < E / 8; ++i) {  // two steps (pairs 2s and 2s + 1 each) a 16-byte load of x
    const uint4 p = xa[i], q = xb[i];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = 2 * i + h;
      const uint32_t fx[4] = {h ? p.z : p.x, h ? q.z : q.x, h ? p.w : p.y, h ? q.w : q.y};
      mma16816<T>(sums, fx, decode_pair<T, W>(w0, 2 * s), decode_pair<T, W>(w0, 2 * s + 1));
      mma16816<T>(sums + 4, fx, decode_pair<T, W>(w1, 2 * s), decode_pair<T, W>(w1, 2 * s + 1));
    }
  }
  if constexpr (W == Format::kInt4) {
    const int c = threadIdx.x % 4;
    const float f0 = __shfl_sync(0xffffffffu, s0, 8 * c), f1 = __shfl_sync(0xffffffffu, s0, 8 * c + 4);
    const float f8 = __shfl_sync(0xffffffffu, s1, 8 * c), f9 = __shfl_sync(0xffffffffu, s1, 8 * c + 4);
    acc[0] += d[0] * f0;
    acc[1] += d[1] * f1;
    acc[2] += d[2] * f0;
    acc[3] += d[3] * f1;
    acc[4] += d[4] * f8;
    acc[5] += d[5] * f9;
    acc[6] += d[6] * f8;
    acc[7] += d[7] * f9;
  }
}

// out[m, n] from the float32 sum y of row m and output feature n: times the float8 row scale, plus
// bias and residual, rounded to T.
template <typename T, Format W>
__device__ __forceinline__ void finish_output(const GemvArgs<T>& a, int m, int64_t n, float y) {
  if constexpr (W == Format::kFp8) y *= static_cast<const float*>(a.scale)[n * a.scale_s0];
  if (a.bias != nullptr) y += static_cast<float>(a.bias[n * a.bias_stride]);
  if (a.residual != nullptr) y += static_cast<float>(a.residual[m * a.r_stride0 + n * a.r_stride1]);
  a.out[m * a.N + n] = static_cast<T>(y);
}

// A tile's end: the kWarpsN warps' sums (acc, reset here) meet in red ([kWarpsN, 16, 8] floats),
// and the block's first 128 threads write the tile's outputs (finish_output), or where the inputs
// are split (kSplit: a.k_splits ranges) the sums alone, into range blockIdx.y's of a.partial. sync()
// is a barrier over the kWarpsN warps (the only threads calling this).
template <typename T, Format W, int kWarpsN, bool kSplit = false, typename Sync>
__device__ __forceinline__ void mma_tile_end(const GemvArgs<T>& a, float* red, int64_t tile, float* acc, Sync sync) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  float* r = red + threadIdx.x / 32 * 128;
  r[g * 8 + 2 * c] = acc[0];
  r[g * 8 + 2 * c + 1] = acc[1];
  r[(g + 8) * 8 + 2 * c] = acc[2];
  r[(g + 8) * 8 + 2 * c + 1] = acc[3];
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.f;
  sync();
  if (threadIdx.x < 128) {
    const int row = threadIdx.x / 8, m = threadIdx.x % 8;
    const int64_t n = tile * 16 + row;
    if (m < a.M && n < a.N) {
      float y = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsN; ++w) y += red[w * 128 + row * 8 + m];
      if constexpr (kSplit) {
        a.partial[(static_cast<int64_t>(blockIdx.y) * a.M + m) * a.N + n] = y;
      } else {
        finish_output<T, W>(a, m, n, y);
      }
    }
  }
  sync();
}

// mma_tile_end for the wide kernel: red holds [kWarpsN, 16 features, 16 tokens] floats (a feature's
// 16 tokens kWideRedPitch apart: the four lanes of a group store to four banks), and each of the
// block's 256 threads sums one (feature, token).
constexpr int kWideRedPitch = 17;
template <typename T, Format W, int kWarpsN, bool kSplit, typename Sync>
__device__ __forceinline__ void mma_tile_end_wide(const GemvArgs<T>& a, float* red, int64_t tile, float* acc, Sync sync) {
  static_assert(kWarpsN * 32 == 256, "a thread a (feature, token)");
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  constexpr int kP = kWideRedPitch;
  float* r = red + threadIdx.x / 32 * 16 * kP;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    r[(8 * h + 2 * c) * kP + g] = acc[4 * h];
    r[(8 * h + 2 * c + 1) * kP + g] = acc[4 * h + 1];
    r[(8 * h + 2 * c) * kP + g + 8] = acc[4 * h + 2];
    r[(8 * h + 2 * c + 1) * kP + g + 8] = acc[4 * h + 3];
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  sync();
  const int row = threadIdx.x / 16, m = threadIdx.x % 16;
  const int64_t n = tile * 16 + row;
  if (m < a.M && n < a.N) {
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) y += red[(w * 16 + row) * kP + m];
    if constexpr (kSplit) {
      a.partial[(static_cast<int64_t>(blockIdx.y) * a.M + m) * a.N + n] = y;
    } else {
      finish_output<T, W>(a, m, n, y);
    }
  }
  sync();
}

// A task: a warp's next U chunks of a tile (tasks_a_tile a tile for every warp, so that all reach
// the tile's end together; a warp's chunks are a contiguous range of the tile's): its weights, its
// chunks' int4 scales, and where it lies.
template <Format W, int U = kMmaChunks>
struct MmaTask {
  uint4 w[U][2];  // rows g and g + 8
  uint32_t scale[W == Format::kInt4 ? U : 1][2];  // (scale_bits)
  int tile, j0, chunks;  // its tile, its first chunk, and its chunks (0 ... U)
  bool last;             // the tile's last task: the tile's sums are written after it
};

// A warp's tasks: tasks_a_tile of each of tiles tile, tile + gridDim.x, ..., count in all, loaded
// in order by next() from a cursor (tile, sub) that moves by one a task, and each load's addresses
// formed once a task, so that loading a task takes no division and little index arithmetic. (ncu
// on an H200, 2026-11-29: gate_up's int4 product at 1 row spent 44% of its 1,250 instructions a
// task on loading it (divisions by tasks_a_tile and group_vectors, 64-bit addresses a vector),
// against 33% on decoding, at 0.52 instructions a cycle a scheduler.)
template <typename T, Format W, int U = kMmaChunks>
struct MmaTasks {
  const GemvArgs<T>& a;
  int tasks_a_tile, count;
  int chunk_lo, chunk_hi;  // this warp's chunks of a tile: [chunk_lo, chunk_hi)
  int group_shift;         // int4: log2 of the chunks a group (a power of two), else -1: divide by
  int chunks_a_group;      // chunks_a_group
  bool chunk_scales;       // int4: a group a chunk, the scales of T adjacent along a row
  int tile, sub, issued;   // the next task's tile and place in it, and the tasks loaded

  // chunks: a tile's row's, from chunk base on (a range of the inputs: gemv_mma_kernel's k_splits)
  __device__ MmaTasks(const GemvArgs<T>& args, int base, int chunks, int tiles) : a(args) {
    const int warp = threadIdx.x / 32;
    const int chunks_a_warp = (chunks + kMmaWarps - 1) / kMmaWarps;
    tasks_a_tile = max(1, (chunks_a_warp + U - 1) / U);
    count = static_cast<int>(blockIdx.x) < tiles
                ? (tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x) *
                      tasks_a_tile
                : 0;
    chunk_lo = base + warp * chunks_a_warp;
    chunk_hi = min(base + chunks, chunk_lo + chunks_a_warp);
    chunks_a_group = W == Format::kInt4 ? a.group_vectors / 4 : 1;
    group_shift = (chunks_a_group & (chunks_a_group - 1)) == 0 ? __ffs(chunks_a_group) - 1 : -1;
    chunk_scales = sizeof(T) == 2 && !a.scale_float && chunks_a_group == 1 && a.scale_s1 == 1;
    tile = static_cast<int>(blockIdx.x);
    sub = 0;
    issued = 0;
  }

  // The next task into task (its weights loaded unless it is past the last). A whole task (U chunks
  // of 16 rows, every task but at a row's or the weight's end) loads without bounds, and int4's
  // scales, where chunk_scales, from one address a row. (ncu on an H200, 2026-11-29: with a bound
  // and a scale address a load, loading took 39% of gemv_mma_kernel's instructions, int4 gate_up.)
  __device__ __forceinline__ void next(MmaTask<W, U>& task) {
    task.tile = tile;
    task.j0 = chunk_lo + sub * U;
    task.chunks = max(0, min(U, chunk_hi - task.j0));
    task.last = sub == tasks_a_tile - 1;
    if (++sub == tasks_a_tile) {
      sub = 0;
      tile += gridDim.x;
    }
    if (issued++ >= count) return;
    const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t row_vectors = a.K / kElems<T, W>;
    const int64_t n0 = int64_t{task.tile} * 16 + g;
    const bool has0 = n0 < a.N, has1 = n0 + 8 < a.N;
    const uint4* p0 = static_cast<const uint4*>(a.weight) + n0 * row_vectors + task.j0 * 4 + c;
    const uint4* p1 = p0 + 8 * row_vectors;
    [[maybe_unused]] int64_t s0 = 0, s1 = 0;  // int4: the rows' first scales
    if constexpr (W == Format::kInt4) {
      s0 = n0 * a.scale_s0;
      s1 = s0 + 8 * a.scale_s0;
    }
    const bool whole = task.chunks == U && int64_t{task.tile} * 16 + 16 <= a.N;  // (the same for the warp)
    if (whole) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        task.w[u][0] = load_streaming(p0 + 4 * u);
        task.w[u][1] = load_streaming(p1 + 4 * u);
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool in = u < task.chunks;
        task.w[u][0] = in && has0 ? load_streaming(p0 + 4 * u) : make_uint4(0, 0, 0, 0);
        task.w[u][1] = in && has1 ? load_streaming(p1 + 4 * u) : make_uint4(0, 0, 0, 0);
      }
    }
    if constexpr (W == Format::kInt4) {
      if (whole && chunk_scales) {
        const uint16_t* q0 = static_cast<const uint16_t*>(a.scale) + s0 + task.j0;
        const uint16_t* q1 = static_cast<const uint16_t*>(a.scale) + s1 + task.j0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          task.scale[u][0] = q0[u];
          task.scale[u][1] = q1[u];
        }
        return;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool in = u < task.chunks;
        const int j = task.j0 + u;
        const int64_t at = (group_shift >= 0 ? j >> group_shift : j / chunks_a_group) * a.scale_s1;
        task.scale[u][0] = in && has0 ? scale_bits(a, s0 + at) : 0u;
        task.scale[u][1] = in && has1 ? scale_bits(a, s1 + at) : 0u;
      }
    }
  }
};

// U: chunks a task; two tasks' loads a thread in flight take 16 U registers, and 4 leave room for
// two blocks an SM (128 registers a thread). (Tasks of 2 chunks, three blocks an SM, took up to
// 1.37x the time at 1-8 rows of Llama-3-8B's products with int4 weights on an H200, 2026-11-29,
// and 1.00-1.25x at 1 row after scale_bits, 2026-11-29.) kSplit: the inputs in a.k_splits ranges
// (blockIdx.y's here), a code of its own (at 128 registers a thread the ranges' arithmetic spilled
// the dense kernel's registers).
template <typename T, Format W, Prologue P, bool kSplit = false, bool kWide = false, int U = kMmaChunks>
__global__ void __launch_bounds__(kMmaThreads, 2) gemv_mma_kernel(GemvArgs<T> a) {
  constexpr int E = kElems<T, W>, V = 16 / static_cast<int>(sizeof(T));
  extern __shared__ __align__(16) unsigned char smem[];
  // this block's range of the inputs: chunks [base, base + chunks) of each row (all, or k_splits')
  const int all_chunks = a.K / (4 * E), splits = kSplit ? a.k_splits : 1;
  const int split_chunks = kSplit ? (all_chunks + splits - 1) / splits : all_chunks;
  const int base = kSplit ? min(all_chunks, static_cast<int>(blockIdx.y) * split_chunks) : 0;
  const int chunks = kSplit ? min(all_chunks - base, split_chunks) : all_chunks;
  const int row_elems = (kSplit ? chunks * 4 * E : a.K) + kMmaRowPad / static_cast<int>(sizeof(T));
  T* xs = reinterpret_cast<T*>(smem);  // [M, row_elems]: the range of each row, each vector's slice in pair order
  // [warps, 16, 8] floats (the wide kernel: [warps, 16, 16])
  float* red = reinterpret_cast<float*>(smem + int64_t{a.M} * row_elems * sizeof(T));
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

  MmaTasks<T, W, U> k(a, base, chunks, static_cast<int>((a.N + 15) / 16));
  MmaTask<W, U> ta, tb;
  if (!a.constant_weight) wait_prerequisites();
  k.next(ta);
  k.next(tb);
  launch_dependents();
  wait_prerequisites();
  if constexpr (kSplit) {
    prologue_pairs<T, W, P, kMmaThreads>(a, xs, row_elems, [] { __syncthreads(); }, base * 4 * E / V,
                                         (base + chunks) * 4 * E / V);
  } else {
    prologue_pairs<T, W, P, kMmaThreads>(a, xs, row_elems, [] { __syncthreads(); });
  }

  // rows g, g (tokens 2c, 2c + 1), g + 8, g + 8 (the wide kernel's: mma_chunk_wide)
  float acc[kWide ? 8 : 4] = {};
  // this thread's x: token g's (the last token's past M: mma_chunk), vector c of each chunk (from
  // chunk base on); the wide kernel's token g + 8 too
  const T* xg = xs + int64_t{min(g, a.M - 1)} * row_elems + c * E;
  [[maybe_unused]] const T* xg8 = xs + int64_t{min(g + 8, a.M - 1)} * row_elems + c * E;
  auto consume = [&](const MmaTask<W, U>& task) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u >= task.chunks) break;
      float s0 = 1.f, s1 = 1.f;
      if constexpr (W == Format::kInt4) {
        s0 = scale_of(a, task.scale[u][0]);
        s1 = scale_of(a, task.scale[u][1]);
      }
      const int at = (task.j0 - base + u) * 4 * E;
      if constexpr (kWide) {
        mma_chunk_wide<T, W>(task.w[u][0], task.w[u][1], xg + at, xg8 + at, s0, s1, acc);
      } else {
        mma_chunk<T, W>(task.w[u][0], task.w[u][1], xg + at, s0, s1, acc);
      }
    }
    if (task.last) {
      if constexpr (kWide) {
        mma_tile_end_wide<T, W, kMmaWarps, kSplit>(a, red, task.tile, acc, [] { __syncthreads(); });
      } else {
        mma_tile_end<T, W, kMmaWarps, kSplit>(a, red, task.tile, acc, [] { __syncthreads(); });
      }
    }
  };
  for (int t = 0; t < k.count; t += 2) {
    consume(ta);
    k.next(ta);
    if (t + 1 < k.count) {
      consume(tb);
      k.next(tb);
    }
  }
}

// x's rows and the tile ends' sums ([warps, 16, 8] floats, or [warps, 16, kWideRedPitch] for more
// than 8 rows: the wide kernel) of the tensor-core kernels
int64_t mma_smem(int64_t m, int64_t k, int64_t element_size, int warps = kMmaWarps) {
  return m * (k * element_size + kMmaRowPad) + warps * 16 * (m > kQuantRowsALaunch ? kWideRedPitch : 8) * sizeof(float);
}

// Whether gemv_mma_kernel takes m rows of k inputs of T with weights of format W: sm_80 on, k a
// whole number of chunks, and x beside the tile ends' sums in shared memory. (An int4 weight's
// groups must be whole chunks too: launch_mma.)
template <typename T, Format W>
bool mma_applies(int64_t m, int64_t k) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major >= 8 && k % (4 * kElems<T, W>) == 0 &&
         mma_smem(m, k, sizeof(T)) + 1024 <= static_cast<int64_t>(prop->sharedMemPerBlockOptin);
}

// gemv_mma_kernel's k_splits: x of many rows of a wide product leaves room for one block an SM (down's
// 14,336 inputs at 4 rows of bfloat16 take 115 KiB; int4's down product there took 34 us against 17
// at 1 row on an H200, and 8 rows, two launches, 75), so a quantized weight's inputs may be split
// into 2, 4 or 8 ranges over the blocks (gridDim.y; 8 for 16 rows: the wide kernel), each block
// holding its range of x, each range's sums added by split_k_epilogue. At most kMaxKSplits ranges,
// each of at least a chunk a warp.
constexpr int kMaxKSplits = 8;

// CUSTOMOPS_LINEAR_K_SPLITS (a switch for bench --linear): 1, 2, 4 or 8 ranges first, 0 where unset.
int forced_k_splits() {
  const int64_t forced = env_count("CUSTOMOPS_LINEAR_K_SPLITS");
  TORCH_CHECK(forced == 0 || forced == 1 || forced == 2 || forced == 4 || forced == 8,
              "customops.fused_linear: CUSTOMOPS_LINEAR_K_SPLITS must be 1, 2, 4 or 8, not ", forced);
  return static_cast<int>(forced);
}

// The inputs of a block's range where gemv_mma_kernel splits k inputs of a quantized weight (e
// weights a 16-byte vector) into the most ranges it may, or k where it may not split
// (CUSTOMOPS_LINEAR_K_SPLITS=1): the x a launch's rows must fit.
int64_t narrowest_range(int64_t k, int64_t e) {
  const int64_t chunks = k / (4 * e);
  if (k % (4 * e) != 0 || forced_k_splits() == 1) return k;
  for (int s = kMaxKSplits; s > 1; s /= 2) {
    if (chunks >= s * kMmaWarps) return (chunks + s - 1) / s * 4 * e;
  }
  return k;
}

// Adds gemv_mma_kernel's k_splits ranges' sums (a.partial) and finishes each output, a thread an
// output.
template <typename T, Format W>
__global__ void __launch_bounds__(256) split_k_epilogue(GemvArgs<T> a) {
  launch_dependents();
  wait_prerequisites();
  const int64_t outs = int64_t{a.M} * a.N, i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= outs) return;
  float y = 0.f;
  for (int s = 0; s < a.k_splits; ++s) y += a.partial[s * outs + i];
  finish_output<T, W>(a, static_cast<int>(i / a.N), i % a.N, y);
}

// Launches gemv_mma_kernel for a.M <= 8 rows, or a quantized weight's 9-16 (the wide kernel), and
// split_k_epilogue after it where it splits the inputs; false where it does not apply (sm_80 on, K a
// whole number of chunks, int4 groups that are whole chunks, x's range beside the tile ends' sums in
// shared memory). k_splits: the fewest ranges (1, 2, 4 or 8; a dense weight's 1) that leave room for
// two blocks an SM, else the fewest that give the most; CUSTOMOPS_LINEAR_K_SPLITS=N takes N where x's
// range fits.
template <typename T, Format W, Prologue P>
bool launch_mma(const GemvArgs<T>& args, cudaStream_t stream) {
  constexpr int E = kElems<T, W>;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major < 8 || args.K % (4 * E) != 0 || (W == Format::kInt4 && args.group_vectors % 4 != 0)) {
    return false;
  }
  // the kernels whole and split (its inputs in ranges), for up to 8 rows or (wide) 16; a dense
  // weight's inputs are never split nor its rows more than 8
  const bool wide = args.M > kQuantRowsALaunch;
  if (args.M > (W == Format::kDense ? kQuantRowsALaunch : kWideRows)) return false;
  using Kernel = void (*)(GemvArgs<T>);
  Kernel whole = &gemv_mma_kernel<T, W, P>, split = whole;
  if constexpr (W != Format::kDense) {
    // (int4's wide kernel takes tasks of 2 chunks: with 4 its registers spilled)
    constexpr int kWideU = W == Format::kInt4 ? 2 : kMmaChunks;
    whole = wide ? &gemv_mma_kernel<T, W, P, false, true, kWideU> : whole;
    split = wide ? &gemv_mma_kernel<T, W, P, true, true, kWideU> : &gemv_mma_kernel<T, W, P, true>;
  }
  const int chunks = args.K / (4 * E);
  int splits = 0, per_sm = 0;
  int64_t smem = 0;
  auto consider = [&](int s) {
    if (s > 1 && (W == Format::kDense || chunks < s * kMmaWarps)) return;
    const int64_t bytes = mma_smem(args.M, int64_t{(chunks + s - 1) / s} * 4 * E, sizeof(T));
    if (bytes + 1024 > static_cast<int64_t>(prop->sharedMemPerBlockOptin)) return;
    auto* kernel = s > 1 ? split : whole;
    if (bytes > 48 * 1024) cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kMmaThreads, bytes));
    if (n > per_sm) {
      splits = s;
      per_sm = n;
      smem = bytes;
    }
  };
  const int forced = W == Format::kDense ? 0 : forced_k_splits();  // (checked before the first launch)
  if (forced > 0) consider(forced);
  if (per_sm == 0 && forced != 1) {
    for (int s = 1; s <= kMaxKSplits && per_sm < 2; s *= 2) consider(s);
  }
  if (per_sm == 0) return false;
  GemvArgs<T> a = args;
  a.k_splits = splits;
  at::Tensor partial;  // (freed here, its memory reused only by later work on this stream)
  if (splits > 1) {
    partial = at::empty({splits, a.M, a.N},
                        at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
    a.partial = partial.mutable_data_ptr<float>();
  }
  const int64_t blocks = std::max<int64_t>(1, wave_blocks((a.N + 15) / 16 * splits, per_sm) / splits);
  launch_dependent(splits > 1 ? split : whole, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(splits)),
                   dim3(kMmaThreads),
                   static_cast<size_t>(smem), stream, a);
  if (splits > 1) {
    const int64_t outs = int64_t{a.M} * a.N;
    launch_dependent(&split_k_epilogue<T, W>, dim3(static_cast<unsigned>((outs + 255) / 256)), dim3(256), 0, stream, a);
  }
  return true;
}

// ---- Hopper: a quantized weight streamed by the tensor memory accelerator into the tensor cores --
// gemv_mma_kernel keeps its weight bytes in flight in registers (two tasks a warp); at one row it
// read gate_up's float8 weight (Llama-3-8B) at 53% of the H200's DRAM bandwidth and its int4 weight
// at 30%, with 8-9 cycles between a warp's instructions (ncu, 2026-11-28). Here one producer thread
// keeps S stages in flight through cp.async.bulk (each stage 16 output features' rows,
// kQuantSlabBytes of each row), as gemv_tma_kernel does for dense weights, and C consumer warps (8
// or 16) run gemv_mma_kernel's math on them from shared memory. A block owns a contiguous range of
// 16-feature tiles; a tile's rows are split into slabs (its stages, in order), each slab into
// 64-byte chunks (4 vectors a row, as gemv_mma_kernel's), warp w taking chunks w, w + C, ... of every
// slab: it loads all of them from the stage, then decodes and multiplies. Rows sit kQuantRowPitch
// apart in a stage (64 bytes of padding: rows g and g + 1, read by one quarter of a warp, fall in
// different banks). An int4 chunk's group scales are loaded a stage ahead into registers.
constexpr int kQuantSlabBytes = 2048;
constexpr int kQuantRowPitch = kQuantSlabBytes + 64;
constexpr int kQuantStageBytes = 16 * kQuantRowPitch;
constexpr int kQuantStages = 4;

// A slab's chunks a warp, with C consumer warps
template <int C>
constexpr int quant_slab_chunks() {
  return kQuantSlabBytes / 64 / C;
}

template <int S>
constexpr int64_t quant_ring_bytes() {
  return kBarBytes + int64_t{S} * kQuantStageBytes;
}

// The int4 scales of this thread's U chunks of a stage (rows g and g + 8 of its tile), or ones.
template <Format W, int U>
struct SlabScales {
  uint32_t v[W == Format::kInt4 ? U : 1][2];  // (scale_bits)
};

template <typename T, Format W, Prologue P, int S, int C>
__global__ void __launch_bounds__((C + 1) * 32, 1) gemv_tma_mma_kernel(GemvArgs<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = kElems<T, W>, U = quant_slab_chunks<C>();
  static_assert(2 * S * 8 <= kBarBytes, "the barriers fit their space");
  extern __shared__ __align__(128) unsigned char tma_smem[];
  const uint32_t full = smem_addr(tma_smem), empty = full + S * 8;  // barrier of stage s: + 8 s
  unsigned char* ring = tma_smem + kBarBytes;
  const int row_elems = a.K + kMmaRowPad / static_cast<int>(sizeof(T));
  T* xs = reinterpret_cast<T*>(tma_smem + quant_ring_bytes<S>());  // [M, row_elems], pair order
  float* red = reinterpret_cast<float*>(xs + int64_t{a.M} * row_elems);  // [C, 16, 8]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t tiles = (a.N + 15) / 16;
  const int64_t tile0 = blockIdx.x * tiles / gridDim.x, tile1 = (blockIdx.x + 1) * tiles / gridDim.x;
  const int64_t row_bytes = int64_t{a.K} / E * 16;
  const int slabs = static_cast<int>((row_bytes + kQuantSlabBytes - 1) / kQuantSlabBytes);  // a tile's stages
  const int stages = static_cast<int>(tile1 - tile0) * slabs;
  auto slab_bytes = [&](int slab) {
    return static_cast<int>(std::min<int64_t>(kQuantSlabBytes, row_bytes - int64_t{slab} * kQuantSlabBytes));
  };

  tma::start_ring<S, C>(full, empty);

  if (warp == C) {  // the producer: stage i is slab i % slabs of tile tile0 + i / slabs
    if (lane != 0) return;
    if (!a.constant_weight) wait_prerequisites();
    const uint64_t policy = tma::evict_first();
    for (int i = 0; i < stages; ++i) {
      const int s = i % S, slab = i % slabs;
      if (i >= S) tma::mbar_wait(empty + 8 * s, static_cast<uint32_t>((i / S - 1) & 1));
      const int64_t n0 = (tile0 + i / slabs) * 16;
      const int rows = static_cast<int>(std::min<int64_t>(16, a.N - n0)), bytes = slab_bytes(slab);
      tma::mbar_arrive_expect_tx(full + 8 * s, static_cast<uint32_t>(rows * bytes));
      const char* src = static_cast<const char*>(a.weight) + n0 * row_bytes + int64_t{slab} * kQuantSlabBytes;
      for (int r = 0; r < rows; ++r) {
        tma::bulk_load(smem_addr(ring + s * kQuantStageBytes + r * kQuantRowPitch), src + r * row_bytes,
                       static_cast<uint32_t>(bytes), full + 8 * s, policy);
      }
    }
    return;
  }

  // The consumers. (A stage's rows past N are not copied: what the ring holds there reaches only
  // those rows' sums, which are not written.)
  auto load_scales = [&](int i, SlabScales<W, U>& sc) {
    if constexpr (W == Format::kInt4) {
      if (i >= stages) return;
      const int64_t n = (tile0 + i / slabs) * 16 + g;
      const int chunks = slab_bytes(i % slabs) / 64, j0 = i % slabs * (kQuantSlabBytes / 64);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = warp + u * C;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sc.v[u][h] = j < chunks && n + 8 * h < a.N
                          ? scale_bits(a, (n + 8 * h) * a.scale_s0 + (j0 + j) * 4 / a.group_vectors * a.scale_s1)
                          : 0u;
        }
      }
    }
  };
  SlabScales<W, U> sc, next;
  if (!a.constant_weight) wait_prerequisites();  // (the scales are as constant as the weight)
  load_scales(0, next);
  wait_prerequisites();
  prologue_pairs<T, W, P, C * 32>(a, xs, row_elems, [] { tma::consumers_sync<C>(); });

  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g (tokens 2c, 2c + 1), g + 8, g + 8
  for (int i = 0; i < stages; ++i) {
    const int s = i % S, slab = i % slabs;
    sc = next;
    load_scales(i + 1, next);
    tma::mbar_wait(full + 8 * s, static_cast<uint32_t>((i / S) & 1));
    const unsigned char* stage = ring + s * kQuantStageBytes;
    const int chunks = slab_bytes(slab) / 64, j0 = slab * (kQuantSlabBytes / 64);
    uint4 w[U][2];  // this warp's chunks u (the slab's chunk warp + u C), rows g and g + 8
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = warp + u * C;
      if (j < chunks) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          w[u][h] = *reinterpret_cast<const uint4*>(stage + (g + 8 * h) * kQuantRowPitch + j * 64 + c * 16);
        }
      }
    }
    tma::mbar_arrive(empty + 8 * s);  // (each thread's own reads: the producer's next copy waits for them)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = warp + u * C;
      if (j < chunks) {
        float s0 = 1.f, s1 = 1.f;
        if constexpr (W == Format::kInt4) {
          s0 = scale_of(a, sc.v[u][0]);
          s1 = scale_of(a, sc.v[u][1]);
        }
        mma_chunk<T, W>(w[u][0], w[u][1], xs + int64_t{min(g, a.M - 1)} * row_elems + ((j0 + j) * 4 + c) * E, s0, s1,
                        acc);
      }
    }
    if (slab == slabs - 1) {
      mma_tile_end<T, W, C>(a, red, tile0 + i / slabs, acc, [] { tma::consumers_sync<C>(); });
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launch_tma_mma launches only code compiled for sm_90+: never here
#endif
}

// Launches gemv_tma_mma_kernel for a.M <= 8 rows of a float8 weight; false where it does not apply
// (before sm_90 or code not compiled for it, in_features not a whole number of chunks, x past the
// shared memory beside the ring, or CUSTOMOPS_LINEAR_QUANT_TMA=0: gemv_mma_kernel). An int4 weight
// takes it only with CUSTOMOPS_LINEAR_QUANT_TMA=1: its decoding (twice float8's work a byte) does not
// keep up here. Measured on an H200 in a CUDA graph (bench --linear, Llama-3-8B shapes, 1 row, one
// run), us for qkv / o / gate_up / down: float8 12.3 / 7.6 / 37.0 / 22.8 with 16 consumer warps,
// 13.2 / 8.3 / 38.1 / 24.1 with 8, 14.7 / 8.3 / 40.7 / 26.3 through gemv_mma_kernel; int4 13.5 / 8.7 /
// 48.4 / 27.8 with 16, 14.9 / 9.5 / 53.6 / 33.4 with 8, 10.8 / 6.5 / 34.6 / 23.7 through
// gemv_mma_kernel. ncu (gate_up, 16 warps): the schedulers issue on about half their cycles (float8
// 0.52 instructions a cycle, int4 0.46), about one warp of 4.2 eligible: the decoding's instructions
// and their latencies bound it, not the stream (DRAM 49% / 19% of peak at ncu's clocks). Summing a
// tile's warps by shared-memory atomics instead of a barrier a tile, with int4's scales loaded 4
// stages ahead, measured the same (float8) or 3% faster (int4): not kept. Nor was feeding int4's
// raw nibbles (136 + q) to the tensor cores with bfloat16 x, a third fewer decoding instructions,
// less 136 times each chunk's sum of x after: no faster in either kernel (2026-11-29). After
// gemv_mma_kernel's tasks and the prologue lost their divisions and per-element branches (the same
// day, H200): float8 here 10.0 / 7.0 / 35.5 / 20.5, int4 through gemv_mma_kernel 8.1 / 5.3 / 29.1 /
// 18.4 (bf16 16.9 / 12.5 / 64.2 / 35.7). With int4's scales kept as loaded (scale_bits), int4 here
// 9.9 / 6.7 / 37.4 / 21.0, through gemv_mma_kernel 7.6 / 5.2 / 25.9 / 17.3 (2026-11-29).
template <typename T, Format W, Prologue P>
bool launch_tma_mma(const GemvArgs<T>& a, cudaStream_t stream) {
  if (a.M > kQuantRowsALaunch) return false;  // (its tile ends' sums hold 8 rows)
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  constexpr int E = kElems<T, W>;
  const bool on = W == Format::kInt4 ? env::is("CUSTOMOPS_LINEAR_QUANT_TMA", "1")
                                     : !env::is("CUSTOMOPS_LINEAR_QUANT_TMA", "0");
  if (!on || prop->major < 9 || a.K % (4 * E) != 0 || (W == Format::kInt4 && a.group_vectors % 4 != 0)) {
    return false;
  }
  // consumer warps: CUSTOMOPS_LINEAR_QUANT_WARPS (8 or 16), else 16
  const int64_t warps = env_count("CUSTOMOPS_LINEAR_QUANT_WARPS");
  TORCH_CHECK(warps == 0 || warps == 8 || warps == 16,
              "customops.fused_linear: CUSTOMOPS_LINEAR_QUANT_WARPS must be 8 or 16, not ", warps);
  const int64_t blocks = std::min<int64_t>((a.N + 15) / 16, prop->multiProcessorCount);
  const auto launch = [&](auto consumers) {
    constexpr int C = decltype(consumers)::value;
    const int64_t smem = quant_ring_bytes<kQuantStages>() + mma_smem(a.M, a.K, sizeof(T), C);
    return launch_sm90<&gemv_tma_mma_kernel<T, W, P, kQuantStages, C>, (C + 1) * 32>(blocks, smem, stream, a);
  };
  if (warps == 8) return launch(std::integral_constant<int, 8>{});
  return launch(std::integral_constant<int, 16>{});
}

// A quantized weight's rows through the matrix-vector kernels, up to `chunk` rows a launch: the
// TMA one, the tensor-core one, else the register kernel (each where the one before does not apply);
// but more than 8 rows go 16 at a time to the wide tensor-core kernel, each weight decoded once for
// all of them, where it applies (CUSTOMOPS_LINEAR_WIDE=0: never, a switch for bench --linear).
template <typename T, Format W, Prologue P>
void launch_quantized(const GemvArgs<T>& a, int chunk, cudaStream_t stream) {
  const bool wide = !env::is("CUSTOMOPS_LINEAR_WIDE", "0");
  for (int m0 = 0, rows = 0; m0 < a.M; m0 += rows) {
    GemvArgs<T> c = a;
    c.x = a.x + m0 * a.x_stride;
    if (a.residual != nullptr) c.residual = a.residual + m0 * a.r_stride0;
    c.out = a.out + m0 * a.N;
    c.M = rows = std::min(kWideRows, a.M - m0);
    if (wide && rows > kQuantRowsALaunch && launch_mma<T, W, P>(c, stream)) continue;
    c.M = rows = std::min(chunk, a.M - m0);
    const int64_t smem = int64_t{c.M} * a.K * sizeof(T);
    if (launch_tma_mma<T, W, P>(c, stream) || launch_mma<T, W, P>(c, stream)) continue;  // (else the register kernel)
    if (c.M == 1) {
      launch_gemv<T, W, 1, P>(c, smem, stream);
    } else if (c.M == 2) {
      launch_gemv<T, W, 2, P>(c, smem, stream);
    } else if (c.M <= 4) {
      launch_gemv<T, W, 4, P>(c, smem, stream);
    } else {
      launch_gemv<T, W, 8, P>(c, smem, stream);
    }
  }
}

// ---- A quantized weight's product over many rows (prefill) -------------------------------------

// The weight dequantized into T ([N, K], contiguous): a thread a 16-byte pack of the output, so
// that a warp's stores are 512 contiguous bytes (the threads of one input vector load the same 16
// bytes, one request). packs: the output's 16-byte packs.
template <typename T, Format W>
__global__ void __launch_bounds__(256) dequantize_kernel(GemvArgs<T> a, int64_t packs, T* out) {
  constexpr int V = 16 / sizeof(T), E = kElems<T, W>, J = E / V;  // J: packs a vector
  const int64_t p = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (p >= packs) return;
  const int64_t i = p / J;  // (J a power of two: a shift)
  const int kv = a.K / E;
  // (32-bit division where the vectors allow: a 64-bit one is a long software loop)
  const int64_t n = i <= INT32_MAX ? static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(kv)) : i / kv;
  const int col = static_cast<int>(i - n * kv);
  const uint4 v = static_cast<const uint4*>(a.weight)[i];
  const float s = W == Format::kFp8 ? static_cast<const float*>(a.scale)[n * a.scale_s0]
                                    : scale_at(a, n, col / a.group_vectors);
  float f[V];
  decode<T, W, V>(v, static_cast<int>(p % J), f);
  Pack<T, V> q;
#pragma unroll
  for (int e = 0; e < V; ++e) q.v[e] = static_cast<T>(f[e] * s);
  reinterpret_cast<Pack<T, V>*>(out)[p] = q;
}

// The pointers and strides of a quantized weight (and its scale), for the kernels.
template <typename T>
void set_weight(GemvArgs<T>& a, const at::Tensor& weight, const std::optional<at::Tensor>& scale, int64_t group) {
  a.weight = weight.const_data_ptr();
  if (!scale.has_value() || !scale->defined()) return;
  a.scale = scale->const_data_ptr();
  a.scale_s0 = scale->stride(0);
  a.scale_s1 = scale->dim() > 1 ? scale->stride(1) : 0;
  a.scale_float = scale->scalar_type() == at::kFloat;
  a.group_vectors = static_cast<int>(group / 32);
}

at::Tensor dequantize(const at::Tensor& weight, const at::Tensor& scale, Format w, int64_t k, int64_t group,
                      at::ScalarType t) {
  at::Tensor out = at::empty({weight.size(0), k}, weight.options().dtype(t));
  const int64_t vectors = weight.numel() * weight.element_size() / 16;
  if (vectors == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "customops::fused_linear", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      GemvArgs<scalar_t> a{};
      set_weight(a, weight, scale, group);
      a.K = static_cast<int>(k);
      constexpr int V = 16 / sizeof(scalar_t);
      const int64_t packs =
          vectors * (w == Format::kFp8 ? kElems<scalar_t, Format::kFp8> : kElems<scalar_t, Format::kInt4>) / V;
      const dim3 grid(static_cast<unsigned>((packs + 255) / 256));
      const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
      auto* out_p = out.mutable_data_ptr<scalar_t>();
      if (w == Format::kFp8) {
        dequantize_kernel<scalar_t, Format::kFp8><<<grid, 256, 0, stream>>>(a, packs, out_p);
      } else {
        dequantize_kernel<scalar_t, Format::kInt4><<<grid, 256, 0, stream>>>(a, packs, out_p);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

// The float8 product on Hopper's FP8 tensor cores (cuBLASLt, by at::_scaled_mm): each row of
// prologue(x) quantized to float8 e4m3 with a float32 scale of its own (its largest magnitude over
// 448, e4m3's largest), the products scaled by the row's and the output feature's scales in
// float32; bfloat16 out. (The activations' rounding to float8 is this path's own error:
// docs/quantization.md.)
// Rows of prologue(x) to float8 e4m3, each with its scale, a block a row: prologue_packs gives the
// row's values (rounded to T as the prologue ops round them) twice, for the row's largest magnitude
// and then for the codes (the second read of x comes from L2), so that the prologue's output never
// goes through memory nor takes a launch of its own. An infinity makes its row's scale NaN; a NaN
// (which fmaxf passes over) stays a NaN in float8: either way the row's products are NaN.
template <typename T, Prologue P>
__global__ void __launch_bounds__(256) quantize_rows_kernel(GemvArgs<T> a, __nv_fp8_storage_t* xq, float* row_scale) {
  constexpr int V = 16 / sizeof(T);
  using PackT = Pack<T, V>;
  using Codes = Pack<__nv_fp8_storage_t, V>;
  GemvArgs<T> row = a;  // this block's row alone
  row.x = a.x + static_cast<int64_t>(blockIdx.x) * a.x_stride;
  row.M = 1;
  float amax = 0.f;
  prologue_packs<T, V, P, 256>(
      row,
      [&](int, int, const PackT& y) {
#pragma unroll
        for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(static_cast<float>(y.v[j])));
      },
      [] { __syncthreads(); });
  __shared__ float warp_max[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) amax = fmaxf(amax, warp_max[w]);
  const float scale = isfinite(amax) ? fmaxf(amax / 448.f, 1e-30f) : __int_as_float(0x7fc00000);
  if (threadIdx.x == 0) row_scale[blockIdx.x] = scale;
  const float inv = 1.f / scale;
  Codes* out = reinterpret_cast<Codes*>(xq + static_cast<int64_t>(blockIdx.x) * a.K);
  prologue_packs<T, V, P, 256>(
      row,
      [&](int, int c, const PackT& y) {
        Codes q;
#pragma unroll
        for (int j = 0; j < V; ++j) q.v[j] = __nv_cvt_float_to_fp8(static_cast<float>(y.v[j]) * inv, __NV_SATFINITE, __NV_E4M3);
        out[c] = q;
      },
      [] { __syncthreads(); });
}

// prologue(x) @ float8 weight.T on the FP8 tensor cores, x [M, K] (or [M, 2K] for SwiGLU), its rows
// whole 16-byte packs from a 16-byte boundary (x2 in fused_linear_cuda). cuBLASLt accumulates without
// promoting to float32 along the way (fast accumulation, as torchao's float8 forward does): on an
// H200 2-7% faster at 128-4096 rows of Llama-3-8B's products, the same error (2026-11-29);
// CUSTOMOPS_LINEAR_FP8_FAST_ACCUM=0 promotes (a switch for bench --linear).
at::Tensor fp8_tensor_cores(const at::Tensor& x, Prologue p, const std::optional<at::Tensor>& norm_weight, double eps,
                            const at::Tensor& weight, const at::Tensor& scale, int64_t k) {
  const int64_t m = x.size(0);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor row_scale = at::empty({m, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "customops::fused_linear", [&] {
    GemvArgs<scalar_t> a{};
    a.x = x.const_data_ptr<scalar_t>();
    a.x_stride = x.stride(0);
    a.K = static_cast<int>(k);
    a.M = static_cast<int>(m);
    a.eps = static_cast<float>(eps);
    if (norm_weight.has_value() && norm_weight->defined()) {
      a.norm_weight = norm_weight->const_data_ptr();
      a.norm_stride = norm_weight->stride(0);
      a.norm_weight_float = norm_weight->scalar_type() == at::kFloat;
    }
    auto* codes = static_cast<__nv_fp8_storage_t*>(xq.data_ptr());
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const auto grid = static_cast<unsigned>(m);
    if (p == Prologue::kRmsNorm) {
      quantize_rows_kernel<scalar_t, Prologue::kRmsNorm><<<grid, 256, 0, stream>>>(a, codes, row_scale.mutable_data_ptr<float>());
    } else if (p == Prologue::kSwiglu) {
      quantize_rows_kernel<scalar_t, Prologue::kSwiglu><<<grid, 256, 0, stream>>>(a, codes, row_scale.mutable_data_ptr<float>());
    } else {
      quantize_rows_kernel<scalar_t, Prologue::kNone><<<grid, 256, 0, stream>>>(a, codes, row_scale.mutable_data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return at::_scaled_mm(xq, weight.t(), row_scale, scale.to(at::kFloat).reshape({1, -1}).contiguous(), std::nullopt,
                        std::nullopt, at::kBFloat16, !env::is("CUSTOMOPS_LINEAR_FP8_FAST_ACCUM", "0"));
}

// Whether a float8 product takes the FP8 tensor cores: sm_90 on, half types, features that are
// multiples of 16.
bool fp8_tensor_cores_apply(at::ScalarType t, int64_t k, int64_t n) {
  return at::cuda::getCurrentDeviceProperties()->major >= 9 && t != at::kFloat && k % 16 == 0 && n % 16 == 0;
}

// Whether a quantized product past the decoding kernels' rows takes quant_gemm_kernel (the weight
// decoded in its tiles; cuda/quant_gemm.cuh): sm_80 on, bf16 or fp16 x, in_features multiples of 64,
// up to kMaxTileRows rows (past them the dequantized copy and cuBLAS win: its products are
// compute-bound, and cuBLAS's Hopper kernels outrun mma.sync); int4: scales in x's dtype, groups
// multiples of 64; float8: where the FP8 tensor cores do not apply (fp8_tensor_cores_apply).
// CUSTOMOPS_LINEAR_INT4_GEMM=0 and CUSTOMOPS_LINEAR_FP8_GEMM=0 keep the copy; =1 takes the kernel at
// any rows (float8: over the FP8 tensor cores too). Switches for bench --linear and the tests.
constexpr int64_t kMaxTileRows = 128;
constexpr int64_t kMaxFp8TileRows = 64;  // (on Hopper, where the FP8 tensor cores apply: quantized_rows)
bool quant_gemm_applies(Format w, at::ScalarType t, const at::Tensor& scale, int64_t m, int64_t n, int64_t k,
                        int64_t group) {
  if ((t != at::kBFloat16 && t != at::kHalf) || k % 64 != 0 || k > INT32_MAX || m > INT32_MAX ||
      (n + cuda::quant_gemm::kBN - 1) / cuda::quant_gemm::kBN > 65535 || at::cuda::getCurrentDeviceProperties()->major < 8) {
    return false;
  }
  const char* name = w == Format::kInt4 ? "CUSTOMOPS_LINEAR_INT4_GEMM" : "CUSTOMOPS_LINEAR_FP8_GEMM";
  if (env::is(name, "0") || (m > kMaxTileRows && !env::is(name, "1"))) return false;
  return w == Format::kInt4 ? scale.scalar_type() == t && group % 64 == 0 : scale.scalar_type() == at::kFloat;
}

// in [M, K] (contiguous, 16-byte aligned) @ dequantized(weight).T + bias + residual ([M, N] or
// undefined) by quant_gemm_kernel: [M, N] in in's dtype. Blocks of 128 rows where there are more than
// 64 and their tiles fill the SMs, of 32 for up to 32 rows, else of 64.
at::Tensor quant_gemm_product(const at::Tensor& in, const at::Tensor& weight, const at::Tensor& scale, Format w,
                              int64_t group, const std::optional<at::Tensor>& bias, const at::Tensor& residual) {
  namespace qg = cuda::quant_gemm;
  const int64_t m = in.size(0), n = weight.size(0), k = in.size(1);
  at::Tensor out = at::empty({m, n}, in.options());
  if (m == 0) return out;
  qg::Args a{};
  a.x = in.const_data_ptr();
  a.x_stride = in.stride(0);
  a.w = static_cast<const uint8_t*>(weight.const_data_ptr());
  a.scale = scale.const_data_ptr();
  a.scale_s0 = scale.stride(0);
  a.scale_s1 = scale.dim() > 1 ? scale.stride(1) : 0;
  a.out = out.mutable_data_ptr();
  if (bias.has_value() && bias->defined()) {
    a.bias = bias->const_data_ptr();
    a.bias_stride = bias->stride(0);
  }
  if (residual.defined()) {
    a.residual = residual.const_data_ptr();
    a.r_stride0 = residual.stride(0);
    a.r_stride1 = residual.stride(1);
  }
  a.M = static_cast<int>(m);
  a.N = static_cast<int>(n);
  a.K = static_cast<int>(k);
  a.group = static_cast<int>(group);
  const int64_t n_tiles = (n + qg::kBN - 1) / qg::kBN, sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool tall = m > 64 && (m + 127) / 128 * n_tiles >= sms;
  const int bm = tall ? 128 : m <= 32 ? 32 : 64;
  const int64_t blocks = (m + bm - 1) / bm * n_tiles;
  // The inputs split in 2-8 ranges of whole k-blocks where the tiles alone leave SMs idle (o_proj,
  // qkv and down of Llama-3-8B, 32-48 tiles of 128 features, at up to 64 rows), while the ranges'
  // float32 sums, written and read once, stay under the weight's bytes and each range has 8
  // k-blocks or more; CUSTOMOPS_LINEAR_K_SPLITS=N takes N (a range past the inputs sums to zeros).
  int splits = forced_k_splits();
  if (splits == 0) {
    splits = 1;
    const int64_t weight_bytes = weight.numel() * weight.element_size();
    while (!tall && splits < kMaxKSplits) {
      const int64_t next = 2 * splits;  // (each limit holds for the count chosen)
      if (blocks * next > 2 * sms || k / qg::kBK < 8 * next || 2 * next * m * n * 4 > weight_bytes) break;
      splits = static_cast<int>(next);
    }
  }
  a.k_splits = splits;
  at::Tensor partial;  // (freed here, its memory reused only by later work on this stream)
  if (splits > 1) {
    partial = at::empty({splits, m, n}, in.options().dtype(at::kFloat));
    a.partial = partial.mutable_data_ptr<float>();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel, int bm, int smem) {
    cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel));  // (once a kernel and device)
    kernel<<<dim3(static_cast<unsigned>((m + bm - 1) / bm), static_cast<unsigned>(n_tiles), static_cast<unsigned>(splits)),
             qg::kThreads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // 4 stages; CUSTOMOPS_LINEAR_TILE_STAGES=deep (an experiment for bench --linear --variant, not yet
  // run on a GPU) takes kDeepStages where the SM's shared memory holds them (and the 1 KiB the runtime
  // reserves a block) at the launch bounds' blocks an SM: Hopper's 228 KiB.
  const int64_t smem_an_sm = at::cuda::getCurrentDeviceProperties()->sharedMemPerMultiprocessor;
  const bool shallow = !env::is("CUSTOMOPS_LINEAR_TILE_STAGES", "deep");
  auto launch_rows = [&](auto tt, auto fp8, auto rows) {
    using TT = decltype(tt);
    constexpr bool kFp8 = decltype(fp8)::value;
    constexpr int BM = decltype(rows)::value, kDeep = qg::kDeepStages<BM, kFp8>;
    constexpr int kDeepBytes = qg::smem_bytes<BM, kFp8, kDeep>();
    if (!shallow && kDeep > qg::kShallowStages && qg::kBlocksAnSm<BM> * (kDeepBytes + 1024) <= smem_an_sm) {
      launch(qg::quant_gemm_kernel<TT, BM, kFp8, kDeep>, BM, kDeepBytes);
    } else {
      launch(qg::quant_gemm_kernel<TT, BM, kFp8, qg::kShallowStages>, BM, qg::smem_bytes<BM, kFp8, qg::kShallowStages>());
    }
  };
  auto launch_typed = [&](auto tt, auto fp8) {
    if (bm == 128) {
      launch_rows(tt, fp8, std::integral_constant<int, 128>());
    } else if (bm == 64) {
      launch_rows(tt, fp8, std::integral_constant<int, 64>());
    } else {
      launch_rows(tt, fp8, std::integral_constant<int, 32>());
    }
  };
  const bool half = in.scalar_type() == at::kHalf;
  if (w == Format::kFp8) {
    half ? launch_typed(__half(), std::true_type()) : launch_typed(__nv_bfloat16(), std::true_type());
  } else {
    half ? launch_typed(__half(), std::false_type()) : launch_typed(__nv_bfloat16(), std::false_type());
  }
  if (splits > 1) {  // (the decoding kernels' epilogue: the ranges' sums, scale, bias and residual, rounded once)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(in.scalar_type(), "customops::fused_linear", [&] {
      GemvArgs<scalar_t> e{};
      e.out = out.mutable_data_ptr<scalar_t>();
      e.scale = a.scale;  // (float8: finish_output scales by it)
      e.scale_s0 = a.scale_s0;
      if (a.bias != nullptr) {
        e.bias = static_cast<const scalar_t*>(a.bias);
        e.bias_stride = a.bias_stride;
      }
      if (a.residual != nullptr) {
        e.residual = static_cast<const scalar_t*>(a.residual);
        e.r_stride0 = a.r_stride0;
        e.r_stride1 = a.r_stride1;
      }
      e.M = a.M;
      e.N = a.N;
      e.k_splits = splits;
      e.partial = a.partial;
      const dim3 grid(static_cast<unsigned>((m * n + 255) / 256));
      if (w == Format::kFp8) {
        launch_dependent(&split_k_epilogue<scalar_t, Format::kFp8>, grid, dim3(256), 0, stream, e);
      } else {
        launch_dependent(&split_k_epilogue<scalar_t, Format::kInt4>, grid, dim3(256), 0, stream, e);
      }
    });
  }
  return out;
}

// prologue(x) @ dequantized(weight).T + bias + residual for the rows the matrix-vector kernels do
// not take: float8 on the FP8 tensor cores where fp8_tensor_cores_apply (but up to 64 rows with no
// more outputs than inputs, or with CUSTOMOPS_LINEAR_FP8_GEMM=1, quant_gemm_kernel), else
// quant_gemm_kernel where quant_gemm_applies, else the weight dequantized into x's dtype and cuBLAS.
at::Tensor quantized_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual, Prologue p,
                          const std::optional<at::Tensor>& norm_weight, double eps, const at::Tensor& scale, Format w,
                          int64_t k, int64_t group) {
  const at::ScalarType t = x.scalar_type();
  const int64_t n = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor y;
  const int64_t m = x.numel() / x.size(-1);
  // A float8 product with no more outputs than inputs takes quant_gemm_kernel up to kMaxFp8TileRows on
  // Hopper too: on an H200 (2026-11-29) Llama-3-8B's o_proj and down at 20-64 rows took 12.1-16.3 and
  // 32.8-43.5 us there against 17.3 and 51.4-52.6 on the FP8 tensor cores (cuBLASLt's tiles leave SMs
  // idle on 4,096 outputs), qkv and gate_up 21.0-28.7 and 62.3-82.3 against 18.3-21.7 and 47.1-52.1.
  const bool fp8_tiles = w == Format::kFp8 && quant_gemm_applies(w, t, scale, m, n, k, group) &&
                         (env::is("CUSTOMOPS_LINEAR_FP8_GEMM", "1") || (n <= k && m <= kMaxFp8TileRows));
  if (w == Format::kFp8 && fp8_tensor_cores_apply(t, k, n) && !fp8_tiles) {
    at::Tensor x2 = x.reshape({-1, x.size(-1)});  // (16-byte loads from a 16-byte boundary)
    if (x2.stride(1) != 1 || x2.stride(0) % (16 / x.element_size()) != 0 || !aligned16(x2.data_ptr())) {
      x2 = x2.contiguous();
      if (!aligned16(x2.data_ptr())) x2 = x2.clone();
    }
    y = fp8_tensor_cores(x2, p, norm_weight, eps, weight, scale, k).to(t);
    if (has_bias) y.add_(*bias);
  } else {
    at::Tensor in = apply_prologue(p, x, norm_weight, eps).reshape({-1, k}).contiguous();
    if (!aligned16(in.data_ptr())) in = in.clone();  // (16-byte loads: x itself may start anywhere)
    if (quant_gemm_applies(w, t, scale, in.size(0), n, k, group)) {
      const bool has_residual = residual.has_value() && residual->defined();
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = n;
      return quant_gemm_product(in, weight, scale, w, group, bias,
                                has_residual ? residual->reshape({in.size(0), n}) : at::Tensor())
          .view(sizes);
    }
    const at::Tensor wt = dequantize(weight, scale, w, k, group, t).t();
    y = has_bias ? at::addmm(*bias, in, wt) : at::mm(in, wt);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  y = y.view(sizes);
  if (residual.has_value() && residual->defined()) y.add_(*residual);
  return y;
}

at::Tensor fused_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view prologue_name,
                             const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight,
                             const std::optional<at::Tensor>& weight_scale) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue_name, norm_weight, weight_scale);
  c10::cuda::CUDAGuard guard(x.device());  // (before the device's properties are read)
  auto unfused = [&] {
    return fused_linear_unfused(x, weight, bias, residual, prologue_name, norm_weight, eps, weight_scale);
  };
  const at::ScalarType t = x.scalar_type();
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return unfused();
  const Format w = !weight_scale.has_value() || !weight_scale->defined() ? Format::kDense
                   : weight.scalar_type() == at::kFloat8_e4m3fn       ? Format::kFp8
                                                                        : Format::kInt4;
  const int64_t k = w == Format::kInt4 ? weight.size(1) * 2 : weight.size(1), n = weight.size(0), k_in = x.size(-1);
  const int64_t v = 16 / x.element_size();
  const int64_t e = w == Format::kDense ? v : w == Format::kFp8 ? 16 : 32;  // weights a 16-byte vector
  if (k == 0 || n == 0 || k % e != 0 || k > (int64_t{1} << 30)) return unfused();
  if (!weight.is_contiguous() || !aligned16(weight.data_ptr())) return unfused();
  const int64_t group = w == Format::kInt4 ? k / weight_scale->size(1) : 0;
  if (w == Format::kInt4 && (group % 32 != 0 || (weight_scale->scalar_type() != at::kFloat &&
                                                 weight_scale->scalar_type() != t))) {
    return unfused();  // (a group within a vector, or a scale of a third dtype: the ATen ops)
  }
  const int64_t m = x.numel() / k_in;
  if (m < 1) return unfused();
  const int64_t row_bytes = k * x.element_size();
  int chunk = 0;  // a quantized weight's rows a launch
  // A bfloat16 or half weight's 2-4 rows go through the quantized weights' tensor-core kernel
  // (gemv_mma_kernel, with nothing to decode) where x takes at most kMaxSmemManyRows.
  // On an H200 at 4 rows of Llama-3-8B's products it took 0.59-0.78x the time of the kernels here
  // (qkv, o_proj, gate_up: 4096 inputs), and 1.73x with down's 14,336 (x in 112 KiB, one block an
  // SM); at one row 0.92-1.05x (2026-11-29). CUSTOMOPS_LINEAR_DENSE_MMA=0 keeps the kernels here,
  // =1 sends it 1-8 rows wherever it applies (switches for bench --linear --variant).
  const bool dense_mma = [&] {
    if (w != Format::kDense || (t != at::kBFloat16 && t != at::kHalf) || m > kQuantRowsALaunch) return false;
    if (env::is("CUSTOMOPS_LINEAR_DENSE_MMA", "0")) return false;
    const bool forced = env::is("CUSTOMOPS_LINEAR_DENSE_MMA", "1");
    if (!forced && (m < 2 || m > kMaxRows || m * row_bytes > kMaxSmemManyRows)) return false;
    return t == at::kHalf ? mma_applies<c10::Half, Format::kDense>(m, k) : mma_applies<c10::BFloat16, Format::kDense>(m, k);
  }();
  if (w == Format::kDense && !dense_mma) {
    // CUSTOMOPS_LINEAR_MAX_ROWS lowers kMaxRows (an experiment: in a graph on an H200 the 4-row
    // kernel was 1.5-1.8x slower than the unfused path at 8 rows, benchmarks.md "on an H200")
    const int64_t cap = env_count("CUSTOMOPS_LINEAR_MAX_ROWS");
    if (m > (cap > 0 ? std::min<int64_t>(cap, kMaxRows) : kMaxRows) || m * row_bytes > kMaxSmem ||
        (m > 2 && m * row_bytes > kMaxSmemManyRows)) {
      return unfused();
    }
  } else if (w != Format::kDense) {
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    // (as many rows a launch as fit the tensor-core kernel's shared memory, its narrowest range of
    // the inputs where it may split them: narrowest_range)
    const int64_t range = prop->major >= 8 && (w != Format::kInt4 || group % 128 == 0)
                              ? narrowest_range(k, w == Format::kFp8 ? 16 : 32)
                              : k;
    chunk = static_cast<int>(std::min<int64_t>(
        kQuantRowsALaunch, (static_cast<int64_t>(prop->sharedMemPerBlockOptin) - 1024 - mma_smem(0, range, x.element_size())) /
                               (range * x.element_size() + kMmaRowPad)));
    // (CUSTOMOPS_LINEAR_QUANT_MAX_ROWS=N, 1-64, sets the rows the decoding kernels take, 16 a
    // launch, a switch for bench --linear)
    int max_rows = kMaxQuantRows[static_cast<int>(w)];
    // A float8 product with more outputs than inputs takes the FP8 tensor cores from 9 rows: on an
    // H200 at 16 rows (2026-11-29) the wide kernel took 27.5 and 59.3 us for Llama-3-8B's qkv and
    // gate_up against 21.6 and 49.9 there, and 13.7 and 37.1 for o_proj and down against 17.3 and
    // 54.8 (cuBLASLt's tiles of 128 outputs leave SMs idle on their 4,096).
    if (w == Format::kFp8 && n > k && fp8_tensor_cores_apply(t, k, n) && !env::is("CUSTOMOPS_LINEAR_FP8_GEMM", "1")) {
      max_rows = kQuantRowsALaunch;
    }
    if (w == Format::kInt4 && m > kMaxInt4RowsBeforeTiles && quant_gemm_applies(w, t, *weight_scale, m, n, k, group)) {
      max_rows = kMaxInt4RowsBeforeTiles;
    }
    if (const int64_t cap = env_count("CUSTOMOPS_LINEAR_QUANT_MAX_ROWS"); cap > 0) {
      max_rows = static_cast<int>(std::min<int64_t>(cap, 64));
    }
    if (t == at::kFloat || m > max_rows || chunk < 1) {
      return quantized_rows(x, weight, bias, residual, p, norm_weight, eps, *weight_scale, w, k, group);
    }
  }
  at::Tensor x2 = x.reshape({m, k_in});
  if (x2.stride(1) != 1 || x2.stride(0) % v != 0 || !aligned16(x2.data_ptr())) {
    x2 = x2.contiguous();
    // (contiguous() returns x itself where it is contiguous already, as a view one element into a
    // buffer is: the kernels' 16-byte loads need a copy of their own)
    if (!aligned16(x2.data_ptr())) x2 = x2.clone();
  }

  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor r2 = residual.has_value() && residual->defined() ? residual->reshape({m, n}) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "customops::fused_linear", [&] {
    GemvArgs<scalar_t> a{};
    a.x = x2.const_data_ptr<scalar_t>();
    a.x_stride = x2.stride(0);
    set_weight(a, weight, weight_scale, group);
    if (bias.has_value() && bias->defined()) {
      a.bias = bias->const_data_ptr<scalar_t>();
      a.bias_stride = bias->stride(0);
    }
    if (r2.defined()) {
      a.residual = r2.const_data_ptr<scalar_t>();
      a.r_stride0 = r2.stride(0);
      a.r_stride1 = r2.stride(1);
    }
    if (norm_weight.has_value() && norm_weight->defined()) {
      a.norm_weight = norm_weight->const_data_ptr();
      a.norm_stride = norm_weight->stride(0);
      a.norm_weight_float = norm_weight->scalar_type() == at::kFloat && t != at::kFloat;
    }
    a.out = out.mutable_data_ptr<scalar_t>();
    a.M = static_cast<int>(m);
    a.N = n;
    a.K = static_cast<int>(k);
    a.eps = static_cast<float>(eps);
    a.constant_weight = constant_weight;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const int64_t smem = m * row_bytes;
    auto launch = [&](auto prologue) {
      constexpr Prologue P = decltype(prologue)::value;
      using T = scalar_t;
      if constexpr (std::is_same_v<T, float>) {
        launch_rows<T, P>(a, smem, stream);  // (float32 x: dense weights only, above)
      } else if constexpr (!std::is_same_v<T, double>) {  // (float64: the unfused path, above)
        if (w == Format::kFp8) return launch_quantized<T, Format::kFp8, P>(a, chunk, stream);
        if (w == Format::kInt4) return launch_quantized<T, Format::kInt4, P>(a, chunk, stream);
        if (dense_mma) {
          const bool launched = launch_mma<T, Format::kDense, P>(a, stream);
          TORCH_CHECK(launched, "customops.fused_linear: the tensor-core kernel did not take a product it was "
                      "checked for");  // (its conditions, above)
          return;
        }
        launch_rows<T, P>(a, smem, stream);
      }
    };
    if (p == Prologue::kRmsNorm) {
      launch(std::integral_constant<Prologue, Prologue::kRmsNorm>{});
    } else if (p == Prologue::kSwiglu) {
      launch(std::integral_constant<Prologue, Prologue::kSwiglu>{});
    } else {
      launch(std::integral_constant<Prologue, Prologue::kNone>{});
    }
  });
  return out.view(out_sizes);
}

}  // namespace

// CUDA kernel of fused_linear.
TORCH_LIBRARY_IMPL(customops, CUDA, m) { m.impl("fused_linear", &fused_linear_cuda); }

}  // namespace customops
