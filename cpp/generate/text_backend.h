// Internal to libcustomops_text: what customops::Tokenizer asks of a tokenizer format, and the two
// formats it reads: a SentencePiece model (tokenizer.cpp) and a tokenizer.json of byte-level BPE
// (bpe_tokenizer.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace customops::text {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // Special tokens give no text; ids are in [0, vocab_size()) (the caller checks).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int64_t> bos_id() const = 0;
  virtual std::optional<int64_t> eos_id() const = 0;
};

// Throws std::invalid_argument naming the file where it is not a SentencePiece model, and
// std::runtime_error in a build without SentencePiece.
std::unique_ptr<Backend> load_sentencepiece(const std::string& path);
bool sentencepiece_available();

// tokenizer.json (and, where given, the tokenizer_config.json beside it: bos and eos tokens).
// Throws std::invalid_argument naming the file and what it cannot read (malformed JSON, a model
// other than byte-level BPE, a normalizer or pre-tokenizer it does not implement), and
// std::runtime_error in a build without the libraries it needs.
std::unique_ptr<Backend> load_tokenizer_json(const std::string& path, const std::string& config_path);
bool tokenizer_json_available();

// bytes as UTF-8, each maximal ill-formed subsequence replaced with U+FFFD (as Rust's
// String::from_utf8_lossy, which Hugging Face's decoders use).
std::string utf8_lossy(const std::string& bytes);

}  // namespace customops::text
