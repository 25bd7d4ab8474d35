// Text generation from a causal-LM package (customops.export.package_causal_lm), with no Python:
// load the package once, then generate from token ids. customops-run generate is this API.
//
//   customops::CausalLM lm("llama.pt2");               // the package's own device
//   customops::GenerateOptions o;
//   o.max_new_tokens = 64;
//   auto r = lm.generate({{1, 15043, 29892}}, o);      // r.ids[0]: the new ids of prompt 0
//
// Each call prefills every prompt in one run of the package (prompts of different lengths are
// right-padded in one batch), as a client of customops::Engine (customops/engine.h, which serves
// requests that come and go), then decodes one token a run until every sequence has produced one
// of its eos ids or max_new_tokens ids (or filled the package's max_seq_len). Sampling (greedy, or
// temperature with top-k / top-p) runs on the package's device; a seed makes it reproducible.
// The package's KV cache is its own state: every call starts its sequences at position 0, so a
// failed call leaves nothing that the next call reads. One call at a time (a CausalLM is not
// thread-safe: its package runs single-threaded, which CUDA graph capture needs).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "customops/macros.h"

namespace customops {

struct GenerateOptions {
  int64_t max_new_tokens = 32;  // at most this many new ids per prompt (>= 1)
  double temperature = 0;       // 0: greedy (the largest logit); otherwise (finite) sample from softmax(logits / T)
  int64_t top_k = 0;            // sample among the k largest logits only (0: all)
  double top_p = 1;             // sample among the fewest ids whose probability sums to top_p (1: all)
  uint64_t seed = 0;            // the sampler's seed: the same seed, prompts and package give the same ids
  bool stop_at_eos = true;      // a sequence ends at any of the package's eos ids (kept as its last new id)
  // CUDA: replay decode steps from a CUDA graph, captured at the first decode step of each batch
  // size (where the package's attention runs without host syncs: float16/bfloat16, head dim 64,
  // 128 or 256); false: launch every kernel of every step.
  bool cuda_graph = true;
};

struct GenerateResult {
  std::vector<std::vector<int64_t>> ids;  // per prompt, the new ids (not the prompt)
  int64_t prefill_tokens = 0;             // prompt tokens prefilled (the sum of the prompts' lengths)
  double prefill_ms = 0;                  // the prefill run, sampling of the first ids included
  int64_t decode_steps = 0;               // runs of the package after the prefill
  double decode_ms = 0;                   // all of them, sampling included
  bool cuda_graph = false;                // whether decode steps were replayed from a CUDA graph
};

class CUSTOMOPS_API CausalLM {
 public:
  // Loads a package written by customops.export.package_causal_lm onto its device (device:
  // another index of that device type), after customops::verify_package. Throws
  // std::invalid_argument for a missing or damaged file, a package that is not a causal-LM
  // package, or a device it cannot run on; c10::Error where torch's loader fails. The package
  // checks its inputs at every run (AOTI_RUNTIME_CHECK_INPUTS=1, unless the process set it).
  explicit CausalLM(const std::string& package_path, std::optional<c10::Device> device = std::nullopt);
  ~CausalLM();
  CausalLM(const CausalLM&) = delete;
  CausalLM& operator=(const CausalLM&) = delete;

  // Generates from each prompt (ids in [0, vocab_size), 1 to max_seq_len of them; 1 to max_batch
  // prompts). Throws std::invalid_argument naming the first problem with the prompts or options,
  // std::runtime_error where a step's logits for a sequence are not finite (NaN or inf: never an
  // id for them), and c10::Error where the package fails to run.
  GenerateResult generate(const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& options);

  int64_t max_batch() const;
  int64_t max_seq_len() const;
  int64_t vocab_size() const;
  // The ids a sequence ends at: every one the model lists (generation_config's, else its config's,
  // as Hugging Face's generate takes them), none where it has none.
  std::vector<int64_t> eos_token_ids() const;
  std::optional<int64_t> bos_token_id() const;  // what the model expects before a prompt, where it has one
  c10::Device device() const;

 private:
  friend class Engine;  // runs the package (customops/engine.h)
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace customops
