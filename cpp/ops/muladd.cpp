// muladd, muladd.out and mul, device-independent parts: the typed C++ API (through the
// dispatcher), the Meta kernels (symbolic sizes, same checks as the real kernels) and the
// Autograd kernels. Backward formulas call only dispatcher ops, so double backward works.
#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autograd.h"
#include "ops/muladd.h"

namespace customops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const auto& muladd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::muladd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const auto& muladd_out_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::muladd", "out")
                       .typed<at::Tensor&(const at::Tensor&, const at::Tensor&, double, at::Tensor&)>();
  return op;
}

const auto& mul_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::mul", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op;
}

}  // namespace

at::Tensor muladd(const at::Tensor& a, const at::Tensor& b, double c) { return muladd_op().call(a, b, c); }

at::Tensor& muladd_out(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  return muladd_out_op().call(a, b, c, out);
}

at::Tensor mul(const at::Tensor& a, const at::Tensor& b) { return mul_op().call(a, b); }

namespace {

// ---- Meta -------------------------------------------------------------------------------------
// Real kernels return a fresh contiguous tensor, so the Meta kernels do too.
at::Tensor muladd_meta(const at::Tensor& a, const at::Tensor& b, double /*c*/) {
  check_binary("customops::muladd", a, b);
  return at::empty_symint(a.sym_sizes(), a.options());
}

at::Tensor& muladd_out_meta(const at::Tensor& a, const at::Tensor& b, double /*c*/, at::Tensor& out) {
  check_muladd_out(a, b, out);
  return out;
}

at::Tensor mul_meta(const at::Tensor& a, const at::Tensor& b) {
  check_binary("customops::mul", a, b);
  return at::empty_symint(a.sym_sizes(), a.options());
}

// ---- Autograd ---------------------------------------------------------------------------------
// d(a*b + c) = (g*b, g*a); c is a constant.
class MulAddFunction : public torch::autograd::Function<MulAddFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, double c) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({a, b});
    return muladd_op().call(a, b, c);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = grads[0];
    at::Tensor grad_a = ctx->needs_input_grad(0) ? customops::mul(g, saved[1]) : at::Tensor();
    at::Tensor grad_b = ctx->needs_input_grad(1) ? customops::mul(g, saved[0]) : at::Tensor();
    return {grad_a, grad_b, at::Tensor()};
  }
};

class MulFunction : public torch::autograd::Function<MulFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({a, b});
    return mul_op().call(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = grads[0];
    at::Tensor grad_a = ctx->needs_input_grad(0) ? customops::mul(g, saved[1]) : at::Tensor();
    at::Tensor grad_b = ctx->needs_input_grad(1) ? customops::mul(g, saved[0]) : at::Tensor();
    return {grad_a, grad_b};
  }
};

at::Tensor muladd_autograd(const at::Tensor& a, const at::Tensor& b, double c) {
  return needs_autograd(a, b) ? MulAddFunction::apply(a, b, c) : call_below_autograd(muladd_op(), a, b, c);
}

at::Tensor mul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return needs_autograd(a, b) ? MulFunction::apply(a, b) : call_below_autograd(mul_op(), a, b);
}

// As ATen's out= ops: no gradient flows through out=, so refuse rather than drop it silently.
at::Tensor& muladd_out_autograd(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  const bool needs_grad = at::GradMode::is_enabled() &&
                          ((a.defined() && a.requires_grad()) || (b.defined() && b.requires_grad()) ||
                           (out.defined() && out.requires_grad()));
  TORCH_CHECK(!needs_grad,
              "customops::muladd.out: out= arguments don't support automatic differentiation, but one of "
              "the arguments (a, b or out) requires grad; call customops.muladd(a, b, c) without out=");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    muladd_out_op().call(a, b, c, out);
  }
  out.unsafeGetTensorImpl()->bump_version();  // what ADInplaceOrView would have done
  return out;
}

// ---- Functionalize ------------------------------------------------------------------------------
// torch.compile and torch.export cannot functionalize a custom op that returns an alias of its
// out= argument, so muladd.out does it here, as ATen's out= ops do: compute with the functional
// muladd, then make out refer to the result.
at::Tensor unwrap_functional(const at::Tensor& t) {
  if (!at::functionalization::impl::isFunctionalTensor(t)) return t;
  at::functionalization::impl::sync(t);
  return at::functionalization::impl::from_functional_tensor(t);
}

at::Tensor& muladd_out_functionalize(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  at::Tensor a_ = unwrap_functional(a), b_ = unwrap_functional(b);
  if (!at::functionalization::impl::isFunctionalTensor(out)) {
    TORCH_CHECK(!at::functionalization::impl::isFunctionalTensor(a) && !at::functionalization::impl::isFunctionalTensor(b),
                "customops::muladd.out: out is not a functional tensor but a or b is");
    at::AutoDispatchSkipFunctionalize guard;
    at::Tensor out_ = out;
    muladd_out_op().call(a_, b_, c, out_);
    return out;
  }
  at::Tensor result;
  {
    at::AutoDispatchSkipFunctionalize guard;
    at::Tensor out_ = unwrap_functional(out);
    check_muladd_out(a_, b_, out_);
    result = muladd_op().call(a_, b_, c);
  }
  at::functionalization::impl::replace_(out, result);
  at::functionalization::impl::commit_update(out);
  at::functionalization::impl::sync(out);
  return out;
}

}  // namespace

// Functionalization of the out= variant.
TORCH_LIBRARY_IMPL(customops, Functionalize, m) { m.impl("muladd.out", &muladd_out_functionalize); }

// Meta kernels of the multiply-add family.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("muladd", &muladd_meta);
  m.impl("muladd.out", &muladd_out_meta);
  m.impl("mul", &mul_meta);
}

// Autograd kernels of the multiply-add family.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("muladd", &muladd_autograd);
  m.impl("muladd.out", &muladd_out_autograd);
  m.impl("mul", &mul_autograd);
}

}  // namespace customops
