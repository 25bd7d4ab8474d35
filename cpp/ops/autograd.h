// Internal: the autograd plumbing of every customops op, written once. An op's Autograd kernel
// builds its graph node the way ATen's generated VariableType kernels do (a Node subclass with
// SavedVariables, next edges and set_history), not with torch::autograd::Function: that is what
// lets torch.func (grad, vjp, jacrev, vmap of them), forward-mode AD and compiled autograd treat
// customops ops like ATen ops. A kernel then reads:
//
//   at::Tensor silu_autograd(const at::Tensor& x) {
//     autograd::Recorder rec(x);                                   // differentiable inputs
//     if (!rec) return call_below_autograd(silu_op(), x);          // nothing to record
//     at::Tensor y = call_below_autograd(silu_op(), x);
//     rec.record<silu_grad>("SiluBackward", {y}, {rec.input(x)});  // node, outputs, saved
//     rec.set_tangent(y, [&] { return silu_backward(rec.tangent(0), rec.primal(0)); });
//     return y;
//   }
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace customops {

inline bool needs_grad_or_tangent(const at::Tensor& t) {
  return t.defined() && ((at::GradMode::is_enabled() && t.requires_grad()) || torch::autograd::isFwGradDefined(t));
}
inline bool needs_grad_or_tangent(const std::optional<at::Tensor>& t) {
  return t.has_value() && needs_grad_or_tangent(*t);
}

// True when a call must record: grad mode is on and an input requires grad, or an input carries a
// forward-mode tangent. Otherwise the kernel calls below autograd directly, as ATen's
// VariableType kernels do.
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

namespace autograd {

using torch::autograd::variable_list;
// Node handles are std::shared_ptr up to torch 2.12 and c10::intrusive_ptr after.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());

// What a backward formula receives: one incoming gradient per differentiable output (undefined
// where none flowed), the saved tensors unpacked, the op's float arguments, and which of the
// differentiable inputs need a gradient. It returns one gradient per differentiable input,
// undefined where none is needed. It calls dispatcher ops only, so double backward and
// compiled autograd trace through it.
struct BackwardArgs {
  const variable_list& grads;
  const variable_list& saved;
  const std::vector<double>& attrs;
  std::vector<bool> needs;

  bool needs_any() const {
    for (bool n : needs) {
      if (n) return true;
    }
    return false;
  }
};
using Formula = variable_list (*)(const BackwardArgs&);

// The graph node of every customops op: plain data (saved tensors, float arguments) and a
// formula, so compiled autograd can swap the saved tensors for proxies and trace the formula.
class OpNode final : public torch::autograd::TraceableFunction {
 public:
  OpNode(std::string name, Formula formula) : name_(std::move(name)), formula_(formula) {}

  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return name_; }
  void release_variables() override;
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override;
  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& saved) override;

  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<bool> saved_is_output_;
  std::vector<double> attrs_;

 private:
  variable_list unpack_saved();
  std::vector<bool> needs() const;

  std::string name_;
  Formula formula_;
};

// Raised by the backward ops' own backward where no fused formula exists.
[[noreturn]] void no_double_backward(const char* op);

// The backward formula of a backward op that has no derivative: raises (never a silent zero).
template <const char* kOp>
variable_list no_double_backward_formula(const BackwardArgs&) {
  no_double_backward(kOp);
}

// A tensor to save on the node: an input (saved as it came) or an output (saved after it got
// its history, without a reference cycle).
struct Save {
  at::Tensor tensor;
  bool is_output;
};

// Records one call of an op: the node with its next edges, history on the differentiable
// outputs, and forward-mode tangents. Construct it with the op's differentiable inputs, in the
// order the backward formula returns their gradients.
class Recorder {
 public:
  template <typename... Ts>
  explicit Recorder(const Ts&... inputs) {
    (add_input(inputs), ...);
    needs_grad_ = torch::autograd::compute_requires_grad(inputs...);
    if (needs_grad_) next_edges_ = torch::autograd::collect_next_edges(inputs...);
  }

  explicit operator bool() const { return needs_grad_ || needs_tangent_; }
  bool needs_grad() const { return needs_grad_; }
  bool needs_tangent() const { return needs_tangent_; }

  static Save input(const at::Tensor& t) { return {t, false}; }
  static Save input(const std::optional<at::Tensor>& t) { return {t.value_or(at::Tensor()), false}; }
  static Save output(const at::Tensor& t) { return {t, true}; }

  // Builds the node (when a gradient is needed) with `Formula` as its backward; `outputs` are the
  // differentiable outputs in the order of the formula's incoming gradients.
  template <Formula F>
  void record(const char* name, std::initializer_list<at::Tensor> outputs, std::initializer_list<Save> saved,
              std::vector<double> attrs = {}) {
    if (needs_grad_) record_node(name, F, outputs, saved, std::move(attrs));
  }

  // Input i's tangent (undefined when it has none) and its primal (the input without tangent).
  const at::Tensor& tangent(size_t i) const { return tangents_.at(i); }
  const at::Tensor& primal(size_t i) const { return primals_.at(i); }
  bool has_tangent(size_t i) const { return tangents_.at(i).defined(); }

  // Gives `output` the tangent `formula()` computes, when any input carries one.
  template <typename F>
  void set_tangent(const at::Tensor& output, F&& formula) const {
    if (needs_tangent_) set_fw_grad(output, formula());
  }
  // The whole Autograd kernel of a backward op with no derivative of its own (kOp names it):
  // computes below autograd and records a node whose backward raises, or raises at once when an
  // input carries a tangent, so a second derivative is never silently zero.
  template <const char* kOp, typename Op, typename... Args>
  auto backward_op(const Op& op, const Args&... args) {
    if (needs_tangent_) no_double_backward(kOp);
    auto out = call_below_autograd(op, args...);
    if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
      record<no_double_backward_formula<kOp>>(kOp, {out}, {});
    } else {
      std::apply([&](const auto&... outs) { record<no_double_backward_formula<kOp>>(kOp, {outs...}, {}); }, out);
    }
    return out;
  }


 private:
  void add_input(const at::Tensor& t);
  void add_input(const std::optional<at::Tensor>& t) { add_input(t.value_or(at::Tensor())); }
  void record_node(const char* name, Formula formula, std::initializer_list<at::Tensor> outputs,
                   std::initializer_list<Save> saved, std::vector<double> attrs);
  static void set_fw_grad(const at::Tensor& output, const at::Tensor& tangent);

  bool needs_grad_ = false;
  bool needs_tangent_ = false;
  torch::autograd::edge_list next_edges_;
  c10::SmallVector<at::Tensor, 4> tangents_, primals_;
};

// The sum of the defined tensors among ts (undefined if none is): tangent formulas add one
// term per input that carries a tangent.
at::Tensor sum_defined(std::initializer_list<at::Tensor> ts);

}  // namespace autograd
}  // namespace customops
