// ConnectionStreams: the streaming calls open on each client connection,
// held under --max-streams-per-connection.
//
// HTTP/2's MAX_CONCURRENT_STREAMS alone makes the call past the limit wait
// inside the client for a free stream, with no error and no server log line.
// So the server advertises a higher HTTP/2 limit (server.cc) and enforces
// this one itself: the streaming call past it fails at once with
// RESOURCE_EXHAUSTED naming the flag.
//
// A connection is known by its peer address (gRPC's ServerContext::peer()).
// Only TCP peers ("ipv4:" / "ipv6:") are counted: every unix-socket client
// has the same peer name, so those connections keep the HTTP/2 limit alone.
//
// Thread-safety: safe for concurrent use without external synchronization.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "common/status.h"

namespace ctxcache::service {

class ConnectionStreams {
 public:
  // limit: streams one connection may hold at once (>= 1).
  explicit ConnectionStreams(uint32_t limit) : limit_(limit) {}

  // One admitted stream; gives its place back on destruction.
  class Guard {
   public:
    Guard() = default;
    Guard(Guard&& o) noexcept : owner_(std::exchange(o.owner_, nullptr)), peer_(o.peer_) {}
    Guard& operator=(Guard&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = std::exchange(o.owner_, nullptr);
        peer_ = std::move(o.peer_);
      }
      return *this;
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { Release(); }

   private:
    friend class ConnectionStreams;
    Guard(ConnectionStreams* owner, std::string peer) : owner_(owner), peer_(std::move(peer)) {}
    void Release() {
      if (owner_) owner_->Release(peer_);
      owner_ = nullptr;
    }
    ConnectionStreams* owner_ = nullptr;
    std::string peer_;
  };

  // Takes one of `peer`'s streams. RESOURCE_EXHAUSTED naming the limit when
  // the connection holds `limit` already; an uncounted peer always passes.
  StatusOr<Guard> Admit(const std::string& peer) {
    if (peer.rfind("ipv4:", 0) != 0 && peer.rfind("ipv6:", 0) != 0) return Guard();
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t& n = open_[peer];
    if (n >= limit_) {
      return ResourceExhaustedError(
          "this connection already has " + std::to_string(n) +
          " streaming calls open (limit --max-streams-per-connection=" + std::to_string(limit_) +
          "); close one, or open more sessions on another channel (docs/api.md, \"Many "
          "sessions from one worker\")");
    }
    ++n;
    return Guard(this, peer);
  }

  // Streams `peer` holds now (for tests).
  uint32_t open(const std::string& peer) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(peer);
    return it == open_.end() ? 0 : it->second;
  }

 private:
  void Release(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(peer);
    if (it != open_.end() && --it->second == 0) open_.erase(it);
  }

  const uint32_t limit_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, uint32_t> open_;  // GUARDED_BY(mu_)
};

}  // namespace ctxcache::service
