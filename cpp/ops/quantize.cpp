// quantize_fp8 and quantize_int4: a linear layer's weight in the formats fused_linear reads
// through weight_scale (the layouts are in cpp/library.cpp's schemas). Every device runs the same
// ATen ops, once a weight (at export), so there is one kernel a quantizer; they round, so they
// are not differentiable.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "customops/customops.h"
#include "ops/batching.h"
#include "ops/checks.h"

namespace customops {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;

constexpr const char* kFp8 = "customops::quantize_fp8";
constexpr const char* kInt4 = "customops::quantize_int4";
constexpr double kE4M3Max = 448.0;  // float8_e4m3fn's largest finite magnitude

const auto& quantize_fp8_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kFp8, "").typed<Pair(const at::Tensor&)>();
  return op;
}

const auto& quantize_int4_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kInt4, "").typed<Pair(const at::Tensor&, int64_t)>();
  return op;
}

// A [out_features, in_features] floating-point weight.
void check_weight(const char* op, const at::Tensor& weight) {
  checks::float_dtype(op, "weight", weight);
  TORCH_CHECK(weight.dim() == 2, op, ": expected weight of shape [out_features, in_features], but got ",
              weight.sym_sizes());
}

// weight in float32, finite: a NaN or infinity is a clear error, which reads the check's result on
// the host. A CUDA graph's capture cannot wait for it: there the row or group holding one gets a
// NaN scale (poisoned(), below), so that every product with it is NaN, never a wrong number.
at::Tensor finite_float(const char* op, const at::Tensor& weight) {
  const at::Tensor w = weight.to(at::kFloat);
#ifdef CUSTOMOPS_WITH_CUDA
  if (w.is_cuda() && checks::cuda_stream_capturing()) return w;
#endif
  if (w.numel() > 0) {
    TORCH_CHECK(at::isfinite(w).all().item<bool>(), op, ": weight holds NaN or infinite values",
                weight.scalar_type() == at::kDouble ? " (or values past float32's range, which it quantizes in)" : "");
  }
  return w;
}

// f(rows) over weight's rows in slices of at most kChunkElements elements (at least one row), the
// quantized slices concatenated: the float32 temporaries of a quantizer stay a few times a slice,
// not the weight (an LM head of 128,256 x 4,096 is 2 GiB in float32 alone).
constexpr int64_t kChunkElements = int64_t{1} << 22;
template <typename F>
Pair by_row_slices(const at::Tensor& weight, const F& f) {
  const int64_t n = weight.size(0), rows = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(weight.size(1), 1));
  if (n <= rows) return f(weight);
  std::vector<at::Tensor> qs, ss;
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    auto [q, s] = f(weight.narrow(0, r0, std::min(rows, n - r0)));
    qs.push_back(q);
    ss.push_back(s);
  }
  return {at::cat(qs), at::cat(ss)};
}

// scale, NaN where amax (the largest magnitude its elements had) is not finite.
at::Tensor poisoned(const at::Tensor& scale, const at::Tensor& amax) {
  return at::where(at::isfinite(amax), scale, std::numeric_limits<double>::quiet_NaN());
}

void refuse_grad(const char* op, const at::Tensor& weight) {
  TORCH_CHECK(!at::GradMode::is_enabled() || !weight.requires_grad(), op,
              " is not differentiable (it rounds): call it under torch.no_grad() or on a weight that does not "
              "require grad");
}

// ---- quantize_fp8 -----------------------------------------------------------------------------
Pair quantize_fp8_meta(const at::Tensor& weight) {
  check_weight(kFp8, weight);
  return {at::empty_symint(weight.sym_sizes(), weight.options().dtype(at::kFloat8_e4m3fn)),
          at::empty_symint({weight.sym_size(0)}, weight.options().dtype(at::kFloat))};
}

// Each row's scale is its largest magnitude over 448 (1 for a row of zeros, or of magnitudes so
// small that the quotient is 0 in float32, so that nothing divides by 0); the row over it rounds to
// E4M3 (to nearest even), whose range it then fits.
Pair quantize_fp8_rows(const at::Tensor& weight) {
  const at::Tensor w = finite_float(kFp8, weight);
  const at::Tensor amax = w.numel() > 0 ? w.abs().amax(1) : at::zeros({w.size(0)}, w.options());
  const at::Tensor quotient = amax / kE4M3Max;
  const at::Tensor scale = poisoned(at::where(quotient > 0, quotient, at::ones_like(amax)), amax);
  const at::Tensor q = (w / scale.unsqueeze(1)).clamp(-kE4M3Max, kE4M3Max).to(at::kFloat8_e4m3fn);
  return {q.contiguous(), scale.contiguous()};
}

Pair quantize_fp8_kernel(const at::Tensor& weight) {
  check_weight(kFp8, weight);
  return by_row_slices(weight, quantize_fp8_rows);
}

Pair quantize_fp8_autograd(const at::Tensor& weight) {
  refuse_grad(kFp8, weight);
  at::AutoDispatchBelowADInplaceOrView guard;
  return quantize_fp8_op().call(weight);
}

// ---- quantize_int4 ----------------------------------------------------------------------------
void check_int4(const at::Tensor& weight, int64_t group_size) {
  check_weight(kInt4, weight);
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0, kInt4, ": group_size must be an even number >= 2, but it is ",
              group_size);
  TORCH_SYM_CHECK((weight.sym_size(1) % group_size).sym_eq(0).sym_and(weight.sym_size(1).sym_ge(1)), kInt4,
                  ": weight's in_features (", weight.sym_size(1), ") must be a positive multiple of group_size (",
                  group_size, ")");
}

Pair quantize_int4_meta(const at::Tensor& weight, int64_t group_size) {
  check_int4(weight, group_size);
  const c10::SymInt n = weight.sym_size(0), k = weight.sym_size(1);
  return {at::empty_symint({n, k / 2}, weight.options().dtype(at::kByte)),
          at::empty_symint({n, k / group_size}, weight.options())};
}

// A scale as the weight's dtype stores it, in float32: rounded to bfloat16 or float16 (never to 0:
// a scale past the type's smallest is that smallest, its subnormal).
at::Tensor as_stored(const at::Tensor& s, at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return s;
  const double smallest = dtype == at::kHalf ? static_cast<double>(std::numeric_limits<c10::Half>::denorm_min())
                                             : static_cast<double>(std::numeric_limits<c10::BFloat16>::denorm_min());
  const at::Tensor r = s.to(dtype).to(at::kFloat);
  return at::where(r > 0, r, smallest);
}

// A group's scale is, of its largest magnitude over 7 times 1, 0.95, ..., 0.7, each as the weight's
// dtype stores it (as_stored), the one whose rounding leaves the least squared error (a smaller
// scale clips the largest elements but steps the others finer; llama.cpp's k-quants search so
// too), in float32 whatever the weight's dtype; 1 for a group of zeros. The elements round against
// the stored scale, so that each is within half its step (the largest clipped aside).
// Elements round to [-8, 7], stored plus 8, two a byte (low nibble first). (On a small Llama
// trained on a Markov chain, the search took int4's perplexity over the unquantized model's from
// 1.054x to 1.043x.)
Pair quantize_int4_rows(const at::Tensor& weight, int64_t group_size) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor w = finite_float(kInt4, weight).reshape({n, k / group_size, group_size});
  const at::Tensor amax = w.abs().amax(2, /*keepdim=*/true);
  at::Tensor best, best_err;
  for (int i = 0; i <= 6; ++i) {
    const double f = 1.0 - 0.05 * i;
    const at::Tensor s =
        at::where(amax > 0, as_stored(amax * (f / 7.0), weight.scalar_type()), at::ones_like(amax));
    const at::Tensor err = (at::round(w / s).clamp(-8, 7) * s - w).square().sum(2, /*keepdim=*/true);
    if (i == 0) {
      best = s;
      best_err = err;
    } else {
      const at::Tensor better = err < best_err;
      best = at::where(better, s, best);
      best_err = at::where(better, err, best_err);
    }
  }
  best = poisoned(best, amax);
  // (a NaN rounds to 0, stored 8: its group's scale is NaN)
  const at::Tensor q = at::round(w / best).nan_to_num(0).clamp(-8, 7).to(at::kInt).add(8).to(at::kByte);  // 0..15
  const at::Tensor pairs = q.reshape({n, k / 2, 2});
  const at::Tensor packed = at::bitwise_or(pairs.select(2, 0), at::bitwise_left_shift(pairs.select(2, 1), 4));
  return {packed.contiguous(), best.squeeze(2).to(weight.scalar_type()).contiguous()};
}

Pair quantize_int4_kernel(const at::Tensor& weight, int64_t group_size) {
  check_int4(weight, group_size);
  return by_row_slices(weight, [&](const at::Tensor& rows) { return quantize_int4_rows(rows, group_size); });
}

Pair quantize_int4_autograd(const at::Tensor& weight, int64_t group_size) {
  refuse_grad(kInt4, weight);
  at::AutoDispatchBelowADInplaceOrView guard;
  return quantize_int4_op().call(weight, group_size);
}

// vmap: rows quantize alone, so the entries fold into the rows (and unfold from both outputs).
template <typename... Args>
Pair quantize_batched(const c10::OperatorHandle& handle, const at::Tensor& weight, Args... args) {
  const batching::Level level{c10::ArrayRef<at::Tensor>(weight)};
  auto batch = level.batch_size(c10::ArrayRef<at::Tensor>(weight));
  const auto& op = handle.typed<Pair(const at::Tensor&, Args...)>();
  if (!batch) return op.call(weight, args...);
  const at::Tensor w = level.front(weight, *batch);
  auto [q, s] = op.call(w.flatten(0, 1), args...);
  return {level.wrap(q.unflatten_symint(0, {*batch, w.sym_size(1)})),
          level.wrap(s.unflatten_symint(0, {*batch, w.sym_size(1)}))};
}

Pair quantize_fp8_batched(const at::Tensor& weight) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(kFp8, "");
  return quantize_batched(handle, weight);
}

Pair quantize_int4_batched(const at::Tensor& weight, int64_t group_size) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(kInt4, "");
  return quantize_batched(handle, weight, group_size);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& weight) { return quantize_fp8_op().call(weight); }

std::tuple<at::Tensor, at::Tensor> quantize_int4(const at::Tensor& weight, int64_t group_size) {
  return quantize_int4_op().call(weight, group_size);
}

TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("quantize_fp8", &quantize_fp8_meta);
  m.impl("quantize_int4", &quantize_int4_meta);
}
// The ATen kernels, registered at each device's key (as every op's are: a registration test holds it).
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("quantize_fp8", &quantize_fp8_kernel);
  m.impl("quantize_int4", &quantize_int4_kernel);
}
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8_kernel);
  m.impl("quantize_int4", &quantize_int4_kernel);
}
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("quantize_fp8", &quantize_fp8_autograd);
  m.impl("quantize_int4", &quantize_int4_autograd);
}
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("quantize_fp8", &quantize_fp8_batched);
  m.impl("quantize_int4", &quantize_int4_batched);
}

}  // namespace customops
