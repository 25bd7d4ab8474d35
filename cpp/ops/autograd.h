// Internal: the fast path every Autograd kernel takes when no gradient is needed.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <optional>

namespace customops {

inline bool needs_grad_or_tangent(const at::Tensor& t) {
  return t.defined() && ((at::GradMode::is_enabled() && t.requires_grad()) || torch::autograd::isFwGradDefined(t));
}
inline bool needs_grad_or_tangent(const std::optional<at::Tensor>& t) {
  return t.has_value() && needs_grad_or_tangent(*t);
}

// True when a call must go through its torch::autograd::Function: grad mode is on and an input
// requires grad, or an input carries a forward-mode tangent (Function::apply then raises, as no
// forward-mode formula exists). Otherwise the kernel calls below autograd directly, as ATen's
// VariableType kernels do: Function::apply would build a graph node only to drop it (about 1 us
// per call on tiny tensors).
template <typename... Ts>
bool needs_autograd(const Ts&... inputs) {
  return (needs_grad_or_tangent(inputs) || ...);
}

// op.call(args...) below the Autograd key.
template <typename Op, typename... Args>
decltype(auto) call_below_autograd(const Op& op, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(args...);
}

}  // namespace customops
