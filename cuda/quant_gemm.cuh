// A quantized weight's product over many rows (prefill, batches past the decoding kernels' rows) on
// the tensor cores, the weight decoded inside the tiles: out[M, N] = x[M, K] @ dequantized(w).T
// (+ bias + residual), reading the weight as stored instead of a dequantized copy (2x or 4x its
// bytes) that cuBLAS would read after one more kernel wrote it.
// - int4 (quantize_int4's layout: [N, K / 2] bytes, weight 2j of a row in the low nibble of byte j,
//   2j + 1 in the high one, each q + 8; a scale in x's dtype a group of inputs): a byte's two
//   nibbles become the bf16 (fp16) pair 128 + q (1024 + q) by an OR of the exponent, less 136
//   (1032): q - 8 exactly, times the group's scale, rounded once: the dequantized copy's weights.
//   Groups are multiples of 64 inputs (a k-block within one group); scales in x's dtype (float32
//   scales keep the copy, whose product rounds (q - 8) * scale once from float32).
// - float8 e4m3 ([N, K] bytes, a float32 scale an output feature): a code's sign and 7 low bits
//   moved into a bf16 (fp16) as they are, times 2^120 (2^8), is the code's value exactly (an e4m3
//   subnormal too); the sums are scaled by the feature's scale in float32 at the end (more exact
//   than the copy, which rounds code * scale to x's dtype).
//
// A block computes a [BM, 128] tile of out over k-blocks of 64 inputs (all of them, or one of
// k_splits ranges where the tiles alone leave SMs idle), in kStages stages of cp.async (4; as an
// experiment, CUSTOMOPS_LINEAR_TILE_STAGES=deep, as many as fit 72 KiB up to 8 where the SM's
// shared memory holds them at the same blocks an SM: kDeepStages, about 32 KiB more of the weight
// in flight an SM at 32 rows): x's [BM, 64] slab into a swizzled tile (ldmatrix gives the A
// fragments) and the weight's [128, 32 or 64 bytes] slab, its 16-byte chunks swizzled by row
// (below). 8 warps: for 128 rows 2 along M and 4 along N, each [64, 32] of the tile; for 32 and 64
// rows all 8 along N, each [BM, 16], so that each weight is decoded once a block (the decoding, not
// the products, bounds a block of few rows). A warp has WM / 16 m16 tiles by NT n8 tiles of
// mma.sync m16n8k16 with float32 sums. A B fragment of mma (column n = g of the n8 tile, inputs 2c,
// 2c + 1 and 2c + 8, 2c + 9 of the k16 step, g = lane / 4, c = lane % 4) is, int4, bytes 8 kk + c
// and 8 kk + 4 + c of row n's 32 (one 8-byte shared load a row and k16 step), float8 bytes 16 kk +
// 2c, + 1 and 16 kk + 8 + 2c, + 1 of its 64 (one 16-byte load); decoded once for all the warp's m16
// tiles. The swizzle (chunk ^ row bits) puts a warp's 8 rows of one load in distinct banks: int4's
// 32-byte rows g and g + 4 would share them, float8's 64-byte rows g, g + 2, g + 4, g + 6.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention.cuh"  // (the ldmatrix and mma.sync wrappers and swizzled tiles it shares)
#include "cp_async.cuh"

namespace customops::cuda::quant_gemm {

using attention::a_frag;
using attention::ldmatrix_x4;
using attention::load_tile;
using attention::mma;
using attention::Tile;

constexpr int kBN = 128, kBK = 64, kThreads = 256;
template <bool kFp8>
constexpr int kWRowBytes = kFp8 ? kBK : kBK / 2;  // a weight row's bytes a k-block
template <int BM, bool kFp8>
constexpr int kStageBytes = BM * kBK * 2 + kBN * kWRowBytes<kFp8>;  // a stage's x and weight slabs
constexpr int kShallowStages = 4;
template <int BM, bool kFp8>
constexpr int kDeepStages = std::max(kShallowStages, std::min(8, 72 * 1024 / kStageBytes<BM, kFp8>));
template <int BM>
constexpr int kBlocksAnSm = BM == 32 ? 3 : BM == 64 ? 2 : 1;  // (the kernel's launch bounds)

struct Args {
  const void* x;  // [M, K], row stride x_stride elements (a multiple of 8), 16-byte aligned
  int64_t x_stride;
  const uint8_t* w;  // [N, K / 2] (int4) or [N, K] (float8) bytes, contiguous, 16-byte aligned
  const void* scale;  // int4: [N, K / group] in x's dtype, strides scale_s0, scale_s1; float8: [N]
  int64_t scale_s0, scale_s1;  // float32, stride scale_s0
  void* out;  // [M, N], contiguous
  const void* bias;  // [N] (stride bias_stride) or null
  int64_t bias_stride;
  const void* residual;  // [M, N] (strides r_stride0, r_stride1) or null
  int64_t r_stride0, r_stride1;
  // where the inputs split over blocks (blockIdx.z of k_splits ranges of whole k-blocks): each
  // range's raw sums into partial ([k_splits, M, N] float32), which one more kernel adds and finishes
  float* partial;
  int k_splits;
  int M, N, K, group;
};

// A weight row's 16-byte chunk `chunk` of a k-block, at its swizzled place in the slab's row `row`.
template <bool kFp8>
__device__ __forceinline__ int w_chunk(int row, int chunk) {
  return kFp8 ? chunk ^ ((row >> 1) & 3) : chunk ^ ((row >> 2) & 1);
}

template <int BM, bool kFp8, int kStages>
constexpr int smem_bytes() {
  return kStages * kStageBytes<BM, kFp8>;
}

// A B fragment's two registers from byte c of two words of a weight row (inputs 2c, 2c + 1 of the
// k16 step in x's byte c, 2c + 8, 2c + 9 in y's): the bf16 (fp16) pairs (q - 8) * s. One byte_perm
// puts both bytes in one word (x's in byte 0, y's in byte 2; bytes 1 and 3 are masked away), the low
// nibbles and the high ones become 128 + q (1024 + q) by an AND and an OR of the exponent, the
// subtraction is exact and the product rounds once; two byte_perms pair each byte's nibbles.
template <typename TT>
__device__ __forceinline__ void dequantize_pairs(uint32_t x, uint32_t y, int c, uint32_t scale2, uint32_t& b0,
                                                 uint32_t& b1) {
  constexpr bool kHalf = std::is_same_v<TT, __half>;
  using T2 = std::conditional_t<kHalf, __half2, __nv_bfloat162>;
  constexpr uint32_t kExponent = kHalf ? 0x64006400u : 0x43004300u;  // 1024 (128), whose unit is 1
  constexpr unsigned short kOffset = kHalf ? 0x6408u : 0x4308u;  // 1032 (136)
  const uint32_t p = __byte_perm(x, y, static_cast<uint32_t>(c) | ((static_cast<uint32_t>(c) + 4) << 8));
  uint32_t v[2] = {(p & 0x000F000Fu) | kExponent, ((p >> 4) & 0x000F000Fu) | kExponent};  // (low, high nibbles)
  T2 off;
  if constexpr (kHalf) {
    off = T2(__ushort_as_half(kOffset), __ushort_as_half(kOffset));
  } else {
    off = T2(__ushort_as_bfloat16(kOffset), __ushort_as_bfloat16(kOffset));
  }
#pragma unroll
  for (uint32_t& w : v) {
    const T2 h = __hmul2(__hsub2(*reinterpret_cast<const T2*>(&w), off), *reinterpret_cast<const T2*>(&scale2));
    w = *reinterpret_cast<const uint32_t*>(&h);
  }
  b0 = __byte_perm(v[0], v[1], 0x5410u);  // (x's low nibble, x's high one)
  b1 = __byte_perm(v[0], v[1], 0x7632u);  // (y's)
}

// A pair of e4m3 codes (the first in the low byte) as the bf16 (fp16) pair of their values: each
// code's sign and 7 low bits placed as the type's sign and low exponent and mantissa bits, then
// times 2^120 (2^8), which restores the exponent's bias, exactly (subnormal codes too).
template <typename TT>
__device__ __forceinline__ uint32_t widen_fp8_pair(uint32_t pair) {
  if constexpr (std::is_same_v<TT, __half>) {
    const uint32_t t =
        ((pair & 0x80u) << 8) | ((pair & 0x7Fu) << 7) | ((pair & 0x8000u) << 16) | ((pair & 0x7F00u) << 15);
    const __half2 two8(__ushort_as_half(0x5C00u), __ushort_as_half(0x5C00u));  // 2^8
    const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&t), two8);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const uint32_t t =
        ((pair & 0x80u) << 8) | ((pair & 0x7Fu) << 4) | ((pair & 0x8000u) << 16) | ((pair & 0x7F00u) << 12);
    const __nv_bfloat162 two120(__ushort_as_bfloat16(0x7B80u), __ushort_as_bfloat16(0x7B80u));  // 2^120
    const __nv_bfloat162 h = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&t), two120);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// TT: __nv_bfloat16 or __half; BM: 32, 64 or 128 rows a block; kFp8: a float8 weight, else int4;
// kStages: cp.async stages (2 or more). Grid: (M tiles, N tiles, k_splits), the M tiles fastest so
// that the blocks that read a weight slab run together (x, the smaller, is re-read). (32 rows: three
// blocks an SM; 64: two, at most 128 registers a thread; 128 rows: one.)
template <typename TT, int BM, bool kFp8, int kStages>
__global__ void __launch_bounds__(kThreads, kBlocksAnSm<BM>) quant_gemm_kernel(Args a) {
  static_assert(kStages >= 2, "a stage loads while another multiplies");
  constexpr int kWarpsM = BM == 128 ? 2 : 1, kWarpsN = kThreads / 32 / kWarpsM;
  constexpr int WM = BM / kWarpsM, MT = WM / 16, WN = kBN / kWarpsN, NT = WN / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int64_t m0 = int64_t{blockIdx.x} * BM, n0 = int64_t{blockIdx.y} * kBN;
  // this block's k-blocks: [kb0, kb0 + kblocks) (range blockIdx.z of k_splits; the last may be shorter)
  const int all_kblocks = a.K / kBK, per_split = (all_kblocks + a.k_splits - 1) / a.k_splits;
  const int kb0 = static_cast<int>(blockIdx.z) * per_split;
  const int kblocks = min(per_split, all_kblocks - kb0);
  const TT* x = static_cast<const TT*>(a.x);
  const TT* scale = static_cast<const TT*>(a.scale);

  auto x_tile = [&](int stage) {
    return Tile<kBK>{smem_addr(smem) + static_cast<uint32_t>(stage * BM * kBK * 2)};
  };
  constexpr int kRowBytes = kWRowBytes<kFp8>, kChunks = kRowBytes / 16;  // (16-byte chunks a row)
  const int64_t w_row = kFp8 ? a.K : a.K / 2;  // a weight row's bytes
  unsigned char* w_smem = smem + kStages * BM * kBK * 2;
  auto load_stage = [&](int stage, int i) {  // (the block's k-block i)
    const int kb = kb0 + i;
    load_tile<BM, kBK, kThreads>(x_tile(stage), x + int64_t{kb} * kBK, a.x_stride, m0, a.M);
    // the weight slab: 128 rows of 32 (64) bytes, a 16-byte chunk a thread (two)
#pragma unroll
    for (int r = 0; r < kBN * kChunks / kThreads; ++r) {
      const int idx = r * kThreads + static_cast<int>(threadIdx.x), row = idx / kChunks, chunk = idx % kChunks;
      const bool valid = n0 + row < a.N;
      const uint8_t* src = a.w + (valid ? n0 + row : 0) * w_row + int64_t{kb} * kRowBytes + chunk * 16;
      cp_async16(smem_addr(w_smem + stage * kBN * kRowBytes + row * kRowBytes + w_chunk<kFp8>(row, chunk) * 16), src,
                 valid);
    }
  };
  // The scales of this thread's 4 features (n8 tile j's column g) for the block's k-block i, as
  // pairs (s, s).
  auto load_scales = [&](int i, uint32_t (&s2)[NT]) {
    const int64_t group = int64_t{kb0 + i} * kBK / a.group;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int64_t n = n0 + warp_n * WN + j * 8 + g;
      const unsigned short bits =
          n < a.N ? reinterpret_cast<const unsigned short*>(scale)[n * a.scale_s0 + group * a.scale_s1] : 0;
      s2[j] = bits | (static_cast<uint32_t>(bits) << 16);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < kblocks) load_stage(s, s);
    cp_async_commit();
  }
  uint32_t s2[NT] = {}, s2_next[NT] = {};  // (int4's group scales; float8 scales the sums at the end)
  // (a forced split's range past the inputs has no k-block: zero sums)
  if (!kFp8 && kblocks > 0) load_scales(0, s2);
  for (int kb = 0; kb < kblocks; ++kb) {  // (kb: the block's k-blocks from 0, kb0 + kb of the inputs')
    if (!kFp8 && kb + 1 < kblocks) load_scales(kb + 1, s2_next);  // (in flight while this k-block multiplies)
    cp_async_wait<kStages - 2>();
    __syncthreads();  // (every warp is done with the stage the next load overwrites)
    if (const int next = kb + kStages - 1; next < kblocks) load_stage(next % kStages, next);
    cp_async_commit();

    const int stage = kb % kStages;
    const Tile<kBK> xt = x_tile(stage);
    // (row g of each n8 tile: the same row bits, the same swizzle)
    const unsigned char* wt = w_smem + stage * kBN * kRowBytes + (warp_n * WN + g) * kRowBytes;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) ldmatrix_x4(af[i], a_frag(xt, warp_m * WM + i * 16, kk * 16, lane));
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        uint32_t b0, b1;
        if constexpr (kFp8) {
          // bytes 16 kk ... 16 kk + 15 of row g of n8 tile j: this lane's, 2c and 2c + 1 of each half
          const uint4 words = *reinterpret_cast<const uint4*>(wt + j * 8 * kRowBytes + w_chunk<true>(g, kk) * 16);
          const uint32_t pick = (2u * c) | ((2u * c + 1) << 4);
          b0 = widen_fp8_pair<TT>(__byte_perm(words.x, words.y, pick));
          b1 = widen_fp8_pair<TT>(__byte_perm(words.z, words.w, pick));
        } else {
          // bytes 8 kk ... 8 kk + 7 of row g of n8 tile j: this lane's are byte c of each word
          const uint2 words =
              *reinterpret_cast<const uint2*>(wt + j * 8 * kRowBytes + w_chunk<false>(g, kk / 2) * 16 + kk % 2 * 8);
          dequantize_pairs<TT>(words.x, words.y, c, s2[j], b0, b1);
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) mma<TT>(acc[i][j], af[i], b0, b1);
      }
    }
    if (!kFp8 && kb + 1 < kblocks) {
#pragma unroll
      for (int j = 0; j < NT; ++j) s2[j] = s2_next[j];
    }
  }
  // out: a thread's sums are rows g and g + 8 of each m16 tile, columns 2c and 2c + 1 of each n8 tile,
  // plus bias and residual in float32, rounded once (as the decoding kernels' outputs are); split,
  // the range's sums alone into partial
  if (a.partial != nullptr) {
    float* part = a.partial + int64_t{blockIdx.z} * a.M * a.N;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t m = m0 + warp_m * WM + i * 16 + g + half * 8;
        if (m >= a.M) continue;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int64_t n = n0 + warp_n * WN + j * 8 + 2 * c;
          float* o = part + m * a.N + n;
          if (n + 1 < a.N && a.N % 2 == 0) {  // (8-byte aligned)
            *reinterpret_cast<float2*>(o) = make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
          } else {
            if (n < a.N) o[0] = acc[i][j][2 * half];
            if (n + 1 < a.N) o[1] = acc[i][j][2 * half + 1];
          }
        }
      }
    }
    return;
  }
  TT* out = static_cast<TT*>(a.out);
  const TT* bias = static_cast<const TT*>(a.bias);
  const TT* residual = static_cast<const TT*>(a.residual);
  auto finish = [&](int64_t m, int64_t n, float v) {
    if constexpr (kFp8) v *= static_cast<const float*>(a.scale)[n * a.scale_s0];
    if (bias != nullptr) v += static_cast<float>(bias[n * a.bias_stride]);
    if (residual != nullptr) v += static_cast<float>(residual[m * a.r_stride0 + n * a.r_stride1]);
    return v;
  };
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t m = m0 + warp_m * WM + i * 16 + g + half * 8;
      if (m >= a.M) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int64_t n = n0 + warp_n * WN + j * 8 + 2 * c;
        if (n >= a.N) continue;
        const float v0 = finish(m, n, acc[i][j][2 * half]);
        const float v1 = n + 1 < a.N ? finish(m, n + 1, acc[i][j][2 * half + 1]) : 0.f;
        TT* o = out + m * a.N + n;
        if (n + 1 < a.N && (a.N % 2 == 0)) {
          if constexpr (std::is_same_v<TT, __half>) {
            *reinterpret_cast<__half2*>(o) = __floats2half2_rn(v0, v1);
          } else {
            *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
          }
        } else {
          o[0] = static_cast<TT>(v0);
          if (n + 1 < a.N) o[1] = static_cast<TT>(v1);
        }
      }
    }
  }
}

}  // namespace customops::cuda::quant_gemm
