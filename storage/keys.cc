#include "storage/keys.h"

#include <cstring>

#include "common/sha256.h"

namespace ctxcache::storage {
namespace {

constexpr char kManifestTag = 'M';
constexpr char kFormatVersionTag = 'V';

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

ContextId ContextId::Compute(std::string_view model_fingerprint, std::span<const uint32_t> tokens) {
  return Compute({}, model_fingerprint, tokens);
}

ContextId ContextId::Compute(std::string_view id_namespace, std::string_view model_fingerprint,
                             std::span<const uint32_t> tokens) {
  Sha256 h;
  if (!id_namespace.empty()) {
    static constexpr char kTag[] = "ctxcache-ns";  // hashed with its NUL
    h.Update(reinterpret_cast<const uint8_t*>(kTag), sizeof(kTag));
    const uint32_t n = static_cast<uint32_t>(id_namespace.size());
    const uint8_t len[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                            static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24)};
    h.Update(len, 4);
    h.Update(id_namespace);
  }
  h.Update(model_fingerprint);
  // Token ids as u32 little-endian, in chunks to keep the stack small.
  uint8_t buf[4096];
  size_t n = 0;
  for (uint32_t t : tokens) {
    buf[n++] = static_cast<uint8_t>(t);
    buf[n++] = static_cast<uint8_t>(t >> 8);
    buf[n++] = static_cast<uint8_t>(t >> 16);
    buf[n++] = static_cast<uint8_t>(t >> 24);
    if (n == sizeof(buf)) {
      h.Update(buf, n);
      n = 0;
    }
  }
  h.Update(buf, n);
  Sha256::Digest d = h.Finish();
  ContextId id;
  std::memcpy(id.bytes.data(), d.data(), id.bytes.size());
  return id;
}

StatusOr<ContextId> ContextId::FromHex(std::string_view hex) {
  if (hex.size() != 32) {
    return InvalidArgumentError("context_id: expected 32 hex characters, got " +
                                std::to_string(hex.size()));
  }
  ContextId id;
  for (size_t i = 0; i < 16; ++i) {
    int hi = HexValue(hex[2 * i]);
    int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return InvalidArgumentError("context_id: not a hex string: '" + std::string(hex) + "'");
    }
    id.bytes[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return id;
}

StatusOr<ContextId> ContextId::FromBytes(std::string_view raw) {
  if (raw.size() != 16) {
    return InvalidArgumentError("context_id: expected 16 bytes, got " + std::to_string(raw.size()));
  }
  ContextId id;
  std::memcpy(id.bytes.data(), raw.data(), 16);
  return id;
}

std::string ContextId::ToHex() const { return ctxcache::ToHex(bytes.data(), bytes.size()); }

void PutBE16(std::string* dst, uint16_t v) {
  dst->push_back(static_cast<char>(v >> 8));
  dst->push_back(static_cast<char>(v));
}

void PutBE32(std::string* dst, uint32_t v) {
  dst->push_back(static_cast<char>(v >> 24));
  dst->push_back(static_cast<char>(v >> 16));
  dst->push_back(static_cast<char>(v >> 8));
  dst->push_back(static_cast<char>(v));
}

uint16_t GetBE16(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return static_cast<uint16_t>((u[0] << 8) | u[1]);
}

uint32_t GetBE32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

void EncodePageKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint32_t block,
                   char* dst) {
  std::memcpy(dst, id.bytes.data(), 16);
  dst[16] = static_cast<char>(layer >> 8);
  dst[17] = static_cast<char>(layer);
  dst[18] = static_cast<char>(kv_head >> 8);
  dst[19] = static_cast<char>(kv_head);
  dst[20] = static_cast<char>(block >> 24);
  dst[21] = static_cast<char>(block >> 16);
  dst[22] = static_cast<char>(block >> 8);
  dst[23] = static_cast<char>(block);
}

std::string PageKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint32_t block) {
  std::string k(kPageKeySize, '\0');
  EncodePageKey(id, layer, kv_head, block, k.data());
  return k;
}

std::string ArtifactKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint8_t kind,
                        uint32_t chunk) {
  std::string k;
  k.reserve(kArtifactKeySize);
  k.append(id.AsBytes());
  PutBE16(&k, layer);
  PutBE16(&k, kv_head);
  k.push_back(static_cast<char>(kind));
  PutBE32(&k, chunk);
  return k;
}

std::string TokenKey(const ContextId& id, uint32_t chunk) {
  std::string k;
  k.reserve(kTokenKeySize);
  k.append(id.AsBytes());
  PutBE32(&k, chunk);
  return k;
}

std::string ManifestKey(const ContextId& id) {
  std::string k(1, kManifestTag);
  k.append(id.AsBytes());
  return k;
}

std::string FormatVersionKey() { return std::string(1, kFormatVersionTag); }

bool ParsePageKey(std::string_view key, PageKeyParts* out) {
  if (key.size() != kPageKeySize) return false;
  std::memcpy(out->id.bytes.data(), key.data(), 16);
  out->layer = GetBE16(key.data() + 16);
  out->kv_head = GetBE16(key.data() + 18);
  out->block = GetBE32(key.data() + 20);
  return true;
}

bool ParseContextPrefix(std::string_view key, ContextId* out) {
  if (key.size() < 16) return false;
  std::memcpy(out->bytes.data(), key.data(), 16);
  return true;
}

bool ParseManifestKey(std::string_view key, ContextId* out) {
  if (key.size() != 17 || key[0] != kManifestTag) return false;
  std::memcpy(out->bytes.data(), key.data() + 1, 16);
  return true;
}

std::string ContextRangeBegin(const ContextId& id) { return std::string(id.AsBytes()); }

std::string ContextRangeEnd(const ContextId& id) {
  std::string end(id.AsBytes());
  for (int i = 15; i >= 0; --i) {
    auto c = static_cast<uint8_t>(end[i]);
    if (c != 0xFF) {
      end[i] = static_cast<char>(c + 1);
      end.resize(i + 1);  // shortest successor of every key with this prefix
      return end;
    }
  }
  // id = ff..ff: every key we write is at most 25 bytes, so 32 0xFF bytes
  // sort after all of them.
  return std::string(32, '\xFF');
}

Status ContextNotFoundError(const ContextId& id) {
  return NotFoundError("context " + id.ToHex() + " not found");
}

}  // namespace ctxcache::storage
