// customops-run's errors as the user reads them: one line, without torch's C++ backtrace.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

#include "runner/runner.h"

namespace customops::runner {
namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 where there is none.
size_t utf8_length(const std::string& s, size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return 0;
  }
  return n;
}

}  // namespace

std::string message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10_error ? c10_error->what_without_backtrace() : e.what();
  // An operator's error that crossed the model's C ABI arrives as text, backtrace included.
  auto trace = msg.find("Exception raised from ");
  if (trace != std::string::npos) msg.erase(trace);
  // miniz's advice about checkpoints, which says nothing about this file.
  auto miniz = msg.find(" This is an internal miniz error.");
  if (miniz != std::string::npos) msg.erase(miniz);
  std::string line;
  for (size_t i = 0; i < msg.size();) {
    size_t n = utf8_length(msg, i);
    char c = msg[i];
    if (c == '\n' || c == '\r' || c == '\t' || c == ' ') {
      if (!line.empty() && line.back() != ' ') line += ' ';
    } else if (n == 0 || (n == 1 && (static_cast<unsigned char>(c) < 0x20 || c == 0x7f))) {
      line += '?';
    } else {
      line.append(msg, i, n);
    }
    i += n ? n : 1;
  }
  while (!line.empty() && line.back() == ' ') line.pop_back();
  return line;
}

}  // namespace customops::runner
