// customops::CausalLM (customops/generate.h): prefill and decode loop over a causal-LM package,
// and sampling on the package's device.
//
// The package's forward (customops.export.package_causal_lm) is (input_ids [B, T], start [B],
// count [B]) -> float32 logits [B, vocab] of each sequence's last new token, its KV cache updated
// in place. A call prefills with start 0 and count the prompts' lengths (right-padded to the
// longest), then decodes with T = 1, start each sequence's length and count 1. On CUDA the decode
// step of each batch size is captured in a CUDA graph at its first run (DecodeGraph), its inputs
// refilled in place and the graph replayed at every later step.
#include "customops/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "ops/cache_attention.h"
#ifdef CUSTOMOPS_WITH_CUDA
#include "generate/decode_graph.h"
#endif

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace customops {

struct CausalLM::Impl {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  c10::Device device = c10::kCPU;
  int64_t max_batch = 0, max_seq_len = 0, vocab = 0, pad = 0;
  std::optional<int64_t> eos, bos;
  bool graphs = false;  // CUDA, and the package's attention runs without host syncs
#ifdef CUSTOMOPS_WITH_CUDA
  // A decode step of one batch size: its inputs, which each step refills, and its graph.
  struct Step {
    at::Tensor ids, start, count;
    std::unique_ptr<DecodeGraph> graph;
  };
  std::map<int64_t, Step> steps;
#endif

  void synchronize() const {
    if (!device.is_cpu()) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
  }
};

namespace {

int64_t metadata_int(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                     const std::string& path) {
  auto it = meta.find(key);
  if (it == meta.end() || it->second.empty()) {
    throw std::invalid_argument(path + ": the causal-LM package's metadata has no " + key);
  }
  return std::stoll(it->second);
}

std::optional<int64_t> metadata_optional(const std::unordered_map<std::string, std::string>& meta,
                                         const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end() || it->second.empty()) return std::nullopt;
  return std::stoll(it->second);
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The next id of each row of logits [B, vocab], on their device.
at::Tensor sample(const at::Tensor& logits, const GenerateOptions& o, at::Generator& gen) {
  if (o.temperature <= 0) return logits.argmax(-1);
  at::Tensor l = logits / o.temperature;
  const double inf = std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < l.size(-1)) {
    at::Tensor kth = std::get<0>(l.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    l = l.masked_fill(l < kth, -inf);
  }
  if (o.top_p < 1) {
    auto [sorted, order] = l.sort(-1, /*descending=*/true);
    at::Tensor probs = sorted.softmax(-1);
    // drop an id when the ids before it already reach top_p (the first id always stays)
    at::Tensor drop = (probs.cumsum(-1) - probs) > o.top_p;
    l = at::full_like(l, -inf).scatter(-1, order, sorted.masked_fill(drop, -inf));
  }
  return at::multinomial(l.softmax(-1), 1, /*replacement=*/false, gen).squeeze(-1);
}

at::Generator make_generator(const c10::Device& device, uint64_t seed) {
  at::Generator gen = device.is_cuda() ? at::detail::getCUDAHooks().getNewGenerator(device.index())
                                       : at::make_generator<at::CPUGeneratorImpl>(seed);
  gen.set_current_seed(seed);
  return gen;
}

}  // namespace

CausalLM::CausalLM(const std::string& package_path, std::optional<c10::Device> device) : impl_(new Impl) {
  auto& m = *impl_;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(package_path, ec)) {
    throw std::invalid_argument("package not found: " + package_path);
  }
  const c10::DeviceIndex index = device && !device->is_cpu() ? device->index() : c10::DeviceIndex(-1);
  m.loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package_path, "model",
                                                                       /*run_single_threaded=*/true,
                                                                       /*num_runners=*/1, index);
  const auto meta = m.loader->get_metadata();
  auto kind = meta.find("customops_causal_lm");
  if (kind == meta.end() || kind->second != "1") {
    throw std::invalid_argument(package_path +
                                " is not a causal-LM package (write one with customops.export.package_causal_lm)");
  }
  auto key = meta.find("AOTI_DEVICE_KEY");
  const std::string type = key == meta.end() || key->second.empty() ? "cpu" : key->second;
  m.device = type == "cpu" ? c10::Device(c10::kCPU) : c10::Device(type + ":" + std::to_string(std::max<int>(index, 0)));
  m.max_batch = metadata_int(meta, "max_batch", package_path);
  m.max_seq_len = metadata_int(meta, "max_seq_len", package_path);
  m.vocab = metadata_int(meta, "vocab_size", package_path);
  m.eos = metadata_optional(meta, "eos_token_id");
  m.bos = metadata_optional(meta, "bos_token_id");
  m.pad = metadata_optional(meta, "pad_token_id").value_or(m.eos.value_or(0));
  // CUDA graphs where the package's cache_attention runs on the device alone (older packages do
  // not record their head dim: no graphs)
  auto dtype = meta.find("dtype");
  const std::optional<int64_t> head_dim = metadata_optional(meta, "head_dim");
  const std::string name = dtype == meta.end() ? "" : dtype->second;
  const c10::ScalarType scalar = name == "bfloat16" ? c10::kBFloat16 : name == "float16" ? c10::kHalf : c10::kFloat;
  m.graphs = m.device.is_cuda() && head_dim && cache_attention_on_device(scalar, *head_dim, /*queries=*/1);
}

CausalLM::~CausalLM() = default;

int64_t CausalLM::max_batch() const { return impl_->max_batch; }
int64_t CausalLM::max_seq_len() const { return impl_->max_seq_len; }
int64_t CausalLM::vocab_size() const { return impl_->vocab; }
std::optional<int64_t> CausalLM::eos_token_id() const { return impl_->eos; }
std::optional<int64_t> CausalLM::bos_token_id() const { return impl_->bos; }
c10::Device CausalLM::device() const { return impl_->device; }

GenerateResult CausalLM::generate(const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& o) {
  auto& m = *impl_;
  const int64_t b = static_cast<int64_t>(prompts.size());
  if (b < 1 || b > m.max_batch) {
    throw std::invalid_argument(std::to_string(b) + " prompts, but the package takes 1 to " +
                                std::to_string(m.max_batch) + " (its max_batch)");
  }
  if (o.max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be at least 1");
  if (o.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("top_p must be in (0, 1]");
  if (!(o.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    const auto& p = prompts[i];
    const std::string which = "prompt " + std::to_string(i);
    if (p.empty()) throw std::invalid_argument(which + " is empty");
    if (static_cast<int64_t>(p.size()) > m.max_seq_len) {
      throw std::invalid_argument(which + " has " + std::to_string(p.size()) + " ids, more than the package's max_seq_len (" +
                                  std::to_string(m.max_seq_len) + ")");
    }
    for (size_t j = 0; j < p.size(); ++j) {
      if (p[j] < 0 || p[j] >= m.vocab) {
        throw std::invalid_argument(which + " holds id " + std::to_string(p[j]) + " at position " + std::to_string(j) +
                                    ", outside the vocabulary [0, " + std::to_string(m.vocab) + ")");
      }
    }
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }

  const auto ids_options = at::TensorOptions().dtype(at::kLong);
  at::Tensor input = at::full({b, longest}, m.pad, ids_options);
  std::vector<int64_t> lengths(b);
  GenerateResult r;
  r.ids.resize(b);
  for (int64_t i = 0; i < b; ++i) {
    lengths[i] = static_cast<int64_t>(prompts[i].size());
    input[i].narrow(0, 0, lengths[i]).copy_(at::tensor(prompts[i], ids_options));
    r.prefill_tokens += lengths[i];
  }
  at::Generator gen = make_generator(m.device, o.seed);
  auto run = [&](const at::Tensor& ids, const std::vector<int64_t>& start, const at::Tensor& count) {
    std::vector<at::Tensor> inputs = {ids.to(m.device), at::tensor(start, ids_options).to(m.device), count.to(m.device)};
    return sample(m.loader->run(inputs).at(0), o, gen).cpu();  // .cpu() waits for the device
  };

  auto t0 = std::chrono::steady_clock::now();
  at::Tensor next = run(input, std::vector<int64_t>(b, 0), at::tensor(lengths, ids_options));
  r.prefill_ms = ms_since(t0);

  std::vector<bool> done(b, false);
  // Whether a sequence ends by the counts alone, with `ids` new ids and its cache filled to `filled`.
  auto ends_by_count = [&](size_t ids, int64_t filled) {
    return static_cast<int64_t>(ids) >= o.max_new_tokens || filled >= m.max_seq_len;
  };
  // Takes the ids sampled from a step whose inputs filled each sequence's cache up to filled[i];
  // true once every sequence is done.
  auto take = [&](const at::Tensor& next_ids, const std::vector<int64_t>& filled) {
    auto acc = next_ids.accessor<int64_t, 1>();
    bool all_done = true;
    for (int64_t i = 0; i < b; ++i) {
      if (!done[i]) {
        r.ids[i].push_back(acc[i]);
        if ((o.stop_at_eos && m.eos && acc[i] == *m.eos) || ends_by_count(r.ids[i].size(), filled[i])) done[i] = true;
      }
      all_done = all_done && done[i];
    }
    return all_done;
  };
  // The next step's start: a new id goes in at its sequence's length (which grows by one); a
  // finished sequence is fed its last id again at its last position (its cache row is its own, and
  // its ids are no longer read).
  auto advance = [&](std::vector<int64_t>& len, const std::vector<bool>& finished) {
    std::vector<int64_t> start(b);
    for (int64_t i = 0; i < b; ++i) start[i] = finished[i] ? std::min(len[i], m.max_seq_len - 1) : len[i]++;
    return start;
  };
  t0 = std::chrono::steady_clock::now();
  if (take(next, lengths)) {
    r.decode_ms = ms_since(t0);
    return r;
  }
#ifdef CUSTOMOPS_WITH_CUDA
  if (m.graphs && o.cuda_graph) {
    // Decode steps replayed from the batch size's CUDA graph (captured at its first step), one step
    // ahead of the host: step k + 1 is enqueued, its ids copied on the device from step k's sample,
    // before the host waits for step k's ids, so the GPU does not idle while the host reads them,
    // decides and launches. Step k + 1's start assumes step k ends no sequence but by the counts
    // (max_new_tokens, max_seq_len), which the host knows ahead; a sequence that ends with eos at
    // step k is fed one more id at step k + 1, whose id is not taken (its cache row is its own). A
    // step enqueued after the last one is finished (done) before generate returns.
    r.cuda_graph = true;
    auto& step = m.steps[b];
    if (!step.ids.defined()) {
      const auto on_device = ids_options.device(m.device);
      step.ids = at::empty({b, 1}, on_device);
      step.start = at::empty({b}, on_device);
      step.count = at::ones({b}, on_device);
    }
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(m.device.type())->getStream(m.device);
    struct Launched {
      at::Tensor ids, host;                        // the sampled ids on the device, their pinned host copy
      c10::Event copied{c10::DeviceType::CUDA};  // recorded after the host copy
      std::vector<int64_t> filled;                 // each sequence's filled length once its inputs are in
    };
    auto launch = [&](const at::Tensor& ids, const std::vector<int64_t>& start, std::vector<int64_t> filled) {
      auto l = std::make_unique<Launched>();
      step.ids.copy_(ids.view({b, 1}), /*non_blocking=*/true);
      step.start.copy_(at::tensor(start, ids_options).pin_memory(), /*non_blocking=*/true);
      if (!step.graph) {
        step.graph = std::make_unique<DecodeGraph>(m.device,
                                                   [&] { return m.loader->run({step.ids, step.start, step.count}); });
        l->ids = sample(step.graph->first().at(0), o, gen);
      } else {
        l->ids = sample(step.graph->replay().at(0), o, gen);
      }
      l->host = at::empty({b}, ids_options.pinned_memory(true));
      l->host.copy_(l->ids, /*non_blocking=*/true);
      l->copied.record(stream);
      l->filled = std::move(filled);
      return l;
    };
    std::vector<int64_t> start = advance(lengths, done);
    std::unique_ptr<Launched> cur = launch(next, start, lengths), ahead;
    for (;;) {
      std::vector<bool> ends = done;  // what cur's ids end by the counts alone
      bool more = false;
      for (int64_t i = 0; i < b; ++i) {
        if (!done[i] && ends_by_count(r.ids[i].size() + 1, cur->filled[i])) ends[i] = true;
        more = more || !ends[i];
      }
      if (more) {
        start = advance(lengths, ends);
        ahead = launch(cur->ids, start, lengths);
      }
      cur->copied.synchronize();
      ++r.decode_steps;
      if (take(cur->host, cur->filled)) break;  // (more was true: take ends no more than ends but by eos)
      cur = std::move(ahead);
    }
    r.decode_ms = ms_since(t0);
    if (ahead) ahead->copied.synchronize();  // a step past the end: finished, not timed
    return r;
  }
#endif
  const at::Tensor ones = at::ones({b}, ids_options);
  do {
    const std::vector<int64_t> start = advance(lengths, done);
    next = run(next.view({b, 1}), start, ones);
    ++r.decode_steps;
  } while (!take(next, lengths));
  r.decode_ms = ms_since(t0);
  return r;
}

}  // namespace customops
