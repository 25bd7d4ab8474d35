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
#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "customops/package.h"
#include "ops/cache_attention.h"
#ifdef CUSTOMOPS_WITH_CUDA
#include "generate/decode_graph.h"
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
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
  std::vector<int64_t> eos;
  std::optional<int64_t> bos;
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

// text as an integer, or nullopt where it is not one.
std::optional<int64_t> parse_int(const std::string& text) {
  size_t used = 0;
  try {
    int64_t v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The integers of a metadata field: a comma-separated list (an eos field; packages written before
// lists hold one id), or one integer; none where the field is absent or empty.
std::vector<int64_t> metadata_ints(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                                   const std::string& path) {
  std::vector<int64_t> out;
  auto it = meta.find(key);
  if (it == meta.end() || it->second.empty()) return out;
  const std::string& list = it->second;
  for (size_t at = 0; at <= list.size();) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::optional<int64_t> v = parse_int(list.substr(at, end - at));
    if (!v) {
      throw std::invalid_argument(path + ": the causal-LM package's metadata field " + key +
                                  " is not an integer or a list of them (the package was not written by "
                                  "package_causal_lm, or was changed)");
    }
    out.push_back(*v);
    at = end + 1;
  }
  return out;
}

std::optional<int64_t> metadata_int(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                                    const std::string& path) {
  const std::vector<int64_t> v = metadata_ints(meta, key, path);
  if (v.size() > 1) throw std::invalid_argument(path + ": the causal-LM package's metadata field " + key + " is a list");
  return v.empty() ? std::nullopt : std::optional<int64_t>(v[0]);
}

// A size the package cannot do without: there, and at least `min`.
int64_t metadata_size(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                      const std::string& path, int64_t min) {
  const std::optional<int64_t> v = metadata_int(meta, key, path);
  if (!v) throw std::invalid_argument(path + ": the causal-LM package's metadata has no " + key);
  if (*v < min) {
    throw std::invalid_argument(path + ": the causal-LM package's metadata gives " + key + " " + std::to_string(*v) +
                                ", less than " + std::to_string(min));
  }
  return *v;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The next id of each row of logits [B, vocab], on their device: (ids, the same ids with -1 where a
// row's largest logit is not finite). That is NaN anywhere in the row (max propagates it), +inf, or
// -inf everywhere: damaged weights, or a model that overflows its dtype; argmax would give an id
// for it as if it were a token, and the host turns the -1 into an error. (A -inf among finite
// logits is an id of probability 0, which neither greedy nor sampling picks.) The ids alone are
// always in the vocabulary, for a step queued before the host has read them.
std::pair<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const GenerateOptions& o, at::Generator& gen) {
  auto [top, ids] = logits.max(-1, /*keepdim=*/true);
  const at::Tensor finite = top.isfinite();
  // A temperature whose reciprocal overflows float (below about 3e-39) defines the argmax's
  // distribution; dividing the float32 logits by it would give 0 * inf = NaN.
  if (o.temperature > 0 && 1 / o.temperature <= std::numeric_limits<float>::max()) {
    // the row's max subtracted first, so that a small temperature does not overflow a logit to
    // inf; zeros in a row that is not finite (multinomial on CUDA asserts on the device for NaN)
    at::Tensor l = at::where(finite, logits - top, 0) / o.temperature;
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
    ids = at::multinomial(l.softmax(-1), 1, /*replacement=*/false, gen);
  }
  return {ids.squeeze(-1), at::where(finite, ids, -1).squeeze(-1)};
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
  verify_package(package_path);  // torch's loader would run a damaged package
  std::unordered_map<std::string, std::string> meta;
  try {
    meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(package_path, "model");
  } catch (const std::exception&) {
    meta.clear();
  }
  const std::string& format = meta["customops_causal_lm"];
  if (format == "1") {  // T >= 2 declared (a decode step fails torch's input checks), one eos id
    throw std::invalid_argument(package_path + " was written by an older customops; write it again with "
                                "customops.export.package_causal_lm");
  }
  if (format != "2") {
    throw std::invalid_argument(package_path +
                                " is not a causal-LM package (write one with customops.export.package_causal_lm)");
  }
  // The package's device type; the index asked for (or 0). Checked here, before loading, so that a
  // wrong device is an invalid_argument whatever torch's loader would make of it.
  const std::string type = meta["AOTI_DEVICE_KEY"].empty() ? "cpu" : meta["AOTI_DEVICE_KEY"];
  const c10::DeviceType package_type = type == "cuda" ? c10::kCUDA : c10::kCPU;
  if (type != "cpu" && type != "cuda") {
    throw std::invalid_argument(package_path + " was compiled for " + type + "; CausalLM runs cpu and cuda packages");
  }
  if (device && device->type() != package_type) {
    throw std::invalid_argument(package_path + " was compiled for " + type + " and cannot run on " + device->str());
  }
  if (device && device->is_cpu() && device->has_index() && device->index() != 0) {
    throw std::invalid_argument("device " + device->str() + ": there is one cpu device; use cpu");
  }
  const c10::DeviceIndex index = package_type == c10::kCUDA && device && device->has_index() ? device->index() : 0;
  if (package_type == c10::kCUDA) {
    const int gpus = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
    if (index >= gpus) {
      throw std::invalid_argument(package_path + " runs on cuda:" + std::to_string(index) + ", but this process has " +
                                  std::to_string(gpus) + " CUDA device(s)");
    }
  }
  m.device = package_type == c10::kCUDA ? c10::Device(c10::kCUDA, index) : c10::Device(c10::kCPU);
  m.max_batch = metadata_size(meta, "max_batch", package_path, 1);
  m.max_seq_len = metadata_size(meta, "max_seq_len", package_path, 1);
  m.vocab = metadata_size(meta, "vocab_size", package_path, 1);
  m.eos = metadata_ints(meta, "eos_token_id", package_path);
  m.bos = metadata_int(meta, "bos_token_id", package_path);
  // Padding is written to the cache past a short prompt and never read (nor does it reach a
  // logit), but the embedding looks it up: any id of the vocabulary does, the model's pad id where
  // it is one (a config may give -1, or an id past the vocabulary).
  auto in_vocab = [&](std::optional<int64_t> id) { return id && *id >= 0 && *id < m.vocab; };
  const std::optional<int64_t> pad = metadata_int(meta, "pad_token_id", package_path);
  m.pad = in_vocab(pad) ? *pad : !m.eos.empty() && in_vocab(m.eos[0]) ? m.eos[0] : 0;
  // CUDA graphs where the package's cache_attention runs on the device alone (older packages do
  // not record their head dim: no graphs)
  const std::optional<int64_t> head_dim = metadata_int(meta, "head_dim", package_path);
  const std::string& name = meta["dtype"];
  const c10::ScalarType scalar = name == "bfloat16" ? c10::kBFloat16 : name == "float16" ? c10::kHalf : c10::kFloat;
  m.graphs = m.device.is_cuda() && head_dim && cache_attention_on_device(scalar, *head_dim, /*queries=*/1);
  // The package checks the dtypes, shapes and strides of its inputs at every run (torch's switch,
  // read when a package first runs; as customops-run's default, unless the process set it).
  setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);
  m.loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      package_path, "model", /*run_single_threaded=*/true, /*num_runners=*/1,
      m.device.is_cpu() ? c10::DeviceIndex(-1) : m.device.index());
}

CausalLM::~CausalLM() = default;

int64_t CausalLM::max_batch() const { return impl_->max_batch; }
int64_t CausalLM::max_seq_len() const { return impl_->max_seq_len; }
int64_t CausalLM::vocab_size() const { return impl_->vocab; }
std::vector<int64_t> CausalLM::eos_token_ids() const { return impl_->eos; }
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
  if (!(o.temperature >= 0 && o.temperature < std::numeric_limits<double>::infinity())) {
    throw std::invalid_argument("temperature must be a finite number >= 0");
  }
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
    return sample(m.loader->run(inputs).at(0), o, gen).second.cpu();  // .cpu() waits for the device
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
  // true once every sequence is done. A row whose logits were not finite (sample's -1) ends the call.
  auto take = [&](const at::Tensor& next_ids, const std::vector<int64_t>& filled) {
    auto acc = next_ids.accessor<int64_t, 1>();
    bool all_done = true;
    for (int64_t i = 0; i < b; ++i) {
      if (!done[i]) {
        if (acc[i] < 0) {
          throw std::runtime_error("the package's logits for prompt " + std::to_string(i) + " are not finite (NaN or "
                                   "inf) at its new id " + std::to_string(r.ids[i].size() + 1) +
                                   ": the package's weights are damaged, or the model overflows its dtype");
        }
        r.ids[i].push_back(acc[i]);
        const bool eos = o.stop_at_eos && std::find(m.eos.begin(), m.eos.end(), acc[i]) != m.eos.end();
        if (eos || ends_by_count(r.ids[i].size(), filled[i])) done[i] = true;
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
      const bool first = !step.graph;
      if (first) {
        step.graph = std::make_unique<DecodeGraph>(m.device,
                                                   [&] { return m.loader->run({step.ids, step.start, step.count}); });
      }
      // the ids the next step reads (in the vocabulary), and for the host the same ids marked
      // where the logits were not finite
      auto [next_ids, marked] = sample((first ? step.graph->first() : step.graph->replay()).at(0), o, gen);
      l->ids = next_ids;
      l->host = at::empty({b}, ids_options.pinned_memory(true));
      l->host.copy_(marked, /*non_blocking=*/true);
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
      bool all_done = false;
      try {
        all_done = take(cur->host, cur->filled);  // (more was true: take ends no more than ends but by eos)
      } catch (...) {
        if (ahead) ahead->copied.synchronize();  // its buffers are freed as the error unwinds
        throw;
      }
      if (all_done) break;
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
