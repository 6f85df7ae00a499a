// Helpers shared by the storage tests: temp dirs, model specs, and
// deterministic synthetic KV so that every read can be checked exactly.
#pragma once

#include <rocksdb/db.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"
#include "storage/store.h"

namespace ctxcache::storage::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& base = "/tmp") {
    std::string tmpl = base + "/ctxcache-storage-test-XXXXXX";
    char* p = mkdtemp(tmpl.data());
    path_ = p ? std::string(p) : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline uint64_t DirBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  }
  return total;
}

inline v1::ModelSpec MakeSpec(uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                              v1::DType dtype = v1::DTYPE_BF16, const std::string& fp = "fp-A") {
  v1::ModelSpec m;
  m.set_name("test-model");
  m.set_n_layers(layers);
  m.set_n_q_heads(kv_heads * 2);
  m.set_n_kv_heads(kv_heads);
  m.set_head_dim(head_dim);
  m.set_kv_dtype(dtype);
  m.set_fingerprint(fp);
  m.mutable_rope()->set_theta(10000.0);
  return m;
}

inline std::vector<uint32_t> Tokens(size_t n, uint32_t seed = 1) {
  std::vector<uint32_t> t(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : t) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<uint32_t>(x % 32000);
  }
  return t;
}

// Deterministic KV value for (layer, head, token, dim, is_v): depends only on
// the token id and position, so a child context's KV for shared tokens equals
// its parent's.
inline float KvValue(uint32_t layer, uint32_t head, uint64_t token, uint32_t dim, bool is_v) {
  uint64_t x = (uint64_t{layer} * 1315423911u) ^ (uint64_t{head} * 2654435761u) ^ (token * 97531u) ^
               (uint64_t{dim} * 7919u) ^ (is_v ? 0xABCDEFull : 0);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return static_cast<float>(static_cast<int64_t>(x % 20001) - 10000) / 1000.0f;
}

// Fills [n][head_dim] elements of `dtype` for one (layer, head) from token t0.
inline std::vector<uint8_t> KvRows(DType dtype, uint32_t layer, uint32_t head, uint64_t t0,
                                   uint32_t n, uint32_t head_dim, bool is_v) {
  std::vector<float> f(size_t{n} * head_dim);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t d = 0; d < head_dim; ++d)
      f[size_t{t} * head_dim + d] = KvValue(layer, head, t0 + t, d, is_v);
  }
  std::vector<uint8_t> out(f.size() * DTypeSize(dtype));
  ConvertFromFloat(dtype, f.data(), out.data(), f.size());
  return out;
}

// Writes KV for tokens [from, to) of every (layer, head) in chunks of `chunk`.
inline Status WriteKv(ContextWriter* w, uint64_t from, uint64_t to, uint32_t chunk = 100) {
  const auto& m = w->manifest().model();
  DType dtype = *FromProtoDType(m.kv_dtype());
  for (uint64_t t = from; t < to; t += chunk) {
    uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(chunk, to - t));
    for (uint32_t l = 0; l < m.n_layers(); ++l) {
      for (uint32_t h = 0; h < m.n_kv_heads(); ++h) {
        auto k = KvRows(dtype, l, h, t, n, m.head_dim(), false);
        auto v = KvRows(dtype, l, h, t, n, m.head_dim(), true);
        RETURN_IF_ERROR(w->AppendKV(l, h, t, n, dtype, k.data(), v.data()));
      }
    }
  }
  return Status::OK();
}

// Builds (or finds) a complete context; returns its manifest.
inline StatusOr<v1::ContextManifest> BuildContext(Store* store, const v1::ModelSpec& spec,
                                                  const std::vector<uint32_t>& tokens,
                                                  std::optional<ContextId> parent = std::nullopt,
                                                  int64_t ttl_ms = 0, bool pinned = false) {
  BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  req.parent = parent;
  req.ttl_ms = ttl_ms;
  req.pinned = pinned;
  ASSIGN_OR_RETURN(BuildStart start, store->BeginBuild(req));
  if (!start.writer) return start.existing;
  RETURN_IF_ERROR(WriteKv(start.writer.get(), start.writer->first_token(), tokens.size()));
  return start.writer->Commit();
}

// Checks that page `i` of `batch` holds the synthetic KV of its block.
inline bool PageMatches(const PageBatch& batch, size_t i, uint32_t layer, uint32_t head) {
  const uint64_t t0 = uint64_t{batch.blocks[i]} * batch.block_tokens;
  auto k = KvRows(batch.dtype, layer, head, t0, batch.n_tokens[i], batch.head_dim, false);
  auto v = KvRows(batch.dtype, layer, head, t0, batch.n_tokens[i], batch.head_dim, true);
  return std::memcmp(batch.K(i), k.data(), k.size()) == 0 &&
         std::memcmp(batch.V(i), v.data(), v.size()) == 0;
}

// Opens the raw RocksDB of a (closed) store with all its column families.
struct RawDb {
  std::unique_ptr<rocksdb::DB> db;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  std::vector<std::string> names;
  rocksdb::ColumnFamilyHandle* cf(const std::string& name) const {
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == name) return handles[i];
    }
    return nullptr;
  }
  ~RawDb() {
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    if (db) db->Close().PermitUncheckedError();
  }
};

inline std::unique_ptr<RawDb> OpenRaw(const std::string& path) {
  auto raw = std::make_unique<RawDb>();
  rocksdb::DBOptions o;
  if (!rocksdb::DB::ListColumnFamilies(o, path, &raw->names).ok()) return nullptr;
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  rocksdb::ColumnFamilyOptions cfo;
  cfo.compression = rocksdb::kNoCompression;  // values stay findable in files it flushes
  for (auto& n : raw->names) descs.emplace_back(n, cfo);
  rocksdb::DB* db = nullptr;
  if (!rocksdb::DB::Open(o, path, descs, &raw->handles, &db).ok()) return nullptr;
  raw->db.reset(db);
  return raw;
}

// Store options for tests: no background thread, small memtables.
inline StoreOptions TestOptions(Clock* clock = nullptr) {
  StoreOptions o;
  o.background_interval_ms = 0;
  o.clock = clock;
  o.write_buffer_bytes = 4 << 20;
  o.block_cache_bytes = 8 << 20;
  o.write_batch_bytes = 1 << 20;
  return o;
}

}  // namespace ctxcache::storage::testing
