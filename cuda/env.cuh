// The CUDA kernels' switches: environment variables read at each call, so that tests and
// benchmarks (bench --attention and bench --linear take --variant VAR=VALUE) can flip them in one
// process.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

namespace customops::env {

// Whether environment variable `name` is set to `value`.
inline bool is(const char* name, std::string_view value) {
  const char* env = std::getenv(name);
  return env != nullptr && value == env;
}

// The count environment variable `name` is set to, if it is set and not empty. A value other than
// a count raises an error that names `op` and says what the count is of (`what`).
inline std::optional<int64_t> count(const char* op, const char* name, const char* what) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  char* end = nullptr;
  const int64_t n = std::strtoll(env, &end, 10);
  TORCH_CHECK(*end == '\0' && n >= 0, op, ": ", name, " must be a count of ", what, ", not '", env, "'");
  return n;
}

}  // namespace customops::env
