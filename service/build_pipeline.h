// The offline build: tokens -> chunked prefill (model/) -> KV pages
// (storage::ContextWriter) + index artifacts (index/ selectors, built per
// (layer, kv head) in parallel once the prefill is done) -> atomic commit.
//
// Memory: the prefill's KvCache (the context's KV in bf16), the pooled
// prefill queries kept for query-centric indexes (bf16, at most
// BuildOptions::query_cap rows per (layer, kv head), always including the
// last 32 positions for LFPS), and the writer's bounded buffer.
//
// Thread-safety: RunBuild may run concurrently for different jobs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/large_buffer.h"
#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "index/selector.h"
#include "model/model.h"
#include "service/model_registry.h"
#include "storage/context_writer.h"
#include "storage/store.h"

namespace ctxcache::service {

struct IndexRequest {
  std::string method;
  index::MethodParams params;
};

struct BuildJob {
  std::shared_ptr<const LoadedModel> model;
  // All tokens of the context (for an extend: the parent's then the new ones).
  std::vector<int32_t> tokens;
  // Extend: the parent context (its tokens must be a prefix of `tokens`).
  std::optional<storage::ContextId> parent;
  std::vector<IndexRequest> indexes;
  std::string name;
  std::string tenant;
  // storage::BuildRequest::id_namespace and provenance (service/access.h).
  std::string id_namespace;
  v1::Provenance provenance = v1::PROVENANCE_BUILT;
  std::map<std::string, std::string> labels;
  int64_t ttl_ms = 0;
  bool pinned = false;
  // Called right before the commit with the bytes the new context stores;
  // an error aborts the build (nothing stays stored). Quotas use it.
  std::function<Status(uint64_t bytes)> before_commit;
};

struct BuildOptions {
  // Prefill chunk size, tokens. Default: 512.
  int prefill_chunk = 512;
  // Prefill query rows kept per (layer, kv head) for index builds. Default: 65536.
  int64_t query_cap = 65536;
};

// Where a build stands; the handler sends it as v1::BuildProgress
// (service/wire.h).
struct BuildProgress {
  enum class Phase { kQueued, kPrefill, kIndexing, kCommitting, kDone };
  Phase phase = Phase::kPrefill;
  uint64_t tokens_total = 0;
  uint64_t tokens_prefilled = 0;
  uint32_t layers_total = 0;
  uint32_t layers_indexed = 0;
  uint64_t bytes_written = 0;
  double tokens_per_s = 0;
  double eta_s = 0;
  uint32_t queue_position = 0;  // kQueued: 1 = next
};

struct BuildOutcome {
  v1::ContextManifest manifest;
  bool reused = false;  // the context already existed; nothing was done
  double prefill_s = 0;
  double index_s = 0;
};

// Shape of the context an index build covers.
struct IndexShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int group_size = 0;
  int64_t n_tokens = 0;
};
// Writes the keys and values of (layer, kv head), n_tokens * head_dim fp32 each;
// k or v is null when no method being built reads it (MethodInfo::reads_keys,
// reads_values), and is then left alone.
using ReadKvFn = std::function<void(int layer, int kv_head, float* k, float* v)>;
// The prefill queries kept for (layer, kv head): [group][rows][d] and positions.
using ReadQueriesFn =
    std::function<void(int layer, int kv_head, std::vector<float>* q, std::vector<int64_t>* pos)>;

// Builds and stores every requested method's artifact (plus the always-built
// reference methods) per (layer, kv head), all items in parallel, and records
// the methods' parameters in the manifest. `layer_done(n)` once layers 0..n-1
// are complete, in order and never concurrently (from any thread).
Status BuildIndexArtifacts(storage::ContextWriter* writer, const IndexShape& shape,
                           const std::vector<IndexRequest>& requested, const ReadKvFn& read_kv,
                           const ReadQueriesFn& read_queries,
                           const std::function<void(int)>& layer_done,
                           const std::atomic<bool>* cancel);

// Validates index requests up front (unknown method, bad params) so a bad
// request fails before any work: INVALID_ARGUMENT naming the method/param.
Status ValidateIndexRequests(const std::vector<IndexRequest>& indexes);

// A build whose tokens are already stored returns the stored context, but
// only if it holds every requested index with the same effective params
// (context-dependent defaults such as csa's C included, resolved for the
// query rows a build samples: a child's from its own tokens). Otherwise
// ALREADY_EXISTS, naming the stored and the requested indexes and the fix
// (evict first, or request the stored indexes).
Status CheckReusable(const v1::ContextManifest& existing,
                     const std::vector<IndexRequest>& requested, int group_size);

// An external engine's prefill (IngestContext): per-layer K/V (and
// optionally Q) chunks in token order, then Commit. Pages are written as the
// chunks arrive. A layer's index builds start as soon as its KV is complete,
// on a thread of the builder's, while later layers' chunks arrive: every
// layer complete by then is built in one parallel loop over its (layer, kv
// head) items on ThreadPool::Default(), so models with few kv heads still
// use every core. A built layer's K/V copy is released, so a client that
// sends layer by layer holds a few layers in memory, not the context.
// Commit waits for the builds. They
// run over the KV as stored (rounded to kv_dtype), with the same query
// sampling as a BuildContext, so both paths produce the same artifacts for
// the same KV.
//
// A child (Header::parent): the chunks carry the KV of the appended tokens
// only, from token first_token() == the parent's n_tokens; the child
// references the parent's pages as an ExtendContext child does
// (storage::BuildRequest::parent). Begin reads the parent's KV as stored,
// since the child's indexes cover every token; queries come from the
// appended tokens only, as in an extend build.
// Memory: the K/V of the layers complete and not yet indexed, in kv_dtype (a
// child's: every layer's, mapped at Begin); none when no method being built
// reads them (streaming, full, oracle).
// Thread-safety: one caller at a time.
class IngestBuilder {
 public:
  struct Header {
    v1::ModelSpec model;  // shape, fingerprint and kv_dtype are required
    // All tokens of the context (for a child: the parent's, then the new ones).
    std::vector<uint32_t> tokens;
    // A child of this READY context, whose tokens must be a prefix of
    // `tokens` and whose model must be `model`. Default: none.
    std::optional<storage::ContextId> parent;
    std::vector<IndexRequest> indexes;
    std::string name;
    std::string tenant;
    std::string id_namespace;
    v1::Provenance provenance = v1::PROVENANCE_INGESTED;
    std::map<std::string, std::string> labels;
    int64_t ttl_ms = 0;
    bool pinned = false;
    // As BuildJob::before_commit.
    std::function<Status(uint64_t bytes)> before_commit;
  };

  // Validates the header (InvalidArgument naming the field) and begins the
  // build. When the context is already stored, reused() is true and
  // existing() holds it (after CheckReusable against the requested indexes).
  static StatusOr<std::unique_ptr<IngestBuilder>> Begin(storage::Store* store, Header header,
                                                        const BuildOptions& options);
  ~IngestBuilder();  // aborts an uncommitted build: nothing stays stored

  bool reused() const { return !writer_; }
  const v1::ContextManifest& existing() const { return existing_; }
  int n_layers() const { return spec_.n_layers; }
  int n_q_heads() const { return spec_.n_q_heads; }
  int n_kv_heads() const { return spec_.n_kv_heads; }
  int head_dim() const { return spec_.head_dim; }
  // The first token the chunks carry: 0, or a child's parent's n_tokens.
  int64_t first_token() const { return first_token_; }

  // Tokens [token_start, token_start + n) of `layer`: k and v
  // [n_kv_heads][n][head_dim], q [n_q_heads][n][head_dim] or null, fp32.
  // Chunks of a layer must be contiguous and in order from first_token()
  // (InvalidArgument).
  Status AddChunk(int layer, int64_t token_start, int64_t n, const float* k, const float* v,
                  const float* q);
  // The same with k and v already in the context's kv dtype (kv_dtype()),
  // as they are stored: no conversion, one copy (what a client sends when
  // its wire dtype is the model's kv_dtype). No queries.
  Status AddStoredChunk(int layer, int64_t token_start, int64_t n, const void* k,
                        const void* v);
  DType kv_dtype() const { return kv_dtype_; }
  // Layers whose index builds are done (progress; they run in the background).
  int layers_indexed();
  // Blocks until n layers' index builds are done (or one failed: its
  // status). FailedPrecondition when fewer than n layers are complete.
  Status WaitForIndexes(int n);
  // Waits for the index builds and flips the context to READY.
  // FailedPrecondition when a layer is incomplete; a failed index build's
  // status (also returned by the next AddChunk once it is known).
  StatusOr<v1::ContextManifest> Commit();
  // Removes everything written.
  void Abort();

 private:
  IngestBuilder() = default;
  class Queries;
  model::ModelSpec spec_;
  DType kv_dtype_ = DType::kBF16;
  int64_t n_tokens_ = 0;
  int64_t first_token_ = 0;
  std::vector<IndexRequest> indexes_;
  std::function<Status(uint64_t)> before_commit_;
  std::unique_ptr<storage::ContextWriter> writer_;
  v1::ContextManifest existing_;
  std::vector<int64_t> next_;                     // per layer: the next token expected
  // Checks a chunk's layer and token range against what the layer expects.
  Status CheckChunk(int layer, int64_t token_start, int64_t n) const;
  // Stores rows [token_start, token_start + n) of every kv head of `layer`,
  // k and v [n_kv_heads][n][head_dim] in kv_dtype_, and keeps them for the
  // index build (keep_keys_, keep_values_).
  Status StoreChunk(int layer, int64_t token_start, int64_t n, const void* k, const void* v);
  // [layer * n_kv + head]: the context's K and V as stored (kv_dtype_), for
  // the index build; head_bytes_ each (n_tokens_ * head_dim elements),
  // mapped when the layer's first chunk arrives (a child's at Begin, with
  // the parent's KV), filled in token order, and moved to spare_ once the
  // layer's indexes are built (no regrowth; the kernel's zero fill only for
  // buffers not reused). keys_/vals_ slots of a layer are touched by one
  // thread at a time: the chunks' until complete, then the build's.
  std::vector<MappedBytes> keys_, vals_;
  // Whether a method being built reads the stored K (V) (KvReadBy): when
  // not, keys_ (vals_) stay empty and nothing is copied into them.
  bool keep_keys_ = true, keep_values_ = true;
  // The kept buffers of slot [layer * n_kv + head]: keys_ and/or vals_.
  std::vector<MappedBytes*> Kept(size_t slot);
  size_t head_bytes_ = 0;
  std::vector<MappedBytes> spare_;  // guarded by index_mu_
  Status MapLayer(int layer);       // fills the layer's slots (ResourceExhausted)
  std::unique_ptr<Queries> queries_;
  std::vector<uint8_t> kc_, vc_;

  // Per-layer index builds (see the class comment).
  IndexShape index_shape() const;
  ReadQueriesFn read_queries() const;  // the sampled prefill queries (queries_)
  void LayerComplete(int layer);  // queues the layer's build
  void RunIndexBuilds();          // index_thread_'s loop
  Status IndexStatus();           // the first failed build's status, else OK
  void StopIndexBuilds();         // cancels queued and running builds, joins
  std::vector<IndexRequest> methods_;  // indexes_ plus the always-built methods
  std::mutex index_mu_;
  std::condition_variable index_cv_;
  std::deque<int> index_queue_;  // guarded by index_mu_: layers complete, not yet built
  int layers_indexed_ = 0;       // guarded by index_mu_
  bool index_stop_ = false;      // guarded by index_mu_
  Status index_status_;          // guarded by index_mu_
  std::atomic<bool> index_cancel_{false};
  std::thread index_thread_;
};

// Runs a build. `progress` (may be empty) is called from this thread;
// `cancel` (may be null) aborts the build with CANCELLED and removes
// everything written.
StatusOr<BuildOutcome> RunBuild(storage::Store* store, const BuildJob& job,
                                const BuildOptions& options,
                                const std::function<void(const BuildProgress&)>& progress,
                                const std::atomic<bool>* cancel);

}  // namespace ctxcache::service
