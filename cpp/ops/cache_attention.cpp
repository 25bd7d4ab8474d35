// cache_attention, cache_write and rope_cache_write: a static KV cache (the decode and prefill steps of a causal LM
// packaged with customops.export.package_causal_lm), device-independent parts: argument checks,
// Meta kernels, the device-generic kernels (every CPU input; the CUDA inputs the split-KV kernel
// of cuda/cache_attention.cu does not take), Autograd kernels that refuse gradients (inference
// ops), a vmap rule for cache_attention, and the typed C++ API.
//
// The generic kernels read lengths / start on the host, which on CUDA waits for the device; the
// CUDA kernels read them on the device (no sync, so a CUDA graph can capture a decode step).
#include "ops/cache_attention.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "customops/customops.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#include "ops/batching.h"
#include "ops/checks.h"
#include "ops/layout.h"
#include "ops/rope.h"

namespace customops {

namespace {
constexpr const char* kAttn = "customops::cache_attention";
constexpr const char* kWrite = "customops::cache_write";
constexpr const char* kRopeWrite = "customops::rope_cache_write";

using Pair = std::tuple<at::Tensor, at::Tensor>;

const auto& cache_attention_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::cache_attention", "")
                       .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   std::optional<double>, const Slots&)>();
  return op;
}

const auto& cache_write_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::cache_write", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const Slots&)>();
  return op;
}

const auto& rope_cache_write_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("customops::rope_cache_write", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const Slots&)>();
  return op;
}

// A [Bc, Hkv, S, D] cache pair of one dtype and device.
void check_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  checks::float_dtype(op, "k_cache", k_cache);
  checks::defined(op, "v_cache", v_cache);
  TORCH_CHECK(k_cache.dim() == 4, op, ": expected k_cache of shape [Bc, Hkv, S, D], but got ", k_cache.sym_sizes());
  checks::same_shape(op, "v_cache", v_cache, "k_cache", k_cache);
  checks::same_dtype(op, "v_cache", v_cache, "k_cache", k_cache);
  checks::same_device(op, "v_cache", v_cache, "k_cache", k_cache);
  TORCH_SYM_CHECK(k_cache.sym_size(1).sym_ge(1), op, ": k_cache must have at least one head, but got ",
                  k_cache.sym_sizes());
}

// An int64 [B] tensor of positions on the cache's device.
void check_positions(const char* op, const char* name, const at::Tensor& t, const c10::SymInt& b,
                     const at::Tensor& cache) {
  checks::defined(op, name, t);
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": expected ", name, " of dtype int64, but got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": expected ", name, " of shape [B], but got ", t.sym_sizes());
  TORCH_SYM_CHECK(t.sym_size(0).sym_eq(b), op, ": expected ", name, " of shape [B] = [", b, "], but got ",
                  t.sym_sizes());
  checks::same_device(op, name, t, "k_cache", cache);
}

// slots, where given, an int64 [B] on the cache's device (its values are checked where they are
// read); without them the cache holds row b's sequence at b, so it must hold B sequences.
void check_slots(const char* op, const Slots& slots, const c10::SymInt& b, const at::Tensor& cache,
                 const char* batch_of, bool distinct) {
  if (slots) {
    check_positions(op, "slots", *slots, b, cache);
    // distinct slots (a write's) are no more than the cache's sequences
    TORCH_SYM_CHECK(cache.sym_size(0).sym_ge(b).sym_or(c10::SymBool(!distinct)), op, ": the cache holds ",
                    cache.sym_size(0), " sequences, fewer than ", batch_of, "'s batch (", b,
                    "), so its slots cannot be distinct");
    return;
  }
  TORCH_SYM_CHECK(cache.sym_size(0).sym_ge(b), op, ": the cache holds ", cache.sym_size(0), " sequences, fewer than ",
                  batch_of, "'s batch (", b, "); pass slots to map the batch onto the cache's sequences");
}

// The slots' values as a device tensor for index_select: those given, else 0 to b - 1.
at::Tensor slot_index(const Slots& slots, int64_t b, const at::Tensor& cache) {
  return slots ? slots->contiguous() : at::arange(b, cache.options().dtype(at::kLong));
}

// Not differentiable (inference ops): refuse inputs that require grad while grad mode is on rather
// than return outputs that silently do not.
void refuse_grad(const char* op, std::initializer_list<at::Tensor> ts) {
  if (!at::GradMode::is_enabled()) return;
  for (const auto& t : ts) {
    TORCH_CHECK(!t.requires_grad(), op, " is not differentiable (an inference op): call it under torch.no_grad() or "
                "on tensors that do not require grad");
  }
}

Pair cache_attention_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& lengths, std::optional<double>, const Slots& slots) {
  check_cache_attention(q, k_cache, v_cache, lengths, slots);
  return attention_outputs(q);
}

Pair cache_attention_autograd(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& lengths, std::optional<double> scale, const Slots& slots) {
  refuse_grad(kAttn, {q, k_cache, v_cache});
  at::AutoDispatchBelowADInplaceOrView guard;
  return cache_attention_op().call(q, k_cache, v_cache, lengths, scale, slots);
}

// vmap: entries fold into the batch (each entry's B sequences read the first B of its own cache,
// or its slots of it, shifted to the entry's place in the folded cache).
Pair cache_attention_batched(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& lengths, std::optional<double> scale, const Slots& slots) {
  const at::Tensor sl = slots.value_or(at::Tensor());
  batching::Level level({q, k_cache, v_cache, lengths, sl});
  auto batch = level.batch_size({q, k_cache, v_cache, lengths, sl});
  if (!batch) return cache_attention_op().call(q, k_cache, v_cache, lengths, scale, slots);
  const c10::SymInt& e = *batch;
  const at::Tensor qf = level.front(q, e);
  const c10::SymInt b = qf.sym_size(1);
  Slots folded;
  if (slots) {
    // an entry's slot b is row e * Bc + b of the folded cache; one outside [0, Bc) stays outside
    // (-1), not a row of the next entry's cache
    const int64_t bc = level.front(k_cache, e).size(1);
    const at::Tensor base = at::arange(e.guard_int(__FILE__, __LINE__), sl.options()).unsqueeze(1) * bc;
    const at::Tensor s = level.front(sl, e);
    folded = at::where((s >= 0) & (s < bc), s + base, at::full_like(s, -1)).flatten(0, 1);
  }
  auto cache = [&](const at::Tensor& c) {
    const at::Tensor f = level.front(c, e);
    return (slots ? f : f.narrow_symint(1, 0, b)).flatten(0, 1);
  };
  auto [out, lse] = cache_attention_op().call(qf.flatten(0, 1), cache(k_cache), cache(v_cache),
                                              level.front(lengths, e).flatten(0, 1), scale, folded);
  return {level.wrap(out.unflatten_symint(0, {e, b})), level.wrap(lse.unflatten_symint(0, {e, b}))};
}

// vmap: the caches must be batched wherever the new values or positions are (an in-place write of
// batched values, as ATen's in-place rules require); each entry writes its own caches, which stay
// views of the batched ones.
void cache_write_batched(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& start, const Slots& slots) {
  const at::Tensor sl = slots.value_or(at::Tensor());
  batching::Level level({k_cache, v_cache, k, v, start, sl});
  auto batch = level.batch_size({k_cache, v_cache, k, v, start, sl});
  if (!batch) return cache_write_op().call(k_cache, v_cache, k, v, start, slots);
  TORCH_CHECK(level.batched(k_cache) && level.batched(v_cache), kWrite,
              ": vmap: k_cache and v_cache must be batched where k, v or start is (they are written in place)");
  const c10::SymInt& e = *batch;
  const at::Tensor kc = level.front(k_cache, e), vc = level.front(v_cache, e), kf = level.front(k, e),
                   vf = level.front(v, e), sf = level.front(start, e);
  const at::Tensor slf = slots ? level.front(sl, e) : at::Tensor();
  for (int64_t i = 0, n = e.guard_int(__FILE__, __LINE__); i < n; ++i) {
    cache_write_op().call(kc[i], vc[i], kf[i], vf[i], sf[i], slots ? Slots(slf[i]) : std::nullopt);
  }
}

void cache_write_meta(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& start, const Slots& slots) {
  check_cache_write(k_cache, v_cache, k, v, start, slots);
}

// As ATen's in-place ops under autograd: refuse what would need a gradient, bump the versions of
// what was written (ADInplaceOrView's job, which this kernel takes over).
void cache_write_autograd(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& start, const Slots& slots) {
  refuse_grad(kWrite, {k_cache, v_cache, k, v});
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    cache_write_op().call(k_cache, v_cache, k, v, start, slots);
  }
  k_cache.unsafeGetTensorImpl()->bump_version();
  v_cache.unsafeGetTensorImpl()->bump_version();
}

at::Tensor rope_cache_write_meta(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& start, const Slots& slots) {
  check_rope_cache_write(k_cache, v_cache, q, k, v, cos, sin, start, slots);
  return heads_layout_like(q);
}

at::Tensor rope_cache_write_autograd(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                     const at::Tensor& sin, const at::Tensor& start, const Slots& slots) {
  refuse_grad(kRopeWrite, {k_cache, v_cache, q, k, v, cos, sin});
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = rope_cache_write_op().call(k_cache, v_cache, q, k, v, cos, sin, start, slots);
  }
  k_cache.unsafeGetTensorImpl()->bump_version();
  v_cache.unsafeGetTensorImpl()->bump_version();
  return out;
}

// vmap: as cache_write's rule, an entry at a time; the rotated q of the entries stacked.
at::Tensor rope_cache_write_batched(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                    const at::Tensor& sin, const at::Tensor& start, const Slots& slots) {
  const at::Tensor sl = slots.value_or(at::Tensor());
  batching::Level level({k_cache, v_cache, q, k, v, cos, sin, start, sl});
  auto batch = level.batch_size({k_cache, v_cache, q, k, v, cos, sin, start, sl});
  if (!batch) return rope_cache_write_op().call(k_cache, v_cache, q, k, v, cos, sin, start, slots);
  TORCH_CHECK(level.batched(k_cache) && level.batched(v_cache), kRopeWrite,
              ": vmap: k_cache and v_cache must be batched where another argument is (they are written in place)");
  const c10::SymInt& e = *batch;
  const at::Tensor kc = level.front(k_cache, e), vc = level.front(v_cache, e), qf = level.front(q, e),
                   kf = level.front(k, e), vf = level.front(v, e), cf = level.front(cos, e), sf = level.front(sin, e),
                   pf = level.front(start, e);
  const at::Tensor slf = slots ? level.front(sl, e) : at::Tensor();
  std::vector<at::Tensor> outs;
  for (int64_t i = 0, n = e.guard_int(__FILE__, __LINE__); i < n; ++i) {
    outs.push_back(rope_cache_write_op().call(kc[i], vc[i], qf[i], kf[i], vf[i], cf[i], sf[i], pf[i],
                                              slots ? Slots(slf[i]) : std::nullopt));
  }
  return level.wrap(at::stack(outs));
}

// Autocast: q, k, v, cos and sin follow the caches' dtype (the caches are written in place, so
// theirs is the one dtype that cannot change); the rotated q comes back in it.
at::Tensor rope_cache_write_autocast(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                     const at::Tensor& sin, const at::Tensor& start, const Slots& slots) {
  const at::ScalarType dt = k_cache.scalar_type();
  auto like_cache = [&](const at::Tensor& t) {
    return t.defined() && t.is_floating_point() && k_cache.is_floating_point() && t.scalar_type() != dt ? t.to(dt) : t;
  };
  autocast::Below below;
  return rope_cache_write_op().call(k_cache, v_cache, like_cache(q), like_cache(k), like_cache(v), like_cache(cos),
                                    like_cache(sin), start, slots);
}

// start read on the host (a device sync on CUDA) and checked against the cache's positions.
at::Tensor start_on_host(const char* op, const at::Tensor& start, int64_t t, int64_t s) {
  at::Tensor host = start.cpu().contiguous();
  const int64_t* pos = host.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] <= s - t, op, ": start[", i, "] is ", pos[i], "; its ", t,
                " new positions must fit in the cache's ", s, " (start in [0, ", s - t, "])");
  }
  return host;
}

void check_write(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& start, const Slots& slots) {
  check_cache(op, k_cache, v_cache);
  checks::defined(op, "k", k);
  checks::defined(op, "v", v);
  TORCH_CHECK(k.dim() == 4, op, ": expected k of shape [B, Hkv, T, D], but got ", k.sym_sizes());
  checks::same_shape(op, "v", v, "k", k);
  checks::same_dtype(op, "k", k, "k_cache", k_cache);
  checks::same_dtype(op, "v", v, "k_cache", k_cache);
  checks::same_device(op, "k", k, "k_cache", k_cache);
  checks::same_device(op, "v", v, "k_cache", k_cache);
  TORCH_SYM_CHECK(k.sym_size(1).sym_eq(k_cache.sym_size(1)).sym_and(k.sym_size(3).sym_eq(k_cache.sym_size(3))), op,
                  ": expected k of shape [B, Hkv, T, D] with the cache's Hkv and D ", k_cache.sym_sizes(),
                  ", but got ", k.sym_sizes());
  TORCH_SYM_CHECK(k.sym_size(2).sym_le(k_cache.sym_size(2)), op, ": k has ", k.sym_size(2),
                  " new positions a sequence, more than the cache's ", k_cache.sym_size(2));
  check_positions(op, "start", start, k.sym_size(0), k_cache);
  check_slots(op, slots, k.sym_size(0), k_cache, "k", /*distinct=*/true);
  // written in place: like ATen's in-place ops, no element of a cache shares memory with another
  checks::no_internal_overlap(op, "k_cache", k_cache);
  checks::no_internal_overlap(op, "v_cache", v_cache);
  if (checks::concrete(k_cache) && checks::concrete(v_cache)) {
    const at::MemOverlapStatus both = at::get_overlap_status(k_cache, v_cache);
    TORCH_CHECK(both != at::MemOverlapStatus::Full && both != at::MemOverlapStatus::Partial, op,
                ": k_cache and v_cache share memory; each is written in place, so they must not");
  }
}

// CacheAttentionChunks::current()
thread_local int64_t chunk_queries = 0;

}  // namespace

CacheAttentionChunks::CacheAttentionChunks(int64_t queries) : previous_(chunk_queries) { chunk_queries = queries; }
CacheAttentionChunks::~CacheAttentionChunks() { chunk_queries = previous_; }
int64_t CacheAttentionChunks::current() { return chunk_queries; }

void check_cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& lengths, const Slots& slots) {
  checks::float_dtype(kAttn, "q", q);
  check_cache(kAttn, k_cache, v_cache);
  checks::same_dtype(kAttn, "k_cache", k_cache, "q", q);
  checks::same_device(kAttn, "k_cache", k_cache, "q", q);
  TORCH_CHECK(q.dim() == 4, kAttn, ": expected q of shape [B, Hq, T, D], but got ", q.sym_sizes());
  TORCH_SYM_CHECK(k_cache.sym_size(3).sym_eq(q.sym_size(3)), kAttn, ": expected k_cache's head dim to be q's (",
                  q.sym_size(3), "), but got ", k_cache.sym_sizes());
  TORCH_SYM_CHECK((q.sym_size(1) % k_cache.sym_size(1)).sym_eq(0), kAttn, ": q's heads (", q.sym_size(1),
                  ") must be a multiple of the cache's (", k_cache.sym_size(1), ") for grouped-query attention");
  TORCH_SYM_CHECK(q.sym_size(2).sym_le(k_cache.sym_size(2)), kAttn, ": q has ", q.sym_size(2),
                  " new queries a sequence, more than the cache's ", k_cache.sym_size(2), " positions");
  check_positions(kAttn, "lengths", lengths, q.sym_size(0), k_cache);
  check_slots(kAttn, slots, q.sym_size(0), k_cache, "q", /*distinct=*/false);
}

at::Tensor slots_on_host(const char* op, const Slots& slots, int64_t bc, bool distinct) {
  if (!slots) return {};
  at::Tensor host = slots->cpu().contiguous();
  const int64_t* sl = host.const_data_ptr<int64_t>();
  const int64_t b = host.numel();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < bc, op, ": slots[", i, "] is ", sl[i], ", outside the cache's ", bc,
                " sequences [0, ", bc, ")");
  }
  if (distinct) {
    std::vector<int64_t> first(bc, -1);
    for (int64_t i = 0; i < b; ++i) {
      TORCH_CHECK(first[sl[i]] < 0, op, ": slots[", first[sl[i]], "] and slots[", i, "] are both ", sl[i],
                  "; the sequences a call writes must be distinct");
      first[sl[i]] = i;
    }
  }
  return host;
}

at::Tensor cache_lengths_on_host(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& lengths) {
  const int64_t b = q.size(0), t = q.size(2), s = k_cache.size(2);
  at::Tensor host = lengths.cpu().contiguous();
  const int64_t* len = host.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(len[i] >= t && len[i] <= s, kAttn, ": lengths[", i, "] is ", len[i], "; it must be at least the ", t,
                " new queries and at most the cache's ", s, " positions");
  }
  return host;
}

Pair cache_attention_generic(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& lengths, std::optional<double> scale, const Slots& slots) {
  check_cache_attention(q, k_cache, v_cache, lengths, slots);
  auto [out, lse] = attention_outputs(q);
  const int64_t b = q.size(0);
  const at::Tensor host = cache_lengths_on_host(q, k_cache, lengths);
  const int64_t* len = host.const_data_ptr<int64_t>();
  const at::Tensor host_slots = slots_on_host(kAttn, slots, k_cache.size(0), /*distinct=*/false);
  auto slot = [&](int64_t i) { return slots ? host_slots.const_data_ptr<int64_t>()[i] : i; };
  // attention of the input dtype, as the op's (autocast would run a float32 call in half precision)
  autocast::Below below;
  if (b > 1 && std::all_of(len, len + b, [&](int64_t n) { return n == len[0]; })) {
    // one length (a prefill of equal prompts): one call over the batch, not one a sequence (the
    // slots' filled positions gathered where they are not 0 to b - 1)
    auto rows = [&](const at::Tensor& c) {
      const at::Tensor filled = c.narrow(2, 0, len[0]);
      return slots ? filled.index_select(0, slot_index(slots, b, c)) : filled.narrow(0, 0, b);
    };
    auto [o, l] = customops::attention(q, rows(k_cache), rows(v_cache), /*causal=*/true, scale);
    out.copy_(o);
    lse.copy_(l);
    return {out, lse};
  }
  for (int64_t i = 0; i < b; ++i) {
    auto [o, l] = customops::attention(q.narrow(0, i, 1), k_cache.narrow(0, slot(i), 1).narrow(2, 0, len[i]),
                                       v_cache.narrow(0, slot(i), 1).narrow(2, 0, len[i]), /*causal=*/true, scale);
    out.narrow(0, i, 1).copy_(o);
    lse.narrow(0, i, 1).copy_(l);
  }
  return {out, lse};
}

void check_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& start, const Slots& slots) {
  check_write(kWrite, k_cache, v_cache, k, v, start, slots);
}

void cache_write_generic(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& start, const Slots& slots) {
  check_cache_write(k_cache, v_cache, k, v, start, slots);
  const int64_t b = k.size(0), t = k.size(2);
  const at::Tensor host = start_on_host(kWrite, start, t, k_cache.size(2));
  const int64_t* pos = host.const_data_ptr<int64_t>();
  const at::Tensor host_slots = slots_on_host(kWrite, slots, k_cache.size(0), /*distinct=*/true);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t c = slots ? host_slots.const_data_ptr<int64_t>()[i] : i;
    k_cache[c].narrow(1, pos[i], t).copy_(k[i]);
    v_cache[c].narrow(1, pos[i], t).copy_(v[i]);
  }
}

void check_rope_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& start, const Slots& slots) {
  check_rope(kRopeWrite, q, k, cos, sin);
  check_write(kRopeWrite, k_cache, v_cache, k, v, start, slots);
}

at::Tensor rope_cache_write_composite(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& start, const Slots& slots) {
  check_rope_cache_write(k_cache, v_cache, q, k, v, cos, sin, start, slots);
  if (!k.is_cuda()) {  // errors name this op
    start_on_host(kRopeWrite, start, k.size(2), k_cache.size(2));
    slots_on_host(kRopeWrite, slots, k_cache.size(0), /*distinct=*/true);
  }
  auto [q_out, k_out] = customops::rope(q, k, cos, sin, /*interleaved=*/false);
  customops::cache_write(k_cache, v_cache, k_out, v, start, slots);
  return q_out;
}

std::tuple<at::Tensor, at::Tensor> cache_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache, const at::Tensor& lengths,
                                                   std::optional<double> scale, const Slots& slots) {
  return cache_attention_op().call(q, k_cache, v_cache, lengths, scale, slots);
}

void cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& start, const Slots& slots) {
  cache_write_op().call(k_cache, v_cache, k, v, start, slots);
}

at::Tensor rope_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& start, const Slots& slots) {
  return rope_cache_write_op().call(k_cache, v_cache, q, k, v, cos, sin, start, slots);
}

// Meta, CPU cache_write (the generic kernel; cache_attention's CPU kernel is in
// cpp/cpu/cache_attention.cpp, the CUDA ones in cuda/cache_attention.cu), Autograd and vmap
// registrations.
TORCH_LIBRARY_IMPL(customops, Meta, m) {
  m.impl("cache_attention", &cache_attention_meta);
  m.impl("cache_write", &cache_write_meta);
  m.impl("rope_cache_write", &rope_cache_write_meta);
}
TORCH_LIBRARY_IMPL(customops, CPU, m) {  // cache_attention's CPU kernel: cpp/cpu/cache_attention.cpp
  m.impl("cache_write", &cache_write_generic);
  m.impl("rope_cache_write", &rope_cache_write_composite);
}
#ifndef CUSTOMOPS_WITH_CUDA
// A build without the CUDA kernels still runs CUDA tensors (a CUDA torch, no CUDA compiler).
TORCH_LIBRARY_IMPL(customops, CUDA, m) {
  m.impl("cache_attention", &cache_attention_generic);
  m.impl("cache_write", &cache_write_generic);
  m.impl("rope_cache_write", &rope_cache_write_composite);
}
#endif
TORCH_LIBRARY_IMPL(customops, Autograd, m) {
  m.impl("cache_attention", &cache_attention_autograd);
  m.impl("cache_write", &cache_write_autograd);
  m.impl("rope_cache_write", &rope_cache_write_autograd);
}
CUSTOMOPS_AUTOCAST_IMPL(m) { m.impl("rope_cache_write", &rope_cache_write_autocast); }
TORCH_LIBRARY_IMPL(customops, FuncTorchBatched, m) {
  m.impl("cache_attention", &cache_attention_batched);
  m.impl("cache_write", &cache_write_batched);
  m.impl("rope_cache_write", &rope_cache_write_batched);
}

}  // namespace customops
