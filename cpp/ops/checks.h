// Argument checks shared by every kernel of every op (Meta, CPU, CUDA), so the Meta kernel
// rejects exactly what the real kernels reject. Sizes are compared symbolically: these run
// under torch.compile and torch.export with symbolic shapes and must not specialize them.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

namespace customops::checks {

#ifdef CUSTOMOPS_WITH_CUDA
// Whether the current CUDA stream is capturing a graph (cuda/decode_graph.cu): a check that reads
// a device value on the host (a sync) cannot run then.
bool cuda_stream_capturing();
#endif

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
}

inline void float_dtype(const char* op, const char* name, const at::Tensor& t) {
  defined(op, name, t);
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", name, " has dtype ", t.scalar_type(),
              "; supported dtypes are float32, float64, float16 and bfloat16");
}

inline void same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": expected ", name, " to have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), but got ", t.scalar_type());
}

inline void same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                        const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": expected ", name, " to be on the device of ", ref_name,
              " (", ref.device(), "), but got ", t.device());
}

inline void same_shape(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  bool same_rank = t.dim() == ref.dim();
  TORCH_CHECK(same_rank, op, ": expected ", name, " to have the shape of ", ref_name, " ",
              ref.sym_sizes(), ", but got ", t.sym_sizes());
  for (int64_t i = 0; i < t.dim(); ++i) {
    TORCH_SYM_CHECK(t.sym_size(i).sym_eq(ref.sym_size(i)), op, ": expected ", name,
                    " to have the shape of ", ref_name, " ", ref.sym_sizes(), ", but got ", t.sym_sizes());
  }
}

// Memory can only be compared for real tensors with concrete sizes (not Meta/fake ones).
inline bool concrete(const at::Tensor& t) {
  return !t.is_meta() && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// A tensor an op writes in place must not have elements that share memory (an expanded tensor
// would take every row's values in one place), as ATen's in-place ops refuse.
inline void no_internal_overlap(const char* op, const char* name, const at::Tensor& t) {
  if (!concrete(t)) return;
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
              " has elements that share memory (e.g. an expanded tensor); it is written in place, so it must not");
}

// An out= tensor must match ref exactly (no resizing) and must not share memory with an input
// partially; being the very same tensor as an input is fine (elementwise ops read before write).
inline void out_tensor(const char* op, const at::Tensor& out, const at::Tensor& ref,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  defined(op, "out", out);
  same_dtype(op, "out", out, "the result", ref);
  same_device(op, "out", out, "the inputs", ref);
  same_shape(op, "out", out, "the result", ref);
  if (!concrete(out)) return;
  for (const auto& input : inputs) {
    if (!concrete(*input.second)) return;
  }
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op,
              ": out has elements that share memory (e.g. an expanded tensor); it must not");
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK(at::get_overlap_status(out, *t) != at::MemOverlapStatus::Partial, op, ": out overlaps ",
                name, " partially; pass a separate tensor or ", name, " itself");
  }
}

}  // namespace customops::checks
