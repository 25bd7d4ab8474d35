// attention, _attention_backward and merge_attention, device-independent parts: typed C++ API,
// Meta, Autograd, vmap and autocast kernels, and merge_attention's composite kernel.
//
// attention returns the rows' log-sum-exp as an output (background 000's running example): the
// backward reuses it instead of recomputing softmax statistics, and it is differentiable
// (d lse_i / d s_ij = p_ij), which merging partial attentions needs.
//
// The device kernels are blocked ("flash") attention: scores of a block of query rows against a
// block of keys, an online softmax across key blocks, and no [Sq, Sk] matrix ever: extra memory is
// one block of scores. Grouped-query attention reads k and v once per group of query heads (the
// group's rows are stacked, k is never repeated). On the CPU, float32, bfloat16 and float16 run on
// raw pointers through oneDNN's brgemm (cpp/cpu/attention.cpp); on CUDA, float16 and bfloat16 with
// head dims 64 and 128 run in fused tensor-core kernels, scores kept in registers
// (cuda/attention.cu). Every other input (float64, CUDA without the fused kernels) takes ATen ops
// on blocks (cpp/ops/attention_blocked.cpp), the reference of both.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

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

// ---- Meta -------------------------------------------------------------------------------------
Pair attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool, std::optional<double>) {
  check_attention("customops::attention", q, k, v);
  return attention_outputs(q);
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
  const double scale = attention_scale(scale_opt, q.size(3));
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
