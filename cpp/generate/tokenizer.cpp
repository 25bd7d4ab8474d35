// customops::Tokenizer and customops::TextStream (customops/tokenizer.h): the facade over the
// formats of generate/text_backend.h, and the SentencePiece one (in a build without SentencePiece,
// CUSTOMOPS_WITH_SENTENCEPIECE undefined, a loader that says so).
#include "customops/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "generate/text_backend.h"

#ifdef CUSTOMOPS_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace customops {

namespace text {

#ifdef CUSTOMOPS_WITH_SENTENCEPIECE

namespace {

class SentencePiece final : public Backend {
 public:
  explicit SentencePiece(const std::string& path) {
    const auto status = sp_.Load(path);
    if (!status.ok()) throw std::invalid_argument(path + " is not a SentencePiece model (" + status.ToString() + ")");
  }

  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw std::invalid_argument("cannot tokenize the text: " + status.ToString());
    return {ids.begin(), ids.end()};
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> narrow(ids.begin(), ids.end());
    std::string text;
    const auto status = sp_.Decode(narrow, &text);
    if (!status.ok()) throw std::invalid_argument("cannot detokenize the ids: " + status.ToString());
    return text;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int64_t> bos_id() const override { return id_or_none(sp_.bos_id()); }
  std::optional<int64_t> eos_id() const override { return id_or_none(sp_.eos_id()); }

 private:
  static std::optional<int64_t> id_or_none(int id) { return id < 0 ? std::nullopt : std::optional<int64_t>(id); }
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

bool sentencepiece_available() { return true; }
std::unique_ptr<Backend> load_sentencepiece(const std::string& path) { return std::make_unique<SentencePiece>(path); }

#else  // no SentencePiece in this build

bool sentencepiece_available() { return false; }
std::unique_ptr<Backend> load_sentencepiece(const std::string&) {
  throw std::runtime_error(
      "this build of customops reads no SentencePiece model: SentencePiece was not found when it was built "
      "(Debian: apt-get install libsentencepiece-dev, then rebuild customops)");
}

#endif

}  // namespace text

namespace {

// Whether a file holds JSON (a tokenizer.json) rather than a SentencePiece model (protobuf).
bool is_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char c = 0;
  while (f.get(c) && (c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
  }
  return f && c == '{';
}

}  // namespace

struct Tokenizer::Impl {
  std::unique_ptr<text::Backend> backend;
};

bool Tokenizer::available(const std::string& format) {
  if (format == "sentencepiece") return text::sentencepiece_available();
  if (format == "tokenizer.json") return text::tokenizer_json_available();
  return false;
}

Tokenizer::Tokenizer(const std::string& path) : impl_(new Impl) {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto file = [&](const fs::path& p) { return fs::is_regular_file(p, ec); };
  fs::path model = path, config;
  if (fs::is_directory(model, ec)) {  // save_pretrained's folder
    if (file(model / "tokenizer.json")) {
      model /= "tokenizer.json";
    } else if (file(model / "tokenizer.model")) {
      model /= "tokenizer.model";
    } else {
      throw std::invalid_argument(path + " holds neither a tokenizer.json nor a tokenizer.model");
    }
  } else if (!file(model)) {
    throw std::invalid_argument("tokenizer not found: " + path);
  }
  if (is_json(model.string())) {
    if (file(model.parent_path() / "tokenizer_config.json")) config = model.parent_path() / "tokenizer_config.json";
    impl_->backend = text::load_tokenizer_json(model.string(), config.string());
  } else {
    impl_->backend = text::load_sentencepiece(model.string());
  }
}

Tokenizer::~Tokenizer() = default;

std::vector<int64_t> Tokenizer::encode(const std::string& text) const { return impl_->backend->encode(text); }

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  for (const int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      throw std::invalid_argument("id " + std::to_string(id) + " is outside the tokenizer's vocabulary of " +
                                  std::to_string(vocab_size()));
    }
  }
  return impl_->backend->decode(ids);
}

int64_t Tokenizer::vocab_size() const { return impl_->backend->vocab_size(); }
std::optional<int64_t> Tokenizer::bos_id() const { return impl_->backend->bos_id(); }
std::optional<int64_t> Tokenizer::eos_id() const { return impl_->backend->eos_id(); }

// A window of ids is decoded with the ids before them (SentencePiece drops the space of a text's
// first piece, so an id decoded alone may lose it), and what the window adds to the text of its
// first ids is the new text. Where the text ends in U+FFFD, bytes that are not UTF-8 yet, the last
// ids may still complete a character: a character's bytes before its last are at most 3, from the
// last 3 ids that give bytes at most, so the text of the ids before those is final where it begins
// the whole text (where it does not, an id boundary there cuts a character: a few earlier ones are
// tried). So bytes that no id can complete (a model that repeats a continuation byte) are sent as
// U+FFFD, as decode() gives them, 3 ids later, not held to the end. (Ids whose every boundary cuts a
// character, as a run of tokens each ending inside a CJK character could, are still held until one
// does not.)
TextStream::TextStream(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}

std::string TextStream::push(int64_t id) {
  ids_.push_back(id);
  auto starts_with = [](const std::string& text, const std::string& start) {
    return text.size() >= start.size() && text.compare(0, start.size(), start) == 0;
  };
  std::string text = tokenizer_.decode(ids_);
  static const std::string replacement = "\xEF\xBF\xBD";
  size_t end = ids_.size();  // the window's ids whose text is final: ids_[read_, end)
  if (text.size() >= 3 && text.compare(text.size() - 3, 3, replacement) == 0) {
    for (int giving = 0; end > read_ && giving < 3; --end) {
      giving += !tokenizer_.decode({ids_[end - 1]}).empty();  // (special ids give no bytes)
    }
    std::string final_text;
    for (int tries = 0;; --end, ++tries) {
      if (end == read_ || tries == 4) return {};
      final_text = tokenizer_.decode({ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(end)});
      if (starts_with(text, final_text)) break;
    }
    text = std::move(final_text);
  }
  if (text.size() <= prefix_.size() || !starts_with(text, prefix_)) return {};
  std::string added = text.substr(prefix_.size());
  // the next window: the ids not yet in the text's prefix before this push, up to end
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(read_));
  read_ = end - read_;
  prefix_ = tokenizer_.decode({ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(read_)});
  return added;
}

std::string TextStream::finish() {
  const std::string text = tokenizer_.decode(ids_);
  std::string rest = text.compare(0, prefix_.size(), prefix_) == 0 ? text.substr(prefix_.size()) : text;
  ids_.clear();
  read_ = 0;
  prefix_.clear();
  return rest;
}

}  // namespace customops
