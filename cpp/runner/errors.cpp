// customops-run's errors as the user reads them: one line, without torch's C++ backtrace, and
// what the user gave quoted so that it cannot garble the terminal or flood it.
#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <execinfo.h>
#include <sys/uio.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <sstream>
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

// Where a crash report goes: stderr, or where without_backtraces keeps it while it captures fd 2.
volatile sig_atomic_t crash_fd = 2;

// (async-signal-safe: write, backtrace_symbols_fd, raise)
void write_stderr(const char* text) {
  ssize_t ignored = write(crash_fd, text, std::strlen(text));
  (void)ignored;
}

// n in hexadecimal, "0x" first (async-signal-safe)
void write_hex(uintptr_t n) {
  char text[2 + 2 * sizeof n + 1];
  char* end = text + sizeof text - 1;
  *end = '\0';
  char* at = end;
  do {
    *--at = "0123456789abcdef"[n & 0xf];
    n >>= 4;
  } while (n != 0);
  *--at = 'x';
  *--at = '0';
  write_stderr(at);
}

// Copies n bytes at from into to without touching them: false where any is not readable (a read
// through process_vm_readv fails with EFAULT where a load would fault). Async-signal-safe.
bool read_safely(void* to, const void* from, size_t n) {
  iovec local{to, n}, remote{const_cast<void*>(from), n};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(n);
}

constexpr int kCrashSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

void on_crash(int signal, siginfo_t* info, void* context) {
  // every crash signal's default action from here: a fault inside this report ends the process as
  // that fault would, not with a second report that names the wrong signal
  for (int s : kCrashSignals) std::signal(s, SIG_DFL);
  const char* name = signal == SIGSEGV ? "SIGSEGV"
                     : signal == SIGBUS ? "SIGBUS"
                     : signal == SIGILL ? "SIGILL"
                     : signal == SIGFPE ? "SIGFPE"
                                        : "SIGABRT";
  write_stderr("customops-run: crashed (");
  write_stderr(name);
  if ((signal == SIGSEGV || signal == SIGBUS) && info->si_code > 0) {  // (si_code <= 0: sent by a process)
    write_stderr(" at address ");
    write_hex(reinterpret_cast<uintptr_t>(info->si_addr));
  }
  write_stderr("); please report it with this stack:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), crash_fd);
  // Where the program counter is in no loaded object, the stack above ends at the signal's
  // trampoline: a call through a null pointer (the program counter is 0), or into a library no
  // longer mapped. Then the return address that call left names its caller (x86-64: the stack's
  // top; AArch64: the link register), and on x86-64 the return addresses further up the stack (the
  // words that point just past a call instruction in a loaded object) name the callers' callers.
  // (dladdr is not async-signal-safe; this is a crash's last word, after the report above)
  const auto* uc = static_cast<const ucontext_t*>(context);
#if defined(__x86_64__)
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  const auto* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.pc);
#else
  const uintptr_t pc = 0;
#endif
  Dl_info where_info;
  if (pc != 0 && dladdr(reinterpret_cast<void*>(pc), &where_info) != 0) {
    raise(signal);  // the stack above is whole: the default action now (SA_NODEFER: at once)
    return;
  }
  write_stderr("customops-run: the program counter was ");
  write_hex(pc);
  write_stderr(", in no loaded object; the return address a call there would have left:\n");
  void* where[1] = {nullptr};
#if defined(__x86_64__)
  read_safely(&where[0], sp, sizeof where[0]);
#elif defined(__aarch64__)
  where[0] = reinterpret_cast<void*>(uc->uc_mcontext.regs[30]);
#endif
  backtrace_symbols_fd(where, 1, crash_fd);
#if defined(__x86_64__)
  write_stderr("customops-run: return addresses further up the stack (a scan, not an unwinding):\n");
  int found = 0;
  for (int i = 1; i < 1024 && found < 24; ++i) {
    void* word = nullptr;
    unsigned char before[8];  // the 7 bytes before the word's address, and one to spare
    Dl_info object;
    if (!read_safely(&word, sp + i, sizeof word)) break;  // past the stack's end
    const auto* at = static_cast<const unsigned char*>(word);
    if (at == nullptr || dladdr(at, &object) == 0 || !read_safely(before, at - 8, sizeof before)) continue;
    // a call rel32 (e8) ends there, or an indirect call (ff /2, 2 to 7 bytes with its prefix,
    // ModRM, SIB and displacement): before[8 - k] is the byte k places back
    bool call = before[3] == 0xe8;
    for (int k = 2; k <= 7 && !call; ++k) call = before[8 - k] == 0xff && (before[9 - k] & 0x38) == 0x10;
    if (!call) continue;
    where[0] = word;
    backtrace_symbols_fd(where, 1, crash_fd);
    ++found;
  }
#endif
  raise(signal);
}

}  // namespace

void report_crashes() {
  void* warm[1];
  backtrace(warm, 1);  // (its first call loads libgcc_s: here, not in the handler)
  // the main thread's handler runs on a stack of its own, so that an overflow of its stack is
  // reported too (other threads' overflows end without the report)
  static char alternate[1 << 16];
  stack_t stack{};
  stack.ss_sp = alternate;
  stack.ss_size = sizeof alternate;
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int signal : kCrashSignals) sigaction(signal, &action, nullptr);
}

std::string quoted(const std::string& text, size_t max_bytes) {
  std::string out = "'";
  size_t i = 0;
  for (; i < text.size() && i < max_bytes;) {
    const size_t n = utf8_length(text, i);
    const auto c = static_cast<unsigned char>(text[i]);
    if (n == 0 || (n == 1 && (c < 0x20 || c == 0x7f || c == '\\' || c == '\''))) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  out += "'";
  if (i < text.size()) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

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

void without_backtraces(const std::function<void()>& fn) {
  std::cerr.flush();
  std::fflush(stderr);
  FILE* capture = std::tmpfile();
  const int saved = capture ? dup(2) : -1;
  if (saved < 0 || dup2(fileno(capture), 2) < 0) {  // nowhere to capture: run as is
    if (saved >= 0) close(saved);
    if (capture) std::fclose(capture);
    return fn();
  }
  crash_fd = saved;
  std::string error;  // fn's error, as main words it
  auto restore = [&] {
    std::cerr.flush();
    std::fflush(stderr);
    dup2(saved, 2);
    crash_fd = 2;
    close(saved);
    std::string text;
    std::rewind(capture);
    char buffer[4096];
    for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, capture)) > 0;) text.append(buffer, n);
    std::fclose(capture);
    std::istringstream lines(text);
    std::string line, kept;
    bool trace = false;
    while (std::getline(lines, line)) {
      if (line.rfind("Exception raised from ", 0) == 0) {
        trace = true;
      } else if (!(trace && (line.empty() || line.rfind("frame #", 0) == 0))) {
        trace = false;
        const bool repeated = line.rfind("Error: ", 0) == 0 && !error.empty() && error.find(line.substr(7)) != std::string::npos;
        if (!repeated) kept += line + "\n";
      }
    }
    std::cerr << kept;
  };
  try {
    fn();
  } catch (const std::exception& e) {
    error = message_of(e);
    restore();
    throw;
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace customops::runner
