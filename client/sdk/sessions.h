// The SDK's two DecodeSession implementations (ctxcache/client.h):
//  - server mode: ctxcached selects and sends the pages (DecodeStream only);
//  - client mode: the session core (session/sparse_session.h) runs here over
//    the fetched index, pages come from the PageCache or FetchPages, and a
//    Prefetcher fetches ahead.
// Both keep a Decode stream open so appended tokens reach the server.
//
// Thread-safety: a session is used by one thread (its prefetch thread is
// internal).
#pragma once

#include <memory>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client::internal {

// client and stub: not owned, outlive the session.
StatusOr<std::unique_ptr<DecodeSession>> OpenServerModeSession(Client* client,
                                                               v1::DecodeService::Stub* stub,
                                                               const SessionOptions& options);
StatusOr<std::unique_ptr<DecodeSession>> OpenClientModeSession(Client* client,
                                                               v1::DecodeService::Stub* stub,
                                                               const SessionOptions& options);

}  // namespace ctxcache::client::internal
