// Text in and out of generation (customops/generate.h): the tokenizer of a model, from
// - a tokenizer.json of byte-level BPE (Llama-3, Qwen2/Qwen3, Mistral-Nemo, GPT-2), encoded and
//   decoded as Hugging Face's tokenizers library does (through PCRE2, utf8proc and nlohmann-json);
// - a SentencePiece model, the tokenizer.model of Llama-2, Mistral, Gemma (through SentencePiece);
// - a folder written by save_pretrained: its tokenizer.json (else tokenizer.model), and the bos and
//   eos tokens of its tokenizer_config.json.
// It lives in its own library, libcustomops_text (CMake: customops::text), which links what the
// build found (available() says which formats it reads); libcustomops itself links none of it.
//
//   customops::CausalLM lm("llama.pt2");
//   customops::Tokenizer tok("tokenizer.json");
//   std::vector<int64_t> prompt = tok.encode("The capital of France is");
//   if (auto bos = lm.bos_token_id()) prompt.insert(prompt.begin(), *bos);   // as the model was trained
//   std::string text = tok.decode(lm.generate({prompt}, {}).ids[0]);
//
//   customops::TextStream stream(tok);             // streaming: text as ids come, whole characters
//   for (int64_t id : ids) std::cout << stream.push(id);
//   std::cout << stream.finish();
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "customops/macros.h"

namespace customops {

class CUSTOMOPS_API Tokenizer {
 public:
  // Whether this build reads a format: "sentencepiece" (SentencePiece found) or "tokenizer.json"
  // (nlohmann-json, PCRE2 and utf8proc found).
  static bool available(const std::string& format = "sentencepiece");

  // Loads a tokenizer.json, a SentencePiece model or a save_pretrained folder (see above). Throws
  // std::invalid_argument naming the file where it is missing, malformed, or of a kind it does not
  // read (a WordPiece or Unigram tokenizer.json), and std::runtime_error where the build does not
  // read its format.
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of text, without bos or eos (a tokenizer.json's added and special tokens written in the
  // text are theirs; bytes that are not UTF-8 are read as U+FFFD).
  std::vector<int64_t> encode(const std::string& text) const;
  // The text of ids (special and control ids, such as bos and eos, give no text; bytes that do not
  // form UTF-8 give U+FFFD). Throws std::invalid_argument for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;
  std::optional<int64_t> bos_id() const;  // none where the model has none
  std::optional<int64_t> eos_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The text of ids as they come, for streaming: push returns what the ids so far add to the text,
// never part of a UTF-8 character (it waits for the ids that may complete one: the last 3 that give
// bytes, or more where their boundaries cut characters; bytes that no id can complete come as
// decode()'s U+FFFD), and finish what is left. The text pushed and finished is decode() of all the
// ids. The tokenizer must outlive it.
class CUSTOMOPS_API TextStream {
 public:
  explicit TextStream(const Tokenizer& tokenizer);
  std::string push(int64_t id);
  std::string finish();

 private:
  const Tokenizer& tokenizer_;
  std::vector<int64_t> ids_;  // the ids from the window's start on
  size_t read_ = 0;           // ids_[0, read_) are the window, whose text prefix_ is
  std::string prefix_;
};

}  // namespace customops
