// Internal: torch.autocast support, written once. Autocast sits above Autograd in the dispatcher,
// so an autocast kernel casts the inputs, then calls the op again below autocast; autograd then
// records the casts and the op on the cast inputs, and the backward runs in the precision the
// forward used. Ops register their policy for CPU and CUDA in one block:
//
//   CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("mul", autocast::promote()); }
//
// Ops with no autocast kernel (the unary ones) run in their input's dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>

namespace customops::autocast {

// For the calls an autocast kernel makes: below every autocast key.
struct Below {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// "promote", as ATen's promote ops: every floating tensor argument is cast to the widest floating
// dtype among them (bfloat16 with float16 gives float32).
void promote_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack);
inline torch::CppFunction promote() { return torch::CppFunction::makeFromBoxedFunction<&promote_rule>(); }

// The weight a norm uses under autocast: x keeps its dtype (the norm returns it); a weight of x's
// dtype, or a float32 weight with a half-type x, is used as it is (no cast, no copy); any other
// weight is cast to float32 for a half-type x and to x's dtype otherwise.
std::optional<at::Tensor> norm_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight);

}  // namespace customops::autocast

#define CUSTOMOPS_AUTOCAST_CONCAT_(a, b) a##b
#define CUSTOMOPS_AUTOCAST_CONCAT(a, b) CUSTOMOPS_AUTOCAST_CONCAT_(a, b)
// Registers the block that follows at both AutocastCPU and AutocastCUDA.
#define CUSTOMOPS_AUTOCAST_IMPL(lib)                                                               \
  static void CUSTOMOPS_AUTOCAST_CONCAT(customops_autocast_impl_, __LINE__)(torch::Library&);     \
  TORCH_LIBRARY_IMPL(customops, AutocastCPU, l) { CUSTOMOPS_AUTOCAST_CONCAT(customops_autocast_impl_, __LINE__)(l); } \
  TORCH_LIBRARY_IMPL(customops, AutocastCUDA, l) { CUSTOMOPS_AUTOCAST_CONCAT(customops_autocast_impl_, __LINE__)(l); } \
  static void CUSTOMOPS_AUTOCAST_CONCAT(customops_autocast_impl_, __LINE__)(torch::Library & lib)
