// Internal to customops-run: what its parts share. args.cpp reads the command line and main.cpp
// runs it; package_checks.cpp checks a package before it is loaded; tensor_io.cpp reads inputs and
// writes outputs; loaded_package.cpp loads and runs a package without knowing the command line (a
// C++ API for running packages, or a decode loop, builds on it); errors.cpp words errors;
// process.cpp keeps temporary folders and stop signals; generate.cpp and serve.cpp are the
// generate and serve commands.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <signal.h>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace torch::inductor {
class AOTIModelPackageLoader;
}  // namespace torch::inductor

namespace customops {
class CausalLM;
class Tokenizer;
}  // namespace customops

namespace customops::runner {

// An error the user can act on; main prints "customops-run: <message>" and exits with status 1.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wrong command line; exits with status 2.
struct UsageError : UserError {
  using UserError::UserError;
};

// ---- process.cpp
// Removes path and, where it is a folder, everything in it (symbolic links themselves, never what
// they point to); errors are ignored. Not std::filesystem::remove_all: torch's own libraries export
// a copy of std::filesystem that the dynamic linker may bind this program's calls to, and the copy
// in torch 2.11's CUDA wheel crashes in remove_all (a call through a null pointer, seen on an H200).
void remove_tree(const std::string& path) noexcept;

// A folder of its own under TMPDIR (or /tmp), PREFIX-XXXXXX, removed with everything in it when
// this goes away, or by StopSignals where a signal ends the process first. A UserError where it
// cannot be made.
class TempFolder {
 public:
  explicit TempFolder(const std::string& prefix);
  ~TempFolder();
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// TMPDIR is folder while one lives, then as it was: torch's package loader unpacks a package under
// TMPDIR and removes its copy when it is destroyed, but not where loading fails or a signal ends
// the process, so it is given a TempFolder.
class TmpdirScope {
 public:
  explicit TmpdirScope(const std::string& folder);
  ~TmpdirScope();
  TmpdirScope(const TmpdirScope&) = delete;
  TmpdirScope& operator=(const TmpdirScope&) = delete;

 private:
  std::optional<std::string> old_;
};

// SIGINT and SIGTERM go to one thread of their own, blocked in every other (the mask is set here,
// before the command starts any thread, and threads inherit it), so that none takes them with the
// default action. Until serving(), and again after finish() or a first stop, a signal ends the
// process at once: "customops-run EARLY_STOP (SIGINT)" on stderr, every TempFolder removed by a
// child process as soon as this one is gone, and the process ended by the signal itself (a load
// of minutes cannot be interrupted otherwise). After serving(stop), the first signal calls stop on
// that thread. finish() returns once a stop under way has returned, so that what stop touches may
// go; the destructor puts the signal mask back.
class StopSignals {
 public:
  explicit StopSignals(std::string early_stop);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  void serving(std::function<void()> stop);
  void finish();

 private:
  void wait();
  [[noreturn]] void end(int signal);
  std::string early_stop_;
  sigset_t set_, old_mask_;
  std::mutex mu_;
  std::condition_variable idle_;
  std::function<void()> stop_;
  bool stopping_ = false, done_ = false;
  std::thread thread_;
};

// ---- generate.cpp
// customops-run generate ARGS (argv[0] is "generate"): its own command line and run.
int generate_main(int argc, char** argv);
// The causal-LM package at package loaded onto its device (checked against device, as --device),
// and a UserError that says what is wrong where it cannot be. Torch's loader unpacks the package
// into unpack_into, which must outlive the CausalLM.
std::unique_ptr<CausalLM> load_causal_lm(const std::string& package, const std::optional<std::string>& device,
                                         const TempFolder& unpack_into);
// A UserError where the tokenizer cannot be the model's (its vocabulary is larger).
void check_tokenizer(const Tokenizer& tokenizer, const CausalLM& lm);
// The tokenizer a package embeds (customops.export.package_causal_lm(..., tokenizer=...)), written
// into a TempFolder (as save_pretrained would write it) for as long as this object lives: path()
// is that folder, empty where the package embeds none.
class EmbeddedTokenizer {
 public:
  explicit EmbeddedTokenizer(const std::string& package);
  const std::string& path() const;

 private:
  std::optional<TempFolder> folder_;
};

// ---- serve.cpp
// customops-run serve ARGS (argv[0] is "serve"): an OpenAI-compatible HTTP server.
int serve_main(int argc, char** argv);

// ---- errors.cpp
// A c10::Error or std::exception as one line: without the C++ backtrace torch appends, its lines
// joined, and with '?' for bytes that would garble a terminal (an error about a corrupt file can
// quote the file's bytes).
std::string message_of(const std::exception& e);
// text in single quotes for an error message: a control character, a quote, a backslash or a byte
// that is not UTF-8 as \xNN, and cut after max_bytes (then its length follows).
std::string quoted(const std::string& text, size_t max_bytes = 40);
// Runs fn with this process's stderr (fd 2) going to a temporary file, then writes what came there
// back without torch's C++ backtraces: an AOTInductor model prints every error it raises,
// backtrace included, before it returns the failure that customops-run reports in one line (the
// model's own "Error: ..." line is left out too where that line repeats fn's error).
void without_backtraces(const std::function<void()>& fn);
// From here on a crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) writes which signal it was and the
// stack (glibc's backtrace: each frame's library and offset, addr2line's input) to stderr, then ends
// the process as that signal would have: what a bug report needs, from a server that ran for days.
void report_crashes();

// ---- args.cpp
struct Options {
  std::string package, inputs, outputs;
  std::optional<std::string> device;
  std::string model_name = "model";
  bool time = false, check_inputs = true, show_libraries = false, info = false;
  int runs = 1, warmup = 0;
};

// The command line; prints the help or the version and exits for -h, --help and --version.
Options parse_args(int argc, char** argv);
// The value of the option at argv[i] (argv[i + 1], and i moves past it); a UsageError if none.
std::string option_value(int argc, char** argv, int& i);
// value as an integer in [min, max] for the option flag, else a UsageError: "FLAG expects an
// integer >= MIN, got 'VALUE'" (with "and <= MAX" for one past max).
int64_t parse_integer(const std::string& flag, const std::string& value, int64_t min,
                      int64_t max = std::numeric_limits<int64_t>::max());

// ---- package_checks.cpp
// A UserError naming `what` unless path is a regular file.
void require_regular_file(const std::string& path, const std::string& what);
// The package's metadata (AOTI_DEVICE_KEY etc.), read without loading the model.
std::unordered_map<std::string, std::string> read_metadata(const Options& o);
// The device to run on: the package's, checked against --device and against this process.
c10::Device pick_device(const Options& o, const std::string& package_device);

// ---- tensor_io.cpp
// The tensors of the inputs file, moved to device and made contiguous.
std::vector<at::Tensor> read_inputs(const std::string& path, const c10::Device& device);
// Checked before the model is loaded, so that a wrong path costs no run.
void check_outputs_path(const std::string& path);
// Writes outputs to path as a tuple of CPU tensors (torch.load reads it); no partial file is left.
void write_outputs(const std::string& path, const std::vector<at::Tensor>& outputs);

// ---- loaded_package.cpp
// The model's own error from a run, as one line; the caller words it for the user.
struct ModelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A package loaded onto a device, to be run any number of times.
class LoadedPackage {
 public:
  // Checks the package (customops::verify_package), then loads model_name from it onto device; a UserError
  // where either fails. check_inputs: the model checks its inputs' dtypes, shapes and strides.
  LoadedPackage(const std::string& path, const std::string& model_name, const c10::Device& device,
                bool check_inputs);
  ~LoadedPackage();
  LoadedPackage(const LoadedPackage&) = delete;
  LoadedPackage& operator=(const LoadedPackage&) = delete;

  // Runs the model once and waits for the device: a ModelError where the model fails, a UserError
  // where it returns no output.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  // Inputs by the call spec: exact for tensor inputs (the model itself checks the count when run).
  std::optional<size_t> spec_inputs();

 private:
  std::string path_;
  c10::Device device_;
  TempFolder unpacked_;  // declared before the loader, so it outlives it
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

}  // namespace customops::runner
