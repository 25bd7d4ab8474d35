// Text in and out of generation (customops/generate.h): a SentencePiece tokenizer, the
// tokenizer.model of Llama-2, Mistral, Gemma and other SentencePiece models. It lives in its own
// library, libcustomops_text (CMake: customops::text), which links SentencePiece where the build
// found it (Debian: apt-get install libsentencepiece-dev); elsewhere available() is false and the
// constructor throws. libcustomops itself never links it.
//
//   customops::CausalLM lm("llama.pt2");
//   customops::Tokenizer tok("tokenizer.model");
//   std::vector<int64_t> prompt = tok.encode("The capital of France is");
//   if (auto bos = lm.bos_token_id()) prompt.insert(prompt.begin(), *bos);   // as the model was trained
//   std::string text = tok.decode(lm.generate({prompt}, {}).ids[0]);
//
// Tokenizers described by a tokenizer.json (Llama-3's byte-level BPE, Qwen's) are not SentencePiece
// models: no C++ reader of them installs from the package registries this project builds from.
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
  // Whether this build links SentencePiece.
  static bool available();

  // Loads a SentencePiece model file. Throws std::invalid_argument naming the file where it is
  // missing or not a SentencePiece model, and std::runtime_error where !available().
  explicit Tokenizer(const std::string& model_path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of text, without bos or eos.
  std::vector<int64_t> encode(const std::string& text) const;
  // The text of ids (control ids such as bos and eos give no text). Throws std::invalid_argument
  // for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;
  std::optional<int64_t> bos_id() const;  // none where the model has none
  std::optional<int64_t> eos_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace customops
