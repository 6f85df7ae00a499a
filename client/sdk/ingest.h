// The ingest stream behind Client::StartIngest (client/include/ctxcache/
// client.h): one IngestContext stream, layers gathered from caller memory
// into frames.
//
// Thread-safety: CheckIngestLayout is reentrant; an IngestStream has one
// writer (see IngestStream).
#pragma once

#include <memory>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client::internal {

// The shape an ingest's layers must have.
struct IngestShape {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t n_q_heads = 0;
  uint32_t head_dim = 0;
  uint64_t n_tokens = 0;     // tokens whose KV the stream carries
  uint64_t token_start = 0;  // the first one's position (a child: the parent's n_tokens)
};

// Checks a layer's layout against the shape: INVALID_ARGUMENT naming the
// field (layout.k_capacity, ...) and the expected value.
Status CheckIngestLayout(const IngestShape& shape, const IngestLayerLayout& layout);

// Opens the stream (writes the header; a server that refuses it answers
// here). `header` is complete: a child's model filled in.
StatusOr<std::unique_ptr<IngestStream>> OpenIngest(const ClientOptions& client,
                                                   v1::ContextAdmin::Stub* admin,
                                                   const v1::IngestHeader& header,
                                                   const IngestShape& shape,
                                                   const IngestOptions& options);

}  // namespace ctxcache::client::internal
