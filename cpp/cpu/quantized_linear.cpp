// CPU kernels of fused_linear with a quantized weight (cpp/ops/fused_linear.cpp calls them).
// - A few rows (decoding): the codes are read as stored, a block of a weight row decoded at a time
//   into L1 (as float16 bit patterns: fp8 codes shifted, int4 codes as subnormals) and multiplied
//   there with up to 4 rows of x at once. The ATen decomposition's dequantized float32 matrix,
//   written and read again, cost 20-60x the bf16 product at one row. At 7-8 rows the inputs go in
//   spans whose x (every row's) stays in L1 while each of a thread's output features multiplies
//   it, instead of x read from L2 for every feature: on a 2-core AVX-512 CPU (2026-11-30) 8 rows
//   of 4096 x 14336 took 7.7 ms (int4) and 7.6 (fp8) against 11.0 and 9.1, of 14336 x 4096 9.8 and
//   8.8 against 9.8 and 9.7; at 1-5 rows reading each weight row whole was as fast or faster.
//   fp8 (E4M3, a float32 scale an output feature): y[r, j] = scale[j] * sum_k x[r, k] * f8(w[j, k]);
//   int4 (two a byte, low nibble first, stored plus 8; a scale a group of inputs):
//   y[r, j] = sum_g scale[j, g] * sum_{k in g} x[r, k] * (q[j, k] - 8): the dequantized product's
//   sums in float32, in another order (each code less its 8 before the product, never a sum of x
//   taken off after: that cancels, and a zero weight under a large x would not give 0).
// - 1-8 rows of bfloat16 x where the CPU has AVX512_BF16 (rows_bf16), int4 groups or fp8 rows of
//   whole 32-byte vectors: the codes decoded in registers into bfloat16 and multiplied with x by
//   VDPBF16PS (exact products, float32 sums), up to 4 rows a pass over 2-4 features sharing x's
//   loads: one row at the memory's speed (the float32 kernels took up to 2.6x as long), 4-8 rows of
//   Llama-3-8B MLP shapes in 0.3-0.5x the float32 kernels' time. Other shapes at 2-8 rows: a block
//   decoded into bfloat16 pairs in L1 first, the weight rows prefetched ahead.
// - Many rows (prefill): blocks of output features dequantized to float32, bit for bit as the
//   decomposition does, a row at a time (then rounded to bfloat16 or float16 x's dtype), and
//   multiplied by BLAS, hundreds of features a product.
// Output features are split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/rows.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace customops {
namespace CPU_CAPABILITY {

namespace {

using Vec = Vectorized<float>;
using HalfVec = Vectorized<c10::Half>;
static_assert(HalfVec::size() == 2 * Vec::size());

// The block of a weight row decoded at once (8 KiB of floats: it stays in L1 beside x's block), and
// the rows of x that share each decoded vector (their sums in registers). Past kRowsWhole rows the
// inputs go in spans of kXSpanBytes of x.
constexpr int64_t kBlock = 2048;
constexpr int kRowBlock = 4;
constexpr int64_t kRowsWhole = 6;
constexpr int64_t kXSpanBytes = 24 * 1024;

// Threads split the output features in blocks of at least this many weight bytes.
constexpr int64_t kMinBytesAThread = 256 * 1024;

// int4's float32 decoding kernel at 2-8 rows and the bfloat16 ones prefetch the weight row this
// many features ahead: between one row's bytes and the next the rows' products run, and the
// hardware's prefetcher had not kept up
// (int4 4096 x 14336 on a 2-core AVX-512 CPU, 2026-11-30: 4 rows 5.4-5.8 ms without, 3.8-4.6 with).
constexpr int64_t kPrefetchRows = 2;

// The exact value of each float8_e4m3fn code (signed zeros, subnormals, NaN; E4M3 has no
// infinity), by integer operations the compiler vectorizes: a normal code's exponent rebiased
// (7 to 127), a subnormal's mantissa times 2^-9, 0x7f and 0xff NaN.
void decode_fp8(const uint8_t* __restrict w, float* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = w[i], e = (b >> 3) & 15u, m = b & 7u;
    const uint32_t normal = ((e + 120u) << 23) | (m << 20);
    const uint32_t subnormal = __builtin_bit_cast(uint32_t, static_cast<float>(m) * 0x1p-9f);
    const uint32_t is_normal = 0u - static_cast<uint32_t>(e != 0);
    const uint32_t is_nan = 0u - static_cast<uint32_t>((b & 0x7fu) == 0x7fu);
    const uint32_t bits = (((normal & is_normal) | (subnormal & ~is_normal)) & ~is_nan) | (0x7fc00000u & is_nan);
    out[i] = __builtin_bit_cast(float, bits | ((b & 0x80u) << 24));
  }
}

// float8_e4m3fn codes to the float16 bit patterns of 2^-8 times their values, exactly (E4M3's
// exponent bias is 7, float16's 15, so a shift does it, subnormals too): half the bytes of floats
// to hold in L1, and float16 to float32 is one instruction where the CPU has F16C. Returns whether
// a code was NaN (0x7f or 0xff), which has no such pattern.
bool fp8_as_half(const uint8_t* __restrict w, uint16_t* __restrict out, int64_t n) {
  uint32_t nan = 0;
#pragma omp simd reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = w[i];
    out[i] = static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    nan |= static_cast<uint32_t>((b & 0x7fu) == 0x7fu);
  }
  return nan != 0;
}

// A byte's two int4 codes (0..15) as float16 bit patterns, the low nibbles to lo, the high ones to
// hi: a code q is the subnormal q * 2^-24, exactly, which F16C widens to float32 at full speed.
void int4_as_half(const uint8_t* __restrict w, uint16_t* __restrict lo, uint16_t* __restrict hi, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    lo[i] = static_cast<uint16_t>(w[i] & 15u);
    hi[i] = static_cast<uint16_t>(w[i] >> 4);
  }
}

// The float value of a float16 bit pattern.
float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// acc[r] += x[r][i] * h[i] for R rows, over n elements (a multiple of HalfVec::size()) of float16
// patterns h, each vector of h converted once for the R rows.
template <int R>
void fma_halves(const float* const* x, const uint16_t* h, int64_t n, Vec* acc) {
  Vec a0[R], a1[R];  // (in registers: two chains a row hide the FMA's latency)
  for (int r = 0; r < R; ++r) {
    a0[r] = acc[r];
    a1[r] = Vec(0.f);
  }
  for (int64_t i = 0; i < n; i += HalfVec::size()) {
    const auto [h0, h1] = at::vec::convert_to_float<c10::Half>(HalfVec::loadu(h + i));
    for (int r = 0; r < R; ++r) {
      a0[r] = at::vec::fmadd(Vec::loadu(x[r] + i), h0, a0[r]);
      a1[r] = at::vec::fmadd(Vec::loadu(x[r] + i + Vec::size()), h1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = a0[r] + a1[r];
}

// part[r] = sum_i e[r][i] * (lo[i] - 8) + o[r][i] * (hi[i] - 8) for R rows, over n elements (a
// multiple of HalfVec::size()) of int4 codes as float16 patterns (so 2^-24 times that: the 8 too).
template <int R>
void fma_pairs(const float* const* e, const float* const* o, const uint16_t* lo, const uint16_t* hi, int64_t n,
               Vec* part) {
  const Vec eight(8.f * 0x1p-24f);
  Vec pe[R], po[R];
  for (int r = 0; r < R; ++r) pe[r] = po[r] = Vec(0.f);
  for (int64_t i = 0; i < n; i += HalfVec::size()) {
    auto [l0, l1] = at::vec::convert_to_float<c10::Half>(HalfVec::loadu(lo + i));
    auto [h0, h1] = at::vec::convert_to_float<c10::Half>(HalfVec::loadu(hi + i));
    l0 = l0 - eight;
    l1 = l1 - eight;
    h0 = h0 - eight;
    h1 = h1 - eight;
    for (int r = 0; r < R; ++r) {
      pe[r] = at::vec::fmadd(Vec::loadu(e[r] + i), l0, pe[r]);
      po[r] = at::vec::fmadd(Vec::loadu(o[r] + i), h0, po[r]);
      pe[r] = at::vec::fmadd(Vec::loadu(e[r] + i + Vec::size()), l1, pe[r]);
      po[r] = at::vec::fmadd(Vec::loadu(o[r] + i + Vec::size()), h1, po[r]);
    }
  }
  for (int r = 0; r < R; ++r) part[r] = pe[r] + po[r];
}

// fp8's outputs of features [begin, end) from their sums [rows, end - begin] of float16 patterns'
// products: times each feature's scale and 2^8 (the patterns' factor, folded into the scale, or
// taken first where the scale is near float's largest: a product of exact powers of two, so the
// same rounding either way); NaN for a feature with a NaN code.
void fp8_finish(const float* sums, const uint8_t* nan, const float* scale, int64_t begin, int64_t end, int64_t rows,
                int64_t n, float* y) {
  const int64_t count = end - begin;
  for (int64_t j = begin; j < end; ++j) {
    const float s256 = 256.f * scale[j];
    for (int64_t r = 0; r < rows; ++r) {
      const float sum = sums[r * count + j - begin];
      y[r * n + j] = nan[j - begin]         ? std::numeric_limits<float>::quiet_NaN()
                     : std::isfinite(s256) ? sum * s256
                                           : sum * 256.f * scale[j];
    }
  }
}

// f(std::integral_constant<int, R>, first row) over the rows in blocks of kRowBlock (the last one
// shorter).
template <typename F>
void row_blocks(int64_t rows, const F& f) {
  static_assert(kRowBlock == 4);
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, rows - r0)) {
      case 1: f(std::integral_constant<int, 1>(), r0); break;
      case 2: f(std::integral_constant<int, 2>(), r0); break;
      case 3: f(std::integral_constant<int, 3>(), r0); break;
      default: f(std::integral_constant<int, 4>(), r0); break;
    }
  }
}

// The elements of a weight row in a span (all `elements` up to kRowsWhole rows; else a multiple of
// `unit` whose inputs, bytes_an_element of x a row, keep x's span of every row within kXSpanBytes).
int64_t span_elements(int64_t rows, int64_t elements, int64_t bytes_an_element, int64_t unit) {
  if (rows <= kRowsWhole) return std::max<int64_t>(elements, 1);
  return std::max<int64_t>(unit, kXSpanBytes / (rows * bytes_an_element) / unit * unit);
}

}  // namespace

// x [rows, k] float32; w [n, k] float8 codes; scale [n]; y [rows, n].
void fp8_rows(const float* x, int64_t rows, int64_t k, const uint8_t* w, const float* scale, int64_t n, float* y) {
  const int64_t span = span_elements(rows, k, sizeof(float), HalfVec::size());
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    const int64_t count = end - begin;
    std::vector<uint16_t> dec(std::min(k, kBlock));
    std::vector<Vec> acc(rows);
    std::vector<float> tail(rows);
    std::vector<float> sums(rows * count, 0.f);  // [rows, count]: each feature's sums over the spans so far
    std::vector<uint8_t> nan(count, 0);
    for (int64_t s0 = 0; s0 < k; s0 += span) {
      const int64_t s1 = std::min(s0 + span, k);
      for (int64_t j = begin; j < end; ++j) {
        std::fill(acc.begin(), acc.end(), Vec(0.f));
        std::fill(tail.begin(), tail.end(), 0.f);
        for (int64_t c = s0; c < s1; c += kBlock) {
          const int64_t len = std::min(kBlock, s1 - c), whole = len - len % HalfVec::size();
          nan[j - begin] |= fp8_as_half(w + j * k + c, dec.data(), len);
          row_blocks(rows, [&](auto block_rows, int64_t r0) {
            constexpr int R = decltype(block_rows)::value;
            const float* xr[R];
            for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * k + c;
            fma_halves<R>(xr, dec.data(), whole, acc.data() + r0);
          });
          for (int64_t i = whole; i < len; ++i) {
            const float h = half_value(dec[i]);
            for (int64_t r = 0; r < rows; ++r) tail[r] += x[r * k + c + i] * h;
          }
        }
        for (int64_t r = 0; r < rows; ++r) sums[r * count + j - begin] += hsum(acc[r]) + tail[r];
      }
    }
    fp8_finish(sums.data(), nan.data(), scale, begin, end, rows, n, y);
  });
}

// x [rows, k] float32 split into its even (xe) and odd (xo) inputs, [rows, k / 2] each; w [n, k / 2] bytes; scale [n, groups] float32 (a group:
// k / groups inputs, an even number); y [rows, n].
void int4_rows(const float* xe, const float* xo, int64_t rows, int64_t k, const uint8_t* w,
               const float* scale, int64_t groups, int64_t n, float* y) {
  const int64_t half = k / 2, group_bytes = half / groups;
  // a block holds whole groups (one group where a group is longer than kBlock bytes: split there);
  // a span (a byte: 2 floats of x a row) whole blocks
  const int64_t block = group_bytes >= kBlock ? kBlock : kBlock / group_bytes * group_bytes;
  const int64_t span = span_elements(rows, half, 2 * sizeof(float), std::min(block, group_bytes));
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(half, 1)), [&](int64_t begin, int64_t end) {
    const int64_t count = end - begin;
    std::vector<uint16_t> lo(block), hi(block);
    std::vector<float> tail(rows);
    std::vector<Vec> acc(rows);
    std::vector<float> sums(rows * count, 0.f);  // [rows, count]: each feature's sums so far
    for (int64_t s0 = 0; s0 < half; s0 += span) {
      const int64_t s1 = std::min(s0 + span, half);
      for (int64_t j = begin; j < end; ++j) {
        std::fill(acc.begin(), acc.end(), Vec(0.f));
        std::fill(tail.begin(), tail.end(), 0.f);
        const float* sj = scale + j * groups;
        for (int64_t c0 = s0; c0 < s1; c0 += block) {
          const int64_t c1 = std::min(c0 + block, s1);
          if (rows > 1 && j + kPrefetchRows < end) {
            for (int64_t p = c0; p < c1; p += 64) __builtin_prefetch(w + (j + kPrefetchRows) * half + p, 0, 3);
          }
          int4_as_half(w + j * half + c0, lo.data(), hi.data(), c1 - c0);
          // the pieces of groups in the block: [c, c + len) of group g
          for (int64_t c = c0; c < c1;) {
            const int64_t g = c / group_bytes, len = std::min(group_bytes - c % group_bytes, c1 - c);
            const int64_t whole = len - len % HalfVec::size();
            const uint16_t* l = lo.data() + (c - c0);
            const uint16_t* h = hi.data() + (c - c0);
            row_blocks(rows, [&](auto block_rows, int64_t r0) {
              constexpr int R = decltype(block_rows)::value;
              const float* e[R];
              const float* o[R];
              for (int r = 0; r < R; ++r) {
                e[r] = xe + (r0 + r) * half + c;
                o[r] = xo + (r0 + r) * half + c;
              }
              Vec part[R];
              fma_pairs<R>(e, o, l, h, whole, part);
              // (2^24: the float16 patterns' factor, folded into the scale, or taken first where the
              // scale is near float's largest)
              const float s24 = sj[g] * 0x1p24f;
              for (int r = 0; r < R; ++r) {
                acc[r0 + r] = std::isfinite(s24) ? at::vec::fmadd(part[r], Vec(s24), acc[r0 + r])
                                                 : at::vec::fmadd(part[r] * Vec(0x1p24f), Vec(sj[g]), acc[r0 + r]);
              }
            });
            if (whole < len) {
              for (int64_t r = 0; r < rows; ++r) {
                float t = 0.f;
                for (int64_t i = whole; i < len; ++i) {
                  t += xe[r * half + c + i] * (static_cast<float>(l[i]) - 8.f) +
                       xo[r * half + c + i] * (static_cast<float>(h[i]) - 8.f);
                }
                tail[r] += sj[g] * t;
              }
            }
            c += len;
          }
        }
        for (int64_t r = 0; r < rows; ++r) sums[r * count + j - begin] += hsum(acc[r]) + tail[r];
      }
    }
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < rows; ++r) y[r * n + j] = sums[r * count + j - begin];
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
// int4 with bfloat16 x where the CPU has AVX512_BF16's dot products (VDPBF16PS: two bfloat16
// products a float32 lane, exact, added to the lane's sum): a block of a weight row decoded into
// L1 as bfloat16 pairs (a byte's low and high codes, less 8: exact), each pair multiplied with x's
// inputs 2i and 2i + 1 as they are stored (no float32 copy of x, no even/odd split), a group's
// sums times its scale in float32. Twice the products an instruction of the float32 path, whose
// decoding and FMAs bound it. (The instruction treats subnormal inputs as 0 and flushes subnormal
// results: with int4's codes at 2^-24 times their values, products below 2^-102.)
#define CUSTOMOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
namespace {

constexpr int64_t kBf16Chunk = 16;  // weight bytes a vector (32 codes, 32 bfloat16 of x)

// acc[r] += (pre * sum over [0, whole) bytes of x[r] (bfloat16 pairs) . d (bfloat16 pairs)) * s, R
// rows; two sums a row (even and odd vectors) to hide the instruction's latency.
template <int R>
CUSTOMOPS_BF16_TARGET inline void dot_pairs(const uint16_t* const* xr, const uint32_t* d, int64_t whole, __m512 pre,
                                           __m512 s, __m512* acc) {
  __m512 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kBf16Chunk <= whole; i += 2 * kBf16Chunk) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(d + i), w1 = (__m512bh)_mm512_loadu_si512(d + i + kBf16Chunk);
    for (int r = 0; r < R; ++r) {
      p0[r] = _mm512_dpbf16_ps(p0[r], (__m512bh)_mm512_loadu_si512(xr[r] + 2 * i), w0);
      p1[r] = _mm512_dpbf16_ps(p1[r], (__m512bh)_mm512_loadu_si512(xr[r] + 2 * (i + kBf16Chunk)), w1);
    }
  }
  if (i < whole) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(d + i);
    for (int r = 0; r < R; ++r) p0[r] = _mm512_dpbf16_ps(p0[r], (__m512bh)_mm512_loadu_si512(xr[r] + 2 * i), w0);
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_add_ps(p0[r], p1[r]), pre), s, acc[r]);
}

// The block [c0, c1) of weight row bytes (decoded into dec, `unit` times the weights' values)
// against every row of x: each group's piece in it, rows four at a time.
CUSTOMOPS_BF16_TARGET void dot_block(const uint32_t* dec, int64_t c0, int64_t c1, int64_t group_bytes,
                                     const uint16_t* xb, int64_t rows, int64_t k, const float* sj, float unit,
                                     __m512* acc) {
  for (int64_t c = c0; c < c1;) {
    const int64_t g = c / group_bytes, len = std::min(group_bytes - c % group_bytes, c1 - c);
    const int64_t whole = len - len % kBf16Chunk;
    const uint32_t* d = dec + (c - c0);
    // (unit: the decoded weights' factor, folded into the scale, or taken first where the scale is
    // near float's largest)
    const float unit_s = sj[g] * unit;
    const bool folded = std::isfinite(unit_s);
    const __m512 pre = _mm512_set1_ps(folded ? 1.f : unit), s = _mm512_set1_ps(folded ? unit_s : sj[g]);
    row_blocks(rows, [&](auto block_rows, int64_t r0) {
      constexpr int R = decltype(block_rows)::value;
      const uint16_t* xr[R];
      for (int r = 0; r < R; ++r) xr[r] = xb + (r0 + r) * k + 2 * c;
      dot_pairs<R>(xr, d, whole, pre, s, acc + r0);
    });
    c += len;
  }
}

float bf16_value(uint32_t bits) { return c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()); }

// The bfloat16 of (q - 8) * 2^-24 for each int4 code q (vpermw's table: words 0-15, repeated in
// 16-31), exact: the sums are 2^-24 times the products', so that a sum overflows only where the
// result does (the scale takes the 2^24, as int4_rows' do); a product of x below 2^-102 is flushed.
void int4_bf16_table(uint16_t* table) {
  for (int q = 0; q < 32; ++q) table[q] = c10::BFloat16(static_cast<float>(q % 16 - 8) * 0x1p-24f).x;
}

void int4_rows_bf16_kernel(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const float* scale,
                           int64_t groups, int64_t n, float* y) {
  const int64_t half = k / 2, group_bytes = half / groups;
  const int64_t block = group_bytes >= kBlock ? kBlock : kBlock / group_bytes * group_bytes;
  // x whole, not in spans as the float32 kernels' at 7-8 rows: 8 rows of bfloat16 x fit L2, and in
  // spans 8 rows took 8.6 ms against 6.3 (int4 4096 x 14336)
  alignas(64) uint16_t table[32];
  int4_bf16_table(table);
  const __m512i codes = _mm512_load_si512(table);
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(half, 1)), [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> dec(block);  // a byte's two codes as a bfloat16 pair (low code first)
    __m512 acc[8];
    for (int64_t j = begin; j < end; ++j) {
      const float* sj = scale + j * groups;
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      float tail[8] = {};
      for (int64_t c0 = 0; c0 < half; c0 += block) {
        const int64_t c1 = std::min(c0 + block, half), len = c1 - c0, whole = len - len % kBf16Chunk;
        const uint8_t* wj = w + j * half + c0;
        if (j + kPrefetchRows < end) {
          for (int64_t p = 0; p < len; p += 64) __builtin_prefetch(wj + kPrefetchRows * half + p, 0, 3);
        }
        for (int64_t i = 0; i < whole; i += kBf16Chunk) {
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + i)));
          const __m512i pair = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(15)),
                                               _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
          _mm512_storeu_si512(dec.data() + i, _mm512_permutexvar_epi16(pair, codes));
        }
        for (int64_t i = whole; i < len; ++i) dec[i] = table[wj[i] & 15u] | (uint32_t{table[wj[i] >> 4]} << 16);
        dot_block(dec.data(), c0, c1, group_bytes, xb, rows, k, sj, 0x1p24f, acc);
        // each group piece's bytes past its whole vectors, one at a time
        for (int64_t c = c0; c < c1;) {
          const int64_t g = c / group_bytes, piece = std::min(group_bytes - c % group_bytes, c1 - c);
          const float s24 = sj[g] * 0x1p24f;
          for (int64_t r = 0; r < rows && piece % kBf16Chunk != 0; ++r) {
            float t = 0.f;  // (2^-24 times the products, as the table's)
            for (int64_t i = c + piece - piece % kBf16Chunk; i < c + piece; ++i) {
              const uint16_t* xi = xb + r * k + 2 * i;
              t += bf16_value(xi[0]) * bf16_value(dec[i - c0]) + bf16_value(xi[1]) * bf16_value(dec[i - c0] >> 16);
            }
            tail[r] += std::isfinite(s24) ? t * s24 : t * 0x1p24f * sj[g];
          }
          c += piece;
        }
      }
      for (int64_t r = 0; r < rows; ++r) y[r * n + j] = _mm512_reduce_add_ps(acc[r]) + tail[r];
    }
  });
}
// int4 with 1-8 rows of bfloat16 x, where a group is whole vectors of 32 bytes: each row of x split
// once into its even and odd inputs, so that 32 weight bytes decode in registers, without a buffer,
// into the bfloat16 of their 32 low codes (the even inputs' weights) and of their 32 high codes (the
// odd inputs'), one table lookup (vpermw) each, which VDPBF16PS takes against up to 4 rows' xe and xo
// as loaded; F features share each load of x and each decoded vector serves the rows. About 6
// instructions for 64 weights at one row, where the float32 kernel's decoding and FMAs bound it
// (int4 4096 x 14336 on a 2-core AVX-512 CPU, 2026-11-30: 2.0-2.2 ms, now 1.0-1.4: about the
// memory's speed). The table int4_bf16_table (2^-24 times the values, the scale times
// 2^24, a product of x below 2^-102 flushed).
constexpr int64_t kRowVector = 32;  // weight bytes a vector (64 int4 codes, 32 fp8 ones)

// The features a block for R rows: as many as the 32 vector registers hold.
template <int R>
constexpr int row_features() {
  return R <= 2 ? 4 : 2;
}

// y[r, f] (y's rows n apart) for R rows of x (xe, xo) and F features of w (F rows of half bytes),
// scales sf (F rows of groups); folded: every scale times 2^24 finite (the 2^24 folded into it).
template <int R, int F>
CUSTOMOPS_BF16_TARGET inline void int4_rows_features(const uint16_t* const* xe, const uint16_t* const* xo,
                                                     int64_t half, int64_t groups, const uint8_t* w,
                                                     const float* sf, bool folded, __m512i codes, float* y,
                                                     int64_t n) {
  const int64_t group_bytes = half / groups;
  __m512 acc[R][F];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_setzero_ps();
  // (one row: two sums a feature, the even inputs' and the odd ones', to hide the instruction's
  // latency; more rows have chains enough, and no registers to spare)
  constexpr bool kTwo = R == 1;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 p[R][F], q[R][F];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) p[r][f] = q[r][f] = _mm512_setzero_ps();
    for (int64_t c = g * group_bytes; c < (g + 1) * group_bytes; c += kRowVector) {
      __m512bh ve[R], vo[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        ve[r] = (__m512bh)_mm512_loadu_si512(xe[r] + c);
        vo[r] = (__m512bh)_mm512_loadu_si512(xo[r] + c);
      }
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) {
        // a byte in each word: its bits 0-4 index the table (codes 0-15, repeated in 16-31), its high
        // code shifted down
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + f * half + c)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, codes);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), codes);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          if constexpr (kTwo) {
            p[r][f] = _mm512_dpbf16_ps(p[r][f], ve[r], lo);
            q[r][f] = _mm512_dpbf16_ps(q[r][f], vo[r], hi);
          } else {
            p[r][f] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(p[r][f], ve[r], lo), vo[r], hi);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) {
      const float s = sf[f * groups + g];
      const __m512 s24 = _mm512_set1_ps(folded ? s * 0x1p24f : s);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 sum = kTwo ? _mm512_add_ps(p[r][f], q[r][f]) : p[r][f];
        acc[r][f] = folded ? _mm512_fmadd_ps(sum, s24, acc[r][f])
                           : _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(0x1p24f)), s24, acc[r][f]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) y[r * n + f] = _mm512_reduce_add_ps(acc[r][f]);
}

// F features for R rows: row_features<R>() at a time.
template <int R, int F>
CUSTOMOPS_BF16_TARGET inline void int4_rows_pass(const uint16_t* const* xe, const uint16_t* const* xo, int64_t half,
                                                 int64_t groups, const uint8_t* w, const float* sf, bool folded,
                                                 __m512i codes, float* y, int64_t n) {
  constexpr int FF = F < row_features<R>() ? F : row_features<R>();
  for (int f0 = 0; f0 < F; f0 += FF) {
    int4_rows_features<R, FF>(xe, xo, half, groups, w + f0 * half, sf + f0 * groups, folded, codes, y + f0, n);
  }
}

// F features (from feature j) for every row, kRowBlock rows a pass: the block's weight bytes stay in
// L1 between the passes.
template <int F>
CUSTOMOPS_BF16_TARGET inline void int4_feature_block(const uint16_t* xe, const uint16_t* xo, int64_t rows,
                                                     int64_t half, int64_t groups, const uint8_t* w,
                                                     const float* scale, int64_t j, int64_t n, __m512i codes,
                                                     float* y) {
  const float* sf = scale + j * groups;
  const uint8_t* wj = w + j * half;
  bool folded = true;
  for (int64_t i = 0; i < F * groups; ++i) folded &= std::isfinite(sf[i] * 0x1p24f);
  row_blocks(rows, [&](auto block_rows, int64_t r0) {
    constexpr int R = decltype(block_rows)::value;
    const uint16_t* e[R];
    const uint16_t* o[R];
    for (int r = 0; r < R; ++r) {
      e[r] = xe + (r0 + r) * half;
      o[r] = xo + (r0 + r) * half;
    }
    int4_rows_pass<R, F>(e, o, half, groups, wj, sf, folded, codes, y + r0 * n + j, n);
  });
}

CUSTOMOPS_BF16_TARGET void int4_rows_bf16_regs(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w,
                                               const float* scale, int64_t groups, int64_t n, float* y) {
  const int64_t half = k / 2;
  alignas(64) uint16_t table[32];
  int4_bf16_table(table);
  const __m512i codes = _mm512_load_si512(table);
  std::vector<uint16_t> xe(rows * half), xo(rows * half);  // [rows, half] each
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < rows * half; ++i) {
    xe[i] = xb[2 * i];
    xo[i] = xb[2 * i + 1];
  }
  constexpr int F = row_features<1>();
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(half, 1)), [&](int64_t begin, int64_t end) {
    int64_t j = begin;
    for (; j + F <= end; j += F) int4_feature_block<F>(xe.data(), xo.data(), rows, half, groups, w, scale, j, n, codes, y);
    for (; j < end; ++j) int4_feature_block<1>(xe.data(), xo.data(), rows, half, groups, w, scale, j, n, codes, y);
  });
}

// fp8 with bfloat16 x, as int4's above: a block of a weight row decoded to bfloat16 (the float16
// patterns of fp8_as_half, 2^-8 times the codes' values, widened and narrowed again: exact, every
// code has at most 4 significant bits), one group a row, its scale (times 2^8) on the sum.
CUSTOMOPS_BF16_TARGET void fp8_block_as_bf16(const uint16_t* h, uint32_t* out, int64_t pairs) {
  int64_t i = 0;
  for (; i + 16 <= pairs; i += 16) {  // (32 halves: two vectors of 16 floats, one of 32 bfloat16)
    const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 2 * i)));
    const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 2 * i + 16)));
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (; i < pairs; ++i) {
    out[i] = c10::BFloat16(half_value(h[2 * i])).x | (uint32_t{c10::BFloat16(half_value(h[2 * i + 1])).x} << 16);
  }
}

// fp8 with 1-8 rows of bfloat16 x, k a multiple of 32: 32 codes decoded in registers (the float16
// patterns of fp8_as_half widened and narrowed to bfloat16, exact) into VDPBF16PS against up to 4
// rows of x as stored, F features sharing each load of x (whose bfloat16, half of float32's bytes,
// stays in L1 at 14,336 inputs) and each decoded vector serving the rows; sums[r, f] (rows `count`
// apart) 2^-8 times the products' (fp8_finish takes the 2^8), nan[f] whether a code of feature f
// was NaN.
template <int R, int F>
CUSTOMOPS_BF16_TARGET inline void fp8_rows_features(const uint16_t* const* xr, int64_t k, const uint8_t* w,
                                                    float* sums, int64_t count, uint8_t* nan) {
  const __m512i low = _mm512_set1_epi16(0x3f80), sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  __m512 acc[R][F];
  __mmask32 nans[F];
#pragma GCC unroll 8
  for (int f = 0; f < F; ++f) {
    nans[f] = 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][f] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < k; c += kRowVector) {
    __m512bh v[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) v[r] = (__m512bh)_mm512_loadu_si512(xr[r] + c);
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + f * k + c)));
      // the float16 pattern: bits 0-6 of the code at 7-13, its sign at 15
      const __m512i mag = _mm512_and_si512(_mm512_slli_epi16(b, 7), low);
      const __m512i h = _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(b, 8), sign, 0xF8);  // mag | (b << 8 & sign)
      nans[f] |= _mm512_cmpeq_epi16_mask(mag, low);  // (code & 0x7f) == 0x7f
      const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      const __m512bh d = _mm512_cvtne2ps_pbh(hi, lo);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][f] = _mm512_dpbf16_ps(acc[r][f], v[r], d);
    }
  }
#pragma GCC unroll 8
  for (int f = 0; f < F; ++f) {
    nan[f] |= nans[f] != 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r * count + f] = _mm512_reduce_add_ps(acc[r][f]);
  }
}

CUSTOMOPS_BF16_TARGET void fp8_rows_bf16_regs(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w,
                                              const float* scale, int64_t n, float* y) {
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    const int64_t count = end - begin;
    std::vector<float> sums(rows * count);  // [rows, count]
    std::vector<uint8_t> nan(count, 0);
    // F features (from j) for every row, kRowBlock rows a pass (the features' bytes stay in L1)
    auto block = [&](auto features, int64_t j) {
      constexpr int F = decltype(features)::value;
      row_blocks(rows, [&](auto block_rows, int64_t r0) {
        constexpr int R = decltype(block_rows)::value;
        const uint16_t* xr[R];
        for (int r = 0; r < R; ++r) xr[r] = xb + (r0 + r) * k;
        fp8_rows_features<R, F>(xr, k, w + j * k, sums.data() + r0 * count + j - begin, count, nan.data() + j - begin);
      });
    };
    int64_t j = begin;
    for (; j + 4 <= end; j += 4) block(std::integral_constant<int, 4>(), j);
    for (; j < end; ++j) block(std::integral_constant<int, 1>(), j);
    fp8_finish(sums.data(), nan.data(), scale, begin, end, rows, n, y);
  });
}

void fp8_rows_bf16_kernel(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const float* scale,
                          int64_t n, float* y) {
  const int64_t pairs = k / 2, block = kBlock / 2;  // (pairs of codes: a block of kBlock codes)
  const auto* xb = reinterpret_cast<const uint16_t*>(x);  // (x whole, as int4's)
  const float one = 1.f;
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    const int64_t count = end - begin;
    std::vector<uint16_t> halves(2 * block);
    std::vector<uint32_t> dec(block);
    std::vector<float> sums(rows * count);  // [rows, count]: fp8_finish's
    std::vector<uint8_t> nan(count, 0);
    __m512 acc[8];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      float tail[8] = {};
      for (int64_t c0 = 0; c0 < pairs; c0 += block) {
        const int64_t c1 = std::min(c0 + block, pairs), len = c1 - c0;
        if (j + kPrefetchRows < end) {
          for (int64_t p = 0; p < 2 * len; p += 64) __builtin_prefetch(w + (j + kPrefetchRows) * k + 2 * c0 + p, 0, 3);
        }
        nan[j - begin] |= fp8_as_half(w + j * k + 2 * c0, halves.data(), 2 * len);
        fp8_block_as_bf16(halves.data(), dec.data(), len);
        dot_block(dec.data(), c0, c1, pairs, xb, rows, k, &one, 1.f, acc);
        for (int64_t i = c0 + len - len % kBf16Chunk; i < c1; ++i) {  // (pairs past whole vectors)
          for (int64_t r = 0; r < rows; ++r) {
            const uint16_t* xi = xb + r * k + 2 * i;
            tail[r] += bf16_value(xi[0]) * bf16_value(dec[i - c0]) + bf16_value(xi[1]) * bf16_value(dec[i - c0] >> 16);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) sums[r * count + j - begin] = _mm512_reduce_add_ps(acc[r]) + tail[r];
    }
    fp8_finish(sums.data(), nan.data(), scale, begin, end, rows, n, y);
  });
}
}  // namespace
#endif

// bfloat16 x [rows, k] with int4 weights (groups > 0: w, scale as int4_rows') or float8 ones
// (groups == 0: as fp8_rows'), by the CPU's bfloat16 dot products; false where this copy or the
// CPU has no AVX512_BF16, past 8 rows, for float8 of an odd k, and at one row but for whole 32-byte
// vectors (int4 groups, fp8 rows: in registers; else the float32 kernels, as the buffered ones took
// one row of int4 4096 x 14336 in 2.6 ms against their 2.0; in registers 1.0-1.4).
bool rows_bf16(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const float* scale,
               int64_t groups, int64_t n, float* y) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  if (!has_bf16 || rows < 1 || rows > 8 || (groups == 0 && k % 2 != 0)) return false;
  if (groups == 0 ? k % kRowVector == 0 : (k / 2 / groups) % kRowVector == 0) {
    // whole vectors: decoded in registers
    if (groups == 0) {
      fp8_rows_bf16_regs(x, rows, k, w, scale, n, y);
    } else {
      int4_rows_bf16_regs(x, rows, k, w, scale, groups, n, y);
    }
  } else if (rows == 1) {
    return false;  // (the float32 kernels: faster at one row than the buffered kernels below)
  } else if (groups == 0) {
    fp8_rows_bf16_kernel(x, rows, k, w, scale, n, y);
  } else {
    int4_rows_bf16_kernel(x, rows, k, w, scale, groups, n, y);
  }
  return true;
#else
  (void)x, (void)rows, (void)k, (void)w, (void)scale, (void)groups, (void)n, (void)y;
  return false;
#endif
}

// The dequantized weight [n, k] in float32, as fused_linear's ATen decomposition computes it
// (float(code) * scale; (float(q) - 8) * scale), bit for bit, into out as out_type: float32 as it
// is, bfloat16 or float16 rounded to nearest even from those floats (ATen's vectorized conversion,
// the rounding of Tensor.to), a row at a time through a row of floats in L1, so that no float32
// block is written and read again. For the rows past the kernels above; called from each thread's
// share of quantized_matmul_cpu.
template <typename Decode>
void dequantize_rows(int64_t n, int64_t k, void* out, at::ScalarType out_type, const Decode& decode) {
  std::vector<float> row(out_type == at::kFloat ? 0 : k);
  for (int64_t j = 0; j < n; ++j) {
    float* o = out_type == at::kFloat ? static_cast<float*>(out) + j * k : row.data();
    decode(j, o);
    if (out_type == at::kBFloat16) {
      at::vec::convert(o, static_cast<at::BFloat16*>(out) + j * k, k);
    } else if (out_type == at::kHalf) {
      at::vec::convert(o, static_cast<at::Half*>(out) + j * k, k);
    }
  }
}

// fp8: each code's float16 pattern (fp8_as_half) is 2^-8 times its value, exactly, and 256 times a
// finite scale is exact too, so pattern x (256 scale) is code x scale rounded once, as the
// decomposition rounds it; a row with a NaN code, or a scale past 2^120, decodes the long way.
void dequantize_fp8(const uint8_t* w, const float* scale, int64_t n, int64_t k, void* out, at::ScalarType out_type) {
  std::vector<uint16_t> halves(k);
  dequantize_rows(n, k, out, out_type, [&](int64_t j, float* o) {
    const float s = scale[j], s256 = s * 256.f;
    if (std::isfinite(s256) && !fp8_as_half(w + j * k, halves.data(), k)) {
      const Vec f(s256);
      int64_t i = 0;
      for (; i + HalfVec::size() <= k; i += HalfVec::size()) {
        const auto [h0, h1] = at::vec::convert_to_float<c10::Half>(HalfVec::loadu(halves.data() + i));
        (h0 * f).store(o + i);
        (h1 * f).store(o + i + Vec::size());
      }
      for (; i < k; ++i) o[i] = half_value(halves[i]) * s256;
      return;
    }
    decode_fp8(w + j * k, o, k);
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) o[i] *= s;
  });
}

void dequantize_int4(const uint8_t* w, const float* scale, int64_t groups, int64_t n, int64_t k, void* out,
                     at::ScalarType out_type) {
  const int64_t half = k / 2, group_bytes = half / groups;
  dequantize_rows(n, k, out, out_type, [&](int64_t j, float* row) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = w + j * half + g * group_bytes;
      float* o = row + g * group_bytes * 2;
      const float s = scale[j * groups + g];
#pragma omp simd
      for (int64_t i = 0; i < group_bytes; ++i) {
        o[2 * i] = (static_cast<float>(b[i] & 15u) - 8.f) * s;
        o[2 * i + 1] = (static_cast<float>(b[i] >> 4) - 8.f) * s;
      }
    }
  });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, fp8_rows, const float*, int64_t, int64_t, const uint8_t*, const float*, int64_t, float*)
CUSTOMOPS_CPU_KERNEL(void, int4_rows, const float*, const float*, int64_t, int64_t, const uint8_t*,
                     const float*, int64_t, int64_t, float*)
CUSTOMOPS_CPU_KERNEL(bool, rows_bf16, const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const float*,
                     int64_t, int64_t, float*)
CUSTOMOPS_CPU_KERNEL(void, dequantize_fp8, const uint8_t*, const float*, int64_t, int64_t, void*, at::ScalarType)
CUSTOMOPS_CPU_KERNEL(void, dequantize_int4, const uint8_t*, const float*, int64_t, int64_t, int64_t, void*,
                     at::ScalarType)

bool quantized_cpu_fit(const at::Tensor& weight, const at::Tensor& weight_scale) {
  if (!weight.is_contiguous() || weight.size(0) == 0 || weight.size(1) == 0) return false;
  if (weight.scalar_type() == at::kFloat8_e4m3fn) return true;
  // int4: a group's inputs are whole bytes
  return weight.scalar_type() == at::kByte && (weight.size(1) * 2 / weight_scale.size(1)) % 2 == 0;
}

at::Tensor quantized_rows_cpu(const at::Tensor& in, const at::Tensor& weight, const at::Tensor& weight_scale) {
  const at::Tensor scale = weight_scale.to(at::kFloat).contiguous();
  const int64_t rows = in.size(0), k = in.size(1), n = weight.size(0);
  // bfloat16 x of 1-8 rows: the CPU's bfloat16 dot products where it has them (rows_bf16 says which)
  // (CUSTOMOPS_CPU_BF16_DOT=0 turns them off, read at each call so that a benchmark can time both)
  const char* dot = std::getenv("CUSTOMOPS_CPU_BF16_DOT");
  if (in.scalar_type() == at::kBFloat16 && rows >= 1 && rows <= 8 && (dot == nullptr || std::string_view(dot) != "0")) {
    const at::Tensor xb = in.contiguous();
    at::Tensor y = at::empty({rows, n}, xb.options().dtype(at::kFloat));
    const int64_t groups = weight.scalar_type() == at::kFloat8_e4m3fn ? 0 : scale.size(1);
    if (CUSTOMOPS_CPU_DISPATCH(rows_bf16, xb.const_data_ptr<at::BFloat16>(), rows, k,
                               static_cast<const uint8_t*>(weight.const_data_ptr()), scale.const_data_ptr<float>(),
                               groups, n, y.mutable_data_ptr<float>())) {
      return y;
    }
  }
  const at::Tensor x = in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  const auto* w = static_cast<const uint8_t*>(weight.const_data_ptr());
  if (weight.scalar_type() == at::kFloat8_e4m3fn) {
    CUSTOMOPS_CPU_DISPATCH(fp8_rows, x.const_data_ptr<float>(), rows, k, w, scale.const_data_ptr<float>(), n,
                           y.mutable_data_ptr<float>());
    return y;
  }
  const int64_t groups = scale.size(1);
  const at::Tensor pairs = x.view({rows, k / 2, 2});
  const at::Tensor xe = pairs.select(2, 0).contiguous(), xo = pairs.select(2, 1).contiguous();
  CUSTOMOPS_CPU_DISPATCH(int4_rows, xe.const_data_ptr<float>(), xo.const_data_ptr<float>(),
                         rows, k, w, scale.const_data_ptr<float>(), groups, n,
                         y.mutable_data_ptr<float>());
  return y;
}

at::Tensor quantized_matmul_cpu(const at::Tensor& in, const at::Tensor& weight, const at::Tensor& weight_scale) {
  // bfloat16 x multiplies in bfloat16 (the dequantized weight rounded to it once, as the CUDA path's
  // int4 prefill does; the product rounded to bfloat16 before bias and residual): BLAS's bfloat16
  // products are several times its float32 ones where the CPU has bfloat16 matrix units. float16's
  // would round a product past 65504 to inf before a bias could bring it back: float32.
  const at::ScalarType dtype = in.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor x = in.to(dtype).contiguous();
  const at::Tensor scale = weight_scale.to(at::kFloat).contiguous();
  const auto* w = static_cast<const uint8_t*>(weight.const_data_ptr());
  const bool fp8 = weight.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0), groups = fp8 ? 1 : scale.size(1);
  const int64_t row_bytes = weight.size(1), x_size = static_cast<int64_t>(x.element_size());
  // Output features a product: up to 512, their rows in x's dtype at most 8 MiB, so that BLAS packs
  // x once for hundreds of features (2048 x 2048 by 64 rows of bfloat16 on a 2-core CPU: 64 features
  // a product took 2.5x one product's time, 512 features 1.07x).
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(512, (8 << 20) / (k * x_size)));
  at::Tensor out_t = at::empty({n, rows}, x.options());  // features x rows: a block of features is a block of rows
  // (every thread takes a share, however few the blocks; each multiplies its share a block at a time)
  const int64_t grain = std::max<int64_t>(1, std::min(block, (n + at::get_num_threads() - 1) / at::get_num_threads()));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    at::Tensor wx = at::empty({std::min(block, end - begin), k}, x.options());  // a block's rows in x's dtype
    for (int64_t j0 = begin; j0 < end; j0 += block) {
      const int64_t nb = std::min(block, end - j0);
      if (fp8) {
        CUSTOMOPS_CPU_DISPATCH(dequantize_fp8, w + j0 * row_bytes, scale.const_data_ptr<float>() + j0, nb, k,
                               wx.data_ptr(), dtype);
      } else {
        CUSTOMOPS_CPU_DISPATCH(dequantize_int4, w + j0 * row_bytes, scale.const_data_ptr<float>() + j0 * groups,
                               groups, nb, k, wx.data_ptr(), dtype);
      }
      at::Tensor o = out_t.narrow(0, j0, nb);
      at::mm_out(o, wx.narrow(0, 0, nb), x.t());
    }
  });
  return out_t.t().to(at::kFloat).contiguous();
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
