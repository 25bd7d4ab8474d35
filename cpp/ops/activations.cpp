// silu, silu_mul, swiglu and scale_clamp with their private backward ops, device-independent
// parts: typed C++ API, Meta kernels and Autograd kernels. scale_clamp's backward is linear in
// grad_y and piecewise constant in x, so its double backward is exact; silu's, silu_mul's and
// swiglu's would need silu'' and raise a clear error instead.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/llm.h"
#include "ops/row_view.h"

namespace customops {
namespace {

using torch::autograd::variable_list;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const auto& silu_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&)>("customops::silu");
  return op;
}
const auto& silu_backward_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("customops::_silu_backward");
  return op;
}
const auto& silu_mul_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("customops::silu_mul");
  return op;
}
const auto& silu_mul_backward_op() {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "customops::_silu_mul_backward");
  return op;
}
const auto& swiglu_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&)>("customops::swiglu");
  return op;
}
const auto& swiglu_backward_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("customops::_swiglu_backward");
  return op;
}
const auto& scale_clamp_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&, double, double, double)>("customops::scale_clamp");
  return op;
}
const auto& scale_clamp_backward_op() {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, double, double)>(
      "customops::_scale_clamp_backward");
  return op;
}

}  // namespace

at::Tensor silu(const at::Tensor& x) { return silu_op().call(x); }
at::Tensor silu_backward(const at::Tensor& grad_y, const at::Tensor& x) { return silu_backward_op().call(grad_y, x); }
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) { return silu_mul_op().call(gate, up); }
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_y, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  return silu_mul_backward_op().call(grad_y, gate, up);
}
at::Tensor swiglu(const at::Tensor& x) { return swiglu_op().call(x); }
at::Tensor swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x) {
  return swiglu_backward_op().call(grad_y, x);
}
at::Tensor scale_clamp(const at::Tensor& x, double scale, double lo, double hi) {
  return scale_clamp_op().call(x, scale, lo, hi);
}
at::Tensor scale_clamp_backward(const at::Tensor& grad_y, const at::Tensor& x, double scale, double lo, double hi) {
  return scale_clamp_backward_op().call(grad_y, x, scale, lo, hi);
}

namespace {

// ---- Meta: every output is a fresh contiguous tensor shaped like the (first) input -------------
at::Tensor like(const at::Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); }

at::Tensor silu_meta(const at::Tensor& x) {
  check_unary("customops::silu", x);
  return like(x);
}
at::Tensor silu_backward_meta(const at::Tensor& dy, const at::Tensor& x) {
  check_unary("customops::_silu_backward", x);
  check_grad_like("customops::_silu_backward", dy, "x", x);
  return like(x);
}
at::Tensor silu_mul_meta(const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul("customops::silu_mul", gate, up);
  return like(gate);
}
std::tuple<at::Tensor, at::Tensor> silu_mul_backward_meta(const at::Tensor& dy, const at::Tensor& gate,
                                                          const at::Tensor& up) {
  check_silu_mul("customops::_silu_mul_backward", gate, up);
  check_grad_like("customops::_silu_mul_backward", dy, "gate", gate);
  return {like(gate), like(gate)};
}
at::Tensor swiglu_meta(const at::Tensor& x) {
  check_swiglu("customops::swiglu", x);
  auto sizes = x.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return at::empty_symint(sizes, x.options());
}
at::Tensor swiglu_backward_meta(const at::Tensor& dy, const at::Tensor& x) {
  check_swiglu_backward(dy, x);
  return like(x);
}
at::Tensor scale_clamp_meta(const at::Tensor& x, double /*scale*/, double lo, double hi) {
  check_scale_clamp("customops::scale_clamp", x, lo, hi);
  return like(x);
}
at::Tensor scale_clamp_backward_meta(const at::Tensor& dy, const at::Tensor& x, double /*scale*/, double lo,
                                     double hi) {
  check_scale_clamp("customops::_scale_clamp_backward", x, lo, hi);
  check_grad_like("customops::_scale_clamp_backward", dy, "x", x);
  return like(x);
}

// ---- Autograd ---------------------------------------------------------------------------------
// Each backward op is linear in grad_y, so it is also its op's tangent formula (with the input's
// tangent in grad_y's place). The backward ops of silu, silu_mul and swiglu have no derivative
// (it would need silu''): their second-order uses raise a clear error.
constexpr char kSilu[] = "silu";
constexpr char kSiluMul[] = "silu_mul";
constexpr char kSwiglu[] = "swiglu";
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list silu_grad(const BackwardArgs& a) { return {customops::silu_backward(a.grads[0], a.saved[0])}; }

at::Tensor silu_autograd(const at::Tensor& x) {
  Recorder rec(x);
  if (!rec) return call_below_autograd(silu_op(), x);
  at::Tensor y = call_below_autograd(silu_op(), x);
  rec.record<silu_grad>("SiluBackward", {y}, {Recorder::input(x)});
  rec.set_tangent(y, [&] { return customops::silu_backward(rec.tangent(0), rec.primal(0)); });
  return y;
}

at::Tensor silu_backward_autograd(const at::Tensor& dy, const at::Tensor& x) {
  Recorder rec(dy, x);
  if (!rec) return call_below_autograd(silu_backward_op(), dy, x);
  return rec.backward_op<kSilu>(silu_backward_op(), dy, x);
}

// d(silu(g) * u) = silu'(g) u dg + silu(g) du: the first term is _silu_mul_backward's grad_gate
// with dg as grad_y, the second silu_mul(g, du).
at::Tensor silu_mul_tangent(const at::Tensor& gate_t, const at::Tensor& up_t, const at::Tensor& gate,
                            const at::Tensor& up) {
  return autograd::sum_defined({gate_t.defined() ? std::get<0>(customops::silu_mul_backward(gate_t, gate, up)) : at::Tensor(),
                                up_t.defined() ? customops::silu_mul(gate, up_t) : at::Tensor()});
}

variable_list silu_mul_grad(const BackwardArgs& a) {
  auto [dgate, dup] = customops::silu_mul_backward(a.grads[0], a.saved[0], a.saved[1]);
  return {dgate, dup};
}

at::Tensor silu_mul_autograd(const at::Tensor& gate, const at::Tensor& up) {
  Recorder rec(gate, up);
  if (!rec) return call_below_autograd(silu_mul_op(), gate, up);
  at::Tensor y = call_below_autograd(silu_mul_op(), gate, up);
  rec.record<silu_mul_grad>("SiluMulBackward", {y}, {Recorder::input(gate), Recorder::input(up)});
  rec.set_tangent(y, [&] { return silu_mul_tangent(rec.tangent(0), rec.tangent(1), rec.primal(0), rec.primal(1)); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_autograd(const at::Tensor& dy, const at::Tensor& gate,
                                                              const at::Tensor& up) {
  Recorder rec(dy, gate, up);
  if (!rec) return call_below_autograd(silu_mul_backward_op(), dy, gate, up);
  return rec.backward_op<kSiluMul>(silu_mul_backward_op(), dy, gate, up);
}

variable_list swiglu_grad(const BackwardArgs& a) { return {customops::swiglu_backward(a.grads[0], a.saved[0])}; }

at::Tensor swiglu_autograd(const at::Tensor& x) {
  Recorder rec(x);
  if (!rec) return call_below_autograd(swiglu_op(), x);
  at::Tensor y = call_below_autograd(swiglu_op(), x);
  rec.record<swiglu_grad>("SwigluBackward", {y}, {Recorder::input(x)});
  rec.set_tangent(y, [&] {
    auto [gate, up] = halves(rec.primal(0));
    auto [gate_t, up_t] = halves(rec.tangent(0));
    return silu_mul_tangent(gate_t, up_t, gate, up);
  });
  return y;
}

at::Tensor swiglu_backward_autograd(const at::Tensor& dy, const at::Tensor& x) {
  Recorder rec(dy, x);
  if (!rec) return call_below_autograd(swiglu_backward_op(), dy, x);
  return rec.backward_op<kSwiglu>(swiglu_backward_op(), dy, x);
}

// scale_clamp's backward is grad_y * scale inside (lo, hi) and 0 outside: linear in grad_y and
// piecewise constant in x, so it is its own derivative (d/dx is 0 almost everywhere) and its own
// tangent formula. Saved: x; attrs: scale, lo, hi.
at::Tensor scale_clamp_backward_from(const at::Tensor& g, const at::Tensor& x, const std::vector<double>& attrs) {
  return customops::scale_clamp_backward(g, x, attrs[0], attrs[1], attrs[2]);
}

variable_list scale_clamp_grad(const BackwardArgs& a) { return {scale_clamp_backward_from(a.grads[0], a.saved[0], a.attrs)}; }

variable_list scale_clamp_backward_grad(const BackwardArgs& a) {
  return {scale_clamp_backward_from(a.grads[0], a.saved[0], a.attrs), at::Tensor()};
}

at::Tensor scale_clamp_autograd(const at::Tensor& x, double scale, double lo, double hi) {
  Recorder rec(x);
  if (!rec) return call_below_autograd(scale_clamp_op(), x, scale, lo, hi);
  at::Tensor y = call_below_autograd(scale_clamp_op(), x, scale, lo, hi);
  rec.record<scale_clamp_grad>("ScaleClampBackward", {y}, {Recorder::input(x)}, {scale, lo, hi});
  rec.set_tangent(y, [&] { return customops::scale_clamp_backward(rec.tangent(0), rec.primal(0), scale, lo, hi); });
  return y;
}

at::Tensor scale_clamp_backward_autograd(const at::Tensor& dy, const at::Tensor& x, double scale, double lo,
                                         double hi) {
  Recorder rec(dy, x);
  if (!rec) return call_below_autograd(scale_clamp_backward_op(), dy, x, scale, lo, hi);
  at::Tensor dx = call_below_autograd(scale_clamp_backward_op(), dy, x, scale, lo, hi);
  rec.record<scale_clamp_backward_grad>("ScaleClampBackwardBackward", {dx}, {Recorder::input(x)}, {scale, lo, hi});
  rec.set_tangent(dx, [&] {
    return rec.has_tangent(0) ? customops::scale_clamp_backward(rec.tangent(0), rec.primal(1), scale, lo, hi)
                              : at::zeros_like(dx);
  });
  return dx;
}

}  // namespace

// Meta kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("silu", &silu_meta);
  m.impl("_silu_backward", &silu_backward_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("_silu_mul_backward", &silu_mul_backward_meta);
  m.impl("swiglu", &swiglu_meta);
  m.impl("_swiglu_backward", &swiglu_backward_meta);
  m.impl("scale_clamp", &scale_clamp_meta);
  m.impl("_scale_clamp_backward", &scale_clamp_backward_meta);
}

// Autograd kernels of silu, silu_mul, swiglu, scale_clamp and their backward ops.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("silu", &silu_autograd);
  m.impl("_silu_backward", &silu_backward_autograd);
  m.impl("silu_mul", &silu_mul_autograd);
  m.impl("_silu_mul_backward", &silu_mul_backward_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("_swiglu_backward", &swiglu_backward_autograd);
  m.impl("scale_clamp", &scale_clamp_autograd);
  m.impl("_scale_clamp_backward", &scale_clamp_backward_autograd);
}

// Autocast kernels: mixed inputs promote to the widest dtype, as ATen's promote ops do.
CUSTOMOPS_AUTOCAST_IMPL(m) {
  m.impl("silu_mul", autocast::promote());
}

// vmap batching rules: every tensor argument shares the rows.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("silu", batching::leading_dims());
  m.impl("_silu_backward", batching::leading_dims());
  m.impl("silu_mul", batching::leading_dims());
  m.impl("_silu_mul_backward", batching::leading_dims());
  m.impl("swiglu", batching::leading_dims());
  m.impl("_swiglu_backward", batching::leading_dims());
  m.impl("scale_clamp", batching::leading_dims());
  m.impl("_scale_clamp_backward", batching::leading_dims());
}

}  // namespace customops
