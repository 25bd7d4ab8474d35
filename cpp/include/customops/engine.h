// Continuous batching over a causal-LM package (customops/generate.h): requests come and go at any
// time, each with its own prompt, sampling and stops, and each streams its new ids as they are
// sampled. customops-run serve is this engine behind HTTP; CausalLM::generate is a client of it.
//
//   customops::CausalLM lm("llama.pt2");
//   customops::Engine engine(lm);
//   engine.start();                                        // a thread runs the steps
//   auto request = engine.submit({1, 15043, 29892}, {});   // from any thread
//   for (auto u = request->next(); ; u = request->next()) {
//     for (int64_t id : u.ids) use(id);
//     if (u.finished) break;                               // u.reason: why
//   }
//
// Each request holds a slot, a row of the package's KV cache, from its admission to its end;
// requests beyond max_batch wait in order, and a finished or cancelled request frees its slot for
// the next one at once. A step is at most two runs of the package, each over the slots it names:
// one where every decoding sequence feeds its last id, and one where every newly admitted prompt
// feeds its next chunk. Chunks are as long as a token budget allows (what the decode run leaves,
// shared among the prompts, each padded to the longest chunk: the package takes one length a
// run), so a long prompt does not stall the sequences decoding beside it, and they do not compute
// its length. Decode runs replay a CUDA graph of their batch size, and where no prompt is being
// prefilled the next one starts before the host has read this one's ids, as CausalLM::generate
// always did. A sequence's rows compute nothing from the other rows, so its greedy ids do not
// depend on what else is in flight (exactly so in float32 on the CPU).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "customops/generate.h"
#include "customops/macros.h"

namespace customops {

struct RequestOptions {
  int64_t max_new_tokens = 32;      // at most this many new ids (>= 1)
  double temperature = 0;           // 0: greedy; otherwise (finite) sample from softmax(logits / T)
  int64_t top_k = 0;                // sample among the k largest logits only (0: all)
  double top_p = 1;                 // sample among the fewest ids whose probability sums to top_p (1: all)
  uint64_t seed = 0;                // this request's sampler: the same seed and prompt give the same ids
  bool stop_at_eos = true;          // end at any of the package's eos ids
  std::vector<int64_t> stop_ids;    // end at any of these ids too (kept as the last new id, as eos is)
};

enum class FinishReason {
  none,       // not finished
  stop,       // an eos or stop id (the last new id)
  length,     // max_new_tokens ids, or the package's max_seq_len filled
  cancelled,  // Request::cancel
  error,      // the logits were not finite (NaN or inf), or the package failed to run: Update::error
};
CUSTOMOPS_API const char* to_string(FinishReason reason);

class CUSTOMOPS_API Request {
 public:
  struct Update {
    std::vector<int64_t> ids;  // the new ids since the last update
    bool finished = false;
    FinishReason reason = FinishReason::none;
    std::string error;         // why, where reason is error
  };
  // Blocks until the request has new ids or ends (a finished request returns finished at once),
  // or until timeout passes (then an update with no ids, not finished).
  Update next(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Ends the request at the engine's next step (its slot freed); a finished request ignores it.
  void cancel();
  int64_t prompt_tokens() const;
  // When it was submitted, when it got a slot (its prompt's prefill starts at the next step), when
  // its first id was sampled and when it finished (the steady clock).
  struct Times {
    std::chrono::steady_clock::time_point submitted;
    std::optional<std::chrono::steady_clock::time_point> admitted, first_id, finished;
  };
  Times times() const;

  struct State;  // internal
  explicit Request(std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

// What submit throws once the engine was stopped.
struct CUSTOMOPS_API EngineStopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct EngineOptions {
  int64_t max_batch = 0;  // the slots to use, at most the package's max_batch (0: all of them)
  // The tokens a step computes at most, padding included: its decoding sequences (which always
  // run) and its prompts' rows times their chunk length.
  int64_t token_budget = 2048;
  bool cuda_graph = true;  // CUDA: replay the decode runs (one id a row) from CUDA graphs
  // A prefill run's chunk is padded up to a multiple of this many tokens where the budget and the
  // caches leave room, so that prompts of any length share a few shapes; start() first runs each
  // of those shapes once, so that no request pays a shape's first run (on a GPU, the libraries'
  // first choice of kernels and the allocator's first blocks of a size). 0: the engine's choice,
  // 64 on CUDA and 1 (no padding) on the CPU. The environment's CUSTOMOPS_PREFILL_MULTIPLE, where
  // set, replaces it (an experiment switch for the benches).
  int64_t prefill_multiple = 0;
};

class CUSTOMOPS_API Engine {
 public:
  // Runs lm's package, which it must be alone to run while the engine lives (CausalLM::generate is
  // a client of its own engine); lm must outlive the engine.
  explicit Engine(CausalLM& lm, EngineOptions options = {});
  ~Engine();  // stops the thread start() began; requests still in flight end as cancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request (any thread). Throws std::invalid_argument naming the first problem with the
  // prompt (empty, longer than max_seq_len, an id outside the vocabulary) or the options, and
  // EngineStopped once stop() was called.
  std::shared_ptr<Request> submit(std::vector<int64_t> prompt, const RequestOptions& options);

  // Runs one step if any request is in flight; false where there was none. For a caller that
  // drives the engine itself, from one thread, without start().
  bool step();
  // A thread that runs steps while requests are in flight and sleeps while none are. On a GPU it
  // first runs the padded prefill shapes (prefill_multiple) and one draw of each way of sampling,
  // so that no request pays a kernel's first launch.
  void start();
  void stop();  // ends that thread (after its current step); requests in flight end as cancelled,
                // and submit refuses new ones

  struct Stats {
    int64_t running = 0, waiting = 0;  // requests holding a slot, and waiting for one
    int64_t steps = 0;                 // steps so far (a decode run, a prefill run, or both)
    int64_t runs = 0;                  // runs of the package
    int64_t graph_runs = 0;            // of which replayed from a CUDA graph
    int64_t tokens = 0;                // positions the runs computed (rows x T, padding included)
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace customops
