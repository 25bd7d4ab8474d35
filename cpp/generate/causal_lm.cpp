// customops::CausalLM (customops/generate.h): a causal-LM package loaded and checked, sampling on
// the package's device, and generate, a client of customops::Engine (engine.cpp, which runs the
// package: prefill, the decode steps and their CUDA graphs).
#include "customops/generate.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "customops/engine.h"
#include "customops/package.h"
#include "generate/causal_lm_impl.h"
#include "generate/greedy.h"
#include "ops/cache_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace customops {

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

// top-p on the CPU without sorting the vocabulary: which of each row's scaled logits l [B, vocab]
// (largest 0, -inf where top-k dropped them) to drop. The kept ids are those at or above tau, the
// smallest value whose larger values' mass (sum of exp) is at most top_p of the row's: in
// descending order, every id whose predecessors' probability does not yet pass top_p, as sort's
// way keeps them (equal values at tau are all kept). Found by a quickselect on (value, exp) pairs
// that descends into the side holding tau, in about 2 vocab steps; the sums are in double. At
// batch 8 with a vocabulary of 128,256 on a 2-core CPU a top-p step took 31 ms with it against 64
// with the sort (torch 2.13). CUDA keeps the sort (one batched op there).
at::Tensor top_p_drop_cpu(const at::Tensor& l, double top_p) {
  const at::Tensor x = l.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor drop = at::empty(x.sizes(), x.options().dtype(at::kBool));
  const float* xs = x.const_data_ptr<float>();
  bool* ds = drop.mutable_data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    struct Entry {
      float value, mass;
    };
    std::vector<Entry> a(static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * n;
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        a[i] = {row[i], std::exp(row[i])};
        total += a[i].mass;
      }
      const double limit = top_p * total;
      double above = 0;  // the mass of the values above [lo, hi): at most limit
      auto lo = a.begin(), hi = a.end();
      float tau = 0;
      while (true) {
        const float p0 = lo->value, p1 = lo[(hi - lo) / 2].value, p2 = (hi - 1)->value;
        const float pivot = std::max(std::min(p0, p1), std::min(std::max(p0, p1), p2));  // (their median)
        const auto gt = std::partition(lo, hi, [&](const Entry& e) { return e.value > pivot; });
        const auto eq = std::partition(gt, hi, [&](const Entry& e) { return e.value == pivot; });
        double greater = 0, equal = 0;
        for (auto it = lo; it != gt; ++it) greater += it->mass;
        for (auto it = gt; it != eq; ++it) equal += it->mass;
        if (above + greater > limit) {  // pivot's larger values pass top_p: tau is one of them
          hi = gt;
          continue;
        }
        if (above + greater + equal > limit || eq == hi) {  // below pivot every value would pass
          tau = pivot;
          break;
        }
        above += greater + equal;
        lo = eq;
      }
      bool* out = ds + r * n;
      for (int64_t i = 0; i < n; ++i) out[i] = row[i] < tau;
    }
  });
  return drop;
}

}  // namespace

// The next id of each row of logits [B, vocab], on their device: (ids, the same ids with -1 where a
// row's largest logit is not finite). That is NaN anywhere in the row (max propagates it), +inf, or
// -inf everywhere: damaged weights, or a model that overflows its dtype; argmax would give an id
// for it as if it were a token, and the host turns the -1 into an error. (A -inf among finite
// logits is an id of probability 0, which neither greedy nor sampling picks.) The ids alone are
// always in the vocabulary, for a step queued before the host has read them. Sampling shapes every
// row's distribution at once (each row's values the same as alone: the ops work row by row) and
// draws each row's id from its own generator, so a request's draws do not depend on its
// batch-mates.
std::pair<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const Sampling& s,
                                         const std::vector<at::Generator*>& gens) {
  // A temperature whose reciprocal overflows float (below about 3e-39) defines the argmax's
  // distribution; dividing the float32 logits by it would give 0 * inf = NaN.
  const bool sampled = s.temperature > 0 && 1 / s.temperature <= std::numeric_limits<float>::max();
#ifdef CUSTOMOPS_WITH_CUDA
  // one kernel for the lines below; CUSTOMOPS_GREEDY_KERNEL=0 keeps them (an experiment switch, for
  // bench --generate --variant)
  static const bool kernel = switch_on("CUSTOMOPS_GREEDY_KERNEL");
  if (!sampled && kernel && logits.is_cuda()) return greedy_cuda(logits);
#endif
  auto [top, ids] = logits.max(-1, /*keepdim=*/true);
  // |top| < inf is isfinite's answer in two kernels instead of four (NaN compares false): a decode
  // step on a small model spends a few microseconds a kernel here, outside its graph
  const at::Tensor finite = top.abs() < std::numeric_limits<double>::infinity();
  if (sampled) {
    // the row's max subtracted first, so that a small temperature does not overflow a logit to
    // inf; zeros in a row that is not finite (its NaN would spread through the cumulative sum below)
    at::Tensor l = at::where(finite, logits - top, 0) / s.temperature;
    const double inf = std::numeric_limits<double>::infinity();
    if (s.top_k > 0 && s.top_k < l.size(-1)) {
      at::Tensor kth = std::get<0>(l.topk(s.top_k, -1)).narrow(-1, s.top_k - 1, 1);
      l = l.masked_fill(l < kth, -inf);
    }
    if (s.top_p < 1 && l.is_cpu()) {
      l = l.masked_fill(top_p_drop_cpu(l, s.top_p), -inf);
    } else if (s.top_p < 1) {
      auto [sorted, order] = l.sort(-1, /*descending=*/true);
      at::Tensor probs = sorted.softmax(-1);
      // drop an id when the ids before it already reach top_p (the first id always stays)
      at::Tensor drop = (probs.cumsum(-1) - probs) > s.top_p;
      l = at::full_like(l, -inf).scatter(-1, order, sorted.masked_fill(drop, -inf));
    }
    TORCH_CHECK(static_cast<int64_t>(gens.size()) == l.size(0), "sample: a generator a row, ", gens.size(), " for ",
                l.size(0), " rows");
    // Inverse transform sampling: one uniform u a row from the row's own generator, and the first
    // id whose cumulative mass passes u times the row's (the masses exp(l), float, summed in
    // double; an id of mass 0 never passes). at::multinomial's way (the argmax of p / q, q ~ Exp(1)
    // over the whole vocabulary) drew a random number an id: at batch 8 with a vocabulary of 128,256
    // on a 2-core CPU a sampled step took 24 ms against 4 greedy, most of it that noise.
    const at::Tensor cdf = l.to(at::kFloat).exp().to(at::kDouble).cumsum(-1);
    const int64_t vocab = cdf.size(-1);
    at::Tensor u = at::empty({cdf.size(0), 1}, cdf.options());
    for (int64_t r = 0; r < cdf.size(0); ++r) u.narrow(0, r, 1).uniform_(0, 1, *gens[r]);
    ids = at::searchsorted(cdf, u * cdf.narrow(-1, vocab - 1, 1), /*out_int32=*/false, /*right=*/true)
              .clamp_max(vocab - 1);  // (u * total < total; the clamp is for rounding's sake)
  }
  return {ids.squeeze(-1), at::where(finite, ids, -1).squeeze(-1)};
}

at::Generator make_generator(const c10::Device& device, uint64_t seed) {
  at::Generator gen = device.is_cuda() ? at::detail::getCUDAHooks().getNewGenerator(device.index())
                                       : at::make_generator<at::CPUGeneratorImpl>(seed);
  gen.set_current_seed(seed);
  return gen;
}

bool switch_on(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || std::string(env) != "0";
}

void check_sampling(const Sampling& s) {
  if (s.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  if (!(s.top_p > 0 && s.top_p <= 1)) throw std::invalid_argument("top_p must be in (0, 1]");
  if (!(s.temperature >= 0 && s.temperature < std::numeric_limits<double>::infinity())) {
    throw std::invalid_argument("temperature must be a finite number >= 0");
  }
}

void check_prompt(const std::vector<int64_t>& p, int64_t max_seq_len, int64_t vocab, const std::string& which) {
  if (p.empty()) throw std::invalid_argument(which + " is empty");
  if (static_cast<int64_t>(p.size()) > max_seq_len) {
    throw std::invalid_argument(which + " has " + std::to_string(p.size()) + " ids, more than the package's max_seq_len (" +
                                std::to_string(max_seq_len) + ")");
  }
  for (size_t j = 0; j < p.size(); ++j) {
    if (p[j] < 0 || p[j] >= vocab) {
      throw std::invalid_argument(which + " holds id " + std::to_string(p[j]) + " at position " + std::to_string(j) +
                                  ", outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
}

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
  // "1": T >= 2 declared (a decode step fails torch's input checks), one eos id; "2": no slots
  if (format == "1" || format == "2") {
    throw std::invalid_argument(package_path + " was written by an older customops; write it again with "
                                "customops.export.package_causal_lm");
  }
  if (format != "3") {
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
  const Sampling sampling{o.temperature, o.top_k, o.top_p};
  check_sampling(sampling);
  for (int64_t i = 0; i < b; ++i) check_prompt(prompts[i], m.max_seq_len, m.vocab, "prompt " + std::to_string(i));

  // An engine of its own whose budget takes every prompt whole: the first step prefills them all
  // in one run, each later step decodes them all.
  EngineOptions eo;
  eo.token_budget = std::numeric_limits<int64_t>::max();
  eo.cuda_graph = o.cuda_graph;
  eo.prefill_multiple = 1;  // its one prefill run needs no shared shapes (a bench may still set the environment's)
  Engine engine(*this, eo);
  RequestOptions ro;
  ro.max_new_tokens = o.max_new_tokens;
  ro.temperature = o.temperature;
  ro.top_k = o.top_k;
  ro.top_p = o.top_p;
  ro.seed = o.seed;
  ro.stop_at_eos = o.stop_at_eos;
  std::vector<std::shared_ptr<Request>> requests;
  GenerateResult r;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // each prompt its own seed (identical prompts of one batch draw apart; prompt 0 takes o.seed)
    ro.seed = o.seed ^ (0x9E3779B97F4A7C15ULL * i);
    requests.push_back(engine.submit(prompts[i], ro));
    r.prefill_tokens += static_cast<int64_t>(prompts[i].size());
  }
  auto t0 = std::chrono::steady_clock::now();
  engine.step();
  r.prefill_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  while (engine.step()) ++r.decode_steps;
  r.decode_ms = ms_since(t0);
  r.cuda_graph = engine.stats().graph_runs > 0;
  r.ids.resize(b);
  for (int64_t i = 0; i < b; ++i) {
    Request::Update u = requests[i]->next();
    r.ids[i] = std::move(u.ids);
    if (u.reason == FinishReason::error) {
      // "the package's logits are not finite ..." as the engine words it, for this prompt
      const std::string prefix = "the package's logits ";
      std::string e = u.error;
      if (e.rfind(prefix, 0) == 0) e.insert(prefix.size(), "for prompt " + std::to_string(i) + " ");
      throw std::runtime_error(e);
    }
  }
  return r;
}

}  // namespace customops
