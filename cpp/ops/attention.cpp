// attention, _attention_backward and merge_attention: typed C++ API, the CPU and CUDA kernels,
// Meta, Autograd, vmap and autocast kernels.
//
// attention returns the rows' log-sum-exp as an output (background 000's running example): the
// backward reuses it instead of recomputing softmax statistics, and it is differentiable
// (d lse_i / d s_ij = p_ij), which merging partial attentions needs.
//
// The kernels here are blocked ("flash") attention: scores of a block of query rows against a
// block of keys, an online softmax across key blocks, and no [Sq, Sk] matrix ever: extra memory is
// one block of scores. Grouped-query attention reads k and v once per group of query heads (the
// group's rows are stacked, k is never repeated). On the CPU, float32, bfloat16 and float16 run
// on raw pointers: float32 matmuls of blocks through oneDNN's brgemm micro-kernel, the softmax
// work between them in one vectorized pass (cpp/cpu/attention.cpp), in parallel over (batch, kv
// head, query block) in the forward and (batch, kv head) in the backward. The other inputs
// (float64, CUDA without the fused kernels) take ATen ops on blocks (at::matmul, so MKL on the CPU
// and cuBLAS tensor cores on CUDA); on CUDA each step covers every batch entry and head at once,
// over query chunks sized to keep the scores under 256 MiB. On CUDA, float16 and bfloat16 with
// head dims 64 and 128 go to the fused tensor-core kernels instead (cuda/attention.cu, scores kept
// in registers); the blocked ATen kernels are their reference and take every other input.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "customops/customops.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/layout.h"
#include "ops/llm.h"

namespace customops {
namespace {

using torch::autograd::variable_list;
using Pair = std::tuple<at::Tensor, at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using AttentionSig = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, std::optional<double>);
using AttentionBackwardSig = Triple(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, bool, std::optional<double>);

const auto& attention_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("customops::attention", "").typed<AttentionSig>();
  return op;
}

const auto& attention_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_attention_backward", "")
                       .typed<AttentionBackwardSig>();
  return op;
}

const auto& merge_attention_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::merge_attention", "")
                       .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

// 1/sqrt(D) unless given; 1 for D = 0 (every score is 0 then).
double resolve_scale(std::optional<double> scale, int64_t d) {
  return scale.has_value() ? *scale : (d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool causal, std::optional<double> scale) {
  return attention_op().call(q, k, v, causal, scale);
}

std::tuple<at::Tensor, at::Tensor> merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                   const at::Tensor& out_b, const at::Tensor& lse_b) {
  return merge_attention_op().call(out_a, lse_a, out_b, lse_b);
}

namespace {

// ---- the blocked kernels ------------------------------------------------------------------------
// Tensors come grouped: q, out and their gradients as [B', Hkv', G, M, D] (G query heads per kv
// head, M query rows starting at row i0 of Sq), k and v as [B', Hkv', Sk, D], lse-shaped ones as
// [B', Hkv', G, M]. Query row i sees key j when j <= i + Sk - Sq (causal; bottom-right aligned).
struct Blocks {
  int64_t i0, sq, sk;
  bool causal;
  double scale;
  int64_t block_k;
  int64_t keys_from = 0, keys_to = std::numeric_limits<int64_t>::max();  // the keys to go over

  int64_t shift() const { return sk - sq; }
  // The keys [keys_from, end) that some row of the block sees.
  int64_t key_end(int64_t m) const {
    return std::min(causal ? std::clamp<int64_t>(i0 + m + shift(), 0, sk) : sk, keys_to);
  }
  // s ([B', Hkv', G * M, N], keys from j0) with the keys a row must not see at -inf.
  void mask(at::Tensor& s, int64_t m, int64_t j0) const {
    const int64_t n = s.size(-1);
    if (!causal || j0 + n - 1 <= i0 + shift()) return;  // every row sees every key of the block
    const auto opts = at::TensorOptions().device(s.device()).dtype(at::kLong);
    const at::Tensor rows = at::arange(i0 + shift(), i0 + shift() + m, opts).unsqueeze(-1);
    const at::Tensor hidden = at::arange(j0, j0 + n, opts).unsqueeze(0) > rows;  // [M, N]
    s.view({s.size(0), s.size(1), -1, m, n}).masked_fill_(hidden, -kInf);
  }
};

// Forward over one block of query rows: writes out ([B', Hkv', G, M, D], q's dtype) and lse.
void forward_rows(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v, const Blocks& blk,
                  const at::Tensor& out, const at::Tensor& lse) {
  const at::ScalarType acc = attention_lse_dtype(qg.scalar_type());
  const int64_t m = qg.size(3), d = qg.size(4);
  const at::Tensor qs = qg.to(acc).flatten(2, 3);  // [B', Hkv', G*M, D]
  const auto rows = qs.sizes().slice(0, 3);
  at::Tensor mx = at::full(rows, -kInf, qs.options()), l = at::zeros(rows, qs.options());
  at::Tensor o = at::zeros({rows[0], rows[1], rows[2], d}, qs.options());
  const int64_t end = blk.key_end(m);
  for (int64_t j0 = 0; j0 < end; j0 += blk.block_k) {
    const int64_t n = std::min(blk.block_k, end - j0);
    const at::Tensor kb = k.narrow(2, j0, n).to(acc), vb = v.narrow(2, j0, n).to(acc);
    // [B', Hkv', G*M, N], scaled after the matmul (as the fused kernels do): q * scale would
    // differ where the scale is infinite (inf - inf in the dot product) or D is 0 (0 * NaN)
    at::Tensor s = at::matmul(qs, kb.transpose(-2, -1)).mul_(blk.scale);
    blk.mask(s, m, j0);
    const at::Tensor mx_new = at::maximum(mx, s.amax(-1));
    const at::Tensor mx_safe = mx_new.masked_fill(mx_new == -kInf, 0);  // rows that saw no key yet
    s.sub_(mx_safe.unsqueeze(-1)).exp_();                              // p, 0 where masked
    const at::Tensor corr = (mx - mx_safe).exp_();                      // 0 for a row's first keys
    l.mul_(corr).add_(s.sum(-1));
    o.mul_(corr.unsqueeze(-1)).add_(at::matmul(s, vb));
    mx = mx_new;
  }
  // A row that saw no key: out 0, lse -inf. A NaN sum is not one: NaN scores give NaN rows.
  const at::Tensor seen = l != 0;
  out.copy_(at::where(seen.unsqueeze(-1), o / l.masked_fill(~seen, 1).unsqueeze(-1), 0).view(out.sizes()));
  lse.copy_((mx.masked_fill(~seen, 0) + l.log()).view(lse.sizes()));
}

// Backward over one block of query rows and the keys [blk.keys_from, key_end): writes dq and adds
// the block's share to dk (before its scale) and dv (float accumulators [B', Hkv', Sk, D]); dq
// undefined: only dk and dv; dk_acc undefined: only dq. dterm = rowsum(grad_out * out) - grad_lse.
void backward_rows(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gog,
                   const at::Tensor& dterm, const at::Tensor& lse, const Blocks& blk, const at::Tensor& dq,
                   const at::Tensor& dk_acc, const at::Tensor& dv_acc) {
  const at::ScalarType acc = attention_lse_dtype(qg.scalar_type());
  const int64_t m = qg.size(3);
  const at::Tensor qa = qg.to(acc).flatten(2, 3), go = gog.to(acc).flatten(2, 3);  // [B', Hkv', G*M, D]
  const at::Tensor lse_r = lse.flatten(2, 3).masked_fill(lse.flatten(2, 3) == -kInf, kInf).unsqueeze(-1);
  const at::Tensor dt = dterm.flatten(2, 3).unsqueeze(-1);
  const bool want_dq = dq.defined(), want_dkv = dk_acc.defined();
  at::Tensor dqa = want_dq ? at::zeros_like(qa) : at::Tensor();
  const int64_t end = blk.key_end(m);
  for (int64_t j0 = blk.keys_from; j0 < end; j0 += blk.block_k) {
    const int64_t n = std::min(blk.block_k, end - j0);
    const at::Tensor kb = k.narrow(2, j0, n).to(acc), vb = v.narrow(2, j0, n).to(acc);
    at::Tensor p = at::matmul(qa, kb.transpose(-2, -1)).mul_(blk.scale);
    blk.mask(p, m, j0);
    // 0 where masked and in rows that saw no key (lse -inf); at most 1 where a huge lse's rounding
    // leaves a score above it
    p.sub_(lse_r).clamp_max_(0).exp_();
    at::Tensor ds = at::matmul(go, vb.transpose(-2, -1)).sub_(dt).mul_(p);
    if (want_dq) dqa.add_(at::matmul(ds, kb));
    if (want_dkv) {
      dk_acc.narrow(2, j0, n).add_(at::matmul(ds.transpose(-2, -1), qa));  // sums the group's rows
      dv_acc.narrow(2, j0, n).add_(at::matmul(p.transpose(-2, -1), go));
    }
  }
  if (want_dq) dq.copy_(dqa.mul_(blk.scale).view(dq.sizes()));
}

// Rows per query block and keys per key block of forward_rows and backward_rows. CPU (float64): a
// block's scores (G * 256 x 512) stay in cache. CUDA: every batch entry and head at once, query
// chunks keeping the scores under 256 MiB.
struct Tiling {
  int64_t rows, keys;
};
Tiling tiling(const at::Tensor& q, int64_t sk) {
  if (q.is_cpu()) return {256, 512};
  const int64_t keys = std::max<int64_t>(1, std::min<int64_t>(sk, 4096));
  const int64_t per_row = std::max<int64_t>(1, q.size(0) * q.size(1) * keys * 4);
  return {std::clamp<int64_t>((int64_t{256} << 20) / per_row, 1, std::max<int64_t>(q.size(2), 1)), keys};
}

// fn(task) for task in [0, n) in parallel on the CPU. The ATen calls of a task must dispatch as
// this thread's do (below autograd): worker threads take this thread's dispatch-key and
// grad-mode state.
template <typename Fn>
void parallel_tasks(int64_t n, Fn&& fn) {
  const at::ThreadLocalState state;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard tls(state);
    for (int64_t task = begin; task < end; ++task) fn(task);
  });
}

// Runs fn(b, h, i0, rows) over (batch, kv head, query block) tasks: on the CPU in parallel, each
// task's ATen calls on one thread; on CUDA over whole batches and heads at once (b = h = -1),
// query block after query block.
template <typename Fn>
void for_blocks(const at::Tensor& q, int64_t hkv, int64_t sq, const Tiling& t, Fn&& fn) {
  if (!q.is_cpu()) {
    for (int64_t i0 = 0; i0 < sq; i0 += t.rows) fn(-1, -1, i0, std::min(t.rows, sq - i0));
    return;
  }
  const int64_t chunks = (sq + t.rows - 1) / t.rows;
  parallel_tasks(q.size(0) * hkv * chunks, [&](int64_t task) {
    const int64_t c = task % chunks, h = (task / chunks) % hkv, b = task / (chunks * hkv);
    fn(b, h, c * t.rows, std::min(t.rows, sq - c * t.rows));
  });
}

// t's slice for task (b, h) along dims 0 and 1 (the whole of them when b = -1).
at::Tensor task_slice(const at::Tensor& t, int64_t b, int64_t h) {
  return b < 0 ? t : t.narrow(0, b, 1).narrow(1, h, 1);
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
// without these kernels: its CPU inputs take the blocked ATen kernels above.
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

Pair attention_device(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in, bool causal,
                      std::optional<double> scale_opt) {
  check_attention("customops::attention", q, k_in, v_in);
  const int64_t hq = q.size(1), sq = q.size(2), d = q.size(3), hkv = k_in.size(1), sk = k_in.size(2);
  at::Tensor out = heads_layout_like(q);
  at::Tensor lse = at::empty({q.size(0), hq, sq}, q.options().dtype(attention_lse_dtype(q.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const double scale = resolve_scale(scale_opt, d);
#ifdef CUSTOMOPS_WITH_CUDA
  if (q.is_cuda() && attention_cuda_fused(q, scale)) {
    attention_fwd_cuda(q, k_in, v_in, causal, scale, out, lse);
    return {out, lse};
  }
#endif
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  if (kCpuKernels && q.is_cpu() && attention_lse_dtype(q.scalar_type()) == at::kFloat && d > 0) {
    forward_cpu(q, k, v, causal, scale, out, lse);
    return {out, lse};
  }
  const at::Tensor qg = q.unflatten(1, {hkv, hq / hkv}), outg = out.unflatten(1, {hkv, hq / hkv});
  const at::Tensor lseg = lse.unflatten(1, {hkv, hq / hkv});
  const Tiling t = tiling(q, sk);
  for_blocks(q, hkv, sq, t, [&](int64_t b, int64_t h, int64_t i0, int64_t m) {
    const Blocks blk{i0, sq, sk, causal, scale, t.keys};
    forward_rows(task_slice(qg, b, h).narrow(3, i0, m), task_slice(k, b, h), task_slice(v, b, h), blk,
                 task_slice(outg, b, h).narrow(3, i0, m), task_slice(lseg, b, h).narrow(3, i0, m));
  });
  return {out, lse};
}

Triple attention_backward_device(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                                 const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                                 const at::Tensor& out, const at::Tensor& lse, bool causal,
                                 std::optional<double> scale_opt) {
  check_attention_backward(grad_out, grad_lse, q, k_in, v_in, out, lse);
  const double scale = resolve_scale(scale_opt, q.size(3));
  const int64_t hq = q.size(1), sq = q.size(2), hkv = k_in.size(1), sk = k_in.size(2), g = hq / hkv;
  at::Tensor dq = heads_layout_like(q), dk = heads_layout_like(k_in), dv = heads_layout_like(v_in);
  const at::ScalarType acc = attention_lse_dtype(q.scalar_type());
  const bool has_go = grad_out.has_value() && grad_out->defined();
  const at::Tensor go = has_go ? *grad_out : at::zeros_like(q);
#ifdef CUSTOMOPS_WITH_CUDA
  if (q.is_cuda() && attention_cuda_fused(q, scale)) {
    attention_bwd_cuda(go, grad_lse, q, k_in, v_in, out, lse, causal, scale, dq, dk, dv);
    return {dq, dk, dv};
  }
#endif
  // dterm = rowsum(grad_out * out) - grad_lse, per query row.
  at::Tensor dterm = has_go ? (go.to(acc) * out.to(acc)).sum(-1) : at::zeros(lse.sizes(), lse.options());
  if (grad_lse.has_value() && grad_lse->defined()) dterm = dterm - *grad_lse;
  if (kCpuKernels && q.is_cpu() && acc == at::kFloat && q.numel() > 0 && k_in.numel() > 0) {
    backward_cpu(go, q, k_in.contiguous(), v_in.contiguous(), dterm, lse, causal, scale, dq, dk, dv);
    return {dq, dk, dv};
  }
  at::Tensor dk_acc = at::zeros(dk.sizes(), dk.options().dtype(acc)), dv_acc = at::zeros_like(dk_acc);
  if (q.numel() > 0 && k_in.numel() > 0) {
    const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
    auto grouped = [&](const at::Tensor& t) { return t.unflatten(1, {hkv, g}); };
    const at::Tensor qg = grouped(q), gog = grouped(go), dtg = grouped(dterm), lseg = grouped(lse), dqg = grouped(dq);
    const Tiling t = tiling(q, sk);
    const double s = scale;
    auto rows = [&](const at::Tensor& x, int64_t b, int64_t h, int64_t r, int64_t mr) {
      return task_slice(x, b, h).narrow(3, r, mr);
    };
    // Every query row of a kv head adds to its dk and dv. On CUDA and on a CPU with at least as many
    // (batch, kv head) pairs as threads, a task owns a pair and writes its dq, dk and dv in one pass
    // over the blocks. With fewer pairs, two passes keep every thread busy: dk and dv per (pair,
    // key block), then dq per (pair, query block), recomputing the probabilities (7 matmuls a block
    // instead of 5).
    const int64_t pairs = q.size(0) * hkv;
    if (!q.is_cpu() || pairs >= at::get_num_threads()) {
      auto one_pass = [&](int64_t b, int64_t h) {
        for (int64_t r = 0; r < sq; r += t.rows) {
          const int64_t mr = std::min(t.rows, sq - r);
          const Blocks blk{r, sq, sk, causal, s, t.keys};
          backward_rows(rows(qg, b, h, r, mr), task_slice(k, b, h), task_slice(v, b, h), rows(gog, b, h, r, mr),
                        rows(dtg, b, h, r, mr), rows(lseg, b, h, r, mr), blk, rows(dqg, b, h, r, mr),
                        task_slice(dk_acc, b, h), task_slice(dv_acc, b, h));
        }
      };
      if (q.is_cpu()) {
        parallel_tasks(pairs, [&](int64_t task) { one_pass(task / hkv, task % hkv); });
      } else {
        one_pass(-1, -1);
      }
    } else {
      auto pass = [&](int64_t b, int64_t h, int64_t r, int64_t mr, int64_t j0, int64_t j1, bool dkv) {
        Blocks blk{r, sq, sk, causal, s, t.keys};
        blk.keys_from = j0;
        blk.keys_to = j1;
        backward_rows(rows(qg, b, h, r, mr), task_slice(k, b, h), task_slice(v, b, h), rows(gog, b, h, r, mr),
                      rows(dtg, b, h, r, mr), rows(lseg, b, h, r, mr), blk, dkv ? at::Tensor() : rows(dqg, b, h, r, mr),
                      dkv ? task_slice(dk_acc, b, h) : at::Tensor(), dkv ? task_slice(dv_acc, b, h) : at::Tensor());
      };
      const int64_t kblocks = (sk + t.keys - 1) / t.keys, qblocks = (sq + t.rows - 1) / t.rows;
      parallel_tasks(pairs * kblocks, [&](int64_t task) {
        const int64_t j0 = (task % kblocks) * t.keys, pair = task / kblocks;
        for (int64_t r = 0; r < sq; r += t.rows) {
          pass(pair / hkv, pair % hkv, r, std::min(t.rows, sq - r), j0, std::min(j0 + t.keys, sk), true);
        }
      });
      parallel_tasks(pairs * qblocks, [&](int64_t task) {
        const int64_t r = (task % qblocks) * t.rows, pair = task / qblocks;
        pass(pair / hkv, pair % hkv, r, std::min(t.rows, sq - r), 0, sk, false);
      });
    }
  } else {
    dq.zero_();
  }
  dk.copy_(dk_acc.mul_(scale));
  dv.copy_(dv_acc);
  return {dq, dk, dv};
}

// ---- Meta -------------------------------------------------------------------------------------
Pair attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool, std::optional<double>) {
  check_attention("customops::attention", q, k, v);
  return {heads_layout_like(q),
          at::empty_symint(q.sym_sizes().slice(0, 3), q.options().dtype(attention_lse_dtype(q.scalar_type())))};
}

Triple attention_backward_meta(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, bool, std::optional<double>) {
  check_attention_backward(grad_out, grad_lse, q, k, v, out, lse);
  return {heads_layout_like(q), heads_layout_like(k), heads_layout_like(v)};
}

// ---- Autograd ---------------------------------------------------------------------------------
// Differentiable inputs q, k, v; outputs out and lse. Saved: q, k, v, out, lse; attrs: causal,
// whether scale was given, scale. (The default scale is left to the kernels: reading D here would
// specialize symbolic sizes under torch.compile.)
constexpr char kAttention[] = "attention";
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list attention_grad(const BackwardArgs& a) {
  const at::Tensor &go = a.grads[0], &gl = a.grads[1];
  if (!a.needs_any() || (!go.defined() && !gl.defined())) return {at::Tensor(), at::Tensor(), at::Tensor()};
  const std::optional<double> scale = a.attrs[1] != 0 ? std::optional<double>(a.attrs[2]) : std::nullopt;
  auto [dq, dk, dv] = attention_backward_op().call(optional_defined(go), optional_defined(gl), a.saved[0], a.saved[1],
                                                   a.saved[2], a.saved[3], a.saved[4], a.attrs[0] != 0, scale);
  return {a.needs[0] ? dq : at::Tensor(), a.needs[1] ? dk : at::Tensor(), a.needs[2] ? dv : at::Tensor()};
}

// Tangents (ATen ops; the [Sq, Sk] probabilities are built, as forward-mode AD is for checks and
// small problems): with s' = scale * (q' k^T + q k'^T), lse' = sum_j p_ij s'_ij and
// out' = (p * (s' - lse')) v + p v'.
Pair attention_tangents(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                        const at::Tensor& tq, const at::Tensor& tk, const at::Tensor& tv, bool causal,
                        std::optional<double> scale_opt) {
  const at::ScalarType acc = lse.scalar_type();
  const double scale = resolve_scale(scale_opt, q.size(3));
  const int64_t g = q.size(1) / k.size(1), sq = q.size(2), sk = k.size(2);
  auto heads = [&](const at::Tensor& t) { return t.to(acc).repeat_interleave(g, 1); };
  const at::Tensor qa = q.to(acc), ka = heads(k), va = heads(v);
  at::Tensor s = at::matmul(qa, ka.transpose(-2, -1)).mul_(scale);
  if (causal) {
    const auto opts = at::TensorOptions().device(q.device()).dtype(at::kLong);
    s.masked_fill_(at::arange(sk, opts).unsqueeze(0) > at::arange(sk - sq, sk, opts).unsqueeze(-1), -kInf);
  }
  const at::Tensor p = (s - lse.masked_fill(lse == -kInf, kInf).unsqueeze(-1)).exp();
  at::Tensor ts = at::zeros_like(s);
  if (tq.defined()) ts = ts + at::matmul(tq.to(acc), ka.transpose(-2, -1));
  if (tk.defined()) ts = ts + at::matmul(qa, heads(tk).transpose(-2, -1));
  ts = ts * scale;
  const at::Tensor tlse = (p * ts).sum(-1);
  at::Tensor tout = at::matmul(p * (ts - tlse.unsqueeze(-1)), va);
  if (tv.defined()) tout = tout + at::matmul(p, heads(tv));
  return {tout.to(q.scalar_type()), tlse};
}

Pair attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                        std::optional<double> scale_opt) {
  Recorder rec(q, k, v);
  if (!rec) return call_below_autograd(attention_op(), q, k, v, causal, scale_opt);
  auto [out, lse] = call_below_autograd(attention_op(), q, k, v, causal, scale_opt);
  rec.record<attention_grad>("AttentionBackward", {out, lse},
                             {Recorder::input(q), Recorder::input(k), Recorder::input(v), Recorder::output(out),
                              Recorder::output(lse)},
                             {causal ? 1.0 : 0.0, scale_opt.has_value() ? 1.0 : 0.0, scale_opt.value_or(0.0)});
  if (rec.needs_tangent()) {
    auto [tout, tlse] = attention_tangents(rec.primal(0), rec.primal(1), rec.primal(2), lse.detach(), rec.tangent(0),
                                           rec.tangent(1), rec.tangent(2), causal, scale_opt);
    rec.set_tangent(out, [&, &tout = tout] { return tout; });
    rec.set_tangent(lse, [&, &tlse = tlse] { return tlse; });
  }
  return {out, lse};
}

Triple attention_backward_autograd(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                                   const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse, bool causal,
                                   std::optional<double> scale) {
  Recorder rec(grad_out, grad_lse, q, k, v, out, lse);
  if (!rec) return call_below_autograd(attention_backward_op(), grad_out, grad_lse, q, k, v, out, lse, causal, scale);
  return rec.backward_op<kAttention>(attention_backward_op(), grad_out, grad_lse, q, k, v, out, lse, causal, scale);
}

// ---- vmap: the vmap dim folds into the batch dim B ---------------------------------------------
at::Tensor fold(const batching::Level& level, const at::Tensor& t, const c10::SymInt& e) {
  return t.defined() ? level.front(t, e).flatten(0, 1) : t;
}
at::Tensor unfold(const batching::Level& level, const at::Tensor& t, const c10::SymInt& e) {
  return level.wrap(t.unflatten_symint(0, {e, t.sym_size(0) / e}));
}

Pair attention_batched(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       std::optional<double> scale) {
  batching::Level level({q, k, v});
  auto batch = level.batch_size({q, k, v});
  if (!batch) return attention_op().call(q, k, v, causal, scale);
  auto [out, lse] = attention_op().call(fold(level, q, *batch), fold(level, k, *batch), fold(level, v, *batch),
                                        causal, scale);
  return {unfold(level, out, *batch), unfold(level, lse, *batch)};
}

Triple attention_backward_batched(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                                  const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, bool causal, std::optional<double> scale) {
  const at::Tensor go = grad_out.value_or(at::Tensor()), gl = grad_lse.value_or(at::Tensor());
  batching::Level level({go, gl, q, k, v, out, lse});
  auto batch = level.batch_size({go, gl, q, k, v, out, lse});
  if (!batch) return attention_backward_op().call(grad_out, grad_lse, q, k, v, out, lse, causal, scale);
  const c10::SymInt& e = *batch;
  auto [dq, dk, dv] = attention_backward_op().call(
      optional_defined(fold(level, go, e)), optional_defined(fold(level, gl, e)), fold(level, q, e),
      fold(level, k, e), fold(level, v, e), fold(level, out, e), fold(level, lse, e), causal, scale);
  return {unfold(level, dq, e), unfold(level, dk, e), unfold(level, dv, e)};
}

// ---- Autocast: as scaled_dot_product_attention, float32 q, k and v run in the autocast dtype ---
Pair attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                        std::optional<double> scale) {
  const at::ScalarType low = at::autocast::get_autocast_dtype(q.device().type());
  auto cast = [&](const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kFloat ? t.to(low) : t; };
  autocast::Below below;
  return attention_op().call(cast(q), cast(k), cast(v), causal, scale);
}

// ---- merge_attention: ATen ops (CompositeImplicitAutograd), so autograd, vmap, autocast, Meta and
// compile take it apart --------------------------------------------------------------------------
// With m = max(lse_a, lse_b): lse = m + log(e^(lse_a - m) + e^(lse_b - m)) and
// out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse); rows where both are empty (lse -inf)
// give out 0 and lse -inf, with zero gradients rather than NaN.
// mixed: out_b and lse_b may have other float dtypes than out_a and lse_a (under autocast).
Pair merge_attention_mixed(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                           const at::Tensor& lse_b, bool mixed) {
  constexpr const char* op = "customops::merge_attention";
  checks::float_dtype(op, "out_a", out_a);
  checks::float_dtype(op, "lse_a", lse_a);
  checks::defined(op, "out_b", out_b);
  checks::defined(op, "lse_b", lse_b);
  checks::same_shape(op, "out_b", out_b, "out_a", out_a);
  checks::same_device(op, "out_b", out_b, "out_a", out_a);
  checks::same_shape(op, "lse_b", lse_b, "lse_a", lse_a);
  if (mixed) {
    checks::float_dtype(op, "out_b", out_b);
    checks::float_dtype(op, "lse_b", lse_b);
  } else {
    checks::same_dtype(op, "out_b", out_b, "out_a", out_a);
    checks::same_dtype(op, "lse_b", lse_b, "lse_a", lse_a);
  }
  checks::same_device(op, "lse_a", lse_a, "out_a", out_a);
  checks::same_device(op, "lse_b", lse_b, "out_a", out_a);
  TORCH_CHECK(out_a.dim() >= 1, op, ": out_a must have at least one dimension (the head dim)");
  TORCH_CHECK(lse_a.sym_sizes().equals(out_a.sym_sizes().slice(0, out_a.dim() - 1)), op,
                  ": expected lse_a of shape out_a.shape[:-1] = ", out_a.sym_sizes().slice(0, out_a.dim() - 1),
                  ", but got ", lse_a.sym_sizes());
  const at::ScalarType acc =
      at::promote_types(at::promote_types(lse_a.scalar_type(), lse_b.scalar_type()), at::kFloat);
  const at::Tensor la = lse_a.to(acc), lb = lse_b.to(acc);
  const at::Tensor mx = at::maximum(la, lb);
  const at::Tensor m = at::where(at::isfinite(mx), mx, at::zeros_like(mx));
  const at::Tensor ea = (la - m).exp(), eb = (lb - m).exp(), sum = ea + eb;
  const at::Tensor empty = sum == 0, safe = at::where(empty, at::ones_like(sum), sum);
  const at::Tensor lse = at::where(empty, at::full_like(sum, -kInf), m + safe.log());
  const at::Tensor wa = (ea / safe).unsqueeze(-1), wb = (eb / safe).unsqueeze(-1);
  const at::Tensor out = out_a.to(at::promote_types(out_a.scalar_type(), acc)) * wa +
                         out_b.to(at::promote_types(out_b.scalar_type(), acc)) * wb;
  return {out.to(out_a.scalar_type()), lse.to(lse_a.scalar_type())};
}

Pair merge_attention_impl(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                          const at::Tensor& lse_b) {
  return merge_attention_mixed(out_a, lse_a, out_b, lse_b, /*mixed=*/false);
}

// Autocast: partial attentions of mixed precision (one side computed under autocast, the other
// not) merge in float32 (float64 if either is); out keeps out_a's dtype and lse lse_a's.
Pair merge_attention_autocast(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                              const at::Tensor& lse_b) {
  autocast::Below below;
  return merge_attention_mixed(out_a, lse_a, out_b, lse_b, /*mixed=*/true);
}

}  // namespace

// Meta kernels of attention.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("_attention_backward", &attention_backward_meta);
}

// CPU and CUDA kernels of attention.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("attention", &attention_device);
  m.impl("_attention_backward", &attention_backward_device);
}

#ifdef CUSTOMOPS_WITH_CUDA
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("attention", &attention_device);
  m.impl("_attention_backward", &attention_backward_device);
}
#endif

// Autograd kernels of attention.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("_attention_backward", &attention_backward_autograd);
}

// vmap batching rules of attention; merge_attention's is its composite (functorch's vmap fallback
// would otherwise take it: functorch decomposes ATen's composites the same way).
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("attention", &attention_batched);
  m.impl("_attention_backward", &attention_backward_batched);
  m.impl("merge_attention", &merge_attention_impl);
}

// Autocast kernels of attention and merge_attention.
CUSTOMOPS_AUTOCAST_IMPL(m) {
  m.impl("attention", &attention_autocast);
  m.impl("merge_attention", &merge_attention_autocast);
}

// merge_attention: one composite kernel for every other key.
TORCH_LIBRARY_IMPL(customops, CompositeImplicitAutograd, m) {
  m.impl("merge_attention", &merge_attention_impl);
}

}  // namespace customops
