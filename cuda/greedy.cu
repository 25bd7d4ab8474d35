// customops::greedy_cuda (cpp/generate/greedy.h): one block a row of logits finds the row's first
// largest value and whether the row is finite enough to decode, in one pass. Each thread keeps its
// best (value, position) and a flag for NaN or +inf over 16-byte vectors of the row; the block then
// combines them, lower position first among equal values, as at::max does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>

#include "generate/greedy.h"

namespace customops {
namespace {

constexpr int kThreads = 1024;

template <typename A>
struct Best {
  A value;
  int64_t index;
  bool bad;  // a NaN or a +inf seen

  __device__ void see(A v, int64_t i) {
    bad |= !(v < INFINITY);  // (NaN compares false)
    if (v > value) {         // (strictly: a thread sees its positions in order, the first stays)
      value = v;
      index = i;
    }
  }
  __device__ void merge(const Best<A>& o) {
    bad |= o.bad;
    if (o.value > value || (o.value == value && o.index < index)) {
      value = o.value;
      index = o.index;
    }
  }
};

template <typename T, bool Vectors, typename A = at::opmath_type<T>>
__global__ void __launch_bounds__(kThreads) greedy_kernel(const T* logits, int64_t vocab, int64_t* ids,
                                                          int64_t* marked) {
  const T* row = logits + blockIdx.x * vocab;
  Best<A> b{-INFINITY, 0, false};
  int64_t tail = 0;
  if constexpr (Vectors) {
    constexpr int N = 16 / sizeof(T);
    const int64_t vectors = vocab / N;
    const auto* v = reinterpret_cast<const uint4*>(row);
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < vectors; c += kThreads) {
      const uint4 w = v[c];
      const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int j = 0; j < N; ++j) b.see(static_cast<A>(e[j]), c * N + j);
    }
    tail = vectors * N;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += kThreads) b.see(static_cast<A>(row[i]), i);

  // the warp's best, then the block's
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best<A> other{__shfl_xor_sync(0xffffffffu, b.value, o), __shfl_xor_sync(0xffffffffu, b.index, o),
               __shfl_xor_sync(0xffffffffu, static_cast<int>(b.bad), o) != 0};
    b.merge(other);
  }
  __shared__ A values[kThreads / 32];
  __shared__ int64_t indices[kThreads / 32];
  __shared__ bool bads[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    values[warp] = b.value;
    indices[warp] = b.index;
    bads[warp] = b.bad;
  }
  __syncthreads();
  if (warp != 0) return;
  b = lane < kThreads / 32 ? Best<A>{values[lane], indices[lane], bads[lane]} : Best<A>{-INFINITY, vocab, false};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best<A> other{__shfl_xor_sync(0xffffffffu, b.value, o), __shfl_xor_sync(0xffffffffu, b.index, o),
               __shfl_xor_sync(0xffffffffu, static_cast<int>(b.bad), o) != 0};
    b.merge(other);
  }
  if (lane == 0) {
    // -inf everywhere has no largest logit either; the id itself stays in the vocabulary
    const int64_t id = b.index < vocab ? b.index : 0;
    ids[blockIdx.x] = id;
    marked[blockIdx.x] = b.bad || b.value == -INFINITY ? -1 : id;
  }
}

}  // namespace

std::pair<at::Tensor, at::Tensor> greedy_cuda(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_cuda: logits must be [B, vocab], got ",
              logits.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor l = logits.contiguous();
  const int64_t rows = l.size(0), vocab = l.size(1);
  at::Tensor out = at::empty({2, rows}, l.options().dtype(at::kLong));
  if (rows == 0) return {out[0], out[1]};
  TORCH_CHECK(rows <= INT32_MAX, "greedy_cuda: too many rows, ", rows);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.scalar_type(), "customops::greedy", [&] {
    const bool vectors = reinterpret_cast<uintptr_t>(l.data_ptr()) % 16 == 0 && vocab * sizeof(scalar_t) % 16 == 0;
    auto* kernel = vectors ? &greedy_kernel<scalar_t, true> : &greedy_kernel<scalar_t, false>;
    int64_t* ids = out.data_ptr<int64_t>();
    kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(l.data_ptr<scalar_t>(), vocab, ids, ids + rows);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out[0], out[1]};
}

}  // namespace customops
