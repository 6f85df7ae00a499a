// ctxcache C++ SDK: admin calls and decode sessions against ctxcached.
//
//   auto client = ctxcache::client::Client::Connect({.server = "127.0.0.1:7700"});
//   auto info = (*client)->Build(request, on_progress);
//   auto session = (*client)->OpenSession({.context_id = info->context_id(), .method = "csa"});
//   for each layer: (*session)->Step(layer, queries, &selected);   // selection + KV
//   (*session)->Append(k, v, q);                                    // streaming update
//
// Every call has a deadline (ClientOptions::timeout_s). Unary calls and
// stream opens are retried with exponential backoff on UNAVAILABLE. Every
// page received is checked against its crc32c (DATA_LOSS on mismatch).
//
// Thread-safety: Client is safe for concurrent use (one channel, many
// calls). A DecodeSession is NOT: use one per decode stream / thread. A
// DecodeSession, KVLoad or IngestStream must not outlive its Client. (In
// client mode a session runs its own background prefetch thread; that is
// internal and does not change this rule.)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"

namespace ctxcache::client {

struct ClientOptions {
  // ctxcached address, HOST:PORT; or etcd://host:port[,host:port...]/<cluster>
  // for a cluster (docs/cluster.md): calls are routed to a node holding
  // their context and decode sessions fail over mid-session. Default:
  // 127.0.0.1:7700.
  std::string server = "127.0.0.1:7700";
  // With an etcd:// server: the cluster's --replicas, to compute owners.
  // Default: 2.
  uint32_t cluster_replicas = 2;
  // Deadline of each unary call and of each session message, seconds. Default: 30.
  double timeout_s = 30.0;
  // Attempts for idempotent calls failing with UNAVAILABLE (1 = no retry;
  // Evict is never retried). Default: 5.
  int max_attempts = 5;
  // Bound of the first retry delay, doubled each attempt (capped at 5 s);
  // each delay is drawn uniformly from [bound / 2, bound]. Default: 0.1 s.
  double initial_backoff_s = 0.1;
  // Max gRPC message size received, bytes. Default: 16 MiB.
  int max_message_bytes = 16 << 20;
  // TLS (docs/security.md): the CA bundle (PEM file) the server's
  // certificate must chain to; set = TLS. Default: "" (plaintext).
  std::string tls_ca;
  // Client certificate chain and private key (PEM files) for mTLS.
  // Default: "" (none).
  std::string tls_cert;
  std::string tls_key;
  // Name to verify the server's certificate against instead of the host in
  // `server`. Default: "".
  std::string tls_server_name;
  // API key, sent as "authorization: Bearer <key>" on every call.
  // Default: "" (none).
  std::string api_key;
  // Decode sessions (one stream each) per connection. Sessions go on
  // connections of their own (never the client's, which stays free for the
  // other calls), opened as needed. At most the server's
  // --max-streams-per-connection. Default: 256 (the server's default).
  int sessions_per_connection = 256;
};

enum class SelectMode {
  // One round trip per layer-step: the server selects and returns pages.
  kServer,
  // FetchIndex once, select locally with index/, FetchPages for pages the
  // local page cache does not hold.
  kClient,
};

struct SessionOptions {
  std::string context_id;
  // csa | tactic | lfps | quest | streaming | oracle | full
  std::string method = "csa";
  // Session params, e.g. {"rho", "0.05"} (see docs/api.md).
  std::map<std::string, std::string> params;
  SelectMode mode = SelectMode::kServer;
  // Byte budget of the local page cache (immutable stored pages; LRU).
  // Default: 256 MiB.
  size_t page_cache_bytes = 256u << 20;
  // Client mode only: prefetch pages into the page cache on a background
  // thread. Enables DecodeSession::Prefetch (a no-op when false), the
  // automatic next-layer prefetch of query-independent methods (streaming,
  // full: Step(l) prefetches layer l+1) and the reference worker's
  // speculative prefetch (client/worker/decode_worker.h). Prefetch never
  // changes selections or results, only where pages come from. Default:
  // false: it pays when fetches wait on a network, not when the server
  // shares the worker's CPUs (docs/benchmarks.md).
  bool prefetch = false;
};

// The selected context tokens of one layer-step and their K/V (fp32).
struct SelectedKV {
  struct Head {
    // Union over the kv head's q heads, sorted; K and V are [ids.size()][d].
    std::vector<int32_t> ids;
    std::vector<float> k, v;
    // Per q head of this kv head's group: its own selection (subset of ids).
    std::vector<std::vector<int32_t>> per_q_head;
    // Per q head (parallel to per_q_head): the estimated attention mass its
    // selection captures, in [0, 1] (HeadSelection.estimated_mass, docs/api.md);
    // empty when the method gives no estimate.
    std::vector<float> estimated_mass;
    // The pages fetched for this kv head: the union of its block-union page
    // tables (all subgroups), sorted.
    std::vector<uint32_t> pages;
  };
  std::vector<Head> heads;  // one per kv head
  // Bytes of page payload received from the server for this step.
  uint64_t bytes_received = 0;
  // Pages served from the local page cache.
  uint64_t cache_hits = 0;
  uint64_t pages = 0;
};

struct PageCacheStats {
  // Look-ups by Step (including key gathers of exact-scoring methods).
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t bytes = 0;  // bytes held now (decoded fp32), <= page_cache_bytes
  uint64_t evictions = 0;
  // Prefetch (client mode, SessionOptions::prefetch).
  uint64_t prefetch_requests = 0;        // prefetch jobs run (explicit and automatic)
  uint64_t prefetched_pages = 0;         // pages a prefetch fetched into the cache
  uint64_t prefetched_bytes = 0;         // their page payload bytes received (wire)
  uint64_t prefetch_hits = 0;            // pages a Step found in the cache because a
                                         // prefetch brought them (first use only)
  uint64_t prefetch_hit_bytes = 0;       // payload bytes of those pages; the wasted
                                         // prefetch bytes are prefetched_bytes - this
  uint64_t prefetch_failures = 0;        // prefetch jobs that failed (Step fetched itself)
  double prefetch_wait_seconds = 0;      // time Steps waited for an in-flight prefetch
  uint64_t prefetch_selector_bytes = 0;  // prediction selector copies (MemoryBytes at clone)
};

// Caller-owned memory that a KV load fills in place (a pinned torch tensor,
// a numpy array, shared memory). With layer slot i = the i-th layer loaded
// (KVLoadOptions::layers), element (i, kv head h, token t, dim j) of K is
// the element at byte offset
//   i * layer_stride + h * head_stride + t * token_stride + j * element size
// from `k`, and V's likewise from `v`. Strides of 0 mean the dense layout
// [layer slots][n_kv_heads][n_tokens][head_dim]. Every element written lies
// inside [k, k + k_capacity) and [v, v + v_capacity), or the load is refused
// with INVALID_ARGUMENT naming the field and nothing is written.
struct KVLayout {
  void* k = nullptr;
  void* v = nullptr;
  size_t k_capacity = 0;  // bytes
  size_t v_capacity = 0;  // bytes
  int64_t layer_stride = 0;  // bytes; >= 0
  int64_t head_stride = 0;   // bytes; >= 0
  int64_t token_stride = 0;  // bytes; 0 or >= head_dim * element size
  // What the buffers hold; must equal the context's kv dtype (bytes are
  // copied as stored, never converted). Default: bf16.
  v1::DType dtype = v1::DTYPE_BF16;
};

struct KVLoadOptions {
  // Layers to load, in layer-slot order; no repeats. Default: empty = all,
  // ascending.
  std::vector<uint32_t> layers;
  // Concurrent FetchKV streams, each on a connection of its own; each
  // stream loads one layer at a time. Default: 4.
  int streams = 4;
  // Payload bytes per frame (FetchKVRequest.frame_bytes). Default: 4 MiB.
  uint32_t frame_bytes = 4u << 20;
};

struct KVLoadProgress {
  uint64_t bytes_done = 0;   // K+V payload bytes written into the buffers
  uint64_t bytes_total = 0;  // of all requested layers
  uint32_t layers_done = 0;
  uint32_t layers_total = 0;
  uint64_t frames = 0;
  double seconds = 0;  // since the load started (to the end, once finished)
};

// A KV load running in the background (Client::StartLoadKV): layers arrive
// in the order asked, except that a layer somebody waits for or prioritizes
// is taken next. Every page is checked against its crc32c before it is
// written; a mismatch fails the load with DATA_LOSS naming the page.
// Safe for concurrent use. Destroying it cancels what is left and waits for
// the streams to stop (the buffers are no longer touched after that).
class KVLoad {
 public:
  virtual ~KVLoad() = default;
  // Moves `layer` (a context layer number) to the front of the queue.
  // INVALID_ARGUMENT when it is not one of the load's layers.
  virtual Status Prioritize(uint32_t layer) = 0;
  // Blocks until `layer` is in the buffers (prioritizing it), or the load
  // failed (its status).
  virtual Status WaitLayer(uint32_t layer) = 0;
  // Blocks until every layer is in, or the first failure.
  virtual Status Wait() = 0;
  // Stops early: streams end after their current frame; Wait returns
  // CANCELLED.
  virtual void Cancel() = 0;
  // True once finished (done, failed or cancelled).
  virtual bool done() const = 0;
  virtual KVLoadProgress progress() const = 0;
};

// Where a KVMapping holds each element: K of (layer slot i, kv head h,
// token t, dim j) at byte offset i * layer_stride + h * head_stride +
// t * token_stride + j * element size from data(); V at the same plus
// v_offset. Layer slot i is the i-th layer mapped.
struct KVMapLayout {
  uint64_t layer_stride = 0;
  uint64_t head_stride = 0;
  uint64_t token_stride = 0;
  uint64_t v_offset = 0;
  uint64_t n_tokens = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  v1::DType dtype = v1::DTYPE_BF16;
  std::vector<uint32_t> layers;  // slot order
};

// A context's K and V in shared memory (Client::MapKV), mapped read-only
// into this process; the server fills it layer by layer. Safe for
// concurrent use. Destroying it cancels a fill in progress and unmaps (the
// kernel frees the segment once no process maps it).
class KVMapping {
 public:
  virtual ~KVMapping() = default;
  // Blocks until `layer` (a context layer number) is in the segment, or the
  // fill failed (its status). INVALID_ARGUMENT for a layer not mapped.
  virtual Status WaitLayer(uint32_t layer) = 0;
  // Blocks until every layer is in, or the first failure.
  virtual Status Wait() = 0;
  virtual const uint8_t* data() const = 0;
  virtual uint64_t size() const = 0;
  virtual const KVMapLayout& layout() const = 0;
};

// Caller memory holding one layer's post-RoPE K, V and (optionally) Q for
// IngestStream::WriteLayer, with n = the header's token count: element
// (kv head h, token t, dim j) of K is at byte offset h * head_stride +
// t * token_stride + j * element size from `k`, V's likewise from `v`, and
// Q's (q head h) at h * q_head_stride + t * q_token_stride + j * element
// size from `q`. Strides of 0 mean the dense layout [heads][n][head_dim].
// Every element read lies inside [k, k + k_capacity) (v, q likewise), or
// the layer is refused with INVALID_ARGUMENT naming the field and nothing
// is sent.
struct IngestLayerLayout {
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q = nullptr;  // null: no queries (query-centric indexes need them)
  size_t k_capacity = 0;    // bytes
  size_t v_capacity = 0;    // bytes
  size_t q_capacity = 0;    // bytes
  int64_t head_stride = 0;     // bytes, K and V; >= 0
  int64_t token_stride = 0;    // bytes, K and V; 0 or >= head_dim * element size
  int64_t q_head_stride = 0;   // bytes; >= 0
  int64_t q_token_stride = 0;  // bytes; 0 or >= head_dim * element size
  // What k, v and q hold: f32, f16 or bf16. Sent as is; the server stores
  // the model's kv_dtype (no conversion when they are equal and there is no
  // q). Default: bf16.
  v1::DType dtype = v1::DTYPE_BF16;
};

struct IngestOptions {
  // Payload bytes per IngestChunk message; the server's
  // --max-message-bytes (default 8 MiB) bounds a message. Default: 4 MiB.
  uint32_t frame_bytes = 4u << 20;
  // Deadline of the whole stream, seconds. Default: 0 = max(timeout_s, 3600).
  double timeout_s = 0;
  // A child's parent's n_tokens when the caller knows it (its chunks count
  // from the parent's end), saving a GetContext unless the header lacks a
  // model. Default: -1 = ask the server.
  int64_t parent_tokens = -1;
};

// One ingest (IngestContext) in progress: layers go to the server as they
// are written, in frames of IngestOptions::frame_bytes, each copied once
// from the caller's memory into its message. Not retried: a failure ends
// the stream and nothing is stored. Destroying it before Commit cancels it
// (nothing is stored). Not thread-safe: one writer.
class IngestStream {
 public:
  virtual ~IngestStream() = default;
  // Sends layer `layer`'s K, V (and Q): layers must come in order, 0 first.
  // A refused layout or an out-of-order layer is INVALID_ARGUMENT naming
  // the field, with nothing sent: the stream stays usable. A server error
  // (e.g. a model mismatch) ends the stream with the server's status.
  virtual Status WriteLayer(uint32_t layer, const IngestLayerLayout& layout) = 0;
  // After the model's n_layers layers: commits and returns the stored
  // context (or the stored one with the same tokens and indexes).
  // FAILED_PRECONDITION before every layer was written.
  virtual StatusOr<v1::ContextInfo> Commit() = 0;
};

class DecodeSession {
 public:
  virtual ~DecodeSession() = default;
  virtual const v1::ContextInfo& context() const = 0;
  // Tokens in the session's sequence (context + appended).
  virtual int64_t n_tokens() const = 0;
  // queries: [n_q_heads][head_dim] fp32 (post-RoPE) of `layer`.
  // In client mode Step first waits for an in-flight prefetch of `layer`
  // (so no page is fetched twice), then fetches what the cache lacks; a
  // failed prefetch never fails a Step. For streaming and full it also
  // starts the prefetch of layer + 1 (SessionOptions::prefetch).
  virtual Status Step(uint32_t layer, const float* queries, SelectedKV* out) = 0;
  // Speculative prefetch of `layer`'s pages for predicted queries
  // ([n_q_heads][head_dim] fp32 post-RoPE, like Step; copied, so the
  // buffer may be reused at once; may be null for streaming and full).
  // Client mode: runs the layer's selection on the predicted queries, with
  // the same budget, page cap and page tables as Step, and fetches the
  // stored pages the page cache lacks on the session's background thread
  // (crc-checked like every page); returns at once. The selection runs on
  // prediction copies of the layer's selectors, so the session's selector
  // state (e.g. the csa search schedule) and thus Step's results are
  // unchanged. Cost: the first Prefetch of a layer deep-copies its
  // selectors (Selector::Clone, about Selector::MemoryBytes() each: the
  // layer's index tables in memory; a few bytes for streaming); the copies
  // then take every Append too. See
  // PageCacheStats::prefetch_selector_bytes. Append waits for in-flight
  // prefetches; Close drops queued ones and waits for the running one.
  // Server mode, or SessionOptions::prefetch false: a no-op returning OK
  // (the server sends pages inline). InvalidArgument for a layer out of
  // range or null queries of a query-dependent method.
  virtual Status Prefetch(uint32_t layer, const float* predicted_queries) = 0;
  // The new token's post-RoPE K, V ([n_layers][n_kv_heads][d]) and Q
  // ([n_layers][n_q_heads][d], may be null).
  virtual Status Append(const float* k, const float* v, const float* q) = 0;
  virtual Status Close() = 0;
  // A snapshot (prefetches may still be in flight).
  virtual PageCacheStats page_cache_stats() const = 0;
};

class Client {
 public:
  static StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  virtual ~Client() = default;

  // Streams progress to `on_progress` (may be empty); returns the final info.
  virtual StatusOr<v1::BuildProgress> Build(
      const v1::BuildContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) = 0;
  virtual StatusOr<v1::BuildProgress> Extend(
      const v1::ExtendContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) = 0;
  virtual StatusOr<v1::ContextInfo> GetContext(const std::string& context_id) = 0;
  virtual StatusOr<v1::ListContextsResponse> ListContexts(
      const v1::ListContextsRequest& request) = 0;
  virtual StatusOr<v1::EvictContextResponse> Evict(const std::string& context_id) = 0;
  virtual StatusOr<v1::ContextInfo> Pin(const std::string& context_id, bool pinned) = 0;
  // Admin (its own tenant's contexts) or operator (any): make a context
  // readable by every tenant (or undo it).
  virtual StatusOr<v1::ContextInfo> Share(const std::string& context_id, bool shared) = 0;
  virtual StatusOr<v1::ServerStats> GetStats() = 0;
  // Calls on_event for each event until it returns false, the server ends
  // the stream, or max_seconds pass (0 = no limit).
  virtual Status Watch(const v1::WatchRequest& request,
                       const std::function<bool(const v1::ContextEvent&)>& on_event,
                       double max_seconds) = 0;
  // Serialized index artifacts for client-side selection: key (layer, kv head),
  // of `layers` (empty = every layer; INVALID_ARGUMENT for one out of range).
  virtual StatusOr<std::map<std::pair<uint32_t, uint32_t>, std::string>> FetchIndex(
      const std::string& context_id, const std::string& method,
      const std::vector<uint32_t>& layers) = 0;
  // Every layer's.
  StatusOr<std::map<std::pair<uint32_t, uint32_t>, std::string>> FetchIndex(
      const std::string& context_id, const std::string& method) {
    return FetchIndex(context_id, method, {});
  }
  // Pages for the given tables, crc-checked.
  virtual Status FetchPages(const v1::FetchPagesRequest& request, std::vector<v1::Page>* pages) = 0;

  // Bulk load of a READY context's K and V into caller memory (KVLayout),
  // in large frames over options.streams connections (FetchKV). Validates
  // the layout against the context first (INVALID_ARGUMENT naming the field,
  // nothing written). The buffers must stay valid until the load is done or
  // destroyed.
  virtual StatusOr<std::unique_ptr<KVLoad>> StartLoadKV(const std::string& context_id,
                                                        const KVLoadOptions& options,
                                                        const KVLayout& layout) = 0;
  // Same-host bulk load (MapKV): the server copies the layers' K and V
  // (`layers` in slot order; empty = all) into a shared-memory segment and
  // hands it over its Unix socket; no byte crosses gRPC. Returns once the
  // segment is mapped, while the server still fills it (WaitLayer).
  // UNAVAILABLE when the server's socket cannot be reached (the worker is
  // on another host: use StartLoadKV); FAILED_PRECONDITION when the server
  // has MapKV off. One attempt, no retry. The call's deadline, fill
  // included, is ClientOptions::timeout_s per layer mapped (32 layers' worth
  // when `layers` is empty).
  virtual StatusOr<std::unique_ptr<KVMapping>> MapKV(const std::string& context_id,
                                                     const std::vector<uint32_t>& layers) = 0;
  // StartLoadKV, then Wait. `progress` (may be null) gets the final counts.
  Status LoadKV(const std::string& context_id, const KVLoadOptions& options,
                const KVLayout& layout, KVLoadProgress* progress = nullptr);
  // The pages of `request`'s tables written in place into `layout`, a
  // layout of the whole context (layer slot i = layer i): each page's K and
  // V rows land at its tokens' rows, where a bulk load of every layer puts
  // them; rows of pages not asked for are left untouched. One FetchKV call
  // with page tables (pages in large frames, each page's crc32c checked),
  // on one of the bulk connections; call it concurrently for more. For a
  // worker that fills its host tier on demand (the pages a step selects)
  // before, or beside, a bulk load. Checked before anything is written: the
  // layout as StartLoadKV checks it for every layer, and each table's
  // layer, kv head and blocks (in range, strictly increasing),
  // INVALID_ARGUMENT naming the field. A page whose crc32c fails is
  // DATA_LOSS (pages before it may have been written).
  virtual Status FetchPagesInto(const v1::FetchPagesRequest& request, const KVLayout& layout) = 0;

  // Stores a context from KV computed elsewhere (IngestContext; docs/api.md):
  // `header` as the first message of the stream (its model and tokens; with
  // parent_id, a child of that context, the tokens then being the appended
  // ones and a missing model the parent's), then IngestStream::WriteLayer
  // per layer and Commit. INVALID_ARGUMENT naming the field for a header
  // without tokens or with a zero model dimension; the server's errors.
  virtual StatusOr<std::unique_ptr<IngestStream>> StartIngest(const v1::IngestHeader& header,
                                                              const IngestOptions& options) = 0;

  virtual StatusOr<std::unique_ptr<DecodeSession>> OpenSession(const SessionOptions& options) = 0;

  virtual const ClientOptions& options() const = 0;
};

}  // namespace ctxcache::client
