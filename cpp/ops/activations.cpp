// silu, silu_mul, swiglu and scale_clamp with their private backward ops, device-independent
// parts: typed C++ API, Meta kernels and Autograd kernels. scale_clamp's backward is linear in
// grad_y and piecewise constant in x, so its double backward is exact; silu's, silu_mul's and
// swiglu's would need silu'' and raise a clear error instead.
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
// Backward ops of silu, silu_mul and swiglu: their derivative would need silu'', which no kernel
// computes.
template <const char* kOp>
[[noreturn]] void no_double_backward() {
  TORCH_CHECK(false, "double backward is not supported for customops::", kOp);
}
constexpr char kSilu[] = "silu";
constexpr char kSiluMul[] = "silu_mul";
constexpr char kSwiglu[] = "swiglu";

class SiluBackwardFunction : public torch::autograd::Function<SiluBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext*, const at::Tensor& dy, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return silu_backward_op().call(dy, x);
  }
  static variable_list backward(AutogradContext*, variable_list) { no_double_backward<kSilu>(); }
};

class SiluFunction : public torch::autograd::Function<SiluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x});
    return silu_op().call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {customops::silu_backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

class SiluMulBackwardFunction : public torch::autograd::Function<SiluMulBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dgate, dup] = silu_mul_backward_op().call(dy, gate, up);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext*, variable_list) { no_double_backward<kSiluMul>(); }
};

class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({gate, up});
    return silu_mul_op().call(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = customops::silu_mul_backward(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? dgate : at::Tensor(), ctx->needs_input_grad(1) ? dup : at::Tensor()};
  }
};

class SwigluBackwardFunction : public torch::autograd::Function<SwigluBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext*, const at::Tensor& dy, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return swiglu_backward_op().call(dy, x);
  }
  static variable_list backward(AutogradContext*, variable_list) { no_double_backward<kSwiglu>(); }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x});
    return swiglu_op().call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {customops::swiglu_backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

// d/d(grad_y) of the backward is the backward itself; d/dx is zero almost everywhere.
class ScaleClampBackwardFunction : public torch::autograd::Function<ScaleClampBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& dy, const at::Tensor& x, double scale, double lo,
                            double hi) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["lo"] = lo;
    ctx->saved_data["hi"] = hi;
    return scale_clamp_backward_op().call(dy, x, scale, lo, hi);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    at::Tensor ggrad = ctx->needs_input_grad(0) ? scale_clamp_backward(grads[0], x, ctx->saved_data["scale"].toDouble(),
                                                                      ctx->saved_data["lo"].toDouble(),
                                                                      ctx->saved_data["hi"].toDouble())
                                                : at::Tensor();
    return {ggrad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class ScaleClampFunction : public torch::autograd::Function<ScaleClampFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double scale, double lo, double hi) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["lo"] = lo;
    ctx->saved_data["hi"] = hi;
    return scale_clamp_op().call(x, scale, lo, hi);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {customops::scale_clamp_backward(grads[0], ctx->get_saved_variables()[0], ctx->saved_data["scale"].toDouble(),
                                 ctx->saved_data["lo"].toDouble(), ctx->saved_data["hi"].toDouble()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor silu_autograd(const at::Tensor& x) {
  return needs_autograd(x) ? SiluFunction::apply(x) : call_below_autograd(silu_op(), x);
}
at::Tensor silu_backward_autograd(const at::Tensor& dy, const at::Tensor& x) {
  return needs_autograd(dy, x) ? SiluBackwardFunction::apply(dy, x) : call_below_autograd(silu_backward_op(), dy, x);
}
at::Tensor silu_mul_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return needs_autograd(gate, up) ? SiluMulFunction::apply(gate, up) : call_below_autograd(silu_mul_op(), gate, up);
}
std::tuple<at::Tensor, at::Tensor> silu_mul_backward_autograd(const at::Tensor& dy, const at::Tensor& gate,
                                                              const at::Tensor& up) {
  if (!needs_autograd(dy, gate, up)) return call_below_autograd(silu_mul_backward_op(), dy, gate, up);
  auto g = SiluMulBackwardFunction::apply(dy, gate, up);
  return {g[0], g[1]};
}
at::Tensor swiglu_autograd(const at::Tensor& x) {
  return needs_autograd(x) ? SwigluFunction::apply(x) : call_below_autograd(swiglu_op(), x);
}
at::Tensor swiglu_backward_autograd(const at::Tensor& dy, const at::Tensor& x) {
  return needs_autograd(dy, x) ? SwigluBackwardFunction::apply(dy, x)
                               : call_below_autograd(swiglu_backward_op(), dy, x);
}
at::Tensor scale_clamp_autograd(const at::Tensor& x, double scale, double lo, double hi) {
  return needs_autograd(x) ? ScaleClampFunction::apply(x, scale, lo, hi)
                           : call_below_autograd(scale_clamp_op(), x, scale, lo, hi);
}
at::Tensor scale_clamp_backward_autograd(const at::Tensor& dy, const at::Tensor& x, double scale, double lo,
                                         double hi) {
  return needs_autograd(dy, x) ? ScaleClampBackwardFunction::apply(dy, x, scale, lo, hi)
                               : call_below_autograd(scale_clamp_backward_op(), dy, x, scale, lo, hi);
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

}  // namespace customops
