// customops-run's checks of a package before it is loaded: a regular file and a zip archive, the
// model and device its metadata names, and every member against its CRC-32 (a damaged model
// library would crash the process when run).
#include <ATen/Context.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <sys/stat.h>

#include "runner/runner.h"

namespace customops::runner {
namespace {

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

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw UserError(what + " not found: " + path);
  if (!S_ISREG(st.st_mode)) throw UserError(what + " is not a regular file: " + path);
}

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

}  // namespace customops::runner
