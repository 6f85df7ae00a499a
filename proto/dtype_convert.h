// Conversion between the wire/storage enum ctxcache.v1.DType (0 = unset) and
// common's DType. Header-only, shared by storage/, service/ and client/.
#pragma once

#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"

namespace ctxcache {

// INVALID_ARGUMENT (naming the value) for DTYPE_UNSPECIFIED or unknown values.
inline StatusOr<DType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return DType::kF32;
    case v1::DTYPE_F16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    default:
      return InvalidArgumentError("dtype: expected DTYPE_F32|DTYPE_F16|DTYPE_BF16, got " +
                                  std::to_string(static_cast<int>(dtype)));
  }
}

inline v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::DTYPE_F32;
    case DType::kF16:
      return v1::DTYPE_F16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace ctxcache
