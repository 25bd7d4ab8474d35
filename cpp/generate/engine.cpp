// customops::Engine (customops/engine.h): continuous batching over a causal-LM package.
//
// The package's forward is (input_ids [B, T], start [B], count [B], slots [B]) -> logits [B,
// vocab] of each row's last new token; row i reads and writes row slots[i] of the KV cache, a
// request's slot. A row writes its T ids at positions start to start + T - 1 of its slot, the ids
// past its count as padding that no query reads (attention is causal and reads each row's filled
// part) and that its next ids overwrite. A step is two runs at most, each over the slots it names:
// the decoding sequences (T = 1) and the prefilling ones (T = their chunk), so that a decoding row
// never computes a chunk's length. A run is planned on the host (launch_planned), launched (run:
// its inputs copied, the package run, its ids sampled on the device and copied to pinned host
// memory) and taken (take: the host waits for its ids, streams them to their requests and ends the
// ones that stop). On CUDA a run of T = 1 replays its batch size's CUDA graph, and where no prompt
// is being prefilled the next decode run is launched before the host waits for this one's ids, fed
// them on the device: the GPU does not idle while the host reads, decides and launches. That next
// run assumes no sequence ends but by its counts, which the host knows ahead; a sequence that ends
// at an eos or stop id, or is cancelled, gets one more id that nobody takes, written to its own
// slot past its end (before its slot can be taken again: admission waits for every launched run).
#include "customops/engine.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#include "generate/causal_lm_impl.h"
#include "ops/cache_attention.h"

namespace customops {

using Clock = std::chrono::steady_clock;

const char* to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::none: return "none";
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::cancelled: return "cancelled";
    case FinishReason::error: return "error";
  }
  return "none";
}

// ---- a request, as its client and the engine share it -------------------------------------------

struct Request::State {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int64_t> ids;  // sampled, not yet returned by next()
  FinishReason reason = FinishReason::none;
  std::string error;
  Times times;
  int64_t prompt_tokens = 0;
  std::atomic<bool> cancelled{false};  // read by the engine at its next step

  void admit() {
    std::lock_guard<std::mutex> lock(mu);
    times.admitted = Clock::now();
  }
  void push(int64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (!times.first_id) times.first_id = Clock::now();
    ids.push_back(id);
    cv.notify_all();
  }
  void finish(FinishReason why, std::string message = {}) {
    std::lock_guard<std::mutex> lock(mu);
    if (reason != FinishReason::none) return;
    reason = why;
    error = std::move(message);
    times.finished = Clock::now();
    cv.notify_all();
  }
};

Request::Request(std::shared_ptr<State> state) : state_(std::move(state)) {}

Request::Update Request::next(std::optional<std::chrono::milliseconds> timeout) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  auto ready = [&] { return !s.ids.empty() || s.reason != FinishReason::none; };
  if (timeout) {
    s.cv.wait_for(lock, *timeout, ready);
  } else {
    s.cv.wait(lock, ready);
  }
  Update u;
  u.ids.swap(s.ids);
  u.finished = s.reason != FinishReason::none;
  u.reason = s.reason;
  u.error = s.error;
  return u;
}

void Request::cancel() { state_->cancelled = true; }

int64_t Request::prompt_tokens() const { return state_->prompt_tokens; }

Request::Times Request::times() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->times;
}

// ---- the engine ---------------------------------------------------------------------------------

namespace {

struct Seq {
  std::shared_ptr<Request::State> state;
  std::vector<int64_t> prompt;
  RequestOptions o;
  std::optional<at::Generator> gen;  // sampling requests, made at admission on the package's device
  int64_t slot = -1;
  int64_t fed = 0;        // prompt ids planned into the cache
  int64_t filled = 0;     // positions planned into the cache (prompt and fed-back ids)
  int64_t taken = 0;      // new ids taken
  int64_t in_flight = 0;  // launched steps whose id for this sequence is not taken yet
  int64_t last = -1;      // the last id taken
  bool done = false;

  bool prefilling() const { return fed < static_cast<int64_t>(prompt.size()); }
  Sampling sampling() const { return {o.temperature, o.top_k, o.top_p}; }
};

// One launched run: what each row samples, and the ids coming back.
struct Launched {
  int64_t rows = 0, t = 0;
  std::vector<std::shared_ptr<Seq>> sampled;  // per row: the sequence whose next id it samples, or none
                                              // (a prompt chunk that is not its last)
  std::vector<int64_t> filled;                // per row: that sequence's filled length with this step's ids in
  at::Tensor ids;                             // the sampled ids on the device (in the vocabulary)
  at::Tensor host;                            // the same, -1 where not finite, on the host once `ready`
  std::optional<c10::Event> ready;            // CUDA: recorded after the copy to host
};

// The multiple a prefill run's chunk length is rounded up to (EngineOptions::prefill_multiple):
// CUSTOMOPS_PREFILL_MULTIPLE=N where set (read when an engine is made), else the options', else
// 64 on CUDA and 1 on the CPU. Prompts of different lengths then share a few shapes. On an H200 a
// server's prefill at one client took 7.9-14.8 ms against 3.6 ms for generate's, which repeats its
// warm-up's shapes; padded to 64 and warmed (warm_up), 32 clients got 1.28x the tokens/s and half
// the time to a first token (docs/benchmarks.md, 2026-11-29). On the CPU a shape's first run costs
// little and the padding's compute a lot.
int64_t prefill_multiple(const EngineOptions& o, const c10::Device& device) {
  const char* env = std::getenv("CUSTOMOPS_PREFILL_MULTIPLE");
  if (env == nullptr || *env == '\0') {
    if (o.prefill_multiple < 0) {
      throw std::invalid_argument("EngineOptions::prefill_multiple must be 0 (the engine's choice) or a count of "
                                  "tokens, not " + std::to_string(o.prefill_multiple));
    }
    return o.prefill_multiple > 0 ? o.prefill_multiple : device.is_cuda() ? 64 : 1;
  }
  char* end = nullptr;
  const long long n = std::strtoll(env, &end, 10);
  if (*end != '\0' || n < 1) {
    throw std::invalid_argument(std::string("CUSTOMOPS_PREFILL_MULTIPLE must be a count of tokens (1 or more), not '") +
                                env + "'");
  }
  return n;
}

}  // namespace

struct Engine::Impl {
  CausalLM::Impl& m;
  EngineOptions options;
  int64_t multiple;  // a prefill chunk's length is padded to a multiple of it (prefill_multiple)
  // A prefill run launched beside a decode run attends through the CUDA split-KV kernel whatever
  // its length (CacheAttentionChunks), lengths on the device, not through the generic path, whose
  // host reads of the lengths make the device wait between layers while the decode run waits behind
  // it: on an H200 that gave 32 clients 1.17-1.25x the tokens/s. A prefill run alone takes the kernel
  // up to kCacheAttentionChunkQueries queries and the generic path past them, where a long prompt is
  // 10-17% faster (docs/benchmarks.md, 2026-11-29).
  // CUSTOMOPS_ENGINE_CHUNK_ATTENTION=0: prefill runs beside decode runs as alone (the benches).
  bool chunk_attention = switch_on("CUSTOMOPS_ENGINE_CHUNK_ATTENTION");

  std::mutex mu;  // guards incoming, stats and the thread's flags
  std::condition_variable cv;
  std::deque<std::shared_ptr<Seq>> incoming;
  bool stopping = false;
  std::thread thread;
  Stats stats;

  // the engine thread's own (or step()'s caller's)
  std::deque<std::shared_ptr<Seq>> waiting;
  std::vector<std::shared_ptr<Seq>> slots;  // [max_batch], none where free
  std::unique_ptr<Launched> ahead;          // a decode run launched, not taken

  Impl(CausalLM::Impl& lm, EngineOptions o)
      : m(lm),
        options(o),
        multiple(prefill_multiple(o, lm.device)),
        slots(o.max_batch > 0 ? std::min(o.max_batch, lm.max_batch) : lm.max_batch) {}

  // With a prefill multiple N (prefill_multiple above 1), one run of every shape a padded prefill
  // run can take: n rows (1 up to the slots) of t ids, t a multiple of N that the budget (t n of
  // it) and the caches leave room for. Then, on a GPU, one draw of each way of sampling (greedy,
  // temperature, top-k with top-p) from the last run's logits: a kernel's first launch loads it.
  // (On an H200, 8 clients' sampled requests waited 91 ms on average for a first id, p99 250 ms,
  // where a prompt's prefill alone takes 3.8 ms; how much of that was first launches is not
  // measured.) The engine's own thread (start(): a server's) runs
  // this before its first step; CausalLM::generate's engine, whose budget is unbounded, does not.
  // The ids are the pad id, on slots 0 to n - 1 from position 0: no sequence holds a slot yet, and
  // what they write to the caches lies past every later sequence's length until that sequence
  // writes it. (A run near a cache's end or the budget's may still take a shape not warmed: t is
  // what is left.)
  void warm_up() {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    auto run_pads = [&](int64_t n, int64_t t) {
      return m.loader
          ->run({at::full({n, t}, m.pad, opts).to(m.device), at::zeros({n}, opts).to(m.device),
                 at::full({n}, t, opts).to(m.device), at::arange(n, opts).to(m.device)})
          .at(0);
    };
    at::Tensor logits;
    for (int64_t n = 1; multiple > 1 && n <= max_slots(); ++n) {
      for (int64_t t = multiple; t * n <= options.token_budget && t <= m.max_seq_len; t += multiple) {
        logits = run_pads(n, t);
      }
    }
    if (m.device.is_cpu()) return;
    if (!logits.defined()) logits = run_pads(1, 1);
    at::Generator gen = make_generator(m.device, 0);
    const std::vector<at::Generator*> gens(logits.size(0), &gen);
    sample(logits, Sampling{});
    sample(logits, Sampling{1, 0, 1}, gens);
    sample(logits, Sampling{1, 40, 0.9}, gens);
    // (done before the first request's runs queue behind them)
    const auto* guard = c10::impl::getDeviceGuardImpl(m.device.type());
    guard->synchronizeStream(guard->getStream(m.device));
  }

  int64_t max_slots() const { return static_cast<int64_t>(slots.size()); }

  int64_t running() const {
    return std::count_if(slots.begin(), slots.end(), [](const auto& s) { return s != nullptr; });
  }

  // Ends s (no longer waiting), its slot freed and stats counted without it before its client can
  // see the end: whoever waited for the end (a server counting its cancels) reads gauges that agree.
  void end(const std::shared_ptr<Seq>& s, FinishReason why, std::string message = {}) {
    const std::shared_ptr<Seq> seq = s;  // (s may be the very slot freed here)
    seq->done = true;
    if (seq->slot >= 0 && slots[seq->slot] == seq) slots[seq->slot] = nullptr;
    update_stats();
    seq->state->finish(why, std::move(message));
  }

  // Takes what was submitted and admits waiting requests into free slots, lowest first; ends the
  // cancelled ones.
  void admit() {
    {
      std::lock_guard<std::mutex> lock(mu);
      while (!incoming.empty()) {
        waiting.push_back(std::move(incoming.front()));
        incoming.pop_front();
      }
    }
    for (auto& s : slots) {
      if (s && s->state->cancelled) end(s, FinishReason::cancelled);
    }
    // a cancelled request that waits ends now (its client may be waiting for its end)
    for (auto it = waiting.begin(); it != waiting.end();) {
      if ((*it)->state->cancelled) {
        const std::shared_ptr<Seq> s = std::move(*it);
        it = waiting.erase(it);
        end(s, FinishReason::cancelled);
      } else {
        ++it;
      }
    }
    for (int64_t slot = 0; slot < max_slots() && !waiting.empty(); ++slot) {
      if (slots[slot]) continue;
      std::shared_ptr<Seq> s = std::move(waiting.front());
      waiting.pop_front();
      if (s->o.temperature > 0) {
        try {
          s->gen = make_generator(m.device, s->o.seed);
        } catch (const std::exception& e) {  // (in no queue now: ended here, or its client would wait forever)
          end(s, FinishReason::error, std::string("cannot make the request's generator: ") + e.what());
          --slot;
          continue;
        }
      }
      s->slot = slot;
      s->state->admit();
      slots[slot] = s;
    }
    update_stats();
  }

  // Plans and launches the next step from the host's state: a run of the decoding sequences, each
  // feeding its last id, and a run of the prefilling ones, each feeding its next chunk. Empty where
  // no request holds a slot.
  std::vector<std::unique_ptr<Launched>> launch_planned() {
    std::vector<std::shared_ptr<Seq>> decoding, prefilling;
    for (const auto& s : slots) {
      if (s) (s->prefilling() ? prefilling : decoding).push_back(s);
    }
    std::vector<std::unique_ptr<Launched>> runs;
    if (!decoding.empty()) runs.push_back(launch_rows(decoding, 1));
    if (!prefilling.empty()) {
      const int64_t n = static_cast<int64_t>(prefilling.size());
      int64_t t = 1;
      for (const auto& s : prefilling) t = std::max<int64_t>(t, static_cast<int64_t>(s->prompt.size()) - s->fed);
      // what the decode run leaves of the budget, shared; every row's t positions fit in its cache
      const int64_t left = options.token_budget - static_cast<int64_t>(decoding.size());
      int64_t room = std::max<int64_t>(1, left / n);
      for (const auto& s : prefilling) room = std::min(room, m.max_seq_len - s->filled);
      t = std::min(t, room);
      if (const int64_t r = t % multiple; r != 0) t = multiple - r > room - t ? room : t + (multiple - r);
      std::optional<CacheAttentionChunks> on_device;
      if (chunk_attention && !decoding.empty()) on_device.emplace(t);
      runs.push_back(launch_rows(prefilling, t));
    }
    return runs;
  }

  // Launches one run of T = t over these sequences' slots: a decoding one feeds its last id, a
  // prefilling one its next chunk of at most t ids (padded to t).
  std::unique_ptr<Launched> launch_rows(const std::vector<std::shared_ptr<Seq>>& seqs, int64_t t) {
    const int64_t b = static_cast<int64_t>(seqs.size());
    auto l = std::make_unique<Launched>();
    l->rows = b;
    l->t = t;
    l->sampled.resize(b);
    l->filled.resize(b);
    std::vector<int64_t> ids(b * t, m.pad), start(b), count(b, 1), slot(b);
    for (int64_t r = 0; r < b; ++r) {
      const auto& s = seqs[r];
      start[r] = s->filled;
      slot[r] = s->slot;
      if (s->prefilling()) {
        count[r] = std::min<int64_t>(t, static_cast<int64_t>(s->prompt.size()) - s->fed);
        std::copy_n(s->prompt.begin() + s->fed, count[r], ids.begin() + r * t);
        s->fed += count[r];
        if (!s->prefilling()) l->sampled[r] = s;  // the prompt's last chunk: its first new id
      } else {
        ids[r * t] = s->last;
        l->sampled[r] = s;
      }
      s->filled += count[r];
      l->filled[r] = s->filled;
      if (l->sampled[r]) ++s->in_flight;
    }
    run(*l, at::tensor(ids, at::TensorOptions().dtype(at::kLong)).view({b, t}), start, count, slot);
    return l;
  }

  // Launches the decode run after `cur` (a run of T = 1 on CUDA, not taken yet) fed cur's ids on the
  // device, for the sequences that go on unless an eos or stop id ends them. nullptr where none
  // does, or where a request waits for a slot (the next step plans its admission).
  std::unique_ptr<Launched> launch_ahead(const Launched& cur) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!incoming.empty() || !waiting.empty()) return nullptr;
    }
    // a prefilling sequence's next chunk is planned on the host (the next step is not a decode step)
    for (const auto& s : slots) {
      if (s && s->prefilling()) return nullptr;
    }
    std::vector<int64_t> kept;  // cur's rows that go on
    for (int64_t r = 0; r < cur.rows; ++r) {
      const auto& s = cur.sampled[r];
      if (s && !s->done && !s->state->cancelled && s->taken + s->in_flight < s->o.max_new_tokens &&
          s->filled < m.max_seq_len) {
        kept.push_back(r);
      }
    }
    const int64_t b = static_cast<int64_t>(kept.size());
    if (b == 0) return nullptr;
    auto l = std::make_unique<Launched>();
    l->rows = b;
    l->t = 1;
    l->sampled.resize(b);
    l->filled.resize(b);
    std::vector<int64_t> start(b), slot(b);
    for (int64_t r = 0; r < b; ++r) {
      const auto& s = cur.sampled[kept[r]];
      start[r] = s->filled++;
      slot[r] = s->slot;
      l->filled[r] = s->filled;
      l->sampled[r] = s;
      ++s->in_flight;
    }
    at::Tensor ids = cur.ids;
    if (b < cur.rows) {  // (from pinned memory, not waiting for the device)
      const at::Tensor index = at::tensor(kept, at::TensorOptions().dtype(at::kLong)).pin_memory();
      ids = ids.index_select(0, index.to(m.device, /*non_blocking=*/true));
    }
    run(*l, ids.view({b, 1}), start, std::vector<int64_t>(b, 1), slot);
    return l;
  }

  // Runs the package on one run's inputs and samples each row's next id (on the device; the copy
  // to the host is waited for in take).
  void run(Launched& l, const at::Tensor& ids, const std::vector<int64_t>& start, const std::vector<int64_t>& count,
           const std::vector<int64_t>& slot) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    at::Tensor logits;
#ifdef CUSTOMOPS_WITH_CUDA
    if (l.t == 1 && m.graphs && options.cuda_graph) {
      auto& step = m.steps[l.rows];
      // start and slots in one buffer (one copy a run), each row 16-byte aligned as the package
      // expects its inputs (else it copies them)
      const int64_t row = (l.rows + 1) / 2 * 2;
      if (!step.ids.defined()) {
        const auto on_device = opts.device(m.device);
        step.ids = at::empty({l.rows, 1}, on_device);
        step.positions = at::zeros({2, row}, on_device);
        step.count = at::ones({l.rows}, on_device);
      }
      step.ids.copy_(ids, /*non_blocking=*/true);
      std::vector<int64_t> positions(2 * row, 0);
      std::copy(start.begin(), start.end(), positions.begin());
      std::copy(slot.begin(), slot.end(), positions.begin() + row);
      step.positions.copy_(at::tensor(positions, opts).view({2, row}).pin_memory(), /*non_blocking=*/true);
      if (!step.graph) {
        step.graph = std::make_unique<DecodeGraph>(m.device, [&] {
          return m.loader->run({step.ids, step.positions[0].narrow(0, 0, l.rows), step.count,
                                step.positions[1].narrow(0, 0, l.rows)});
        });
        logits = step.graph->first().at(0);
      } else {
        logits = step.graph->replay().at(0);
      }
      std::lock_guard<std::mutex> lock(mu);
      ++stats.graph_runs;
    }
#endif
    if (!logits.defined()) {
      logits = m.loader
                   ->run({ids.to(m.device), at::tensor(start, opts).to(m.device), at::tensor(count, opts).to(m.device),
                          at::tensor(slot, opts).to(m.device)})
                   .at(0);
    }
    // the rows that sample, by their options: each set's distributions shaped at once, each row
    // drawn from its own generator (a launch or two a row, not the dozen of shaping it alone)
    std::map<std::tuple<double, int64_t, double>, std::vector<int64_t>> sets;
    for (int64_t r = 0; r < l.rows; ++r) {
      const auto& s = l.sampled[r];
      if (!s || !s->gen) continue;
      const Sampling o = s->sampling();
      sets[{o.temperature, o.top_k, o.top_p}].push_back(r);
    }
    at::Tensor next, marked;
    const bool one_set = sets.size() == 1 && static_cast<int64_t>(sets.begin()->second.size()) == l.rows;
    if (!one_set) std::tie(next, marked) = sample(logits, Sampling{});  // every row greedy first
    for (const auto& [key, rows] : sets) {
      std::vector<at::Generator*> gens;
      for (const int64_t r : rows) gens.push_back(&*l.sampled[r]->gen);
      const Sampling sampling{std::get<0>(key), std::get<1>(key), std::get<2>(key)};
      if (one_set) {
        std::tie(next, marked) = sample(logits, sampling, gens);
        break;
      }
      at::Tensor index = at::tensor(rows, opts);
      if (!m.device.is_cpu()) index = index.pin_memory().to(m.device, /*non_blocking=*/true);
      auto [ids, ids_marked] = sample(logits.index_select(0, index), sampling, gens);
      next.index_copy_(0, index, ids);
      marked.index_copy_(0, index, ids_marked);
    }
    l.ids = next;
    if (m.device.is_cpu()) {
      l.host = marked;
    } else {
      l.host = at::empty({l.rows}, opts.pinned_memory(true));
      l.host.copy_(marked, /*non_blocking=*/true);
      l.ready.emplace(m.device.type());
      l.ready->record(c10::impl::getDeviceGuardImpl(m.device.type())->getStream(m.device));
    }
    std::lock_guard<std::mutex> lock(mu);
    ++stats.runs;
    stats.tokens += l.rows * l.t;
  }

  // Waits for a launched step's ids and gives each to its request; ends the sequences that stop.
  void take(Launched& l) {
    if (l.ready) l.ready->synchronize();
    auto ids = l.host.accessor<int64_t, 1>();
    for (int64_t r = 0; r < l.rows; ++r) {
      const auto& s = l.sampled[r];
      if (!s) continue;
      --s->in_flight;
      if (s->done) continue;  // ended by an earlier step; this id was launched ahead
      if (s->state->cancelled) {
        end(s, FinishReason::cancelled);
        continue;
      }
      if (ids[r] < 0) {
        end(s, FinishReason::error,
            "the package's logits are not finite (NaN or inf) at its new id " + std::to_string(s->taken + 1) +
                ": the package's weights are damaged, or the model overflows its dtype");
        continue;
      }
      s->last = ids[r];
      ++s->taken;
      s->state->push(s->last);
      const bool stop = (s->o.stop_at_eos && std::find(m.eos.begin(), m.eos.end(), s->last) != m.eos.end()) ||
                        std::find(s->o.stop_ids.begin(), s->o.stop_ids.end(), s->last) != s->o.stop_ids.end();
      if (stop) {
        end(s, FinishReason::stop);
      } else if (s->taken >= s->o.max_new_tokens || l.filled[r] >= m.max_seq_len) {
        end(s, FinishReason::length);
      }
    }
  }

  bool step() {
    const c10::DeviceGuard device_guard(m.device);  // (a thread of its own starts on device 0)
    std::vector<std::unique_ptr<Launched>> runs;
    if (ahead) runs.push_back(std::move(ahead));
    try {
      if (runs.empty()) {
        admit();
        runs = launch_planned();
        if (runs.empty()) return false;
      }
      // (a step with a prefill run has prefilling sequences: nothing runs ahead of it)
      if (runs.size() == 1 && runs[0]->t == 1 && runs[0]->ready) ahead = launch_ahead(*runs[0]);
      for (auto& l : runs) take(*l);
    } catch (...) {
      fail(std::current_exception());
      throw;
    }
    std::lock_guard<std::mutex> lock(mu);
    ++stats.steps;
    stats.running = running();
    return true;
  }

  // The package failed to run: every request holding a slot ends with the error (their caches
  // are whatever the failed run left), and a step launched ahead is finished first.
  void fail(std::exception_ptr error) {
    std::string message = "the package failed to run";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message += std::string(": ") + e.what();
    } catch (...) {
    }
    if (ahead && ahead->ready) {
      try {
        ahead->ready->synchronize();
      } catch (...) {
      }
    }
    ahead.reset();
    for (auto& s : slots) {
      if (s) end(s, FinishReason::error, message);
    }
    update_stats();
  }

  void update_stats() {
    std::lock_guard<std::mutex> lock(mu);
    stats.running = running();
    stats.waiting = static_cast<int64_t>(waiting.size() + incoming.size());
  }

  // Ends every request, in a slot or waiting, as cancelled (the engine is going away).
  void cancel_all() {
    if (ahead && ahead->ready) {
      try {  // (a device error first seen here must not keep the requests from ending)
        ahead->ready->synchronize();
      } catch (...) {
      }
    }
    ahead.reset();
    {
      std::lock_guard<std::mutex> lock(mu);
      while (!incoming.empty()) {
        waiting.push_back(std::move(incoming.front()));
        incoming.pop_front();
      }
    }
    for (auto& s : slots) {
      if (s) end(s, FinishReason::cancelled);
    }
    std::deque<std::shared_ptr<Seq>> left;
    left.swap(waiting);
    for (auto& s : left) end(s, FinishReason::cancelled);
    update_stats();
  }
};

Engine::Engine(CausalLM& lm, EngineOptions options) {
  if (options.token_budget < 1) throw std::invalid_argument("token_budget must be at least 1");
  if (options.max_batch < 0) throw std::invalid_argument("max_batch must be at least 0");
  impl_ = std::make_unique<Impl>(*lm.impl_, options);
}

Engine::~Engine() {
  stop();
  try {
    impl_->cancel_all();
  } catch (...) {
  }
}

std::shared_ptr<Request> Engine::submit(std::vector<int64_t> prompt, const RequestOptions& o) {
  auto& m = impl_->m;
  if (o.max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be at least 1");
  check_sampling({o.temperature, o.top_k, o.top_p});
  check_prompt(prompt, m.max_seq_len, m.vocab, "the prompt");
  auto state = std::make_shared<Request::State>();
  state->times.submitted = Clock::now();
  state->prompt_tokens = static_cast<int64_t>(prompt.size());
  auto s = std::make_shared<Seq>();
  s->state = state;
  s->prompt = std::move(prompt);
  s->o = o;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    // (after stop() nothing would ever run it)
    if (impl_->stopping) throw EngineStopped("the engine is stopped: it takes no more requests");
    impl_->incoming.push_back(s);
    ++impl_->stats.waiting;
    impl_->cv.notify_all();
  }
  return std::make_shared<Request>(state);
}

bool Engine::step() { return impl_->step(); }

void Engine::start() {
  auto& i = *impl_;
  if (i.thread.joinable()) return;
  i.stopping = false;
  i.thread = std::thread([&i] {
    try {
      i.warm_up();
    } catch (const std::exception& e) {
      std::cerr << "customops::Engine: the warm-up failed (the engine runs without it): " << e.what() << "\n";
    }
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(i.mu);
        // (waiting, slots and ahead are this thread's own)
        i.cv.wait(lock, [&] {
          return i.stopping || !i.incoming.empty() || !i.waiting.empty() || i.running() > 0 || i.ahead;
        });
        if (i.stopping) break;
      }
      try {
        i.step();
      } catch (const std::exception& e) {
        std::cerr << "customops::Engine: " << e.what() << "\n";  // the requests in flight ended with it
      } catch (...) {
        std::cerr << "customops::Engine: a step failed with an exception that is not a std::exception\n";
      }
    }
    try {
      i.cancel_all();
    } catch (...) {
    }
  });
}

void Engine::stop() {
  auto& i = *impl_;
  {
    std::lock_guard<std::mutex> lock(i.mu);
    i.stopping = true;
    i.cv.notify_all();
  }
  if (i.thread.joinable()) i.thread.join();
}

Engine::Stats Engine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace customops
