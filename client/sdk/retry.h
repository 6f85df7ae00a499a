// The SDK's gRPC status handling: the one conversion of a grpc::Status to a
// Status, call deadlines, and the one retry loop (a call that fails with UNAVAILABLE: server
// down, restarting or draining, is retried with exponential backoff).
//
// Thread-safety: stateless; reentrant.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <random>
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

// A call's status for the caller: UNAVAILABLE says which server could not
// be reached; anything else is FromGrpc's.
inline Status FromGrpcCall(const ClientOptions& options, const grpc::Status& s,
                           const std::string& what) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return UnavailableError("cannot reach ctxcached at " + options.server + " (" +
                            s.error_message() + ")");
  }
  return FromGrpc(s, what);
}

// A call deadline `seconds` from now.
inline std::chrono::system_clock::time_point DeadlineAfter(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

inline bool IsUnavailable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE;
}
inline bool IsUnavailable(const Status& s) { return s.code() == StatusCode::kUnavailable; }
template <typename T>
bool IsUnavailable(const StatusOr<T>& s) {
  return !s.ok() && s.status().code() == StatusCode::kUnavailable;
}

// A delay in [bound / 2, bound], uniformly: clients that failed together do
// not retry together.
inline double JitteredBackoff(double bound) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return std::uniform_real_distribution<double>(bound / 2, bound)(rng);
}

// Runs attempt() until it returns something other than UNAVAILABLE, at most
// options.max_attempts times (at least once), sleeping JitteredBackoff(b)
// between tries, b = options.initial_backoff_s doubled each time up to 5 s.
// Only for idempotent calls (EvictContext is not retried). Returns the last
// result.
template <typename Fn>
auto RetryUnavailable(const ClientOptions& options, Fn attempt) -> decltype(attempt()) {
  double backoff = options.initial_backoff_s;
  const int attempts = std::max(1, options.max_attempts);
  for (int i = 1;; ++i) {
    auto result = attempt();
    if (!IsUnavailable(result) || i >= attempts) return result;
    std::this_thread::sleep_for(
        std::chrono::microseconds(static_cast<int64_t>(JitteredBackoff(backoff) * 1e6)));
    backoff = std::min(5.0, backoff * 2);
  }
}

}  // namespace ctxcache::client::internal
