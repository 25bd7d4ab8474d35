// rope and _rope_backward, device-independent parts: typed C++ API, Meta kernels, Autograd
// kernels, vmap rules and the autocast kernel. rope is linear in q and k, so its backward is the
// transposed rotation of the output gradients (_rope_backward) and its tangent is rope of the
// tangents; the backward op is linear too (its transpose is rope), so double backward works.
// cos and sin come from positions and are not differentiable: asking for their
// gradient raises rather than returning a silent zero.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/layout.h"
#include "ops/rope.h"

namespace customops {
namespace {

using torch::autograd::variable_list;
using Pair = std::tuple<at::Tensor, at::Tensor>;
using RopeSig = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

const auto& rope_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("customops::rope", "").typed<RopeSig>();
  return op;
}

const auto& rope_backward_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("customops::_rope_backward", "").typed<RopeSig>();
  return op;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin, bool interleaved) {
  return rope_op().call(q, k, cos, sin, interleaved);
}

namespace {

// ---- Meta -------------------------------------------------------------------------------------
Pair rope_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool) {
  check_rope("customops::rope", q, k, cos, sin);
  return {heads_layout_like(q), heads_layout_like(k)};
}

Pair rope_backward_meta(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& cos,
                        const at::Tensor& sin, bool) {
  check_rope_backward(grad_q, grad_k, cos, sin);
  return {heads_layout_like(grad_q), heads_layout_like(grad_k)};
}

// ---- Autograd ---------------------------------------------------------------------------------
using autograd::BackwardArgs;
using autograd::Recorder;

// op (rope or its transpose) applied to a and b, where one of them may be undefined (no gradient
// or tangent reached it): the defined one stands in for both (q and k may differ in heads only),
// and the missing result stays undefined, which autograd reads as zero.
Pair rotate_defined(const decltype(rope_op())& op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& cos,
                    const at::Tensor& sin, bool interleaved) {
  if (a.defined() && b.defined()) return op.call(a, b, cos, sin, interleaved);
  if (a.defined()) return {std::get<0>(op.call(a, a, cos, sin, interleaved)), at::Tensor()};
  if (b.defined()) return {at::Tensor(), std::get<1>(op.call(b, b, cos, sin, interleaved))};
  return {at::Tensor(), at::Tensor()};
}

// Saved: cos, sin; attrs: interleaved.
variable_list rope_grad(const BackwardArgs& a) {
  auto [dq, dk] = rotate_defined(rope_backward_op(), a.grads[0], a.grads[1], a.saved[0], a.saved[1], a.attrs[0] != 0);
  return {a.needs[0] ? dq : at::Tensor(), a.needs[1] ? dk : at::Tensor()};
}

Pair rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                   bool interleaved) {
  TORCH_CHECK(!needs_grad_or_tangent(cos) && !needs_grad_or_tangent(sin),
              "customops::rope: cos and sin must not require grad (rope differentiates q and k only; cos and sin "
              "come from positions); pass cos.detach() and sin.detach()");
  Recorder rec(q, k);
  if (!rec) return call_below_autograd(rope_op(), q, k, cos, sin, interleaved);
  auto [qo, ko] = call_below_autograd(rope_op(), q, k, cos, sin, interleaved);
  rec.record<rope_grad>("RopeBackward", {qo, ko}, {Recorder::input(cos), Recorder::input(sin)},
                        {interleaved ? 1.0 : 0.0});
  if (rec.needs_tangent()) {
    auto [tq, tk] = rotate_defined(rope_op(), rec.tangent(0), rec.tangent(1), cos, sin, interleaved);
    if (tq.defined()) rec.set_tangent(qo, [&, &tq = tq] { return tq; });
    if (tk.defined()) rec.set_tangent(ko, [&, &tk = tk] { return tk; });
  }
  return {qo, ko};
}

// _rope_backward is linear in its gradients too, its transpose being rope: double backward works.
variable_list rope_backward_grad(const BackwardArgs& a) {
  auto [dq, dk] = rotate_defined(rope_op(), a.grads[0], a.grads[1], a.saved[0], a.saved[1], a.attrs[0] != 0);
  return {a.needs[0] ? dq : at::Tensor(), a.needs[1] ? dk : at::Tensor()};
}

Pair rope_backward_autograd(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& cos,
                            const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(!needs_grad_or_tangent(cos) && !needs_grad_or_tangent(sin),
              "customops::_rope_backward: cos and sin must not require grad");
  Recorder rec(grad_q, grad_k);
  if (!rec) return call_below_autograd(rope_backward_op(), grad_q, grad_k, cos, sin, interleaved);
  auto [dq, dk] = call_below_autograd(rope_backward_op(), grad_q, grad_k, cos, sin, interleaved);
  rec.record<rope_backward_grad>("RopeBackwardBackward", {dq, dk}, {Recorder::input(cos), Recorder::input(sin)},
                                 {interleaved ? 1.0 : 0.0});
  if (rec.needs_tangent()) {
    auto [tq, tk] = rotate_defined(rope_backward_op(), rec.tangent(0), rec.tangent(1), cos, sin, interleaved);
    if (tq.defined()) rec.set_tangent(dq, [&, &tq = tq] { return tq; });
    if (tk.defined()) rec.set_tangent(dk, [&, &tk = tk] { return tk; });
  }
  return {dq, dk};
}

// ---- vmap -------------------------------------------------------------------------------------
// The vmap batch folds into rope's own batch dim B: q [E, B, H, S, D] -> [E*B, H, S, D]; cos and
// sin follow (broadcast over E or B where they were), one call for the whole batch.
at::Tensor fold_cos(const batching::Level& level, const at::Tensor& c, const c10::SymInt& e, const c10::SymInt& b) {
  at::Tensor t = level.front_if_batched(c);
  if (!t.defined()) {  // shared by every entry: [S, R] and [1, S, R] broadcast as they are
    if (c.dim() == 2 || c.sym_size(0) == 1) return c;
    t = c.unsqueeze(0).expand_symint({e, c.sym_size(0), c.sym_size(1), c.sym_size(2)});
  } else if (t.dim() == 3) {  // [E, S, R]: the same for every b
    t = t.unsqueeze(1);
  }
  t = t.expand_symint({e, b, t.sym_size(2), t.sym_size(3)});
  return t.reshape_symint({e * b, t.sym_size(2), t.sym_size(3)});
}

template <typename Op>
Pair rope_batched_with(const Op& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin, bool interleaved) {
  batching::Level level({q, k, cos, sin});
  auto batch = level.batch_size({q, k, cos, sin});
  if (!batch) return op.call(q, k, cos, sin, interleaved);
  const at::Tensor q_ = level.front(q, *batch), k_ = level.front(k, *batch);
  const c10::SymInt e = *batch, b = q_.sym_size(1);
  auto fold = [&](const at::Tensor& t) {
    return t.reshape_symint({e * b, t.sym_size(2), t.sym_size(3), t.sym_size(4)});
  };
  auto [qo, ko] = op.call(fold(q_), fold(k_), fold_cos(level, cos, e, b), fold_cos(level, sin, e, b), interleaved);
  return {level.wrap(qo.reshape_symint(q_.sym_sizes())), level.wrap(ko.reshape_symint(k_.sym_sizes()))};
}

Pair rope_batched(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved) {
  return rope_batched_with(rope_op(), q, k, cos, sin, interleaved);
}

Pair rope_backward_batched(const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& cos,
                           const at::Tensor& sin, bool interleaved) {
  return rope_batched_with(rope_backward_op(), grad_q, grad_k, cos, sin, interleaved);
}

// ---- Autocast: k, cos and sin follow q's dtype (the activations'; Hugging Face casts cos and
// sin to it too) -------------------------------------------------------------------------------
Pair rope_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                   bool interleaved) {
  auto like_q = [&](const at::Tensor& t) {
    return t.is_floating_point() && q.is_floating_point() && t.scalar_type() != q.scalar_type() ? t.to(q.scalar_type()) : t;
  };
  const at::Tensor k_ = like_q(k), c_ = like_q(cos), s_ = like_q(sin);
  autocast::Below below;
  return rope_op().call(q, k_, c_, s_, interleaved);
}

}  // namespace

// Meta kernels of rope.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("rope", &rope_meta);
  m.impl("_rope_backward", &rope_backward_meta);
}

// Autograd kernels of rope.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("rope", &rope_autograd);
  m.impl("_rope_backward", &rope_backward_autograd);
}

// Autocast kernel of rope.
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("rope", &rope_autocast); }

// vmap batching rules of rope.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("rope", &rope_batched);
  m.impl("_rope_backward", &rope_backward_batched);
}

}  // namespace customops
