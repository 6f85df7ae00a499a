#include "storage/page_codec.h"

#include <zstd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "common/byte_order.h"
#include "common/crc32c.h"

namespace ctxcache::storage {
namespace {

struct ZstdContexts {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  std::vector<uint8_t> scratch;
  ~ZstdContexts() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }
};

ZstdContexts& ThreadContexts() {
  thread_local ZstdContexts ctx;
  return ctx;
}

}  // namespace

std::string_view PageCodecName(PageCodec codec) {
  switch (codec) {
    case PageCodec::kNone:
      return "none";
    case PageCodec::kZstd:
      return "zstd";
    case PageCodec::kZstdShuffle:
      return "zstd_shuffle";
  }
  return "unknown";
}

StatusOr<PageCodec> ParsePageCodec(std::string_view name) {
  if (name == "none") return PageCodec::kNone;
  if (name == "zstd") return PageCodec::kZstd;
  if (name == "zstd_shuffle" || name == "zstd+shuffle") return PageCodec::kZstdShuffle;
  return InvalidArgumentError("page codec: expected none|zstd|zstd_shuffle, got '" +
                              std::string(name) + "'");
}

bool IsValidPageCodec(int value) { return value >= 0 && value <= 2; }

void ShuffleBytes(const uint8_t* src, uint8_t* dst, size_t n, size_t elem_size) {
  if (elem_size == 2) {
    for (size_t i = 0; i < n; ++i) {
      dst[i] = src[2 * i];
      dst[n + i] = src[2 * i + 1];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < elem_size; ++j) dst[j * n + i] = src[i * elem_size + j];
  }
}

void UnshuffleBytes(const uint8_t* src, uint8_t* dst, size_t n, size_t elem_size) {
  if (elem_size == 2) {
    for (size_t i = 0; i < n; ++i) {
      dst[2 * i] = src[i];
      dst[2 * i + 1] = src[n + i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < elem_size; ++j) dst[i * elem_size + j] = src[j * n + i];
  }
}

namespace {

Status CheckShape(const PageShape& shape, size_t raw_size) {
  if (!IsValidDType(static_cast<int>(shape.dtype))) {
    return InvalidArgumentError("page dtype: expected f32|f16|bf16");
  }
  if (shape.n_tokens == 0 || shape.n_tokens > 0xFFFF) {
    return InvalidArgumentError("page n_tokens: expected 1..65535, got " +
                                std::to_string(shape.n_tokens));
  }
  if (shape.head_dim == 0 || shape.head_dim > 0xFFFF) {
    return InvalidArgumentError("page head_dim: expected 1..65535, got " +
                                std::to_string(shape.head_dim));
  }
  if (raw_size != shape.RawBytes()) {
    return InvalidArgumentError("page payload: expected " + std::to_string(shape.RawBytes()) +
                                " bytes (2*n_tokens*head_dim*dtype_size), got " +
                                std::to_string(raw_size));
  }
  return Status::OK();
}

void WriteHeader(const PageShape& shape, PageCodec codec, std::string_view raw, char* h) {
  h[0] = static_cast<char>(kPageMagic);
  h[1] = static_cast<char>(kPageFormatVersion);
  h[2] = static_cast<char>(shape.dtype);
  h[3] = static_cast<char>(codec);
  PutLE16(h + 4, static_cast<uint16_t>(shape.n_tokens));
  PutLE16(h + 6, static_cast<uint16_t>(shape.head_dim));
  PutLE32(h + 8, static_cast<uint32_t>(raw.size()));
  PutLE32(h + 12, crc32c::Value(raw));
}

}  // namespace

StatusOr<std::string_view> EncodeRawPageInPlace(const PageShape& shape, char* buf) {
  RETURN_IF_ERROR(CheckShape(shape, shape.RawBytes()));
  WriteHeader(shape, PageCodec::kNone, std::string_view(buf + kPageHeaderSize, shape.RawBytes()),
              buf);
  return std::string_view(buf, kPageHeaderSize + shape.RawBytes());
}

Status EncodePage(const PageCodecOptions& options, const PageShape& shape, std::string_view raw,
                  std::string* out) {
  RETURN_IF_ERROR(CheckShape(shape, raw.size()));
  if (!IsValidPageCodec(static_cast<int>(options.codec))) {
    return InvalidArgumentError("page codec: unknown value");
  }
  const size_t base = out->size();
  out->resize(base + kPageHeaderSize);
  WriteHeader(shape, options.codec, raw, out->data() + base);

  if (options.codec == PageCodec::kNone) {
    out->append(raw);
    return Status::OK();
  }
  ZstdContexts& z = ThreadContexts();
  const void* src = raw.data();
  if (options.codec == PageCodec::kZstdShuffle) {
    z.scratch.resize(raw.size());
    size_t esize = DTypeSize(shape.dtype);
    ShuffleBytes(reinterpret_cast<const uint8_t*>(raw.data()), z.scratch.data(), raw.size() / esize,
                 esize);
    src = z.scratch.data();
  }
  size_t bound = ZSTD_compressBound(raw.size());
  out->resize(base + kPageHeaderSize + bound);
  size_t n = ZSTD_compressCCtx(z.cctx, out->data() + base + kPageHeaderSize, bound, src, raw.size(),
                               options.zstd_level);
  if (ZSTD_isError(n)) {
    out->resize(base);
    return InternalError(std::string("zstd compress: ") + ZSTD_getErrorName(n));
  }
  out->resize(base + kPageHeaderSize + n);
  return Status::OK();
}

Status ParsePageHeader(std::string_view encoded, PageHeader* header) {
  if (encoded.size() < kPageHeaderSize) {
    return DataLossError("page value too short (" + std::to_string(encoded.size()) + " bytes)");
  }
  const char* h = encoded.data();
  if (static_cast<uint8_t>(h[0]) != kPageMagic) return DataLossError("bad page magic");
  if (static_cast<uint8_t>(h[1]) != kPageFormatVersion) {
    return DataLossError("unknown page format version " +
                         std::to_string(static_cast<uint8_t>(h[1])));
  }
  if (!IsValidDType(static_cast<uint8_t>(h[2]))) return DataLossError("bad page dtype");
  if (!IsValidPageCodec(static_cast<uint8_t>(h[3]))) return DataLossError("bad page codec");
  header->shape.dtype = static_cast<DType>(h[2]);
  header->codec = static_cast<PageCodec>(h[3]);
  header->shape.n_tokens = GetLE16(h + 4);
  header->shape.head_dim = GetLE16(h + 6);
  header->raw_bytes = GetLE32(h + 8);
  header->crc32c = GetLE32(h + 12);
  if (header->shape.n_tokens == 0 || header->shape.head_dim == 0 ||
      header->raw_bytes != header->shape.RawBytes()) {
    return DataLossError("inconsistent page header");
  }
  if (header->codec == PageCodec::kNone && encoded.size() != kPageHeaderSize + header->raw_bytes) {
    return DataLossError("page value size mismatch");
  }
  return Status::OK();
}

Status DecodePage(std::string_view encoded, void* dst, size_t dst_capacity, PageHeader* header) {
  RETURN_IF_ERROR(ParsePageHeader(encoded, header));
  if (dst_capacity < header->raw_bytes) {
    return InvalidArgumentError("page buffer: need " + std::to_string(header->raw_bytes) +
                                " bytes, have " + std::to_string(dst_capacity));
  }
  std::string_view body = encoded.substr(kPageHeaderSize);
  auto* out = static_cast<uint8_t*>(dst);
  if (header->codec == PageCodec::kNone) {
    std::memcpy(out, body.data(), body.size());
  } else {
    ZstdContexts& z = ThreadContexts();
    uint8_t* target = out;
    if (header->codec == PageCodec::kZstdShuffle) {
      z.scratch.resize(header->raw_bytes);
      target = z.scratch.data();
    }
    size_t n = ZSTD_decompressDCtx(z.dctx, target, header->raw_bytes, body.data(), body.size());
    if (ZSTD_isError(n) || n != header->raw_bytes) {
      return DataLossError(std::string("page payload does not decompress: ") +
                           (ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short output"));
    }
    if (header->codec == PageCodec::kZstdShuffle) {
      size_t esize = DTypeSize(header->shape.dtype);
      UnshuffleBytes(target, out, header->raw_bytes / esize, esize);
    }
  }
  uint32_t crc = crc32c::Value(out, header->raw_bytes);
  if (crc != header->crc32c) {
    return DataLossError("page checksum mismatch (stored crc32c " + std::to_string(header->crc32c) +
                         ", computed " + std::to_string(crc) + ")");
  }
  return Status::OK();
}

StatusOr<std::string_view> DecodePageView(std::string_view encoded, std::string* scratch,
                                          PageHeader* header) {
  RETURN_IF_ERROR(ParsePageHeader(encoded, header));
  std::string_view raw;
  if (header->codec == PageCodec::kNone) {
    raw = encoded.substr(kPageHeaderSize);  // ParsePageHeader checked its size
    const uint32_t crc = crc32c::Value(raw.data(), raw.size());
    if (crc != header->crc32c) {
      return DataLossError("page checksum mismatch (stored crc32c " +
                           std::to_string(header->crc32c) + ", computed " + std::to_string(crc) +
                           ")");
    }
    return raw;
  }
  scratch->resize(header->raw_bytes);
  RETURN_IF_ERROR(DecodePage(encoded, scratch->data(), scratch->size(), header));
  return std::string_view(*scratch);
}

}  // namespace ctxcache::storage
