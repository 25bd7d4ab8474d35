// customops-run's inputs and outputs files, in the torch.save / torch::jit::pickle_save format:
// inputs read with every tensor's storage checked against its data record, outputs written whole
// or not at all.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/storage_context.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "runner/runner.h"

namespace customops::runner {
namespace {

std::vector<char> read_file(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError("cannot open " + what + " " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool is_zip(const std::vector<char>& bytes) {
  return bytes.size() >= 4 && bytes[0] == 'P' && bytes[1] == 'K' && bytes[2] == 3 && bytes[3] == 4;
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

}  // namespace

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

}  // namespace customops::runner
