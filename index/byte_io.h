// Little-endian byte writer/reader for index artifacts (Selector::Serialize
// and LoadSelector). Every artifact starts with WriteHeader(magic, version)
// so a loader can reject foreign or newer bytes with a clear Status.
//
// ByteReader never reads past its input: every getter returns false once the
// input is exhausted, and callers turn that into DataLoss/InvalidArgument.
// Thread-safety: plain values; not for concurrent use.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/status.h"

namespace ctxcache::index {

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}

  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));  // x86-64: little-endian
    out_->append(buf, sizeof(T));
  }
  void PutBytes(const void* p, size_t n) {
    if (n > 0) out_->append(static_cast<const char*>(p), n);
  }
  template <typename T>
  void PutArray(const T* p, size_t n) {
    PutBytes(p, n * sizeof(T));
  }
  void PutVarint(uint64_t v) {
    while (v >= 0x80) {
      out_->push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_->push_back(static_cast<char>(v));
  }
  void PutString(std::string_view s) {
    PutVarint(s.size());
    out_->append(s.data(), s.size());
  }
  // 4-byte magic (e.g. "CSA1") + u32 format version.
  void PutHeader(std::string_view magic4, uint32_t version) {
    out_->append(magic4.data(), 4);
    Put<uint32_t>(version);
  }

 private:
  std::string* out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}

  size_t remaining() const { return in_.size() - pos_; }

  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (remaining() < sizeof(T)) return false;
    std::memcpy(v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetBytes(void* p, size_t n) {
    if (remaining() < n) return false;
    if (n == 0) return true;  // p may be null (empty vector); memcpy(null, ., 0) is UB
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool GetArray(T* p, size_t n) {
    if (n > remaining() / sizeof(T)) return false;
    return GetBytes(p, n * sizeof(T));
  }
  bool GetVarint(uint64_t* v) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= in_.size()) return false;
      const uint8_t byte = static_cast<uint8_t>(in_[pos_++]);
      result |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;
  }
  bool GetString(std::string* s) {
    uint64_t n = 0;
    if (!GetVarint(&n) || n > remaining()) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // Checks magic and that version <= max_version; `what` names the artifact.
  Status GetHeader(std::string_view magic4, uint32_t max_version, uint32_t* version,
                   std::string_view what) {
    if (remaining() < 8 || in_.substr(pos_, 4) != magic4) {
      return InvalidArgumentError(std::string(what) + ": bad magic, expected \"" +
                                  std::string(magic4) + "\"");
    }
    pos_ += 4;
    uint32_t v = 0;
    if (!Get(&v)) return DataLossError(std::string(what) + ": truncated header");
    if (v == 0 || v > max_version) {
      return InvalidArgumentError(std::string(what) + ": unsupported format version " +
                                  std::to_string(v) +
                                  ", this build reads <= " + std::to_string(max_version));
    }
    *version = v;
    return Status::OK();
  }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

// The elements of `v` (its size is known to the reader), as PutArray/GetArray.
template <typename T>
void PutVector(ByteWriter* w, const std::vector<T>& v) {
  w->PutArray(v.data(), v.size());
}
template <typename T>
bool GetVector(ByteReader* r, std::vector<T>* v) {
  return r->GetArray(v->data(), v->size());
}

}  // namespace ctxcache::index
