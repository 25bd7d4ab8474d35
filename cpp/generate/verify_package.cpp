// customops::verify_package (customops/package.h): every stored member of a package's zip archive
// against the CRC-32 its zip directory records, before torch's loader (which checks none) unpacks it;
// and customops::package_files, the members of one of its folders (a tokenizer the package embeds).
#include "customops/package.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
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

// A package's zip archive: its members as its zip directory records them, and their bytes.
class ZipArchive {
 public:
  struct Member {
    std::string name;
    uint32_t method = 0, crc = 0;
    uint64_t stored = 0, unpacked = 0, data = 0;  // data: the offset of its bytes (stored members)
  };

  explicit ZipArchive(const std::string& path) : path_(path), corrupt_("cannot load " + path + ": the package is damaged: ") {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) throw std::invalid_argument("package not found: " + path);
    if (!S_ISREG(st.st_mode)) throw std::invalid_argument("package is not a regular file: " + path);
    f_.open(path, std::ios::binary);
    char magic[4] = {};
    if (!f_ || !f_.read(magic, 4) || magic[0] != 'P' || magic[1] != 'K' || magic[2] != 3 || magic[3] != 4) {
      throw std::invalid_argument("cannot load " + path +
                                  ": not an AOTInductor package (a .pt2 is a zip archive; this file is not one)");
    }
    if (!f_.seekg(0, std::ios::end)) throw std::invalid_argument("cannot read " + path);
    size_ = static_cast<uint64_t>(f_.tellg());
    read_directory();
  }

  const std::vector<Member>& members() const { return members_; }
  const std::string& corrupt() const { return corrupt_; }

  // Calls fn on consecutive pieces of a stored member's bytes.
  template <typename Fn>
  void read(const Member& m, Fn&& fn) {
    std::vector<unsigned char> buffer(static_cast<size_t>(std::min<uint64_t>(m.stored, 1 << 20)));
    f_.clear();
    f_.seekg(static_cast<std::streamoff>(m.data));
    for (uint64_t left = m.stored; left > 0;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
      if (!f_.read(reinterpret_cast<char*>(buffer.data()), static_cast<std::streamsize>(n))) {
        throw std::invalid_argument("cannot read " + path_);
      }
      fn(buffer.data(), n);
      left -= n;
    }
  }

 private:
  std::vector<unsigned char> read_at(uint64_t offset, size_t n) {
    std::vector<unsigned char> b(n);
    f_.clear();
    if (offset > size_ || n > size_ - offset || !f_.seekg(static_cast<std::streamoff>(offset)) ||
        !f_.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n))) {
      throw std::invalid_argument(corrupt_ + "its zip directory points past the end of the file");
    }
    return b;
  }
  static uint32_t u16(const unsigned char* p) { return static_cast<uint32_t>(p[0] | p[1] << 8); }
  static uint32_t u32(const unsigned char* p) {
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
           static_cast<uint32_t>(p[3]) << 24;
  }
  static uint64_t u64(const unsigned char* p) { return u32(p) | static_cast<uint64_t>(u32(p + 4)) << 32; }

  void read_directory() {
    // The end-of-central-directory record: the last 22 bytes, or earlier by a comment of < 64 KiB.
    size_t tail_size = static_cast<size_t>(std::min<uint64_t>(size_, 22 + 65535));
    auto tail = read_at(size_ - tail_size, tail_size);
    std::optional<size_t> eocd;
    for (size_t i = tail_size >= 22 ? tail_size - 22 + 1 : 0; i-- > 0;) {
      if (u32(&tail[i]) == 0x06054b50) {
        eocd = i;
        break;
      }
    }
    if (!eocd) throw std::invalid_argument(corrupt_ + "it has no zip directory (truncated?)");
    uint64_t entries = u16(&tail[*eocd + 10]), dir_size = u32(&tail[*eocd + 12]), dir_offset = u32(&tail[*eocd + 16]);
    if (entries == 0xffff || dir_size == 0xffffffff || dir_offset == 0xffffffff) {  // zip64
      uint64_t locator = size_ - tail_size + *eocd;
      if (locator < 20) throw std::invalid_argument(corrupt_ + "its zip64 directory is missing");
      auto loc = read_at(locator - 20, 20);
      if (u32(loc.data()) != 0x07064b50) throw std::invalid_argument(corrupt_ + "its zip64 directory is missing");
      auto z = read_at(u64(&loc[8]), 56);
      if (u32(z.data()) != 0x06064b50) throw std::invalid_argument(corrupt_ + "its zip64 directory is missing");
      entries = u64(&z[32]);
      dir_size = u64(&z[40]);
      dir_offset = u64(&z[48]);
    }
    auto dir = read_at(dir_offset, static_cast<size_t>(std::min(dir_size, size_)));
    size_t at = 0;
    for (uint64_t e = 0; e < entries; ++e) {
      if (at + 46 > dir.size() || u32(&dir[at]) != 0x02014b50) {
        throw std::invalid_argument(corrupt_ + "its zip directory is garbled");
      }
      Member m;
      m.method = u16(&dir[at + 10]);
      m.crc = u32(&dir[at + 16]);
      m.stored = u32(&dir[at + 20]);
      m.unpacked = u32(&dir[at + 24]);
      uint64_t local = u32(&dir[at + 42]);
      size_t name_len = u16(&dir[at + 28]), extra_len = u16(&dir[at + 30]), comment_len = u16(&dir[at + 32]);
      if (at + 46 + name_len + extra_len + comment_len > dir.size()) {
        throw std::invalid_argument(corrupt_ + "its zip directory is garbled");
      }
      m.name.assign(reinterpret_cast<const char*>(&dir[at + 46]), name_len);
      // Sizes and offset that do not fit 32 bits are in the zip64 extra field, in this order.
      for (size_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
        size_t id = u16(&dir[x]), len = u16(&dir[x + 2]), v = x + 4;
        if (id == 0x0001) {
          for (uint64_t* field : {&m.unpacked, &m.stored, &local}) {
            if (*field == 0xffffffff && v + 8 <= x + 4 + len) {
              *field = u64(&dir[v]);
              v += 8;
            }
          }
        }
        x += 4 + len;
      }
      at += 46 + name_len + extra_len + comment_len;
      if (m.method == 0) {  // stored: where its bytes are (compressed ones are not read here; torch stores)
        if (m.stored != m.unpacked) {
          throw std::invalid_argument(corrupt_ + m.name + " has two different sizes in its zip directory");
        }
        auto header = read_at(local, 30);
        if (u32(header.data()) != 0x04034b50) {
          throw std::invalid_argument(corrupt_ + "the zip header of " + m.name + " is garbled");
        }
        m.data = local + 30 + u16(&header[26]) + u16(&header[28]);
        if (m.data > size_ || m.stored > size_ - m.data) {
          throw std::invalid_argument(corrupt_ + m.name + " runs past the end of the file");
        }
      }
      members_.push_back(std::move(m));
    }
  }

  std::string path_, corrupt_;
  std::ifstream f_;
  uint64_t size_ = 0;
  std::vector<Member> members_;
};

}  // namespace

void verify_package(const std::string& path) {
  ZipArchive zip(path);
  static const Crc32 crc32;
  for (const auto& m : zip.members()) {
    if (m.method != 0) continue;  // compressed: checked by the decompressor, not here (torch stores)
    uint32_t crc = 0;
    zip.read(m, [&](const unsigned char* p, size_t n) { crc = crc32.update(crc, p, n); });
    if (crc != m.crc) {
      throw std::invalid_argument(zip.corrupt() + m.name +
                                  " does not match the checksum (CRC-32) recorded for it; the file was changed "
                                  "or damaged after it was written");
    }
  }
}

std::map<std::string, std::string> package_files(const std::string& path, const std::string& folder) {
  ZipArchive zip(path);
  static const Crc32 crc32;
  std::map<std::string, std::string> files;
  for (const auto& m : zip.members()) {
    // "<archive's top folder>/<folder><name>"
    const size_t top = m.name.find('/');
    if (top == std::string::npos || m.name.compare(top + 1, folder.size(), folder) != 0) continue;
    const std::string name = m.name.substr(top + 1 + folder.size());
    if (name.empty() || name.back() == '/') continue;  // the folder itself
    if (m.method != 0) throw std::invalid_argument("cannot read " + m.name + " of " + path + ": it is compressed");
    std::string bytes;  // (of two members of one name, the last, as a zip reader takes it)
    uint32_t crc = 0;
    zip.read(m, [&](const unsigned char* p, size_t n) {
      bytes.append(reinterpret_cast<const char*>(p), n);
      crc = crc32.update(crc, p, n);
    });
    if (crc != m.crc) {
      throw std::invalid_argument(zip.corrupt() + m.name +
                                  " does not match the checksum (CRC-32) recorded for it; the file was changed "
                                  "or damaged after it was written");
    }
    files[name] = std::move(bytes);
  }
  return files;
}

}  // namespace customops
