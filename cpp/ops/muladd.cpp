// muladd, muladd.out and mul, device-independent parts: the typed C++ API (through the
// dispatcher), the Meta kernels (symbolic sizes, same checks as the real kernels) and the
// Autograd kernels. Backward formulas call only dispatcher ops, so double backward works.
#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/muladd.h"

namespace customops {
namespace {

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
// d(a*b + c) = b da + a db for both ops (c is a constant); the formulas use mul, whose own
// Autograd kernel makes double backward and forward-over-reverse work.
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list mul_grad(const BackwardArgs& a) {
  const at::Tensor& g = a.grads[0];
  return {a.needs[0] ? customops::mul(g, a.saved[1]) : at::Tensor(), a.needs[1] ? customops::mul(g, a.saved[0]) : at::Tensor()};
}

at::Tensor mul_tangent(const Recorder& rec) {
  return autograd::sum_defined({rec.has_tangent(0) ? customops::mul(rec.tangent(0), rec.primal(1)) : at::Tensor(),
                                rec.has_tangent(1) ? customops::mul(rec.primal(0), rec.tangent(1)) : at::Tensor()});
}

at::Tensor muladd_autograd(const at::Tensor& a, const at::Tensor& b, double c) {
  Recorder rec(a, b);
  if (!rec) return call_below_autograd(muladd_op(), a, b, c);
  at::Tensor y = call_below_autograd(muladd_op(), a, b, c);
  rec.record<mul_grad>("MulAddBackward", {y}, {Recorder::input(a), Recorder::input(b)});
  rec.set_tangent(y, [&] { return mul_tangent(rec); });
  return y;
}

at::Tensor mul_autograd(const at::Tensor& a, const at::Tensor& b) {
  Recorder rec(a, b);
  if (!rec) return call_below_autograd(mul_op(), a, b);
  at::Tensor y = call_below_autograd(mul_op(), a, b);
  rec.record<mul_grad>("MulBackward", {y}, {Recorder::input(a), Recorder::input(b)});
  rec.set_tangent(y, [&] { return mul_tangent(rec); });
  return y;
}

// As ATen's out= ops: no gradient flows through out=, so refuse rather than drop it silently.
at::Tensor& muladd_out_autograd(const at::Tensor& a, const at::Tensor& b, double c, at::Tensor& out) {
  TORCH_CHECK(!needs_autograd(a, b, out),
              "customops::muladd.out: out= arguments don't support automatic differentiation, but one of "
              "the arguments (a, b or out) requires grad or carries a forward-mode tangent; call "
              "customops.muladd(a, b, c) without out=");
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

// Autocast kernels: mixed inputs promote to the widest dtype, as ATen's promote ops do.
CUSTOMOPS_AUTOCAST_IMPL(m) {
  m.impl("muladd", autocast::promote());
  m.impl("mul", autocast::promote());
}

// vmap batching rules: every tensor argument shares the rows.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("muladd", batching::leading_dims());
  m.impl("muladd.out", batching::leading_dims());
  m.impl("mul", batching::leading_dims());
}

}  // namespace customops
