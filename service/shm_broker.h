// ShmBroker: hands shared-memory segments (memfd) to workers on this host
// over a Unix socket, for MapKV.
//
// The RPC that authorized a read creates a segment and Offer()s its file
// descriptor: the broker returns a one-time token (128 random bits, hex)
// that the RPC sends to its client. The client connects to the socket,
// writes the 32-character token and receives the descriptor (SCM_RIGHTS).
// A token is redeemed at most once and is withdrawn when its RPC ends, so
// only the caller the RPC authorized (key, tenant) can take the segment, and
// no segment has a name another process could open. The kernel frees a
// segment when the last descriptor and mapping of it go: the broker's with
// the RPC, the worker's when it unmaps or dies.
//
// Thread-safety: safe for concurrent use. One accept thread serves the
// socket, one connection at a time (each a token read and a reply).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"

namespace ctxcache::service {

class ShmBroker {
 public:
  // Listens on `path` (created with mode 0660, replacing a stale socket
  // file). INVALID_ARGUMENT for a path longer than a Unix socket allows;
  // UNAVAILABLE when it cannot listen.
  static StatusOr<std::unique_ptr<ShmBroker>> Start(const std::string& path);
  ~ShmBroker();  // stops serving, removes the socket file, closes offered fds
  ShmBroker(const ShmBroker&) = delete;
  ShmBroker& operator=(const ShmBroker&) = delete;

  const std::string& path() const { return path_; }

  // Takes ownership of `fd`; returns the token that redeems it.
  std::string Offer(int fd);
  // Blocks until `token` was redeemed (true), or `give_up()` returns true
  // (checked every 50 ms; false).
  bool WaitRedeemed(const std::string& token, const std::function<bool()>& give_up);
  // Drops an offer not redeemed (closing its fd); no-op for a redeemed one.
  void Withdraw(const std::string& token);
  // Offers not yet redeemed or withdrawn.
  size_t pending() const;

 private:
  ShmBroker(std::string path, int listen_fd);
  void Serve();
  void Answer(int conn);

  const std::string path_;
  const int listen_fd_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, int> offers_;  // guarded by mu_: token -> fd
  bool stop_ = false;                  // guarded by mu_
  std::thread thread_;
};

// A memfd segment mapped read-write into this process, to fill and then
// Offer. Not thread-safe; the mapping goes with the object.
class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // RESOURCE_EXHAUSTED (with the size) when the segment cannot be had.
  Status Create(uint64_t size);
  uint8_t* data() { return data_; }
  // True when only data()'s mapping can write the segment: nobody else
  // (holders of its fd included) can write, map it writable or resize it.
  bool sealed() const { return sealed_; }
  // A new fd of the segment (the caller owns it; -1 on failure).
  int DupFd() const;
  // The segment's fd, now the caller's (the mapping stays valid).
  int ReleaseFd();

 private:
  int fd_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool sealed_ = false;
};

}  // namespace ctxcache::service
