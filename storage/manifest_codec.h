// Framing of the ContextManifest values stored in the meta column family
// (docs/storage-format.md, "Manifest values").
//
//   byte 0     0xC7  magic: a protobuf value can never start with it (its
//                    low three bits are wire type 7, which does not exist)
//   byte 1     0x01  frame version
//   bytes 2-5  u32   crc32c of bytes 6.. (little-endian)
//   bytes 6..        the serialized v1::ContextManifest
//
// Values written before the framing (a bare serialized manifest) are still
// read; they carry no checksum, so only a parse failure detects their
// corruption.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"

namespace ctxcache::storage {

inline constexpr unsigned char kManifestMagic = 0xC7;
inline constexpr unsigned char kManifestFrameVersion = 1;
inline constexpr size_t kManifestHeaderSize = 6;

// Serializes and frames `m`.
std::string EncodeManifest(const v1::ContextManifest& m);

// Parses a stored value (framed or legacy unframed) into *out. DATA_LOSS with
// the reason if the crc32c does not match, the frame is truncated or of an
// unknown version, or the body does not parse.
Status DecodeManifest(std::string_view value, v1::ContextManifest* out);

// Whether `value` is framed (starts with the magic byte).
bool IsFramedManifest(std::string_view value);

}  // namespace ctxcache::storage
