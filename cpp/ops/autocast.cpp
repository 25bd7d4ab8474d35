// Autocast kernels shared by customops ops (see ops/autocast.h).
#include "ops/autocast.h"

#include <ATen/ATen.h>

namespace customops::autocast {

void promote_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n_args = op.schema().arguments().size();
  const size_t begin = stack->size() - n_args;
  std::optional<at::ScalarType> widest;
  for (size_t i = begin; i < stack->size(); ++i) {
    const c10::IValue& arg = (*stack)[i];
    if (!arg.isTensor() || !arg.toTensor().is_floating_point()) continue;
    const at::ScalarType t = arg.toTensor().scalar_type();
    widest = widest.has_value() ? at::promote_types(*widest, t) : t;
  }
  if (widest.has_value()) {
    for (size_t i = begin; i < stack->size(); ++i) {
      c10::IValue& arg = (*stack)[i];
      if (arg.isTensor() && arg.toTensor().is_floating_point() && arg.toTensor().scalar_type() != *widest) {
        arg = arg.toTensor().to(*widest);
      }
    }
  }
  Below below;
  op.callBoxed(stack);
}

std::optional<at::Tensor> norm_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight) {
  if (!weight.has_value() || !weight->defined() || !x.is_floating_point() || !weight->is_floating_point()) {
    return weight;
  }
  const at::ScalarType xt = x.scalar_type(), wt = weight->scalar_type();
  const bool half_x = xt == at::kHalf || xt == at::kBFloat16;
  if (wt == xt || (half_x && wt == at::kFloat)) return weight;
  return weight->to(half_x ? at::kFloat : xt);
}

}  // namespace customops::autocast
