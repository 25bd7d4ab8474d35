// customops-run serve: an OpenAI-compatible HTTP server over a causal-LM package, with no Python.
// customops::Engine batches the requests continuously over the package's KV slots;
// customops::Tokenizer and customops::ChatTemplate turn text and conversations into ids; cpp-httplib
// serves HTTP (its thread pool: one thread a connection) and nlohmann-json reads and writes JSON.
//
// Endpoints, shaped as OpenAI's and llama-server's: POST /v1/completions, POST /v1/chat/completions
// (both with "stream": true as server-sent events ending in "data: [DONE]"), GET /v1/models,
// GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize. A bad request gets
// OpenAI's error JSON ({"error": {"message", "type", "param", "code"}}) with 400 (401 without the
// API key, 404 for an unknown path, 413 for a body over --max-body), never a crash. A client that
// goes away, mid-stream or while it waits for a whole answer, cancels its request, which frees its
// slot at the engine's next step.
#include "runner/runner.h"

#ifdef CUSTOMOPS_WITH_SERVE
#include <customops/chat_template.h>
#include <customops/engine.h>
#include <customops/generate.h>
#include <customops/tokenizer.h>
#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace customops::runner {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr const char* kServeUsage = R"(usage: customops-run serve PACKAGE.pt2 [--tokenizer PATH] [options]

Serves a causal-LM package (customops.export.package_causal_lm) over HTTP, as OpenAI's API and
llama.cpp's llama-server shape it: POST /v1/completions and /v1/chat/completions (streaming with
"stream": true), GET /v1/models, /health and /metrics, POST /tokenize and /detokenize. Requests are
batched continuously over the package's KV cache slots (its max_batch). Stops on SIGINT or SIGTERM
(at once while the package loads).

  --tokenizer PATH       a folder written by save_pretrained (tokenizer.json or tokenizer.model,
                         and tokenizer_config.json: its chat template, bos and eos tokens), or a
                         tokenizer.json / tokenizer.model (then chat needs --chat-template);
                         default: the one the package embeds (package_causal_lm(..., tokenizer=))
  --chat-template FILE   the chat template (Jinja) to use instead of the tokenizer folder's
  --host HOST            the address to listen on (default: 127.0.0.1)
  --port N               the port (default: 8000; 0: any free port, printed at startup)
  --api-key KEY          require "Authorization: Bearer KEY" on /v1/ and the token endpoints
  --model-name NAME      the model's name in the API (default: the package's file name, no .pt2)
  --max-batch N          requests decoding together, at most the package's max_batch (default: it)
  --token-budget N       tokens a step computes at most, prompt chunks included (default: 2048)
  --prefill-multiple N   pad prompt chunks to a multiple of N tokens, each such shape run once at
                         startup (default: 64 on CUDA, 1 on the CPU)
  --max-body BYTES       the largest request body (default: 8388608); larger ones get 413
  --threads N            connections served at once (default: 64)
  --device DEVICE        cpu, cuda or cuda:N (default: the package's device, index 0)
  --no-cuda-graph        CUDA: launch every kernel of every decode step
  -h, --help             print this help
)";

struct ServeOptions {
  std::string package, tokenizer, chat_template, host = "127.0.0.1", api_key, model_name, device;
  int port = 8000;
  int64_t max_batch = 0, token_budget = 2048, max_body = 8 << 20, threads = 64, prefill_multiple = 0;
  bool cuda_graph = true;
};

ServeOptions parse_serve_args(int argc, char** argv) {
  ServeOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << kServeUsage;
      std::exit(0);
    }
    if (a == "--no-cuda-graph") {
      o.cuda_graph = false;
      continue;
    }
    if (a.rfind("--", 0) != 0) {
      if (!o.package.empty()) throw UsageError("serve takes one package; " + runner::quoted(a) + " is a second");
      o.package = a;
      continue;
    }
    if (i + 1 >= argc) throw UsageError(a + " expects a value");
    const char* v = argv[++i];
    if (a == "--tokenizer") {
      o.tokenizer = v;
    } else if (a == "--chat-template") {
      o.chat_template = v;
    } else if (a == "--host") {
      o.host = v;
    } else if (a == "--port") {
      o.port = static_cast<int>(parse_integer(a, v, 0, 65535));
    } else if (a == "--api-key") {
      o.api_key = v;
    } else if (a == "--model-name") {
      o.model_name = v;
    } else if (a == "--max-batch") {
      o.max_batch = parse_integer(a, v, 1);
    } else if (a == "--token-budget") {
      o.token_budget = parse_integer(a, v, 1);
    } else if (a == "--prefill-multiple") {
      o.prefill_multiple = parse_integer(a, v, 1);
    } else if (a == "--max-body") {
      o.max_body = parse_integer(a, v, 1);
    } else if (a == "--threads") {
      o.threads = parse_integer(a, v, 1, 4096);  // (each a thread, made when listening starts)
    } else if (a == "--device") {
      o.device = v;
    } else {
      throw UsageError("unknown option " + runner::quoted(a) + " (customops-run serve --help lists them)");
    }
  }
  if (o.package.empty()) throw UsageError("serve needs a package (customops-run serve --help)");
  if (o.model_name.empty()) o.model_name = fs::path(o.package).stem().string();
  return o;
}

// ---- what the tokenizer folder says ------------------------------------------------------------

json read_json(const fs::path& path) {
  std::ifstream in(path);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw UserError(path.string() + " is not valid JSON");
  return j;
}

// A special token of tokenizer_config.json: "<s>", or {"content": "<s>", ...}; empty where none.
std::string token_text(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"];
  return "";
}

struct TextSetup {
  std::optional<std::string> chat_template;  // none: the model has none (chat is refused)
  std::string bos, eos;                      // the template's bos_token and eos_token
  bool add_bos = false;                      // whether a completion's prompt starts with bos
};

// The chat template, its special tokens, and whether prompts get bos, as transformers reads them
// from a save_pretrained folder: tokenizer_config.json's chat_template (or the chat_template.jinja
// beside it, as newer transformers saves it); bos where add_bos_token says so, else where
// tokenizer.json's post-processor writes the bos token (Llama-3), and always before a
// SentencePiece tokenizer.model's prompt (Llama-2, Mistral).
TextSetup read_text_setup(const ServeOptions& o) {
  TextSetup t;
  const fs::path path(o.tokenizer);
  const bool folder = fs::is_directory(path);
  const fs::path dir = folder ? path : path.parent_path();
  json config = json::object();
  if (folder && fs::exists(dir / "tokenizer_config.json")) config = read_json(dir / "tokenizer_config.json");
  t.bos = token_text(config, "bos_token");
  t.eos = token_text(config, "eos_token");
  const bool sentencepiece = folder ? !fs::exists(dir / "tokenizer.json") : path.extension() == ".model";
  if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean()) {
    t.add_bos = config["add_bos_token"].get<bool>();
  } else if (sentencepiece) {
    t.add_bos = true;
  } else if (!t.bos.empty()) {
    const fs::path tj = folder ? dir / "tokenizer.json" : path;
    const json post = read_json(tj).value("post_processor", json());
    t.add_bos = !post.is_null() && post.dump().find(json(t.bos).dump()) != std::string::npos;
  }
  if (!o.chat_template.empty()) {
    std::ifstream in(o.chat_template);
    if (!in) throw UserError("cannot read the chat template " + runner::quoted(o.chat_template));
    t.chat_template = std::string(std::istreambuf_iterator<char>(in), {});
  } else if (config.contains("chat_template")) {
    const json& c = config["chat_template"];
    if (c.is_string()) {
      t.chat_template = c.get<std::string>();
    } else if (c.is_array()) {  // named templates: the "default" one
      for (const auto& named : c) {
        if (named.value("name", "") == "default" && named.contains("template")) t.chat_template = named["template"];
      }
    }
  } else if (folder && fs::exists(dir / "chat_template.jinja")) {
    std::ifstream in(dir / "chat_template.jinja");
    t.chat_template = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return t;
}

// ---- errors, as OpenAI words them ---------------------------------------------------------------

struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status, const std::string& message, std::string type, std::string param = "", std::string code = "")
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
};

ApiError bad_request(const std::string& message, const std::string& param = "") {
  return ApiError(400, message, "invalid_request_error", param);
}

json error_body(const std::string& message, const std::string& type, const std::string& param = "",
                const std::string& code = "") {
  return {{"error",
           {{"message", message}, {"type", type}, {"param", param.empty() ? json() : json(param)},
            {"code", code.empty() ? json() : json(code)}}}};
}

// The answer to a body over --max-body, whether its Content-Length said so or httplib found it.
json too_large() {
  return error_body("the request body is larger than the server takes (--max-body)", "invalid_request_error");
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// ---- request fields, checked ------------------------------------------------------------------

// The deepest nesting of arrays and objects in a JSON text (strings skipped). No request needs more
// than a few levels, and a deep value is what nlohmann's recursive copy and dump would overflow the
// stack on.
int json_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

json parse_body(const httplib::Request& req) {
  if (json_depth(req.body) > 32) throw bad_request("the request body nests arrays or objects deeper than 32 levels");
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw bad_request("the request body is not valid JSON");
  if (!body.is_object()) throw bad_request("the request body must be a JSON object");
  return body;
}

// A field that is absent or null reads as none.
const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<double> number_field(const json& body, const char* key, double lo, double hi) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw bad_request(std::string(key) + " must be a number", key);
  const double d = v->get<double>();
  if (!(d >= lo && d <= hi)) {
    std::ostringstream m;
    m << key << " must be in [" << lo << ", " << hi << "], not " << json(d).dump();  // (shortest exact form)
    throw bad_request(m.str(), key);
  }
  return d;
}

// A list of token ids (JSON integers), as int64; one past int64 (2^63 and up) is refused here,
// where it would otherwise wrap to a negative id.
std::vector<int64_t> id_list(const json& list, const char* key) {
  std::vector<int64_t> ids;
  ids.reserve(list.size());
  for (const json& v : list) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      throw bad_request(std::string(key) + " holds an id past any vocabulary (" + v.dump() + ")", key);
    }
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

std::optional<int64_t> int_field(const json& body, const char* key, int64_t lo) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) throw bad_request(std::string(key) + " must be an integer", key);
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    throw bad_request(std::string(key) + " is too large", key);
  }
  const int64_t i = v->get<int64_t>();
  if (i < lo) throw bad_request(std::string(key) + " must be at least " + std::to_string(lo), key);
  return i;
}

std::optional<bool> bool_field(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw bad_request(std::string(key) + " must be true or false", key);
  return v->get<bool>();
}

// ---- metrics ------------------------------------------------------------------------------------

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v, int64_t times = 1) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
    counts_[i] += times;
    sum_ += v * times;
    count_ += times;
  }
  void write(std::ostream& out, const std::string& name, const std::string& help) const {
    std::lock_guard<std::mutex> lock(mu_);
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
    int64_t cumulative = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
      cumulative += counts_[i];
      out << name << "_bucket{le=\"" << bounds_[i] << "\"} " << cumulative << "\n";
    }
    out << name << "_bucket{le=\"+Inf\"} " << count_ << "\n" << name << "_sum " << sum_ << "\n"
        << name << "_count " << count_ << "\n";
  }

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;
  double sum_ = 0;
  int64_t count_ = 0;
};

struct Metrics {
  std::atomic<int64_t> requests{0}, failed{0}, prompt_tokens{0}, generated_tokens{0};
  // generation requests ended, by why: stop (an eos or stop id, or a stop string), length,
  // cancelled (the client went away, or the server is stopping), error
  static constexpr const char* kEnds[] = {"stop", "length", "cancelled", "error"};
  std::atomic<int64_t> ended[4] = {};
  Histogram ttft{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram itl{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
  // the engine's part of the time to first token: waiting for a slot, then the prompt's prefill
  // (from its slot to its first id sampled)
  Histogram queue{{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram prefill{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}};
};

// ---- the client's connection ------------------------------------------------------------------
// cpp-httplib 0.11 (Debian 12's) gives a handler no handle on its connection, and tells it nothing
// of a client that went away until it writes; a request without "stream" writes only at its end.
// So that such a request stops when its client leaves, its handler finds the connection's socket
// among this process's open files by its two ends (httplib's own numbers for them) and watches it.

// An IP address's port; -1 for another kind of socket.
int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// An address's host as httplib writes Request::remote_addr and local_addr (getnameinfo's numeric form).
std::string host_of(const sockaddr_storage& a, socklen_t n) {
  char host[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), n, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) {
    return {};
  }
  return host;
}

// Whether fd is a socket connected from the request's client address and port to its local
// address and port: one connection has these four.
bool is_connection(int fd, const httplib::Request& req) {
  sockaddr_storage peer{}, self{};
  socklen_t np = sizeof peer, ns = sizeof self;
  return getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &np) == 0 &&
         getsockname(fd, reinterpret_cast<sockaddr*>(&self), &ns) == 0 && port_of(peer) == req.remote_port &&
         port_of(self) == req.local_port && host_of(peer, np) == req.remote_addr &&
         host_of(self, ns) == req.local_addr;
}

// The request's connection's socket; -1 where none is found (then the request is not watched). It
// stays this connection's while its handler runs (httplib closes it after). Each of httplib's
// threads serves one connection at a time, often many requests on it: the last one found is
// tried first, and the open files are read only where it is not this request's.
int connection_socket(const httplib::Request& req) {
  thread_local int last = -1;
  if (last >= 0 && is_connection(last, req)) return last;
  last = -1;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    struct stat st {};
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir) || fstat(static_cast<int>(fd), &st) != 0 ||
        !S_ISSOCK(st.st_mode)) {
      continue;
    }
    if (is_connection(static_cast<int>(fd), req)) {
      last = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return last;
}

// Whether the client closed its end of the connection, or the connection failed. Bytes it sent
// and nobody read yet (a pipelined request) do not hide a close. (A client that shuts down only its
// sending side while it waits for the answer counts as gone, as in newer cpp-httplib.)
bool client_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLERR | POLLHUP | POLLNVAL)) != 0;
}

// ---- text out, with stop strings ----------------------------------------------------------------

// The text of a request's ids as they come: whole characters (TextStream), cut before the first
// stop string, and holding back a tail that may be the start of one until the next ids show. An id
// past the tokenizer's vocabulary (a model's vocabulary is often padded past its tokenizer's) has
// no text.
class TextOut {
 public:
  TextOut(const Tokenizer& tokenizer, std::vector<std::string> stops)
      : stream_(tokenizer), stops_(std::move(stops)), vocab_(tokenizer.vocab_size()) {}
  // (each id's text is checked on its own, so that which stop string ends the text does not depend
  // on how the ids were grouped into updates)
  std::string push(const std::vector<int64_t>& ids) {
    std::string out;
    for (int64_t id : ids) {
      if (stopped_) break;
      ++taken_;
      if (id < vocab_) pending_ += stream_.push(id);
      out += release(false);
    }
    return out;
  }
  // The ids taken: up to the one that completed a stop string, where one did. (The engine may have
  // sampled more before the request was cancelled: no one's, and not counted.)
  int64_t taken() const { return taken_; }
  std::string finish() {
    if (!stopped_) pending_ += stream_.finish();
    return release(true);
  }
  bool stopped() const { return stopped_; }

 private:
  std::string release(bool final) {
    if (stopped_) return "";
    size_t cut = std::string::npos;
    for (const auto& s : stops_) cut = std::min(cut, pending_.find(s));
    std::string out;
    if (cut != std::string::npos) {
      stopped_ = true;
      out = pending_.substr(0, cut);
      pending_.clear();
      return out;
    }
    size_t keep = 0;
    if (!final) {
      for (const auto& s : stops_) {
        for (size_t k = std::min(s.size() - 1, pending_.size()); k > keep; --k) {
          if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
            keep = k;
            break;
          }
        }
      }
    }
    out = pending_.substr(0, pending_.size() - keep);
    pending_.erase(0, pending_.size() - keep);
    return out;
  }

  TextStream stream_;
  std::vector<std::string> stops_;
  int64_t vocab_;
  std::string pending_;
  int64_t taken_ = 0;
  bool stopped_ = false;
};

// ---- the server ---------------------------------------------------------------------------------

struct Job {
  bool chat = false;
  std::vector<int64_t> prompt;
  RequestOptions options;
  std::vector<std::string> stops;
  bool stream = false, include_usage = false;
};

class Server {
 public:
  Server(const ServeOptions& o, CausalLM& lm, Engine& engine, const Tokenizer& tokenizer, const TextSetup& text)
      : o_(o), lm_(lm), engine_(engine), tokenizer_(tokenizer), text_(text) {
    if (text.chat_template) {
      try {
        chat_ = std::make_unique<ChatTemplate>(*text.chat_template, text.bos, text.eos);
      } catch (const std::invalid_argument& e) {
        throw UserError("the chat template cannot be served: " + std::string(e.what()));
      }
    }
    created_ = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                   .count();
  }

  void routes(httplib::Server& http) {
    http.set_payload_max_length(static_cast<size_t>(o_.max_body));
    // httplib bounds a body by its Content-Length only: a chunked body, one without a length, or a
    // compressed one (which it inflates) could be any size. Refused before the body is read, and
    // so is every method but GET, HEAD and POST: httplib reads a PUT's, PATCH's or DELETE's body
    // before it finds no route for it (a chunked PUT of 300 MiB grew the server by 300 MiB). The
    // connection is closed after a refusal: its body, unread, is not a next request.
    // A POST's Content-Length is checked here too, so that a body over the limit is refused at once
    // (httplib reads such a body to skip it, until its read timeout where it never comes) and two
    // lengths, or one that is not a count, are refused (httplib takes the first; a proxy may take
    // another, and read the rest as a request of its own). So is a header name with white space
    // in it ("Transfer-Encoding : chunked"), which httplib keeps as another name.
    const size_t max_body = static_cast<size_t>(o_.max_body);
    http.set_pre_routing_handler([max_body](const httplib::Request& req, httplib::Response& res) {
      if (req.method == "GET" || req.method == "HEAD") return httplib::Server::HandlerResponse::Unhandled;
      const std::string length = req.get_header_value("Content-Length");
      const bool spaced = std::any_of(req.headers.begin(), req.headers.end(), [](const auto& h) {
        return h.first.find_first_of(" \t") != std::string::npos;
      });
      if (req.method != "POST") {
        send_json(res, 405, error_body("method " + runner::quoted(req.method) + " is not allowed (GET, HEAD and POST are)",
                                       "invalid_request_error"));
        res.set_header("Allow", "GET, HEAD, POST");
      } else if (spaced) {
        send_json(res, 400, error_body("a header's name holds white space", "invalid_request_error"));
      } else if (req.has_header("Content-Encoding") &&
                 (req.get_header_value_count("Content-Encoding") > 1 || req.get_header_value("Content-Encoding") != "identity")) {
        send_json(res, 415, error_body("compressed request bodies are not accepted", "invalid_request_error"));
      } else if (req.has_header("Transfer-Encoding") || !req.has_header("Content-Length")) {
        send_json(res, 411, error_body("a request body needs a Content-Length (chunked bodies are not accepted)",
                                       "invalid_request_error"));
      } else if (req.get_header_value_count("Content-Length") > 1 || length.empty() ||
                 length.find_first_not_of("0123456789") != std::string::npos) {
        send_json(res, 400, error_body("Content-Length must be given once, as a count of bytes", "invalid_request_error"));
      } else if (length.size() > 18 || std::stoull(length) > max_body) {
        send_json(res, 413, too_large());
      } else {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    });
    http.Post("/v1/completions", [this](const auto& req, auto& res) { handle(req, res, [&] { generate(req, res, false); }); });
    http.Post("/v1/chat/completions", [this](const auto& req, auto& res) { handle(req, res, [&] { generate(req, res, true); }); });
    http.Get("/v1/models", [this](const auto& req, auto& res) { handle(req, res, [&] { models(res); }); });
    http.Post("/tokenize", [this](const auto& req, auto& res) { handle(req, res, [&] { tokenize(req, res); }); });
    http.Post("/detokenize", [this](const auto& req, auto& res) { handle(req, res, [&] { detokenize(req, res); }); });
    http.Get("/health", [](const auto&, auto& res) { send_json(res, 200, {{"status", "ok"}}); });
    http.Get("/metrics", [this](const auto&, auto& res) { res.set_content(metrics(), "text/plain; version=0.0.4"); });
    // statuses httplib sets itself (404 for an unknown path, 413 for an oversized body, 400 for
    // a malformed request line) get OpenAI's error body too
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 404) {
        send_json(res, 404, error_body("no such endpoint: " + req.method + " " + req.path, "invalid_request_error"));
      } else if (res.status == 413) {
        send_json(res, 413, too_large());
      } else {
        send_json(res, res.status, error_body("the request failed with HTTP status " + std::to_string(res.status),
                                              "invalid_request_error"));
      }
    });
  }

 private:
  // Runs a handler: checks the API key, and turns what it throws into an error response.
  template <typename F>
  void handle(const httplib::Request& req, httplib::Response& res, F&& f) {
    try {
      if (!o_.api_key.empty() && req.get_header_value("Authorization") != "Bearer " + o_.api_key) {
        throw ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)", "invalid_request_error", "",
                       "invalid_api_key");
      }
      f();
    } catch (const ApiError& e) {
      if (e.status >= 500) ++metrics_.failed;
      send_json(res, e.status, error_body(e.what(), e.type, e.param, e.code));
    } catch (const std::invalid_argument& e) {  // the engine's and tokenizer's checks of what came
      send_json(res, 400, error_body(e.what(), "invalid_request_error"));
    } catch (const json::exception& e) {  // a value of a type a check above did not foresee
      send_json(res, 400, error_body(std::string("the request has a value of the wrong type: ") + e.what(),
                                     "invalid_request_error"));
    } catch (const EngineStopped& e) {  // the server is stopping
      send_json(res, 503, error_body(e.what(), "server_error"));
    } catch (const std::exception& e) {
      ++metrics_.failed;
      send_json(res, 500, error_body(message_of(e), "server_error"));
    }
  }

  void check_model(const json& body) {
    const json* m = field(body, "model");
    if (!m) return;
    if (!m->is_string()) throw bad_request("model must be a string", "model");
    if (m->get<std::string>() != o_.model_name) {
      throw ApiError(400, "the model " + runner::quoted(m->get<std::string>()) + " is not served here; this server serves " +
                              runner::quoted(o_.model_name), "invalid_request_error", "model", "model_not_found");
    }
  }

  // Fields of OpenAI's API this server does not implement: refused where they ask for something.
  static void refuse_unsupported(const json& body) {
    auto refuse = [](const char* key, const std::string& what) {
      throw bad_request(std::string(key) + " is not supported (" + what + ")", key);
    };
    if (const json* n = field(body, "n"); n && *n != 1) refuse("n", "one choice a request");
    if (const json* b = field(body, "best_of"); b && *b != 1) refuse("best_of", "one choice a request");
    if (const json* e = field(body, "echo"); e && *e != false) refuse("echo", "the prompt is not returned");
    if (const json* l = field(body, "logprobs"); l && *l != false) refuse("logprobs", "no log probabilities");
    if (field(body, "top_logprobs")) refuse("top_logprobs", "no log probabilities");
    if (const json* s = field(body, "suffix"); s && *s != "") refuse("suffix", "no insertion");
    for (const char* p : {"presence_penalty", "frequency_penalty"}) {
      if (const json* v = field(body, p); v && (!v->is_number() || v->get<double>() != 0)) refuse(p, "no penalties");
    }
    if (const json* b = field(body, "logit_bias"); b && !b->empty()) refuse("logit_bias", "no logit bias");
    for (const char* t : {"tools", "functions"}) {
      if (const json* v = field(body, t); v && !v->empty()) refuse(t, "no tool calls");
    }
    if (const json* f = field(body, "response_format");
        f && !(f->is_object() && f->contains("type") && (*f)["type"] == "text")) {
      refuse("response_format", "text only");
    }
  }

  // The prompt ids of a completions request: a string (tokenized, after bos where the tokenizer
  // puts one), a list of one string, or a list of ids.
  std::vector<int64_t> completion_prompt(const json& body) {
    const json* p = field(body, "prompt");
    if (!p) throw bad_request("prompt is required", "prompt");
    const json& prompt = p->is_array() && p->size() == 1 && (*p)[0].is_string() ? (*p)[0] : *p;
    if (prompt.is_string()) {
      std::vector<int64_t> ids = tokenizer_.encode(prompt.get<std::string>());
      if (text_.add_bos) {
        if (auto bos = lm_.bos_token_id() ? lm_.bos_token_id() : tokenizer_.bos_id()) ids.insert(ids.begin(), *bos);
      }
      if (ids.empty()) throw bad_request("the prompt is empty", "prompt");
      return ids;
    }
    if (prompt.is_array() && !prompt.empty() && std::all_of(prompt.begin(), prompt.end(), [](const json& v) {
          return v.is_number_integer();
        })) {
      return id_list(prompt, "prompt");
    }
    if (prompt.is_array() && prompt.size() > 1) throw bad_request("one prompt a request (n = 1)", "prompt");
    throw bad_request("prompt must be a string, or a list of token ids", "prompt");
  }

  // The prompt ids of a chat request: its messages rendered by the chat template, tokenized.
  std::vector<int64_t> chat_prompt(const json& body) {
    if (!chat_) {
      throw bad_request("the model has no chat template (its tokenizer_config.json gives none; serve it with "
                        "--chat-template FILE); use /v1/completions");
    }
    const json* ms = field(body, "messages");
    if (!ms || !ms->is_array() || ms->empty()) throw bad_request("messages must be a non-empty list", "messages");
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < ms->size(); ++i) {
      const json& m = (*ms)[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        throw bad_request(where + " must be an object with a role", "messages");
      }
      std::string role = m["role"];
      if (role == "developer") role = "system";
      if (role != "system" && role != "user" && role != "assistant") {
        throw bad_request(where + ": the role " + runner::quoted(role) + " is not supported (system, user, assistant)",
                          "messages");
      }
      std::string content;
      const json* c = field(m, "content");
      if (c && c->is_string()) {
        content = c->get<std::string>();
      } else if (c && c->is_array()) {  // parts: text ones only
        for (const auto& part : *c) {
          if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
              !part["text"].is_string()) {
            throw bad_request(where + ": only text content parts are supported", "messages");
          }
          content += part["text"].get<std::string>();
        }
      } else if (c || role != "assistant") {
        throw bad_request(where + ": content must be a string or a list of text parts", "messages");
      }
      messages.push_back({role, content});
    }
    std::map<std::string, std::string> extra;
    if (const json* kw = field(body, "chat_template_kwargs")) {
      if (!kw->is_object()) throw bad_request("chat_template_kwargs must be an object", "chat_template_kwargs");
      for (const auto& [k, v] : kw->items()) {
        if (v.is_boolean()) {
          extra[k] = v.get<bool>() ? "true" : "false";
        } else if (v.is_string()) {
          extra[k] = v.get<std::string>();
        } else {
          throw bad_request("chat_template_kwargs values must be strings or booleans", "chat_template_kwargs");
        }
      }
    }
    std::string text;
    try {
      text = chat_->render(messages, /*add_generation_prompt=*/true, extra);
    } catch (const std::invalid_argument& e) {
      throw bad_request(std::string("the chat template refuses these messages: ") + e.what(), "messages");
    }
    return tokenizer_.encode(text);  // the template wrote bos where the model wants it
  }

  // What the engine would refuse of a prompt, refused here first so that the error names its field
  // (and, for a prompt longer than the cache, OpenAI's code for it).
  void check_prompt_fits(const std::vector<int64_t>& ids, const char* param) {
    if (static_cast<int64_t>(ids.size()) > lm_.max_seq_len()) {
      throw ApiError(400,
                     "the prompt has " + std::to_string(ids.size()) + " tokens, more than the package's max_seq_len (" +
                         std::to_string(lm_.max_seq_len()) + ")",
                     "invalid_request_error", param, "context_length_exceeded");
    }
    for (size_t j = 0; j < ids.size(); ++j) {
      if (ids[j] < 0 || ids[j] >= lm_.vocab_size()) {
        throw bad_request("the prompt holds id " + std::to_string(ids[j]) + " at position " + std::to_string(j) +
                              ", outside the vocabulary [0, " + std::to_string(lm_.vocab_size()) + ")",
                          param);
      }
    }
  }

  Job parse_job(const json& body, bool chat) {
    check_model(body);
    refuse_unsupported(body);
    Job job;
    job.chat = chat;
    job.prompt = chat ? chat_prompt(body) : completion_prompt(body);
    check_prompt_fits(job.prompt, chat ? "messages" : "prompt");
    RequestOptions& r = job.options;
    // OpenAI's defaults: temperature 1, top_p 1; completions 16 tokens, chat until the cache is full
    r.temperature = number_field(body, "temperature", 0, 2).value_or(1.0);
    r.top_p = number_field(body, "top_p", 0, 1).value_or(1.0);
    if (r.top_p == 0) throw bad_request("top_p must be greater than 0", "top_p");
    r.top_k = int_field(body, "top_k", 0).value_or(0);
    std::optional<int64_t> max_tokens = int_field(body, "max_tokens", 1);
    if (chat) {
      if (auto m = int_field(body, "max_completion_tokens", 1)) max_tokens = m;
    }
    r.max_new_tokens = max_tokens.value_or(chat ? lm_.max_seq_len() : 16);
    if (const json* seed = field(body, "seed")) {
      if (!seed->is_number_integer()) throw bad_request("seed must be an integer", "seed");
      r.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
    } else {
      static std::atomic<uint64_t> counter{std::random_device{}()};
      r.seed = counter.fetch_add(0x9E3779B97F4A7C15ULL);
    }
    if (const json* stop = field(body, "stop")) {
      if (stop->is_string()) {
        job.stops.push_back(*stop);
      } else if (stop->is_array() && stop->size() <= 4 &&
                 std::all_of(stop->begin(), stop->end(), [](const json& s) { return s.is_string(); })) {
        job.stops = stop->get<std::vector<std::string>>();
      } else {
        throw bad_request("stop must be a string or a list of at most 4 strings", "stop");
      }
      for (const auto& s : job.stops) {
        if (s.empty()) throw bad_request("stop strings must not be empty", "stop");
      }
    }
    job.stream = bool_field(body, "stream").value_or(false);
    if (const json* so = field(body, "stream_options")) {
      if (!so->is_object()) throw bad_request("stream_options must be an object", "stream_options");
      job.include_usage = bool_field(*so, "include_usage").value_or(false);
    }
    return job;
  }

  // One choice's JSON: its text (or delta) and finish reason.
  json choice(const Job& job, const std::string& text, const json& finish, bool first_delta = false) const {
    json c = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
    if (!job.chat) {
      c["text"] = text;
    } else if (job.stream) {
      c["delta"] = json::object();
      if (first_delta) c["delta"]["role"] = "assistant";
      if (!text.empty() || first_delta) c["delta"]["content"] = text;
    } else {
      c["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return c;
  }

  json envelope(const Job& job, const std::string& id) const {
    const char* object = job.chat ? (job.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    return {{"id", id}, {"object", object}, {"created", now_seconds()}, {"model", o_.model_name}};
  }

  static json usage(int64_t prompt, int64_t completion) {
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }

  static int64_t now_seconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  // A request in flight: its engine request, its text, and its counts.
  struct Run {
    Run(std::shared_ptr<Request> r, TextOut t, Metrics& m) : request(std::move(r)), text(std::move(t)), metrics(m) {}
    Run(const Run&) = delete;
    Run& operator=(const Run&) = delete;
    std::shared_ptr<Request> request;
    TextOut text;
    Metrics& metrics;
    int64_t completion_tokens = 0;
    Clock::time_point last = Clock::now();
    bool first = true;
    FinishReason reason = FinishReason::none;  // the engine's once an update said it finished, or error
    bool ended = false;                        // an update said it finished
    ~Run() {
      request->cancel();  // a no-op where it ended; else its slot is freed at the engine's next step
      // A dropped (or failed) run is counted once the engine ended it, so that a scrape showing its
      // end shows its slot free. (A step is milliseconds; a wedged engine holds this thread 10 s at
      // most. A stop string's run ended for its client: counted at once, its slot a step later.)
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      while (!ended && !text.stopped() && Clock::now() < deadline &&
             !request->next(std::chrono::milliseconds(50)).finished) {
      }
      // a run whose end the server never read was dropped (its client went away) or stopped
      const int end = text.stopped() || reason == FinishReason::stop ? 0
                      : reason == FinishReason::length                ? 1
                      : reason == FinishReason::error                 ? 3
                                                                      : 2;
      ++metrics.ended[end];
    }
  };

  // Takes an update's ids into run (its text, metrics); returns the text to send.
  std::string advance(Run& run, const Request::Update& u) {
    const auto now = Clock::now();
    const int64_t before = run.text.taken();
    std::string out = run.text.push(u.ids);
    if (const int64_t n = run.text.taken() - before; n > 0) {
      const double since = std::chrono::duration<double>(now - run.last).count();
      if (run.first) {
        metrics_.ttft.observe(since);
        const Request::Times t = run.request->times();
        if (t.admitted && t.first_id) {
          metrics_.queue.observe(std::chrono::duration<double>(*t.admitted - t.submitted).count());
          metrics_.prefill.observe(std::chrono::duration<double>(*t.first_id - *t.admitted).count());
        }
        if (n > 1) metrics_.itl.observe(0, n - 1);
      } else {
        metrics_.itl.observe(since / static_cast<double>(n), n);
      }
      run.first = false;
      run.last = now;
      run.completion_tokens += n;
      metrics_.generated_tokens += n;
    }
    if (u.finished) {
      run.reason = u.reason;
      run.ended = true;
    }
    if (u.finished && !run.text.stopped()) out += run.text.finish();
    if (run.text.stopped()) run.request->cancel();
    return out;
  }

  // Why the run ended, as OpenAI's finish_reason; throws for a run the engine ended with an error.
  static std::string finish_reason(const Run& run, const Request::Update& u) {
    if (run.text.stopped() || u.reason == FinishReason::stop) return "stop";
    if (u.reason == FinishReason::length) return "length";
    if (u.reason == FinishReason::cancelled) {
      throw ApiError(503, "the server is shutting down", "server_error");
    }
    throw ApiError(500, "generation failed: " + u.error, "server_error");
  }

  void generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    const json body = parse_body(req);
    Job job = parse_job(body, chat);
    TextOut text_out(tokenizer_, job.stops);  // (first: a submitted request must get its Run, which ends it)
    // counted before the engine has it (a scrape shows no request waiting or running that it does
    // not count), uncounted where refused; an accepted one ends in customops_requests_finished_total
    ++metrics_.requests;
    std::shared_ptr<Request> request;
    try {
      request = engine_.submit(job.prompt, job.options);
    } catch (...) {
      --metrics_.requests;
      throw;
    }
    auto run = std::make_shared<Run>(std::move(request), std::move(text_out), metrics_);
    metrics_.prompt_tokens += static_cast<int64_t>(job.prompt.size());
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_++);
    if (!job.stream) {
      std::string text;
      Request::Update u;
      const int connection = connection_socket(req);
      try {
        do {
          u = run->request->next(std::chrono::milliseconds(50));
          if (!u.finished && client_gone(connection)) {
            res.status = 499;  // (nginx's "client closed request", for no one: its Run cancels the request)
            return;
          }
          text += advance(*run, u);
        } while (!u.finished && !run->text.stopped());
      } catch (...) {  // (the text's failure: the run ends as an error, not as dropped)
        if (run->reason == FinishReason::none) run->reason = FinishReason::error;
        throw;
      }
      const std::string reason = finish_reason(*run, u);
      json out = envelope(job, id);
      out["choices"] = json::array({choice(job, text, reason)});
      out["usage"] = usage(static_cast<int64_t>(job.prompt.size()), run->completion_tokens);
      send_json(res, 200, out);
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, id, run, connection = connection_socket(req)](size_t, httplib::DataSink& sink) {
          try {
            return stream(job, id, *run, sink, connection);
          } catch (const std::exception& e) {  // thrown here, it would end the process
            ++metrics_.failed;
            if (run->reason == FinishReason::none) run->reason = FinishReason::error;
            const std::string line = "data: " + error_body(message_of(e), "server_error").dump() + "\n\n";
            sink.write(line.data(), line.size());
            return false;
          }
        },
        [run](bool) { run->request->cancel(); });  // a no-op where it ended
  }

  // Writes a run's server-sent events until it ends; false where the client went away (seen at a
  // write, or on its socket while nothing is written: waiting for a slot, or text held back).
  bool stream(const Job& job, const std::string& id, Run& run, httplib::DataSink& sink, int connection) {
    auto send = [&](const json& event) {
      const std::string line = "data: " + event.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
      return sink.write(line.data(), line.size());
    };
    auto chunk = [&](const std::string& text, const json& finish, bool first = false) {
      json event = envelope(job, id);
      event["choices"] = json::array({choice(job, text, finish, first)});
      if (job.include_usage) event["usage"] = nullptr;
      return send(event);
    };
    if (job.chat && !chunk("", nullptr, /*first=*/true)) return false;
    Request::Update u;
    do {
      u = run.request->next(std::chrono::milliseconds(100));
      if (!sink.is_writable() || client_gone(connection)) return false;  // (gone: the releaser cancels)
      const std::string text = advance(run, u);
      if (!text.empty() && !chunk(text, nullptr)) return false;
    } while (!u.finished && !run.text.stopped());
    try {
      if (!chunk("", finish_reason(run, u))) return false;
    } catch (const ApiError& e) {
      ++metrics_.failed;
      send(error_body(e.what(), e.type));
    }
    if (job.include_usage) {
      json event = envelope(job, id);
      event["choices"] = json::array();
      event["usage"] = usage(static_cast<int64_t>(job.prompt.size()), run.completion_tokens);
      send(event);
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  }

  void models(httplib::Response& res) {
    json model = {{"id", o_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "customops"},
                  {"max_model_len", lm_.max_seq_len()}};
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  }

  void tokenize(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    const json* content = field(body, "content");
    if (!content) content = field(body, "prompt");
    if (!content || !content->is_string()) throw bad_request("content must be a string", "content");
    std::vector<int64_t> ids = tokenizer_.encode(content->get<std::string>());
    if (bool_field(body, "add_special").value_or(false) && text_.add_bos) {
      if (auto bos = lm_.bos_token_id() ? lm_.bos_token_id() : tokenizer_.bos_id()) ids.insert(ids.begin(), *bos);
    }
    send_json(res, 200, {{"tokens", ids}});
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    const json* tokens = field(body, "tokens");
    if (!tokens || !tokens->is_array() ||
        !std::all_of(tokens->begin(), tokens->end(), [](const json& t) { return t.is_number_integer(); })) {
      throw bad_request("tokens must be a list of token ids", "tokens");
    }
    send_json(res, 200, {{"content", tokenizer_.decode(id_list(*tokens, "tokens"))}});
  }

  std::string metrics() {
    // A request counts as accepted before the engine has it and as ended after it left its slot:
    // the ends read before the engine's gauges and the accepted after them, no request in the
    // gauges is missing from the counts of one scrape. (But a stop string's, ended for its client
    // and counted at once, holds its slot to the engine's next step.)
    int64_t ended[4];
    for (int i = 0; i < 4; ++i) ended[i] = metrics_.ended[i];
    const Engine::Stats s = engine_.stats();
    const int64_t requests = metrics_.requests, failed = metrics_.failed, prompt_tokens = metrics_.prompt_tokens;
    const int64_t generated_tokens = metrics_.generated_tokens;
    std::ostringstream out;
    auto counter = [&](const char* name, const char* help, int64_t v) {
      out << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n" << name << " " << v << "\n";
    };
    auto gauge = [&](const char* name, const char* help, int64_t v) {
      out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n" << name << " " << v << "\n";
    };
    counter("customops_requests_total", "Generation requests accepted.", requests);
    counter("customops_requests_failed_total", "Requests that failed on the server's side.", failed);
    counter("customops_prompt_tokens_total", "Prompt tokens of accepted requests.", prompt_tokens);
    counter("customops_generated_tokens_total", "Tokens generated.", generated_tokens);
    counter("customops_steps_total", "Engine steps (a decode run, a prefill run, or both).", s.steps);
    counter("customops_runs_total", "Runs of the package.", s.runs);
    counter("customops_graph_runs_total", "Runs of the package replayed from a CUDA graph.", s.graph_runs);
    counter("customops_computed_tokens_total", "Positions the package computed, padding included.", s.tokens);
    out << "# HELP customops_requests_finished_total Generation requests ended, by why: stop (an eos or stop id, or "
           "a stop string), length, cancelled (the client went away, or the server is stopping), error.\n"
           "# TYPE customops_requests_finished_total counter\n";
    for (int i = 0; i < 4; ++i) {
      out << "customops_requests_finished_total{reason=\"" << Metrics::kEnds[i] << "\"} " << ended[i] << "\n";
    }
    gauge("customops_requests_running", "Requests holding a KV cache slot.", s.running);
    gauge("customops_requests_waiting", "Requests waiting for a slot.", s.waiting);
    metrics_.ttft.write(out, "customops_time_to_first_token_seconds", "Time from a request to its first token.");
    metrics_.itl.write(out, "customops_inter_token_latency_seconds", "Time between a request's tokens.");
    metrics_.queue.write(out, "customops_request_queue_time_seconds",
                         "Time from a request's submission to the engine until it got a KV cache slot.");
    metrics_.prefill.write(out, "customops_request_prefill_time_seconds",
                           "Time from a request's slot to its first token: its prompt's prefill.");
    return out.str();
  }

  const ServeOptions& o_;
  CausalLM& lm_;
  Engine& engine_;
  const Tokenizer& tokenizer_;
  const TextSetup& text_;
  std::unique_ptr<ChatTemplate> chat_;
  Metrics metrics_;
  std::atomic<int64_t> next_id_{1};
  int64_t created_ = 0;
};

}  // namespace

int serve_main(int argc, char** argv) {
  ServeOptions o = parse_serve_args(argc, argv);
  // Before it serves, a signal ends the process at once (a package's load can take minutes and
  // cannot be interrupted), its folders removed; after, it stops the server.
  StopSignals signals("serve: stopped before serving");
  // without --tokenizer, the tokenizer the package embeds (in a folder of its own while this runs)
  std::optional<EmbeddedTokenizer> embedded;
  if (o.tokenizer.empty()) {
    embedded.emplace(o.package);
    if (embedded->path().empty()) {
      throw UsageError("serve needs --tokenizer (the model's tokenizer: text in and out), or a package that embeds "
                       "one (package_causal_lm(..., tokenizer=...))");
    }
    o.tokenizer = embedded->path();
  }
  const TextSetup text = read_text_setup(o);
  std::unique_ptr<Tokenizer> tokenizer_owner;
  try {
    tokenizer_owner = std::make_unique<Tokenizer>(o.tokenizer);
  } catch (const std::exception& e) {
    throw UserError(e.what());
  }
  const Tokenizer& tokenizer = *tokenizer_owner;
  const TempFolder unpacked("customops-run");  // (before the model, which keeps files in it)
  std::unique_ptr<CausalLM> lm_owner =
      load_causal_lm(o.package, o.device.empty() ? std::nullopt : std::optional<std::string>(o.device), unpacked);
  CausalLM& lm = *lm_owner;
  check_tokenizer(tokenizer, lm);
  EngineOptions eo;
  eo.max_batch = o.max_batch;
  eo.token_budget = o.token_budget;
  eo.cuda_graph = o.cuda_graph;
  eo.prefill_multiple = o.prefill_multiple;
  Engine engine(lm, eo);
  Server server(o, lm, engine, tokenizer, text);

  // a first request that loads the kernels (and captures the one-row CUDA graph) before any client
  engine.start();
  // (waited to its end: no client sees it running)
  const auto warm = engine.submit({lm.bos_token_id().value_or(0)}, [] {
    RequestOptions r;
    r.max_new_tokens = 2;
    r.stop_at_eos = false;
    return r;
  }());
  while (!warm->next().finished) {
  }

  httplib::Server http;
  const size_t threads = static_cast<size_t>(o.threads);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // A stream is a run of small writes, one an event: without TCP_NODELAY, Nagle's algorithm may hold
  // an event until the client has acknowledged the one before (uvicorn and nginx set it to stream).
  http.set_tcp_nodelay(true);
  server.routes(http);
  const int port = o.port == 0 ? http.bind_to_any_port(o.host) : (http.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port < 0) throw UserError("cannot listen on " + o.host + ":" + std::to_string(o.port));
  // On a signal the engine stops first: the requests in flight end (their streams with an error
  // event, others with 503) and new ones are refused, so that no connection keeps the server up.
  // A signal before listening starts waits for it (stop() does nothing to a server not running yet).
  std::atomic<bool> listened{false};
  signals.serving([&http, &engine, &listened] {
    engine.stop();
    while (!listened) {
      if (http.is_running()) {
        http.stop();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  // (signals stop nothing once what the stop touches is about to go, whichever way this returns)
  const struct Finish {
    StopSignals& s;
    ~Finish() { s.finish(); }
  } finish_signals{signals};
  std::cerr << "customops-run serve: " << o.model_name << " on http://" << o.host << ":" << port << " ("
            << lm.device().str() << ", " << (o.max_batch ? std::min(o.max_batch, lm.max_batch()) : lm.max_batch())
            << " slots of " << lm.max_seq_len() << " tokens)" << std::endl;
  // (listening makes the --threads threads: a failure there is an error, once signals stop nothing)
  std::exception_ptr failed;
  try {
    http.listen_after_bind();
  } catch (...) {
    failed = std::current_exception();
  }
  listened = true;
  signals.finish();
  if (failed) {
    engine.stop();
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      throw UserError("serving failed: " + message_of(e));
    }
  }
  engine.stop();
  std::cerr << "customops-run serve: stopped" << std::endl;
  return 0;
}

}  // namespace customops::runner

#else  // built without cpp-httplib or nlohmann-json

namespace customops::runner {
int serve_main(int, char**) {
  throw UserError("this customops-run was built without serve (Debian: apt-get install libcpp-httplib-dev "
                  "nlohmann-json3-dev pkg-config, then build again)");
}
}  // namespace customops::runner

#endif
