// DecodeStream: the Decode bidi stream of one session, used by both selection
// modes. Open is retried on UNAVAILABLE (client/sdk/retry.h); each request
// gets its response and, for a Step with pages, its page batches.
//
// Thread-safety: one caller at a time (a session's).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client::internal {

class DecodeStream {
 public:
  DecodeStream(v1::DecodeService::Stub* stub, const ClientOptions& options)
      : stub_(stub), options_(options) {}
  ~DecodeStream() { Close().IgnoreError(); }

  // Opens the session; want_pages: the server sends the selected pages.
  StatusOr<v1::ContextInfo> Open(const SessionOptions& session, bool want_pages);
  // One request and its response (with its page batches into *batches when
  // not null). The server's per-request errors come back as their Status.
  StatusOr<v1::DecodeResponse> RoundTrip(v1::DecodeRequest* req,
                                         std::vector<v1::PageBatch>* batches);
  // Sends the new token's K, V [n_layers][n_kv][d] and Q [n_layers][n_q][d]
  // (may be null) as fp32.
  Status Append(const float* k, const float* v, const float* q, const v1::ModelSpec& model);
  Status Close();
  bool closed() const { return closed_; }

 private:
  v1::DecodeService::Stub* stub_;
  const ClientOptions& options_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  uint64_t next_id_ = 1;
  bool closed_ = true;
};

}  // namespace ctxcache::client::internal
