#include "client/sdk/kv_map.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "client/sdk/channel.h"
#include "client/sdk/retry.h"

namespace ctxcache::client::internal {

namespace {

// Connects to the server's socket, sends the token and receives the
// segment's fd.
StatusOr<int> TakeSegment(const std::string& path, const std::string& token) {
  auto fail = [&](const std::string& what) {
    return UnavailableError("MapKV: cannot take the segment from " + path + " (" + what +
                            "); MapKV needs the worker on the server's host: use LoadKV");
  };
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return fail("path too long");
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return fail(strerror(errno));
  timeval tv{10, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      send(s, token.data(), token.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(token.size())) {
    const std::string err = strerror(errno);
    close(s);
    return fail(err);
  }
  char reply = 0;
  iovec iov{&reply, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  close(s);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n != 1 || reply != 'K' || fd < 0) {
    if (fd >= 0) close(fd);
    return PermissionDeniedError("MapKV: the server refused the segment's token");
  }
  return fd;
}

class KVMappingImpl final : public KVMapping {
 public:
  KVMappingImpl(std::unique_ptr<grpc::ClientContext> ctx,
                std::unique_ptr<grpc::ClientReader<v1::MapKVProgress>> reader, uint8_t* data,
                uint64_t size, KVMapLayout layout, uint32_t n_layers)
      : ctx_(std::move(ctx)),
        reader_(std::move(reader)),
        data_(data),
        size_(size),
        layout_(std::move(layout)),
        ready_(n_layers, false),
        mapped_(n_layers, false) {
    for (uint32_t l : layout_.layers) mapped_[l] = true;
    thread_ = std::thread([this] { Follow(); });
  }

  ~KVMappingImpl() override {
    ctx_->TryCancel();
    thread_.join();
    munmap(data_, size_);
  }

  Status WaitLayer(uint32_t layer) override {
    if (layer >= mapped_.size() || !mapped_[layer]) {
      return InvalidArgumentError("layer: " + std::to_string(layer) + " is not one of the " +
                                  std::to_string(layout_.layers.size()) + " layers mapped");
    }
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return ready_[layer] || finished_; });
    return ready_[layer] ? Status::OK() : (status_.ok() ? DataLossError(Missing(layer)) : status_);
  }

  Status Wait() override {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return finished_; });
    if (!status_.ok()) return status_;
    for (uint32_t layer : layout_.layers) {
      if (!ready_[layer]) return DataLossError(Missing(layer));
    }
    return Status::OK();
  }

  const uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  const KVMapLayout& layout() const override { return layout_; }

 private:
  static std::string Missing(uint32_t layer) {
    return "MapKV: the call ended without layer " + std::to_string(layer);
  }

  void Follow() {
    v1::MapKVProgress p;
    while (reader_->Read(&p)) {
      if (p.msg_case() != v1::MapKVProgress::kLayerReady || p.layer_ready() >= ready_.size()) {
        continue;
      }
      std::lock_guard<std::mutex> l(mu_);
      ready_[p.layer_ready()] = true;
      cv_.notify_all();
    }
    grpc::Status s = reader_->Finish();
    std::lock_guard<std::mutex> l(mu_);
    status_ = FromGrpc(s, "MapKV");
    finished_ = true;
    cv_.notify_all();
  }

  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReader<v1::MapKVProgress>> reader_;
  uint8_t* const data_;
  const uint64_t size_;
  const KVMapLayout layout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> ready_;   // guarded by mu_: by context layer
  std::vector<bool> mapped_;  // by context layer; set before the thread starts
  bool finished_ = false;     // guarded by mu_
  Status status_;             // guarded by mu_
  std::thread thread_;
};

}  // namespace

StatusOr<std::unique_ptr<KVMapping>> OpenKVMapping(const ClientOptions& options,
                                                   v1::DecodeService::Stub* stub,
                                                   const std::string& context_id,
                                                   const std::vector<uint32_t>& layers) {
  v1::MapKVRequest req;
  req.set_context_id(context_id);
  req.mutable_layers()->Add(layers.begin(), layers.end());
  auto ctx = std::make_unique<grpc::ClientContext>();
  // The fill of a large context takes a while: the deadline bounds the whole call.
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(static_cast<int64_t>(options.timeout_s * 1e6) *
                                              static_cast<int64_t>(std::max<size_t>(
                                                  1, layers.empty() ? 32 : layers.size()))));
  AddCallCredentials(options, ctx.get());
  auto reader = stub->MapKV(ctx.get(), req);
  v1::MapKVProgress first;
  if (!reader->Read(&first) || first.msg_case() != v1::MapKVProgress::kSegment) {
    grpc::Status s = reader->Finish();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      return UnavailableError("MapKV: cannot reach ctxcached at " + options.server + " (" +
                              s.error_message() + ")");
    }
    if (!s.ok()) return FromGrpc(s, "MapKV");
    return InternalError("MapKV: the call ended without a segment");
  }
  const v1::KVSegment& seg = first.segment();
  auto taken = TakeSegment(seg.socket_path(), seg.token());
  if (!taken.ok()) {
    ctx->TryCancel();
    (void)reader->Finish();
    return taken.status();
  }
  const int fd = *taken;
  struct stat st {};
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= seg.size() && seg.size() > 0) {
    p = mmap(nullptr, seg.size(), PROT_READ, MAP_SHARED, fd, 0);
  }
  close(fd);  // the mapping keeps the segment
  if (p == MAP_FAILED) {
    ctx->TryCancel();
    (void)reader->Finish();
    return DataLossError("MapKV: cannot map the segment of " + std::to_string(seg.size()) +
                         " bytes");
  }
  KVMapLayout layout;
  layout.layer_stride = seg.layer_stride();
  layout.head_stride = seg.head_stride();
  layout.token_stride = seg.token_stride();
  layout.v_offset = seg.v_offset();
  layout.n_tokens = seg.n_tokens();
  layout.n_kv_heads = seg.n_kv_heads();
  layout.head_dim = seg.head_dim();
  layout.dtype = seg.dtype();
  const uint64_t slots = seg.layer_stride() ? seg.size() / seg.layer_stride() : 0;
  layout.layers = layers;
  if (layout.layers.empty()) {
    for (uint32_t l = 0; l < slots; ++l) layout.layers.push_back(l);
  }
  uint32_t n_layers = 0;
  for (uint32_t l : layout.layers) n_layers = std::max(n_layers, l + 1);
  return std::unique_ptr<KVMapping>(new KVMappingImpl(std::move(ctx), std::move(reader),
                                                      static_cast<uint8_t*>(p), seg.size(),
                                                      std::move(layout), n_layers));
}

}  // namespace ctxcache::client::internal
