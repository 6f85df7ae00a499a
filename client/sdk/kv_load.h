// The bulk KV load behind Client::StartLoadKV (client/include/ctxcache/
// client.h): FetchKV streams on connections of their own, frames checked
// against their pages' crc32c and copied once into the caller's buffers.
//
// Thread-safety: CheckKVLayout is reentrant; the KVLoad it starts is safe
// for concurrent use (see KVLoad).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client::internal {

// The layers a load covers (options.layers, or all) after checking them,
// the options and the layout against the context: INVALID_ARGUMENT naming
// the field and the expected value.
StatusOr<std::vector<uint32_t>> CheckKVLoad(const v1::ContextInfo& info,
                                            const KVLoadOptions& options, const KVLayout& layout);

// Each table of a FetchPages request against the context: its layer and
// kv head in range, its blocks in range and strictly increasing, at least
// one table; INVALID_ARGUMENT naming the field (tables[i].blocks[j]).
Status CheckPageTables(const v1::ContextInfo& info, const v1::FetchPagesRequest& request);

// Writes `pages` (FetchPages' answer to `request`, crc32c-checked by it)
// into `layout` (checked by CheckKVLoad for every layer; layer slot =
// layer): K and V rows of each page at its tokens' rows. DATA_LOSS when
// the pages are not the request's, in its order.
Status ScatterPages(const v1::ContextInfo& info, const v1::FetchPagesRequest& request,
                    const std::vector<v1::Page>& pages, const KVLayout& layout);

// Stream i's stub (i < options.streams); called from the load's threads,
// so it must be safe for concurrent use and outlive the load.
using KVStubFor = std::function<v1::DecodeService::Stub*(int stream)>;

// Starts a load already checked by CheckKVLoad.
std::unique_ptr<KVLoad> StartKVLoad(const ClientOptions& client, const v1::ContextInfo& info,
                                    std::vector<uint32_t> layers, const KVLoadOptions& options,
                                    const KVLayout& layout, KVStubFor stubs);

}  // namespace ctxcache::client::internal
