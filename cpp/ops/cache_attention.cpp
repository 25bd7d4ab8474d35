// _cache_attention: attention of new queries against a static KV cache (the decode and prefill
// steps of a causal LM packaged with customops.export.package_causal_lm), reading each sequence's
// filled length only. Meta kernel and a device-generic kernel (CPU and CUDA): each sequence's
// filled prefix goes through customops::attention (causal, bottom-right aligned), so it runs the
// fused attention kernels of either device. The lengths are read on the host (a device sync on
// CUDA); a split-KV decoding kernel that reads them on the device is to come.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "customops/customops.h"
#include "ops/attention.h"
#include "ops/checks.h"

namespace customops {
namespace {

constexpr const char* kOp = "customops::_cache_attention";

void check_cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& lengths) {
  checks::float_dtype(kOp, "q", q);
  checks::defined(kOp, "k_cache", k_cache);
  checks::defined(kOp, "v_cache", v_cache);
  checks::same_dtype(kOp, "k_cache", k_cache, "q", q);
  checks::same_dtype(kOp, "v_cache", v_cache, "q", q);
  checks::same_device(kOp, "k_cache", k_cache, "q", q);
  checks::same_device(kOp, "v_cache", v_cache, "q", q);
  TORCH_CHECK(q.dim() == 4, kOp, ": expected q of shape [B, Hq, T, D], but got ", q.sym_sizes());
  TORCH_CHECK(k_cache.dim() == 4, kOp, ": expected k_cache of shape [Bc, Hkv, S, D], but got ", k_cache.sym_sizes());
  checks::same_shape(kOp, "v_cache", v_cache, "k_cache", k_cache);
  TORCH_SYM_CHECK(k_cache.sym_size(0).sym_ge(q.sym_size(0)), kOp, ": the cache holds ", k_cache.sym_size(0),
                  " sequences, fewer than q's batch (", q.sym_size(0), ")");
  TORCH_SYM_CHECK(k_cache.sym_size(3).sym_eq(q.sym_size(3)), kOp, ": expected k_cache's head dim to be q's (",
                  q.sym_size(3), "), but got ", k_cache.sym_sizes());
  TORCH_SYM_CHECK(k_cache.sym_size(1).sym_ge(1), kOp, ": k_cache must have at least one head, but got ",
                  k_cache.sym_sizes());
  TORCH_SYM_CHECK((q.sym_size(1) % k_cache.sym_size(1)).sym_eq(0), kOp, ": q's heads (", q.sym_size(1),
                  ") must be a multiple of the cache's (", k_cache.sym_size(1), ") for grouped-query attention");
  checks::defined(kOp, "lengths", lengths);
  TORCH_CHECK(lengths.scalar_type() == at::kLong, kOp, ": expected lengths of dtype int64, but got ",
              lengths.scalar_type());
  TORCH_CHECK(lengths.dim() == 1, kOp, ": expected lengths of shape [B], but got ", lengths.sym_sizes());
  TORCH_SYM_CHECK(lengths.sym_size(0).sym_eq(q.sym_size(0)), kOp, ": expected lengths of shape [B] = [",
                  q.sym_size(0), "], but got ", lengths.sym_sizes());
  checks::same_device(kOp, "lengths", lengths, "q", q);
}

std::tuple<at::Tensor, at::Tensor> cache_attention_meta(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& lengths,
                                                        std::optional<double>) {
  check_cache_attention(q, k_cache, v_cache, lengths);
  return attention_outputs(q);
}

std::tuple<at::Tensor, at::Tensor> cache_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& lengths,
                                                        std::optional<double> scale) {
  check_cache_attention(q, k_cache, v_cache, lengths);
  auto [out, lse] = attention_outputs(q);
  const int64_t b = q.size(0), t = q.size(2), s = k_cache.size(2);
  const at::Tensor host = lengths.cpu();
  const int64_t* len = host.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(len[i] >= t && len[i] <= s, kOp, ": lengths[", i, "] is ", len[i], "; it must be at least the ", t,
                " new queries and at most the cache's ", s, " positions");
  }
  for (int64_t i = 0; i < b; ++i) {
    auto [o, l] = customops::attention(q.narrow(0, i, 1), k_cache.narrow(0, i, 1).narrow(2, 0, len[i]),
                                       v_cache.narrow(0, i, 1).narrow(2, 0, len[i]), /*causal=*/true, scale);
    out.narrow(0, i, 1).copy_(o);
    lse.narrow(0, i, 1).copy_(l);
  }
  return {out, lse};
}

// Not differentiable (inference): refuses inputs that require grad while grad mode is on, rather
// than returning outputs that silently do not.
std::tuple<at::Tensor, at::Tensor> cache_attention_autograd(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const at::Tensor& lengths,
                                                            std::optional<double> scale) {
  TORCH_CHECK(!at::GradMode::is_enabled() || !(q.requires_grad() || k_cache.requires_grad() || v_cache.requires_grad()),
              kOp, " is not differentiable (an inference op): call it under torch.no_grad() or on tensors that do "
              "not require grad");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::_cache_attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, std::optional<double>)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k_cache, v_cache, lengths, scale);
}

}  // namespace

// Registrations: Meta, the device-generic kernel on CPU and CUDA, and Autograd.
TORCH_LIBRARY_IMPL(customops, Meta, m) { m.impl("_cache_attention", &cache_attention_meta); }
TORCH_LIBRARY_IMPL(customops, CPU, m) { m.impl("_cache_attention", &cache_attention_impl); }
TORCH_LIBRARY_IMPL(customops, CUDA, m) { m.impl("_cache_attention", &cache_attention_impl); }
TORCH_LIBRARY_IMPL(customops, Autograd, m) { m.impl("_cache_attention", &cache_attention_autograd); }

}  // namespace customops
