// What customops-run's commands share as a process: its temporary folders, TMPDIR while torch's
// package loader unpacks a package, and SIGINT and SIGTERM, which end the process without leaving
// either behind.
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runner/runner.h"

namespace customops::runner {

void remove_tree(const std::string& path) noexcept {
  // depth first (a folder's entries before it), without following symbolic links
  nftw(
      path.c_str(), [](const char* entry, const struct stat*, int, struct FTW*) { return std::remove(entry), 0; }, 16,
      FTW_DEPTH | FTW_PHYS);
}

namespace {

// The TempFolders that exist: a stop signal removes them before the process ends. The mutex is
// held while a folder is made or removed, so that none is half made or half gone when the signal's
// thread takes it.
std::mutex& folders_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& folders() {
  static std::set<std::string> s;
  return s;
}

}  // namespace

TempFolder::TempFolder(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  std::string dir = base + "/" + prefix + "-XXXXXX";
  std::lock_guard<std::mutex> lock(folders_mutex());
  if (mkdtemp(dir.data()) == nullptr) {
    throw UserError("cannot make a folder in " + base + ": " + std::strerror(errno));
  }
  path_ = dir;
  folders().insert(path_);
}

TempFolder::~TempFolder() {
  std::lock_guard<std::mutex> lock(folders_mutex());
  folders().erase(path_);
  remove_tree(path_);
}

TmpdirScope::TmpdirScope(const std::string& folder) {
  if (const char* tmp = std::getenv("TMPDIR")) old_ = tmp;
  setenv("TMPDIR", folder.c_str(), /*overwrite=*/1);
}

TmpdirScope::~TmpdirScope() {
  if (old_) {
    setenv("TMPDIR", old_->c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
}

StopSignals::StopSignals(std::string early_stop) : early_stop_(std::move(early_stop)) {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  sigaddset(&set_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set_, &old_mask_);
  thread_ = std::thread([this] { wait(); });
}

StopSignals::~StopSignals() {
  finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  pthread_kill(thread_.native_handle(), SIGTERM);  // (a thread that has returned ignores it)
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

void StopSignals::serving(std::function<void()> stop) {
  std::lock_guard<std::mutex> lock(mu_);
  stop_ = std::move(stop);
}

void StopSignals::finish() {
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = nullptr;
  idle_.wait(lock, [this] { return !stopping_; });
}

void StopSignals::wait() {
  for (;;) {
    int signal = 0;
    sigwait(&set_, &signal);
    std::unique_lock<std::mutex> lock(mu_);
    if (done_) return;
    if (!stop_) end(signal);
    // the first signal while serving: a clean stop (a second one, while it or the teardown after it
    // runs, ends the process at once)
    const std::function<void()> stop = std::move(stop_);
    stop_ = nullptr;
    stopping_ = true;
    lock.unlock();
    stop();
    lock.lock();
    stopping_ = false;
    idle_.notify_all();
  }
}

void StopSignals::end(int signal) {
  // The folders are removed by a child process once this one is gone: a thread still writing into
  // one (torch's loader unpacking a package makes the folders of a file's path as it goes) would
  // otherwise leave files, or the folder itself, behind. The child closes every file this process
  // has open (a listening socket, a device, a parent's pipe) first; where no child can be made, the
  // folders are removed here. The lock is held to the end: no folder is made after the list.
  folders_mutex().lock();
  const std::vector<std::string> paths(folders().begin(), folders().end());
  const pid_t self = getpid();
  const pid_t child = paths.empty() ? 0 : fork();
  if (child == 0 && !paths.empty()) {
    if (close_range(0, ~0U, 0) != 0) {
      for (int fd = 0; fd < 65536; ++fd) close(fd);
    }
    for (int i = 0; i < 60000 && getppid() == self; ++i) usleep(1000);  // (a minute at the most)
    for (const std::string& path : paths) remove_tree(path);
    _exit(0);
  }
  if (child < 0) {
    for (const std::string& path : paths) remove_tree(path);
  }
  std::fprintf(stderr, "customops-run %s (%s)\n", early_stop_.c_str(), signal == SIGINT ? "SIGINT" : "SIGTERM");
  std::fflush(stderr);
  // ended by the signal itself, as a shell expects of a program it stops (a loop over
  // customops-run stops at Ctrl-C)
  std::signal(signal, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, signal);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  raise(signal);
  std::_Exit(128 + signal);
}

}  // namespace customops::runner
