// CPU kernels of attention and _attention_backward. float32, bfloat16 and float16 inputs run flash
// attention on raw pointers (forward_cpu, backward_cpu; float32 matmuls of blocks through oneDNN's
// brgemm), in parallel over (batch, kv head, query block) in the forward and (batch, kv head) in
// the backward; float64 takes the blocked ATen kernels (cpp/ops/attention_blocked.cpp).
//
// The block kernels (attention_kernels_cpu), compiled per instruction set, do the elementwise and
// row work between a block's matmuls, one pass each over a block of float32 scores that is in
// cache: the online-softmax step of the forward, the probabilities and the score gradients of the
// backward; and the transposes and row stores around the matmuls. Keys past a row's causal limit
// are never read: their probabilities are written as 0. exp is ATen's exp_u20 (the one its own
// flash attention uses on the CPU: about 1e-6 relative error, below the inputs' float32 rounding
// once summed).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "cpu/dispatch.h"
#include "ops/attention.h"
#include "ops/layout.h"

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

// The block kernels above, on float32 blocks of scores [rows, n] with row stride ld, written out
// to width >= n columns (the ones past n as 0: the padding of the block's matmuls). Row r of a
// block stacks a group's query rows (m of them, repeated per query head); it sees the block's keys
// up to index first_limit + r % m (its causal limit; any n - 1 or more means all of them).
struct AttentionCpuKernels {
  // Online-softmax step, in place: s <- exp(scale * s - m_new) over the visible keys, 0 past them;
  // per row, mx (running max of scale * s) and l (running sum) updated, and the row of o ([rows, d],
  // the output so far; null: none yet) multiplied by exp(mx_old - m_new) (0 where the row saw no
  // key before).
  void (*softmax_step)(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                       double scale, float* mx, float* l, float* o, int64_t d);
  // s <- exp(scale * s - lse) over the visible keys, 0 past them and in rows with lse -inf.
  void (*probs)(float* s, int64_t rows, int64_t n, int64_t width, int64_t ld, int64_t m, int64_t first_limit,
                double scale, const float* lse);
  // dp <- p * (dp - dt[r]), the scores' gradient (dt: rowsum(grad_out * out) - grad_lse).
  void (*dscores)(float* dp, const float* p, int64_t rows, int64_t n, int64_t ld, const float* dt);
  // dst[c, r] <- src[r, c] for a [rows, cols] src.
  void (*transpose)(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst);
  // dst <- a * src, [rows, cols] (in place when dst is src).
  void (*scale_rows)(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float a, float* dst,
                     int64_t ld_dst);
  // The forward's last step: out <- o / l and lse <- mx + log(l) per row; out 0 and lse -inf in rows
  // that saw no key (l = 0). o is [rows, d] dense.
  void (*finish_rows)(const float* o, int64_t rows, int64_t d, const float* mx, const float* l, float* out,
                      int64_t ld_out, float* lse);
};

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

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using attention_blocked::Blocks;
using attention_blocked::parallel_tasks;

const AttentionCpuKernels& attention_kernels_cpu() {
  static const AttentionCpuKernels k{&softmax_step_cpu, &probs_cpu,      &dscores_cpu,
                                     &transpose_cpu,    &scale_rows_cpu, &finish_rows_cpu};
  return k;
}

// ---- the CPU kernels for float32 accumulation (float32, bfloat16 and float16 inputs) -------------
// Flash attention on raw pointers: per task, float32 matmuls of blocks through oneDNN's brgemm
// micro-kernel (ATen's cpublas::brgemm), the work between them in one vectorized pass
// (attention_kernels_cpu), scratch allocated once per thread and call, no ATen op inside a task.
// On the AMD EPYC (Zen 5) of docs/benchmarks.md, one thread, brgemm runs this file's block shapes
// at 220-260 GFLOP/s where MKL's sgemm (at::mm, and SDPA's CPU flash kernel) runs 100: MKL takes
// its AVX2 path on AMD CPUs, oneDNN picks its AVX-512 one from the CPU's features. Every matmul,
// bfloat16 inputs' included, is float32 (a bfloat16 brgemm needs VNNI-packed operands and AVX-512).
// Each matmul's B operand is row-major [K, N], so k^T and v^T (for the scores and their
// gradients) are transposed copies made once per call, and the backward accumulates dk^T = q^T ds
// and dv^T = dout^T p (A = the transposed query block, made once per block) and transposes them
// once at the end. Against the blocked ATen kernels (at::mm on tensors, MKL) at [2, 8, 1024, 64]
// float32 on the 2-core EPYC: forward 24.7 -> 11.9 ms, forward and backward 86.4 -> 37.8 ms (SDPA
// 23.6 and 85.2 ms); bfloat16 18.3 -> 11.8 ms and 58.3 -> 41.6 ms.

// A torch without cpublas's float32 brgemm (its header defines this macro where it has one) builds
// without these kernels: its CPU inputs take the blocked ATen kernels
// (cpp/ops/attention_blocked.cpp).
#ifdef CPUBLAS_BRGEMM_F32F32F32
constexpr bool kCpuKernels = true;
#else
constexpr bool kCpuKernels = false;
#endif

// C[m, n] (+)= A[m, k] B[k, n], row-major float32 with leading dims (MKL's sgemm when oneDNN is
// disabled: cpublas::brgemm falls back to it).
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool add) {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
#else
  TORCH_INTERNAL_ASSERT(false, "customops::attention: CPU kernels built without cpublas::brgemm");
#endif
}

// t ([B, H, S, D]) in float32 with a unit last stride and rows at least D apart (brgemm's leading
// dim): t itself when it is one already.
at::Tensor float_rows(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat);
  return (f.stride(3) == 1 || f.size(3) == 1) && f.stride(2) >= f.size(3) ? f : f.contiguous();
}

// Where a kernel writes out's values: out itself when it is float32 with a unit last stride, else a
// float32 buffer that is copied into out at the end.
at::Tensor float_out(const at::Tensor& out) {
  if (out.scalar_type() == at::kFloat && out.stride(3) == 1) return out;
  return at::empty(out.sizes(), out.options().dtype(at::kFloat));
}

// Rows of a float32 [B, H, S, D] tensor with a unit last stride.
struct Rows {
  float* p;
  int64_t sb, sh, ss;
  explicit Rows(const at::Tensor& t) : p(t.data_ptr<float>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)) {}
  float* at(int64_t b, int64_t h, int64_t i) const { return p + b * sb + h * sh + i * ss; }
};

// As parallel_tasks, fn(task, scratch) with scratch floats of each worker's own, allocated once per
// worker and call.
template <typename Fn>
void parallel_tasks_scratch(int64_t n, int64_t scratch, Fn&& fn) {
  const at::ThreadLocalState state;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard tls(state);
    const at::Tensor buf = at::empty({scratch}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t task = begin; task < end; ++task) fn(task, buf.data_ptr<float>());
  });
}

// The CPU kernels' blocks: query rows per head (a block stacks the G heads' rows) and keys. On the
// EPYC at [2, 8, 1024, 64] float32, without a mask 64 to 256 rows and 256 to 1024 keys are within
// 1% of each other in the forward, and 256 x 512 is 1-7% ahead in the backward (a longer K for
// dk^T and dv^T); causal, 64 rows are 7-13% ahead of 256 in both (less of each diagonal block is
// computed only to be masked).
struct CpuTiling {
  int64_t rows, keys;
};
CpuTiling cpu_tiling(int64_t g, bool causal) { return {std::max<int64_t>(1, (causal ? 64 : 256) / g), 512}; }

// brgemm JIT-compiles a kernel per shape and leading dims, about 0.2 ms each, and keeps them per
// thread: a decoding loop whose Sk grows by one each step compiled new kernels at every step (0.5
// ms a call where the call itself took 0.13). So no leading dim depends on Sk (k^T, v^T, dk^T and
// dv^T are stored per key block, [D, keys] each), and a block's matmuls cover its keys rounded up
// to a multiple of 16, the padding's probabilities 0: at most keys / 16 tails per shape.
int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

int64_t first_limit(const Blocks& blk, int64_t j0, int64_t n) {
  return blk.causal ? blk.i0 + blk.shift() - j0 : n;
}

// x ([B, H, S, D], contiguous) transposed per key block, float32 [B, H, S / keys, D, keys] (the
// last block's missing keys 0): the B operand of q k^T and dout v^T.
at::Tensor transposed_blocks(const at::Tensor& x, int64_t keys) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t s = x.size(2), d = x.size(3), blocks = (s + keys - 1) / keys;
  at::Tensor xt = at::empty({x.size(0), x.size(1), blocks, d, keys}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = xt.data_ptr<float>();
  const auto& kern = attention_kernels_cpu();
  parallel_tasks(x.size(0) * x.size(1) * blocks, [&](int64_t task) {
    const int64_t p = task / blocks, j0 = (task % blocks) * keys, n = std::min(keys, s - j0);
    float* out = dst + task * d * keys;
    kern.transpose(src + (p * s + j0) * d, n, d, d, out, keys);
    for (int64_t i = 0; n < keys && i < d; ++i) std::fill(out + i * keys + n, out + (i + 1) * keys, 0.f);
  });
  return xt;
}

// Rows [j0, j0 + width) of x ([S, D] dense float32): x's own when it has them, else a copy in tail
// with the rows past S 0 (the B operand of a padded block's p v and ds k).
const float* rows_padded(const float* x, int64_t s, int64_t d, int64_t j0, int64_t width, float* tail) {
  if (j0 + width <= s) return x + j0 * d;
  std::copy(x + j0 * d, x + s * d, tail);
  std::fill(tail + (s - j0) * d, tail + width * d, 0.f);
  return tail;
}

// out and lse (fresh, contiguous float32) of attention for D > 0; k and v contiguous.
void forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                 const at::Tensor& out, const at::Tensor& lse) {
  const auto& kern = attention_kernels_cpu();
  const int64_t hq = q.size(1), sq = q.size(2), d = q.size(3), hkv = k.size(1), sk = k.size(2), g = hq / hkv;
  const CpuTiling t = cpu_tiling(g, causal);
  const int64_t kblocks = (sk + t.keys - 1) / t.keys;
  const at::Tensor qf = float_rows(q), kt = transposed_blocks(k, t.keys), vf = v.to(at::kFloat).contiguous();
  const at::Tensor of = float_out(out);
  const Rows qr(qf), outr(of);
  const float *kt0 = kt.data_ptr<float>(), *v0 = vf.data_ptr<float>();
  float* lse0 = lse.data_ptr<float>();
  const int64_t rows_max = g * t.rows, chunks = (sq + t.rows - 1) / t.rows;
  const int64_t scratch = rows_max * (t.keys + d + 2) + t.keys * d;
  parallel_tasks_scratch(q.size(0) * hkv * chunks, scratch, [&](int64_t task, float* buf) {
    const int64_t c = task % chunks, pair = task / chunks, h = pair % hkv, b = pair / hkv;
    const int64_t i0 = c * t.rows, m = std::min(t.rows, sq - i0), rows = g * m;
    float *s = buf, *o = s + rows_max * t.keys, *mx = o + rows_max * d, *l = mx + rows_max, *tail = l + rows_max;
    std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    const Blocks blk{i0, sq, sk, causal, scale, t.keys};
    const int64_t end = blk.key_end(m);
    for (int64_t j0 = 0; j0 < end; j0 += t.keys) {
      const int64_t n = std::min(t.keys, end - j0), w = padded(n);
      const float* ktb = kt0 + (pair * kblocks + j0 / t.keys) * d * t.keys;
      for (int64_t gi = 0; gi < g; ++gi) {
        gemm(m, w, d, qr.at(b, h * g + gi, i0), qr.ss, ktb, t.keys, s + gi * m * t.keys, t.keys, false);
      }
      kern.softmax_step(s, rows, n, w, t.keys, m, first_limit(blk, j0, n), scale, mx, l, j0 > 0 ? o : nullptr, d);
      gemm(rows, d, w, s, t.keys, rows_padded(v0 + pair * sk * d, sk, d, j0, w, tail), d, o, d, j0 > 0);
    }
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t hh = h * g + gi;
      kern.finish_rows(o + gi * m * d, m, d, mx + gi * m, l + gi * m, outr.at(b, hh, i0), outr.ss,
                       lse0 + (b * hq + hh) * sq + i0);
    }
  });
  if (!of.is_same(out)) out.copy_(of);
}

// dq, dk and dv of attention (go: grad_out; dterm = rowsum(grad_out * out) - grad_lse, float32);
// q and k non-empty, k and v contiguous.
void backward_cpu(const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& dterm, const at::Tensor& lse, bool causal, double scale, const at::Tensor& dq,
                  const at::Tensor& dk, const at::Tensor& dv) {
  const auto& kern = attention_kernels_cpu();
  const int64_t nb = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), hkv = k.size(1), sk = k.size(2);
  const int64_t g = hq / hkv;
  const CpuTiling t = cpu_tiling(g, causal);
  const int64_t kblocks = (sk + t.keys - 1) / t.keys, block_size = d * t.keys;
  const at::Tensor qf = float_rows(q), gof = float_rows(go), kf = k.to(at::kFloat).contiguous();
  const at::Tensor kt = transposed_blocks(kf, t.keys), vt = transposed_blocks(v, t.keys);
  const at::Tensor lsec = lse.contiguous(), dtc = dterm.to(at::kFloat).contiguous();
  const at::Tensor dqf = float_out(dq), dkf = float_out(dk), dvf = float_out(dv);
  at::Tensor dkt = at::empty_like(kt), dvt = at::empty_like(kt);  // dk^T and dv^T, blocked as kt
  const Rows qr(qf), gor(gof), dqr(dqf), dkr(dkf), dvr(dvf);
  const float *kt0 = kt.data_ptr<float>(), *vt0 = vt.data_ptr<float>(), *k0 = kf.data_ptr<float>();
  const float *lse0 = lsec.data_ptr<float>(), *dt0 = dtc.data_ptr<float>();
  float *dkt0 = dkt.data_ptr<float>(), *dvt0 = dvt.data_ptr<float>();
  const int64_t rows_max = g * t.rows;
  const int64_t scratch = rows_max * (2 * t.keys + 3 * d + 2) + t.keys * d;

  // Query rows [r, r + m) of (b, kv head h) against keys [j_from, j_to) (whole blocks): dq's rows
  // (want_dq) and the keys' share of dk^T and dv^T (want_dkv).
  auto block = [&](int64_t b, int64_t h, int64_t r, int64_t m, int64_t j_from, int64_t j_to, bool want_dq,
                   bool want_dkv, float* buf) {
    const int64_t rows = g * m, pair = b * hkv + h;
    float *p = buf, *ds = p + rows_max * t.keys, *qt = ds + rows_max * t.keys, *got = qt + rows_max * d;
    float *dqa = got + rows_max * d, *lse_b = dqa + rows_max * d, *dt_b = lse_b + rows_max, *tail = dt_b + rows_max;
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t i = (b * hq + h * g + gi) * sq + r;
      std::copy(lse0 + i, lse0 + i + m, lse_b + gi * m);
      std::copy(dt0 + i, dt0 + i + m, dt_b + gi * m);
      if (want_dkv) {
        kern.transpose(qr.at(b, h * g + gi, r), m, d, qr.ss, qt + gi * m, rows);
        kern.transpose(gor.at(b, h * g + gi, r), m, d, gor.ss, got + gi * m, rows);
      }
    }
    Blocks blk{r, sq, sk, causal, scale, t.keys};
    blk.keys_to = j_to;
    const int64_t end = blk.key_end(m);
    for (int64_t j0 = j_from; j0 < end; j0 += t.keys) {
      const int64_t n = std::min(t.keys, end - j0), w = padded(n), kb = (pair * kblocks + j0 / t.keys) * block_size;
      for (int64_t gi = 0; gi < g; ++gi) {
        gemm(m, w, d, qr.at(b, h * g + gi, r), qr.ss, kt0 + kb, t.keys, p + gi * m * t.keys, t.keys, false);
        gemm(m, w, d, gor.at(b, h * g + gi, r), gor.ss, vt0 + kb, t.keys, ds + gi * m * t.keys, t.keys, false);
      }
      kern.probs(p, rows, n, w, t.keys, m, first_limit(blk, j0, n), scale, lse_b);
      kern.dscores(ds, p, rows, w, t.keys, dt_b);  // 0 in the padding (p 0 there, dout v^T finite)
      if (want_dq) {
        gemm(rows, d, w, ds, t.keys, rows_padded(k0 + pair * sk * d, sk, d, j0, w, tail), d, dqa, d, j0 > j_from);
      }
      if (want_dkv) {
        gemm(d, w, rows, qt, rows, ds, t.keys, dkt0 + kb, t.keys, true);
        gemm(d, w, rows, got, rows, p, t.keys, dvt0 + kb, t.keys, true);
      }
    }
    if (want_dq) {
      if (end <= j_from) std::fill(dqa, dqa + rows * d, 0.f);
      for (int64_t gi = 0; gi < g; ++gi) {
        kern.scale_rows(dqa + gi * m * d, m, d, d, static_cast<float>(scale), dqr.at(b, h * g + gi, r), dqr.ss);
      }
    }
  };
  // A pair's key blocks [kb0, kb1) of dk^T and dv^T: zeroed before, written to dk (times scale)
  // and dv after.
  auto zero_keys = [&](int64_t pair, int64_t kb0, int64_t kb1) {
    std::fill(dkt0 + (pair * kblocks + kb0) * block_size, dkt0 + (pair * kblocks + kb1) * block_size, 0.f);
    std::fill(dvt0 + (pair * kblocks + kb0) * block_size, dvt0 + (pair * kblocks + kb1) * block_size, 0.f);
  };
  auto store_keys = [&](int64_t pair, int64_t kb0, int64_t kb1) {
    const int64_t b = pair / hkv, h = pair % hkv;
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t j0 = kb * t.keys, n = std::min(t.keys, sk - j0), at = (pair * kblocks + kb) * block_size;
      kern.transpose(dkt0 + at, d, n, t.keys, dkr.at(b, h, j0), dkr.ss);
      kern.scale_rows(dkr.at(b, h, j0), n, d, dkr.ss, static_cast<float>(scale), dkr.at(b, h, j0), dkr.ss);
      kern.transpose(dvt0 + at, d, n, t.keys, dvr.at(b, h, j0), dvr.ss);
    }
  };

  // Every query row of a kv head adds to its dk and dv. With at least as many (batch, kv head) pairs
  // as threads, a task owns a pair and writes its dq, dk and dv in one pass over the blocks. With
  // fewer, two passes keep every thread busy: dk and dv per (pair, key block), then dq per (pair,
  // query block), recomputing the probabilities (7 matmuls a block instead of 5).
  const int64_t pairs = nb * hkv, qblocks = (sq + t.rows - 1) / t.rows;
  if (pairs >= at::get_num_threads()) {
    parallel_tasks_scratch(pairs, scratch, [&](int64_t pair, float* buf) {
      zero_keys(pair, 0, kblocks);
      for (int64_t r = 0; r < sq; r += t.rows) {
        block(pair / hkv, pair % hkv, r, std::min(t.rows, sq - r), 0, sk, true, true, buf);
      }
      store_keys(pair, 0, kblocks);
    });
  } else {
    parallel_tasks_scratch(pairs * kblocks, scratch, [&](int64_t task, float* buf) {
      const int64_t pair = task / kblocks, kb = task % kblocks;
      zero_keys(pair, kb, kb + 1);
      for (int64_t r = 0; r < sq; r += t.rows) {
        block(pair / hkv, pair % hkv, r, std::min(t.rows, sq - r), kb * t.keys, (kb + 1) * t.keys, false, true, buf);
      }
      store_keys(pair, kb, kb + 1);
    });
    parallel_tasks_scratch(pairs * qblocks, scratch, [&](int64_t task, float* buf) {
      const int64_t pair = task / qblocks, r = (task % qblocks) * t.rows;
      block(pair / hkv, pair % hkv, r, std::min(t.rows, sq - r), 0, sk, true, false, buf);
    });
  }
  if (!dqf.is_same(dq)) dq.copy_(dqf);
  if (!dkf.is_same(dk)) dk.copy_(dkf);
  if (!dvf.is_same(dv)) dv.copy_(dvf);
}

// ---- entry points: the kernels above for float32 accumulation, the blocked ATen kernels else -----
Pair attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                   std::optional<double> scale_opt) {
  check_attention("customops::attention", q, k, v);
  auto [out, lse] = attention_outputs(q);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const double scale = attention_scale(scale_opt, q.size(3));
  if (kCpuKernels && lse.scalar_type() == at::kFloat && q.size(3) > 0) {
    forward_cpu(q, k.contiguous(), v.contiguous(), causal, scale, out, lse);
  } else {
    attention_blocked::forward(q, k, v, causal, scale, out, lse);
  }
  return {out, lse};
}

Triple attention_backward_cpu(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, bool causal, std::optional<double> scale_opt) {
  check_attention_backward(grad_out, grad_lse, q, k, v, out, lse);
  const double scale = attention_scale(scale_opt, q.size(3));
  at::Tensor dq = heads_layout_like(q), dk = heads_layout_like(k), dv = heads_layout_like(v);
  const at::Tensor go = grad_out.has_value() && grad_out->defined() ? *grad_out : at::zeros_like(q);
  const at::Tensor dterm = attention_dterm(grad_out, grad_lse, out, lse);
  if (kCpuKernels && lse.scalar_type() == at::kFloat && q.numel() > 0 && k.numel() > 0) {
    backward_cpu(go, q, k.contiguous(), v.contiguous(), dterm, lse, causal, scale, dq, dk, dv);
  } else {
    attention_blocked::backward(go, q, k, v, dterm, lse, causal, scale, dq, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace

// CPU kernels of attention.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("_attention_backward", &attention_backward_cpu);
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
