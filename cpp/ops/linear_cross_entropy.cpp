// linear_cross_entropy: the loss of hidden @ weight.T + bias against target without the [N, V]
// logits. It goes in tiles of rows x classes; each tile's logits (hidden's dtype) come from one
// ATen matmul (cuBLAS on CUDA) and the device's cross-entropy kernels. When a gradient is
// needed the forward computes it for a unit loss gradient (grad_hidden, grad_weight, grad_bias are
// outputs of the private _linear_cross_entropy_with_grads, so the backward only scales them, and
// hidden need not be kept for a recomputation). Here: the device-generic implementation, typed C++
// API, Meta, Autograd, vmap and autocast kernels; the CPU and CUDA registrations pass each
// device's cross-entropy kernels.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <limits>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/batching.h"
#include "ops/cross_entropy.h"

namespace customops {
namespace {

using torch::autograd::variable_list;
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

const auto& lce_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::linear_cross_entropy", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t, double, c10::string_view,
                                         std::optional<int64_t>, std::optional<int64_t>)>();
  return op;
}

const auto& lce_with_grads_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_linear_cross_entropy_with_grads", "")
                       .typed<Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, int64_t, double, c10::string_view,
                                    std::optional<int64_t>, std::optional<int64_t>, std::array<bool, 3>)>();
  return op;
}

const auto& lce_backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_linear_cross_entropy_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                             const at::Tensor&, const at::Tensor&)>();
  return op;
}

constexpr const char* kOpName = "customops::linear_cross_entropy";

// A tile of the logits: rows x classes (tile_rows and tile_classes override either). Rows: 1024,
// enough for every matmul to run at full speed and for grad_weight to be read and written only
// once per 1024 rows. Classes: the whole vocabulary when the tile then fits in hidden's own size
// (N x H elements, or 4M for small inputs), else as many as fit (a multiple of 128): the extra
// memory is at most hidden's, where Liger-Kernel's row chunks take 1 to 2 times hidden's. Measured
// on an H100 (N 8192, H 2048, V 128256, bf16), tiles of the whole vocabulary: 1024 rows 22.8 ms
// and 784 MiB above the inputs (customops.optimize's choice: a model step has that memory to
// spare), 256 rows 34.7 ms and 596 MiB (grad_weight read and written 32 times); docs/benchmarks.md
// has the tiles this picks.
struct Tile {
  int64_t rows, classes;
};

Tile tile_of(int64_t n, int64_t h, int64_t v, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  const int64_t rows = std::max<int64_t>(1, std::min(n, tile_rows.value_or(1024)));
  const int64_t budget = std::max<int64_t>(n * h, int64_t{1} << 22);
  const int64_t classes = tile_classes.value_or(rows * v <= budget ? v : std::max<int64_t>(128, budget / rows / 128 * 128));
  return {rows, std::min(classes, v)};
}

// The rows go in chunks [r0, r0 + r) of the tile's rows, each in pieces of classes [v0, v0 + c);
// logits tiles are hidden[r0:r0+r] @ weight[v0:v0+c].T (+ bias), each written into one buffer
// that every tile reuses.
// - One piece (the whole vocabulary): the device's cross-entropy kernel gives each row's loss and
//   lse and, when a gradient is needed, turns the logits into their gradient in place; then
//   grad_hidden[rows] = logits @ weight and grad_weight += logits.T @ hidden[rows]. Three matmuls
//   in all, as a plain linear + cross-entropy.
// - Several pieces: pass 1 merges each piece's log-sum-exp into the rows' (with the target's
//   logit and, for label smoothing, the logits' sum); pass 2, when a gradient is needed,
//   recomputes each tile, turns it into its gradient and adds its products to grad_hidden[rows]
//   and grad_weight[classes]. Four matmuls (the logits twice) for memory O(rows x classes).
// grad_weight is read and written once per chunk of rows (in the matmul's epilogue).
Grads run(const CrossEntropyKernels& ce, const at::Tensor& hidden, const at::Tensor& weight,
          const at::Tensor& target_in, const std::optional<at::Tensor>& bias_in, int64_t ignore_index,
          double label_smoothing, c10::string_view reduction, std::optional<int64_t> tile_rows,
          std::optional<int64_t> tile_classes, std::array<bool, 3> mask) {
  const at::Tensor target = target_in.contiguous();
  const at::Tensor bias = bias_in.value_or(at::Tensor());
  const int64_t n = hidden.size(0), v = weight.size(0);
  const at::ScalarType acc = cross_entropy_acc_dtype(hidden.scalar_type());
  const auto acc_opts = hidden.options().dtype(acc);
  const bool mean = reduction == "mean";
  mask[2] = mask[2] && bias.defined();
  const bool grads = mask[0] || mask[1] || mask[2];
  const at::Tensor none = at::empty({0}, hidden.options());
  const Tile tile = tile_of(n, hidden.size(1), v, tile_rows, tile_classes);
  const bool pieces = tile.classes < v;
  at::Tensor buffer = at::empty({std::min(tile.rows, n) * tile.classes}, hidden.options());
  auto logits_of = [&](const at::Tensor& h, int64_t v0, int64_t c) {
    at::Tensor out = buffer.narrow(0, 0, h.size(0) * c).view({h.size(0), c});
    const at::Tensor w = weight.narrow(0, v0, c);
    return bias.defined() ? at::addmm_out(out, bias.narrow(0, v0, c), h, w.t()) : at::mm_out(out, h, w.t());
  };

  const at::Tensor counted = mean ? (target != ignore_index).sum() : at::Tensor();
  // Each counted row's loss gradient: 1 / (rows counted) for "mean", 1 for "sum" (a device
  // scalar read by the kernels with stride 0: no host sync).
  const at::Tensor row_grad = (mean ? counted.to(acc).reciprocal() : at::ones({}, acc_opts)).expand({n});
  at::Tensor loss_rows = at::empty({n}, acc_opts), lse = at::empty({n}, acc_opts);
  at::Tensor dh = mask[0] ? at::empty(hidden.sizes(), hidden.options()) : none;
  // The first chunk of rows writes grad_weight, the others add to it (zeros when there is no row).
  at::Tensor dw = mask[1] ? (n == 0 ? at::zeros(weight.sizes(), weight.options()) : at::empty(weight.sizes(), weight.options()))
                          : none;
  at::Tensor db = mask[2] ? at::zeros({v}, acc_opts) : none;
  // The gradient of the tile in place of its logits, then its products.
  auto backward = [&](at::Tensor& g, const at::Tensor& h, const at::Tensor& t, const at::Tensor& lse_r, int64_t r0,
                      int64_t v0) {
    ce.backward(row_grad.narrow(0, r0, h.size(0)), at::Tensor(), g, t, lse_r, ignore_index, label_smoothing, v0, v, g);
    if (mask[0]) {
      at::Tensor rows = dh.narrow(0, r0, h.size(0));
      const at::Tensor w = weight.narrow(0, v0, g.size(1));
      if (v0 == 0) {
        at::mm_out(rows, g, w);
      } else {
        rows.addmm_(g, w);
      }
    }
    if (mask[1]) {
      at::Tensor classes = dw.narrow(0, v0, g.size(1));
      if (r0 == 0) {
        at::mm_out(classes, g.t(), h);
      } else {
        classes.addmm_(g.t(), h);
      }
    }
    if (mask[2]) db.narrow(0, v0, g.size(1)).add_(g.sum(0, /*keepdim=*/false, acc));
  };
  for (int64_t r0 = 0; r0 < n; r0 += tile.rows) {
    const int64_t r = std::min(tile.rows, n - r0);
    const at::Tensor h = hidden.narrow(0, r0, r), t = target.narrow(0, r0, r);
    const at::Tensor lse_r = lse.narrow(0, r0, r);
    if (!pieces) {
      at::Tensor logits = logits_of(h, 0, v);
      ce.forward(logits, t, ignore_index, label_smoothing, loss_rows.narrow(0, r0, r), lse_r);
      if (grads) backward(logits, h, t, lse_r, r0, 0);
      continue;
    }
    // Pass 1: lse, the target's logit and (label smoothing) the logits' sum, piece by piece.
    const at::Tensor no_target = at::full({r}, -1, target.options());  // every row "ignored": lse only
    at::Tensor lse_j = at::empty({r}, acc_opts), unused = at::empty({r}, acc_opts);
    at::Tensor picked = at::zeros({r}, acc_opts), sum_x = label_smoothing != 0.0 ? at::zeros({r}, acc_opts) : at::Tensor();
    lse_r.fill_(-std::numeric_limits<double>::infinity());
    for (int64_t v0 = 0; v0 < v; v0 += tile.classes) {
      const int64_t c = std::min(tile.classes, v - v0);
      const at::Tensor logits = logits_of(h, v0, c);
      ce.forward(logits, no_target, -1, 0.0, unused, lse_j);
      lse_r.copy_(at::logaddexp(lse_r, lse_j));
      const at::Tensor local = t - v0, here = (local >= 0).logical_and_(local < c);
      picked.add_(logits.gather(1, local.clamp(0, c - 1).unsqueeze(1)).squeeze(1).to(acc).masked_fill_(here.logical_not(), 0));
      if (sum_x.defined()) sum_x.add_(logits.sum(1, /*keepdim=*/false, acc));
    }
    at::Tensor loss_r = lse_r - picked * (1.0 - label_smoothing);
    if (sum_x.defined()) loss_r -= sum_x * (label_smoothing / static_cast<double>(v));
    // A target outside [0, V) (CUDA only: CPU raised before) makes its row NaN, as the kernels do.
    const at::Tensor ignored = t == ignore_index;
    const at::Tensor bad = ignored.logical_not().logical_and_((t < 0).logical_or_(t >= v));
    loss_rows.narrow(0, r0, r).copy_(loss_r.masked_fill_(ignored, 0).masked_fill_(bad, std::numeric_limits<double>::quiet_NaN()));
    if (!grads) continue;
    // Pass 2: each tile again, into its gradient.
    for (int64_t v0 = 0; v0 < v; v0 += tile.classes) {
      at::Tensor logits = logits_of(h, v0, std::min(tile.classes, v - v0));
      backward(logits, h, t, lse_r, r0, v0);
    }
  }
  at::Tensor loss = loss_rows.sum();
  if (mean) loss = loss / counted;  // NaN when no row counts, as F.cross_entropy
  if (!grads) return {loss, none, none, none};
  return {loss, dh, dw, mask[2] ? db.to(bias.scalar_type()) : none};
}

}  // namespace

at::Tensor linear_cross_entropy_impl(const CrossEntropyKernels& ce, const at::Tensor& hidden, const at::Tensor& weight,
                                     const at::Tensor& target, const std::optional<at::Tensor>& bias,
                                     int64_t ignore_index, double label_smoothing, c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  check_linear_cross_entropy(kOpName, hidden, weight, target, bias, label_smoothing, reduction, tile_rows, tile_classes);
  if (hidden.is_cpu()) check_target_range(kOpName, target, weight.size(0), ignore_index);
  return std::get<0>(run(ce, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows,
                         tile_classes, {false, false, false}));
}

Grads linear_cross_entropy_with_grads_impl(const CrossEntropyKernels& ce, const at::Tensor& hidden,
                                           const at::Tensor& weight, const at::Tensor& target,
                                           const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                           double label_smoothing, c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes,
                                           std::array<bool, 3> output_mask) {
  check_linear_cross_entropy("customops::_linear_cross_entropy_with_grads", hidden, weight, target, bias,
                             label_smoothing, reduction, tile_rows, tile_classes);
  if (hidden.is_cpu()) check_target_range(kOpName, target, weight.size(0), ignore_index);
  return run(ce, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows, tile_classes, output_mask);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                                std::string_view reduction, std::optional<int64_t> tile_rows,
                                std::optional<int64_t> tile_classes) {
  return lce_op().call(hidden, weight, target, bias, ignore_index, label_smoothing,
                       c10::string_view(reduction.data(), reduction.size()), tile_rows, tile_classes);
}

namespace {

// ---- Meta -------------------------------------------------------------------------------------
at::Tensor lce_meta(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                    const std::optional<at::Tensor>& bias, int64_t, double label_smoothing, c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  check_linear_cross_entropy(kOpName, hidden, weight, target, bias, label_smoothing, reduction, tile_rows, tile_classes);
  return at::empty({}, hidden.options().dtype(cross_entropy_acc_dtype(hidden.scalar_type())));
}

Grads lce_with_grads_meta(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                          const std::optional<at::Tensor>& bias, int64_t, double label_smoothing,
                          c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes, std::array<bool, 3> mask) {
  check_linear_cross_entropy("customops::_linear_cross_entropy_with_grads", hidden, weight, target, bias,
                             label_smoothing, reduction, tile_rows, tile_classes);
  const at::Tensor none = at::empty({0}, hidden.options());
  const bool has_b = bias.has_value() && bias->defined();
  return {at::empty({}, hidden.options().dtype(cross_entropy_acc_dtype(hidden.scalar_type()))),
          mask[0] ? at::empty_symint(hidden.sym_sizes(), hidden.options()) : none,
          mask[1] ? at::empty_symint(weight.sym_sizes(), weight.options()) : none,
          mask[2] && has_b ? at::empty_symint(bias->sym_sizes(), bias->options()) : none};
}

// ---- _linear_cross_entropy_backward: one kernel for every device (ATen's mul) -----------------
// grad_loss is a scalar, or one per vmap entry (leading dims) scaling that entry's gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_kernel(const at::Tensor& grad_loss, const at::Tensor& dh,
                                                                   const at::Tensor& dw, const at::Tensor& db) {
  auto scale = [&](const at::Tensor& t) {
    if (grad_loss.dim() == 0) return t * grad_loss;  // a 0-dim factor keeps t's dtype, computes in float
    at::Tensor g = grad_loss.to(t.scalar_type());
    while (g.dim() < t.dim()) g = g.unsqueeze(-1);
    return t * g;
  };
  return {scale(dh), scale(dw), scale(db)};
}

// ---- Autograd ---------------------------------------------------------------------------------
// Saved: the gradients for a unit loss gradient (outputs of _linear_cross_entropy_with_grads),
// and hidden, weight and bias (references: what those gradients depend on).
constexpr char kLinearCrossEntropy[] = "linear_cross_entropy";
using autograd::BackwardArgs;
using autograd::Recorder;

// A tensor of plain eager autograd: no tracing, functionalization or functorch wrapper.
bool plain_eager(const at::Tensor& t) {
  static const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                           c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                           c10::DispatchKey::FuncTorchGradWrapper,
                                           c10::DispatchKey::FuncTorchDynamicLayerFrontMode});
  return !t.defined() || !t.key_set().has_any(traced);
}

variable_list lce_grad(const BackwardArgs& a) {
  const at::Tensor& g = a.grads[0];
  if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  at::Tensor dh = a.saved[0], dw = a.saved[1], db = a.saved[2];
  if (!at::GradMode::is_enabled() && !torch::autograd::get_current_graph_task_keep_graph() && plain_eager(g) &&
      plain_eager(dh) && plain_eager(dw) && plain_eager(db)) {
    // Plain eager backward that frees the graph after it (no graph being built, none retained):
    // scale the saved gradients in place, so the weight's gradient never exists twice.
    for (at::Tensor* t : {&dh, &dw, &db}) {
      if (t->numel() > 0) t->mul_(g);
    }
  } else {
    // The saved gradients carry no history of the inputs they depend on, so results that a graph
    // is being built for get a node (on the inputs) whose backward raises: double backward fails
    // clearly instead of treating them as constants.
    Recorder rec(g, a.saved[3], a.saved[4], a.saved[5]);
    std::tie(dh, dw, db) = rec ? rec.backward_op<kLinearCrossEntropy>(lce_backward_op(), g, dh, dw, db)
                               : lce_backward_op().call(g, dh, dw, db);
  }
  return {a.needs[0] ? dh : at::Tensor(), a.needs[1] ? dw : at::Tensor(), a.needs[2] ? db : at::Tensor()};
}

at::Tensor lce_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                        c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  Recorder rec(hidden, weight, bias);
  if (!rec) return call_below_autograd(lce_op(), hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows, tile_classes);
  const std::array<bool, 3> mask{needs_grad_or_tangent(hidden), needs_grad_or_tangent(weight),
                                 needs_grad_or_tangent(bias)};
  auto [loss, dh, dw, db] = call_below_autograd(lce_with_grads_op(), hidden, weight, target, bias, ignore_index,
                                                label_smoothing, reduction, tile_rows, tile_classes, mask);
  rec.record<lce_grad>("LinearCrossEntropyBackward", {loss},
                       {Recorder::input(dh), Recorder::input(dw), Recorder::input(db), Recorder::input(hidden),
                        Recorder::input(weight), Recorder::input(bias)});
  // The loss's tangent: its gradient dotted with the inputs' tangents.
  rec.set_tangent(loss, [&, &dh = dh, &dw = dw, &db = db] {
    at::Tensor t;
    const at::Tensor* g[] = {&dh, &dw, &db};
    for (size_t i = 0; i < 3; ++i) {
      if (rec.has_tangent(i)) t = autograd::sum_defined({t, (g[i]->to(loss.scalar_type()) * rec.tangent(i)).sum()});
    }
    return t;
  });
  return loss;
}

Grads lce_with_grads_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                              const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                              c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes, std::array<bool, 3> mask) {
  Recorder rec(hidden, weight, bias);
  if (!rec) {
    return call_below_autograd(lce_with_grads_op(), hidden, weight, target, bias, ignore_index, label_smoothing,
                               reduction, tile_rows, tile_classes, mask);
  }
  return rec.backward_op<kLinearCrossEntropy>(lce_with_grads_op(), hidden, weight, target, bias, ignore_index,
                                              label_smoothing, reduction, tile_rows, tile_classes, mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_autograd(const at::Tensor& grad_loss, const at::Tensor& dh,
                                                                     const at::Tensor& dw, const at::Tensor& db) {
  Recorder rec(grad_loss, dh, dw, db);
  if (!rec) return call_below_autograd(lce_backward_op(), grad_loss, dh, dw, db);
  return rec.backward_op<kLinearCrossEntropy>(lce_backward_op(), grad_loss, dh, dw, db);
}

// ---- vmap: one call per entry (each entry is a whole loss over its own rows, and its matmuls
// are already as large as a device wants) -------------------------------------------------------
template <typename Op, typename... Rest>
auto per_entry(const Op& op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
               const std::optional<at::Tensor>& bias, const Rest&... rest) {
  const at::Tensor b = bias.value_or(at::Tensor());
  batching::Level level({hidden, weight, target, b});
  auto batch = level.batch_size({hidden, weight, target, b});
  if (!batch) return op.call(hidden, weight, target, bias, rest...);
  auto entry = [&](const at::Tensor& t, int64_t e) {
    const at::Tensor f = level.front_if_batched(t);
    return f.defined() ? f.select(0, e) : t;
  };
  using Out = decltype(op.call(hidden, weight, target, bias, rest...));
  std::vector<Out> outs;
  const int64_t n = batch->guard_int(__FILE__, __LINE__);
  for (int64_t e = 0; e < n; ++e) {
    outs.push_back(op.call(entry(hidden, e), entry(weight, e), entry(target, e),
                           b.defined() ? std::optional<at::Tensor>(entry(b, e)) : std::nullopt, rest...));
  }
  auto stack = [&](auto get) {
    std::vector<at::Tensor> ts;
    for (const auto& o : outs) ts.push_back(get(o));
    return level.wrap(at::stack(ts));
  };
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    return stack([](const at::Tensor& o) { return o; });
  } else {
    return Out{stack([](const Out& o) { return std::get<0>(o); }), stack([](const Out& o) { return std::get<1>(o); }),
               stack([](const Out& o) { return std::get<2>(o); }), stack([](const Out& o) { return std::get<3>(o); })};
  }
}

at::Tensor lce_batched(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                       const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                       c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  return per_entry(lce_op(), hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows, tile_classes);
}

Grads lce_with_grads_batched(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                             const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                             c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes, std::array<bool, 3> mask) {
  return per_entry(lce_with_grads_op(), hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows, tile_classes, mask);
}

// ---- Autocast: as a linear layer, float32 hidden, weight and bias run in the autocast dtype ---
at::Tensor lce_autocast(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                        c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  const at::ScalarType low = at::autocast::get_autocast_dtype(hidden.device().type());
  auto cast = [&](const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kFloat ? t.to(low) : t; };
  std::optional<at::Tensor> b = bias;
  if (b.has_value() && b->defined()) b = cast(*b);
  autocast::Below below;
  return lce_op().call(cast(hidden), cast(weight), target, b, ignore_index, label_smoothing, reduction, tile_rows, tile_classes);
}

}  // namespace

// Meta kernels of linear_cross_entropy (the scaling backward's ATen ops run on Meta too).
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("linear_cross_entropy", &lce_meta);
  m.impl("_linear_cross_entropy_with_grads", &lce_with_grads_meta);
  m.impl("_linear_cross_entropy_backward", &lce_backward_kernel);
}

// Autograd kernels of linear_cross_entropy.
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("linear_cross_entropy", &lce_autograd);
  m.impl("_linear_cross_entropy_with_grads", &lce_with_grads_autograd);
  m.impl("_linear_cross_entropy_backward", &lce_backward_autograd);
}

// Autocast kernel of linear_cross_entropy.
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("linear_cross_entropy", &lce_autocast); }

// vmap batching rules of linear_cross_entropy.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("linear_cross_entropy", &lce_batched);
  m.impl("_linear_cross_entropy_with_grads", &lce_with_grads_batched);
  m.impl("_linear_cross_entropy_backward", batching::leading_dims());
}

// CPU and CUDA kernels of linear_cross_entropy: the implementation above with the device's
// cross-entropy kernels.
template <const CrossEntropyKernels& (*Kernels)()>
at::Tensor lce_device(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                      c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes) {
  return linear_cross_entropy_impl(Kernels(), hidden, weight, target, bias, ignore_index, label_smoothing, reduction, tile_rows, tile_classes);
}

template <const CrossEntropyKernels& (*Kernels)()>
Grads lce_with_grads_device(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                            const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
                            c10::string_view reduction, std::optional<int64_t> tile_rows, std::optional<int64_t> tile_classes, std::array<bool, 3> mask) {
  return linear_cross_entropy_with_grads_impl(Kernels(), hidden, weight, target, bias, ignore_index, label_smoothing,
                                              reduction, tile_rows, tile_classes, mask);
}

TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("linear_cross_entropy", &lce_device<cross_entropy_kernels_cpu>);
  m.impl("_linear_cross_entropy_with_grads", &lce_with_grads_device<cross_entropy_kernels_cpu>);
  m.impl("_linear_cross_entropy_backward", &lce_backward_kernel);
}

#ifdef CUSTOMOPS_WITH_CUDA
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("linear_cross_entropy", &lce_device<cross_entropy_kernels_cuda>);
  m.impl("_linear_cross_entropy_with_grads", &lce_with_grads_device<cross_entropy_kernels_cuda>);
  m.impl("_linear_cross_entropy_backward", &lce_backward_kernel);
}
#endif

}  // namespace customops
