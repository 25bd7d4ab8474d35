// CPU block kernels of attention (attention_kernels_cpu): the elementwise and row work between a
// block's matmuls (cpp/ops/attention.cpp), one pass each over a block of float32 scores that is in
// cache: the online-softmax step of the forward, the probabilities and the score gradients of the
// backward; and the transposes and row stores around the matmuls. Keys past a row's causal limit
// are never read: their probabilities are written as 0. exp is ATen's exp_u20 (the one its own
// flash attention uses on the CPU: about 1e-6 relative error, below the inputs' float32 rounding
// once summed).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/dispatch.h"
#include "ops/attention.h"

namespace customops {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys of the block row r sees: all n, or up to its causal limit (first_limit + r % m, the last
// visible key's index within the block).
inline int64_t visible(int64_t r, int64_t n, int64_t m, int64_t first_limit) {
  return std::clamp<int64_t>(first_limit + r % m + 1, 0, n);
}

inline float row_max(const float* s, int64_t c) {
  Vec vm(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= c; j += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(s + j));
  float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  for (; j < c; ++j) mx = std::max(mx, s[j]);
  return mx;
}

inline float row_max_negated(const float* s, int64_t c) {  // max of -s: -min(s)
  float mx = kNegInf;
  for (int64_t j = 0; j < c; ++j) mx = std::max(mx, -s[j]);
  return mx;
}

// s[0, c) <- exp(min(a * s - b, 0)), s[c, n) <- 0; returns the sum. b is at least the row's
// largest a * s (its max, or its lse up to rounding): the clamp keeps p <= 1 where it is not. NaN
// stays NaN (exp_u20 alone turns it into a finite number), so a NaN score makes its row NaN, never
// an "empty" row of 0.
inline float exp_row(float* s, int64_t c, int64_t n, float a, float b) {
  const Vec va(a), vb(b), zero(0.f);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= c; j += Vec::size()) {
    const Vec x = at::vec::minimum(Vec::loadu(s + j) * va - vb, zero);
    const Vec p = Vec::blendv(x.exp_u20(), x, x.isnan());
    p.store(s + j);
    acc = acc + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; j < c; ++j) {
    const float x = s[j] * a - b;
    s[j] = std::exp(x > 0.f ? 0.f : x);  // NaN: NaN
    sum += s[j];
  }
  std::fill(s + c, s + n, 0.f);
  return sum;
}

void scale_rows(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float a, float* dst, int64_t ld_dst) {
  const Vec va(a);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * ld_src;
    float* y = dst + r * ld_dst;
    int64_t j = 0;
    for (; j + Vec::size() <= cols; j += Vec::size()) (Vec::loadu(x + j) * va).store(y + j);
    for (; j < cols; ++j) y[j] = x[j] * a;
  }
}

void softmax_step(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                  double scale, float* mx, float* l, float* o, int64_t d) {
  const float sc = static_cast<float>(scale);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const int64_t c = visible(r, n, m, first_limit);
    // max of scale * s over the visible keys (scale may be negative)
    float blk = kNegInf;
    if (c > 0) blk = sc >= 0 ? sc * row_max(row, c) : sc * -row_max_negated(row, c);
    const float m_new = std::max(mx[r], blk);
    const float m_safe = m_new == kNegInf ? 0.f : m_new;
    const float corr = std::exp(mx[r] - m_safe);
    // The compiler may fuse sc * s - m into one rounding, off from the rounded max by up to half
    // its ulp: more than exp's range at |m| > 2^32, where the max's own term would vanish or
    // overflow. Rows that large take the products rounded first, so the max's term is exactly 1.
    float a = sc;
    if (!(std::abs(m_safe) < 0x1p24f)) {
      scale_rows(row, 1, c, ld, sc, row, ld);
      a = 1.f;
    }
    l[r] = l[r] * corr + exp_row(row, c, width, a, m_safe);
    mx[r] = m_new;
    if (o != nullptr && corr != 1.f) scale_rows(o + r * d, 1, d, d, corr, o + r * d, d);
  }
}

void probs(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit, double scale,
           const float* lse) {
  const float sc = static_cast<float>(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = lse[r] == kNegInf ? 0 : visible(r, n, m, first_limit);  // a row with no key: 0
    exp_row(s + r * ld, c, width, sc, lse[r]);
  }
}

void dscores(float* dp, const float* p, int64_t rows, int64_t n, int64_t ld, const float* dt) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dp + r * ld;
    const float* pr = p + r * ld;
    const Vec t(dt[r]);
    int64_t j = 0;
    for (; j + Vec::size() <= n; j += Vec::size()) ((Vec::loadu(d + j) - t) * Vec::loadu(pr + j)).store(d + j);
    for (; j < n; ++j) d[j] = (d[j] - dt[r]) * pr[j];
  }
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  // 16 x 16 tiles in registers (ATen's transpose_mxn), one call per 256-row strip to keep ints small
  for (int64_t r = 0; r < rows; r += 256) {
    for (int64_t c = 0; c < cols; c += 256) {
      at::vec::transpose_mxn<float>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst,
                                    static_cast<int>(std::min<int64_t>(256, rows - r)),
                                    static_cast<int>(std::min<int64_t>(256, cols - c)));
    }
  }
}

void finish_rows(const float* o, int64_t rows, int64_t d, const float* mx, const float* l, float* out, int64_t ld_out,
                 float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + r * ld_out;
    if (l[r] == 0.f) {  // a row that saw no key: out 0, lse -inf (a NaN sum gives NaN below)
      std::fill(y, y + d, 0.f);
      lse[r] = kNegInf;
      continue;
    }
    const float* x = o + r * d;
    const Vec vl(l[r]);
    int64_t j = 0;
    for (; j + Vec::size() <= d; j += Vec::size()) (Vec::loadu(x + j) / vl).store(y + j);
    for (; j < d; ++j) y[j] = x[j] / l[r];
    lse[r] = mx[r] + std::log(l[r]);
  }
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, softmax_step, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, float*,
                     float*, float*, int64_t)
CUSTOMOPS_CPU_KERNEL(void, probs, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, const float*)
CUSTOMOPS_CPU_KERNEL(void, dscores, float*, const float*, int64_t, int64_t, int64_t, const float*)
CUSTOMOPS_CPU_KERNEL(void, transpose, const float*, int64_t, int64_t, int64_t, float*, int64_t)
CUSTOMOPS_CPU_KERNEL(void, scale_rows, const float*, int64_t, int64_t, int64_t, float, float*, int64_t)
CUSTOMOPS_CPU_KERNEL(void, finish_rows, const float*, int64_t, int64_t, const float*, const float*, float*, int64_t,
                     float*)

namespace {
void softmax_step_cpu(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                      double scale, float* mx, float* l, float* o, int64_t d) {
  CUSTOMOPS_CPU_DISPATCH(softmax_step, s, rows, n, width, ld, m, first_limit, scale, mx, l, o, d);
}
void probs_cpu(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
               double scale, const float* lse) {
  CUSTOMOPS_CPU_DISPATCH(probs, s, rows, n, width, ld, m, first_limit, scale, lse);
}
void dscores_cpu(float* dp, const float* p, int64_t rows, int64_t n, int64_t ld, const float* dt) {
  CUSTOMOPS_CPU_DISPATCH(dscores, dp, p, rows, n, ld, dt);
}
void transpose_cpu(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  CUSTOMOPS_CPU_DISPATCH(transpose, src, rows, cols, ld_src, dst, ld_dst);
}
void scale_rows_cpu(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float a, float* dst,
                    int64_t ld_dst) {
  CUSTOMOPS_CPU_DISPATCH(scale_rows, src, rows, cols, ld_src, a, dst, ld_dst);
}
void finish_rows_cpu(const float* o, int64_t rows, int64_t d, const float* mx, const float* l, float* out,
                     int64_t ld_out, float* lse) {
  CUSTOMOPS_CPU_DISPATCH(finish_rows, o, rows, d, mx, l, out, ld_out, lse);
}
}  // namespace

const AttentionCpuKernels& attention_kernels_cpu() {
  static const AttentionCpuKernels k{&softmax_step_cpu, &probs_cpu,      &dscores_cpu,
                                     &transpose_cpu,    &scale_rows_cpu, &finish_rows_cpu};
  return k;
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
