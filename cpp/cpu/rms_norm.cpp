// CPU kernels of rms_norm, add_rms_norm and their backward ops: rows in parallel
// (at::parallel_for), each row in float32 (float64 for float64) vectors. add_rms_norm writes the
// row's sum x + residual (rounded to x's dtype) and its squares in one loop, then normalizes it
// while it is in L1; its backward adds the gradient that reached sum directly in the same write as
// dx. The weight gradient, a reduction over rows, is accumulated per block of rows (one block per
// thread) in float and summed once at the end, so tall and wide shapes both run at memory speed.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu/dispatch.h"
#include "cpu/rows.h"
#include "ops/llm.h"

namespace customops {
namespace CPU_CAPABILITY {

namespace {

// sum(a[i] * b[i]) over n elements of T, in acc_t<T>; b == nullptr means b = a.
template <typename T>
acc_t<T> dot(const T* a, const T* b, int64_t n) {
  using A = acc_t<T>;
  AccVec<T> v0(A(0)), v1(A(0));
  int64_t c = 0;
  for (; c + kStep<T> <= n; c += kStep<T>) {
    auto [a0, a1] = load2(a + c);
    if (b == nullptr) {
      v0 = at::vec::fmadd(a0, a0, v0);
      v1 = at::vec::fmadd(a1, a1, v1);
    } else {
      auto [b0, b1] = load2(b + c);
      v0 = at::vec::fmadd(a0, b0, v0);
      v1 = at::vec::fmadd(a1, b1, v1);
    }
  }
  A s = hsum(v0 + v1);
  for (; c < n; ++c) s += A(a[c]) * A(b == nullptr ? a[c] : b[c]);
  return s;
}

// out = a + b (rounded to T) over n elements; returns the sum of the squares of out as stored
// (read back from L1, so half types square their rounded values), in acc_t<T>.
template <typename T>
acc_t<T> add_row_sumsq(const T* a, const T* b, T* out, int64_t n) {
  using A = acc_t<T>;
  AccVec<T> v0(A(0)), v1(A(0));
  int64_t c = 0;
  for (; c + kStep<T> <= n; c += kStep<T>) {
    auto [a0, a1] = load2(a + c);
    auto [b0, b1] = load2(b + c);
    store2(out + c, a0 + b0, a1 + b1);
    auto [s0, s1] = load2(out + c);
    v0 = at::vec::fmadd(s0, s0, v0);
    v1 = at::vec::fmadd(s1, s1, v1);
  }
  A s = hsum(v0 + v1);
  for (; c < n; ++c) {
    out[c] = static_cast<T>(A(a[c]) + A(b[c]));
    s += A(out[c]) * A(out[c]);
  }
  return s;
}

}  // namespace

// W, the weight's element type, is T or (for half types) float: load2 widens both to the same
// float vectors.
// With res != nullptr (add_rms_norm), the normalized row is sum = x + res, written first.
template <typename T, typename W>
void rms_norm_fwd(const T* x, const T* res, const W* w, T* y, T* sum, acc_t<T>* rstd, int64_t rows, int64_t n,
                  double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * n;
      A ss;
      if (res != nullptr) {
        ss = add_row_sumsq(xr, res + r * n, sum + r * n, n);
        xr = sum + r * n;
      } else {
        ss = dot<T>(xr, nullptr, n);
      }
      T* yr = y + r * n;
      const A rs = A(1) / std::sqrt(ss / A(n) + A(eps));
      rstd[r] = rs;
      const AccVec<T> vrs(rs);
      int64_t c = 0;
      for (; c + kStep<T> <= n; c += kStep<T>) {
        auto [x0, x1] = load2(xr + c);
        x0 = x0 * vrs;
        x1 = x1 * vrs;
        if (w != nullptr) {
          auto [w0, w1] = load2(w + c);
          x0 = x0 * w0;
          x1 = x1 * w1;
        }
        store2(yr + c, x0, x1);
      }
      for (; c < n; ++c) yr[c] = static_cast<T>(A(xr[c]) * rs * (w != nullptr ? A(w[c]) : A(1)));
    }
  });
}

// dx = rstd * (w*dy) - x * rstd^3 / n * sum(w*dy*x) (+ dadd: add_rms_norm's gradient of sum);
// dw = sum over rows of dy * x * rstd.
// Rows go in `blocks` contiguous blocks, one parallel task each; block k adds its rows' dw into
// row k of dw_partial ([blocks, n], zeroed), so no two tasks share an accumulator whatever the
// thread pool does.
template <typename T, typename W>
void rms_norm_bwd(const T* dy, const T* x, const W* w, const acc_t<T>* rstd, const T* dadd, T* dx,
                  acc_t<T>* dw_partial, int64_t rows, int64_t n, int64_t blocks) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  const int64_t per_block = (rows + blocks - 1) / blocks;
  at::parallel_for(0, blocks, 1, [&](int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      A* dwp = dw_partial == nullptr ? nullptr : dw_partial + k * n;
      for (int64_t r = k * per_block; r < std::min(rows, (k + 1) * per_block); ++r) {
        const T* dyr = dy + r * n;
        const T* xr = x + r * n;
        const A rs = rstd[r];
        const V vrs(rs);
        if (dx != nullptr) {
          A s = 0;
          {
            V v0(A(0)), v1(A(0));
            int64_t c = 0;
            for (; c + kStep<T> <= n; c += kStep<T>) {
              auto [g0, g1] = load2(dyr + c);
              auto [x0, x1] = load2(xr + c);
              if (w != nullptr) {
                auto [w0, w1] = load2(w + c);
                g0 = g0 * w0;
                g1 = g1 * w1;
              }
              v0 = at::vec::fmadd(g0, x0, v0);
              v1 = at::vec::fmadd(g1, x1, v1);
            }
            s = hsum(v0 + v1);
            for (; c < n; ++c) s += A(dyr[c]) * (w != nullptr ? A(w[c]) : A(1)) * A(xr[c]);
          }
          const A k = s * rs * rs * rs / A(n);
          const V vk(k);
          T* dxr = dx + r * n;
          const T* dar = dadd == nullptr ? nullptr : dadd + r * n;
          int64_t c = 0;
          for (; c + kStep<T> <= n; c += kStep<T>) {
            auto [g0, g1] = load2(dyr + c);
            auto [x0, x1] = load2(xr + c);
            if (w != nullptr) {
              auto [w0, w1] = load2(w + c);
              g0 = g0 * w0;
              g1 = g1 * w1;
            }
            V o0 = g0 * vrs - x0 * vk, o1 = g1 * vrs - x1 * vk;
            if (dar != nullptr) {
              auto [d0, d1] = load2(dar + c);
              o0 = o0 + d0;
              o1 = o1 + d1;
            }
            store2(dxr + c, o0, o1);
          }
          for (; c < n; ++c) {
            const A g = A(dyr[c]) * (w != nullptr ? A(w[c]) : A(1));
            dxr[c] = static_cast<T>(g * rs - A(xr[c]) * k + (dar != nullptr ? A(dar[c]) : A(0)));
          }
        }
        if (dwp != nullptr) {
          int64_t c = 0;
          for (; c + kStep<T> <= n; c += kStep<T>) {
            auto [g0, g1] = load2(dyr + c);
            auto [x0, x1] = load2(xr + c);
            const int64_t h = V::size();
            at::vec::fmadd(g0 * vrs, x0, V::loadu(dwp + c)).store(dwp + c);
            at::vec::fmadd(g1 * vrs, x1, V::loadu(dwp + c + h)).store(dwp + c + h);
          }
          for (; c < n; ++c) dwp[c] += A(dyr[c]) * A(xr[c]) * rs;
        }
      }
    }
  });
}

// res and sum: undefined for rms_norm, add_rms_norm's residual and sum output.
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, const at::Tensor& y,
                     const at::Tensor& sum, const at::Tensor& rstd, double eps) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "customops::rms_norm", [&] {
    with_weight_type<scalar_t>(w, [&](auto w_tag) {
      using W = decltype(w_tag);
      rms_norm_fwd<scalar_t, W>(x.const_data_ptr<scalar_t>(), res.defined() ? res.const_data_ptr<scalar_t>() : nullptr,
                                w.defined() ? w.const_data_ptr<W>() : nullptr, y.mutable_data_ptr<scalar_t>(),
                                sum.defined() ? sum.mutable_data_ptr<scalar_t>() : nullptr,
                                rstd.mutable_data_ptr<acc_t<scalar_t>>(), rows, n, eps);
    });
  });
}

// dadd: undefined for rms_norm, add_rms_norm's gradient of sum (added to dx).
void rms_norm_backward_kernel(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor& rstd, const at::Tensor& dadd, const at::Tensor& dx,
                              const at::Tensor& dw_partial, int64_t blocks) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "customops::_rms_norm_backward", [&] {
    using A = acc_t<scalar_t>;
    with_weight_type<scalar_t>(w, [&](auto w_tag) {
      using W = decltype(w_tag);
      rms_norm_bwd<scalar_t, W>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                w.defined() ? w.const_data_ptr<W>() : nullptr, rstd.const_data_ptr<A>(),
                                dadd.defined() ? dadd.const_data_ptr<scalar_t>() : nullptr,
                                dx.defined() ? dx.mutable_data_ptr<scalar_t>() : nullptr,
                                dw_partial.defined() ? dw_partial.mutable_data_ptr<A>() : nullptr, rows, n, blocks);
    });
  });
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, rms_norm_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, double)
CUSTOMOPS_CPU_KERNEL(void, rms_norm_backward_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)

namespace {

at::Tensor weight_or_undefined(const std::optional<at::Tensor>& w) {
  return w.has_value() && w->defined() ? w->contiguous() : at::Tensor();
}

// Rows of no elements have no mean square: their rstd is NaN, as rsqrt(mean([]) + eps) is.
const at::Tensor& empty_rows_rstd(const at::Tensor& x, const at::Tensor& rstd) {
  if (x.size(-1) == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());
  return rstd;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                double eps) {
  check_rms_norm("customops::rms_norm", x, weight);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())));
  CUSTOMOPS_CPU_DISPATCH(rms_norm_kernel, x.contiguous(), at::Tensor(), weight_or_undefined(weight), y, at::Tensor(),
                         rstd, eps);
  return {y, empty_rows_rstd(x, rstd)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                                const std::optional<at::Tensor>& weight, double eps) {
  check_add_rms_norm("customops::add_rms_norm", x, residual, weight);
  at::Tensor y = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(rms_norm_acc_dtype(x.scalar_type())));
  CUSTOMOPS_CPU_DISPATCH(rms_norm_kernel, x.contiguous(), residual.contiguous(), weight_or_undefined(weight), y, sum,
                         rstd, eps);
  return {y, sum, empty_rows_rstd(x, rstd)};
}

// dx (with dadd added when defined) and dw; the checks are the caller's.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_common(const at::Tensor& grad_y, const at::Tensor& x,
                                                            const std::optional<at::Tensor>& weight,
                                                            const at::Tensor& rstd, const at::Tensor& dadd,
                                                            std::array<bool, 2> mask) {
  const at::Tensor w = weight_or_undefined(weight);
  at::Tensor dx = mask[0] ? at::empty(x.sizes(), x.options()) : at::Tensor();
  // One block of rows per thread, each at least ~8K elements (fewer blocks for small inputs).
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const int64_t min_rows = std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1));
  const int64_t blocks = std::clamp<int64_t>((rows + min_rows - 1) / min_rows, 1, at::get_num_threads());
  at::Tensor dw_partial;
  if (mask[1] && w.defined()) {
    dw_partial = at::zeros({blocks, n}, rstd.options());
  }
  CUSTOMOPS_CPU_DISPATCH(rms_norm_backward_kernel, grad_y.contiguous(), x.contiguous(), w, rstd.contiguous(),
                         mask[0] && dadd.defined() ? dadd.contiguous() : at::Tensor(), dx, dw_partial, blocks);
  return {dx.defined() ? dx : at::empty({0}, x.options()),
          dw_partial.defined() ? dw_partial.sum(0).to(w.scalar_type()) : at::empty({0}, x.options())};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                         const std::optional<at::Tensor>& weight,
                                                         const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_rms_norm_backward(grad_y, x, weight, rstd);
  return rms_norm_backward_common(grad_y, x, weight, rstd, at::Tensor(), mask);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_cpu(const at::Tensor& grad_y,
                                                             const std::optional<at::Tensor>& grad_sum,
                                                             const at::Tensor& sum,
                                                             const std::optional<at::Tensor>& weight,
                                                             const at::Tensor& rstd, std::array<bool, 2> mask) {
  check_add_rms_norm_backward(grad_y, grad_sum, sum, weight, rstd);
  return rms_norm_backward_common(grad_y, sum, weight, rstd, grad_sum.value_or(at::Tensor()), mask);
}

}  // namespace

// CPU kernels of rms_norm and add_rms_norm.
TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("_rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("_add_rms_norm_backward", &add_rms_norm_backward_cpu);
}
#endif  // CPU_CAPABILITY_DEFAULT

}  // namespace customops
