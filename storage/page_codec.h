// KV page codec: the value stored for one page in the "pages" column family.
//
// A page holds the K and V of up to B consecutive tokens of one
// (layer, kv_head). Raw payload layout (little-endian elements):
//   K[n_tokens][head_dim] then V[n_tokens][head_dim]
// Encoded value = 16-byte header + payload (raw, or one zstd frame):
//   0  u8   magic 0x4B ('K')
//   1  u8   page format version (1)
//   2  u8   dtype (common/dtype.h DType value: 0 f32, 1 f16, 2 bf16)
//   3  u8   codec (PageCodec value)
//   4  u16  n_tokens (LE)
//   6  u16  head_dim (LE)
//   8  u32  raw payload size in bytes (LE) = 2 * n_tokens * head_dim * sizeof(dtype)
//   12 u32  crc32c of the raw payload (LE)
// DecodePage checks every header field and the crc32c; any mismatch is
// DATA_LOSS, and the caller's buffer then holds unspecified bytes that must
// not be handed out.
//
// Thread-safety: all functions are thread-safe (zstd contexts and scratch
// buffers are thread_local).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"

namespace ctxcache::storage {

// Values are stored on disk and equal ctxcache.v1.PageCodec.
enum class PageCodec : uint8_t {
  kNone = 0,
  kZstd = 1,
  // zstd over byte planes: byte 0 of every element, then byte 1, ...
  kZstdShuffle = 2,
};

std::string_view PageCodecName(PageCodec codec);  // "none", "zstd", "zstd_shuffle"
StatusOr<PageCodec> ParsePageCodec(std::string_view name);
bool IsValidPageCodec(int value);

inline constexpr size_t kPageHeaderSize = 16;
inline constexpr uint8_t kPageMagic = 0x4B;
inline constexpr uint8_t kPageFormatVersion = 1;

struct PageShape {
  DType dtype = DType::kBF16;
  uint32_t n_tokens = 0;  // 1..65535
  uint32_t head_dim = 0;  // 1..65535

  // 2 * n_tokens * head_dim * DTypeSize(dtype).
  size_t RawBytes() const { return 2 * size_t{n_tokens} * head_dim * DTypeSize(dtype); }
};

struct PageCodecOptions {
  // Default: none. zstd_shuffle trades CPU on every write and read for disk
  // bytes (ratios and costs: docs/benchmarks.md); use it where capacity
  // matters more than CPU.
  PageCodec codec = PageCodec::kNone;
  // zstd compression level (1..19; negative = fast modes). Default: 1.
  int zstd_level = 1;
};

struct PageHeader {
  PageShape shape;
  PageCodec codec = PageCodec::kNone;
  uint32_t raw_bytes = 0;
  uint32_t crc32c = 0;
};

// Encodes a page whose raw payload (K rows then V rows, shape.RawBytes()
// bytes) is at `raw`. Appends nothing on error. INVALID_ARGUMENT for a bad
// shape or size.
Status EncodePage(const PageCodecOptions& options, const PageShape& shape, std::string_view raw,
                  std::string* out);

// The codec-none encoding without a copy: buf[kPageHeaderSize,
// kPageHeaderSize + shape.RawBytes()) holds the raw payload; the header is
// written into buf[0, kPageHeaderSize) and the encoded page returned is a
// view of buf[0, kPageHeaderSize + shape.RawBytes()). Same bytes as
// EncodePage with PageCodec::kNone. INVALID_ARGUMENT for a bad shape.
StatusOr<std::string_view> EncodeRawPageInPlace(const PageShape& shape, char* buf);

// Parses and checks the header only (DATA_LOSS if malformed).
Status ParsePageHeader(std::string_view encoded, PageHeader* header);

// Decodes `encoded` into dst[0, header.raw_bytes). `dst_capacity` must be
// >= raw_bytes (else INVALID_ARGUMENT). Verifies the crc32c: DATA_LOSS on
// any corruption. The message names no context; callers prepend it.
Status DecodePage(std::string_view encoded, void* dst, size_t dst_capacity, PageHeader* header);

// The verified raw payload of `encoded` without a copy where it can: a view
// into `encoded` for codec none, else decoded into *scratch (resized) and a
// view of that. Same checks and errors as DecodePage.
StatusOr<std::string_view> DecodePageView(std::string_view encoded, std::string* scratch,
                                          PageHeader* header);

// Byte-plane shuffle of n elements of `elem_size` bytes: dst[j*n + i] =
// src[i*elem_size + j]. Unshuffle is the inverse.
void ShuffleBytes(const uint8_t* src, uint8_t* dst, size_t n, size_t elem_size);
void UnshuffleBytes(const uint8_t* src, uint8_t* dst, size_t n, size_t elem_size);

}  // namespace ctxcache::storage
