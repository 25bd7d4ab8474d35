// Consumer check: customops::CausalLM driven from the command line, for the generation tests and
// their fuzz (tests/python/test_generate.py, test_generate_fuzz.py), which make the packages.
//
//   generate_api PACKAGE [--device D] [--max-new-tokens N] [--temperature T] [--top-k K]
//                [--top-p P] [--seed S] [--ignore-eos] [--no-cuda-graph] --prompt "ID ..." ...
//
// Prints one line of new ids a prompt and exits 0, or one line naming the exception the API threw
// ("invalid_argument: ...", "runtime_error: ...", "c10::Error: ...") and exits 3: the API promises
// these and nothing else, so anything else (another exception, a signal) is a failure of the test.
// Numbers are parsed as given (strtod, strtoll, strtoull), so that the API sees the edge values.
#include <c10/util/Exception.h>
#include <customops/generate.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> ids_of(const std::string& text) {
  std::vector<int64_t> ids;
  std::istringstream in(text);
  for (long long id; in >> id;) ids.push_back(id);
  return ids;
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: generate_api PACKAGE [options] --prompt \"ID ...\" ...\n";
    return 2;
  }
  customops::GenerateOptions o;
  std::optional<c10::Device> device;
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ignore-eos") {
      o.stop_at_eos = false;
      continue;
    }
    if (a == "--no-cuda-graph") {
      o.cuda_graph = false;
      continue;
    }
    if (i + 1 >= argc) {
      std::cerr << "generate_api: " << a << " expects a value\n";
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--prompt") {
      prompts.push_back(ids_of(v));
    } else if (a == "--device") {
      device = c10::Device(v);
    } else if (a == "--max-new-tokens") {
      o.max_new_tokens = std::strtoll(v, nullptr, 10);
    } else if (a == "--temperature") {
      o.temperature = std::strtod(v, nullptr);
    } else if (a == "--top-k") {
      o.top_k = std::strtoll(v, nullptr, 10);
    } else if (a == "--top-p") {
      o.top_p = std::strtod(v, nullptr);
    } else if (a == "--seed") {
      o.seed = std::strtoull(v, nullptr, 10);
    } else {
      std::cerr << "generate_api: unknown option " << a << "\n";
      return 2;
    }
  }
  customops::CausalLM lm(argv[1], device);
  const customops::GenerateResult r = lm.generate(prompts, o);
  for (const auto& ids : r.ids) {
    for (size_t j = 0; j < ids.size(); ++j) std::cout << (j ? " " : "") << ids[j];
    std::cout << "\n";
  }
  return 0;
}

// One line: what the API threw and its message, without torch's backtrace.
int report(const std::string& kind, std::string message) {
  for (char& c : message) c = c == '\n' ? ' ' : c;
  std::cout << kind << ": " << message << "\n";
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    return report("c10::Error", e.what_without_backtrace());
  } catch (const std::invalid_argument& e) {
    return report("invalid_argument", e.what());
  } catch (const std::runtime_error& e) {
    return report("runtime_error", e.what());
  }
}
