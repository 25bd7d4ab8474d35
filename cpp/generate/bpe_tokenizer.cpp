// A tokenizer.json of byte-level BPE (Llama-3, Qwen2/Qwen3, Mistral-Nemo, GPT-2), read as Hugging
// Face's tokenizers library encodes and decodes it: added and special tokens matched first
// (leftmost-longest, before normalization or after it as each says), the normalizer (Unicode
// normalization forms, through utf8proc), the pre-tokenizers (regex splits through PCRE2 in its
// Unicode mode, digits, ByteLevel's byte-to-character map), then the BPE merges, lowest rank first.
// JSON through nlohmann-json. utf8_lossy is here too: the decoder's last step, and the streaming
// decoder's test for a complete character.
#include "generate/text_backend.h"
#include "generate/utf8.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#ifdef CUSTOMOPS_WITH_TOKENIZER_JSON
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>
#endif

namespace customops::text {

std::string utf8_lossy(const std::string& bytes) {
  static const std::string replacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Well-formed sequences (Unicode Table 3-7): the length, and the range of the second byte.
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      lo = c == 0xE0 ? 0xA0 : 0x80;
      hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      lo = c == 0xF0 ? 0x90 : 0x80;
      hi = c == 0xF4 ? 0x8F : 0xBF;
    }
    size_t k = 1;  // bytes of the sequence that are well-formed so far
    if (len) {
      if (i + 1 < n && p[i + 1] >= lo && p[i + 1] <= hi) {
        k = 2;
        while (k < len && i + k < n && p[i + k] >= 0x80 && p[i + k] <= 0xBF) ++k;
      }
    }
    if (len && k == len) {
      out.append(bytes, i, len);
    } else {
      out += replacement;  // the maximal ill-formed subpart, one U+FFFD
    }
    i += k;
  }
  return out;
}

#ifndef CUSTOMOPS_WITH_TOKENIZER_JSON

bool tokenizer_json_available() { return false; }

std::unique_ptr<Backend> load_tokenizer_json(const std::string&, const std::string&) {
  throw std::runtime_error(
      "this build of customops reads no tokenizer.json: nlohmann-json, PCRE2 or utf8proc was not found when it "
      "was built (Debian: apt-get install nlohmann-json3-dev libpcre2-dev libutf8proc-dev, then rebuild)");
}

#else

bool tokenizer_json_available() { return true; }

namespace {

using json = nlohmann::json;

// The UTF-8 length of the character starting with byte c (1 for a byte that starts none).
size_t char_length(unsigned char c) { return c < 0xC0 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

// The code point of the character at text[i] (text is UTF-8).
uint32_t code_point(const std::string& text, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data()) + i;
  switch (char_length(p[0])) {
    case 1: return p[0];
    case 2: return (p[0] & 0x1Fu) << 6 | (p[1] & 0x3Fu);
    case 3: return (p[0] & 0x0Fu) << 12 | (p[1] & 0x3Fu) << 6 | (p[2] & 0x3Fu);
    default: return (p[0] & 0x07u) << 18 | (p[1] & 0x3Fu) << 12 | (p[2] & 0x3Fu) << 6 | (p[3] & 0x3Fu);
  }
}

// Unicode's White_Space property (Rust's char::is_whitespace, which an added token's lstrip and
// rstrip strip).
bool is_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The bytes of the whitespace character at text[i], or 0.
size_t whitespace_at(const std::string& text, size_t i) {
  return is_whitespace(code_point(text, i)) ? char_length(static_cast<unsigned char>(text[i])) : 0;
}

// The bytes of the whitespace character that ends at text[end], or 0.
size_t whitespace_before(const std::string& text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return whitespace_at(text, i) == end - i ? end - i : 0;
}

// GPT-2's map of the 256 bytes to printable characters (ByteLevel): a byte that is printable stays
// itself, the others take the code points from 256 on, in order.
struct ByteMap {
  std::string to_char[256];
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = utf8_of(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++));
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

// A compiled PCRE2 pattern (Unicode mode: \s, \p{L} and case-folding over all of Unicode, as the
// Oniguruma regexes of tokenizers), JIT-compiled where PCRE2 can.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                          &error, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      throw std::invalid_argument(where + ": its pre-tokenizer's regex does not compile at offset " +
                                  std::to_string(offset) + ": " + reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // (without JIT, matching still works)
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The [start, end) of every non-overlapping match in text, left to right (an empty match
  // advances one character).
  std::vector<std::pair<size_t, size_t>> matches(const std::string& text) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    for (size_t at = 0; at <= text.size();) {
      const int rc = pcre2_match(code_, subject, text.size(), at, PCRE2_NO_UTF_CHECK, data, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
      if (ov[1] > ov[0]) {
        out.emplace_back(ov[0], ov[1]);
        at = ov[1];
      } else {
        at = ov[0] + (ov[0] < text.size() ? char_length(static_cast<unsigned char>(text[ov[0]])) : 1);
      }
    }
    pcre2_match_data_free(data);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// How a split keeps what its pattern matches (tokenizers' SplitDelimiterBehavior).
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// pieces split at the matches of re, as behavior keeps them (invert: the matches are the content
// and what lies between them the delimiters).
std::vector<std::string> split(const std::string& text, const Regex& re, Behavior behavior, bool invert) {
  struct Segment {
    size_t start, end;
    bool delimiter;
  };
  std::vector<Segment> segments;
  size_t at = 0;
  for (auto [s, e] : re.matches(text)) {
    if (s > at) segments.push_back({at, s, invert});
    segments.push_back({s, e, !invert});
    at = e;
  }
  if (at < text.size()) segments.push_back({at, text.size(), invert});
  std::vector<std::string> out;
  std::string pending;  // MergedWithNext: delimiters waiting for what follows
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& g = segments[i];
    const std::string piece = text.substr(g.start, g.end - g.start);
    if (!g.delimiter) {
      out.push_back(pending + piece);
      pending.clear();
      continue;
    }
    switch (behavior) {
      case Behavior::Removed:
        break;
      case Behavior::Isolated:
        out.push_back(piece);
        break;
      case Behavior::MergedWithPrevious:
        if (!out.empty() && i > 0 && !segments[i - 1].delimiter) {
          out.back() += piece;
        } else {
          out.push_back(piece);
        }
        break;
      case Behavior::MergedWithNext:
        pending += piece;
        break;
      case Behavior::Contiguous:
        if (!out.empty() && i > 0 && segments[i - 1].delimiter) {
          out.back() += piece;
        } else {
          out.push_back(piece);
        }
        break;
    }
  }
  if (!pending.empty()) out.push_back(pending);
  return out;
}

// A step of the pre-tokenizer: one piece in, its pieces out.
struct PreStep {
  enum Kind { Split, ByteLevel } kind = Split;
  std::unique_ptr<Regex> re;  // Split; ByteLevel with use_regex
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("tokenizer not found: " + path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string regex_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

// GPT-2's pre-tokenizer regex, which ByteLevel applies with use_regex.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, lstrip, rstrip, single_word, normalized;
};

class ByteLevelBpe final : public Backend {
 public:
  ByteLevelBpe(const std::string& path, const std::string& config_path) : path_(path) {
    json doc;
    try {
      doc = json::parse(read_file(path));
    } catch (const json::exception& e) {
      throw std::invalid_argument(path + " is not a tokenizer.json (" + e.what() + ")");
    }
    if (!doc.is_object() || !doc.contains("model")) throw std::invalid_argument(path + " is not a tokenizer.json (no model)");
    read_model(doc["model"]);
    read_normalizer(doc.value("normalizer", json()));
    read_pre_tokenizer(doc.value("pre_tokenizer", json()));
    const json decoder = doc.value("decoder", json());
    if (!byte_level_ || (!decoder.is_null() && !has_type(decoder, "ByteLevel"))) {
      throw std::invalid_argument(path + " is not a byte-level BPE tokenizer (its pre-tokenizer or decoder is not "
                                  "ByteLevel); customops reads byte-level BPE tokenizer.json files (Llama-3, Qwen2, "
                                  "Qwen3, Mistral-Nemo, GPT-2) and SentencePiece models");
    }
    for (const auto& t : doc.value("added_tokens", json::array())) {
      AddedToken a{t.at("id").get<int64_t>(), t.at("content").get<std::string>(), t.value("special", false),
                   t.value("lstrip", false), t.value("rstrip", false), t.value("single_word", false),
                   t.value("normalized", false)};
      if (a.content.empty()) continue;
      if (a.id >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(a.id + 1);
      id_to_token_[a.id] = a.content;
      added_ids_[a.content] = a.id;
      if (a.special) special_.insert(a.id);
      added_.push_back(std::move(a));
    }
    // longest first, so that at a position the longest added token wins (leftmost-longest)
    std::sort(added_.begin(), added_.end(), [](const AddedToken& x, const AddedToken& y) {
      return x.content.size() > y.content.size();
    });
    if (!config_path.empty()) read_config(config_path);
  }

  std::vector<int64_t> encode(const std::string& input) const override {
    const std::string text = utf8_lossy(input);  // (a Python str is always UTF-8; a C++ string need not be)
    std::vector<int64_t> ids;
    // added tokens that are matched before normalization, then those matched after it
    for (const auto& [piece, id] : split_added(text, /*normalized=*/false)) {
      if (id >= 0) {
        ids.push_back(id);
        continue;
      }
      for (const auto& [sub, sub_id] : split_added(normalize(piece), /*normalized=*/true)) {
        if (sub_id >= 0) {
          ids.push_back(sub_id);
        } else {
          for (const std::string& word : pre_tokenize(sub)) bpe(word, ids);
        }
      }
    }
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    const ByteMap& map = byte_map();
    std::string bytes;
    for (const int64_t id : ids) {
      if (special_.count(id)) continue;
      const std::string& token = id_to_token_[static_cast<size_t>(id)];
      // ByteLevel's decoder: a token whose every character is in the byte map gives those bytes,
      // any other its own UTF-8
      std::string mapped;
      bool all = true;
      for (size_t i = 0; i < token.size() && all;) {
        const size_t n = char_length(static_cast<unsigned char>(token[i]));
        auto it = map.to_byte.find(token.substr(i, n));
        if (it == map.to_byte.end()) {
          all = false;
        } else {
          mapped += static_cast<char>(it->second);
        }
        i += n;
      }
      bytes += all ? mapped : token;
    }
    return utf8_lossy(bytes);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int64_t> bos_id() const override { return bos_; }
  std::optional<int64_t> eos_id() const override { return eos_; }

 private:
  static bool has_type(const json& j, const std::string& type) {
    if (j.is_null()) return false;
    if (j.value("type", "") == type) return true;
    if (j.value("type", "") == "Sequence") {
      for (const auto& step : j.value("decoders", json::array())) {
        if (has_type(step, type)) return true;
      }
    }
    return false;
  }

  void refuse(const std::string& what) const {
    throw std::invalid_argument(path_ + ": its " + what + " is one customops does not implement (it reads byte-level "
                                "BPE tokenizer.json files: Llama-3, Qwen2, Qwen3, Mistral-Nemo, GPT-2)");
  }

  void read_model(const json& model) {
    const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
    if (type != "BPE") refuse("model (" + (type.empty() ? std::string("unknown") : type) + ")");
    if (model.value("byte_fallback", false)) refuse("model's byte_fallback");
    if (!model.value("continuing_subword_prefix", json()).is_null() &&
        !model["continuing_subword_prefix"].get<std::string>().empty()) {
      refuse("model's continuing_subword_prefix");
    }
    if (!model.value("end_of_word_suffix", json()).is_null() && !model["end_of_word_suffix"].get<std::string>().empty()) {
      refuse("model's end_of_word_suffix");
    }
    ignore_merges_ = model.value("ignore_merges", false);
    for (const auto& [token, id] : model.at("vocab").items()) {
      const int64_t i = id.get<int64_t>();
      vocab_[token] = i;
      if (i >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(i + 1);
      id_to_token_[i] = token;
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = vocab_.find(model["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_ = it->second;
    }
    int32_t rank = 0;
    for (const auto& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ', 1);
        if (space == std::string::npos) throw std::invalid_argument(path_ + ": a merge is not two tokens: " + s);
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || im == vocab_.end()) {
        throw std::invalid_argument(path_ + ": the merge '" + a + " " + b + "' names a token its vocabulary lacks");
      }
      merges_.emplace(key(ia->second, ib->second), std::make_pair(rank++, static_cast<int32_t>(im->second)));
    }
  }

  void read_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = n.value("type", "");
    if (type == "Sequence") {
      for (const auto& step : n.value("normalizers", json::array())) read_normalizer(step);
    } else if (type == "NFC") {
      normalizers_.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    } else if (type == "NFD") {
      normalizers_.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
    } else if (type == "NFKC") {
      normalizers_.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    } else if (type == "NFKD") {
      normalizers_.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
    } else {
      refuse("normalizer (" + type + ")");
    }
  }

  void read_pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      for (const auto& step : p.value("pretokenizers", json::array())) read_pre_tokenizer(step);
      return;
    }
    PreStep step;
    if (type == "ByteLevel") {
      step.kind = PreStep::ByteLevel;
      step.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) step.re = std::make_unique<Regex>(kGpt2Pattern, path_);
      byte_level_ = true;
    } else if (type == "Split") {
      const json& pattern = p.at("pattern");
      const std::string re = pattern.contains("Regex") ? pattern["Regex"].get<std::string>()
                                                       : regex_escape(pattern.at("String").get<std::string>());
      step.re = std::make_unique<Regex>(re, path_);
      step.invert = p.value("invert", false);
      const std::string behavior = p.value("behavior", "Isolated");
      static const std::unordered_map<std::string, Behavior> behaviors = {
          {"Removed", Behavior::Removed}, {"Isolated", Behavior::Isolated},
          {"MergedWithPrevious", Behavior::MergedWithPrevious}, {"MergedWithNext", Behavior::MergedWithNext},
          {"Contiguous", Behavior::Contiguous}};
      auto it = behaviors.find(behavior);
      if (it == behaviors.end()) refuse("pre-tokenizer's split behavior (" + behavior + ")");
      step.behavior = it->second;
    } else if (type == "Digits") {
      const bool each = p.value("individual_digits", false);
      step.re = std::make_unique<Regex>(R"(\p{N})", path_);
      step.behavior = each ? Behavior::Isolated : Behavior::Contiguous;
    } else {
      refuse("pre-tokenizer (" + type + ")");
    }
    pre_.push_back(std::move(step));
  }

  // bos and eos from tokenizer_config.json ("bos_token": "<s>" or {"content": "<s>", ...}).
  void read_config(const std::string& config_path) {
    json config;
    try {
      config = json::parse(read_file(config_path));
    } catch (const json::exception& e) {
      throw std::invalid_argument(config_path + " is not a tokenizer_config.json (" + e.what() + ")");
    }
    auto token_id = [&](const char* key) -> std::optional<int64_t> {
      if (!config.contains(key)) return std::nullopt;
      const json& t = config[key];
      const std::string content = t.is_string() ? t.get<std::string>() : t.is_object() ? t.value("content", "") : "";
      if (auto it = added_ids_.find(content); it != added_ids_.end()) return it->second;
      if (auto it = vocab_.find(content); it != vocab_.end()) return it->second;
      return std::nullopt;
    };
    bos_ = token_id("bos_token");
    eos_ = token_id("eos_token");
  }

  std::string normalize(const std::string& text) const {
    std::string s = text;
    for (const int options : normalizers_) {
      utf8proc_uint8_t* out = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                              static_cast<utf8proc_ssize_t>(s.size()), &out,
                                              static_cast<utf8proc_option_t>(options));
      if (n < 0) throw std::invalid_argument(std::string("cannot normalize the text: ") + utf8proc_errmsg(n));
      s.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
      std::free(out);
    }
    return s;
  }

  // text cut at the added tokens matched at this stage (normalized: those with normalized=true,
  // on normalized text; else the others, on the raw text), leftmost-longest: (piece, -1) for text
  // between them, ("", id) for a token. lstrip/rstrip take the whitespace beside a token with it;
  // single_word takes a token only where no word character touches it.
  std::vector<std::pair<std::string, int64_t>> split_added(const std::string& text, bool normalized) const {
    std::vector<std::pair<std::string, int64_t>> out;
    size_t start = 0;  // of the text not yet taken
    auto word = [&](size_t at) {
      const unsigned char c = static_cast<unsigned char>(text[at]);
      return c >= 0x80 || std::isalnum(c) || c == '_';
    };
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      for (const AddedToken& a : added_) {
        if (a.normalized != normalized || a.content.size() > text.size() - i) continue;
        if (text.compare(i, a.content.size(), a.content) != 0) continue;
        const size_t end = i + a.content.size();
        if (a.single_word && ((i > 0 && word(i - 1)) || (end < text.size() && word(end)))) continue;
        hit = &a;
        break;
      }
      if (!hit) {
        i += char_length(static_cast<unsigned char>(text[i]));
        continue;
      }
      size_t from = i, to = i + hit->content.size();
      if (hit->lstrip) {
        for (size_t n; from > start && (n = whitespace_before(text, from)) > 0;) from -= n;
      }
      if (hit->rstrip) {
        for (size_t n; to < text.size() && (n = whitespace_at(text, to)) > 0;) to += n;
      }
      if (from > start) out.emplace_back(text.substr(start, from - start), -1);
      out.emplace_back(std::string(), hit->id);
      start = i = to;
    }
    if (start < text.size()) out.emplace_back(text.substr(start), -1);
    return out;
  }

  std::vector<std::string> pre_tokenize(const std::string& text) const {
    std::vector<std::string> pieces = {text};
    const ByteMap& map = byte_map();
    for (const PreStep& step : pre_) {
      std::vector<std::string> next;
      for (std::string& piece : pieces) {
        if (step.kind == PreStep::ByteLevel) {
          if (step.add_prefix_space && !piece.empty() && piece[0] != ' ') piece.insert(0, " ");
          std::vector<std::string> parts = step.re ? split(piece, *step.re, Behavior::Isolated, false)
                                                   : std::vector<std::string>{piece};
          for (const std::string& part : parts) {
            std::string mapped;
            for (const char c : part) mapped += map.to_char[static_cast<unsigned char>(c)];
            next.push_back(std::move(mapped));
          }
        } else {
          for (std::string& part : split(piece, *step.re, step.behavior, step.invert)) next.push_back(std::move(part));
        }
      }
      pieces = std::move(next);
    }
    return pieces;
  }

  static uint64_t key(int64_t a, int64_t b) { return static_cast<uint64_t>(a) << 32 | static_cast<uint32_t>(b); }

  // The ids of one pre-token (byte-level characters), appended to ids: its characters' ids, merged
  // pair by pair, the lowest rank first (the leftmost of equal ones), as tokenizers' Word does.
  void bpe(const std::string& word, std::vector<int64_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      if (auto it = vocab_.find(word); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (auto it = cache_.find(word); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    struct Symbol {
      int32_t id, prev, next;
    };
    std::vector<Symbol> s;
    for (size_t i = 0; i < word.size();) {
      const size_t n = char_length(static_cast<unsigned char>(word[i]));
      auto it = vocab_.find(word.substr(i, n));
      if (it != vocab_.end()) {
        s.push_back({static_cast<int32_t>(it->second), static_cast<int32_t>(s.size()) - 1, -1});
      } else if (unk_) {
        s.push_back({static_cast<int32_t>(*unk_), static_cast<int32_t>(s.size()) - 1, -1});
      }
      i += n;
    }
    for (size_t i = 0; i + 1 < s.size(); ++i) s[i].next = static_cast<int32_t>(i + 1);
    using Pair = std::pair<int32_t, int32_t>;  // (rank, position of the left symbol)
    std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> heap;
    auto push = [&](int32_t left) {
      if (left < 0 || s[left].next < 0) return;
      auto it = merges_.find(key(s[left].id, s[s[left].next].id));
      if (it != merges_.end()) heap.emplace(it->second.first, left);
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(s.size()); ++i) push(i);
    std::vector<bool> gone(s.size(), false);
    while (!heap.empty()) {
      const auto [rank, left] = heap.top();
      heap.pop();
      if (gone[left] || s[left].next < 0) continue;
      const int32_t right = s[left].next;
      auto it = merges_.find(key(s[left].id, s[right].id));
      if (it == merges_.end() || it->second.first != rank) continue;  // stale: the pair changed since
      s[left].id = it->second.second;
      gone[right] = true;
      s[left].next = s[right].next;
      if (s[left].next >= 0) s[s[left].next].prev = left;
      push(s[left].prev);
      push(left);
    }
    std::vector<int64_t> out;
    for (int32_t i = s.empty() ? -1 : 0; i >= 0; i = s[i].next) out.push_back(s[i].id);
    ids.insert(ids.end(), out.begin(), out.end());
    if (word.size() <= 256) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() < 100000) cache_.emplace(word, std::move(out));
    }
  }

  std::string path_;
  std::unordered_map<std::string, int64_t> vocab_, added_ids_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left, right) -> (rank, merged id)
  std::optional<int64_t> unk_, bos_, eos_;
  bool ignore_merges_ = false, byte_level_ = false;
  std::vector<int> normalizers_;  // utf8proc options, in order
  std::vector<PreStep> pre_;
  std::vector<AddedToken> added_;
  std::unordered_set<int64_t> special_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Backend> load_tokenizer_json(const std::string& path, const std::string& config_path) {
  return std::make_unique<ByteLevelBpe>(path, config_path);
}

#endif

}  // namespace customops::text
