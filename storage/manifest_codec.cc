#include "storage/manifest_codec.h"

#include <cstdio>

#include "common/byte_order.h"
#include "common/crc32c.h"

namespace ctxcache::storage {
namespace {

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

}  // namespace

bool IsFramedManifest(std::string_view value) {
  return !value.empty() && static_cast<unsigned char>(value[0]) == kManifestMagic;
}

std::string EncodeManifest(const v1::ContextManifest& m) {
  std::string body = m.SerializeAsString();
  const uint32_t crc = crc32c::Value(body);
  std::string out;
  out.reserve(kManifestHeaderSize + body.size());
  out.push_back(static_cast<char>(kManifestMagic));
  out.push_back(static_cast<char>(kManifestFrameVersion));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(crc >> (8 * i)));
  out += body;
  return out;
}

Status DecodeManifest(std::string_view value, v1::ContextManifest* out) {
  if (!IsFramedManifest(value)) {
    if (!out->ParseFromArray(value.data(), static_cast<int>(value.size()))) {
      return DataLossError("unframed manifest (" + std::to_string(value.size()) +
                           " bytes) does not parse");
    }
    return Status::OK();
  }
  if (value.size() < kManifestHeaderSize) {
    return DataLossError("manifest frame truncated: " + std::to_string(value.size()) + " bytes");
  }
  const auto version = static_cast<unsigned char>(value[1]);
  if (version != kManifestFrameVersion) {
    return DataLossError("manifest frame version " + std::to_string(version) + ", expected " +
                         std::to_string(kManifestFrameVersion));
  }
  std::string_view body = value.substr(kManifestHeaderSize);
  const uint32_t stored = GetLE32(value.data() + 2);
  const uint32_t computed = crc32c::Value(body);
  if (stored != computed) {
    return DataLossError("manifest crc32c mismatch: stored " + Hex32(stored) + ", computed " +
                         Hex32(computed));
  }
  if (!out->ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return DataLossError("manifest body (" + std::to_string(body.size()) +
                         " bytes, crc32c ok) does not parse");
  }
  return Status::OK();
}

}  // namespace ctxcache::storage
