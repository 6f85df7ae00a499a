// Index methods persisted per (layer, kv head), and their kind bytes in the
// store's key schema (docs/storage-format.md). The reference methods (full,
// oracle, streaming) keep only a small header and are always built, so a
// decode session can open any method on any context; csa, tactic, lfps and
// quest are built when requested.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ctxcache::service {

inline std::optional<uint8_t> ArtifactKind(std::string_view method) {
  if (method == "csa") return 1;
  if (method == "tactic") return 2;
  if (method == "lfps") return 3;
  if (method == "quest") return 4;
  if (method == "full") return 5;
  if (method == "oracle") return 6;
  if (method == "streaming") return 7;
  return std::nullopt;
}

inline constexpr std::array<std::string_view, 3> kAlwaysBuiltMethods = {"full", "oracle",
                                                                        "streaming"};

}  // namespace ctxcache::service
