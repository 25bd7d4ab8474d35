// customops::verify_package (customops/package.h): every stored member of a package's zip archive
// against the CRC-32 its zip directory records, before torch's loader (which checks none) unpacks it.
#include "customops/package.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/stat.h>

namespace customops {
namespace {

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

void verify_package(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw std::invalid_argument("package not found: " + path);
  if (!S_ISREG(st.st_mode)) throw std::invalid_argument("package is not a regular file: " + path);
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  if (!f || !f.read(magic, 4) || magic[0] != 'P' || magic[1] != 'K' || magic[2] != 3 || magic[3] != 4) {
    throw std::invalid_argument("cannot load " + path +
                                ": not an AOTInductor package (a .pt2 is a zip archive; this file is not one)");
  }
  if (!f.seekg(0, std::ios::end)) throw std::invalid_argument("cannot read " + path);
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  const std::string corrupt = "cannot load " + path + ": the package is damaged: ";
  auto read_at = [&](uint64_t offset, size_t n) {
    std::vector<unsigned char> b(n);
    if (offset > size || n > size - offset || !f.seekg(static_cast<std::streamoff>(offset)) ||
        !f.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n))) {
      throw std::invalid_argument(corrupt + "its zip directory points past the end of the file");
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
  if (!eocd) throw std::invalid_argument(corrupt + "it has no zip directory (truncated?)");
  uint64_t entries = u16(&tail[*eocd + 10]), dir_size = u32(&tail[*eocd + 12]), dir_offset = u32(&tail[*eocd + 16]);
  if (entries == 0xffff || dir_size == 0xffffffff || dir_offset == 0xffffffff) {  // zip64
    uint64_t locator = size - tail_size + *eocd;
    if (locator < 20) throw std::invalid_argument(corrupt + "its zip64 directory is missing");
    auto loc = read_at(locator - 20, 20);
    if (u32(loc.data()) != 0x07064b50) throw std::invalid_argument(corrupt + "its zip64 directory is missing");
    auto z = read_at(u64(&loc[8]), 56);
    if (u32(z.data()) != 0x06064b50) throw std::invalid_argument(corrupt + "its zip64 directory is missing");
    entries = u64(&z[32]);
    dir_size = u64(&z[40]);
    dir_offset = u64(&z[48]);
  }
  auto dir = read_at(dir_offset, static_cast<size_t>(std::min(dir_size, size)));
  static const Crc32 crc32;
  std::vector<unsigned char> buffer(1 << 20);
  size_t at = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > dir.size() || u32(&dir[at]) != 0x02014b50) throw std::invalid_argument(corrupt + "its zip directory is garbled");
    uint32_t method = u16(&dir[at + 10]), want_crc = u32(&dir[at + 16]);
    uint64_t stored = u32(&dir[at + 20]), unpacked = u32(&dir[at + 24]), local = u32(&dir[at + 42]);
    size_t name_len = u16(&dir[at + 28]), extra_len = u16(&dir[at + 30]), comment_len = u16(&dir[at + 32]);
    if (at + 46 + name_len + extra_len + comment_len > dir.size()) {
      throw std::invalid_argument(corrupt + "its zip directory is garbled");
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
    if (stored != unpacked) throw std::invalid_argument(corrupt + name + " has two different sizes in its zip directory");
    auto header = read_at(local, 30);
    if (u32(header.data()) != 0x04034b50) throw std::invalid_argument(corrupt + "the zip header of " + name + " is garbled");
    uint64_t data = local + 30 + u16(&header[26]) + u16(&header[28]);
    if (data > size || stored > size - data) throw std::invalid_argument(corrupt + name + " runs past the end of the file");
    f.seekg(static_cast<std::streamoff>(data));
    uint32_t crc = 0;
    for (uint64_t left = stored; left > 0;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
      if (!f.read(reinterpret_cast<char*>(buffer.data()), static_cast<std::streamsize>(n))) {
        throw std::invalid_argument("cannot read " + path);
      }
      crc = crc32.update(crc, buffer.data(), n);
      left -= n;
    }
    if (crc != want_crc) {
      throw std::invalid_argument(corrupt + name + " does not match the checksum (CRC-32) recorded for it; the file was changed "
                      "or damaged after it was written");
    }
  }
}

}  // namespace customops
