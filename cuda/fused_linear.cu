// CUDA kernels of fused_linear for a few rows (decoding): y = prologue(x) @ weight.T + bias +
// residual in one launch, each weight element read once. At these sizes the op is a stream over
// the weight (a 2048 x 8192 bfloat16 weight is 32 MiB against a few 16 KiB rows of input). Two
// kernels, chosen by launch_r (the measurements are there):
// - The register kernel (gemv_kernel): every block writes prologue(x) for all rows into shared
//   memory, rounded to x's dtype as customops' rms_norm and swiglu round it (rms_norm: one warp
//   per row reduces the squares first); blocks are at most one wave, so it runs once per block.
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
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cp_async.cuh"
#include "elementwise.cuh"
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
// The Hopper kernel (gemv_tma_kernel): consumer warps, one producer warp, chunks of weight rows.
constexpr int kConsumers = 8;
constexpr int kTmaThreads = (kConsumers + 1) * 32;
constexpr int kChunkBytes = 4096;
constexpr int kBarBytes = 128;  // the stages' barriers, before the ring
constexpr int kStages = 4;
constexpr int64_t kTmaMinBytesPerSm = 192 * 1024;  // weight bytes an SM from which it is used

template <typename T>
struct GemvArgs {
  const T* x;  // [M, K] (none, rms_norm) or [M, 2K] (swiglu: gate then up), rows x_stride apart
  int64_t x_stride;
  const T* weight;  // [N, K], contiguous
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
};

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

template <typename T>
__device__ __forceinline__ float norm_weight_at(const GemvArgs<T>& a, int64_t k) {
  if (a.norm_weight == nullptr) return 1.f;
  if (a.norm_weight_float) return static_cast<const float*>(a.norm_weight)[k * a.norm_stride];
  return static_cast<float>(static_cast<const T*>(a.norm_weight)[k * a.norm_stride]);
}

// prologue(x) for every row, into xs ([M, K] of T), by the block's first kN threads; sync() is a
// barrier over them.
template <typename T, int V, Prologue P, int kN, typename Sync>
__device__ void prologue(const GemvArgs<T>& a, T* xs, Sync sync) {
  using PackT = Pack<T, V>;
  const int kv = a.K / V;
  __shared__ float rstd[kMaxRows];
  if constexpr (P == Prologue::kRmsNorm) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int m = warp; m < a.M; m += kN / 32) {
      const PackT* row = reinterpret_cast<const PackT*>(a.x + m * a.x_stride);
      float ss = 0.f;
      for (int c = lane; c < kv; c += 32) {
        const PackT p = row[c];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float v = static_cast<float>(p.v[j]);
          ss += v * v;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) rstd[m] = rsqrtf(ss / static_cast<float>(a.K) + a.eps);
    }
    sync();
  }
  for (int i = threadIdx.x; i < a.M * kv; i += kN) {
    const int m = i / kv, c = i % kv;
    const T* row = a.x + m * a.x_stride;
    const PackT p = reinterpret_cast<const PackT*>(row)[c];
    PackT y;
    if constexpr (P == Prologue::kNone) {
      y = p;
    } else if constexpr (P == Prologue::kRmsNorm) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        y.v[j] = static_cast<T>(static_cast<float>(p.v[j]) * rstd[m] * norm_weight_at(a, int64_t{c} * V + j));
      }
    } else {
      const PackT u = reinterpret_cast<const PackT*>(row + a.K)[c];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = static_cast<float>(p.v[j]);
        y.v[j] = static_cast<T>(g / (1.f + __expf(-g)) * static_cast<float>(u.v[j]));
      }
    }
    reinterpret_cast<PackT*>(xs)[i] = y;
  }
  sync();
}

// A warp's rows: n0, n0 + stride, ... (stride: all warps of the grid); each row is split into
// segments of kUnroll 16-byte vectors per lane, and the warp walks its (row, segment) tasks with
// two register buffers: the next task's loads are issued before this one's math, so every warp
// keeps weight bytes in flight all the time, its reductions and writes included. The first two
// tasks are loaded before the prologue, which then runs while they arrive.
template <typename T, int V>
struct Tasks {
  const GemvArgs<T>& a;
  int64_t n0, stride;
  int segments, kv, count;

  __device__ int64_t row(int t) const { return n0 + static_cast<int64_t>(t / segments) * stride; }

  __device__ __forceinline__ void load(int t, Pack<T, V>* w) const {
    if (t >= count) return;
    const Pack<T, V>* r = reinterpret_cast<const Pack<T, V>*>(a.weight + row(t) * a.K);
    const int s = t % segments, lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = (s * kUnroll + u) * 32 + lane;
      if (c < kv) {
        const uint4 v = load_streaming(r + c);
        w[u] = *reinterpret_cast<const Pack<T, V>*>(&v);
      }
    }
  }
};

// acc += w . x over task t's segment; at a row's last segment, reduce, write and reset acc.
template <typename T, int V, int R>
__device__ __forceinline__ void consume(const Tasks<T, V>& k, int t, const Pack<T, V>* w, const Pack<T, V>* xp,
                                        float* acc) {
  const GemvArgs<T>& a = k.a;
  const int s = t % k.segments, lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int c = (s * kUnroll + u) * 32 + lane;
    if (c < k.kv) {
      float wf[V];
#pragma unroll
      for (int j = 0; j < V; ++j) wf[j] = static_cast<float>(w[u].v[j]);
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m < a.M) {
          const Pack<T, V> xv = xp[m * k.kv + c];
#pragma unroll
          for (int j = 0; j < V; ++j) acc[m] += wf[j] * static_cast<float>(xv.v[j]);
        }
      }
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
#pragma unroll
    for (int m = 0; m < R; ++m) {
      if (m < a.M) {
        float y = acc[m] + b;
        if (a.residual != nullptr) y += static_cast<float>(a.residual[m * a.r_stride0 + n * a.r_stride1]);
        a.out[m * a.N + n] = static_cast<T>(y);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
}

// R: rows the kernel is compiled for (a.M <= R).
template <typename T, int R, Prologue P>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(GemvArgs<T> a) {
  constexpr int V = 16 / sizeof(T);
  using PackT = Pack<T, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  const int warp = threadIdx.x / 32;
  Tasks<T, V> k{a, int64_t{blockIdx.x} * kWarps + warp, int64_t{gridDim.x} * kWarps, 0, a.K / V, 0};
  k.segments = (k.kv + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t rows = k.n0 < a.N ? (a.N - k.n0 + k.stride - 1) / k.stride : 0;
  k.count = static_cast<int>(rows * k.segments);

  PackT wa[kUnroll], wb[kUnroll];
  if (!a.constant_weight) wait_prerequisites();
  k.load(0, wa);
  k.load(1, wb);
  launch_dependents();
  wait_prerequisites();
  prologue<T, V, P, kThreads>(a, xs, [] { __syncthreads(); });  // ends at a block barrier: no warp returns before it

  const PackT* xp = reinterpret_cast<const PackT*>(xs);
  float acc[R];
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
  for (int t = 0; t < k.count; t += 2) {
    consume<T, V, R>(k, t, wa, xp, acc);
    k.load(t + 2, wa);
    if (t + 1 < k.count) {
      consume<T, V, R>(k, t + 1, wb, xp, acc);
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

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32) : "memory"); }

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
  const char* wblock = reinterpret_cast<const char*>(a.weight) + r0 * row_bytes;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      tma::mbar_init(full + 8 * s, 1);
      tma::mbar_init(empty + 8 * s, kConsumers * 32);  // every consumer thread releases what it read
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  launch_dependents();

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
  prologue<T, V, P, kConsumers * 32>(a, xs, [] { tma::consumers_sync(); });

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

template <typename T, int R, Prologue P>
void launch_gemv(const GemvArgs<T>& a, int64_t smem, cudaStream_t stream) {
  auto* kernel = &gemv_kernel<T, R, P>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t blocks =
      std::min<int64_t>((a.N + kWarps - 1) / kWarps, int64_t{prop->multiProcessorCount} * std::max(per_sm, 1));
  // At most one wave, all resident at once: the next kernel's blocks (launched once all of these
  // have started) take the SMs these leave, load their first weights and wait for these to end.
  launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem), stream, a);
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
  auto* kernel = &gemv_tma_kernel<T, R, P, S>;
  // Only code compiled for sm_90 has the kernel's body (a later GPU may run the sm_80 PTX), and the
  // dynamic shared memory must fit beside the static (the same for every device: asked once).
  if (!cuda::compiled_for_sm90(reinterpret_cast<const void*>(kernel))) return false;
  static const int64_t static_smem = [&] {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    return static_cast<int64_t>(attr.sharedSizeBytes);
  }();
  if (smem + static_smem > static_cast<int64_t>(prop->sharedMemPerBlockOptin)) return false;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kTmaThreads), static_cast<size_t>(smem), stream,
                   a);
  return true;
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
  launch_gemv<T, R, P>(a, smem, stream);
}

template <typename T, Prologue P>
void launch_rows(const GemvArgs<T>& a, int64_t smem, cudaStream_t stream) {
  if (a.M == 1) return launch_r<T, 1, P>(a, smem, stream);
  if (a.M == 2) return launch_r<T, 2, P>(a, smem, stream);
  launch_r<T, 4, P>(a, smem, stream);
}

at::Tensor fused_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view prologue_name,
                             const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight,
                             const std::optional<at::Tensor>& weight_scale) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue_name, norm_weight, weight_scale);
  auto unfused = [&] {
    return fused_linear_unfused(x, weight, bias, residual, prologue_name, norm_weight, eps, weight_scale);
  };
  const at::ScalarType t = x.scalar_type();
  // (a quantized weight: ATen's ops on the dequantized weight, until its kernels come)
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16 || weight_scale.has_value()) return unfused();
  const int64_t k = weight.size(1), n = weight.size(0), k_in = x.size(-1);
  const int64_t v = 16 / x.element_size();
  if (k == 0 || n == 0 || k % v != 0 || k > (int64_t{1} << 30)) return unfused();
  const int64_t m = x.numel() / k_in;
  const int64_t smem = m * k * x.element_size();
  if (m < 1 || m > kMaxRows || smem > kMaxSmem) return unfused();
  if (!weight.is_contiguous() || !aligned16(weight.data_ptr())) return unfused();
  at::Tensor x2 = x.reshape({m, k_in});
  if (x2.stride(1) != 1 || x2.stride(0) % v != 0 || !aligned16(x2.data_ptr())) x2 = x2.contiguous();

  c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor r2 = residual.has_value() && residual->defined() ? residual->reshape({m, n}) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "customops::fused_linear", [&] {
    GemvArgs<scalar_t> a{};
    a.x = x2.const_data_ptr<scalar_t>();
    a.x_stride = x2.stride(0);
    a.weight = weight.const_data_ptr<scalar_t>();
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
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (p == Prologue::kRmsNorm) {
        launch_rows<scalar_t, Prologue::kRmsNorm>(a, smem, stream);
      } else if (p == Prologue::kSwiglu) {
        launch_rows<scalar_t, Prologue::kSwiglu>(a, smem, stream);
      } else {
        launch_rows<scalar_t, Prologue::kNone>(a, smem, stream);
      }
    }
  });
  return out.view(out_sizes);
}

}  // namespace

// CUDA kernel of fused_linear.
TORCH_LIBRARY_IMPL(customops, CUDA, m) { m.impl("fused_linear", &fused_linear_cuda); }

}  // namespace customops
