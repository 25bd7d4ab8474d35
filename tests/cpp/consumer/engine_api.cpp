// Consumer check: customops::Engine driven step by step from a script, for tests/python/test_engine.py
// (requests that arrive while others decode, more requests than slots, chunked prefill, cancels).
//
//   engine_api PACKAGE [--budget N] [--no-cuda-graph] [--thread] SCRIPT
//
// SCRIPT: one event a line, "STEP submit [max=N] [temp=T] [top_k=K] [top_p=P] [seed=S] [stop=ID]
// [ignore_eos] : ID ID ..." or "STEP cancel K" (K: the K-th submit, from 0), applied before the
// engine's STEP-th step (from 0). The engine steps until every event is applied and no request is
// in flight, and each request is read after each step. Prints a line per request, "K REASON N ID
// ID ...": why it ended, in how many steps' updates its ids came, its ids. With --thread the engine runs on its own thread (start())
// and every event is applied at once. An exception prints "invalid_argument: ..." etc. and exits 3.
#include <c10/util/Exception.h>
#include <customops/engine.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Event {
  int64_t step = 0;
  bool cancel = false;
  int64_t target = 0;  // cancel: which request
  std::vector<int64_t> prompt;
  customops::RequestOptions o;
};

Event parse(const std::string& line) {
  Event e;
  std::istringstream in(line);
  std::string word;
  in >> e.step >> word;
  if (word == "cancel") {
    e.cancel = true;
    in >> e.target;
    return e;
  }
  while (in >> word && word != ":") {
    const auto eq = word.find('=');
    const std::string key = word.substr(0, eq), value = eq == std::string::npos ? "" : word.substr(eq + 1);
    if (key == "max") e.o.max_new_tokens = std::strtoll(value.c_str(), nullptr, 10);
    if (key == "temp") e.o.temperature = std::strtod(value.c_str(), nullptr);
    if (key == "top_k") e.o.top_k = std::strtoll(value.c_str(), nullptr, 10);
    if (key == "top_p") e.o.top_p = std::strtod(value.c_str(), nullptr);
    if (key == "seed") e.o.seed = std::strtoull(value.c_str(), nullptr, 10);
    if (key == "stop") e.o.stop_ids.push_back(std::strtoll(value.c_str(), nullptr, 10));
    if (key == "ignore_eos") e.o.stop_at_eos = false;
  }
  for (long long id; in >> id;) e.prompt.push_back(id);
  return e;
}

int run(int argc, char** argv) {
  customops::EngineOptions eo;
  bool threaded = false;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--budget" && i + 1 < argc) {
      eo.token_budget = std::strtoll(argv[++i], nullptr, 10);
    } else if (a == "--no-cuda-graph") {
      eo.cuda_graph = false;
    } else if (a == "--thread") {
      threaded = true;
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2) {
    std::cerr << "usage: engine_api PACKAGE [--budget N] [--no-cuda-graph] [--thread] SCRIPT\n";
    return 2;
  }
  std::vector<Event> events;
  std::ifstream script(positional[1]);
  for (std::string line; std::getline(script, line);) {
    if (!line.empty()) events.push_back(parse(line));
  }
  customops::CausalLM lm(positional[0]);
  customops::Engine engine(lm, eo);
  std::vector<std::shared_ptr<customops::Request>> requests;
  std::vector<std::vector<int64_t>> ids;
  std::vector<int64_t> updates;
  std::vector<customops::Request::Update> last;
  // what each request has streamed so far (without waiting); true once every one has finished
  auto poll = [&](std::optional<std::chrono::milliseconds> timeout) {
    bool all = true;
    for (size_t k = 0; k < requests.size(); ++k) {
      if (last[k].finished) continue;
      last[k] = requests[k]->next(timeout);
      if (!last[k].ids.empty()) ++updates[k];
      ids[k].insert(ids[k].end(), last[k].ids.begin(), last[k].ids.end());
      all = all && last[k].finished;
    }
    return all;
  };
  auto apply = [&](const Event& e) {
    if (e.cancel) {
      requests.at(e.target)->cancel();
    } else {
      requests.push_back(engine.submit(e.prompt, e.o));
      ids.emplace_back();
      updates.push_back(0);
      last.emplace_back();
    }
  };
  if (threaded) {
    engine.start();
    for (const auto& e : events) apply(e);
  } else {
    size_t next = 0;
    for (int64_t step = 0;; ++step) {
      for (; next < events.size() && events[next].step <= step; ++next) apply(events[next]);
      const bool stepped = engine.step();
      poll(std::chrono::milliseconds(0));
      if (!stepped && next == events.size()) break;
    }
  }
  while (!poll(std::nullopt)) {
  }
  for (size_t k = 0; k < requests.size(); ++k) {
    std::cout << k << " " << customops::to_string(last[k].reason) << " " << updates[k];
    for (int64_t id : ids[k]) std::cout << " " << id;
    if (!last[k].error.empty()) std::cout << " error: " << last[k].error;
    std::cout << "\n";
  }
  const auto stats = engine.stats();
  std::cerr << "steps " << stats.steps << " graph_runs " << stats.graph_runs << " runs " << stats.runs << " tokens "
            << stats.tokens << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cout << "invalid_argument: " << e.what() << "\n";
  } catch (const std::runtime_error& e) {
    std::cout << "runtime_error: " << e.what() << "\n";
  } catch (const c10::Error& e) {
    std::cout << "c10::Error: " << e.what_without_backtrace() << "\n";
  }
  return 3;
}
