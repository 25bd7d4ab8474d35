// rms_norm and _rms_norm_backward, device-independent parts: typed C++ API, Meta kernels and
// Autograd kernels. rstd is returned by the forward so the backward never recomputes it; it is
// not differentiable. Double backward raises a clear error (the fused backward has no formula).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autograd.h"
#include "ops/llm.h"

namespace customops {
namespace {

using torch::autograd::AutogradContext;
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

std::optional<at::Tensor> optional_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

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
class RmsNormBackwardFunction : public torch::autograd::Function<RmsNormBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_y, const at::Tensor& x,
                               const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                               std::array<bool, 2> mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dx, dw] = rms_norm_backward_op().call(grad_y, x, weight, rstd, mask);
    return {dx, dw};
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    TORCH_CHECK(false,
                "double backward is not supported for customops::rms_norm (its fused backward, "
                "customops::_rms_norm_backward, has no derivative)");
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  // weight is optional: autograd nodes take no undefined tensors as inputs.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = rms_norm_op().call(x, weight, eps);
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const std::array<bool, 2> mask{ctx->needs_input_grad(0), weight.defined() && ctx->needs_input_grad(1)};
    if (!mask[0] && !mask[1]) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dx, dw] = customops::rms_norm_backward(grads[0], x, optional_defined(weight), rstd, mask);
    return {mask[0] ? dx : at::Tensor(), mask[1] ? dw : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                     double eps) {
  if (!needs_autograd(x, weight)) return call_below_autograd(rms_norm_op(), x, weight, eps);
  auto outs = RmsNormFunction::apply(x, weight, eps);
  return {outs[0], outs[1]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_autograd(const at::Tensor& grad_y, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight,
                                                              const at::Tensor& rstd, std::array<bool, 2> mask) {
  if (!needs_autograd(grad_y, x, weight, rstd)) {
    return call_below_autograd(rms_norm_backward_op(), grad_y, x, weight, rstd, mask);
  }
  auto outs = RmsNormBackwardFunction::apply(grad_y, x, weight, rstd, mask);
  return {outs[0], outs[1]};
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

}  // namespace customops
