// fused_linear, device-independent parts: typed C++ API, argument checks, the CPU and Meta
// kernels, the unfused path (the CUDA kernel's path for many rows), and the Autograd, vmap
// and autocast kernels. The op is for inference: a gradient, a tangent or vmap takes it apart
// into ATen ops (the prologue written out, at::linear, the add), which autograd differentiates
// (twice, and forward-mode) and functorch batches; without them it runs the fused kernels.
#include "ops/fused_linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/autocast.h"
#include "ops/autograd.h"
#include "ops/checks.h"
#include "ops/llm.h"

namespace customops {
namespace {

constexpr const char* kOp = "customops::fused_linear";

const auto& fused_linear_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::fused_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&, c10::string_view,
                                         const std::optional<at::Tensor>&, double, bool)>();
  return op;
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// prologue(x) by customops' rms_norm or swiglu op (x itself for none).
at::Tensor apply_prologue(Prologue p, const at::Tensor& x, const std::optional<at::Tensor>& norm_weight, double eps) {
  return p == Prologue::kRmsNorm ? rms_norm(x, norm_weight, eps) : p == Prologue::kSwiglu ? swiglu(x) : x;
}

}  // namespace

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual, std::string_view prologue,
                        const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight) {
  return fused_linear_op().call(x, weight, bias, residual, c10::string_view(prologue.data(), prologue.size()),
                                norm_weight, eps, constant_weight);
}

Prologue check_fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view prologue,
                            const std::optional<at::Tensor>& norm_weight) {
  Prologue p;
  if (prologue == "none") {
    p = Prologue::kNone;
  } else if (prologue == "rms_norm") {
    p = Prologue::kRmsNorm;
  } else if (prologue == "swiglu") {
    p = Prologue::kSwiglu;
  } else {
    TORCH_CHECK(false, kOp, ": prologue must be \"none\", \"rms_norm\" or \"swiglu\", but got \"",
                std::string(prologue.data(), prologue.size()), "\"");
  }
  checks::float_dtype(kOp, "x", x);
  TORCH_CHECK(x.dim() >= 1, kOp, ": x must have at least one dimension (the features), but it is a scalar");
  checks::defined(kOp, "weight", weight);
  checks::same_dtype(kOp, "weight", weight, "x", x);
  checks::same_device(kOp, "weight", weight, "x", x);
  TORCH_CHECK(weight.dim() == 2, kOp, ": expected weight of shape [out_features, in_features], but got ",
              weight.sym_sizes());
  if (p == Prologue::kSwiglu) {
    TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(weight.sym_size(1) * 2), kOp,
                    ": with prologue \"swiglu\", x's last dim holds gate then up and must be twice weight's "
                    "in_features (", weight.sym_size(1), "), but x has shape ", x.sym_sizes());
  } else {
    TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(weight.sym_size(1)), kOp, ": x's last dim must be weight's in_features (",
                    weight.sym_size(1), "), but x has shape ", x.sym_sizes());
  }
  if (given(bias)) {
    checks::same_dtype(kOp, "bias", *bias, "x", x);
    checks::same_device(kOp, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1, kOp, ": expected bias of shape [", weight.sym_size(0), "], but got ",
                bias->sym_sizes());
    TORCH_SYM_CHECK(bias->sym_size(0).sym_eq(weight.sym_size(0)), kOp, ": expected bias of shape [",
                    weight.sym_size(0), "], but got ", bias->sym_sizes());
  }
  if (given(residual)) {
    const at::Tensor& r = *residual;
    checks::same_dtype(kOp, "residual", r, "x", x);
    checks::same_device(kOp, "residual", r, "x", x);
    TORCH_CHECK(r.dim() == x.dim(), kOp, ": expected residual of the result's shape, x.shape[:-1] + [",
                weight.sym_size(0), "], but got ", r.sym_sizes());
    for (int64_t i = 0; i < x.dim(); ++i) {
      const c10::SymInt want = i + 1 == x.dim() ? weight.sym_size(0) : x.sym_size(i);
      TORCH_SYM_CHECK(r.sym_size(i).sym_eq(want), kOp, ": expected residual of the result's shape, x.shape[:-1] + [",
                      weight.sym_size(0), "], but got ", r.sym_sizes());
    }
  }
  if (p == Prologue::kRmsNorm) {
    check_rms_norm(kOp, x, norm_weight, "norm_weight");
  } else {
    TORCH_CHECK(!given(norm_weight), kOp, ": norm_weight is given but prologue is \"",
                std::string(prologue.data(), prologue.size()), "\"; it is the weight of the \"rms_norm\" prologue");
  }
  return p;
}

at::Tensor fused_linear_unfused(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                const std::optional<at::Tensor>& norm_weight, double eps) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight);
  const at::Tensor in = apply_prologue(p, x, norm_weight, eps);
  at::Tensor y = at::linear(in, weight, bias);
  if (given(residual)) y.add_(*residual);
  return y;
}

namespace {

// ---- CPU --------------------------------------------------------------------------------------
// The unfused ops, except that the product of a few rows (decoding) is split over torch's
// intra-op threads by output features: MKL runs a matrix-vector product on one thread (perf on a
// 2-core machine: 65% of a runner's decode step in one thread's sgemv while the other thread
// waited). Each thread's share is one BLAS call over a contiguous block of weight rows, of at
// least kMinBytesAThread.
constexpr int64_t kMaxSplitRows = 8;
constexpr int64_t kMinBytesAThread = 256 * 1024;

at::Tensor fused_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view prologue,
                            const std::optional<at::Tensor>& norm_weight, double eps, bool /*constant_weight*/) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight);
  const int64_t n = weight.size(0), k = weight.size(1), row_bytes = k * weight.element_size();
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  if (rows == 0 || rows > kMaxSplitRows || k == 0 || at::get_num_threads() < 2 || at::in_parallel_region() ||
      n * row_bytes < 2 * kMinBytesAThread || !weight.is_contiguous()) {
    return fused_linear_unfused(x, weight, bias, residual, prologue, norm_weight, eps);
  }
  const at::Tensor in = apply_prologue(p, x, norm_weight, eps).reshape({rows, k}).contiguous();
  at::Tensor out_t = at::empty({n, rows}, x.options());  // features x rows: a block of features is a block of rows
  at::parallel_for(0, n, std::max<int64_t>(1, kMinBytesAThread / row_bytes), [&](int64_t begin, int64_t end) {
    const at::Tensor w = weight.narrow(0, begin, end - begin);
    at::Tensor o = out_t.narrow(0, begin, end - begin);
    if (rows == 1) {
      at::Tensor o1 = o.squeeze(1);
      at::mv_out(o1, w, in[0]);
    } else {
      at::mm_out(o, w, in.t());
    }
  });
  at::Tensor y = rows == 1 ? out_t.view({1, n}) : out_t.t().contiguous();
  if (given(bias)) y.add_(*bias);
  if (given(residual)) y.add_(residual->reshape({rows, n}));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}

// ---- Meta -------------------------------------------------------------------------------------
at::Tensor fused_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view prologue,
                             const std::optional<at::Tensor>& norm_weight, double /*eps*/, bool /*constant_weight*/) {
  check_fused_linear(x, weight, bias, residual, prologue, norm_weight);
  std::vector<c10::SymInt> sizes(x.sym_sizes().begin(), x.sym_sizes().end());
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

// ---- ATen decomposition: for autograd, forward-mode AD and vmap ------------------------------
// The prologue rounds to x's dtype as customops' rms_norm and swiglu do, so the values agree with
// the fused kernels' within one rounding of the product.
at::Tensor fused_linear_decomposed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                   const std::optional<at::Tensor>& norm_weight, double eps, bool /*constant_weight*/) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight);
  const at::ScalarType acc = rms_norm_acc_dtype(x.scalar_type());
  at::Tensor in = x;
  if (p == Prologue::kRmsNorm) {
    const at::Tensor xf = x.to(acc);
    at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    if (given(norm_weight)) y = y * norm_weight->to(acc);
    in = y.to(x.scalar_type());
  } else if (p == Prologue::kSwiglu) {
    const c10::SymInt n = weight.sym_size(1);
    const at::Tensor g = x.narrow_symint(-1, 0, n).to(acc), u = x.narrow_symint(-1, n, n).to(acc);
    in = (at::silu(g) * u).to(x.scalar_type());
  }
  at::Tensor y = at::linear(in, weight, bias);
  return given(residual) ? y + *residual : y;
}

// ---- Autograd ---------------------------------------------------------------------------------
at::Tensor fused_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                 const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight) {
  autograd::Recorder rec(x, weight, bias, residual, norm_weight);
  if (!rec) return call_below_autograd(fused_linear_op(), x, weight, bias, residual, prologue, norm_weight, eps,
                                                constant_weight);
  return fused_linear_decomposed(x, weight, bias, residual, prologue, norm_weight, eps, constant_weight);
}

// ---- Autocast: as a linear layer, float32 tensors run in the autocast dtype --------------------
at::Tensor fused_linear_autocast(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                 const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight) {
  const at::ScalarType low = at::autocast::get_autocast_dtype(x.device().type());
  auto cast = [&](const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kFloat ? t.to(low) : t; };
  auto cast_opt = [&](const std::optional<at::Tensor>& t) {
    return given(t) ? std::optional<at::Tensor>(cast(*t)) : t;
  };
  autocast::Below below;
  const at::Tensor w = cast(weight);
  // a cast weight is the output of the cast's kernel, just before: not constant to the product
  return fused_linear_op().call(cast(x), w, cast_opt(bias), cast_opt(residual), prologue, cast_opt(norm_weight), eps,
                                constant_weight && w.is_same(weight));
}

}  // namespace

// Meta kernel of fused_linear.
TORCH_LIBRARY_IMPL(customops, Meta, m) { m.impl("fused_linear", &fused_linear_meta); }

// CPU kernel of fused_linear: customops' CPU rms_norm or swiglu, ATen's linear (BLAS), the add.
TORCH_LIBRARY_IMPL(customops, CPU, m) { m.impl("fused_linear", &fused_linear_cpu); }

// Autograd kernel of fused_linear.
TORCH_LIBRARY_IMPL(customops, Autograd, m) { m.impl("fused_linear", &fused_linear_autograd); }

// vmap: the ATen decomposition, which functorch batches.
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) { m.impl("fused_linear", &fused_linear_decomposed); }

// Autocast kernel of fused_linear.
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("fused_linear", &fused_linear_autocast); }

}  // namespace customops
