// cache_attention's CPU kernel for a few new queries a sequence (decoding: T <= 16) in float32,
// bfloat16 or float16: one task a (sequence, kv head), which reads that head's keys and values of
// the filled length once for all its grouped query rows (G heads x T queries), 256 keys a block
// with an online softmax, in float32. A decode step's attention is a few kilobytes a head, so the
// tasks run in parallel only when there is enough work to pay for it; the call is a loop, not the
// blocked attention kernel that cache_attention_generic runs per sequence (which a prefill, float64
// and caches without a unit last stride still take).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/dispatch.h"
#include "ops/attention.h"
#include "ops/cache_attention.h"

namespace customops {
namespace CPU_CAPABILITY {

constexpr int64_t kBlock = 256;  // keys a block

// x as float32: itself for float32, else converted into buf.
template <typename T>
const float* as_float(const T* x, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(x[i]);
    return buf;
  }
}

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* len,
                      const int64_t* slot, const at::Tensor& out, const at::Tensor& lse, double scale) {
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3), hkv = k.size(1), g = hq / hkv;
  const int64_t rows = g * t;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  float* lp = lse.mutable_data_ptr<float>();
  int64_t keys = 0;
  for (int64_t i = 0; i < b; ++i) keys += len[i];
  const int64_t work = std::max<int64_t>(1, keys / std::max<int64_t>(b, 1) * d * rows);  // per task
  const auto scale_f = static_cast<float>(scale);
  at::parallel_for(0, b * hkv, std::max<int64_t>(1, (1 << 16) / work), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), acc(rows * d), s(rows * kBlock), kbuf(d), vbuf(d), m(rows), l(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / hkv, h = task % hkv, n = len[bi], c = slot != nullptr ? slot[bi] : bi;
      const T* kh = kp + c * k.stride(0) + h * k.stride(1);
      const T* vh = vp + c * v.stride(0) + h * v.stride(1);
      for (int64_t r = 0; r < rows; ++r) {  // row r: head h * g + r / t, query r % t
        const T* src = qp + bi * q.stride(0) + (h * g + r / t) * q.stride(1) + (r % t) * q.stride(2);
        for (int64_t c = 0; c < d; ++c) qf[r * d + c] = static_cast<float>(src[c]) * scale_f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
        const int64_t jn = std::min(kBlock, n - j0);
        for (int64_t j = 0; j < jn; ++j) {  // scores: key j0 + j against every row
          const float* kj = as_float(kh + (j0 + j) * k.stride(2), d, kbuf.data());
          for (int64_t r = 0; r < rows; ++r) {
            const float* qr = qf.data() + r * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t c = 0; c < d; ++c) dot += qr[c] * kj[c];
            // causal: query r % t (position n - t + r % t) sees keys up to its own position
            s[r * kBlock + j] = j0 + j <= n - t + r % t ? dot : -std::numeric_limits<float>::infinity();
          }
        }
        for (int64_t r = 0; r < rows; ++r) {  // online softmax: rescale what came before
          float* sr = s.data() + r * kBlock;
          float mb = m[r];
          for (int64_t j = 0; j < jn; ++j) mb = sr[j] > mb || std::isnan(sr[j]) ? sr[j] : mb;  // NaN wins
          if (mb == -std::numeric_limits<float>::infinity()) continue;  // no key of this block is seen
          const float corr = std::exp(m[r] - mb);
          float sum = 0.f;
          for (int64_t j = 0; j < jn; ++j) {
            sr[j] = std::exp(sr[j] - mb);
            sum += sr[j];
          }
          l[r] = l[r] * corr + sum;
          m[r] = mb;
          float* ar = acc.data() + r * d;
          for (int64_t c = 0; c < d; ++c) ar[c] *= corr;
        }
        for (int64_t j = 0; j < jn; ++j) {  // acc += p v, each value row read once
          const float* vj = as_float(vh + (j0 + j) * v.stride(2), d, vbuf.data());
          for (int64_t r = 0; r < rows; ++r) {
            if (m[r] == -std::numeric_limits<float>::infinity()) continue;
            const float p = s[r * kBlock + j];
            float* ar = acc.data() + r * d;
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) ar[c] += p * vj[c];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = h * g + r / t, tq = r % t;
        T* dst = op + bi * out.stride(0) + head * out.stride(1) + tq * out.stride(2);
        const float inv = 1.f / l[r];
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[r * d + c] * inv);
        lp[(bi * hq + head) * t + tq] = m[r] + std::log(l[r]);
      }
    }
  });
}

void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* len,
                             const int64_t* slot, const at::Tensor& out, const at::Tensor& lse, double scale) {
  switch (q.scalar_type()) {  // the caller takes float32, bfloat16 and float16 only
    case at::kFloat: decode_attention<float>(q, k, v, len, slot, out, lse, scale); break;
    case at::kBFloat16: decode_attention<c10::BFloat16>(q, k, v, len, slot, out, lse, scale); break;
    default: decode_attention<c10::Half>(q, k, v, len, slot, out, lse, scale); break;
  }
}

}  // namespace CPU_CAPABILITY

#ifdef CPU_CAPABILITY_DEFAULT
CUSTOMOPS_CPU_KERNEL(void, decode_attention_kernel, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const int64_t*, const int64_t*, const at::Tensor&, const at::Tensor&, double)

namespace {

std::tuple<at::Tensor, at::Tensor> cache_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& lengths,
                                                       std::optional<double> scale, const Slots& slots) {
  check_cache_attention(q, k_cache, v_cache, lengths, slots);
  const at::ScalarType dtype = q.scalar_type();
  const bool takes = (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                     q.size(2) <= kCacheAttentionMaxQueries && k_cache.stride(3) == 1 && v_cache.stride(3) == 1;
  if (!takes) return cache_attention_generic(q, k_cache, v_cache, lengths, scale, slots);
  auto [out, lse] = attention_outputs(q);  // out with a unit last stride; lse float32 for these dtypes
  const at::Tensor host = cache_lengths_on_host(q, k_cache, lengths);
  const at::Tensor host_slots = slots_on_host("customops::cache_attention", slots, k_cache.size(0), /*distinct=*/false);
  if (q.numel() == 0) return {out, lse};
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  CUSTOMOPS_CPU_DISPATCH(decode_attention_kernel, qc, k_cache, v_cache, host.const_data_ptr<int64_t>(),
                         slots ? host_slots.const_data_ptr<int64_t>() : nullptr, out, lse,
                         attention_scale(scale, q.size(3)));
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(customops, CPU, m) {
  m.impl("cache_attention", &cache_attention_cpu);
}
#endif

}  // namespace customops
