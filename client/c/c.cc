// The C ABI (client/include/ctxcache/c.h) over the C++ SDK: conversions and
// ownership only; every behaviour is the SDK's.
#include "ctxcache/c.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ctxcache/client.h"
#include "proto/dtype_convert.h"

using ctxcache::Status;
using ctxcache::StatusCode;
namespace cc = ctxcache::client;

struct ctxcache_options_t {
  cc::ClientOptions options;
};
struct ctxcache_client_t {
  std::unique_ptr<cc::Client> client;
};
struct ctxcache_load_t {
  std::unique_ptr<cc::KVLoad> load;
};
struct ctxcache_map_t {
  std::unique_ptr<cc::KVMapping> map;
};
struct ctxcache_index_t {
  std::map<std::pair<uint32_t, uint32_t>, std::string> artifacts;
};
struct ctxcache_session_t {
  std::unique_ptr<cc::DecodeSession> session;
};
struct ctxcache_step_t {
  cc::SelectedKV kv;
};
struct ctxcache_ingest_t {
  std::unique_ptr<cc::IngestStream> stream;
};

namespace {

char* CopyString(std::string_view s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p == nullptr) return nullptr;
  std::memcpy(p, s.data(), s.size());
  p[s.size()] = '\0';
  return p;
}

int Report(const Status& s, char** errptr) {
  if (errptr != nullptr) *errptr = s.ok() ? nullptr : CopyString(s.message());
  return static_cast<int>(s.code());
}

int Invalid(const std::string& msg, char** errptr) {
  return Report(ctxcache::InvalidArgumentError(msg), errptr);
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

void ToLayout(const ctxcache_kv_layout_t& in, cc::KVLayout* out) {
  out->k = in.k;
  out->v = in.v;
  out->k_capacity = in.k_capacity;
  out->v_capacity = in.v_capacity;
  out->layer_stride = in.layer_stride;
  out->head_stride = in.head_stride;
  out->token_stride = in.token_stride;
  out->dtype = static_cast<ctxcache::v1::DType>(in.dtype);
}

// The shape (out, may be null) and the serialized message (proto, may be
// null) of a ContextInfo.
void ToContext(const ctxcache::v1::ContextInfo& info, ctxcache_context_t* out, char** proto,
               size_t* proto_len) {
  if (out != nullptr) {
    const auto& m = info.model();
    out->n_tokens = info.n_tokens();
    out->n_layers = m.n_layers();
    out->n_q_heads = m.n_q_heads();
    out->n_kv_heads = m.n_kv_heads();
    out->head_dim = m.head_dim();
    out->block_tokens = info.block_tokens() ? info.block_tokens() : 16;
    out->kv_dtype = static_cast<int32_t>(m.kv_dtype());
    out->state = static_cast<int32_t>(info.state());
  }
  if (proto != nullptr) {
    const std::string bytes = info.SerializeAsString();
    *proto = CopyString(bytes);
    if (proto_len != nullptr) *proto_len = bytes.size();
  }
}

void ToProgress(const cc::KVLoadProgress& p, ctxcache_load_progress_t* out) {
  out->bytes_done = p.bytes_done;
  out->bytes_total = p.bytes_total;
  out->layers_done = p.layers_done;
  out->layers_total = p.layers_total;
  out->frames = p.frames;
  out->seconds = p.seconds;
}

size_t ElementSize(ctxcache::v1::DType d) {
  auto dtype = ctxcache::FromProtoDType(d);
  return dtype.ok() ? ctxcache::DTypeSize(*dtype) : 0;
}

}  // namespace

extern "C" {

int ctxcache_abi_version(void) { return CTXCACHE_ABI_VERSION; }

void ctxcache_free(void* ptr) { std::free(ptr); }

ctxcache_options_t* ctxcache_options_create(void) { return new ctxcache_options_t; }
void ctxcache_options_destroy(ctxcache_options_t* o) { delete o; }
void ctxcache_options_set_server(ctxcache_options_t* o, const char* server) {
  o->options.server = Str(server);
}
void ctxcache_options_set_api_key(ctxcache_options_t* o, const char* key) {
  o->options.api_key = Str(key);
}
void ctxcache_options_set_tls(ctxcache_options_t* o, const char* ca_path, const char* cert_path,
                              const char* key_path, const char* server_name) {
  o->options.tls_ca = Str(ca_path);
  o->options.tls_cert = Str(cert_path);
  o->options.tls_key = Str(key_path);
  o->options.tls_server_name = Str(server_name);
}
void ctxcache_options_set_timeout(ctxcache_options_t* o, double seconds) {
  o->options.timeout_s = seconds;
}
void ctxcache_options_set_max_attempts(ctxcache_options_t* o, int attempts) {
  o->options.max_attempts = attempts;
}
void ctxcache_options_set_cluster_replicas(ctxcache_options_t* o, uint32_t r) {
  o->options.cluster_replicas = r;
}

int ctxcache_connect(const ctxcache_options_t* o, ctxcache_client_t** out, char** errptr) {
  if (o == nullptr || out == nullptr) return Invalid("options and out must not be NULL", errptr);
  *out = nullptr;
  auto c = cc::Client::Connect(o->options);
  if (!c.ok()) return Report(c.status(), errptr);
  *out = new ctxcache_client_t{std::move(*c)};
  return Report(Status::OK(), errptr);
}

void ctxcache_client_destroy(ctxcache_client_t* c) { delete c; }

int ctxcache_get_context(ctxcache_client_t* c, const char* context_id, ctxcache_context_t* out,
                         char** proto, size_t* proto_len, char** errptr) {
  if (c == nullptr || context_id == nullptr || out == nullptr) {
    return Invalid("client, context_id and out must not be NULL", errptr);
  }
  auto info = c->client->GetContext(context_id);
  if (!info.ok()) return Report(info.status(), errptr);
  ToContext(*info, out, proto, proto_len);
  return Report(Status::OK(), errptr);
}

int ctxcache_build_tokens(ctxcache_client_t* c, const char* model, const uint32_t* tokens,
                          size_t n_tokens, char** context_id, char** errptr) {
  if (c == nullptr || context_id == nullptr || (n_tokens > 0 && tokens == nullptr)) {
    return Invalid("client, tokens and context_id must not be NULL", errptr);
  }
  *context_id = nullptr;
  ctxcache::v1::BuildContextRequest req;
  req.set_model(Str(model));
  req.mutable_tokens()->mutable_ids()->Add(tokens, tokens + n_tokens);
  auto built = c->client->Build(req, nullptr);
  if (!built.ok()) return Report(built.status(), errptr);
  *context_id = CopyString(built->context().context_id());
  return Report(Status::OK(), errptr);
}

int ctxcache_load_kv_start(ctxcache_client_t* c, const char* context_id, const uint32_t* layers,
                           size_t n_layers, int streams, uint32_t frame_bytes,
                           const ctxcache_kv_layout_t* layout, ctxcache_load_t** out,
                           char** errptr) {
  if (c == nullptr || context_id == nullptr || layout == nullptr || out == nullptr) {
    return Invalid("client, context_id, layout and out must not be NULL", errptr);
  }
  if (n_layers > 0 && layers == nullptr) return Invalid("layers: NULL with n_layers > 0", errptr);
  *out = nullptr;
  cc::KVLoadOptions options;
  if (n_layers > 0) options.layers.assign(layers, layers + n_layers);
  if (streams != 0) options.streams = streams;
  if (frame_bytes != 0) options.frame_bytes = frame_bytes;
  cc::KVLayout l;
  ToLayout(*layout, &l);
  auto load = c->client->StartLoadKV(context_id, options, l);
  if (!load.ok()) return Report(load.status(), errptr);
  *out = new ctxcache_load_t{std::move(*load)};
  return Report(Status::OK(), errptr);
}

int ctxcache_load_wait_layer(ctxcache_load_t* l, uint32_t layer, char** errptr) {
  return Report(l->load->WaitLayer(layer), errptr);
}
int ctxcache_load_prioritize(ctxcache_load_t* l, uint32_t layer, char** errptr) {
  return Report(l->load->Prioritize(layer), errptr);
}
int ctxcache_load_wait(ctxcache_load_t* l, char** errptr) {
  return Report(l->load->Wait(), errptr);
}
void ctxcache_load_cancel(ctxcache_load_t* l) { l->load->Cancel(); }
int ctxcache_load_done(const ctxcache_load_t* l) { return l->load->done() ? 1 : 0; }
void ctxcache_load_progress(const ctxcache_load_t* l, ctxcache_load_progress_t* out) {
  ToProgress(l->load->progress(), out);
}
void ctxcache_load_destroy(ctxcache_load_t* l) { delete l; }

int ctxcache_load_kv(ctxcache_client_t* c, const char* context_id, const uint32_t* layers,
                     size_t n_layers, int streams, uint32_t frame_bytes,
                     const ctxcache_kv_layout_t* layout, ctxcache_load_progress_t* progress,
                     char** errptr) {
  ctxcache_load_t* load = nullptr;
  int code = ctxcache_load_kv_start(c, context_id, layers, n_layers, streams, frame_bytes, layout,
                                    &load, errptr);
  if (code != 0) return code;
  code = ctxcache_load_wait(load, errptr);
  if (progress != nullptr) ctxcache_load_progress(load, progress);
  ctxcache_load_destroy(load);
  return code;
}

int ctxcache_map_kv_start(ctxcache_client_t* c, const char* context_id, const uint32_t* layers,
                          size_t n_layers, ctxcache_map_t** out, char** errptr) {
  if (c == nullptr || context_id == nullptr || out == nullptr) {
    return Invalid("client, context_id and out must not be NULL", errptr);
  }
  if (n_layers > 0 && layers == nullptr) return Invalid("layers: NULL with n_layers > 0", errptr);
  *out = nullptr;
  std::vector<uint32_t> l;
  if (n_layers > 0) l.assign(layers, layers + n_layers);
  auto map = c->client->MapKV(context_id, l);
  if (!map.ok()) return Report(map.status(), errptr);
  *out = new ctxcache_map_t{std::move(*map)};
  return Report(Status::OK(), errptr);
}

int ctxcache_map_wait_layer(ctxcache_map_t* m, uint32_t layer, char** errptr) {
  return Report(m->map->WaitLayer(layer), errptr);
}
int ctxcache_map_wait(ctxcache_map_t* m, char** errptr) { return Report(m->map->Wait(), errptr); }

void ctxcache_map_get(const ctxcache_map_t* m, const void** data, uint64_t* size,
                      ctxcache_map_layout_t* layout) {
  const cc::KVMapLayout& l = m->map->layout();
  if (data != nullptr) *data = m->map->data();
  if (size != nullptr) *size = m->map->size();
  if (layout != nullptr) {
    layout->layer_stride = l.layer_stride;
    layout->head_stride = l.head_stride;
    layout->token_stride = l.token_stride;
    layout->v_offset = l.v_offset;
    layout->n_tokens = l.n_tokens;
    layout->n_kv_heads = l.n_kv_heads;
    layout->head_dim = l.head_dim;
    layout->n_slots = static_cast<uint32_t>(l.layers.size());
    layout->dtype = static_cast<int32_t>(l.dtype);
  }
}

void ctxcache_map_destroy(ctxcache_map_t* m) { delete m; }

int ctxcache_fetch_pages(ctxcache_client_t* c, const char* context_id, uint32_t layer,
                         uint32_t kv_head, const uint32_t* blocks, size_t n_blocks, void* out,
                         size_t out_capacity, char** errptr) {
  if (c == nullptr || context_id == nullptr ||
      (n_blocks > 0 && (blocks == nullptr || out == nullptr))) {
    return Invalid("client, context_id, blocks and out must not be NULL", errptr);
  }
  auto info = c->client->GetContext(context_id);
  if (!info.ok()) return Report(info.status(), errptr);
  const uint32_t b = info->block_tokens() ? info->block_tokens() : 16;
  const size_t page_bytes =
      2 * size_t{b} * info->model().head_dim() * ElementSize(info->model().kv_dtype());
  if (page_bytes == 0) {
    return Report(
        ctxcache::InternalError("context " + std::string(context_id) + " has no valid kv dtype"),
        errptr);
  }
  if (out_capacity / page_bytes < n_blocks) {
    return Invalid("out_capacity: " + std::to_string(out_capacity) +
                       " bytes, expected >= " + std::to_string(n_blocks) + " pages x " +
                       std::to_string(page_bytes) + " bytes",
                   errptr);
  }
  ctxcache::v1::FetchPagesRequest req;
  req.set_context_id(context_id);
  auto* t = req.add_tables();
  t->set_layer(layer);
  t->set_kv_head(kv_head);
  for (size_t i = 0; i < n_blocks; ++i) t->add_blocks(blocks[i]);
  std::vector<ctxcache::v1::Page> pages;
  Status s = c->client->FetchPages(req, &pages);
  if (!s.ok()) return Report(s, errptr);
  if (pages.size() != n_blocks) {
    return Report(ctxcache::DataLossError("FetchPages: got " + std::to_string(pages.size()) +
                                          " pages for " + std::to_string(n_blocks) + " blocks"),
                  errptr);
  }
  for (size_t i = 0; i < n_blocks; ++i) {
    const auto& p = pages[i];
    if (p.block() != blocks[i] || p.k().size() + p.v().size() > page_bytes) {
      return Report(ctxcache::DataLossError("FetchPages: page " + std::to_string(i) +
                                            " is not block " + std::to_string(blocks[i])),
                    errptr);
    }
  }
  for (size_t i = 0; i < n_blocks; ++i) {
    char* dst = static_cast<char*>(out) + i * page_bytes;
    std::memcpy(dst, pages[i].k().data(), pages[i].k().size());
    std::memcpy(dst + pages[i].k().size(), pages[i].v().data(), pages[i].v().size());
  }
  return Report(Status::OK(), errptr);
}

int ctxcache_fetch_pages_into(ctxcache_client_t* c, const char* context_id,
                              const ctxcache_page_table_t* tables, size_t n_tables,
                              const ctxcache_kv_layout_t* layout, char** errptr) {
  if (c == nullptr || context_id == nullptr || layout == nullptr ||
      (n_tables > 0 && tables == nullptr)) {
    return Invalid("client, context_id, tables and layout must not be NULL", errptr);
  }
  ctxcache::v1::FetchPagesRequest req;
  req.set_context_id(context_id);
  for (size_t i = 0; i < n_tables; ++i) {
    if (tables[i].n_blocks > 0 && tables[i].blocks == nullptr) {
      return Invalid("tables[" + std::to_string(i) + "].blocks: NULL with n_blocks > 0", errptr);
    }
    auto* t = req.add_tables();
    t->set_layer(tables[i].layer);
    t->set_kv_head(tables[i].kv_head);
    t->mutable_blocks()->Add(tables[i].blocks, tables[i].blocks + tables[i].n_blocks);
  }
  cc::KVLayout l;
  ToLayout(*layout, &l);
  return Report(c->client->FetchPagesInto(req, l), errptr);
}

int ctxcache_fetch_index(ctxcache_client_t* c, const char* context_id, const char* method,
                         ctxcache_index_t** out, char** errptr) {
  return ctxcache_fetch_index_layers(c, context_id, method, nullptr, 0, out, errptr);
}

int ctxcache_fetch_index_layers(ctxcache_client_t* c, const char* context_id, const char* method,
                                const uint32_t* layers, size_t n_layers, ctxcache_index_t** out,
                                char** errptr) {
  if (c == nullptr || context_id == nullptr || method == nullptr || out == nullptr) {
    return Invalid("client, context_id, method and out must not be NULL", errptr);
  }
  if (n_layers > 0 && layers == nullptr) return Invalid("layers: NULL with n_layers > 0", errptr);
  *out = nullptr;
  auto index = c->client->FetchIndex(
      context_id, method,
      n_layers ? std::vector<uint32_t>(layers, layers + n_layers) : std::vector<uint32_t>{});
  if (!index.ok()) return Report(index.status(), errptr);
  *out = new ctxcache_index_t{std::move(*index)};
  return Report(Status::OK(), errptr);
}

int ctxcache_index_get(const ctxcache_index_t* idx, uint32_t layer, uint32_t kv_head,
                       const char** data, size_t* len) {
  auto it = idx->artifacts.find({layer, kv_head});
  if (it == idx->artifacts.end()) return static_cast<int>(StatusCode::kNotFound);
  *data = it->second.data();
  *len = it->second.size();
  return 0;
}

void ctxcache_index_destroy(ctxcache_index_t* idx) { delete idx; }

int ctxcache_ingest_start(ctxcache_client_t* c, const char* header, size_t header_len,
                          const ctxcache_ingest_options_t* opts, ctxcache_ingest_t** out,
                          char** errptr) {
  if (c == nullptr || out == nullptr || (header == nullptr && header_len > 0)) {
    return Invalid("client, header and out must not be NULL", errptr);
  }
  *out = nullptr;
  ctxcache::v1::IngestHeader h;
  if (header_len > static_cast<size_t>(INT32_MAX) ||
      !h.ParseFromArray(header, static_cast<int>(header_len))) {
    return Invalid("header: not a serialized ctxcache.v1.IngestHeader", errptr);
  }
  cc::IngestOptions options;
  if (opts != nullptr) {
    if (opts->frame_bytes != 0) options.frame_bytes = opts->frame_bytes;
    if (opts->timeout_s > 0) options.timeout_s = opts->timeout_s;
    if (opts->parent_tokens > 0) options.parent_tokens = opts->parent_tokens;
  }
  auto stream = c->client->StartIngest(h, options);
  if (!stream.ok()) return Report(stream.status(), errptr);
  *out = new ctxcache_ingest_t{std::move(stream).value()};
  return Report(Status::OK(), errptr);
}

int ctxcache_ingest_write_layer(ctxcache_ingest_t* in, uint32_t layer,
                                const ctxcache_ingest_layer_t* layout, char** errptr) {
  if (in == nullptr || layout == nullptr) {
    return Invalid("ingest and layout must not be NULL", errptr);
  }
  cc::IngestLayerLayout l;
  l.k = layout->k;
  l.v = layout->v;
  l.q = layout->q;
  l.k_capacity = layout->k_capacity;
  l.v_capacity = layout->v_capacity;
  l.q_capacity = layout->q_capacity;
  l.head_stride = layout->head_stride;
  l.token_stride = layout->token_stride;
  l.q_head_stride = layout->q_head_stride;
  l.q_token_stride = layout->q_token_stride;
  l.dtype = static_cast<ctxcache::v1::DType>(layout->dtype);
  return Report(in->stream->WriteLayer(layer, l), errptr);
}

int ctxcache_ingest_commit(ctxcache_ingest_t* in, ctxcache_context_t* out, char** context_id,
                           char** proto, size_t* proto_len, char** errptr) {
  if (in == nullptr) return Invalid("ingest must not be NULL", errptr);
  if (context_id != nullptr) *context_id = nullptr;
  if (proto != nullptr) *proto = nullptr;
  auto info = in->stream->Commit();
  if (!info.ok()) return Report(info.status(), errptr);
  ToContext(*info, out, proto, proto_len);
  if (context_id != nullptr) *context_id = CopyString(info->context_id());
  return Report(Status::OK(), errptr);
}

void ctxcache_ingest_destroy(ctxcache_ingest_t* in) { delete in; }

int ctxcache_session_open(ctxcache_client_t* c, const char* context_id, const char* method,
                          const char* params, int client_mode, ctxcache_session_t** out,
                          char** errptr) {
  if (c == nullptr || context_id == nullptr || method == nullptr || out == nullptr) {
    return Invalid("client, context_id, method and out must not be NULL", errptr);
  }
  *out = nullptr;
  cc::SessionOptions o;
  o.context_id = context_id;
  o.method = method;
  o.mode = client_mode ? cc::SelectMode::kClient : cc::SelectMode::kServer;
  const std::string text = Str(params);
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(';', at);
    if (end == std::string::npos) end = text.size();
    const std::string pair = text.substr(at, end - at);
    at = end + 1;
    if (pair.empty()) continue;
    const size_t eq = pair.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Invalid("params: expected key=value pairs separated by ';', got \"" + pair + "\"",
                     errptr);
    }
    o.params[pair.substr(0, eq)] = pair.substr(eq + 1);
  }
  auto session = c->client->OpenSession(o);
  if (!session.ok()) return Report(session.status(), errptr);
  *out = new ctxcache_session_t{std::move(*session)};
  return Report(Status::OK(), errptr);
}

int ctxcache_session_step(ctxcache_session_t* s, uint32_t layer, const float* queries,
                          ctxcache_step_t** out, char** errptr) {
  if (s == nullptr || out == nullptr) return Invalid("session and out must not be NULL", errptr);
  *out = nullptr;
  auto step = std::make_unique<ctxcache_step_t>();
  Status st = s->session->Step(layer, queries, &step->kv);
  if (!st.ok()) return Report(st, errptr);
  *out = step.release();
  return Report(Status::OK(), errptr);
}

int ctxcache_session_append(ctxcache_session_t* s, const float* k, const float* v,
                            const float* q, char** errptr) {
  if (s == nullptr || k == nullptr || v == nullptr) {
    return Invalid("session, k and v must not be NULL", errptr);
  }
  return Report(s->session->Append(k, v, q), errptr);
}

int64_t ctxcache_session_n_tokens(const ctxcache_session_t* s) { return s->session->n_tokens(); }

void ctxcache_session_destroy(ctxcache_session_t* s) {
  if (s == nullptr) return;
  (void)s->session->Close();  // best effort: the stream may already be gone
  delete s;
}

uint32_t ctxcache_step_n_heads(const ctxcache_step_t* st) {
  return static_cast<uint32_t>(st->kv.heads.size());
}

uint32_t ctxcache_step_group(const ctxcache_step_t* st, uint32_t kv_head) {
  if (kv_head >= st->kv.heads.size()) return 0;
  return static_cast<uint32_t>(st->kv.heads[kv_head].per_q_head.size());
}

int ctxcache_step_head(const ctxcache_step_t* st, uint32_t kv_head, const int32_t** ids,
                       size_t* n_ids, const float** k, const float** v, const uint32_t** pages,
                       size_t* n_pages) {
  if (kv_head >= st->kv.heads.size()) return static_cast<int>(StatusCode::kNotFound);
  const auto& h = st->kv.heads[kv_head];
  *ids = h.ids.data();
  *n_ids = h.ids.size();
  *k = h.k.data();
  *v = h.v.data();
  *pages = h.pages.data();
  *n_pages = h.pages.size();
  return 0;
}

int ctxcache_step_q_head(const ctxcache_step_t* st, uint32_t kv_head, uint32_t g,
                         const int32_t** ids, size_t* n) {
  if (kv_head >= st->kv.heads.size() || g >= st->kv.heads[kv_head].per_q_head.size()) {
    return static_cast<int>(StatusCode::kNotFound);
  }
  const auto& q = st->kv.heads[kv_head].per_q_head[g];
  *ids = q.data();
  *n = q.size();
  return 0;
}

void ctxcache_step_destroy(ctxcache_step_t* st) { delete st; }

void ctxcache_step_counts(const ctxcache_step_t* st, ctxcache_step_counts_t* out) {
  if (st == nullptr || out == nullptr) return;
  out->bytes_received = st->kv.bytes_received;
  out->pages_fetched = st->kv.pages;
  out->cache_hits = st->kv.cache_hits;
}

void ctxcache_session_page_cache_stats(const ctxcache_session_t* s,
                                       ctxcache_page_cache_stats_t* out) {
  if (s == nullptr || out == nullptr) return;
  const cc::PageCacheStats p = s->session->page_cache_stats();
  out->hits = p.hits;
  out->misses = p.misses;
  out->bytes = p.bytes;
  out->evictions = p.evictions;
  out->prefetch_requests = p.prefetch_requests;
  out->prefetched_pages = p.prefetched_pages;
  out->prefetched_bytes = p.prefetched_bytes;
  out->prefetch_hits = p.prefetch_hits;
  out->prefetch_failures = p.prefetch_failures;
}

}  // extern "C"
