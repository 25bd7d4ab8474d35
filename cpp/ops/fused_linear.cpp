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
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <vector>

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
                                         const std::optional<at::Tensor>&, double, bool,
                                         const std::optional<at::Tensor>&)>();
  return op;
}



bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The dtype a quantized weight's product is computed in: float64 for float64 x, else float32.
at::ScalarType dequant_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// A quantized weight [out, in] in dtype (ATen ops: differentiable in x's direction, batched by
// vmap): float8 times its scale per output feature, or int4 nibbles less 8 times their group's scale.
at::Tensor dequantized(const at::Tensor& weight, const at::Tensor& weight_scale, at::ScalarType dtype) {
  if (weight.scalar_type() == at::kFloat8_e4m3fn) return weight.to(dtype) * weight_scale.to(dtype).unsqueeze(1);
  const c10::SymInt n = weight.sym_size(0), k = weight.sym_size(1) * 2, groups = weight_scale.sym_size(1);
  const at::Tensor lo = at::bitwise_and(weight, 15), hi = at::bitwise_right_shift(weight, 4);
  const at::Tensor q = at::stack({lo, hi}, -1).reshape_symint({n, groups, k / groups}).to(dtype) - 8;
  return (q * weight_scale.to(dtype).unsqueeze(2)).reshape_symint({n, k});
}

}  // namespace

at::Tensor apply_prologue(Prologue p, const at::Tensor& x, const std::optional<at::Tensor>& norm_weight, double eps) {
  return p == Prologue::kRmsNorm ? rms_norm(x, norm_weight, eps) : p == Prologue::kSwiglu ? swiglu(x) : x;
}

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual, std::string_view prologue,
                        const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight,
                        const std::optional<at::Tensor>& weight_scale) {
  return fused_linear_op().call(x, weight, bias, residual, c10::string_view(prologue.data(), prologue.size()),
                                norm_weight, eps, constant_weight, weight_scale);
}

Prologue check_fused_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view prologue,
                            const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& weight_scale) {
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
  const bool int4 = given(weight_scale) && weight.scalar_type() == at::kByte;
  if (given(weight_scale)) {  // a quantized weight
    TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn || int4, kOp,
                ": with weight_scale, weight must be float8_e4m3fn (quantize_fp8's) or uint8 (quantize_int4's two "
                "int4 a byte), but it is ", weight.scalar_type());
    if (int4) {
      checks::float_dtype(kOp, "weight_scale", *weight_scale);
    } else {
      TORCH_CHECK(weight_scale->scalar_type() == at::kFloat, kOp, ": weight_scale must be float32, but it is ",
                  weight_scale->scalar_type());
    }
    checks::same_device(kOp, "weight_scale", *weight_scale, "x", x);
  } else {
    TORCH_CHECK(weight.scalar_type() != at::kFloat8_e4m3fn, kOp,
                ": weight is float8_e4m3fn but no weight_scale is given (quantize_fp8 returns both)");
    checks::same_dtype(kOp, "weight", weight, "x", x);
  }
  checks::same_device(kOp, "weight", weight, "x", x);
  TORCH_CHECK(weight.dim() == 2, kOp, ": expected weight of shape [out_features, in_features], but got ",
              weight.sym_sizes());
  // in_features: two a byte of an int4 weight
  const c10::SymInt k_in = int4 ? weight.sym_size(1) * 2 : weight.sym_size(1);
  if (int4) {
    TORCH_CHECK(weight_scale->dim() == 2, kOp, ": expected weight_scale of shape [", weight.sym_size(0),
                ", groups] (a scale a group of inputs), but got ", weight_scale->sym_sizes());
    TORCH_SYM_CHECK(weight_scale->sym_size(0).sym_eq(weight.sym_size(0)).sym_and(weight_scale->sym_size(1).sym_ge(1)),
                    kOp, ": expected weight_scale of shape [", weight.sym_size(0),
                    ", groups] (a scale a group of inputs), but got ", weight_scale->sym_sizes());
    TORCH_SYM_CHECK((k_in % weight_scale->sym_size(1)).sym_eq(0), kOp, ": weight_scale's ", weight_scale->sym_size(1),
                    " groups do not divide the ", k_in, " in_features of the int4 weight");
  } else if (given(weight_scale)) {
    TORCH_CHECK(weight_scale->dim() == 1, kOp, ": expected weight_scale of shape [", weight.sym_size(0),
                "] (one scale an output feature), but got ", weight_scale->sym_sizes());
    TORCH_SYM_CHECK(weight_scale->sym_size(0).sym_eq(weight.sym_size(0)), kOp, ": expected weight_scale of shape [",
                    weight.sym_size(0), "] (one scale an output feature), but got ", weight_scale->sym_sizes());
  }
  if (p == Prologue::kSwiglu) {
    TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(k_in * 2), kOp,
                    ": with prologue \"swiglu\", x's last dim holds gate then up and must be twice weight's "
                    "in_features (", k_in, "), but x has shape ", x.sym_sizes());
  } else {
    TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(k_in), kOp, ": x's last dim must be weight's in_features (", k_in,
                    "), but x has shape ", x.sym_sizes());
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
                                const std::optional<at::Tensor>& norm_weight, double eps,
                                const std::optional<at::Tensor>& weight_scale) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight, weight_scale);
  const at::Tensor in = apply_prologue(p, x, norm_weight, eps);
  at::Tensor y;
  if (given(weight_scale)) {
    const at::ScalarType acc = dequant_dtype(x);
    const std::optional<at::Tensor> b = given(bias) ? std::optional<at::Tensor>(bias->to(acc)) : std::nullopt;
    y = at::linear(in.to(acc), dequantized(weight, *weight_scale, acc), b).to(x.scalar_type());
  } else {
    y = at::linear(in, weight, bias);
  }
  if (given(residual)) y.add_(*residual);
  return y;
}

namespace {

// ---- CPU --------------------------------------------------------------------------------------
// The unfused ops, except that a float32 (float64) product of a few rows (decoding) is split over
// torch's intra-op threads by output features: MKL runs a matrix-vector product on one thread (perf
// on a 2-core machine: 65% of a runner's decode step in one thread's sgemv while the other thread
// waited). Each thread's share is one BLAS call over a contiguous block of weight rows, of at
// least kMinBytesAThread. bfloat16 and float16 products go to ATen whole (oneDNN's threads): on a
// 2-core AVX-512 CPU (2026-11-30; ms, split / ATen's linear) bfloat16 at 1-8 rows of 4096 x 4096,
// 4096 x 14336 and 14336 x 4096 took 1.3-1.6x as long split (1.73 / 1.08, 5.33 / 3.90, 6.44 / 4.16
// at 1 row), float16 as long at 1 row and up to 1.8x at 2-8; float32 split took 0.39-0.78x at 1-4
// rows (1.50 / 2.77, 5.21 / 8.07, 6.53 / 10.63 at 1 row), at 8 rows 0.89-1.18x.
constexpr int64_t kMaxSplitRows = 4;
constexpr int64_t kMinBytesAThread = 256 * 1024;
// A quantized weight's product reads the codes as stored up to this many rows (float32, float16 or
// bfloat16 x); more rows (prefill) dequantize blocks of the weight for BLAS in x's dtype. On a
// 2-core AVX-512 CPU with bf16 x (8192 x 2048 and 2048 x 8192, fp8 and int4, 2026-11-29) the codes
// took 0.6-1.0 ms at 1-4 rows against 2.2-3.5 dequantized, about as long at 8 rows (2.1-2.6 ms
// against 2.1-3.5), and 2x as long at 16 (5.3-7.6 ms against 2.3-2.9).
constexpr int64_t kMaxQuantizedRows = 8;

at::Tensor fused_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, c10::string_view prologue,
                            const std::optional<at::Tensor>& norm_weight, double eps, bool /*constant_weight*/,
                            const std::optional<at::Tensor>& weight_scale) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight, weight_scale);
  const int64_t n = weight.size(0), k = weight.size(1), row_bytes = k * weight.element_size();
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  if (given(weight_scale) && rows > 0 && x.scalar_type() != at::kDouble && quantized_cpu_fit(weight, *weight_scale)) {
    const at::Tensor prologue_out = apply_prologue(p, x, norm_weight, eps);
    const at::Tensor in = prologue_out.reshape({rows, prologue_out.size(-1)});
    at::Tensor y;
    if (rows <= kMaxQuantizedRows) {
      y = quantized_rows_cpu(in, weight, *weight_scale);
    } else {
      y = quantized_matmul_cpu(in, weight, *weight_scale);
    }
    if (given(bias)) y.add_(bias->to(at::kFloat));
    y = y.to(x.scalar_type());
    if (given(residual)) y.add_(residual->reshape({rows, n}));
    return y.view(sizes);
  }
  const bool blas_gemv = x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble;
  if (given(weight_scale) || !blas_gemv || rows == 0 || rows > kMaxSplitRows || k == 0 || at::get_num_threads() < 2 ||
      at::in_parallel_region() || n * row_bytes < 2 * kMinBytesAThread || !weight.is_contiguous()) {
    return fused_linear_unfused(x, weight, bias, residual, prologue, norm_weight, eps, weight_scale);
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
  return y.view(sizes);
}

// ---- Meta -------------------------------------------------------------------------------------
at::Tensor fused_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, c10::string_view prologue,
                             const std::optional<at::Tensor>& norm_weight, double /*eps*/, bool /*constant_weight*/,
                             const std::optional<at::Tensor>& weight_scale) {
  check_fused_linear(x, weight, bias, residual, prologue, norm_weight, weight_scale);
  std::vector<c10::SymInt> sizes(x.sym_sizes().begin(), x.sym_sizes().end());
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

// ---- ATen decomposition: for autograd, forward-mode AD and vmap ------------------------------
// The prologue rounds to x's dtype as customops' rms_norm and swiglu do, so the values agree with
// the fused kernels' within one rounding of the product.
at::Tensor fused_linear_decomposed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                   const std::optional<at::Tensor>& norm_weight, double eps, bool /*constant_weight*/,
                                   const std::optional<at::Tensor>& weight_scale) {
  const Prologue p = check_fused_linear(x, weight, bias, residual, prologue, norm_weight, weight_scale);
  const at::ScalarType acc = rms_norm_acc_dtype(x.scalar_type());
  at::Tensor in = x;
  if (p == Prologue::kRmsNorm) {
    const at::Tensor xf = x.to(acc);
    at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    if (given(norm_weight)) y = y * norm_weight->to(acc);
    in = y.to(x.scalar_type());
  } else if (p == Prologue::kSwiglu) {
    const c10::SymInt n = x.sym_size(-1) / 2;  // (weight's in_features: an int4 weight packs two a byte)
    const at::Tensor g = x.narrow_symint(-1, 0, n).to(acc), u = x.narrow_symint(-1, n, n).to(acc);
    in = (at::silu(g) * u).to(x.scalar_type());
  }
  at::Tensor y;
  if (given(weight_scale)) {  // in the dequantized product's dtype, as the kernels
    const at::ScalarType dq = dequant_dtype(x);
    const std::optional<at::Tensor> b = given(bias) ? std::optional<at::Tensor>(bias->to(dq)) : std::nullopt;
    y = at::linear(in.to(dq), dequantized(weight, *weight_scale, dq), b).to(x.scalar_type());
  } else {
    y = at::linear(in, weight, bias);
  }
  return given(residual) ? y + *residual : y;
}

// ---- Autograd ---------------------------------------------------------------------------------
at::Tensor fused_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                 const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight,
                                 const std::optional<at::Tensor>& weight_scale) {
  if (given(weight_scale) && at::GradMode::is_enabled()) {
    TORCH_CHECK(!weight.requires_grad() && !weight_scale->requires_grad(), kOp,
                ": a quantized weight is frozen: weight and weight_scale must not require grad (x, bias, residual "
                "and norm_weight may: train adapters beside it)");
  }
  autograd::Recorder rec(x, weight, bias, residual, norm_weight, weight_scale);
  if (!rec) return call_below_autograd(fused_linear_op(), x, weight, bias, residual, prologue, norm_weight, eps,
                                                constant_weight, weight_scale);
  return fused_linear_decomposed(x, weight, bias, residual, prologue, norm_weight, eps, constant_weight, weight_scale);
}

// ---- Autocast: as a linear layer, float32 tensors run in the autocast dtype --------------------
at::Tensor fused_linear_autocast(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual, c10::string_view prologue,
                                 const std::optional<at::Tensor>& norm_weight, double eps, bool constant_weight,
                                 const std::optional<at::Tensor>& weight_scale) {
  const at::ScalarType low = at::autocast::get_autocast_dtype(x.device().type());
  auto cast = [&](const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kFloat ? t.to(low) : t; };
  auto cast_opt = [&](const std::optional<at::Tensor>& t) {
    return given(t) ? std::optional<at::Tensor>(cast(*t)) : t;
  };
  autocast::Below below;
  const at::Tensor w = cast(weight);
  // a cast weight is the output of the cast's kernel, just before: not constant to the product
  // (a quantized weight's float32 scale stays float32)
  return fused_linear_op().call(cast(x), w, cast_opt(bias), cast_opt(residual), prologue, cast_opt(norm_weight), eps,
                                constant_weight && w.is_same(weight), weight_scale);
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
