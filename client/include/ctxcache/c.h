/* ctxcache C API: a C ABI over the C++ SDK (ctxcache/client.h), in the
 * manner of leveldb/c.h and rocksdb/c.h, for Python (ctypes) and any other
 * language. Library: libctxcache_c.so (exports only the ctxcache_* symbols
 * below; its gRPC, protobuf and abseil are hidden inside).
 *
 * Errors: every call that can fail returns a status code, 0 = OK, else a
 * gRPC canonical code (3 INVALID_ARGUMENT, 5 NOT_FOUND, 9
 * FAILED_PRECONDITION, 14 UNAVAILABLE, 15 DATA_LOSS, ...). When errptr is
 * not NULL, a failure stores a message in *errptr (malloc'd; free it with
 * ctxcache_free) and success stores NULL.
 *
 * Memory: buffers passed in (KV layouts) stay owned by the caller, who
 * keeps them valid for as long as a load may write them (until it is done
 * or destroyed). Objects made by *_create / *_connect / *_start are freed by
 * the matching *_destroy.
 *
 * Threads: a client is safe for concurrent use; a load is too. Calls that
 * move data block the calling thread only (ctypes releases the GIL around
 * every call).
 */
#ifndef CTXCACHE_C_H_
#define CTXCACHE_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CTXCACHE_EXPORT __attribute__((visibility("default")))

typedef struct ctxcache_options_t ctxcache_options_t;
typedef struct ctxcache_client_t ctxcache_client_t;
typedef struct ctxcache_load_t ctxcache_load_t;
typedef struct ctxcache_index_t ctxcache_index_t;
typedef struct ctxcache_map_t ctxcache_map_t;
typedef struct ctxcache_session_t ctxcache_session_t;
typedef struct ctxcache_step_t ctxcache_step_t;
typedef struct ctxcache_ingest_t ctxcache_ingest_t;

/* Element types (ctxcache.v1.DType). */
enum { CTXCACHE_F32 = 1, CTXCACHE_F16 = 2, CTXCACHE_BF16 = 3 };

/* The ABI version this header describes; ctxcache_abi_version() returns the
 * library's. They must be equal. */
#define CTXCACHE_ABI_VERSION 5
CTXCACHE_EXPORT int ctxcache_abi_version(void);

CTXCACHE_EXPORT void ctxcache_free(void* ptr);

/* ---- connect ---------------------------------------------------------- */

/* Options of ctxcache/client.h ClientOptions; the defaults are its. */
CTXCACHE_EXPORT ctxcache_options_t* ctxcache_options_create(void);
CTXCACHE_EXPORT void ctxcache_options_destroy(ctxcache_options_t* o);
/* HOST:PORT, or etcd://host:port[,...]/<cluster>. Default 127.0.0.1:7700. */
CTXCACHE_EXPORT void ctxcache_options_set_server(ctxcache_options_t* o, const char* server);
CTXCACHE_EXPORT void ctxcache_options_set_api_key(ctxcache_options_t* o, const char* key);
/* PEM file paths; a CA makes the connection TLS, cert + key make it mTLS. */
CTXCACHE_EXPORT void ctxcache_options_set_tls(ctxcache_options_t* o, const char* ca_path,
                                              const char* cert_path, const char* key_path,
                                              const char* server_name);
/* Deadline of each call attempt (and of each layer of a KV load), seconds. */
CTXCACHE_EXPORT void ctxcache_options_set_timeout(ctxcache_options_t* o, double seconds);
CTXCACHE_EXPORT void ctxcache_options_set_max_attempts(ctxcache_options_t* o, int attempts);
/* With an etcd:// server: the cluster's replica count. */
CTXCACHE_EXPORT void ctxcache_options_set_cluster_replicas(ctxcache_options_t* o, uint32_t r);

/* Connects lazily: bad options fail here, an unreachable server on the
 * first call (UNAVAILABLE). */
CTXCACHE_EXPORT int ctxcache_connect(const ctxcache_options_t* o, ctxcache_client_t** out,
                                     char** errptr);
CTXCACHE_EXPORT void ctxcache_client_destroy(ctxcache_client_t* c);

/* ---- contexts ----------------------------------------------------------- */

typedef struct {
  uint64_t n_tokens;
  uint32_t n_layers;
  uint32_t n_q_heads;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  uint32_t block_tokens;
  int32_t kv_dtype; /* CTXCACHE_BF16, ... */
  int32_t state;    /* ctxcache.v1.ContextState: 2 = READY */
} ctxcache_context_t;

/* The context's shape; *proto / *proto_len (optional, may be NULL) get its
 * serialized ctxcache.v1.ContextInfo (free *proto with ctxcache_free). */
CTXCACHE_EXPORT int ctxcache_get_context(ctxcache_client_t* c, const char* context_id,
                                         ctxcache_context_t* out, char** proto,
                                         size_t* proto_len, char** errptr);

/* Builds (or finds, when it exists) the context of tokens[0..n_tokens) on
 * `model` ("" = the server's default) with the server's default indexes;
 * *context_id gets its id (32 hex characters + NUL, malloc'd). */
CTXCACHE_EXPORT int ctxcache_build_tokens(ctxcache_client_t* c, const char* model,
                                          const uint32_t* tokens, size_t n_tokens,
                                          char** context_id, char** errptr);

/* ---- bulk KV load ------------------------------------------------------- */

/* Caller memory to fill (ctxcache/client.h KVLayout): element (layer slot i,
 * kv head h, token t, dim j) of K is at byte offset i * layer_stride +
 * h * head_stride + t * token_stride + j * element size from k; V likewise
 * from v. Strides of 0 = dense [slots][n_kv_heads][n_tokens][head_dim]. */
typedef struct {
  void* k;
  void* v;
  size_t k_capacity; /* bytes */
  size_t v_capacity; /* bytes */
  int64_t layer_stride;
  int64_t head_stride;
  int64_t token_stride;
  int32_t dtype; /* must equal the context's kv dtype */
} ctxcache_kv_layout_t;

typedef struct {
  uint64_t bytes_done;
  uint64_t bytes_total;
  uint32_t layers_done;
  uint32_t layers_total;
  uint64_t frames;
  double seconds;
} ctxcache_load_progress_t;

/* Starts loading layers[0..n_layers) (n_layers 0 = all) in the background
 * over `streams` connections (0 = 4) in frames of frame_bytes (0 = 4 MiB).
 * A bad layout or too-small buffer fails here with INVALID_ARGUMENT naming
 * the field, and nothing is written. */
CTXCACHE_EXPORT int ctxcache_load_kv_start(ctxcache_client_t* c, const char* context_id,
                                           const uint32_t* layers, size_t n_layers, int streams,
                                           uint32_t frame_bytes,
                                           const ctxcache_kv_layout_t* layout,
                                           ctxcache_load_t** out, char** errptr);
/* Blocks until `layer` (a context layer number) is in the buffers; takes it
 * next if it was still queued. */
CTXCACHE_EXPORT int ctxcache_load_wait_layer(ctxcache_load_t* l, uint32_t layer, char** errptr);
/* Moves `layer` to the front of the queue. */
CTXCACHE_EXPORT int ctxcache_load_prioritize(ctxcache_load_t* l, uint32_t layer, char** errptr);
/* Blocks until every layer is in, or the first failure (e.g. DATA_LOSS). */
CTXCACHE_EXPORT int ctxcache_load_wait(ctxcache_load_t* l, char** errptr);
CTXCACHE_EXPORT void ctxcache_load_cancel(ctxcache_load_t* l);
CTXCACHE_EXPORT int ctxcache_load_done(const ctxcache_load_t* l);
CTXCACHE_EXPORT void ctxcache_load_progress(const ctxcache_load_t* l,
                                            ctxcache_load_progress_t* out);
/* Cancels what is left and waits for the streams to stop. */
CTXCACHE_EXPORT void ctxcache_load_destroy(ctxcache_load_t* l);

/* start + wait + destroy; *progress (may be NULL) gets the final counts. */
CTXCACHE_EXPORT int ctxcache_load_kv(ctxcache_client_t* c, const char* context_id,
                                     const uint32_t* layers, size_t n_layers, int streams,
                                     uint32_t frame_bytes, const ctxcache_kv_layout_t* layout,
                                     ctxcache_load_progress_t* progress, char** errptr);

/* ---- same-host shared memory (MapKV) ----------------------------------- */

/* Where a mapping holds each element (ctxcache/client.h KVMapLayout): K of
 * (layer slot i, kv head h, token t) at i * layer_stride + h * head_stride +
 * t * token_stride from the data pointer, V at the same plus v_offset. */
typedef struct {
  uint64_t layer_stride;
  uint64_t head_stride;
  uint64_t token_stride;
  uint64_t v_offset;
  uint64_t n_tokens;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  uint32_t n_slots;
  int32_t dtype;
} ctxcache_map_layout_t;

/* Maps layers[0..n_layers) (0 = all) of a context read-only into this
 * process from a shared-memory segment the server fills (no byte crosses
 * gRPC); returns once mapped, while the fill goes on. UNAVAILABLE when the
 * server's socket is not reachable from here (another host: use
 * ctxcache_load_kv). The call's deadline, fill included, is the client's
 * timeout per layer mapped (32 layers' worth for n_layers 0). */
CTXCACHE_EXPORT int ctxcache_map_kv_start(ctxcache_client_t* c, const char* context_id,
                                          const uint32_t* layers, size_t n_layers,
                                          ctxcache_map_t** out, char** errptr);
CTXCACHE_EXPORT int ctxcache_map_wait_layer(ctxcache_map_t* m, uint32_t layer, char** errptr);
CTXCACHE_EXPORT int ctxcache_map_wait(ctxcache_map_t* m, char** errptr);
/* The mapping's address, size and layout (valid until destroyed). */
CTXCACHE_EXPORT void ctxcache_map_get(const ctxcache_map_t* m, const void** data, uint64_t* size,
                                      ctxcache_map_layout_t* layout);
/* Cancels a fill in progress and unmaps. */
CTXCACHE_EXPORT void ctxcache_map_destroy(ctxcache_map_t* m);

/* ---- pages and index ---------------------------------------------------- */

/* Pages blocks[0..n_blocks) (a page table: strictly increasing) of
 * (layer, kv_head), crc32c-checked, into out: page i at out + i *
 * page_bytes, its raw payload (K rows then V rows, [tokens][head_dim] each,
 * the kv dtype), page_bytes = 2 * block_tokens * head_dim * element size
 * (a short last page leaves the rest of its slot untouched). out_capacity
 * must be >= n_blocks * page_bytes. */
CTXCACHE_EXPORT int ctxcache_fetch_pages(ctxcache_client_t* c, const char* context_id,
                                         uint32_t layer, uint32_t kv_head,
                                         const uint32_t* blocks, size_t n_blocks, void* out,
                                         size_t out_capacity, char** errptr);

/* One (layer, kv head)'s pages for ctxcache_fetch_pages_into. */
typedef struct {
  uint32_t layer;
  uint32_t kv_head;
  const uint32_t* blocks; /* strictly increasing */
  size_t n_blocks;
} ctxcache_page_table_t;

/* The pages of tables[0..n_tables) (one FetchPages call, crc32c-checked)
 * written in place into a layout of the whole context (layer slot i =
 * layer i; the checks of ctxcache_load_kv_start for every layer): each
 * page's K and V rows at its tokens' rows, where a bulk load puts them;
 * other rows untouched (ctxcache/client.h Client::FetchPagesInto). A bad
 * layout or table fails with INVALID_ARGUMENT naming the field
 * (tables[i].blocks[j], layout.k_capacity, ...), and nothing is written. */
CTXCACHE_EXPORT int ctxcache_fetch_pages_into(ctxcache_client_t* c, const char* context_id,
                                              const ctxcache_page_table_t* tables,
                                              size_t n_tables,
                                              const ctxcache_kv_layout_t* layout,
                                              char** errptr);

/* A method's serialized index artifacts (docs/storage-format.md), every
 * (layer, kv head), crc32c-checked. */
CTXCACHE_EXPORT int ctxcache_fetch_index(ctxcache_client_t* c, const char* context_id,
                                         const char* method, ctxcache_index_t** out,
                                         char** errptr);
/* The same for layers[0..n_layers) only (n_layers 0 = every layer): a
 * worker fetches a large index as several concurrent calls, or layer by
 * layer as it needs them. INVALID_ARGUMENT for a layer out of range. */
CTXCACHE_EXPORT int ctxcache_fetch_index_layers(ctxcache_client_t* c, const char* context_id,
                                                const char* method, const uint32_t* layers,
                                                size_t n_layers, ctxcache_index_t** out,
                                                char** errptr);
/* The artifact of (layer, kv_head): *data stays valid until the index is
 * destroyed. NOT_FOUND (5) when there is none. */
CTXCACHE_EXPORT int ctxcache_index_get(const ctxcache_index_t* idx, uint32_t layer,
                                       uint32_t kv_head, const char** data, size_t* len);
CTXCACHE_EXPORT void ctxcache_index_destroy(ctxcache_index_t* idx);

/* ---- ingest ------------------------------------------------------------ */

/* One layer's post-RoPE K, V and (optionally) Q in caller memory
 * (ctxcache/client.h IngestLayerLayout), n = the header's token count:
 * element (kv head h, token t, dim j) of K at byte offset h * head_stride +
 * t * token_stride + j * element size from k, V likewise from v, Q's (q head
 * h) with q_head_stride and q_token_stride from q. Strides of 0 = dense
 * [heads][n][head_dim]. */
typedef struct {
  const void* k;
  const void* v;
  const void* q; /* NULL: no queries */
  size_t k_capacity; /* bytes */
  size_t v_capacity;
  size_t q_capacity;
  int64_t head_stride;
  int64_t token_stride;
  int64_t q_head_stride;
  int64_t q_token_stride;
  int32_t dtype; /* CTXCACHE_F32, CTXCACHE_F16 or CTXCACHE_BF16: sent as is */
} ctxcache_ingest_layer_t;

/* Options of an ingest (ctxcache/client.h IngestOptions); zeros = defaults. */
typedef struct {
  uint32_t frame_bytes;  /* payload per message; 0 = 4 MiB */
  double timeout_s;      /* the whole stream's deadline; 0 = max(client timeout, 3600) */
  int64_t parent_tokens; /* a child's parent's n_tokens if known; <= 0 = ask the server */
} ctxcache_ingest_options_t;

/* Opens an ingest (IngestContext): header is a serialized
 * ctxcache.v1.IngestHeader (docs/api.md: model, tokens, indexes, name, ...,
 * parent_id); options may be NULL (defaults). A header that does not parse,
 * has no tokens or a zero model dimension is INVALID_ARGUMENT naming the
 * field; the server may refuse the header here. */
CTXCACHE_EXPORT int ctxcache_ingest_start(ctxcache_client_t* c, const char* header,
                                          size_t header_len,
                                          const ctxcache_ingest_options_t* options,
                                          ctxcache_ingest_t** out, char** errptr);
/* Sends layer `layer` (layers in order, 0 first), copied once from the
 * caller's memory into frames. A bad layout, too-small buffer or a layer
 * out of order is INVALID_ARGUMENT naming the field, with nothing sent (the
 * ingest stays usable); a server error ends the ingest. */
CTXCACHE_EXPORT int ctxcache_ingest_write_layer(ctxcache_ingest_t* in, uint32_t layer,
                                                const ctxcache_ingest_layer_t* layout,
                                                char** errptr);
/* Commits after the model's last layer. out (may be NULL) gets the stored
 * context's shape; *context_id (may be NULL) its id (malloc'd); *proto /
 * *proto_len (may be NULL) its serialized ctxcache.v1.ContextInfo (free
 * with ctxcache_free). */
CTXCACHE_EXPORT int ctxcache_ingest_commit(ctxcache_ingest_t* in, ctxcache_context_t* out,
                                           char** context_id, char** proto, size_t* proto_len,
                                           char** errptr);
/* Frees the ingest; one not committed is cancelled and nothing is stored. */
CTXCACHE_EXPORT void ctxcache_ingest_destroy(ctxcache_ingest_t* in);

/* ---- decode sessions (the session core) --------------------------------- */

/* Opens a decode session on a context (ctxcache/client.h SessionOptions).
 * method: csa | tactic | lfps | quest | streaming | oracle | full. params:
 * session params as "key=value" pairs separated by ';' (docs/api.md; NULL
 * or "" for none). client_mode 0: the server runs the session core and
 * sends the pages (one round trip per layer-step); 1: the C++ session core
 * (session/sparse_session.h) runs in this process over the fetched index,
 * pages from FetchPages. INVALID_ARGUMENT for a malformed params string
 * (naming the pair); the server's errors otherwise. */
CTXCACHE_EXPORT int ctxcache_session_open(ctxcache_client_t* c, const char* context_id,
                                          const char* method, const char* params,
                                          int client_mode, ctxcache_session_t** out,
                                          char** errptr);
/* One layer-step: queries [n_q_heads][head_dim] fp32, post-RoPE. *out holds
 * the selections and their K/V (fp32) until ctxcache_step_destroy. */
CTXCACHE_EXPORT int ctxcache_session_step(ctxcache_session_t* s, uint32_t layer,
                                          const float* queries, ctxcache_step_t** out,
                                          char** errptr);
/* The new token's post-RoPE K, V [n_layers][n_kv_heads][head_dim] and Q
 * [n_layers][n_q_heads][head_dim] (q may be NULL), fp32. */
CTXCACHE_EXPORT int ctxcache_session_append(ctxcache_session_t* s, const float* k,
                                            const float* v, const float* q, char** errptr);
/* Tokens of the session's sequence: the context plus those appended. */
CTXCACHE_EXPORT int64_t ctxcache_session_n_tokens(const ctxcache_session_t* s);
/* Closes the session (its Decode stream) and frees it. */
CTXCACHE_EXPORT void ctxcache_session_destroy(ctxcache_session_t* s);

/* A step's kv heads, and the q heads of kv head h's group. */
CTXCACHE_EXPORT uint32_t ctxcache_step_n_heads(const ctxcache_step_t* st);
CTXCACHE_EXPORT uint32_t ctxcache_step_group(const ctxcache_step_t* st, uint32_t kv_head);
/* Kv head h: the union of its q heads' token ids (sorted; n_ids), their K
 * and V rows ([n_ids][head_dim] fp32), the pages fetched (sorted;
 * n_pages). Pointers stay valid until the step is destroyed. NOT_FOUND (5)
 * for h out of range. */
CTXCACHE_EXPORT int ctxcache_step_head(const ctxcache_step_t* st, uint32_t kv_head,
                                       const int32_t** ids, size_t* n_ids, const float** k,
                                       const float** v, const uint32_t** pages,
                                       size_t* n_pages);
/* Q head g of kv head h's group: the token ids it attends (sorted).
 * NOT_FOUND (5) for h or g out of range. */
CTXCACHE_EXPORT int ctxcache_step_q_head(const ctxcache_step_t* st, uint32_t kv_head,
                                         uint32_t g, const int32_t** ids, size_t* n);
CTXCACHE_EXPORT void ctxcache_step_destroy(ctxcache_step_t* st);

/* What one step moved (ctxcache/client.h SelectedKV): the page payload
 * bytes it received from the server (K and V as sent, before decoding),
 * the pages it fetched, and the pages it found in the session's page cache
 * instead (client mode; 0 in server mode, where the server sends every
 * page of every step). */
typedef struct {
  uint64_t bytes_received;
  uint64_t pages_fetched;
  uint64_t cache_hits;
} ctxcache_step_counts_t;
CTXCACHE_EXPORT void ctxcache_step_counts(const ctxcache_step_t* st, ctxcache_step_counts_t* out);

/* A session's page cache so far (ctxcache/client.h PageCacheStats): look-ups
 * that hit and missed, the decoded bytes it holds now, evictions, and its
 * prefetches. All 0 in server mode (no client-side cache). */
typedef struct {
  uint64_t hits;
  uint64_t misses;
  uint64_t bytes;
  uint64_t evictions;
  uint64_t prefetch_requests;
  uint64_t prefetched_pages;
  uint64_t prefetched_bytes;
  uint64_t prefetch_hits;
  uint64_t prefetch_failures;
} ctxcache_page_cache_stats_t;
CTXCACHE_EXPORT void ctxcache_session_page_cache_stats(const ctxcache_session_t* s,
                                                       ctxcache_page_cache_stats_t* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CTXCACHE_C_H_ */
