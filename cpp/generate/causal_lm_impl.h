// Internal to the generation library: what CausalLM (causal_lm.cpp) and Engine (engine.cpp)
// share, the loaded package and the sampler.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "customops/generate.h"
#ifdef CUSTOMOPS_WITH_CUDA
#include "generate/decode_graph.h"
#endif

namespace customops {

struct CausalLM::Impl {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  c10::Device device = c10::kCPU;
  int64_t max_batch = 0, max_seq_len = 0, vocab = 0, pad = 0;
  std::vector<int64_t> eos;
  std::optional<int64_t> bos;
  bool graphs = false;  // CUDA, and the package's attention runs without host syncs
#ifdef CUSTOMOPS_WITH_CUDA
  // A decode step of one batch size: its inputs, which each step refills, and its graph. Kept
  // here, so that every engine of this CausalLM replays the graphs the first one captured.
  struct Step {
    at::Tensor ids, positions, count;  // positions: [2, B], start and slots
    std::unique_ptr<DecodeGraph> graph;
  };
  std::map<int64_t, Step> steps;
#endif
};

// How a row's next id is drawn from its logits.
struct Sampling {
  double temperature = 0;  // 0: greedy
  int64_t top_k = 0;
  double top_p = 1;
};

// Throws std::invalid_argument for sampling options out of their ranges, or a prompt that is
// empty, longer than max_seq_len or holds an id outside the vocabulary (`which` names it).
// Whether the experiment switch `name` is on: on unless the environment sets it to "0" (for bench
// --generate and bench --serve's --variant NAME=0).
bool switch_on(const char* name);

void check_sampling(const Sampling& s);
void check_prompt(const std::vector<int64_t>& prompt, int64_t max_seq_len, int64_t vocab, const std::string& which);

// The next id of each row of logits [B, vocab], on their device: (ids, the same ids with -1 where a
// row's logits are not finite); see causal_lm.cpp. gens: where s samples (temperature > 0), each
// row's generator (B of them).
std::pair<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const Sampling& s,
                                         const std::vector<at::Generator*>& gens = {});
at::Generator make_generator(const c10::Device& device, uint64_t seed);

}  // namespace customops
