// Internal: vmap support (batching rules at the FuncTorchBatched key), written once. Most
// customops ops act on rows over leading dims that all their tensor arguments share
// (elementwise ops, row-wise ops, their backward ops); for them one boxed rule moves every batch
// dim to the front (expanding unbatched arguments) and calls the op once on the whole batch:
//
//   TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) { m.impl("silu", batching::leading_dims()); }
//
// Ops with an argument that is not batched along with the rows (a norm's weight) write an
// unboxed rule from the pieces below.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <optional>

namespace customops::batching {

void leading_dims_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The boxed rule for ops whose tensor arguments all share their leading dims. out= arguments
// must be batched when an input is (as ATen's in-place rules require); they are written in place.
inline torch::CppFunction leading_dims() { return torch::CppFunction::makeFromBoxedFunction<&leading_dims_rule>(); }

// Pieces of unboxed rules. A rule first takes the Level of its tensor arguments (which excludes
// FuncTorchBatched for the calls it makes), and calls the op unchanged when none is batched.
class Level {
 public:
  explicit Level(c10::ArrayRef<at::Tensor> args);
  bool batched(const at::Tensor& t) const;
  // The batch size of the first batched tensor among ts (nullopt when none is).
  std::optional<c10::SymInt> batch_size(c10::ArrayRef<at::Tensor> ts) const;
  // t's value at this level with its batch dim first; unbatched tensors expanded to `batch`.
  at::Tensor front(const at::Tensor& t, const c10::SymInt& batch) const;
  // t's value at this level with its batch dim first; undefined when t is not batched here.
  at::Tensor front_if_batched(const at::Tensor& t) const;
  // A result batched along dim 0 (or unbatched) at this level.
  at::Tensor wrap(const at::Tensor& t) const;
  at::Tensor wrap_unbatched(const at::Tensor& t) const;

 private:
  c10::impl::ExcludeDispatchKeyGuard guard_{c10::DispatchKey::FuncTorchBatched};
  int64_t id_ = -1;
};

}  // namespace customops::batching
