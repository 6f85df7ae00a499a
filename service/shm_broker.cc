#include "service/shm_broker.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace ctxcache::service {

namespace {

constexpr size_t kTokenChars = 32;

std::string RandomToken() {
  uint8_t bytes[kTokenChars / 2];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<ShmBroker>> ShmBroker::Start(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgumentError("--shm-socket: '" + path + "' must have 1 to " +
                                std::to_string(sizeof(addr.sun_path) - 1) + " characters");
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return UnavailableError("--shm-socket: socket: " + std::string(strerror(errno)));
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), 0660) != 0 || listen(fd, 64) != 0) {
    const std::string err = strerror(errno);
    close(fd);
    return UnavailableError("--shm-socket: cannot listen on '" + path + "': " + err);
  }
  return std::unique_ptr<ShmBroker>(new ShmBroker(path, fd));
}

ShmBroker::ShmBroker(std::string path, int listen_fd)
    : path_(std::move(path)), listen_fd_(listen_fd) {
  thread_ = std::thread([this] { Serve(); });
}

ShmBroker::~ShmBroker() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  close(listen_fd_);
  unlink(path_.c_str());
  for (auto& [token, fd] : offers_) close(fd);
}

std::string ShmBroker::Offer(int fd) {
  std::string token = RandomToken();
  std::lock_guard<std::mutex> l(mu_);
  offers_[token] = fd;
  return token;
}

bool ShmBroker::WaitRedeemed(const std::string& token, const std::function<bool()>& give_up) {
  std::unique_lock<std::mutex> l(mu_);
  while (offers_.count(token) != 0) {
    if (stop_ || give_up()) return false;
    cv_.wait_for(l, std::chrono::milliseconds(50));
  }
  return true;
}

void ShmBroker::Withdraw(const std::string& token) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = offers_.find(token);
  if (it == offers_.end()) return;
  close(it->second);
  offers_.erase(it);
}

size_t ShmBroker::pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return offers_.size();
}

void ShmBroker::Serve() {
  for (;;) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stop_) return;
    }
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    Answer(conn);
    close(conn);
  }
}

// Reads a token (2 s to send it) and replies one byte: 'K' with the
// segment's fd attached, or 'E' (unknown, redeemed or withdrawn token).
void ShmBroker::Answer(int conn) {
  timeval tv{2, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  char buf[kTokenChars];
  size_t got = 0;
  while (got < kTokenChars) {
    ssize_t n = recv(conn, buf + got, kTokenChars - got, 0);
    if (n <= 0) return;
    got += static_cast<size_t>(n);
  }
  int fd = -1;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = offers_.find(std::string(buf, kTokenChars));
    if (it != offers_.end()) {
      fd = it->second;
      offers_.erase(it);
    }
  }
  char reply = fd >= 0 ? 'K' : 'E';
  iovec iov{&reply, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
  if (fd >= 0) close(fd);  // the worker holds it now (or nobody: the segment goes)
  cv_.notify_all();
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

Status ShmSegment::Create(uint64_t size) {
  auto fail = [&](const char* what) {
    return ResourceExhaustedError("MapKV: cannot " + std::string(what) + " a shared segment of " +
                                  std::to_string(size) + " bytes: " + strerror(errno));
  };
  fd_ = memfd_create("ctxcache-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) return fail("create");
  if (ftruncate(fd_, static_cast<off_t>(size)) != 0) return fail("size");
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) return fail("map");
  data_ = static_cast<uint8_t*>(p);
  size_ = size;
  // From here only this mapping writes: no new writable mapping, write(),
  // resize, or reopen through /proc for writing (Linux 5.1+; an older
  // kernel leaves the segment unsealed, and ShmCache does not keep it).
  sealed_ = fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) == 0;
  return Status::OK();
}

int ShmSegment::DupFd() const { return fcntl(fd_, F_DUPFD_CLOEXEC, 0); }

int ShmSegment::ReleaseFd() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

}  // namespace ctxcache::service
