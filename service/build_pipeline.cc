#include "service/build_pipeline.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <span>

#include "common/dtype.h"
#include "common/thread_pool.h"
#include "model/kv_cache.h"
#include "model/prefill.h"
#include "index/methods.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"

namespace ctxcache::service {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The store's request for a build of `tokens` with the metadata of `job`
// (a BuildJob or an IngestBuilder::Header: the same field names).
template <typename Job>
storage::BuildRequest StoreRequest(const v1::ModelSpec& model, std::span<const uint32_t> tokens,
                                   const Job& job) {
  storage::BuildRequest req;
  req.model = model;
  req.tokens = tokens;
  req.name = job.name;
  req.tenant = job.tenant;
  req.id_namespace = job.id_namespace;
  req.provenance = job.provenance;
  req.labels = job.labels;
  req.ttl_ms = job.ttl_ms;
  req.pinned = job.pinned;
  return req;
}

// Writes each chunk's K/V to the context writer as bf16 pages.
class PageSink final : public model::PrefillSink {
 public:
  PageSink(storage::ContextWriter* writer, int n_kv_heads, int head_dim)
      : writer_(writer), n_kv_(n_kv_heads), d_(head_dim) {}

  Status OnChunk(int layer, int64_t pos0, int64_t n, const float*, const float* k,
                 const float* v) override {
    const size_t per_head = static_cast<size_t>(n) * d_;
    kb_.resize(per_head);
    vb_.resize(per_head);
    for (int h = 0; h < n_kv_; ++h) {
      FloatToBf16(k + h * per_head, kb_.data(), per_head);
      FloatToBf16(v + h * per_head, vb_.data(), per_head);
      RETURN_IF_ERROR(writer_->AppendKV(static_cast<uint32_t>(layer), static_cast<uint32_t>(h),
                                        static_cast<uint64_t>(pos0), static_cast<uint32_t>(n),
                                        DType::kBF16, kb_.data(), vb_.data()));
    }
    return Status::OK();
  }

 private:
  storage::ContextWriter* writer_;
  int n_kv_, d_;
  std::vector<uint16_t> kb_, vb_;
};

// Keeps a strided sample of the prefill queries (plus the last 32 positions)
// per layer, in bf16, for query-centric index builders.
class QuerySink final : public model::PrefillSink {
 public:
  QuerySink(const model::ModelSpec& spec, int64_t cap) : spec_(spec), cap_(cap) {}

  Status OnBegin(const model::ModelSpec&, int64_t pos0, int64_t n_tokens) override {
    pos0_ = pos0;
    end_ = pos0 + n_tokens;
    const int64_t rows = n_tokens * spec_.group_size();
    stride_ = std::max<int64_t>(1, (rows + cap_ - 1) / cap_);
    layers_.assign(spec_.n_layers, {});
    return Status::OK();
  }

  Status OnChunk(int layer, int64_t pos0, int64_t n, const float* q, const float*,
                 const float*) override {
    LayerQueries& lq = layers_[layer];
    const int d = spec_.head_dim;
    if (lq.rows.empty()) lq.rows.resize(spec_.n_q_heads);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pos0 + i;
      if ((p - pos0_) % stride_ != 0 && p < end_ - 32) continue;
      lq.positions.push_back(p);
      for (int h = 0; h < spec_.n_q_heads; ++h) {
        auto& r = lq.rows[h];
        size_t off = r.size();
        r.resize(off + d);
        FloatToBf16(q + (static_cast<size_t>(h) * n + i) * d, r.data() + off, d);
      }
    }
    return Status::OK();
  }

  // Queries of the q heads of kv head `kv` at `layer`: [G][rows][d] fp32
  // (empty when the layer got no queries).
  void Gather(int layer, int kv, std::vector<float>* out, std::vector<int64_t>* positions) const {
    const LayerQueries& lq = layers_[layer];
    if (lq.rows.empty()) {
      out->clear();
      positions->clear();
      return;
    }
    const int g = spec_.group_size();
    const size_t rows = lq.positions.size();
    const int d = spec_.head_dim;
    out->resize(static_cast<size_t>(g) * rows * d);
    for (int j = 0; j < g; ++j) {
      const auto& r = lq.rows[kv * g + j];
      Bf16ToFloat(r.data(), out->data() + static_cast<size_t>(j) * rows * d, rows * d);
    }
    *positions = lq.positions;
  }

 private:
  struct LayerQueries {
    std::vector<int64_t> positions;
    std::vector<std::vector<uint16_t>> rows;  // per q head: [rows][d] bf16
  };
  const model::ModelSpec& spec_;
  int64_t cap_;
  int64_t pos0_ = 0, end_ = 0, stride_ = 1;
  std::vector<LayerQueries> layers_;
};

// Reads a READY parent's KV as stored, one (layer, kv head) at a time in
// layer order: head(layer, kv_head, n_tokens, k, v) with k and v
// [n_tokens][head_dim] fp32 (valid during the call).
using ParentHeadFn =
    std::function<void(int layer, int kv_head, int64_t n, const float* k, const float* v)>;
Status ReadParentKv(storage::Store* store, const storage::ContextId& parent,
                    const model::ModelSpec& spec, const ParentHeadFn& head) {
  ASSIGN_OR_RETURN(auto reader, store->OpenReader(parent));
  const uint32_t n_blocks = reader->n_blocks();
  const int64_t n = static_cast<int64_t>(reader->manifest().n_tokens());
  std::vector<uint32_t> blocks(n_blocks);
  for (uint32_t b = 0; b < n_blocks; ++b) blocks[b] = b;
  const int d = spec.head_dim;
  std::vector<float> k(static_cast<size_t>(n) * d), v(k.size());
  storage::PageBatch batch;
  for (int layer = 0; layer < spec.n_layers; ++layer) {
    for (int h = 0; h < spec.n_kv_heads; ++h) {
      RETURN_IF_ERROR(reader->ReadPages(layer, h, blocks, &batch));
      int64_t tok = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        const size_t rows = batch.n_tokens[i];
        if (tok + static_cast<int64_t>(rows) > n) {
          return DataLossError("the parent's pages hold more than its " + std::to_string(n) +
                               " tokens");
        }
        ConvertToFloat(batch.dtype, batch.K(i), k.data() + static_cast<size_t>(tok) * d,
                       rows * d);
        ConvertToFloat(batch.dtype, batch.V(i), v.data() + static_cast<size_t>(tok) * d,
                       rows * d);
        tok += static_cast<int64_t>(rows);
      }
      if (tok != n) {
        return DataLossError("the parent's pages of layer " + std::to_string(layer) +
                             " kv head " + std::to_string(h) + " hold " + std::to_string(tok) +
                             " tokens, its manifest " + std::to_string(n));
      }
      head(layer, h, n, k.data(), v.data());
    }
  }
  return Status::OK();
}

// Loads a READY parent's KV into `cache` (extend builds).
Status LoadParentKv(storage::Store* store, const storage::ContextId& parent,
                    const model::ModelSpec& spec, model::KvCache* cache) {
  const int d = spec.head_dim, nkv = spec.n_kv_heads;
  std::vector<float> k, v;  // one layer: [n][nkv][d]
  return ReadParentKv(store, parent, spec,
                      [&](int layer, int h, int64_t n, const float* kh, const float* vh) {
                        k.resize(static_cast<size_t>(n) * nkv * d);
                        v.resize(k.size());
                        for (int64_t t = 0; t < n; ++t) {
                          const size_t row = (static_cast<size_t>(t) * nkv + h) * d;
                          std::copy(kh + t * d, kh + (t + 1) * d, k.data() + row);
                          std::copy(vh + t * d, vh + (t + 1) * d, v.data() + row);
                        }
                        if (h == nkv - 1) {
                          cache->Append(layer, static_cast<int>(n), k.data(), v.data(),
                                        int64_t{nkv} * d);
                        }
                      });
}

// The params a build of `req` uses on n_keys keys and n_rows query rows
// (the method's own defaults, filled in by the registry).
StatusOr<index::MethodParams> ResolvedParams(const IndexRequest& req, int64_t n_keys,
                                             int64_t n_rows, int head_dim) {
  ASSIGN_OR_RETURN(const index::MethodInfo* info, index::FindMethodInfo(req.method));
  return info->resolve(req.params, n_keys, n_rows, head_dim);
}

// Builds, serializes and writes the `req` artifact of (layer, kv head).
Status BuildArtifact(storage::ContextWriter* writer, int layer, int kv_head,
                     const IndexRequest& req, const index::HeadPrefill& hp) {
  ASSIGN_OR_RETURN(const index::MethodInfo* info, index::FindMethodInfo(req.method));
  ASSIGN_OR_RETURN(index::MethodParams params,
                   info->resolve(req.params, hp.n_tokens, hp.n_queries * hp.group_size,
                                 hp.head_dim));
  ASSIGN_OR_RETURN(std::unique_ptr<index::Selector> sel, info->build(hp, params));
  std::string bytes;
  RETURN_IF_ERROR(sel->Serialize(&bytes));
  return writer->PutArtifact(static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                             info->artifact_kind, req.method, bytes);
}

}  // namespace

namespace {

// The requested methods plus the always-built ones.
std::vector<IndexRequest> MethodsToBuild(const std::vector<IndexRequest>& requested) {
  std::vector<IndexRequest> methods = requested;
  for (const index::MethodInfo& m : index::Methods()) {
    if (!m.always_built) continue;
    bool present = false;
    for (const auto& r : methods) present = present || r.method == m.name;
    if (!present) methods.push_back(IndexRequest{std::string(m.name), {}});
  }
  return methods;
}

// Which of the stored keys and values the builds of `methods` read
// (index::MethodInfo::reads_keys, reads_values).
struct KvReads {
  bool keys = false;
  bool values = false;
};
StatusOr<KvReads> KvReadBy(const std::vector<IndexRequest>& methods) {
  KvReads reads;
  for (const IndexRequest& r : methods) {
    ASSIGN_OR_RETURN(const index::MethodInfo* info, index::FindMethodInfo(r.method));
    reads.keys = reads.keys || info->reads_keys;
    reads.values = reads.values || info->reads_values;
  }
  return reads;
}

// Builds and stores `methods`' artifacts of layers [first_layer, end_layer),
// every (layer, kv head) in parallel on ThreadPool::Default().
Status BuildLayerArtifacts(storage::ContextWriter* writer, const IndexShape& shape,
                           const std::vector<IndexRequest>& methods, int first_layer,
                           int end_layer, const ReadKvFn& read_kv,
                           const ReadQueriesFn& read_queries,
                           const std::function<void(int)>& layer_done,
                           const std::atomic<bool>* cancel) {
  const int64_t n = shape.n_tokens;
  const int d = shape.head_dim;
  // One item per (layer, kv head), all in one parallel loop (a per-layer
  // loop left most cores idle on models with few kv heads); an item reads its
  // keys once for every method. layer_done(l + 1) runs, under `mu` and in
  // order, once every head of layers first_layer..l is built.
  const int n_layers = end_layer - first_layer;
  const size_t n_items = static_cast<size_t>(n_layers) * shape.n_kv_heads;
  std::vector<Status> results(n_items);
  std::vector<int> heads_left(static_cast<size_t>(n_layers), shape.n_kv_heads);
  std::mutex mu;
  int layers_reported = 0;  // guarded by mu
  // Keys and values in fp32 only where a method reads them (streaming, full
  // and oracle read neither: an ingest that builds only those converts none).
  ASSIGN_OR_RETURN(const KvReads reads, KvReadBy(methods));
  const bool need_keys = reads.keys, need_values = reads.values;
  ThreadPool::Default()->ParallelFor(n_items, [&](size_t b, size_t e) {
    // Uninitialized: read_kv writes every element (no zero fill per layer).
    const size_t elems = static_cast<size_t>(n) * d;
    std::unique_ptr<float[]> k, v;
    if (need_keys) k = std::make_unique_for_overwrite<float[]>(elems);
    if (need_values) v = std::make_unique_for_overwrite<float[]>(elems);
    std::vector<float> q;
    std::vector<int64_t> positions;
    for (size_t item = b; item < e; ++item) {
      const int layer = first_layer + static_cast<int>(item / shape.n_kv_heads);
      const int h = static_cast<int>(item % shape.n_kv_heads);
      if (cancel && cancel->load()) {
        results[item] = CancelledError("build cancelled");
        continue;
      }
      read_kv(layer, h, k.get(), v.get());
      read_queries(layer, h, &q, &positions);
      index::HeadPrefill hp;
      hp.n_tokens = n;
      hp.head_dim = d;
      hp.group_size = shape.group_size;
      hp.keys = k.get();
      hp.values = v.get();
      hp.n_queries = static_cast<int64_t>(positions.size());
      hp.query_positions = positions.empty() ? nullptr : positions.data();
      hp.queries = q.empty() ? nullptr : q.data();
      for (const IndexRequest& r : methods) {
        Status s = BuildArtifact(writer, layer, h, r, hp);
        if (!s.ok()) {
          results[item] = s.WithContext("building the " + r.method + " index of layer " +
                                        std::to_string(layer) + " kv head " + std::to_string(h));
          break;
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      --heads_left[static_cast<size_t>(layer - first_layer)];
      const int before = layers_reported;
      while (layers_reported < n_layers &&
             heads_left[static_cast<size_t>(layers_reported)] == 0) {
        ++layers_reported;
      }
      if (layer_done && layers_reported != before) layer_done(first_layer + layers_reported);
    }
  });
  for (const auto& s : results) RETURN_IF_ERROR(s);
  return Status::OK();
}

// Records the parameters actually used (defaults that depend on the context
// included), e.g. csa {C, format}.
Status RecordIndexParams(storage::ContextWriter* writer, const IndexShape& shape,
                         const std::vector<IndexRequest>& requested,
                         const ReadQueriesFn& read_queries) {
  std::vector<float> q0;
  std::vector<int64_t> pos0;
  read_queries(0, 0, &q0, &pos0);
  for (const auto& r : requested) {
    v1::IndexParams ip;
    ip.set_method(r.method);
    ASSIGN_OR_RETURN(index::MethodParams resolved,
                     ResolvedParams(r, shape.n_tokens,
                                    static_cast<int64_t>(pos0.size()) * shape.group_size,
                                    shape.head_dim));
    for (const auto& [key, val] : resolved) {
      (*ip.mutable_params())[key] = val;
    }
    writer->AddIndexParams(ip);
  }
  return Status::OK();
}

}  // namespace

Status BuildIndexArtifacts(storage::ContextWriter* writer, const IndexShape& shape,
                           const std::vector<IndexRequest>& requested, const ReadKvFn& read_kv,
                           const ReadQueriesFn& read_queries,
                           const std::function<void(int)>& layer_done,
                           const std::atomic<bool>* cancel) {
  RETURN_IF_ERROR(BuildLayerArtifacts(writer, shape, MethodsToBuild(requested), 0,
                                      shape.n_layers, read_kv, read_queries, layer_done, cancel));
  return RecordIndexParams(writer, shape, requested, read_queries);
}

namespace {

std::string Describe(const std::string& method, const index::MethodParams& params) {
  std::string out = method + "{";
  bool first = true;
  for (const auto& [k, v] : params) {
    out += (first ? "" : ",") + k + "=" + v;
    first = false;
  }
  return out + "}";
}

}  // namespace

Status CheckReusable(const v1::ContextManifest& existing,
                     const std::vector<IndexRequest>& requested, int group_size) {
  const int64_t n = static_cast<int64_t>(existing.n_tokens());
  // A child's builds sample queries of its own tokens only (extend, ingest).
  const int64_t own = n - static_cast<int64_t>(existing.prefix_tokens());
  for (const IndexRequest& r : requested) {
    ASSIGN_OR_RETURN(const index::MethodParams want,
                     ResolvedParams(r, n, own * std::max(1, group_size),
                                    static_cast<int>(existing.model().head_dim())));
    bool found = false;
    for (const auto& ip : existing.index_params()) {
      if (ip.method() != r.method) continue;
      index::MethodParams have(ip.params().begin(), ip.params().end());
      found = have == want;
      if (found) break;
    }
    if (found) continue;
    std::string stored;
    for (const auto& ip : existing.index_params()) {
      stored += (stored.empty() ? "" : ", ") +
                Describe(ip.method(), index::MethodParams(ip.params().begin(), ip.params().end()));
    }
    auto cid = storage::ContextId::FromBytes(existing.context_id());
    const std::string id = cid.ok() ? cid->ToHex() : std::string("<unknown>");
    return AlreadyExistsError("context " + id + " already holds these tokens with indexes [" +
                              (stored.empty() ? std::string("none") : stored) +
                              "], but the request asks for " + Describe(r.method, want) +
                              "; evict it first (ctxcache evict " + id +
                              ") or request the stored indexes");
  }
  return Status::OK();
}

Status ValidateIndexRequests(const std::vector<IndexRequest>& indexes) {
  for (const auto& r : indexes) {
    auto info = index::FindMethodInfo(r.method);
    if (!info.ok()) return info.status().WithContext("indexes");
  }
  return Status::OK();
}

StatusOr<BuildOutcome> RunBuild(storage::Store* store, const BuildJob& job,
                                const BuildOptions& options,
                                const std::function<void(const BuildProgress&)>& progress,
                                const std::atomic<bool>* cancel) {
  RETURN_IF_ERROR(ValidateIndexRequests(job.indexes));
  if (job.tokens.empty()) {
    return InvalidArgumentError("the context has 0 tokens; pass non-empty text or token ids");
  }
  const model::Model& mdl = *job.model->model;
  const model::ModelSpec& spec = mdl.spec();
  for (size_t i = 0; i < job.tokens.size(); ++i) {
    if (job.tokens[i] < 0 || job.tokens[i] >= spec.vocab) {
      return InvalidArgumentError("token id " + std::to_string(job.tokens[i]) + " at index " +
                                  std::to_string(i) + " is outside the model's vocabulary [0, " +
                                  std::to_string(spec.vocab) + ")");
    }
  }
  std::vector<uint32_t> tokens_u32(job.tokens.begin(), job.tokens.end());
  storage::BuildRequest req = StoreRequest(job.model->spec, tokens_u32, job);
  req.parent = job.parent;
  ASSIGN_OR_RETURN(storage::BuildStart start, store->BeginBuild(req));
  BuildOutcome outcome;
  if (!start.writer) {
    RETURN_IF_ERROR(CheckReusable(start.existing, job.indexes, spec.group_size()));
    outcome.manifest = start.existing;
    outcome.reused = true;
    return outcome;
  }
  storage::ContextWriter* writer = start.writer.get();
  auto fail = [&](const Status& s) -> Status {
    writer->Abort().IgnoreError();
    return s;
  };

  const int64_t n_total = static_cast<int64_t>(job.tokens.size());
  const int64_t first = static_cast<int64_t>(writer->first_token());
  const int64_t n_new = n_total - first;
  auto t0 = Clock::now();
  BuildProgress p;
  p.tokens_total = static_cast<uint64_t>(n_total);
  p.layers_total = static_cast<uint32_t>(spec.n_layers);

  model::KvCache cache(spec, DType::kBF16);
  cache.Reserve(n_total);
  if (first > 0) {
    if (Status s = LoadParentKv(store, *job.parent, spec, &cache); !s.ok()) {
      return fail(s.WithContext("loading the parent's KV"));
    }
  }

  PageSink pages(writer, spec.n_kv_heads, spec.head_dim);
  QuerySink queries(spec, options.query_cap);
  model::PrefillOptions po;
  po.chunk_size = options.prefill_chunk;
  po.logits = model::PrefillOptions::LogitsMode::kNone;
  po.cancel = cancel;
  auto last_report = Clock::now();
  po.progress = [&](const model::PrefillProgress& pp) {
    if (!progress) return;
    auto now = Clock::now();
    bool done = pp.tokens_done == pp.tokens_total && pp.layer == pp.n_layers - 1;
    if (!done && now - last_report < std::chrono::milliseconds(200)) return;
    last_report = now;
    double el = Since(t0);
    double frac = (static_cast<double>(pp.tokens_done) +
                   static_cast<double>(pp.layer + 1) / pp.n_layers *
                       std::min<int64_t>(options.prefill_chunk, pp.tokens_total - pp.tokens_done)) /
                  std::max<int64_t>(1, pp.tokens_total);
    p.phase = BuildProgress::Phase::kPrefill;
    p.tokens_prefilled = static_cast<uint64_t>(first + pp.tokens_done);
    p.bytes_written = writer->bytes_written();
    p.tokens_per_s = el > 0 ? frac * n_new / el : 0;
    p.eta_s = frac > 0 ? el * (1 - frac) / frac : 0;
    progress(p);
  };
  std::vector<int32_t> new_tokens(job.tokens.begin() + first, job.tokens.end());
  model::PrefillResult pr;
  if (Status s = model::Prefill(mdl, new_tokens, &cache, {&pages, &queries}, po, &pr); !s.ok()) {
    return fail(s);
  }
  outcome.prefill_s = Since(t0);

  // Index builds, layer by layer, kv heads (x methods) in parallel.
  auto t1 = Clock::now();
  p.phase = BuildProgress::Phase::kIndexing;
  p.tokens_prefilled = static_cast<uint64_t>(n_total);
  const int d = spec.head_dim;
  Status indexed = BuildIndexArtifacts(
      writer, IndexShape{spec.n_layers, spec.n_kv_heads, d, spec.group_size(), n_total},
      job.indexes,
      [&](int layer, int h, float* k, float* v) { cache.Read(layer, h, 0, n_total, k, v); },
      [&](int layer, int h, std::vector<float>* q, std::vector<int64_t>* pos) {
        queries.Gather(layer, h, q, pos);
      },
      [&](int layers_done) {
        if (!progress) return;
        p.layers_indexed = static_cast<uint32_t>(layers_done);
        p.bytes_written = writer->bytes_written();
        progress(p);
      },
      cancel);
  if (!indexed.ok()) return fail(indexed);
  outcome.index_s = Since(t1);
  if (cancel && cancel->load()) return fail(CancelledError("build cancelled"));
  if (progress) {
    p.phase = BuildProgress::Phase::kCommitting;
    p.layers_indexed = static_cast<uint32_t>(spec.n_layers);
    progress(p);
  }
  if (job.before_commit) {
    if (Status s = job.before_commit(writer->bytes_written()); !s.ok()) return fail(s);
  }
  auto committed = writer->Commit();
  if (!committed.ok()) return fail(committed.status());
  outcome.manifest = std::move(committed).value();
  spdlog::info("built context {}: {} tokens ({} new), prefill {:.2f} s, indexes {:.2f} s, {} bytes",
               writer->id().ToHex(), n_total, n_new, outcome.prefill_s, outcome.index_s,
               outcome.manifest.stored_bytes());
  return outcome;
}

}  // namespace ctxcache::service

namespace ctxcache::service {

class IngestBuilder::Queries {
 public:
  Queries(const model::ModelSpec& spec, int64_t cap) : sink(spec, cap) {}
  QuerySink sink;
};

StatusOr<std::unique_ptr<IngestBuilder>> IngestBuilder::Begin(storage::Store* store, Header header,
                                                              const BuildOptions& options) {
  const v1::ModelSpec& spec = header.model;
  if (spec.n_layers() == 0 || spec.n_q_heads() == 0 || spec.n_kv_heads() == 0 ||
      spec.head_dim() == 0 || spec.n_q_heads() % spec.n_kv_heads() != 0) {
    return InvalidArgumentError(
        "header.model: n_layers, n_q_heads, n_kv_heads and head_dim must be > 0 and n_q_heads "
        "a multiple of n_kv_heads");
  }
  if (spec.n_layers() > 1024 || spec.n_q_heads() > 1024 || spec.head_dim() > 1024) {
    return InvalidArgumentError(
        "header.model: n_layers, n_q_heads and head_dim must each be <= 1024, got " +
        std::to_string(spec.n_layers()) + ", " + std::to_string(spec.n_q_heads()) + ", " +
        std::to_string(spec.head_dim()));
  }
  if (spec.fingerprint().empty()) {
    return InvalidArgumentError(
        "header.model.fingerprint is required (it decides KV compatibility)");
  }
  if (spec.kv_dtype() == v1::DTYPE_UNSPECIFIED) {
    return InvalidArgumentError(
        "header.model.kv_dtype is required (DTYPE_BF16, DTYPE_F16 or DTYPE_F32)");
  }
  if (header.tokens.empty()) return InvalidArgumentError("header.tokens is empty");
  RETURN_IF_ERROR(ValidateIndexRequests(header.indexes));
  std::unique_ptr<IngestBuilder> b(new IngestBuilder());
  ASSIGN_OR_RETURN(b->kv_dtype_, FromProtoDType(spec.kv_dtype()));
  b->spec_.n_layers = static_cast<int>(spec.n_layers());
  b->spec_.n_q_heads = static_cast<int>(spec.n_q_heads());
  b->spec_.n_kv_heads = static_cast<int>(spec.n_kv_heads());
  b->spec_.head_dim = static_cast<int>(spec.head_dim());
  b->n_tokens_ = static_cast<int64_t>(header.tokens.size());
  b->indexes_ = std::move(header.indexes);
  b->methods_ = MethodsToBuild(b->indexes_);
  ASSIGN_OR_RETURN(const KvReads reads, KvReadBy(b->methods_));
  b->keep_keys_ = reads.keys;
  b->keep_values_ = reads.values;
  b->before_commit_ = std::move(header.before_commit);
  storage::BuildRequest req = StoreRequest(spec, header.tokens, header);
  req.parent = header.parent;
  ASSIGN_OR_RETURN(storage::BuildStart start, store->BeginBuild(req));
  if (!start.writer) {
    RETURN_IF_ERROR(CheckReusable(start.existing, b->indexes_, b->spec_.group_size()));
    b->existing_ = std::move(start.existing);
    return b;
  }
  b->writer_ = std::move(start.writer);
  b->first_token_ = static_cast<int64_t>(b->writer_->first_token());
  const size_t heads = static_cast<size_t>(b->spec_.n_layers) * b->spec_.n_kv_heads;
  b->head_bytes_ =
      static_cast<size_t>(b->n_tokens_) * b->spec_.head_dim * DTypeSize(b->kv_dtype_);
  b->keys_.resize(heads);
  b->vals_.resize(heads);
  if (b->first_token_ > 0 && (b->keep_keys_ || b->keep_values_)) {
    for (int l = 0; l < b->spec_.n_layers; ++l) RETURN_IF_ERROR(b->MapLayer(l));
    // The child's indexes cover the parent's tokens too: its KV as stored
    // (the parent's values are exact in kv_dtype_, so the round trip through
    // fp32 loses nothing).
    const int nkv = b->spec_.n_kv_heads, d = b->spec_.head_dim;
    Status s = ReadParentKv(store, *header.parent, b->spec_,
                            [&](int layer, int h, int64_t n, const float* k, const float* v) {
                              const size_t slot = static_cast<size_t>(layer) * nkv + h;
                              const size_t m = static_cast<size_t>(std::min(n, b->n_tokens_)) * d;
                              if (b->keep_keys_) {
                                ConvertFromFloat(b->kv_dtype_, k, b->keys_[slot].data(), m);
                              }
                              if (b->keep_values_) {
                                ConvertFromFloat(b->kv_dtype_, v, b->vals_[slot].data(), m);
                              }
                            });
    if (!s.ok()) return s.WithContext("reading the parent's KV");
  }
  b->next_.assign(static_cast<size_t>(b->spec_.n_layers), b->first_token_);
  b->queries_ = std::make_unique<Queries>(b->spec_, options.query_cap);
  RETURN_IF_ERROR(
      b->queries_->sink.OnBegin(b->spec_, b->first_token_, b->n_tokens_ - b->first_token_));
  for (int l = 0; l < b->spec_.n_layers; ++l) {  // a child of no new tokens: complete now
    if (b->next_[static_cast<size_t>(l)] == b->n_tokens_) b->LayerComplete(l);
  }
  return b;
}

IngestBuilder::~IngestBuilder() { Abort(); }

void IngestBuilder::Abort() {
  StopIndexBuilds();
  if (writer_) writer_->Abort().IgnoreError();
  writer_.reset();
}

void IngestBuilder::StopIndexBuilds() {
  index_cancel_ = true;
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    index_stop_ = true;
    index_queue_.clear();
  }
  index_cv_.notify_all();
  if (index_thread_.joinable()) index_thread_.join();
}

Status IngestBuilder::WaitForIndexes(int n) {
  int complete = 0;
  for (int64_t next : next_) complete += next == n_tokens_ ? 1 : 0;
  if (n > complete) {
    return FailedPreconditionError("ingest: waiting for " + std::to_string(n) +
                                   " layers' indexes, " + std::to_string(complete) +
                                   " layers complete");
  }
  std::unique_lock<std::mutex> lock(index_mu_);
  index_cv_.wait(lock, [&] { return layers_indexed_ >= n || !index_status_.ok(); });
  return index_status_;
}

int IngestBuilder::layers_indexed() {
  std::lock_guard<std::mutex> lock(index_mu_);
  return layers_indexed_;
}

Status IngestBuilder::IndexStatus() {
  std::lock_guard<std::mutex> lock(index_mu_);
  return index_status_;
}

void IngestBuilder::LayerComplete(int layer) {
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    index_queue_.push_back(layer);
  }
  index_cv_.notify_all();
  if (!index_thread_.joinable()) index_thread_ = std::thread([this] { RunIndexBuilds(); });
}

IndexShape IngestBuilder::index_shape() const {
  return IndexShape{spec_.n_layers, spec_.n_kv_heads, spec_.head_dim, spec_.group_size(),
                    n_tokens_};
}

ReadQueriesFn IngestBuilder::read_queries() const {
  return [this](int layer, int h, std::vector<float>* q, std::vector<int64_t>* pos) {
    queries_->sink.Gather(layer, h, q, pos);
  };
}

void IngestBuilder::RunIndexBuilds() {
  const int NKV = spec_.n_kv_heads;
  const size_t elems = static_cast<size_t>(n_tokens_) * spec_.head_dim;
  // No chunk of a complete, built layer is accepted: its buffers go to the
  // spares (reused without a new zero fill), up to one layer's worth.
  // Called with index_mu_ held.
  auto release = [&](int layer) {
    for (int h = 0; h < NKV; ++h) {
      const size_t slot = static_cast<size_t>(layer) * NKV + h;
      for (MappedBytes* m : Kept(slot)) {
        if (spare_.size() < 2 * static_cast<size_t>(NKV)) spare_.push_back(std::move(*m));
        *m = MappedBytes();
      }
    }
  };
  for (;;) {
    // Every layer complete so far, built in one parallel loop over their
    // (layer, kv head) items: one layer at a time would leave most cores
    // idle on a model with few kv heads whose layers arrive faster than
    // they are built.
    std::vector<int> layers;
    {
      std::unique_lock<std::mutex> lock(index_mu_);
      index_cv_.wait(lock, [&] { return index_stop_ || !index_queue_.empty(); });
      if (index_queue_.empty() || index_cancel_) return;
      layers.assign(index_queue_.begin(), index_queue_.end());
      index_queue_.clear();
    }
    std::sort(layers.begin(), layers.end());
    for (size_t i = 0; i < layers.size();) {
      size_t j = i + 1;  // [layers[i], layers[j - 1]] is a run of consecutive layers
      while (j < layers.size() && layers[j] == layers[j - 1] + 1) ++j;
      const int first = layers[i];
      int released = first;
      Status s = BuildLayerArtifacts(
          writer_.get(), index_shape(), methods_, first, layers[j - 1] + 1,
          [&](int l, int h, float* kout, float* vout) {
            const size_t slot = static_cast<size_t>(l) * NKV + h;
            if (kout) ConvertToFloat(kv_dtype_, keys_[slot].data(), kout, elems);
            if (vout) ConvertToFloat(kv_dtype_, vals_[slot].data(), vout, elems);
          },
          read_queries(),
          [&](int built_end) {  // layers [first, built_end) are built, in order
            std::lock_guard<std::mutex> lock(index_mu_);
            for (; released < built_end; ++released) release(released);
          },
          &index_cancel_);
      {
        // Counted only now, with the status: a waiter never sees n layers
        // indexed before a failure among them is recorded.
        std::lock_guard<std::mutex> lock(index_mu_);
        for (; released <= layers[j - 1]; ++released) release(released);
        if (!s.ok() && index_status_.ok()) index_status_ = s;
        layers_indexed_ += static_cast<int>(j - i);
      }
      index_cv_.notify_all();
      i = j;
    }
  }
}

Status IngestBuilder::CheckChunk(int layer, int64_t token_start, int64_t n) const {
  if (!writer_) return FailedPreconditionError("ingest: the build is not open");
  const int L = spec_.n_layers;
  if (layer < 0 || layer >= L) {
    return InvalidArgumentError("chunk.layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(L) + ")");
  }
  const int64_t next = next_[static_cast<size_t>(layer)];
  if (token_start != next || n <= 0 || next + n > n_tokens_) {
    const std::string child =
        first_token_ > 0 ? " (a child's chunks count from its token 0 and start at the "
                           "parent's n_tokens, " + std::to_string(first_token_) + ")"
                         : "";
    return InvalidArgumentError("chunk for layer " + std::to_string(layer) + ": token_start " +
                                std::to_string(token_start) + " n_tokens " + std::to_string(n) +
                                ", expected start " + std::to_string(next) +
                                " and an end <= " + std::to_string(n_tokens_) + child);
  }
  return Status::OK();
}

std::vector<MappedBytes*> IngestBuilder::Kept(size_t slot) {
  std::vector<MappedBytes*> out;
  if (keep_keys_) out.push_back(&keys_[slot]);
  if (keep_values_) out.push_back(&vals_[slot]);
  return out;
}

Status IngestBuilder::MapLayer(int layer) {
  if (!keep_keys_ && !keep_values_) return Status::OK();
  const int NKV = spec_.n_kv_heads;
  std::lock_guard<std::mutex> lock(index_mu_);
  try {
    for (int h = 0; h < NKV; ++h) {
      const size_t slot = static_cast<size_t>(layer) * NKV + h;
      for (MappedBytes* m : Kept(slot)) {
        if (!spare_.empty()) {
          *m = std::move(spare_.back());
          spare_.pop_back();
        } else {
          *m = MappedBytes(head_bytes_);  // uninitialized: filled in token order
        }
      }
    }
  } catch (const std::bad_alloc&) {
    const size_t kept = static_cast<size_t>(keep_keys_) + static_cast<size_t>(keep_values_);
    return ResourceExhaustedError("ingest: cannot map " +
                                  std::to_string(kept * NKV * head_bytes_) + " bytes for layer " +
                                  std::to_string(layer) + "'s stored K/V");
  }
  return Status::OK();
}

Status IngestBuilder::StoreChunk(int layer, int64_t token_start, int64_t n, const void* k,
                                 const void* v) {
  const size_t row = static_cast<size_t>(spec_.head_dim) * DTypeSize(kv_dtype_);
  const size_t head = static_cast<size_t>(n) * row;
  // The kv heads' pages are encoded and written in parallel.
  RETURN_IF_ERROR(writer_->AppendLayerKVStrided(static_cast<uint32_t>(layer),
                                                static_cast<uint64_t>(token_start),
                                                static_cast<uint32_t>(n), kv_dtype_, k, v, head,
                                                row));
  // Indexes are built over the KV as stored, as in BuildContext (kept only
  // when a method being built reads it).
  const auto* kb = static_cast<const uint8_t*>(k);
  const auto* vb = static_cast<const uint8_t*>(v);
  for (int h = 0; (keep_keys_ || keep_values_) && h < spec_.n_kv_heads; ++h) {
    const size_t slot = static_cast<size_t>(layer) * spec_.n_kv_heads + h;
    const size_t at = static_cast<size_t>(token_start) * row;
    if (keep_keys_) std::memcpy(keys_[slot].data() + at, kb + h * head, head);
    if (keep_values_) std::memcpy(vals_[slot].data() + at, vb + h * head, head);
  }
  return Status::OK();
}

Status IngestBuilder::AddChunk(int layer, int64_t token_start, int64_t n, const float* k,
                               const float* v, const float* q) {
  RETURN_IF_ERROR(CheckChunk(layer, token_start, n));
  RETURN_IF_ERROR(IndexStatus());
  if (token_start == first_token_ && first_token_ == 0) RETURN_IF_ERROR(MapLayer(layer));
  const size_t elems = static_cast<size_t>(n) * spec_.head_dim * spec_.n_kv_heads;
  kc_.resize(elems * DTypeSize(kv_dtype_));
  vc_.resize(kc_.size());
  ConvertFromFloat(kv_dtype_, k, kc_.data(), elems);
  ConvertFromFloat(kv_dtype_, v, vc_.data(), elems);
  RETURN_IF_ERROR(StoreChunk(layer, token_start, n, kc_.data(), vc_.data()));
  if (q != nullptr) RETURN_IF_ERROR(queries_->sink.OnChunk(layer, token_start, n, q, k, v));
  next_[static_cast<size_t>(layer)] += n;
  if (next_[static_cast<size_t>(layer)] == n_tokens_) LayerComplete(layer);
  return Status::OK();
}

Status IngestBuilder::AddStoredChunk(int layer, int64_t token_start, int64_t n, const void* k,
                                     const void* v) {
  RETURN_IF_ERROR(CheckChunk(layer, token_start, n));
  RETURN_IF_ERROR(IndexStatus());
  if (token_start == first_token_ && first_token_ == 0) RETURN_IF_ERROR(MapLayer(layer));
  RETURN_IF_ERROR(StoreChunk(layer, token_start, n, k, v));
  next_[static_cast<size_t>(layer)] += n;
  if (next_[static_cast<size_t>(layer)] == n_tokens_) LayerComplete(layer);
  return Status::OK();
}

StatusOr<v1::ContextManifest> IngestBuilder::Commit() {
  if (!writer_) return FailedPreconditionError("ingest: the build is not open");
  for (int l = 0; l < spec_.n_layers; ++l) {
    if (next_[l] != n_tokens_) {
      return FailedPreconditionError("IngestCommit before layer " + std::to_string(l) +
                                     " was complete (KV up to token " + std::to_string(next_[l]) +
                                     " of " + std::to_string(n_tokens_) + ")");
    }
  }
  Status built = WaitForIndexes(spec_.n_layers);
  StopIndexBuilds();
  RETURN_IF_ERROR(built);
  RETURN_IF_ERROR(RecordIndexParams(writer_.get(), index_shape(), indexes_, read_queries()));
  if (before_commit_) RETURN_IF_ERROR(before_commit_(writer_->bytes_written()));
  ASSIGN_OR_RETURN(v1::ContextManifest manifest, writer_->Commit());
  writer_.reset();
  return manifest;
}

}  // namespace ctxcache::service
