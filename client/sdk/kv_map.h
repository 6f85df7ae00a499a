// Client::MapKV (client/include/ctxcache/client.h): the MapKV stream, the
// hand-over of the segment's fd over the server's Unix socket, the
// read-only mapping and its layer-ready tracking.
//
// Thread-safety: OpenKVMapping is reentrant; a KVMapping is safe for
// concurrent use.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client::internal {

StatusOr<std::unique_ptr<KVMapping>> OpenKVMapping(const ClientOptions& options,
                                                   v1::DecodeService::Stub* stub,
                                                   const std::string& context_id,
                                                   const std::vector<uint32_t>& layers);

}  // namespace ctxcache::client::internal
