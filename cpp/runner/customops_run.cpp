// customops-run: runs an AOTInductor package (.pt2) that calls customops operators, with no
// Python. It links libcustomops.so, so the proxy executor finds every customops:: schema when it
// loads the package, and libtorch (AOTIModelPackageLoader), never libpython. Tensors go in and out
// in the torch.save / torch::jit::pickle_save format, so torch.load reads the outputs directly.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <customops/customops.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/storage_context.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace {

constexpr const char* kUsage = R"(usage: customops-run [options] PACKAGE.pt2 INPUTS.pt OUTPUTS.pt
       customops-run --info PACKAGE.pt2

Runs an AOTInductor package that may call customops operators, without Python.

  INPUTS.pt   the model's inputs: a tensor, or a list or tuple of tensors in the order
              torch.export flattens them (positional arguments, then keyword arguments),
              written by torch.save (or torch::jit::pickle_save). Inputs are moved to the
              package's device and made contiguous.
  OUTPUTS.pt  written with the model's outputs as a tuple of CPU tensors (read with torch.load);
              its folder must exist. Nothing is written when the run fails.

options:
  --device DEVICE     cpu, cuda or cuda:N; must match the device the package was compiled for
                      (default: that device, index 0)
  --model-name NAME   the model inside the package (default: model)
  --time              print the load time and the run time
  --runs N            run N times and report the mean and best run time (default: 1);
                      OUTPUTS.pt holds the last run's outputs
  --warmup N          untimed runs before the timed ones (default: 0)
  --no-check-inputs   skip the package's checks of input dtypes, shapes and strides
                      (they are on unless AOTI_RUNTIME_CHECK_INPUTS=0 is set)
  --show-libraries    print every shared library the process has loaded, after the run
  --info              print the package's metadata and exit
  --version           print the versions of customops and of the torch it was built with
  -h, --help          print this help
)";

// An error the user can act on; main prints "customops-run: <message>" and exits with status 1.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wrong command line; exits with status 2.
struct UsageError : UserError {
  using UserError::UserError;
};

struct Options {
  std::string package, inputs, outputs;
  std::optional<std::string> device;
  std::string model_name = "model";
  bool time = false, check_inputs = true, show_libraries = false, info = false;
  int runs = 1, warmup = 0;
};

int parse_count(const std::string& flag, const std::string& value, int min) {
  const std::string expects = flag + " expects an integer >= " + std::to_string(min);
  try {
    size_t used = 0;
    int n = std::stoi(value, &used);
    if (used == value.size() && n >= min) return n;
  } catch (const std::out_of_range&) {
    throw UsageError(expects + " and <= " + std::to_string(std::numeric_limits<int>::max()) + ", got '" + value + "'");
  } catch (const std::exception&) {
  }
  throw UsageError(expects + ", got '" + value + "'");
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " expects a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "--version") {
      std::cout << "customops-run " << customops::version() << " (torch " << customops::torch_version()
                << (customops::has_cuda() ? ", CUDA kernels" : ", CPU kernels only") << ")\n";
      std::exit(0);
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--model-name") {
      o.model_name = value();
    } else if (a == "--runs") {
      o.runs = parse_count(a, value(), 1);
    } else if (a == "--warmup") {
      o.warmup = parse_count(a, value(), 0);
    } else if (a == "--time") {
      o.time = true;
    } else if (a == "--no-check-inputs") {
      o.check_inputs = false;
    } else if (a == "--show-libraries") {
      o.show_libraries = true;
    } else if (a == "--info") {
      o.info = true;
    } else if (a.size() > 1 && a[0] == '-') {
      throw UsageError("unknown option " + a + " (see --help)");
    } else {
      positional.push_back(a);
    }
  }
  size_t want = o.info ? 1 : 3;
  if (positional.size() != want) {
    throw UsageError(o.info ? "--info expects one argument, PACKAGE.pt2 (see --help)"
                           : "expected PACKAGE.pt2 INPUTS.pt OUTPUTS.pt, got " + std::to_string(positional.size()) +
                                 " arguments (see --help)");
  }
  const char* names[] = {"PACKAGE.pt2", "INPUTS.pt", "OUTPUTS.pt"};
  for (size_t i = 0; i < positional.size(); ++i) {
    if (positional[i].empty()) throw UsageError(std::string(names[i]) + " is an empty string (see --help)");
  }
  o.package = positional[0];
  if (!o.info) {
    o.inputs = positional[1];
    o.outputs = positional[2];
  }
  return o;
}

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

// A c10::Error or std::exception as one line: without the C++ backtrace torch appends, its lines
// joined, and with '?' for bytes that would garble a terminal (an error about a corrupt file can
// quote the file's bytes).
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

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw UserError(what + " not found: " + path);
  if (!S_ISREG(st.st_mode)) throw UserError(what + " is not a regular file: " + path);
}

std::vector<char> read_file(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError("cannot open " + what + " " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool is_zip(const std::vector<char>& bytes) {
  return bytes.size() >= 4 && bytes[0] == 'P' && bytes[1] == 'K' && bytes[2] == 3 && bytes[3] == 4;
}

bool is_zip(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

// The model names the loader's error for a name it lacks lists, comma-separated ("" when it lists
// none): one per line after its "Available models:" (torch 2.13) or "Available models in the
// archive:" (torch 2.11) line, up to an empty line.
std::string models_in(const std::string& error) {
  auto at = error.find("Available models");
  if (at == std::string::npos) return "";
  std::istringstream lines(error.substr(at));
  std::string line, models;
  std::getline(lines, line);  // the heading
  while (std::getline(lines, line) && !line.empty()) models += (models.empty() ? "" : ", ") + line;
  return models;
}

// The package's metadata (AOTI_DEVICE_KEY etc.), read without loading the model.
std::unordered_map<std::string, std::string> read_metadata(const Options& o) {
  require_regular_file(o.package, "package");
  if (!is_zip(o.package)) {
    throw UserError("cannot load " + o.package +
                    ": not an AOTInductor package (a .pt2 is a zip archive; this file is not one)");
  }
  std::unordered_map<std::string, std::string> meta;
  try {
    meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(o.package, o.model_name);
  } catch (const std::exception& e) {
    std::string models = models_in(e.what());
    if (!models.empty() && (" " + models + ",").find(" " + o.model_name + ",") == std::string::npos) {
      throw UserError(o.package + " holds no model named '" + o.model_name + "' (it holds: " + models +
                      "); pick one with --model-name");
    }
    std::string msg = message_of(e);
    msg = msg.substr(0, msg.find(" Available models"));  // then a list of every file in the package
    throw UserError("cannot read " + o.package + " (model '" + o.model_name +
                    "'): not a valid AOTInductor package, or it holds no model of that name: " + msg);
  }
  if (meta["AOTI_DEVICE_KEY"].empty()) {
    throw UserError("cannot load " + o.package + ": its metadata names no device (AOTI_DEVICE_KEY)");
  }
  return meta;
}

// CRC-32 as zip computes it (slicing by 8: the whole package is read once before it is loaded).
class Crc32 {
 public:
  Crc32() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1)));
      table_[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int t = 1; t < 8; ++t) table_[t][i] = (table_[t - 1][i] >> 8) ^ table_[0][table_[t - 1][i] & 0xff];
    }
  }
  uint32_t update(uint32_t crc, const unsigned char* p, size_t n) const {
    crc = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
      uint32_t lo = crc ^ (p[0] | p[1] << 8 | p[2] << 16 | static_cast<uint32_t>(p[3]) << 24);
      crc = table_[7][lo & 0xff] ^ table_[6][(lo >> 8) & 0xff] ^ table_[5][(lo >> 16) & 0xff] ^ table_[4][lo >> 24] ^
            table_[3][p[4]] ^ table_[2][p[5]] ^ table_[1][p[6]] ^ table_[0][p[7]];
    }
    while (n--) crc = (crc >> 8) ^ table_[0][(crc ^ *p++) & 0xff];
    return ~crc;
  }

 private:
  uint32_t table_[8][256];
};

// Checks every stored member of the package against the CRC-32 its zip directory records. The
// loader's zip reader (miniz, built without CRC checks) would unpack a damaged model library, and
// running it crashes the process (bit flips in a package gave SIGSEGV and SIGILL).
void verify_package(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f || !f.seekg(0, std::ios::end)) throw UserError("cannot open " + path);
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  const std::string corrupt = "cannot load " + path + ": the package is damaged: ";
  auto read_at = [&](uint64_t offset, size_t n) {
    std::vector<unsigned char> b(n);
    if (offset > size || n > size - offset || !f.seekg(static_cast<std::streamoff>(offset)) ||
        !f.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n))) {
      throw UserError(corrupt + "its zip directory points past the end of the file");
    }
    return b;
  };
  auto u16 = [](const unsigned char* p) { return static_cast<uint32_t>(p[0] | p[1] << 8); };
  auto u32 = [](const unsigned char* p) {
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
           static_cast<uint32_t>(p[3]) << 24;
  };
  auto u64 = [&](const unsigned char* p) { return u32(p) | static_cast<uint64_t>(u32(p + 4)) << 32; };

  // The end-of-central-directory record: the last 22 bytes, or earlier by a comment of < 64 KiB.
  size_t tail_size = static_cast<size_t>(std::min<uint64_t>(size, 22 + 65535));
  auto tail = read_at(size - tail_size, tail_size);
  std::optional<size_t> eocd;
  for (size_t i = tail_size >= 22 ? tail_size - 22 + 1 : 0; i-- > 0;) {
    if (u32(&tail[i]) == 0x06054b50) {
      eocd = i;
      break;
    }
  }
  if (!eocd) throw UserError(corrupt + "it has no zip directory (truncated?)");
  uint64_t entries = u16(&tail[*eocd + 10]), dir_size = u32(&tail[*eocd + 12]), dir_offset = u32(&tail[*eocd + 16]);
  if (entries == 0xffff || dir_size == 0xffffffff || dir_offset == 0xffffffff) {  // zip64
    uint64_t locator = size - tail_size + *eocd;
    if (locator < 20) throw UserError(corrupt + "its zip64 directory is missing");
    auto loc = read_at(locator - 20, 20);
    if (u32(loc.data()) != 0x07064b50) throw UserError(corrupt + "its zip64 directory is missing");
    auto z = read_at(u64(&loc[8]), 56);
    if (u32(z.data()) != 0x06064b50) throw UserError(corrupt + "its zip64 directory is missing");
    entries = u64(&z[32]);
    dir_size = u64(&z[40]);
    dir_offset = u64(&z[48]);
  }
  auto dir = read_at(dir_offset, static_cast<size_t>(std::min(dir_size, size)));
  static const Crc32 crc32;
  std::vector<unsigned char> buffer(1 << 20);
  size_t at = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > dir.size() || u32(&dir[at]) != 0x02014b50) throw UserError(corrupt + "its zip directory is garbled");
    uint32_t method = u16(&dir[at + 10]), want_crc = u32(&dir[at + 16]);
    uint64_t stored = u32(&dir[at + 20]), unpacked = u32(&dir[at + 24]), local = u32(&dir[at + 42]);
    size_t name_len = u16(&dir[at + 28]), extra_len = u16(&dir[at + 30]), comment_len = u16(&dir[at + 32]);
    if (at + 46 + name_len + extra_len + comment_len > dir.size()) {
      throw UserError(corrupt + "its zip directory is garbled");
    }
    std::string name(reinterpret_cast<const char*>(&dir[at + 46]), name_len);
    // Sizes and offset that do not fit 32 bits are in the zip64 extra field, in this order.
    for (size_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
      size_t id = u16(&dir[x]), len = u16(&dir[x + 2]), v = x + 4;
      if (id == 0x0001) {
        for (uint64_t* field : {&unpacked, &stored, &local}) {
          if (*field == 0xffffffff && v + 8 <= x + 4 + len) {
            *field = u64(&dir[v]);
            v += 8;
          }
        }
      }
      x += 4 + len;
    }
    at += 46 + name_len + extra_len + comment_len;
    if (method != 0) continue;  // compressed: checked by the decompressor, not here (torch stores)
    if (stored != unpacked) throw UserError(corrupt + name + " has two different sizes in its zip directory");
    auto header = read_at(local, 30);
    if (u32(header.data()) != 0x04034b50) throw UserError(corrupt + "the zip header of " + name + " is garbled");
    uint64_t data = local + 30 + u16(&header[26]) + u16(&header[28]);
    if (data > size || stored > size - data) throw UserError(corrupt + name + " runs past the end of the file");
    f.seekg(static_cast<std::streamoff>(data));
    uint32_t crc = 0;
    for (uint64_t left = stored; left > 0;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
      if (!f.read(reinterpret_cast<char*>(buffer.data()), static_cast<std::streamsize>(n))) {
        throw UserError("cannot read " + path);
      }
      crc = crc32.update(crc, buffer.data(), n);
      left -= n;
    }
    if (crc != want_crc) {
      throw UserError(corrupt + name + " does not match the checksum (CRC-32) recorded for it; the file was changed "
                      "or damaged after it was written");
    }
  }
}

// The device to run on: the package's, checked against --device and against this process.
c10::Device pick_device(const Options& o, const std::string& package_device) {
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(package_device);
  } catch (const std::exception&) {
    throw UserError(o.package + " was compiled for device '" + package_device + "', which customops-run does not know");
  }
  if (o.device) {
    c10::Device asked(c10::kCPU);
    try {
      asked = c10::Device(*o.device);
    } catch (const std::exception&) {
      throw UserError("--device expects cpu, cuda or cuda:N, got '" + *o.device + "'");
    }
    if (asked.type() != device.type()) {
      throw UserError(o.package + " was compiled for " + package_device + " and cannot run on " + *o.device +
                      "; compile it for " + c10::DeviceTypeName(asked.type(), true) +
                      " (inputs and module on that device when exporting), or run it with --device " +
                      package_device);
    }
    if (asked.is_cpu() && asked.has_index() && asked.index() != 0) {
      throw UserError("--device " + *o.device + ": there is one cpu device; use --device cpu");
    }
    device = asked;
  }
  if (device.is_cuda()) {
    if (!at::hasCUDA()) {
      throw UserError(o.package + " was compiled for cuda, but this process has no CUDA device " +
                      "(libtorch built without CUDA, or no GPU visible)");
    }
    if (!device.has_index()) device.set_index(0);
    auto n = static_cast<int>(at::getNumGPUs());
    if (device.index() >= n) {
      throw UserError("--device " + device.str() + ": this machine has " + std::to_string(n) + " CUDA device(s)");
    }
  } else if (!device.is_cpu()) {
    throw UserError(o.package + " was compiled for " + package_device + "; customops-run runs cpu and cuda packages");
  }
  return device;
}

// torch::jit::pickle_load, except that each tensor's storage is as long as its data record:
// pickle_load sizes it by the element count the pickle claims, so a tensor whose record was cut
// short read past the record's end; now set_ rejects it, as torch.load does.
c10::IValue load_pickle(std::vector<char> bytes) {
  // torch::jit::VectorReader, which libtorch does not export.
  struct BytesReader : caffe2::serialize::ReadAdapterInterface {
    explicit BytesReader(std::vector<char> b) : bytes(std::move(b)) {}
    size_t size() const override { return bytes.size(); }
    size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
      if (pos >= bytes.size()) return 0;
      n = std::min<size_t>(n, bytes.size() - pos);
      std::memcpy(buf, bytes.data() + pos, n);
      return n;
    }
    std::vector<char> bytes;
  };
  caffe2::serialize::PyTorchStreamReader reader(std::make_unique<BytesReader>(std::move(bytes)));
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  const std::string dir = "data/";  // where pickle_save and torch.save put the tensors' data
  for (const auto& name : reader.getAllRecords()) {
    if (name.rfind(dir, 0) != 0) continue;
    auto [data, size] = reader.getRecord(name);
    storages->addStorage(name.substr(dir.size()),
                         at::Storage(c10::Storage::use_byte_size_t(), size, std::move(data), /*allocator=*/nullptr,
                                     /*resizable=*/false));
  }
  c10::IValue value = torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                                         std::nullopt, std::nullopt, std::nullopt, reader,
                                                         torch::jit::Unpickler::defaultTypeParser, storages);
  // torch 2.13's set_ rejects a tensor that overruns its storage; torch 2.11's unpickler does not.
  value.visit([](const c10::IValue& v) {
    if (!v.isTensor() || v.toTensor().numel() == 0) return false;
    const at::Tensor& t = v.toTensor();
    int64_t last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const uint64_t need = static_cast<uint64_t>(last + 1) * t.element_size(), have = t.storage().nbytes();
    if (need > have) {
      throw std::runtime_error("a tensor of shape " + c10::str(t.sizes()) + " and strides " + c10::str(t.strides()) +
                               " would require a storage of at least " + std::to_string(need) +
                               " bytes, but storage only has " + std::to_string(have) + " bytes");
    }
    return false;
  });
  return value;
}

std::vector<at::Tensor> read_inputs(const std::string& path, const c10::Device& device) {
  auto bytes = read_file(path, "inputs file");
  const std::string expected = " (expected a tensor, or a list or tuple of tensors, written by torch.save)";
  if (bytes.empty()) throw UserError("the inputs file " + path + " is empty" + expected);
  if (!is_zip(bytes)) {
    throw UserError("cannot read the inputs file " + path + ": it is not a zip archive, as torch.save writes" +
                    expected);
  }
  c10::IValue value;
  try {
    value = load_pickle(std::move(bytes));
  } catch (const std::exception& e) {
    throw UserError("cannot read the inputs file " + path + expected + ": it is truncated or corrupt: " +
                    message_of(e));
  }
  std::vector<c10::IValue> items;
  if (value.isTensor()) {
    items.push_back(value);
  } else if (value.isTuple()) {
    items = value.toTupleRef().elements().vec();
  } else if (value.isList()) {
    items = value.toListRef().vec();
  } else {
    throw UserError("the inputs file " + path + " holds a " + value.tagKind() +
                    "; expected a tensor, or a list or tuple of tensors");
  }
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].isTensor()) {
      throw UserError("input " + std::to_string(i) + " in " + path + " is not a tensor but " + items[i].tagKind() +
                      " (an AOTInductor model takes tensors only)");
    }
    tensors.push_back(items[i].toTensor().to(device).contiguous());
  }
  return tensors;
}

// Checked before the model is loaded, so that a wrong path costs no run.
void check_outputs_path(const std::string& path) {
  const std::string cannot = "cannot write the outputs file " + path + ": ";
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw UserError("the outputs file " + path + " is a directory; name a file in it");
    if (access(path.c_str(), W_OK) != 0) throw UserError(cannot + std::strerror(errno));
    return;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  if (stat(dir.c_str(), &st) != 0) {
    throw UserError(cannot + (errno == ENOENT ? "the folder " + dir + " does not exist"
                                              : "the folder " + dir + ": " + std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) throw UserError(cannot + dir + " is not a folder");
  if (access(dir.c_str(), W_OK) != 0) throw UserError(cannot + "the folder " + dir + ": " + std::strerror(errno));
}

void write_outputs(const std::string& path, const std::vector<at::Tensor>& outputs) {
  std::vector<c10::IValue> items;
  items.reserve(outputs.size());
  for (const auto& t : outputs) items.emplace_back(t.cpu());
  // A tuple, not a c10::List<Tensor>: torch.load(weights_only=True) reads a pickled tuple of tensors.
  auto bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
  std::FILE* f = std::fopen(path.c_str(), "wb");
  bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  int error = errno;
  if (f && std::fclose(f) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (!ok) {
    // No partial file is left behind (a device such as /dev/full is left alone).
    struct stat st {};
    if (f && stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) std::remove(path.c_str());
    throw UserError("cannot write the outputs file " + path + ": " + std::strerror(error));
  }
}

// A folder for the loader's unpacked copy of the package (given to it as TMPDIR while it loads),
// removed at the end: the loader removes its copy when it is destroyed, but not when loading fails.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string base = tmp && *tmp ? tmp : "/tmp";
    std::string templ = base + "/customops-run-XXXXXX";
    if (!mkdtemp(templ.data())) {
      throw UserError("cannot create a folder in " + base + " to unpack the package in: " + std::strerror(errno));
    }
    path_ = templ;
    if (tmp) old_tmpdir_ = tmp;
    setenv("TMPDIR", path_.c_str(), /*overwrite=*/1);
  }
  // Puts TMPDIR back once the loader has unpacked the package.
  void restore_tmpdir() {
    if (old_tmpdir_) {
      setenv("TMPDIR", old_tmpdir_->c_str(), 1);
    } else {
      unsetenv("TMPDIR");
    }
  }
  ~ScratchDir() {
    restore_tmpdir();
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

 private:
  std::string path_;
  std::optional<std::string> old_tmpdir_;
};

// Number of leaves of a pytree spec as torch serializes it (JSON; a leaf is {"type": null, ...}).
// The in_spec of an exported program flattens (args, kwargs); its leaves are the model's inputs,
// plus any non-tensor argument the export made a constant.
std::optional<size_t> count_spec_leaves(const std::string& spec) {
  const std::string leaf = "\"type\": null";
  if (spec.find("children_spec") == std::string::npos) return std::nullopt;
  size_t n = 0;
  for (size_t pos = spec.find(leaf); pos != std::string::npos; pos = spec.find(leaf, pos + leaf.size())) ++n;
  return n;
}

void synchronize(const c10::Device& device) {
  if (!device.is_cpu()) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// Every shared object mapped into this process (what /proc/<pid>/maps would show from outside).
std::vector<std::string> loaded_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> seen;
  std::vector<std::string> libs;
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    auto name = path.substr(path.rfind('/') + 1);
    if (name.find(".so") == std::string::npos) continue;
    if (seen.insert(path).second) libs.push_back(path);
  }
  return libs;
}

// Adds what to do to the proxy executor's error for an operator that is not registered.
std::string with_hint(const std::string& msg) {
  if (msg.find("Could not find schema for") == std::string::npos) return msg;
  return msg + " (the library that registers that operator must be loaded in this process before the package)";
}

// The message for a failed run: the model's own words where torch passes them on (newer torch);
// older torch passes on only which call failed, after the model printed its error on stderr.
std::string run_error(const Options& o, std::string msg, size_t given, std::optional<size_t> spec_inputs) {
  const std::string count_error = "expected inputs vector size to be ";
  if (auto at = msg.find(count_error); at != std::string::npos) {
    size_t want = std::strtoull(msg.c_str() + at + count_error.size(), nullptr, 10);
    return o.package + " takes " + std::to_string(want) + " input tensor(s), but " + o.inputs + " holds " +
           std::to_string(given);
  }
  // Inductor's check of an input's size against one the model already took from another input
  // (e.g. the batch): "expected size 2==3, stride 16==16 at dim=0 Error in op: input ...".
  const std::string size_error = "expected size ";
  if (auto at = msg.find(size_error); at != std::string::npos && msg.find("Error in op: input") != std::string::npos) {
    long long got = 0, want = 0, dim = 0;
    auto dim_at = msg.find("at dim=", at);
    if (std::sscanf(msg.c_str() + at + size_error.size(), "%lld==%lld", &got, &want) == 2 && got != want &&
        dim_at != std::string::npos && std::sscanf(msg.c_str() + dim_at, "at dim=%lld", &dim) == 1) {
      return "running " + o.package + " failed: an input of " + o.inputs + " has size " + std::to_string(got) +
             " in dim " + std::to_string(dim) + " where the model expects " + std::to_string(want) +
             " (inputs that share a dynamic dimension, such as the batch, must agree on its size)";
    }
  }
  if (msg.find("API call failed") != std::string::npos) {
    if (spec_inputs && *spec_inputs != given) {
      return o.package + " takes " + std::to_string(*spec_inputs) + " input tensor(s) by its call spec, but " +
             o.inputs + " holds " + std::to_string(given) + " (the model's own error is printed above)";
    }
    msg += " (the model's own error is printed above)";
  }
  if (!o.check_inputs) msg += " (run without --no-check-inputs to have the model check its inputs)";
  return "running " + o.package + " failed: " + msg;
}

int run(const Options& o) {
  auto meta = read_metadata(o);
  if (o.info) {
    std::map<std::string, std::string> sorted(meta.begin(), meta.end());
    for (const auto& [k, v] : sorted) std::cout << k << ": " << v << "\n";
    return 0;
  }
  c10::Device device = pick_device(o, meta["AOTI_DEVICE_KEY"]);
  check_outputs_path(o.outputs);
  auto inputs = read_inputs(o.inputs, device);

  // The generated model checks its inputs' dtypes, shapes, strides and devices only when this is
  // set (read once, on the first run); without it a wrong shape reads out of bounds.
  if (o.check_inputs) setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);

  auto load_start = std::chrono::steady_clock::now();
  verify_package(o.package);
  ScratchDir scratch;  // declared before the loader, so it outlives it
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        o.package, o.model_name, /*run_single_threaded=*/false, /*num_runners=*/1,
        device.is_cpu() ? c10::DeviceIndex(-1) : device.index());
  } catch (const std::exception& e) {
    throw UserError("cannot load " + o.package + ": " + with_hint(message_of(e)));
  }
  scratch.restore_tmpdir();
  double load_ms = ms_since(load_start);

  // Inputs by the call spec: exact for tensor inputs (the model itself checks the count when run).
  std::optional<size_t> spec_inputs;
  if (auto spec = loader->get_call_spec(); !spec.empty()) spec_inputs = count_spec_leaves(spec[0]);

  std::vector<at::Tensor> outputs;
  auto run_once = [&] {
    try {
      outputs = loader->run(inputs);
    } catch (const std::exception& e) {
      throw UserError(run_error(o, message_of(e), inputs.size(), spec_inputs));
    }
    // torch 2.11 returns undefined outputs from a model whose operator call failed (it printed why)
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined()) {
        throw UserError("running " + o.package + " failed: it returned no output " + std::to_string(i) +
                        " (the model's own error is printed above)");
      }
    }
    synchronize(device);
  };
  for (int i = 0; i < o.warmup; ++i) run_once();
  double total_ms = 0, best_ms = 0;
  for (int i = 0; i < o.runs; ++i) {
    auto start = std::chrono::steady_clock::now();
    run_once();
    double ms = ms_since(start);
    total_ms += ms;
    best_ms = i == 0 ? ms : std::min(best_ms, ms);
  }
  write_outputs(o.outputs, outputs);

  if (o.time) {
    std::printf("load: %.3f ms\n", load_ms);
    std::printf("run: %.3f ms mean, %.3f ms best, %d run(s) on %s\n", total_ms / o.runs, best_ms, o.runs,
                device.str().c_str());
  }
  if (o.show_libraries) {
    for (const auto& lib : loaded_libraries()) std::printf("library: %s\n", lib.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::cerr << "customops-run: " << e.what() << "\n";
    return 2;
  } catch (const UserError& e) {
    std::cerr << "customops-run: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "customops-run: " << message_of(e) << "\n";
    return 1;
  } catch (...) {
    std::cerr << "customops-run: failed with an exception that is not a std::exception\n";
    return 1;
  }
}
