// attention's blocked kernels (ops/attention.h): ATen ops on blocks of query rows and keys, on any
// device (at::matmul: MKL on the CPU, cuBLAS tensor cores on CUDA). The CPU kernels
// (cpp/cpu/attention.cpp) fall back on them for float64, the CUDA kernels (cuda/attention.cu) for
// the inputs their fused kernels do not take; they are the reference of both. Also attention_dterm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <limits>

#include "ops/attention.h"

namespace customops {

at::Tensor attention_dterm(const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& out, const at::Tensor& lse) {
  const at::ScalarType acc = attention_lse_dtype(out.scalar_type());
  at::Tensor dt = grad_out.has_value() && grad_out->defined() ? (grad_out->to(acc) * out.to(acc)).sum(-1)
                                                              : at::zeros(lse.sizes(), lse.options());
  if (grad_lse.has_value() && grad_lse->defined()) dt = dt - *grad_lse;
  return dt;
}

namespace attention_blocked {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

void Blocks::mask(at::Tensor& s, int64_t m, int64_t j0) const {
  const int64_t n = s.size(-1);
  if (!causal || j0 + n - 1 <= i0 + shift()) return;  // every row sees every key of the block
  const auto opts = at::TensorOptions().device(s.device()).dtype(at::kLong);
  const at::Tensor rows = at::arange(i0 + shift(), i0 + shift() + m, opts).unsqueeze(-1);
  const at::Tensor hidden = at::arange(j0, j0 + n, opts).unsqueeze(0) > rows;  // [M, N]
  s.view({s.size(0), s.size(1), -1, m, n}).masked_fill_(hidden, -kInf);
}

void parallel_tasks(int64_t n, c10::function_ref<void(int64_t)> fn) {
  const at::ThreadLocalState state;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard tls(state);
    for (int64_t task = begin; task < end; ++task) fn(task);
  });
}

namespace {

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

}  // namespace

void forward(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in, bool causal, double scale,
             const at::Tensor& out, const at::Tensor& lse) {
  const int64_t hq = q.size(1), sq = q.size(2), hkv = k_in.size(1), sk = k_in.size(2);
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor qg = q.unflatten(1, {hkv, hq / hkv}), outg = out.unflatten(1, {hkv, hq / hkv});
  const at::Tensor lseg = lse.unflatten(1, {hkv, hq / hkv});
  const Tiling t = tiling(q, sk);
  for_blocks(q, hkv, sq, t, [&](int64_t b, int64_t h, int64_t i0, int64_t m) {
    const Blocks blk{i0, sq, sk, causal, scale, t.keys};
    forward_rows(task_slice(qg, b, h).narrow(3, i0, m), task_slice(k, b, h), task_slice(v, b, h), blk,
                 task_slice(outg, b, h).narrow(3, i0, m), task_slice(lseg, b, h).narrow(3, i0, m));
  });
}

void backward(const at::Tensor& go, const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& dterm, const at::Tensor& lse, bool causal, double scale, const at::Tensor& dq,
              const at::Tensor& dk, const at::Tensor& dv) {
  const int64_t hq = q.size(1), sq = q.size(2), hkv = k_in.size(1), sk = k_in.size(2), g = hq / hkv;
  const at::ScalarType acc = attention_lse_dtype(q.scalar_type());
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
}

}  // namespace attention_blocked
}  // namespace customops
