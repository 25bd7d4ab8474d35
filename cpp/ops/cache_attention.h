// Internal: cache_attention and cache_write (the ops of a static KV cache) shared by their Meta,
// CPU and CUDA kernels: argument checks, the device-generic kernels that the CUDA ones fall back
// on, and which inputs the CUDA kernels take without reading lengths or positions on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace customops {

// slots (every op's last argument): where given, int64 [B] on the cache's device, row b's sequence
// of the cache (else b). The host-side kernels check each against the cache's sequences (and, for
// the writes, that they are distinct); the CUDA kernels read them on the device, where a slot out
// of range gives NaN rows (attention) or writes nothing (the writes).
using Slots = std::optional<at::Tensor>;

void check_cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& lengths, const Slots& slots);

// slots read on the host (a device sync on CUDA) and checked: each names one of the cache's Bc
// sequences and, where `distinct` (a write), no two the same. Undefined where slots is not given.
at::Tensor slots_on_host(const char* op, const Slots& slots, int64_t bc, bool distinct);

// lengths read on the host (a device sync on CUDA) and checked: each at least q's new queries and
// at most the cache's positions (the error names the op and the sequence).
at::Tensor cache_lengths_on_host(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& lengths);

// Reads lengths on the host (a device sync on CUDA), checks them, then attends each sequence's
// filled prefix through customops::attention: the kernel of every device and dtype.
std::tuple<at::Tensor, at::Tensor> cache_attention_generic(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& lengths,
                                                           std::optional<double> scale, const Slots& slots);

// The new queries a sequence of decoding and speculative drafts: the CUDA split-KV kernel takes
// them inside a CUDA graph (cache_attention_on_device).
constexpr int64_t kCacheAttentionMaxQueries = 16;

// Outside a graph the split-KV kernel also takes prefill chunks of up to this many queries a
// sequence; longer ones go through cache_attention_generic (customops::attention, a sequence at a
// time, the lengths read on the host). On an H200 (16 layers of Llama-3.2-1B's shapes) a prefill
// alone of 128-512 ids was 1.35-2.1x faster in the kernel, of 2048 ids 0.83-0.90x.
// CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES replaces it (cuda/cache_attention.cu).
constexpr int64_t kCacheAttentionChunkQueries = 512;

// While one lives, cache_attention's CUDA split-KV kernel takes up to `queries` new queries a
// sequence in this thread, where that is more than the limit above: customops::Engine's prefill
// chunks run beside decoding rows, whose lengths the generic path would read on the host, one
// sequence at a time, while the decode run launched before them waits. Scopes nest.
class CacheAttentionChunks {
 public:
  explicit CacheAttentionChunks(int64_t queries);
  ~CacheAttentionChunks();
  CacheAttentionChunks(const CacheAttentionChunks&) = delete;
  CacheAttentionChunks& operator=(const CacheAttentionChunks&) = delete;
  // The innermost scope's queries in this thread; 0 outside every scope.
  static int64_t current();

 private:
  int64_t previous_;
};

// Whether cache_attention's CUDA kernel reads lengths on the device for q of this dtype, head dim
// and number of new queries (with a positive finite scale): no host sync, so a CUDA graph can
// capture it. customops::CausalLM asks before it captures a decode step.
inline bool cache_attention_on_device(c10::ScalarType dtype, int64_t head_dim, int64_t queries) {
  return (dtype == c10::kHalf || dtype == c10::kBFloat16) && (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         queries >= 1 && queries <= kCacheAttentionMaxQueries;
}

void check_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& start, const Slots& slots);

// Reads start on the host, checks it, then copies each sequence's new rows: every device.
void cache_write_generic(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& start, const Slots& slots);

void check_rope_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& start, const Slots& slots);

// rope, then cache_write, as the two ops (the CPU kernel; on CUDA, for inputs the fused kernel
// does not take, both ops' CUDA kernels, which read start on the device).
at::Tensor rope_cache_write_composite(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& start, const Slots& slots);

}  // namespace customops
