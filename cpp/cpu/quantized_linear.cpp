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
// - Many rows (prefill): blocks of output features dequantized to float32, bit for bit as the
//   decomposition does, a row at a time (then rounded to bfloat16 or float16 x's dtype), and
//   multiplied by BLAS, hundreds of features a product.
// Output features are split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/rows.h"

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
    for (int64_t j = begin; j < end; ++j) {
      // (2^8: the float16 patterns' factor, folded into the scale, or taken first where the scale is
      // near float's largest: a product of exact powers of two, so the same rounding either way)
      const float s256 = 256.f * scale[j];
      for (int64_t r = 0; r < rows; ++r) {
        const float sum = sums[r * count + j - begin];
        y[r * n + j] = nan[j - begin]         ? std::numeric_limits<float>::quiet_NaN()
                       : std::isfinite(s256) ? sum * s256
                                             : sum * 256.f * scale[j];
      }
    }
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
  const at::Tensor x = in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  const at::Tensor scale = weight_scale.to(at::kFloat).contiguous();
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
