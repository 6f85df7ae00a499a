// The SDK's gRPC status handling: the one conversion of a grpc::Status to a
// Status, and the one retry loop (a call that fails with UNAVAILABLE: server
// down, restarting or draining, is retried with exponential backoff).
//
// Thread-safety: stateless; reentrant.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "common/status.h"
#include "ctxcache/client.h"

namespace ctxcache::client::internal {

// `what`: the RPC, prefixed to the server's message.
inline Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  return Status(static_cast<StatusCode>(s.error_code()), what + ": " + s.error_message());
}

inline bool IsUnavailable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE;
}
inline bool IsUnavailable(const Status& s) { return s.code() == StatusCode::kUnavailable; }
template <typename T>
bool IsUnavailable(const StatusOr<T>& s) {
  return !s.ok() && s.status().code() == StatusCode::kUnavailable;
}

// Runs attempt() until it returns something other than UNAVAILABLE, at most
// options.max_attempts times (at least once), sleeping
// options.initial_backoff_s between tries, doubled each time up to 5 s.
// Returns the last result.
template <typename Fn>
auto RetryUnavailable(const ClientOptions& options, Fn attempt) -> decltype(attempt()) {
  double backoff = options.initial_backoff_s;
  const int attempts = std::max(1, options.max_attempts);
  for (int i = 1;; ++i) {
    auto result = attempt();
    if (!IsUnavailable(result) || i >= attempts) return result;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(backoff * 1e6)));
    backoff = std::min(5.0, backoff * 2);
  }
}

}  // namespace ctxcache::client::internal
