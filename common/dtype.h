// Element types for tensors at rest and on the wire, and fast conversion
// between them.
//
// bf16 conversion rounds to nearest, ties to even; NaN stays NaN (quiet),
// +-Inf stays +-Inf. fp16 conversion is IEEE 754 binary16 with round to
// nearest even, including subnormals, overflow to Inf and NaN. The bulk
// converters use AVX2/F16C (part of the x86-64-v3 baseline).
//
// Thread-safety: all functions are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace ctxcache {

// Values are stable: they are stored on disk and sent on the wire.
enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
};

// Bytes per element: 4, 2, 2.
size_t DTypeSize(DType dtype);
// "f32", "f16", "bf16".
std::string_view DTypeName(DType dtype);
// Accepts "f32"/"fp32"/"float32", "f16"/"fp16"/"float16", "bf16"/"bfloat16".
StatusOr<DType> ParseDType(std::string_view name);
// Checks that a raw byte value is a known DType.
bool IsValidDType(int value);

// Scalar conversions.
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t x);
uint16_t FloatToHalf(float x);
float HalfToFloat(uint16_t x);

// Bulk conversions. `n` elements; src and dst must not overlap.
void FloatToBf16(const float* src, uint16_t* dst, size_t n);
void Bf16ToFloat(const uint16_t* src, float* dst, size_t n);
void FloatToHalf(const float* src, uint16_t* dst, size_t n);
void HalfToFloat(const uint16_t* src, float* dst, size_t n);

// Converts `n` elements of `dtype` at `src` to fp32 at `dst`. `src` needs
// no alignment (here and in Bf16ToFloat / HalfToFloat): it may point into
// file bytes at any offset.
void ConvertToFloat(DType dtype, const void* src, float* dst, size_t n);
// Converts `n` fp32 elements to `dtype` at `dst` (n * DTypeSize(dtype) bytes).
void ConvertFromFloat(DType dtype, const float* src, void* dst, size_t n);

// True if any of the n floats is NaN or +-Inf.
bool HasNonFinite(const float* x, size_t n);
// The same for n elements of `dtype` at `x` (no alignment needed), read
// as stored: the exponent bits, no conversion.
bool HasNonFinite(DType dtype, const void* x, size_t n);

}  // namespace ctxcache
