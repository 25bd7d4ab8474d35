// cross_entropy and _cross_entropy_backward, device-independent parts: typed C++ API, the CPU and
// CUDA kernels over each device's kernel set (cpp/cpu, cuda/), Meta kernels, Autograd kernels and
// vmap rules. The row's log-sum-exp is an output: the backward reuses it (one pass over the
// logits each way), and it is differentiable, so a z-loss lse**2 costs no second pass. Under autocast the op needs no kernel: it reads half-type logits as they
// are and computes in float32 (ATen's cross_entropy casts them to float32 first).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/cross_entropy.h"
#include "ops/row_view.h"

namespace customops {
namespace {

using torch::autograd::variable_list;

const auto& cross_entropy_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::cross_entropy", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op;
}

const auto& cross_entropy_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_cross_entropy_backward", "")
                       .typed<at::Tensor(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                 int64_t ignore_index, double label_smoothing) {
  return cross_entropy_op().call(logits, target, ignore_index, label_smoothing);
}

void check_target_range(const char* op, const at::Tensor& target, int64_t v, int64_t ignore_index) {
  if (target.numel() == 0) return;
  const at::Tensor bad = (target != ignore_index).logical_and_((target < 0).logical_or_(target >= v)).reshape(-1);
  if (!bad.any().item<bool>()) return;
  const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
  TORCH_CHECK(false, op, ": target holds ", target.reshape(-1)[i].item<int64_t>(), " at index ", i, ", outside [0, ", v,
              ") and not ignore_index (", ignore_index, ")");
}

namespace {

// ---- CPU and CUDA: one implementation over the device's kernels ------------------------------

// logits as [rows, V] with a unit last stride (read in place when its rows have one stride).
at::Tensor as_2d(const at::Tensor& logits) {
  const at::Tensor r = as_rows(logits);
  return r.dim() == 2 ? r : r.view({-1, r.size(-1)});
}

at::Tensor flat(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous().view(-1) : at::Tensor();
}

template <const CrossEntropyKernels& (*Kernels)()>
std::tuple<at::Tensor, at::Tensor> cross_entropy_device(const at::Tensor& logits, const at::Tensor& target,
                                                        int64_t ignore_index, double eps) {
  constexpr const char* op = "customops::cross_entropy";
  check_cross_entropy(op, logits, target, eps);
  if (logits.is_cpu()) check_target_range(op, target, logits.size(-1), ignore_index);
  const auto opts = logits.options().dtype(cross_entropy_acc_dtype(logits.scalar_type()));
  at::Tensor loss = at::empty(target.sizes(), opts), lse = at::empty(target.sizes(), opts);
  Kernels().forward(as_2d(logits), target.contiguous().view(-1), ignore_index, eps, loss.view(-1), lse.view(-1));
  return {loss, lse};
}

template <const CrossEntropyKernels& (*Kernels)()>
at::Tensor cross_entropy_backward_device(const std::optional<at::Tensor>& grad_loss,
                                         const std::optional<at::Tensor>& grad_lse, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                                         double eps) {
  check_cross_entropy_backward(grad_loss, grad_lse, logits, target, lse, eps);
  if (logits.is_cpu()) check_target_range("customops::_cross_entropy_backward", target, logits.size(-1), ignore_index);
  at::Tensor grad = at::empty(logits.sizes(), logits.options());
  Kernels().backward(flat(grad_loss), flat(grad_lse), as_2d(logits), target.contiguous().view(-1),
                     lse.contiguous().view(-1), ignore_index, eps, 0, logits.size(-1), grad.view({-1, logits.size(-1)}));
  return grad;
}

// ---- Meta -------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> cross_entropy_meta(const at::Tensor& logits, const at::Tensor& target,
                                                      int64_t /*ignore_index*/, double label_smoothing) {
  check_cross_entropy("customops::cross_entropy", logits, target, label_smoothing);
  const auto opts = logits.options().dtype(cross_entropy_acc_dtype(logits.scalar_type()));
  return {at::empty_symint(target.sym_sizes(), opts), at::empty_symint(target.sym_sizes(), opts)};
}

at::Tensor cross_entropy_backward_meta(const std::optional<at::Tensor>& grad_loss,
                                       const std::optional<at::Tensor>& grad_lse, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t /*ignore_index*/,
                                       double label_smoothing) {
  check_cross_entropy_backward(grad_loss, grad_lse, logits, target, lse, label_smoothing);
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

// ---- Autograd ---------------------------------------------------------------------------------
// Differentiable outputs: loss and lse. Saved: logits, target, lse; attrs: ignore_index,
// label_smoothing (an index is exact in a double).
constexpr char kCrossEntropy[] = "cross_entropy";
using autograd::BackwardArgs;
using autograd::Recorder;

variable_list cross_entropy_grad(const BackwardArgs& a) {
  const at::Tensor &gl = a.grads[0], &gz = a.grads[1];
  if (!a.needs[0] || (!gl.defined() && !gz.defined())) return {at::Tensor()};
  return {cross_entropy_backward_op().call(optional_defined(gl), optional_defined(gz), a.saved[0], a.saved[1],
                                           a.saved[2], static_cast<int64_t>(a.attrs[0]), a.attrs[1])};
}

// Tangents (ATen ops, in the accumulation dtype): lse' = sum(p * t) and
// loss' = lse' - (1 - eps) * t[target] - eps * mean(t), 0 where target == ignore_index.
std::tuple<at::Tensor, at::Tensor> cross_entropy_tangents(const at::Tensor& logits, const at::Tensor& t,
                                                          const at::Tensor& target, const at::Tensor& lse,
                                                          int64_t ignore_index, double eps) {
  const at::ScalarType acc = lse.scalar_type();
  const at::Tensor tt = t.to(acc);
  const at::Tensor p = (logits.to(acc) - lse.unsqueeze(-1)).exp();
  const at::Tensor tlse = (p * tt).sum(-1);
  const at::Tensor ignored = target == ignore_index;
  const at::Tensor t_target = tt.gather(-1, target.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1);
  at::Tensor tloss = tlse - t_target * (1.0 - eps);
  if (eps != 0.0) tloss = tloss - tt.mean(-1) * eps;
  return {tloss.masked_fill(ignored, 0), tlse};
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target,
                                                          int64_t ignore_index, double label_smoothing) {
  Recorder rec(logits);
  if (!rec) return call_below_autograd(cross_entropy_op(), logits, target, ignore_index, label_smoothing);
  auto [loss, lse] = call_below_autograd(cross_entropy_op(), logits, target, ignore_index, label_smoothing);
  rec.record<cross_entropy_grad>("CrossEntropyBackward", {loss, lse},
                                 {Recorder::input(logits), Recorder::input(target), Recorder::output(lse)},
                                 {static_cast<double>(ignore_index), label_smoothing});
  if (rec.needs_tangent()) {
    auto [tloss, tlse] =
        cross_entropy_tangents(rec.primal(0), rec.tangent(0), target, lse.detach(), ignore_index, label_smoothing);
    rec.set_tangent(loss, [&, &tloss = tloss] { return tloss; });
    rec.set_tangent(lse, [&, &tlse = tlse] { return tlse; });
  }
  return {loss, lse};
}

at::Tensor cross_entropy_backward_autograd(const std::optional<at::Tensor>& grad_loss,
                                           const std::optional<at::Tensor>& grad_lse, const at::Tensor& logits,
                                           const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                                           double label_smoothing) {
  Recorder rec(grad_loss, grad_lse, logits, lse);
  if (!rec) {
    return call_below_autograd(cross_entropy_backward_op(), grad_loss, grad_lse, logits, target, lse, ignore_index,
                               label_smoothing);
  }
  return rec.backward_op<kCrossEntropy>(cross_entropy_backward_op(), grad_loss, grad_lse, logits, target, lse,
                                        ignore_index, label_smoothing);
}

}  // namespace

// Meta kernels of cross_entropy.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("cross_entropy", &cross_entropy_meta);
  m.impl("_cross_entropy_backward", &cross_entropy_backward_meta);
}

// Autograd kernels of cross_entropy.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("_cross_entropy_backward", &cross_entropy_backward_autograd);
}

// CPU and CUDA kernels of cross_entropy.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("cross_entropy", &cross_entropy_device<cross_entropy_kernels_cpu>);
  m.impl("_cross_entropy_backward", &cross_entropy_backward_device<cross_entropy_kernels_cpu>);
}

#ifdef CUSTOMOPS_WITH_CUDA
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("cross_entropy", &cross_entropy_device<cross_entropy_kernels_cuda>);
  m.impl("_cross_entropy_backward", &cross_entropy_backward_device<cross_entropy_kernels_cuda>);
}
#endif

// vmap batching rules of cross_entropy: every tensor argument is per row.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("cross_entropy", batching::leading_dims());
  m.impl("_cross_entropy_backward", batching::leading_dims());
}

}  // namespace customops
