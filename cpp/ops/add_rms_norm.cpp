// add_rms_norm and _add_rms_norm_backward, device-independent parts: typed C++ API, Meta kernels,
// Autograd kernels, vmap rules and the autocast kernel. sum = x + residual is an output (the next
// residual connection takes it) and what the backward normalizes again; rstd is returned so the
// backward never recomputes it. x and residual get the same gradient: rms_norm's backward on
// sum plus the gradient that reached sum directly, written in one pass.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/llm.h"

namespace customops {
namespace {

using torch::autograd::variable_list;

const auto& add_rms_norm_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::add_rms_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double)>();
  return op;
}

const auto& add_rms_norm_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_add_rms_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const at::Tensor&, std::array<bool, 2>)>();
  return op;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                            const std::optional<at::Tensor>& weight, double eps) {
  return add_rms_norm_op().call(x, residual, weight, eps);
}

namespace {

// ---- Meta -------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_meta(const at::Tensor& x, const at::Tensor& residual,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 double /*eps*/) {
  check_add_rms_norm("customops::add_rms_norm", x, residual, weight);
  auto sizes = x.sym_sizes();
  return {at::empty_symint(sizes, x.options()), at::empty_symint(sizes, x.options()),
          at::empty_symint(sizes.slice(0, sizes.size() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_meta(const at::Tensor& grad_y,
                                                              const std::optional<at::Tensor>& grad_sum,
                                                              const at::Tensor& sum,
                                                              const std::optional<at::Tensor>& weight,
                                                              const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_add_rms_norm_backward(grad_y, grad_sum, sum, weight, rstd);
  const bool has_w = weight.has_value() && weight->defined();
  return {mask[0] ? at::empty_symint(sum.sym_sizes(), sum.options()) : at::empty({0}, sum.options()),
          mask[1] && has_w ? at::empty_symint(weight->sym_sizes(), weight->options()) : at::empty({0}, sum.options())};
}

// ---- Autograd ---------------------------------------------------------------------------------
// Differentiable outputs: y and sum (rstd is not). Saved: sum, weight, rstd.
constexpr char kAddRmsNorm[] = "add_rms_norm";
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list add_rms_norm_grad(const BackwardArgs& a) {
  const at::Tensor &dy = a.grads[0], &dsum = a.grads[1];
  const at::Tensor &sum = a.saved[0], &weight = a.saved[1], &rstd = a.saved[2];
  if (!dy.defined()) return {dsum, dsum, at::Tensor()};  // only sum was used: no norm to undo
  const std::array<bool, 2> mask{a.needs[0] || a.needs[1], weight.defined() && a.needs[2]};
  auto [ds, dw] = add_rms_norm_backward_op().call(dy, optional_defined(dsum), sum, optional_defined(weight), rstd, mask);
  return {a.needs[0] ? ds : at::Tensor(), a.needs[1] ? ds : at::Tensor(), mask[1] ? dw : at::Tensor()};
}

// Tangents: sum's is tx + tres; y's is rms_norm's tangent at sum (ATen ops, in float32).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_tangents(const Recorder& rec, const at::Tensor& sum,
                                                         const at::Tensor& rstd) {
  const at::Tensor ts = autograd::sum_defined({rec.tangent(0), rec.tangent(1)});
  const at::Tensor& w = rec.primal(2);
  const at::ScalarType acc = rstd.scalar_type();
  const at::Tensor xhat = sum.to(acc) * rstd.unsqueeze(-1);
  at::Tensor dy;
  if (ts.defined()) {
    const at::Tensor t = ts.to(acc);
    dy = rstd.unsqueeze(-1) * (t - xhat * (xhat * t).mean(-1, /*keepdim=*/true));
    if (w.defined()) dy = dy * w.to(acc);
  }
  if (w.defined() && rec.has_tangent(2)) dy = autograd::sum_defined({dy, xhat * rec.tangent(2).to(acc)});
  return {dy.defined() ? dy.to(sum.scalar_type()) : dy, ts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_autograd(const at::Tensor& x, const at::Tensor& residual,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     double eps) {
  Recorder rec(x, residual, weight);
  if (!rec) return call_below_autograd(add_rms_norm_op(), x, residual, weight, eps);
  auto [y, sum, rstd] = call_below_autograd(add_rms_norm_op(), x, residual, weight, eps);
  rec.record<add_rms_norm_grad>("AddRmsNormBackward", {y, sum},
                                {Recorder::output(sum), Recorder::input(weight), Recorder::input(rstd)});
  if (rec.needs_tangent()) {
    auto [ty, ts] = add_rms_norm_tangents(rec, sum, rstd);
    rec.set_tangent(y, [&, &ty = ty] { return ty; });
    if (ts.defined()) rec.set_tangent(sum, [&, &ts = ts] { return ts; });
  }
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_autograd(const at::Tensor& grad_y,
                                                                  const std::optional<at::Tensor>& grad_sum,
                                                                  const at::Tensor& sum,
                                                                  const std::optional<at::Tensor>& weight,
                                                                  const at::Tensor& rstd, std::array<bool, 2> mask) {
  Recorder rec(grad_y, grad_sum, sum, weight, rstd);
  if (!rec) return call_below_autograd(add_rms_norm_backward_op(), grad_y, grad_sum, sum, weight, rstd, mask);
  return rec.backward_op<kAddRmsNorm>(add_rms_norm_backward_op(), grad_y, grad_sum, sum, weight, rstd, mask);
}

// ---- vmap -------------------------------------------------------------------------------------
// As rms_norm's rules: x, residual (and the gradients, sum, rstd) are batched with the rows; an
// unbatched weight is passed as it is, a batched one scales the unweighted norm.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_batched(const at::Tensor& x, const at::Tensor& residual,
                                                                    const std::optional<at::Tensor>& weight,
                                                                    double eps) {
  const at::Tensor w = weight.value_or(at::Tensor());
  batching::Level level({x, residual, w});
  auto batch = level.batch_size({x, residual, w});
  if (!batch) return add_rms_norm_op().call(x, residual, weight, eps);
  check_add_rms_norm("customops::add_rms_norm", x, residual, weight);
  const at::Tensor x_ = level.front(x, *batch), r_ = level.front(residual, *batch), w_ = level.front_if_batched(w);
  auto [y, sum, rstd] = add_rms_norm_op().call(x_, r_, w_.defined() ? std::nullopt : weight, eps);
  return {level.wrap(w_.defined() ? scale_rows(y, w_) : y), level.wrap(sum), level.wrap(rstd)};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_batched(const at::Tensor& grad_y,
                                                                 const std::optional<at::Tensor>& grad_sum,
                                                                 const at::Tensor& sum,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 const at::Tensor& rstd, std::array<bool, 2> mask) {
  const at::Tensor w = weight.value_or(at::Tensor()), gs = grad_sum.value_or(at::Tensor());
  batching::Level level({grad_y, gs, sum, rstd, w});
  auto batch = level.batch_size({grad_y, gs, sum, rstd, w});
  if (!batch) return add_rms_norm_backward_op().call(grad_y, grad_sum, sum, weight, rstd, mask);
  check_add_rms_norm_backward(grad_y, grad_sum, sum, weight, rstd);
  const at::Tensor gy = level.front(grad_y, *batch), s = level.front(sum, *batch), r = level.front(rstd, *batch);
  const std::optional<at::Tensor> gs_ = gs.defined() ? std::optional<at::Tensor>(level.front(gs, *batch)) : std::nullopt;
  // Each entry's weight gradient sums over its own rows only, shared weight or not.
  const at::Tensor w_ = level.front_if_batched(w);
  const at::Tensor none = at::empty({0}, s.options());
  at::Tensor dx = none, dw = none;
  if (mask[0]) {
    dx = std::get<0>(w_.defined() ? add_rms_norm_backward_op().call(scale_rows(gy, w_), gs_, s, std::nullopt, r, {true, false})
                                  : add_rms_norm_backward_op().call(gy, gs_, s, weight, r, {true, false}));
  }
  if (mask[1] && w.defined()) dw = per_entry_weight_grad(gy, s, r, w.scalar_type());
  return {mask[0] ? level.wrap(dx) : level.wrap_unbatched(dx),
          mask[1] && w.defined() ? level.wrap(dw) : level.wrap_unbatched(dw)};
}

// ---- Autocast: x and residual are promoted to the wider of their dtypes (as x + residual is);
// the weight is used as autocast::norm_weight says --------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_autocast(const at::Tensor& x, const at::Tensor& residual,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     double eps) {
  at::Tensor x_ = x, r_ = residual;
  if (x.is_floating_point() && residual.is_floating_point() && x.scalar_type() != residual.scalar_type()) {
    const at::ScalarType t = at::promote_types(x.scalar_type(), residual.scalar_type());
    x_ = x.to(t);
    r_ = residual.to(t);
  }
  const auto w = autocast::norm_weight(x_, weight);
  autocast::Below below;
  return add_rms_norm_op().call(x_, r_, w, eps);
}

}  // namespace

// Meta kernels of add_rms_norm.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("_add_rms_norm_backward", &add_rms_norm_backward_meta);
}

// Autograd kernels of add_rms_norm.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("add_rms_norm", &add_rms_norm_autograd);
  m.impl("_add_rms_norm_backward", &add_rms_norm_backward_autograd);
}

// Autocast kernel of add_rms_norm.
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("add_rms_norm", &add_rms_norm_autocast); }

// vmap batching rules of add_rms_norm.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("add_rms_norm", &add_rms_norm_batched);
  m.impl("_add_rms_norm_backward", &add_rms_norm_backward_batched);
}

}  // namespace customops
