// CPU kernels of cross_entropy: the kernel-level entry points (cross_entropy_kernels_cpu) that the
// ops cross_entropy, _cross_entropy_backward and linear_cross_entropy run (cpp/ops). Rows in parallel (at::parallel_for), each row in
// float32 (float64 for float64) vectors.
// - Forward: one pass. Each vector lane keeps an online (max, sum of exp(x - max)) pair and the
//   sum of x (label smoothing); a step rescales the sums only when a lane's max grew (rare after
//   the first elements); the lanes combine at the row's end, where the target's logit is read.
// - Backward: one pass writing exp(x - lse) * (g_loss + g_lse) - g_loss * eps / V, the target's
//   element corrected after it (read before the pass: the gradient may overwrite the logits).
// Out-of-range targets raise before any kernel runs (check_target_range); the kernels themselves
// never read outside a row and give such a row NaN, as the CUDA kernels do.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu/dispatch.h"
#include "cpu/rows.h"
#include "ops/cross_entropy.h"

namespace customops {
namespace CPU_CAPABILITY {
namespace {

template <typename V>
inline V vexp(const V& x) {
  if constexpr (std::is_same_v<typename V::value_type, float>) {
    return x.exp_u20();  // a few ulp off at most; lse and the gradients stay within float32's tolerance
  } else {
    return x.exp();
  }
}

// Rows per parallel task: about 32K elements.
int64_t grain(int64_t v) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(v, 1)); }

// lse and the sum of the n elements of xr, in one pass.
template <typename T>
std::pair<acc_t<T>, acc_t<T>> lse_and_sum(const T* xr, int64_t n) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int kLanes = V::size();
  constexpr int kNoneGrew = (1 << kLanes) - 1;  // zero_mask() of a comparison true in no lane
  // The max starts at the lowest finite value, not -inf, so -inf logits add exp(-inf) = 0, never
  // exp(-inf + inf); a NaN logit makes its lane's max NaN (at::vec::maximum propagates it).
  constexpr A lowest = std::numeric_limits<A>::lowest();
  V vm(lowest), vs(A(0)), vx(A(0));
  int64_t c = 0;
  for (; c + kStep<T> <= n; c += kStep<T>) {
    auto [a0, a1] = load2(xr + c);
    const V m = at::vec::maximum(vm, at::vec::maximum(a0, a1));
    if ((m > vm).zero_mask() != kNoneGrew) vs = vs * vexp(vm - m);
    vm = m;
    vs = vs + vexp(a0 - m) + vexp(a1 - m);
    vx = vx + a0 + a1;
  }
  alignas(64) A lm[kLanes], ls[kLanes], lx[kLanes];
  vm.store(lm);
  vs.store(ls);
  vx.store(lx);
  A m = lowest, sum_x = 0;
  bool nan = false;
  for (int i = 0; i < kLanes; ++i) {
    nan = nan || std::isnan(lm[i]);
    m = std::max(m, lm[i]);
    sum_x += lx[i];
  }
  for (int64_t k = c; k < n; ++k) {
    const A v = static_cast<A>(xr[k]);
    nan = nan || std::isnan(v);
    m = std::max(m, v);
    sum_x += v;
  }
  if (nan) return {std::numeric_limits<A>::quiet_NaN(), sum_x};
  if (std::isinf(m)) return {m, sum_x};  // +inf; never exp(inf - inf)
  A s = 0;
  for (int i = 0; i < kLanes; ++i) s += ls[i] * std::exp(lm[i] - m);
  for (int64_t k = c; k < n; ++k) s += std::exp(static_cast<A>(xr[k]) - m);
  return {m + std::log(s), sum_x};  // all -inf: lowest + log(0) = -inf
}

}  // namespace

template <typename T>
void ce_fwd(const T* x, int64_t row_stride, const int64_t* target, int64_t rows, int64_t n, int64_t ignore_index,
            double eps, acc_t<T>* loss, acc_t<T>* lse) {
  using A = acc_t<T>;
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * row_stride;
      const auto [l, sum_x] = lse_and_sum(xr, n);
      lse[r] = l;
      const int64_t t = target[r];
      A out = 0;
      if (t != ignore_index) {
        // eps == 0 drops the smoothing term: 0 * sum_x is NaN when a logit is -inf.
        out = t < 0 || t >= n ? std::numeric_limits<A>::quiet_NaN()
                              : l - A(1 - eps) * static_cast<A>(xr[t]) - (eps == 0 ? A(0) : A(eps) * sum_x / A(n));
      }
      loss[r] = out;
    }
  });
}

// g, h: per-row loss and lse gradients (nullptr: zero) with their strides (0: one for all rows).
// The n columns are classes [offset, offset + n) of n_classes.
template <typename T>
void ce_bwd(const acc_t<T>* g, int64_t g_stride, const acc_t<T>* h, int64_t h_stride, const T* x, int64_t x_stride,
            const int64_t* target, const acc_t<T>* lse, int64_t rows, int64_t n, int64_t offset, int64_t n_classes,
            int64_t ignore_index, double eps, T* dx, int64_t dx_stride) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * x_stride;
      T* dr = dx + r * dx_stride;
      const int64_t t = target[r], local = t - offset;
      const bool counted = t != ignore_index, bad = counted && (t < 0 || t >= n_classes);
      const bool here = counted && local >= 0 && local < n;
      const A gl = counted && g != nullptr ? g[r * g_stride] : A(0);
      const A gz = h != nullptr ? h[r * h_stride] : A(0);
      const A p_scale = bad ? std::numeric_limits<A>::quiet_NaN() : gl + gz;
      const A uniform = gl * A(eps) / A(n_classes), l = lse[r];
      const A xt = here ? static_cast<A>(xr[local]) : A(0);  // read before dr (maybe xr itself) is written
      const V vl(l), vp(p_scale), vu(uniform);
      int64_t c = 0;
      for (; c + kStep<T> <= n; c += kStep<T>) {
        auto [a0, a1] = load2(xr + c);
        store2(dr + c, vexp(a0 - vl) * vp - vu, vexp(a1 - vl) * vp - vu);
      }
      for (; c < n; ++c) dr[c] = static_cast<T>(std::exp(static_cast<A>(xr[c]) - l) * p_scale - uniform);
      if (here) dr[local] = static_cast<T>(std::exp(xt - l) * p_scale - uniform - gl * A(1 - eps));
    }
  });
}

void cross_entropy_forward_kernel(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                                  double eps, const at::Tensor& loss, const at::Tensor& lse) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "customops::cross_entropy", [&] {
    using A = acc_t<scalar_t>;
    ce_fwd<scalar_t>(logits.const_data_ptr<scalar_t>(), logits.stride(0), target.const_data_ptr<int64_t>(), rows, n,
                     ignore_index, eps, loss.mutable_data_ptr<A>(), lse.mutable_data_ptr<A>());
  });
}

void cross_entropy_backward_kernel(const at::Tensor& grad_loss, const at::Tensor& grad_lse, const at::Tensor& logits,
                                   const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index, double eps,
                                   int64_t class_offset, int64_t n_classes, const at::Tensor& grad_logits) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "customops::_cross_entropy_backward", [&] {
    using A = acc_t<scalar_t>;
    ce_bwd<scalar_t>(grad_loss.defined() ? grad_loss.const_data_ptr<A>() : nullptr,
                     grad_loss.defined() ? grad_loss.stride(0) : 0,
                     grad_lse.defined() ? grad_lse.const_data_ptr<A>() : nullptr,
                     grad_lse.defined() ? grad_lse.stride(0) : 0, logits.const_data_ptr<scalar_t>(), logits.stride(0),
                     target.const_data_ptr<int64_t>(), lse.const_data_ptr<A>(), rows, n, class_offset, n_classes,
                     ignore_index, eps, grad_logits.data_ptr<scalar_t>(), grad_logits.stride(0));
  });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, cross_entropy_forward_kernel, const at::Tensor&, const at::Tensor&, int64_t, double,
                     const at::Tensor&, const at::Tensor&)
CUSTOMOPS_CPU_KERNEL(void, cross_entropy_backward_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, int64_t, double, int64_t, int64_t, const at::Tensor&)

namespace {

void forward_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double eps,
                 const at::Tensor& loss, const at::Tensor& lse) {
  CUSTOMOPS_CPU_DISPATCH(cross_entropy_forward_kernel, logits, target, ignore_index, eps, loss, lse);
}

void backward_cpu(const at::Tensor& grad_loss, const at::Tensor& grad_lse, const at::Tensor& logits,
                  const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index, double eps,
                  int64_t class_offset, int64_t n_classes, const at::Tensor& grad_logits) {
  CUSTOMOPS_CPU_DISPATCH(cross_entropy_backward_kernel, grad_loss, grad_lse, logits, target, lse, ignore_index, eps,
                         class_offset, n_classes, grad_logits);
}

}  // namespace

const CrossEntropyKernels& cross_entropy_kernels_cpu() {
  static const CrossEntropyKernels k{&forward_cpu, &backward_cpu};
  return k;
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
