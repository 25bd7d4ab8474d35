// vmap batching rules shared by customops ops (see ops/batching.h): the boxed leading-dims rule
// and the pieces unboxed rules are written with.
//
// The level being processed is read off the arguments rather than functorch's dynamic-layer
// stack, whose header needs nlohmann/json (not shipped with torch): it is the highest level among
// the arguments' batched wrappers. By the time a call reaches FuncTorchBatched every wrapper of a
// higher layer has been taken off, so that level is the current one whenever any argument is
// batched at it; when none is, processing the highest level present here gives what the next
// layer down would compute.
#include "ops/batching.h"

#include <ATen/ATen.h>
#include <ATen/functorch/BatchedTensorImpl.h>

#include <algorithm>
#include <vector>

namespace customops::batching {

using at::functorch::makeBatched;
using at::functorch::maybeGetBatchedImpl;

namespace {

int64_t level_of(const at::Tensor& t) {
  const auto* b = t.defined() ? maybeGetBatchedImpl(t) : nullptr;
  return b != nullptr ? b->level() : -1;
}

// (value, bdim) of t at `level`: its batched wrapper's contents, or t itself when unbatched there.
std::pair<at::Tensor, std::optional<int64_t>> unwrap(const at::Tensor& t, int64_t level) {
  const auto* b = t.defined() ? maybeGetBatchedImpl(t) : nullptr;
  if (b == nullptr || b->level() != level) return {t, std::nullopt};
  return {b->value(), b->bdim()};
}

}  // namespace

Level::Level(c10::ArrayRef<at::Tensor> args) {
  for (const auto& t : args) id_ = std::max(id_, level_of(t));
}

bool Level::batched(const at::Tensor& t) const { return id_ >= 0 && level_of(t) == id_; }

std::optional<c10::SymInt> Level::batch_size(c10::ArrayRef<at::Tensor> ts) const {
  for (const auto& t : ts) {
    if (!batched(t)) continue;
    auto [value, bdim] = unwrap(t, id_);
    return value.sym_size(*bdim);
  }
  return std::nullopt;
}

at::Tensor Level::front(const at::Tensor& t, const c10::SymInt& batch) const {
  auto [value, bdim] = unwrap(t, id_);
  if (bdim.has_value()) return value.movedim(*bdim, 0);
  std::vector<c10::SymInt> sizes{batch};
  for (const auto& s : value.sym_sizes()) sizes.push_back(s);
  return value.unsqueeze(0).expand_symint(sizes);
}

at::Tensor Level::front_if_batched(const at::Tensor& t) const {
  if (!batched(t)) return at::Tensor();
  auto [value, bdim] = unwrap(t, id_);
  return value.movedim(*bdim, 0);
}

at::Tensor Level::wrap(const at::Tensor& t) const { return makeBatched(t, 0, id_); }
at::Tensor Level::wrap_unbatched(const at::Tensor& t) const { return t; }

void leading_dims_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t n_returns = schema.returns().size();
  const size_t begin = stack->size() - n_args;
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < n_args; ++i) {
    if ((*stack)[begin + i].isTensor()) tensors.push_back((*stack)[begin + i].toTensor());
  }
  Level level(tensors);
  std::optional<c10::SymInt> batch = level.batch_size(tensors);
  if (!batch.has_value()) {
    op.callBoxed(stack);
    return;
  }

  std::optional<at::Tensor> written;  // the out= argument, returned as it came
  for (size_t i = 0; i < n_args; ++i) {
    c10::IValue& arg = (*stack)[begin + i];
    if (!arg.isTensor()) continue;
    const at::Tensor t = arg.toTensor();
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      TORCH_CHECK(level.batched(t), schema.operator_name(), ": vmap: ", schema.arguments()[i].name(),
                  " is not batched but an input is; the results of all entries cannot be written into one "
                  "unbatched tensor (batch ", schema.arguments()[i].name(), " too, or call the op without it)");
      written = t;
    }
    arg = level.front(t, *batch);
  }

  op.callBoxed(stack);

  for (size_t i = stack->size() - n_returns; i < stack->size(); ++i) {
    c10::IValue& ret = (*stack)[i];
    TORCH_INTERNAL_ASSERT(ret.isTensor(), schema.name(), ": the leading-dims batching rule takes ops that return tensors");
    ret = written.has_value() ? *written : level.wrap(ret.toTensor());
  }
}

}  // namespace customops::batching
