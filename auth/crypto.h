// Small cryptographic helpers for credentials: HMAC-SHA256 (RFC 2104),
// secure random bytes and a constant-time comparison.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/sha256.h"
#include "common/status.h"

namespace ctxcache::auth {

// HMAC-SHA256(key, message).
Sha256::Digest HmacSha256(std::string_view key, std::string_view message);

// n bytes from the kernel's CSPRNG (getrandom(2)); INTERNAL if it fails.
StatusOr<std::string> RandomBytes(size_t n);

// True when a == b. Runs in time that depends only on the lengths, so a
// caller comparing secrets of a fixed length leaks nothing by timing.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

// Lower-case hex <-> bytes. FromHex fails (INVALID_ARGUMENT naming `what`)
// on odd length or a non-hex character.
std::string HexEncode(std::string_view bytes);
StatusOr<std::string> HexDecode(std::string_view hex, std::string_view what);

}  // namespace ctxcache::auth
