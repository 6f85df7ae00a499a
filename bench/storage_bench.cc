// ctxcache-bench storage: the RocksDB page store against the raw disk.
//
// Workloads (one JSON object on the last line of stdout):
//   codecs     ratio and single-thread encode/decode speed of every page codec
//              on synthetic bf16 KV that looks like real keys/values
//              (per-channel scales, outlier channels, a Gaussian mixture of
//              token clusters); picks nothing, reports.
//   write      a Llama-3-8B shaped context (32 layers, 8 kv heads, d = 128,
//              bf16, 16-token pages; 32K tokens, 2K with --quick) written
//              through ContextWriter in 512-token prefill chunks, including
//              Commit: write_gbps = raw KV bytes / s.
//   read_warm  page-table reads (per layer, per kv head, a sorted random 5% of
//              the blocks; a table is a function of its id alone): one step of
//              tables read once to fill a 1 GiB block cache, then the same
//              tables 5 more times, timed; with the block-cache hit ratio of
//              the timed passes and the working set against the cache size.
//   read_cold  the store reopened with the block cache off and
//              use_direct_reads = true (O_DIRECT: the OS page cache cannot
//              help), fresh random tables, at the default read_io_depth
//              (MultiGet; the iterator too), then swept over --depths.
//              read_cold_gbps counts stored (on-disk) bytes per second.
//   fio        random reads on the same filesystem, bs = average stored page
//              size rounded up to 4 KiB (O_DIRECT), direct=1: psync with
//              numjobs = reader threads (QD1 each) and libaio QD32, each run
//              right before and right after the default store's cold reads
//              (means reported: read_vs_fio_qd1, read_vs_fio_qd32); a libaio
//              queue-depth sweep (--fio-qds) at the end; sequential writes
//              (bs 1 MiB, libaio QD8) before the store's writes
//              (write_vs_fio_seq).
//   variants   the default store (SST ingestion), the memtable path
//              ("sst_memtable") and BlobDB ("blob"): write, warm/cold reads
//              and the disk space reclaimed by deleting the context.
//
// Usage: ctxcache-bench storage [--quick] [--dir PATH] [--tokens N]
//        [--threads T] [--read-seconds S] [--depths 1,2,..] [--fio-qds 1,2,..]
//        [--no-variants]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_registry.h"
#include "common/dtype.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"
#include "storage/page_codec.h"
#include "storage/store.h"

namespace ctxcache::bench {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using storage::ContextId;
using storage::PageBatch;
using storage::PageCodec;
using storage::PageReadMethod;
using storage::Store;
using storage::StoreOptions;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

uint64_t DirBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  }
  return total;
}

// Synthetic KV for `tokens` tokens x `heads` kv heads x `dim`, token-major
// ([t][h][d]) bf16, as a forward pass emits it. Keys: per-channel mean and
// log-normal scale, 4 outlier channels (x15) per head, tokens drawn from a
// 4-component mixture. Values: zero-mean, milder per-channel scales.
void SyntheticKv(uint32_t seed, uint32_t tokens, uint32_t heads, uint32_t dim,
                 std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> kscale(heads * dim), kmean(heads * dim), vscale(heads * dim);
  std::vector<float> comp(4 * heads * dim);
  for (uint32_t i = 0; i < heads * dim; ++i) {
    kscale[i] = std::exp(0.5f * g(rng));
    if (i % dim < 4) kscale[i] *= 15.0f;  // outlier channels
    kmean[i] = 0.5f * g(rng) * kscale[i];
    vscale[i] = 0.05f * std::exp(0.3f * g(rng));
  }
  for (auto& c : comp) c = 0.3f * g(rng);
  std::vector<float> kf(size_t{tokens} * heads * dim), vf(kf.size());
  for (uint32_t t = 0; t < tokens; ++t) {
    uint32_t c = rng() % 4;
    for (uint32_t i = 0; i < heads * dim; ++i) {
      size_t o = size_t{t} * heads * dim + i;
      kf[o] = kmean[i] + kscale[i] * (comp[c * heads * dim + i] + g(rng));
      vf[o] = vscale[i] * g(rng);
    }
  }
  k->resize(kf.size());
  v->resize(vf.size());
  FloatToBf16(kf.data(), k->data(), kf.size());
  FloatToBf16(vf.data(), v->data(), vf.size());
}

// Raw pages ([K rows][V rows] of 16 x dim) cut from synthetic KV.
std::vector<std::string> SyntheticPages(size_t n_pages, uint32_t dim) {
  std::vector<uint16_t> k, v;
  const uint32_t heads = 8, tokens = 512;
  std::vector<std::string> pages;
  for (uint32_t seed = 1; pages.size() < n_pages; ++seed) {
    SyntheticKv(seed, tokens, heads, dim, &k, &v);
    for (uint32_t h = 0; h < heads && pages.size() < n_pages; ++h) {
      for (uint32_t t0 = 0; t0 < tokens && pages.size() < n_pages; t0 += 16) {
        std::string raw(2 * 16 * dim * 2, '\0');
        for (uint32_t t = 0; t < 16; ++t) {
          std::memcpy(raw.data() + t * dim * 2, k.data() + (size_t{t0 + t} * heads + h) * dim,
                      dim * 2);
          std::memcpy(raw.data() + (16 + t) * dim * 2,
                      v.data() + (size_t{t0 + t} * heads + h) * dim, dim * 2);
        }
        pages.push_back(std::move(raw));
      }
    }
  }
  return pages;
}

Json MeasureCodecs(size_t n_pages, uint32_t dim) {
  auto pages = SyntheticPages(n_pages, dim);
  Json out = Json::object();
  struct Variant {
    const char* name;
    PageCodec codec;
    int level;
  };
  const Variant variants[] = {{"none", PageCodec::kNone, 0},
                              {"zstd", PageCodec::kZstd, 1},
                              {"zstd_l3", PageCodec::kZstd, 3},
                              {"zstd_shuffle", PageCodec::kZstdShuffle, 1},
                              {"zstd_shuffle_l3", PageCodec::kZstdShuffle, 3},
                              {"zstd_shuffle_l-1", PageCodec::kZstdShuffle, -1}};
  storage::PageShape shape{DType::kBF16, 16, dim};
  for (const auto& var : variants) {
    std::vector<std::string> enc(pages.size());
    uint64_t raw_bytes = 0, enc_bytes = 0;
    auto t0 = Clock::now();
    for (size_t i = 0; i < pages.size(); ++i) {
      if (!storage::EncodePage({var.codec, var.level}, shape, pages[i], &enc[i]).ok()) return out;
      raw_bytes += pages[i].size();
      enc_bytes += enc[i].size();
    }
    auto t1 = Clock::now();
    std::vector<uint8_t> buf(shape.RawBytes());
    storage::PageHeader h;
    for (size_t i = 0; i < pages.size(); ++i) {
      if (!storage::DecodePage(enc[i], buf.data(), buf.size(), &h).ok()) return out;
    }
    auto t2 = Clock::now();
    out[var.name] = {{"ratio", double(raw_bytes) / double(enc_bytes)},
                     {"encode_mbps", raw_bytes / 1e6 / Seconds(t0, t1)},
                     {"decode_mbps", raw_bytes / 1e6 / Seconds(t1, t2)}};
    std::printf("codec %-18s ratio %.3f  encode %7.0f MB/s  decode %7.0f MB/s\n", var.name,
                out[var.name]["ratio"].get<double>(), out[var.name]["encode_mbps"].get<double>(),
                out[var.name]["decode_mbps"].get<double>());
  }
  return out;
}

// Runs fio and returns bytes/s of the job group (0 if fio fails).
double RunFio(const std::string& args, bool read) {
  std::string cmd = "fio --output-format=json --group_reporting " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return 0;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) return 0;
  auto j = Json::parse(out, nullptr, false);
  if (!j.is_object() || !j.contains("jobs") || j["jobs"].empty()) return 0;
  return j["jobs"][0][read ? "read" : "write"]["bw_bytes"].get<double>();
}

struct WriteResult {
  ContextId id;
  double seconds = 0;
  uint64_t raw_bytes = 0;
  uint64_t stored_bytes = 0;
  uint32_t n_blocks = 0;
  size_t peak_buffered = 0;
};

StatusOr<WriteResult> WriteContext(Store* store, uint32_t n_tokens, uint32_t seed) {
  const uint32_t layers = 32, heads = 8, dim = 128, chunk = 512;
  v1::ModelSpec spec;
  spec.set_name("llama-3-8b-shape");
  spec.set_n_layers(layers);
  spec.set_n_q_heads(32);
  spec.set_n_kv_heads(heads);
  spec.set_head_dim(dim);
  spec.set_kv_dtype(v1::DTYPE_BF16);
  spec.set_fingerprint("bench-fingerprint");
  std::vector<uint32_t> tokens(n_tokens);
  std::mt19937 rng(seed);
  for (auto& t : tokens) t = rng() % 128000;
  // A pool of distinct prefill chunks, cycled over (layer, chunk).
  const int kPool = 8;
  std::vector<std::vector<uint16_t>> pk(kPool), pv(kPool);
  for (int i = 0; i < kPool; ++i) SyntheticKv(seed * 100 + i, chunk, heads, dim, &pk[i], &pv[i]);

  storage::BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  auto t0 = Clock::now();
  ASSIGN_OR_RETURN(storage::BuildStart start, store->BeginBuild(req));
  if (!start.writer) return FailedPreconditionError("context already exists");
  for (uint32_t t = 0; t < n_tokens; t += chunk) {
    uint32_t n = std::min(chunk, n_tokens - t);
    for (uint32_t l = 0; l < layers; ++l) {
      int p = static_cast<int>((l * 7 + t / chunk) % kPool);
      RETURN_IF_ERROR(
          start.writer->AppendLayerKV(l, t, n, DType::kBF16, pk[p].data(), pv[p].data()));
    }
  }
  auto t_append = Clock::now();
  ASSIGN_OR_RETURN(v1::ContextManifest m, start.writer->Commit());
  auto t1 = Clock::now();
  std::printf("write: append %.2f s, commit (flush + READY) %.2f s\n", Seconds(t0, t_append),
              Seconds(t_append, t1));
  WriteResult r;
  r.id = *ContextId::FromBytes(m.context_id());
  r.seconds = Seconds(t0, t1);
  r.raw_bytes = m.raw_kv_bytes();
  r.stored_bytes = m.stored_bytes();
  r.n_blocks = (n_tokens + 15) / 16;
  r.peak_buffered = start.writer->peak_buffered_bytes();
  return r;
}

struct ReadResult {
  double stored_gbps = 0;
  double raw_gbps = 0;
  double p50_us = 0;
  double p99_us = 0;
  uint64_t fetches = 0;
};

// Page-table fetches: work item = (step, layer, head); each a sorted random
// 5% of the blocks. Stops after `steps` steps or `seconds`.
// `repeat_tables`: every step re-reads the first step's tables (warm runs).
StatusOr<ReadResult> RunReads(Store* store, const ContextId& id, PageReadMethod method, int threads,
                              int steps, double seconds, uint32_t seed,
                              bool repeat_tables = false) {
  ASSIGN_OR_RETURN(auto reader, store->OpenReader(id));
  const uint32_t layers = reader->manifest().model().n_layers();
  const uint32_t heads = reader->manifest().model().n_kv_heads();
  const uint32_t n_blocks = reader->n_blocks();
  const uint32_t per_table = std::max<uint32_t>(1, n_blocks / 20);
  std::atomic<uint64_t> next{0}, stored{0}, raw{0};
  std::atomic<bool> failed{false};
  Status first_error;
  std::mutex mu;
  std::vector<std::vector<double>> lat(threads);
  const uint64_t total = uint64_t{static_cast<uint64_t>(steps)} * layers * heads;
  auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th) {
    pool.emplace_back([&, th] {
      PageBatch batch;
      std::vector<uint32_t> table, all(n_blocks);
      for (;;) {
        uint64_t item = next.fetch_add(1);
        if (item >= total || failed || Clock::now() > deadline) break;
        const uint64_t table_id = repeat_tables ? item % (uint64_t{layers} * heads) : item;
        std::mt19937 rng(static_cast<uint32_t>(seed * 1000003u + table_id));
        // Sorted random subset (partial Fisher-Yates), a function of
        // table_id alone: `all` starts from the identity every time, so a
        // repeated table_id reads the same pages (warm runs).
        for (uint32_t b = 0; b < n_blocks; ++b) all[b] = b;
        for (uint32_t i = 0; i < per_table; ++i) std::swap(all[i], all[i + rng() % (n_blocks - i)]);
        table.assign(all.begin(), all.begin() + per_table);
        std::sort(table.begin(), table.end());
        uint32_t layer = static_cast<uint32_t>((item / heads) % layers);
        uint32_t head = static_cast<uint32_t>(item % heads);
        auto a = Clock::now();
        Status s = reader->ReadPages(layer, head, table, &batch, method);
        auto b = Clock::now();
        if (!s.ok()) {
          std::lock_guard<std::mutex> l(mu);
          first_error = s;
          failed = true;
          break;
        }
        lat[th].push_back(std::chrono::duration<double, std::micro>(b - a).count());
        stored += batch.stored_bytes;
        raw += uint64_t{batch.size()} * batch.page_stride;
      }
    });
  }
  for (auto& t : pool) t.join();
  auto t1 = Clock::now();
  if (failed) return first_error;
  std::vector<double> all_lat;
  for (auto& l : lat) all_lat.insert(all_lat.end(), l.begin(), l.end());
  std::sort(all_lat.begin(), all_lat.end());
  ReadResult r;
  r.fetches = all_lat.size();
  if (!all_lat.empty()) {
    r.p50_us = all_lat[all_lat.size() / 2];
    r.p99_us = all_lat[std::min(all_lat.size() - 1, all_lat.size() * 99 / 100)];
  }
  r.stored_gbps = stored / 1e9 / Seconds(t0, t1);
  r.raw_gbps = raw / 1e9 / Seconds(t0, t1);
  return r;
}

storage::PageCodecOptions g_codec;  // --codec / --zstd-level

// The store configurations measured. kDefault is StoreOptions' defaults.
enum class Variant { kDefault, kIngest, kMemtable, kBlob };

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kIngest:
      return "sst_ingest";
    case Variant::kMemtable:
      return "sst_memtable";
    case Variant::kBlob:
      return "blob";
    default:
      return "default";
  }
}

StoreOptions BenchOptions(Variant variant) {
  StoreOptions o;
  o.page_codec = g_codec;
  o.background_interval_ms = 0;
  if (variant == Variant::kIngest) o.ingest_pages = true;
  if (variant == Variant::kMemtable) o.ingest_pages = false;
  o.enable_blob_files = variant == Variant::kBlob;
  return o;
}

constexpr size_t kWarmCacheBytes = 1ull << 30;  // holds the 5% working set of 32K tokens

StoreOptions WarmOptions(Variant variant) {
  StoreOptions o = BenchOptions(variant);
  o.block_cache_bytes = kWarmCacheBytes;
  o.blob_cache_bytes = variant == Variant::kBlob ? kWarmCacheBytes : 0;
  return o;
}

StoreOptions ColdOptions(Variant variant, uint32_t depth) {
  StoreOptions o = BenchOptions(variant);
  o.block_cache_bytes = 0;
  o.blob_cache_bytes = 0;
  o.use_direct_reads = true;
  o.read_io_depth = depth;
  return o;
}

Json ReadJson(const ReadResult& r) {
  return {{"stored_gbps", r.stored_gbps},
          {"raw_gbps", r.raw_gbps},
          {"p50_us", r.p50_us},
          {"p99_us", r.p99_us},
          {"fetches", r.fetches}};
}

int Fail(const Status& s) {
  std::fprintf(stderr, "storage bench: %s\n", s.ToString().c_str());
  return 1;
}

std::vector<uint32_t> ParseList(const std::string& csv) {
  std::vector<uint32_t> out;
  size_t pos = 0;
  while (pos < csv.size()) {
    size_t comma = csv.find(',', pos);
    if (comma == std::string::npos) comma = csv.size();
    const int v = std::atoi(csv.substr(pos, comma - pos).c_str());
    if (v > 0) out.push_back(static_cast<uint32_t>(v));
    pos = comma + 1;
  }
  return out;
}

struct BenchConfig {
  uint32_t tokens = 0;
  int threads = 2;
  double read_seconds = 0;
  std::vector<uint32_t> depths;  // cold/warm read_io_depth sweep (default variant)
};

// Warm reads: one step of tables (5% of the pages of every (layer, head))
// read once to fill the block cache, then the same tables 5 more times,
// timed, with the block cache hit ratio of the timed passes.
StatusOr<Json> MeasureWarm(Store* store, const ContextId& id, const BenchConfig& cfg) {
  const auto method = StoreOptions().page_read_method;
  ASSIGN_OR_RETURN(ReadResult r1, RunReads(store, id, method, cfg.threads, 1, 1e9, 7));
  const auto before = store->GetStats();
  ASSIGN_OR_RETURN(ReadResult r2, RunReads(store, id, method, cfg.threads, 5, 1e9, 7, true));
  const auto after = store->GetStats();
  const double hits = double(after.block_cache_hits - before.block_cache_hits);
  const double misses = double(after.block_cache_misses - before.block_cache_misses);
  Json w = ReadJson(r2);
  w["first_pass_p50_us"] = r1.p50_us;
  w["block_cache_hit_ratio"] = hits + misses > 0 ? hits / (hits + misses) : 0.0;
  w["block_cache_usage_bytes"] = after.block_cache_usage_bytes;
  w["block_cache_bytes"] = store->options().block_cache_bytes;
  return w;
}

// Cold reads at read_io_depth `depth`: store reopened with the block cache
// off and O_DIRECT, fresh random tables.
StatusOr<ReadResult> MeasureCold(Variant variant, const std::string& path, const ContextId& id,
                                 uint32_t depth, PageReadMethod method, const BenchConfig& cfg,
                                 uint32_t seed) {
  ASSIGN_OR_RETURN(auto store, Store::Open(ColdOptions(variant, depth), path));
  return RunReads(store.get(), id, method, cfg.threads, 1'000'000, cfg.read_seconds, seed);
}

int RunStorageBench(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines as they come
  CLI::App app{"storage: RocksDB page store vs the raw disk"};
  bool quick = false, no_variants = false;
  std::string dir = "ctxcache-bench-storage";
  std::string depths_csv, fio_qds_csv;
  BenchConfig cfg;
  app.add_flag("--quick", quick, "small run (2K tokens, short reads, short sweeps; ~1 min)");
  app.add_option("--dir", dir, "scratch directory on the filesystem to measure (emptied)");
  app.add_option("--tokens", cfg.tokens, "context length (default 32768, 2048 with --quick)");
  app.add_option("--threads", cfg.threads,
                 "reader threads (fio psync numjobs for the QD1 baseline)");
  app.add_option("--read-seconds", cfg.read_seconds, "time budget per read measurement");
  app.add_option("--depths", depths_csv,
                 "read_io_depth sweep for the default store (default 1,2,4,8,16,32,64; "
                 "1,8,32 with --quick)");
  app.add_option("--fio-qds", fio_qds_csv,
                 "fio libaio iodepth sweep (default 1,2,4,8,16,32,64,128; 1,32 with --quick)");
  app.add_flag("--no-blob,--no-variants", no_variants,
               "only the default store (skip the ingest/memtable/blob variants)");
  std::string codec = std::string(storage::PageCodecName(StoreOptions().page_codec.codec));
  int zstd_level = StoreOptions().page_codec.zstd_level;
  app.add_option("--codec", codec, "page codec for the store: none|zstd|zstd_shuffle");
  app.add_option("--zstd-level", zstd_level, "zstd level for the store");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto parsed_codec = storage::ParsePageCodec(codec);
  if (!parsed_codec.ok()) return Fail(parsed_codec.status());
  g_codec = {*parsed_codec, zstd_level};
  if (cfg.tokens == 0) cfg.tokens = quick ? 2048 : 32768;
  if (cfg.read_seconds <= 0) cfg.read_seconds = quick ? 2.0 : 8.0;
  cfg.depths = ParseList(depths_csv.empty() ? (quick ? "1,8,32" : "1,2,4,8,16,32,64") : depths_csv);
  const std::vector<uint32_t> fio_qds =
      ParseList(fio_qds_csv.empty() ? (quick ? "1,32" : "1,2,4,8,16,32,64,128") : fio_qds_csv);
  const StoreOptions defaults;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir);
  Json result;
  result["config"] = {{"tokens", cfg.tokens},
                      {"layers", 32},
                      {"kv_heads", 8},
                      {"head_dim", 128},
                      {"dtype", "bf16"},
                      {"block_tokens", 16},
                      {"reader_threads", cfg.threads},
                      {"read_io_depth", defaults.read_io_depth},
                      {"io_threads", defaults.io_threads},
                      {"ingest_pages", defaults.ingest_pages},
                      {"quick", quick},
                      {"dir", dir}};

  // 1. Codecs.
  Json codecs = MeasureCodecs(quick ? 1024 : 8192, 128);
  result["codecs"] = codecs;
  result["compression_ratio"] = {{"none", codecs["none"]["ratio"]},
                                 {"zstd", codecs["zstd"]["ratio"]},
                                 {"zstd_shuffle", codecs["zstd_shuffle"]["ratio"]}};
  result["config"]["page_codec"] = std::string(storage::PageCodecName(g_codec.codec));
  result["config"]["zstd_level"] = g_codec.zstd_level;

  // 2. fio sequential write on the same filesystem, then write + warm + cold
  //    reads per store variant. fio random reads (QD1 x threads, psync) run
  //    right before and right after the default store's cold reads; the
  //    libaio queue-depth sweep runs after them (the machine is shared;
  //    interleaving keeps the comparison fair).
  const std::string fio_file = dir + "/fio.dat";
  const std::string fio_size = quick ? "256m" : "2g";
  const std::string rt = std::to_string(static_cast<int>(std::ceil(cfg.read_seconds)));
  auto fio_randread_qd1 = [&](uint64_t bs) {
    return RunFio("--name=randread --filename=" + fio_file + " --size=" + fio_size +
                      " --rw=randread --bs=" + std::to_string(bs) +
                      " --direct=1 --ioengine=psync --numjobs=" + std::to_string(cfg.threads) +
                      " --time_based --runtime=" + rt,
                  true);
  };
  auto fio_randread_qd = [&](uint64_t bs, uint32_t qd) {
    return RunFio("--name=randread_qd --filename=" + fio_file + " --size=" + fio_size +
                      " --rw=randread --bs=" + std::to_string(bs) +
                      " --direct=1 --ioengine=libaio --iodepth=" + std::to_string(qd) +
                      " --time_based --runtime=" + rt,
                  true);
  };
  double seq = RunFio("--name=seqwrite --filename=" + fio_file + " --size=" + fio_size +
                          " --rw=write --bs=1m --direct=1 --ioengine=libaio --iodepth=8",
                      false);
  std::printf("fio: seq write %.3f GB/s\n", seq / 1e9);
  Json variants = Json::object();
  double avg_page = 0, rr_before = 0, rr_after = 0, rr32_before = 0, rr32_after = 0;
  uint64_t bs = 4096;
  std::vector<Variant> to_run = {Variant::kDefault};
  if (!no_variants) {
    // The non-default write path, and BlobDB.
    to_run.push_back(defaults.ingest_pages ? Variant::kMemtable : Variant::kIngest);
    to_run.push_back(Variant::kBlob);
  }
  Json cold_sweep = Json::array(), warm_json;
  for (Variant variant : to_run) {
    const char* name = VariantName(variant);
    const bool headline = variant == Variant::kDefault;
    const std::string path = dir + "/store-" + name;
    Json v;
    ContextId id;
    {
      auto store = Store::Open(WarmOptions(variant), path);
      if (!store.ok()) return Fail(store.status());
      auto w = WriteContext(store->get(), cfg.tokens, 1);
      if (!w.ok()) return Fail(w.status());
      id = w->id;
      v["write_gbps"] = w->raw_bytes / 1e9 / w->seconds;
      v["write_seconds"] = w->seconds;
      v["raw_bytes"] = w->raw_bytes;
      v["stored_bytes"] = w->stored_bytes;
      v["peak_writer_buffer_bytes"] = w->peak_buffered;
      const double page = double(w->stored_bytes) / (double(w->n_blocks) * 32 * 8);
      v["avg_stored_page_bytes"] = page;
      const auto st = (*store)->GetStats();
      v["pages_cf_bytes"] = st.bytes_by_cf.count("pages") ? st.bytes_by_cf.at("pages") : 0;
      if (headline) {
        avg_page = page;
        bs = (static_cast<uint64_t>(avg_page) + 4095) / 4096 * 4096;
      }
      std::printf("%s: wrote %.2f GB raw (%.2f GB stored) in %.2f s: %.3f GB/s\n", name,
                  w->raw_bytes / 1e9, w->stored_bytes / 1e9, w->seconds,
                  v["write_gbps"].get<double>());
      auto warm = MeasureWarm(store->get(), id, cfg);
      if (!warm.ok()) return Fail(warm.status());
      v["read_warm"] = *warm;
      // The working set: every (layer, head) table of one step.
      const uint64_t per_table = std::max<uint32_t>(1, w->n_blocks / 20);
      v["read_warm"]["working_set_bytes"] =
          static_cast<uint64_t>(double(per_table) * 32 * 8 * page);
      v["read_warm"]["fetch_bytes"] = double(per_table) * page;
      std::printf("%s: warm reads %.3f GB/s stored, p50 %.0f us, p99 %.0f us, hit ratio %.4f\n",
                  name, (*warm)["stored_gbps"].get<double>(), (*warm)["p50_us"].get<double>(),
                  (*warm)["p99_us"].get<double>(), (*warm)["block_cache_hit_ratio"].get<double>());
      if (headline) warm_json = v["read_warm"];
    }
    if (headline) {
      rr_before = fio_randread_qd1(bs);
      rr32_before = fio_randread_qd(bs, 32);
    }
    {
      auto r = MeasureCold(variant, path, id, defaults.read_io_depth, PageReadMethod::kMultiGet,
                           cfg, 11);
      if (!r.ok()) return Fail(r.status());
      v["read_cold_multiget"] = ReadJson(*r);
      std::printf(
          "%s: cold reads (multiget, depth %u) %.3f GB/s stored, p50 %.0f us, p99 %.0f us\n", name,
          defaults.read_io_depth, r->stored_gbps, r->p50_us, r->p99_us);
    }
    if (headline) {
      rr32_after = fio_randread_qd(bs, 32);
      rr_after = fio_randread_qd1(bs);
      auto r = MeasureCold(variant, path, id, defaults.read_io_depth, PageReadMethod::kIterator,
                           cfg, 13);
      if (!r.ok()) return Fail(r.status());
      v["read_cold_iterator"] = ReadJson(*r);
      std::printf("%s: cold reads (iterator) %.3f GB/s stored\n", name, r->stored_gbps);
      for (uint32_t depth : cfg.depths) {
        auto c = MeasureCold(variant, path, id, depth, PageReadMethod::kMultiGet, cfg, 17 + depth);
        if (!c.ok()) return Fail(c.status());
        Json row = ReadJson(*c);
        row["read_io_depth"] = depth;
        row["reads_in_flight"] = depth * static_cast<uint32_t>(cfg.threads);
        cold_sweep.push_back(row);
        std::printf("cold sweep: depth %3u x %d threads: %.3f GB/s, p50 %.0f us, p99 %.0f us\n",
                    depth, cfg.threads, c->stored_gbps, c->p50_us, c->p99_us);
      }
    }
    {
      // Space reclamation.
      auto store = Store::Open(ColdOptions(variant, 1), path);
      if (!store.ok()) return Fail(store.status());
      uint64_t before = DirBytes(path);
      auto del = (*store)->Delete(id);
      if (!del.ok()) return Fail(del.status());
      uint64_t after = DirBytes(path);
      v["dir_bytes_before_delete"] = before;
      v["dir_bytes_after_delete"] = after;
      std::printf("%s: delete: data dir %.1f MB -> %.1f MB\n", name, before / 1e6, after / 1e6);
    }
    std::filesystem::remove_all(path, ec);
    variants[name] = v;
  }
  result["variants"] = variants;
  const double rr = (rr_before + rr_after) / 2;
  const double rr32 = (rr32_before + rr32_after) / 2;
  Json fio_by_qd = Json::object();
  for (uint32_t qd : fio_qds) {
    const double g = fio_randread_qd(bs, qd);
    fio_by_qd[std::to_string(qd)] = g / 1e9;
    std::printf("fio: rand read bs=%lu libaio QD%u: %.3f GB/s\n", static_cast<unsigned long>(bs),
                qd, g / 1e9);
  }
  std::filesystem::remove(fio_file, ec);
  std::printf(
      "fio: rand read bs=%lu around the default store's cold reads: psync QD1 x %d %.3f / %.3f "
      "GB/s, libaio QD32 %.3f / %.3f GB/s (before / after)\n",
      static_cast<unsigned long>(bs), cfg.threads, rr_before / 1e9, rr_after / 1e9,
      rr32_before / 1e9, rr32_after / 1e9);

  const Json& d = variants["default"];
  result["write_gbps"] = d["write_gbps"];
  result["read_warm_gbps"] = d["read_warm"]["stored_gbps"];
  result["read_warm_p50_us"] = d["read_warm"]["p50_us"];
  result["read_warm_p99_us"] = d["read_warm"]["p99_us"];
  // What the readers reach between preemptions: bytes of a median fetch /
  // its p50, times the reader threads (the aggregate above includes fetches
  // that lost the CPU on a shared machine).
  result["read_warm_gbps_at_p50"] = d["read_warm"]["p50_us"].get<double>() > 0
                                        ? warm_json["fetch_bytes"].get<double>() /
                                              (d["read_warm"]["p50_us"].get<double>() * 1e3) *
                                              cfg.threads
                                        : 0.0;
  result["block_cache_hit_ratio"] = warm_json["block_cache_hit_ratio"];
  result["warm_working_set_bytes"] = warm_json["working_set_bytes"];
  result["warm_block_cache_bytes"] = warm_json["block_cache_bytes"];
  result["warm_working_set_fits"] =
      warm_json["working_set_bytes"].get<double>() < warm_json["block_cache_bytes"].get<double>();
  result["read_cold_gbps"] = d["read_cold_multiget"]["stored_gbps"];
  result["read_cold_raw_gbps"] = d["read_cold_multiget"]["raw_gbps"];
  result["read_p50_us"] = d["read_cold_multiget"]["p50_us"];
  result["read_p99_us"] = d["read_cold_multiget"]["p99_us"];
  result["read_cold_gbps_multiget"] = d["read_cold_multiget"]["stored_gbps"];
  result["read_cold_gbps_iterator"] = d["read_cold_iterator"]["stored_gbps"];
  result["read_cold_by_depth"] = cold_sweep;
  result["cold_read_method"] =
      "store reopened with block cache off and use_direct_reads=true (O_DIRECT)";
  result["avg_stored_page_bytes"] = avg_page;
  result["fio_randread_bs"] = bs;
  result["fio_randread_gbps"] = rr / 1e9;
  result["fio_randread_before_gbps"] = rr_before / 1e9;
  result["fio_randread_after_gbps"] = rr_after / 1e9;
  result["fio_randread_qd32_gbps"] = rr32 / 1e9;
  result["fio_randread_qd32_before_gbps"] = rr32_before / 1e9;
  result["fio_randread_qd32_after_gbps"] = rr32_after / 1e9;
  result["fio_randread_by_qd"] = fio_by_qd;
  result["fio_seqwrite_gbps"] = seq / 1e9;
  const double cold = result["read_cold_gbps"].get<double>();
  result["read_vs_fio_qd1"] = rr > 0 ? cold / (rr / 1e9) : 0.0;
  result["read_vs_fio_qd32"] = rr32 > 0 ? cold / (rr32 / 1e9) : 0.0;
  result["read_vs_fio"] = result["read_vs_fio_qd32"];  // the bar (issue #16)
  result["write_vs_fio_seq"] = seq > 0 ? result["write_gbps"].get<double>() / (seq / 1e9) : 0.0;
  result["write_vs_fio"] = result["write_vs_fio_seq"];
  std::filesystem::remove_all(dir, ec);
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

}  // namespace

CTXCACHE_BENCH("storage",
               "RocksDB page store: write, warm/cold random page-table reads, codecs, fio baseline",
               RunStorageBench);

}  // namespace ctxcache::bench
