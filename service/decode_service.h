// DecodeService: decode sessions with server-side sparse selection and
// streaming updates, page and index fetch for client-side selection, and
// context lifecycle events. See docs/api.md.
//
// Thread-safety: gRPC calls the handlers concurrently; each Decode stream
// owns its session; shared state lives in ServiceContext.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "service/kv_frames.h"
#include "service/service_context.h"

namespace ctxcache::service {

class DecodeServiceImpl final : public v1::DecodeService::Service {
 public:
  explicit DecodeServiceImpl(ServiceContext* ctx);
  ~DecodeServiceImpl() override;

  grpc::Status Decode(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override;
  grpc::Status FetchIndex(grpc::ServerContext* context, const v1::FetchIndexRequest* request,
                          grpc::ServerWriter<v1::IndexChunk>* writer) override;
  grpc::Status FetchPages(grpc::ServerContext* context, const v1::FetchPagesRequest* request,
                          grpc::ServerWriter<v1::PageBatch>* writer) override;
  grpc::Status FetchKV(grpc::ServerContext* context, const v1::FetchKVRequest* request,
                       grpc::ServerWriter<v1::KVFrame>* writer) override;
  grpc::Status MapKV(grpc::ServerContext* context, const v1::MapKVRequest* request,
                     grpc::ServerWriter<v1::MapKVProgress>* writer) override;
  grpc::Status WatchContexts(grpc::ServerContext* context, const v1::WatchRequest* request,
                             grpc::ServerWriter<v1::ContextEvent>* writer) override;

  // Cancels every open stream (shutdown).
  void CancelAll();

 private:
  struct LiveStream {
    grpc::ServerContext* context;
    std::atomic<int64_t> last_activity_ms;
    int64_t started_ms = 0;
    std::atomic<bool> opened{false};  // an Open arrived on it
  };
  void ReaperLoop();

  ServiceContext* ctx_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                                                     // guarded by mu_
  std::unordered_map<LiveStream*, std::unique_ptr<LiveStream>> streams_;  // guarded by mu_
  std::thread reaper_;
  FramePool frames_;  // FetchKV's frames, reused across calls
};

}  // namespace ctxcache::service
