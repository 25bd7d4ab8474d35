// Consumer check: customops::Tokenizer and customops::TextStream driven from the command line, for
// the tokenizer tests (tests/python/test_tokenizer.py), which compare them with Hugging Face's
// tokenizers library. Texts travel hex-encoded, one a line, so that any bytes survive.
//
//   tokenize_api TOKENIZER info             vocab_size bos eos (-1 where none)
//   tokenize_api TOKENIZER encode FILE      a line of hex text in, a line of ids out
//   tokenize_api TOKENIZER decode FILE      a line of ids in, a line of hex text out
//   tokenize_api TOKENIZER stream FILE      a line of ids in; out, the hex of each push's text, comma-separated,
//                                           then ';' and the hex of finish()'s
//   tokenize_api TOKENIZER time FILE N      encodes every text of FILE N times; prints the seconds and bytes
//
// An exception the API throws is one line, "invalid_argument: ..." or "runtime_error: ...", exit 3.
#include <customops/tokenizer.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "hex.h"

namespace {

std::vector<std::string> lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) out.push_back(line);
  return out;
}

std::vector<int64_t> ids_of(const std::string& line) {
  std::vector<int64_t> ids;
  std::istringstream in(line);
  for (long long id; in >> id;) ids.push_back(id);
  return ids;
}

int run(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenize_api TOKENIZER (info | encode FILE | decode FILE | stream FILE | time FILE N)\n";
    return 2;
  }
  customops::Tokenizer tok(argv[1]);
  const std::string what = argv[2];
  if (what == "info") {
    std::cout << tok.vocab_size() << " " << tok.bos_id().value_or(-1) << " " << tok.eos_id().value_or(-1) << "\n";
  } else if (what == "encode" && argc == 4) {
    for (const auto& line : lines(argv[3])) {
      const std::vector<int64_t> ids = tok.encode(unhex(line));
      for (size_t j = 0; j < ids.size(); ++j) std::cout << (j ? " " : "") << ids[j];
      std::cout << "\n";
    }
  } else if (what == "decode" && argc == 4) {
    for (const auto& line : lines(argv[3])) std::cout << hex(tok.decode(ids_of(line))) << "\n";
  } else if (what == "stream" && argc == 4) {
    for (const auto& line : lines(argv[3])) {
      customops::TextStream stream(tok);
      bool first = true;
      for (const int64_t id : ids_of(line)) {
        std::cout << (first ? "" : ",") << hex(stream.push(id));
        first = false;
      }
      std::cout << ";" << hex(stream.finish()) << "\n";
    }
  } else if (what == "time" && argc == 5) {
    std::vector<std::string> texts;
    size_t bytes = 0;
    for (const auto& line : lines(argv[3])) {
      texts.push_back(unhex(line));
      bytes += texts.back().size();
    }
    const int n = std::stoi(argv[4]);
    size_t count = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < n; ++r) {
      for (const auto& t : texts) count += tok.encode(t).size();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%.6f %zu %zu\n", s, bytes * static_cast<size_t>(n), count);
  } else {
    std::cerr << "tokenize_api: unknown command\n";
    return 2;
  }
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
  }
  return 3;
}
