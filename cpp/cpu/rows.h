// CPU building blocks for the rowwise and elementwise kernels, compiled once per instruction set
// (include only from cpp/cpu/*.cpp; everything lands in namespace customops::CPU_CAPABILITY):
// - load2/store2 move 2*Vectorized<acc>::size() elements of T and widen half types to float;
//   hsum adds a vector's lanes;
// - rows_loop runs an elementwise functor over tensors seen as rows x cols with a contiguous last
//   dim and a row stride each (so the halves of a gate-up tensor are read in place).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <array>
#include <type_traits>
#include <utility>

#include "ops/row_view.h"

namespace customops {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename T>
using acc_t = at::opmath_type<T>;
template <typename T>
using AccVec = Vectorized<acc_t<T>>;

// The sum of a vector's lanes, in lane order.
template <typename A>
A hsum(const Vectorized<A>& v) {
  alignas(64) A buf[Vectorized<A>::size()];
  v.store(buf);
  A s = 0;
  for (int i = 0; i < Vectorized<A>::size(); ++i) s += buf[i];
  return s;
}

// Elements handled per vector step for T.
template <typename T>
constexpr int64_t kStep = 2 * AccVec<T>::size();

template <typename T>
inline std::pair<AccVec<T>, AccVec<T>> load2(const T* p) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return {AccVec<T>::loadu(p), AccVec<T>::loadu(p + AccVec<T>::size())};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
    return {lo, hi};
  }
}

template <typename T>
inline void store2(T* p, const AccVec<T>& lo, const AccVec<T>& hi) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    lo.store(p);
    hi.store(p + AccVec<T>::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
}

// f(const std::array<A, NIn>& x) -> std::array<A, NOut>, called with A = AccVec<T> on full
// vector steps and A = acc_t<T> on the tail.
template <typename T, size_t NIn, size_t NOut, typename F>
void rows_loop(const F& f, const std::array<at::Tensor, NIn>& in, const std::array<at::Tensor, NOut>& out) {
  const int64_t numel = out[0].numel();
  if (numel == 0) return;
  const customops::RowLayout<NIn, NOut> L(in, out);
  std::array<const T*, NIn> ip;
  std::array<T*, NOut> op;
  for (size_t k = 0; k < NIn; ++k) ip[k] = in[k].template const_data_ptr<T>();
  for (size_t k = 0; k < NOut; ++k) op[k] = out[k].template mutable_data_ptr<T>();

  auto span = [&](int64_t r, int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + kStep<T> <= c1; c += kStep<T>) {
      std::array<AccVec<T>, NIn> lo, hi;
      for (size_t k = 0; k < NIn; ++k) std::tie(lo[k], hi[k]) = load2(ip[k] + r * L.in_stride[k] + c);
      auto ylo = f(lo), yhi = f(hi);
      for (size_t k = 0; k < NOut; ++k) store2(op[k] + r * L.out_stride[k] + c, ylo[k], yhi[k]);
    }
    for (; c < c1; ++c) {
      std::array<acc_t<T>, NIn> x;
      for (size_t k = 0; k < NIn; ++k) x[k] = static_cast<acc_t<T>>(ip[k][r * L.in_stride[k] + c]);
      auto y = f(x);
      for (size_t k = 0; k < NOut; ++k) op[k][r * L.out_stride[k] + c] = static_cast<T>(y[k]);
    }
  };
  constexpr int64_t kGrain = 32768;
  if (L.rows == 1) {
    at::parallel_for(0, L.cols, kGrain, [&](int64_t b, int64_t e) { span(0, b, e); });
  } else {
    at::parallel_for(0, L.rows, std::max<int64_t>(1, kGrain / L.cols), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) span(r, 0, L.cols);
    });
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace customops
