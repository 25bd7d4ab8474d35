// customops-run generate: text generation from a causal-LM package through customops::CausalLM
// (customops/generate.h). Ids in and out (one prompt a line of space-separated ids, one line of
// new ids a prompt on stdout), or text with --tokenizer (customops::Tokenizer); timings on stderr.
#include <customops/generate.h>
#include <customops/package.h>
#include <customops/tokenizer.h>

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "runner/runner.h"

namespace customops::runner {
namespace {

constexpr const char* kGenerateUsage = R"(usage: customops-run generate PACKAGE.pt2 (--prompt "ID ID ..." | --prompts FILE) [options]
       customops-run generate PACKAGE.pt2 --tokenizer TOKENIZER (--prompt "TEXT" | --prompts FILE) [options]

Generates from a causal-LM package (customops.export.package_causal_lm), with no Python: prefills
every prompt in one run, decodes until each has produced the package's eos id or --max-new-tokens
ids, and prints one line per prompt on stdout and the timings on stderr. Without --tokenizer,
prompts and output are token ids (space-separated); with it, they are text: each prompt is
tokenized (after the bos id: the package's, else the tokenizer's) and each line of output is the
new text, with backslash and newline written as \\ and \n.

  --prompt "ID ..."      one prompt (repeat for several; they form one batch)
  --prompts FILE         one prompt a line (no empty lines)
  --tokenizer PATH       text in and out: a tokenizer.json (byte-level BPE: Llama-3, Qwen2/3,
                         Mistral-Nemo, GPT-2), a SentencePiece tokenizer.model, or a folder that
                         save_pretrained wrote (its tokenizer.json or tokenizer.model)
  --text                 text in and out through the tokenizer the package embeds
                         (package_causal_lm(..., tokenizer=...))
  --no-bos               with --tokenizer: do not put the bos id before each prompt
  --max-new-tokens N     at most N new ids per prompt (default: 32)
  --temperature T        0 (default): greedy; otherwise sample from softmax(logits / T)
  --top-k K              sample among the K largest logits (default: 0, all)
  --top-p P              sample among the fewest ids whose probability reaches P (default: 1)
  --seed S               the sampler's seed (default: 0); the same seed gives the same ids
  --ignore-eos           do not stop at the eos id
  --no-cuda-graph        CUDA: launch every kernel of every decode step (default: replay a CUDA graph)
  --no-warmup            time the first call (default: a short call with the same prompts first, so
                         the timings leave out loading kernels and capturing the CUDA graph)
  --device DEVICE        cpu, cuda or cuda:N (default: the package's device, index 0)
  -h, --help             print this help
)";

std::vector<int64_t> parse_ids(const std::string& text, const std::string& where) {
  std::vector<int64_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || used == 0) throw UserError(where + ": " + runner::quoted(word) + " is not a token id (an integer)");
    ids.push_back(v);
  }
  if (ids.empty()) throw UserError(where + " holds no ids");
  return ids;
}

template <typename T>
T parse_number(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    T v;
    if constexpr (std::is_floating_point_v<T>) {  // strtod, not stod: a subnormal or a huge value is a value
      char* end = nullptr;
      v = static_cast<T>(std::strtod(value.c_str(), &end));
      used = static_cast<size_t>(end - value.c_str());
    } else if constexpr (std::is_unsigned_v<T>) {  // stoull takes "-1" as 2^64 - 1
      v = value.find('-') == std::string::npos ? static_cast<T>(std::stoull(value, &used)) : 0;
    } else {
      v = static_cast<T>(std::stoll(value, &used));
    }
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  if constexpr (std::is_unsigned_v<T>) {
    throw UsageError(flag + " expects an integer in [0, " + std::to_string(std::numeric_limits<T>::max()) + "], got " +
                     runner::quoted(value));
  }
  throw UsageError(flag + " expects a number, got " + runner::quoted(value));
}

}  // namespace

std::unique_ptr<CausalLM> load_causal_lm(const std::string& package, const std::optional<std::string>& device,
                                         const TempFolder& unpack_into) {
  // (torch's loader unpacks the package also to read its metadata)
  const TmpdirScope unpacked(unpack_into.path());
  // The package's device, checked against --device as the plain runner checks it.
  Options po;
  po.package = package;
  po.device = device;
  const c10::Device dev = pick_device(po, read_metadata(po)["AOTI_DEVICE_KEY"]);
  try {
    return std::make_unique<CausalLM>(package, dev);
  } catch (const std::invalid_argument& e) {
    throw UserError(e.what());
  } catch (const std::exception& e) {
    throw UserError("cannot load " + package + ": " + message_of(e));
  }
}

EmbeddedTokenizer::EmbeddedTokenizer(const std::string& package) {
  std::map<std::string, std::string> files;
  try {
    files = package_files(package, "extra/customops/tokenizer/");
  } catch (const std::exception& e) {
    throw UserError(e.what());
  }
  if (files.empty()) return;
  for (const auto& [name, bytes] : files) {
    if (name.find('/') != std::string::npos || name == "." || name == "..") {
      throw UserError(package + " embeds a tokenizer file with a path in its name (" + runner::quoted(name) + ")");
    }
  }
  const std::string& dir = folder_.emplace("customops-tokenizer").path();
  for (const auto& [name, bytes] : files) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) throw UserError("cannot write the package's tokenizer into " + dir);
  }
}

const std::string& EmbeddedTokenizer::path() const {
  static const std::string none;
  return folder_ ? folder_->path() : none;
}

void check_tokenizer(const Tokenizer& tokenizer, const CausalLM& lm) {
  if (tokenizer.vocab_size() > lm.vocab_size()) {
    throw UserError("the tokenizer's vocabulary (" + std::to_string(tokenizer.vocab_size()) +
                    " ids) is larger than the package's (" + std::to_string(lm.vocab_size()) +
                    "): it is not this model's tokenizer");
  }
}

int generate_main(int argc, char** argv) {
  std::string package;
  std::vector<std::pair<std::string, std::string>> given;  // (prompt, where it came from)
  std::optional<std::string> prompts_file, device, tokenizer_path;
  GenerateOptions o;
  bool warmup = true, bos = true, text = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&] { return option_value(argc, argv, i); };
    if (a == "-h" || a == "--help") {
      std::cout << kGenerateUsage;
      return 0;
    } else if (a == "--prompt") {
      given.emplace_back(value(), "--prompt " + std::to_string(given.size() + 1));
    } else if (a == "--prompts") {
      prompts_file = value();
    } else if (a == "--tokenizer") {
      tokenizer_path = value();
    } else if (a == "--text") {
      text = true;
    } else if (a == "--no-bos") {
      bos = false;
    } else if (a == "--max-new-tokens") {
      o.max_new_tokens = parse_number<int64_t>(a, value());
    } else if (a == "--temperature") {
      o.temperature = parse_number<double>(a, value());
    } else if (a == "--top-k") {
      o.top_k = parse_number<int64_t>(a, value());
    } else if (a == "--top-p") {
      o.top_p = parse_number<double>(a, value());
    } else if (a == "--seed") {
      o.seed = parse_number<uint64_t>(a, value());
    } else if (a == "--ignore-eos") {
      o.stop_at_eos = false;
    } else if (a == "--no-cuda-graph") {
      o.cuda_graph = false;
    } else if (a == "--no-warmup") {
      warmup = false;
    } else if (a == "--device") {
      device = value();
    } else if (a.size() > 1 && a[0] == '-') {
      throw UsageError("unknown option " + a + " (see generate --help)");
    } else if (package.empty()) {
      package = a;
    } else {
      throw UsageError("generate expects one PACKAGE.pt2, got also '" + a + "' (see generate --help)");
    }
  }
  if (package.empty()) throw UsageError("generate expects PACKAGE.pt2 (see generate --help)");
  if (text && tokenizer_path) throw UsageError("give --text (the package's tokenizer) or --tokenizer, not both");
  // SIGINT or SIGTERM ends it at once, its folders removed
  StopSignals signals("generate: interrupted");
  // --text: the tokenizer the package embeds, in a folder of its own while this runs
  std::optional<EmbeddedTokenizer> embedded;
  if (text) {
    embedded.emplace(package);
    if (embedded->path().empty()) {
      throw UserError(package + " embeds no tokenizer (package_causal_lm(..., tokenizer=...) embeds one); give "
                      "--tokenizer PATH");
    }
    tokenizer_path = embedded->path();
  }
  std::vector<std::vector<int64_t>> prompts;
  if (prompts_file && !given.empty()) throw UsageError("give --prompt or --prompts, not both");
  if (!bos && !tokenizer_path) throw UsageError("--no-bos is for text prompts (--tokenizer or --text)");
  if (prompts_file) {
    require_regular_file(*prompts_file, "the prompts file");
    std::ifstream in(*prompts_file);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) given.emplace_back(line, *prompts_file + " line " + std::to_string(n));
    if (given.empty()) throw UserError("the prompts file " + *prompts_file + " holds no prompts (it is empty)");
  }
  if (given.empty()) throw UsageError("generate expects --prompt \"ID ...\" (or \"TEXT\" with --tokenizer) or --prompts FILE");
  std::unique_ptr<Tokenizer> tokenizer;
  if (tokenizer_path) {
    try {
      tokenizer = std::make_unique<Tokenizer>(*tokenizer_path);
    } catch (const std::exception& e) {
      throw UserError(e.what());
    }
  }
  if (!tokenizer) {
    for (const auto& [text, where] : given) prompts.push_back(parse_ids(text, where));
  }
  const TempFolder unpacked("customops-run");  // (before the model, which keeps files in it)
  std::unique_ptr<CausalLM> lm = load_causal_lm(package, device, unpacked);
  if (tokenizer) {
    check_tokenizer(*tokenizer, *lm);
    const std::optional<int64_t> bos_id = lm->bos_token_id() ? lm->bos_token_id() : tokenizer->bos_id();
    for (const auto& [text, where] : given) {
      if (text.empty()) throw UserError(where + " is empty");
      std::vector<int64_t> ids = tokenizer->encode(text);
      if (bos && bos_id) ids.insert(ids.begin(), *bos_id);
      if (ids.empty()) throw UserError(where + " gives no tokens");
      prompts.push_back(std::move(ids));
    }
  }
  GenerateResult r;
  try {
    without_backtraces([&] {
      if (warmup) {  // two new ids: a prefill and a decode step, which captures the CUDA graph
        GenerateOptions w = o;
        w.max_new_tokens = 2;
        w.stop_at_eos = false;
        lm->generate(prompts, w);
      }
      r = lm->generate(prompts, o);
    });
  } catch (const std::invalid_argument& e) {
    throw UserError(e.what());
  }
  std::vector<std::string> lines;  // all of them first: a failure prints nothing half-done
  for (const auto& ids : r.ids) {
    std::string line;
    if (tokenizer) {
      std::string text;
      try {
        text = tokenizer->decode(ids);
      } catch (const std::invalid_argument& e) {
        throw UserError(std::string("the model generated an id the tokenizer does not have: ") + e.what());
      }
      for (const char c : text) line += c == '\\' ? std::string("\\\\") : c == '\n' ? std::string("\\n") : std::string(1, c);
    } else {
      for (size_t j = 0; j < ids.size(); ++j) line += (j ? " " : "") + std::to_string(ids[j]);
    }
    lines.push_back(std::move(line));
  }
  for (const auto& line : lines) std::cout << line << "\n";
  std::cout.flush();
  std::fprintf(stderr, "prefill: %lld tokens in %.3f ms (%.1f tokens/s)\n", static_cast<long long>(r.prefill_tokens),
               r.prefill_ms, r.prefill_tokens / (r.prefill_ms / 1e3));
  std::fprintf(stderr, "decode: %lld steps of %zu sequence(s) in %.3f ms (%.3f ms/token%s)\n",
               static_cast<long long>(r.decode_steps), prompts.size(), r.decode_ms,
               r.decode_steps ? r.decode_ms / r.decode_steps : 0.0, r.cuda_graph ? ", CUDA graph" : "");
  return 0;
}

}  // namespace customops::runner
