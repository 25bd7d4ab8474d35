// customops::Tokenizer (customops/tokenizer.h) over SentencePiece's processor, or, in a build
// without SentencePiece (CUSTOMOPS_WITH_SENTENCEPIECE undefined), a class that says so.
#include "customops/tokenizer.h"

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#ifdef CUSTOMOPS_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace customops {

#ifdef CUSTOMOPS_WITH_SENTENCEPIECE

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

bool Tokenizer::available() { return true; }

Tokenizer::Tokenizer(const std::string& model_path) : impl_(new Impl) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_path, ec)) {
    throw std::invalid_argument("tokenizer not found: " + model_path);
  }
  const auto status = impl_->sp.Load(model_path);
  if (!status.ok()) {
    throw std::invalid_argument(model_path + " is not a SentencePiece model (" + status.ToString() + ")");
  }
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  const auto status = impl_->sp.Encode(text, &ids);
  if (!status.ok()) throw std::invalid_argument("cannot tokenize the text: " + status.ToString());
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> narrow;
  narrow.reserve(ids.size());
  for (const int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      throw std::invalid_argument("id " + std::to_string(id) + " is outside the tokenizer's vocabulary of " +
                                  std::to_string(vocab_size()));
    }
    narrow.push_back(static_cast<int>(id));
  }
  std::string text;
  const auto status = impl_->sp.Decode(narrow, &text);
  if (!status.ok()) throw std::invalid_argument("cannot detokenize the ids: " + status.ToString());
  return text;
}

int64_t Tokenizer::vocab_size() const { return impl_->sp.GetPieceSize(); }

std::optional<int64_t> Tokenizer::bos_id() const {
  const int id = impl_->sp.bos_id();
  return id < 0 ? std::nullopt : std::optional<int64_t>(id);
}

std::optional<int64_t> Tokenizer::eos_id() const {
  const int id = impl_->sp.eos_id();
  return id < 0 ? std::nullopt : std::optional<int64_t>(id);
}

#else  // no SentencePiece in this build

struct Tokenizer::Impl {};

bool Tokenizer::available() { return false; }

Tokenizer::Tokenizer(const std::string&) {
  throw std::runtime_error(
      "this build of customops has no tokenizer: SentencePiece was not found when it was built "
      "(Debian: apt-get install libsentencepiece-dev, then rebuild customops)");
}

std::vector<int64_t> Tokenizer::encode(const std::string&) const { return {}; }
std::string Tokenizer::decode(const std::vector<int64_t>&) const { return {}; }
int64_t Tokenizer::vocab_size() const { return 0; }
std::optional<int64_t> Tokenizer::bos_id() const { return std::nullopt; }
std::optional<int64_t> Tokenizer::eos_id() const { return std::nullopt; }

#endif

Tokenizer::~Tokenizer() = default;

}  // namespace customops
