// The graph node and recorder that every customops Autograd kernel uses (see ops/autograd.h):
// reverse mode, forward mode and compiled autograd, written once.
#include "ops/autograd.h"

#include <ATen/ATen.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <mutex>
#include <unordered_set>

namespace customops::autograd {

using torch::autograd::SavedVariable;

namespace {

// The formula run on unpacked saved tensors: shared by eager backward and compiled autograd.
variable_list run_formula(Formula formula, const std::string& name, const variable_list& grads,
                          const variable_list& saved, const std::vector<double>& attrs, std::vector<bool> needs) {
  const size_t n = needs.size();
  bool any_grad = false;
  for (const auto& g : grads) any_grad = any_grad || g.defined();
  BackwardArgs args{grads, saved, attrs, std::move(needs)};
  if (!any_grad || !args.needs_any()) return variable_list(n);
  variable_list out = formula(args);
  TORCH_INTERNAL_ASSERT(out.size() == n, name, ": the formula returned ", out.size(), " gradients for ", n, " inputs");
  for (size_t i = 0; i < n; ++i) {
    if (!args.needs[i]) out[i] = at::Tensor();
  }
  return out;
}

}  // namespace

// SavedVariable::unpack raises the usual error when backward runs a second time without
// retain_graph.
variable_list OpNode::unpack_saved() {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list saved;
  saved.reserve(saved_.size());
  for (size_t i = 0; i < saved_.size(); ++i) saved.push_back(saved_[i].unpack(saved_is_output_[i] ? getptr() : nullptr));
  return saved;
}

std::vector<bool> OpNode::needs() const {
  std::vector<bool> out;
  out.reserve(num_outputs());
  for (size_t i = 0; i < num_outputs(); ++i) out.push_back(task_should_compute_output(i));
  return out;
}

variable_list OpNode::apply(variable_list&& grads) {
  return run_formula(formula_, name_, grads, unpack_saved(), attrs_, needs());
}

void OpNode::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& sv : saved_) sv.reset_data();
}

// Compiled autograd keys its cache on the formula (the name) and the float arguments (constants
// to torch.compile, as in the forward), and lifts the saved tensors to graph inputs.
void OpNode::compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const {
  args.collect(name_);
  for (size_t i = 0; i < saved_.size(); ++i) args.collect(saved_[i], saved_is_output_[i]);
  args.collect(attrs_);
}

// Compiled autograd puts each node into its graph as one call of a functional form of the node
// (as torch's own nodes do): the formula bound to Python once per node name, called with the
// incoming gradients and the packed saved tensors, float arguments and input mask. Dynamo may
// trace into it (it calls dispatcher ops only).
variable_list OpNode::apply_with_saved(const variable_list& grads, torch::dynamo::autograd::SwapSavedVariables& saved) {
  using namespace torch::dynamo::autograd;
  for (auto& sv : saved_) saved.before(sv);

  PackedArgs packed;
  packed.pack(needs());
  packed.pack(unpack_saved());
  packed.pack(attrs_);
  auto args = std::move(packed).vec();
  auto output_metadata =
      IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(get_input_metadata(next_edges()));

  const std::string fn_name = "customops_" + name_;
  static std::mutex bound_mutex;
  static std::unordered_set<std::string> bound;
  const auto& py = getPyCompilerInterface();
  {
    std::lock_guard<std::mutex> lock(bound_mutex);
    if (bound.insert(fn_name).second) {
      std::vector<at::TypePtr> schema;
      for (const auto& iv : args) schema.push_back(iv.isTensor() ? at::TensorType::get() : iv.type());
      functional_apply_t fn = [formula = formula_, name = name_](const variable_list& inputs,
                                                                  const std::vector<c10::IValue>& packed_args) {
        PackedArgs unpacked(packed_args);
        auto needs = unpacked.unpack<std::vector<bool>>();
        auto saved = unpacked.unpack<variable_list>();
        auto attrs = unpacked.unpack<std::vector<double>>();
        return run_formula(formula, name, inputs, saved, attrs, std::move(needs));
      };
      py->bind_function(saved.get_py_compiler(), fn_name, fn, schema, /*is_custom_function=*/false,
                        /*is_traceable=*/true);
    }
  }
  variable_list out = py->call_function(saved.get_py_compiler(), "apply_functional", fn_name, grads, args, output_metadata);

  for (auto& sv : saved_) saved.after(sv);
  return out;
}

void Recorder::add_input(const at::Tensor& t) {
  at::Tensor tangent = t.defined() ? t._fw_grad(/*level=*/0) : at::Tensor();
  if (tangent.defined()) {
    needs_tangent_ = true;
    primals_.push_back(t._fw_primal(/*level=*/0));
  } else {
    primals_.push_back(t);
  }
  tangents_.push_back(std::move(tangent));
}

namespace {
// A template, so that only the branch of the torch being compiled against is instantiated. Shared
// nodes are freed with torch's deleteNode (iterative, for deep graphs), found by ADL.
template <typename Ptr = NodePtr>
Ptr make_node(std::string name, Formula formula) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return Ptr(new OpNode(std::move(name), formula), [](typename Ptr::element_type* n) { deleteNode(n); });
  } else {
    return c10::make_intrusive<OpNode>(std::move(name), formula);
  }
}
}  // namespace

void Recorder::record_node(const char* name, Formula formula, std::initializer_list<at::Tensor> outputs,
                           std::initializer_list<Save> saved, std::vector<double> attrs) {
  NodePtr node = make_node(name, formula);
  auto* op_node = static_cast<OpNode*>(node.get());
  node->set_next_edges(std::move(next_edges_));
  for (const auto& out : outputs) torch::autograd::set_history(out, node);
  op_node->attrs_ = std::move(attrs);
  for (const auto& s : saved) {
    op_node->saved_.emplace_back(s.tensor, s.is_output);
    op_node->saved_is_output_.push_back(s.is_output);
  }
}

void Recorder::set_fw_grad(const at::Tensor& output, const at::Tensor& tangent) {
  if (output.defined() && tangent.defined()) output._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
}

at::Tensor sum_defined(std::initializer_list<at::Tensor> ts) {
  at::Tensor total;
  for (const auto& t : ts) {
    if (t.defined()) total = total.defined() ? total + t : t;
  }
  return total;
}

void no_double_backward(const char* op) {
  TORCH_CHECK(false, "double backward is not supported for customops::", op,
              " (its fused backward op has no derivative); this includes forward-mode AD over its backward, "
              "as in torch.func.hessian and jacfwd(jacrev(...))");
}

}  // namespace customops::autograd
