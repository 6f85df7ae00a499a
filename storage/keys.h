// Context ids and the RocksDB key schema (docs/storage-format.md).
//
// All integers in keys are big-endian so that lexicographic order equals
// numeric order: a context's keys in one column family form one contiguous
// range [ctx_id, ctx_id + 1), which DeleteRange and prefix scans rely on.
//
//   pages  : ctx_id(16) | layer(u16) | kv_head(u16) | block(u32)            = 24 bytes
//   index  : ctx_id(16) | layer(u16) | kv_head(u16) | kind(u8) | chunk(u32) = 25 bytes
//   tokens : ctx_id(16) | chunk(u32)                                        = 20 bytes
//   meta   : 'M' | ctx_id(16)  -> ContextManifest (protobuf)
//            'V'               -> format_version (u32 LE)
//
// Thread-safety: pure functions and value types.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ctxcache::storage {

// 16-byte content address of a context.
struct ContextId {
  std::array<uint8_t, 16> bytes{};

  // First 16 bytes of SHA-256(fingerprint || token ids as u32 little-endian).
  static ContextId Compute(std::string_view model_fingerprint, std::span<const uint32_t> tokens);
  // With a namespace (ContextManifest.id_namespace): empty gives the id
  // above; otherwise the first 16 bytes of SHA-256("ctxcache-ns" 0x00 ||
  // u32 LE len(id_namespace) || id_namespace || fingerprint || token ids),
  // so ids in different namespaces never collide with each other or with
  // namespace-less ids.
  static ContextId Compute(std::string_view id_namespace, std::string_view model_fingerprint,
                           std::span<const uint32_t> tokens);
  // Parses 32 lowercase or uppercase hex characters.
  static StatusOr<ContextId> FromHex(std::string_view hex);
  // Takes exactly 16 raw bytes (e.g. ContextManifest.context_id).
  static StatusOr<ContextId> FromBytes(std::string_view raw);

  // 32 lowercase hex characters.
  std::string ToHex() const;
  std::string_view AsBytes() const {
    return std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

  friend auto operator<=>(const ContextId&, const ContextId&) = default;
};

// NOT_FOUND "context <hex> not found": the one message for a context that
// does not exist, which the service also gives for a context the caller may
// not see (so the two cannot be told apart).
Status ContextNotFoundError(const ContextId& id);

struct ContextIdHash {
  size_t operator()(const ContextId& id) const {
    uint64_t h;
    __builtin_memcpy(&h, id.bytes.data(), sizeof(h));
    return static_cast<size_t>(h);
  }
};

// Layer/head value for artifacts that are not per (layer, kv_head).
inline constexpr uint16_t kWholeContext = 0xFFFF;

inline constexpr size_t kPageKeySize = 24;
inline constexpr size_t kArtifactKeySize = 25;
inline constexpr size_t kTokenKeySize = 20;

std::string PageKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint32_t block);
// The same key written to dst[0, kPageKeySize) (no allocation; the reader
// builds a page table's keys in one buffer).
void EncodePageKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint32_t block,
                   char* dst);
std::string ArtifactKey(const ContextId& id, uint16_t layer, uint16_t kv_head, uint8_t kind,
                        uint32_t chunk);
std::string TokenKey(const ContextId& id, uint32_t chunk);
std::string ManifestKey(const ContextId& id);
std::string FormatVersionKey();

// Decoded page key; returns false if `key` is not a page key.
struct PageKeyParts {
  ContextId id;
  uint16_t layer = 0;
  uint16_t kv_head = 0;
  uint32_t block = 0;
};
bool ParsePageKey(std::string_view key, PageKeyParts* out);
// Reads the context id prefix of a pages/index/tokens key (false if too short).
bool ParseContextPrefix(std::string_view key, ContextId* out);
// Reads a manifest key; false if `key` is not one.
bool ParseManifestKey(std::string_view key, ContextId* out);

// [begin, end) covering every key of `id` in the pages, index and tokens
// column families: begin = id, end = the shortest successor of every key with
// that prefix (for id = ff..ff, 32 bytes 0xff, which sorts after every key).
std::string ContextRangeBegin(const ContextId& id);
std::string ContextRangeEnd(const ContextId& id);

// Big-endian helpers.
void PutBE16(std::string* dst, uint16_t v);
void PutBE32(std::string* dst, uint32_t v);
uint16_t GetBE16(const char* p);
uint32_t GetBE32(const char* p);

}  // namespace ctxcache::storage
