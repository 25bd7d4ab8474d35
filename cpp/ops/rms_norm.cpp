// rms_norm and _rms_norm_backward, device-independent parts: typed C++ API, Meta kernels and
// Autograd kernels. rstd is returned by the forward so the backward never recomputes it; it is
// not differentiable. Double backward raises a clear error (the fused backward has no formula).
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

const auto& rms_norm_op() {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("customops::rms_norm", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&, double)>();
  return op;
}

const auto& rms_norm_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_rms_norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const std::optional<at::Tensor>&, const at::Tensor&,
                                                                 std::array<bool, 2>)>();
  return op;
}

}  // namespace

std::optional<at::Tensor> optional_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_with_rstd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                      double eps) {
  return rms_norm_op().call(x, weight, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return std::get<0>(rms_norm_with_rstd(x, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const std::optional<at::Tensor>& weight,
                                                     const at::Tensor& rstd, std::array<bool, 2> output_mask) {
  return rms_norm_backward_op().call(grad_y, x, weight, rstd, output_mask);
}

// ---- vmap helpers shared with add_rms_norm (ops/llm.h) -----------------------------------------

at::Tensor scale_rows(const at::Tensor& rows, at::Tensor w) {
  while (w.dim() < rows.dim()) w = w.unsqueeze(1);
  return (rows.to(rms_norm_acc_dtype(rows.scalar_type())) * w).to(rows.scalar_type());
}

at::Tensor per_entry_weight_grad(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& rstd,
                                 at::ScalarType w_dtype) {
  at::Tensor per_row = gy.to(rstd.scalar_type()) * x.to(rstd.scalar_type()) * rstd.unsqueeze(-1);
  std::vector<int64_t> rows;
  for (int64_t d = 1; d < per_row.dim() - 1; ++d) rows.push_back(d);
  return (rows.empty() ? per_row : per_row.sum(rows)).to(w_dtype);
}

namespace {

// ---- Meta -------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> rms_norm_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                 double /*eps*/) {
  check_rms_norm("customops::rms_norm", x, weight);
  auto sizes = x.sym_sizes();
  return {at::empty_symint(sizes, x.options()),
          at::empty_symint(sizes.slice(0, sizes.size() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_y, const at::Tensor& x,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_rms_norm_backward(grad_y, x, weight, rstd);
  const bool has_w = weight.has_value() && weight->defined();
  return {mask[0] ? at::empty_symint(x.sym_sizes(), x.options()) : at::empty({0}, x.options()),
          mask[1] && has_w ? at::empty_symint(weight->sym_sizes(), weight->options()) : at::empty({0}, x.options())};
}

// ---- Autograd ---------------------------------------------------------------------------------
// rstd is an output the backward reuses, not a differentiable one. Saved: x, weight, rstd.
constexpr char kRmsNorm[] = "rms_norm";
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list rms_norm_grad(const BackwardArgs& a) {
  const at::Tensor &x = a.saved[0], &weight = a.saved[1], &rstd = a.saved[2];
  const std::array<bool, 2> mask{a.needs[0], weight.defined() && a.needs[1]};
  auto [dx, dw] = customops::rms_norm_backward(a.grads[0], x, optional_defined(weight), rstd, mask);
  return {mask[0] ? dx : at::Tensor(), mask[1] ? dw : at::Tensor()};
}

// With xhat = x * rstd: d xhat = rstd * (dx - xhat * mean(xhat * dx)) and dy = d xhat * w + xhat * dw,
// in the accumulation dtype (ATen ops: a tangent is a second pass anyway).
at::Tensor rms_norm_tangent(const Recorder& rec, const at::Tensor& rstd, at::ScalarType out_dtype) {
  const at::Tensor &x = rec.primal(0), &w = rec.primal(1);
  const at::ScalarType acc = rstd.scalar_type();
  const at::Tensor xhat = x.to(acc) * rstd.unsqueeze(-1);
  at::Tensor dy;
  if (rec.has_tangent(0)) {
    const at::Tensor dx = rec.tangent(0).to(acc);
    dy = rstd.unsqueeze(-1) * (dx - xhat * (xhat * dx).mean(-1, /*keepdim=*/true));
    if (w.defined()) dy = dy * w.to(acc);
  }
  if (w.defined() && rec.has_tangent(1)) dy = autograd::sum_defined({dy, xhat * rec.tangent(1).to(acc)});
  return dy.to(out_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                     double eps) {
  Recorder rec(x, weight);
  if (!rec) return call_below_autograd(rms_norm_op(), x, weight, eps);
  auto [y, rstd] = call_below_autograd(rms_norm_op(), x, weight, eps);
  rec.record<rms_norm_grad>("RmsNormBackward", {y}, {Recorder::input(x), Recorder::input(weight), Recorder::input(rstd)});
  rec.set_tangent(y, [&, &rstd = rstd, &y = y] { return rms_norm_tangent(rec, rstd, y.scalar_type()); });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_autograd(const at::Tensor& grad_y, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight,
                                                              const at::Tensor& rstd, std::array<bool, 2> mask) {
  Recorder rec(grad_y, x, weight, rstd);
  if (!rec) return call_below_autograd(rms_norm_backward_op(), grad_y, x, weight, rstd, mask);
  return rec.backward_op<kRmsNorm>(rms_norm_backward_op(), grad_y, x, weight, rstd, mask);
}

// ---- vmap -------------------------------------------------------------------------------------
// x, grad_y and rstd are batched with the rows; weight is shared by all rows, so an unbatched
// weight is passed as it is. A batched weight (vmap over models) scales the unweighted norm, and
// each entry's weight gradient is the sum of grad_y * xhat over that entry's rows.


std::tuple<at::Tensor, at::Tensor> rms_norm_batched(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                    double eps) {
  const at::Tensor w = weight.value_or(at::Tensor());
  batching::Level level({x, w});
  auto batch = level.batch_size({x, w});
  if (!batch) return rms_norm_op().call(x, weight, eps);
  const at::Tensor x_ = level.front(x, *batch), w_ = level.front_if_batched(w);
  if (!w_.defined()) {
    auto [y, rstd] = rms_norm_op().call(x_, weight, eps);
    return {level.wrap(y), level.wrap(rstd)};
  }
  check_rms_norm("customops::rms_norm", x, weight);  // the checks a batched weight skips below
  auto [y, rstd] = rms_norm_op().call(x_, std::nullopt, eps);
  return {level.wrap(scale_rows(y, w_)), level.wrap(rstd)};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_batched(const at::Tensor& grad_y, const at::Tensor& x,
                                                             const std::optional<at::Tensor>& weight,
                                                             const at::Tensor& rstd, std::array<bool, 2> mask) {
  const at::Tensor w = weight.value_or(at::Tensor());
  batching::Level level({grad_y, x, rstd, w});
  auto batch = level.batch_size({grad_y, x, rstd, w});
  if (!batch) return rms_norm_backward_op().call(grad_y, x, weight, rstd, mask);
  check_rms_norm_backward(grad_y, x, weight, rstd);
  const at::Tensor gy = level.front(grad_y, *batch), x_ = level.front(x, *batch), r = level.front(rstd, *batch);
  const at::Tensor w_ = level.front_if_batched(w);
  const at::Tensor none = at::empty({0}, x_.options());
  at::Tensor dx = none, dw = none;
  if (mask[0]) {
    dx = std::get<0>(w_.defined() ? rms_norm_backward_op().call(scale_rows(gy, w_), x_, std::nullopt, r, {true, false})
                                  : rms_norm_backward_op().call(gy, x_, weight, r, {true, false}));
  }
  if (mask[1] && w.defined()) {
    dw = per_entry_weight_grad(gy, x_, r, w.scalar_type());
  }
  return {mask[0] ? level.wrap(dx) : level.wrap_unbatched(dx),
          mask[1] && w.defined() ? level.wrap(dw) : level.wrap_unbatched(dw)};
}

// ---- Autocast: x keeps its dtype; the weight is used as autocast::norm_weight says ------------
std::tuple<at::Tensor, at::Tensor> rms_norm_autocast(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                     double eps) {
  const auto w = autocast::norm_weight(x, weight);
  autocast::Below below;
  return rms_norm_op().call(x, w, eps);
}

}  // namespace

// Meta kernels of rms_norm.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("_rms_norm_backward", &rms_norm_backward_meta);
}

// Autograd kernels of rms_norm.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("_rms_norm_backward", &rms_norm_backward_autograd);
}

// Autocast kernels of rms_norm.
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("rms_norm", &rms_norm_autocast); }

// vmap batching rules of rms_norm.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("rms_norm", &rms_norm_batched);
  m.impl("_rms_norm_backward", &rms_norm_backward_batched);
}

}  // namespace customops
