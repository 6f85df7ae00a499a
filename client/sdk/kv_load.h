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

// Checks a FetchKV frame against the context and each page's crc32c, then
// copies its pages (a run, or the pages KVFrame.blocks lists) into `dense`
// (a layout with its zero strides filled in) at layer slot `slot`.
// DATA_LOSS naming the frame or page otherwise.
Status PlaceFrame(const v1::ContextInfo& info, const KVLayout& dense, int64_t slot,
                  const v1::KVFrame& f);

// One FetchKV call on `stub` for the page tables of `request` (checked by
// CheckPageTables; layout by CheckKVLoad for every layer, layer slot =
// layer): each frame's pages written into `layout` where a bulk load puts
// them. DATA_LOSS for a corrupted page or a short answer.
Status FetchTablesInto(const ClientOptions& client, v1::DecodeService::Stub* stub,
                       const v1::ContextInfo& info, const v1::FetchPagesRequest& request,
                       const KVLayout& layout);

// Stream i's stub (i < options.streams); called from the load's threads,
// so it must be safe for concurrent use and outlive the load.
using KVStubFor = std::function<v1::DecodeService::Stub*(int stream)>;

// Starts a load already checked by CheckKVLoad.
std::unique_ptr<KVLoad> StartKVLoad(const ClientOptions& client, const v1::ContextInfo& info,
                                    std::vector<uint32_t> layers, const KVLoadOptions& options,
                                    const KVLayout& layout, KVStubFor stubs);

}  // namespace ctxcache::client::internal
