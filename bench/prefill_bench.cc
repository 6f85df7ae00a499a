// ctxcache-bench prefill: the C++ prefill engine's throughput and memory, and
// the cost of building the CSA and Tactic indexes from its output (issue 7).
//
// For each context length (1K/4K/16K; 1K/4K with --quick):
//   1. prefill only (no sinks), peak RSS reset before the run:
//      prefill_s, prefill_tokens_per_s, peak_rss_mb (VmHWM), kv_mb;
//   2. prefill with a capture sink keeping every layer's post-RoPE K and Q,
//      then BuildSelector("csa") and ("tactic") for every (layer, kv head),
//      one head at a time:
//      index_build_s per method and index_build_overhead_pct =
//      (csa + tactic build wall time) / prefill_s * 100 (null if a method is
//      not registered in index/); index_serialize_s per method (the
//      artifacts the server stores) and index_build_and_serialize_overhead_pct;
//      index_to_kv_ratio per method: serialized artifact bytes (default
//      format) / bf16 K+V bytes.
// Token ids: --text FILE (tokenized with the model's tokenizer.model and
// repeated to length) or deterministic pseudo-random ids.
// --synthetic builds a random-weight model shaped like the reference model
// (8 layers, hidden 512, 8/2 heads, d 64, ffn 1536, vocab 8192) in a temp dir
// when no trained model is at hand; speed does not depend on weight values.
//
// Usage: ctxcache-bench prefill (--model DIR | --synthetic) [--quick]
//        [--lengths 1024,4096] [--text FILE] [--chunk 512] [--kv-dtype bf16]
//        [--no-index]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_registry.h"
#include "common/dtype.h"
#include "common/thread_pool.h"
#include "index/selector.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/prefill.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

namespace ctxcache::bench {
namespace {

using Json = nlohmann::json;
using model::KvCache;
using model::Model;
using model::ModelSpec;

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// VmHWM / VmRSS from /proc/self/status, in MB.
double ProcStatusMb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t klen = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, klen, key) == 0) return std::stod(line.substr(klen + 1)) / 1024.0;
  }
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0).
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// Writes a random-weight Llama model shaped like the reference model.
Status MakeSyntheticModel(const std::string& dir) {
  const int L = 8, H = 512, NQ = 8, NKV = 2, D = 64, I = 1536, V = 8192;
  Json cfg = {{"architectures", {"LlamaForCausalLM"}},
              {"hidden_size", H},
              {"intermediate_size", I},
              {"num_hidden_layers", L},
              {"num_attention_heads", NQ},
              {"num_key_value_heads", NKV},
              {"head_dim", D},
              {"vocab_size", V},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 100000.0},
              {"max_position_embeddings", 16384},
              {"tie_word_embeddings", true},
              {"hidden_act", "silu"}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  std::mt19937 rng(7);
  std::vector<model::TensorToWrite> ts;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::normal_distribution<float> nd(0.0f, scale);
    std::vector<uint16_t> b(n);
    for (auto& x : b) x = FloatToBf16(scale == 0 ? 1.0f : nd(rng));
    ts.push_back({name, model::TensorDType::kBF16, shape,
                  std::string(reinterpret_cast<const char*>(b.data()), n * 2)});
  };
  add("model.embed_tokens.weight", {V, H}, 1.0f);
  add("model.norm.weight", {H}, 0.0f);
  for (int l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0.0f);
    add(p + "post_attention_layernorm.weight", {H}, 0.0f);
    add(p + "self_attn.q_proj.weight", {NQ * D, H}, 1.0f / std::sqrt(float(H)));
    add(p + "self_attn.k_proj.weight", {NKV * D, H}, 1.0f / std::sqrt(float(H)));
    add(p + "self_attn.v_proj.weight", {NKV * D, H}, 1.0f / std::sqrt(float(H)));
    add(p + "self_attn.o_proj.weight", {H, NQ * D}, 1.0f / std::sqrt(float(NQ * D)));
    add(p + "mlp.gate_proj.weight", {I, H}, 1.0f / std::sqrt(float(H)));
    add(p + "mlp.up_proj.weight", {I, H}, 1.0f / std::sqrt(float(H)));
    add(p + "mlp.down_proj.weight", {H, I}, 1.0f / std::sqrt(float(I)));
  }
  return model::WriteSafetensors(dir + "/model.safetensors", ts);
}

// Keeps every layer's K (per kv head) and Q (per q head), fp32.
class CaptureSink final : public model::PrefillSink {
 public:
  Status OnBegin(const ModelSpec& s, int64_t pos0, int64_t n) override {
    (void)pos0;
    s_ = s;
    n_ = n;
    k_.assign(s.n_layers, std::vector<float>(static_cast<size_t>(s.n_kv_heads) * n * s.head_dim));
    q_.assign(s.n_layers, std::vector<float>(static_cast<size_t>(s.n_q_heads) * n * s.head_dim));
    return Status::OK();
  }
  Status OnChunk(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                 const float*) override {
    const int d = s_.head_dim;
    for (int h = 0; h < s_.n_kv_heads; ++h) {
      std::copy_n(k + int64_t{h} * n * d, n * d, k_[layer].data() + (h * n_ + pos0) * d);
    }
    for (int h = 0; h < s_.n_q_heads; ++h) {
      std::copy_n(q + int64_t{h} * n * d, n * d, q_[layer].data() + (h * n_ + pos0) * d);
    }
    return Status::OK();
  }
  index::HeadPrefill Head(int layer, int kv_head) const {
    const int G = s_.group_size(), d = s_.head_dim;
    index::HeadPrefill hp;
    hp.n_tokens = n_;
    hp.head_dim = d;
    hp.group_size = G;
    hp.keys = k_[layer].data() + static_cast<size_t>(kv_head) * n_ * d;
    hp.n_queries = n_;
    hp.queries = q_[layer].data() + static_cast<size_t>(kv_head) * G * n_ * d;
    return hp;
  }

 private:
  ModelSpec s_;
  int64_t n_ = 0;
  std::vector<std::vector<float>> k_, q_;
};

std::vector<int32_t> MakeTokens(const std::vector<int32_t>& text_ids, int64_t n, int vocab) {
  std::vector<int32_t> ids(n);
  if (!text_ids.empty()) {
    for (int64_t i = 0; i < n; ++i) ids[i] = text_ids[i % text_ids.size()];
    return ids;
  }
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> u(3, vocab - 1);
  for (auto& x : ids) x = u(rng);
  return ids;
}

int RunPrefill(int argc, char** argv) {
  CLI::App app{"prefill: C++ prefill engine throughput, memory, index build overhead"};
  std::string model_dir, text_file, lengths_arg, kv_dtype_name = "bf16";
  bool quick = false, synthetic = false, no_index = false;
  int chunk = 512;
  app.add_option("--model", model_dir, "HF model directory (config.json + safetensors)");
  app.add_flag("--synthetic", synthetic, "random-weight model shaped like the reference model");
  app.add_flag("--quick", quick, "1K and 4K tokens only (< 60 s)");
  app.add_option("--lengths", lengths_arg, "comma-separated context lengths (overrides defaults)");
  app.add_option("--text", text_file, "text to tokenize (repeated to length); default random ids");
  app.add_option("--chunk", chunk, "prefill chunk size");
  app.add_option("--kv-dtype", kv_dtype_name, "KV cache dtype: bf16|f16|f32");
  app.add_flag("--no-index", no_index, "skip the index build measurement");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "prefill: %s\n", msg.c_str());
    std::printf("%s\n", Json{{"bench", "prefill"}, {"error", msg}}.dump().c_str());
    return 1;
  };
  std::string tmp_dir;
  if (synthetic) {
    tmp_dir = (std::filesystem::temp_directory_path() / "ctxcache-prefill-bench-model").string();
    std::filesystem::create_directories(tmp_dir);
    Status st = MakeSyntheticModel(tmp_dir);
    if (!st.ok()) return fail(st.ToString());
    model_dir = tmp_dir;
  }
  if (model_dir.empty()) return fail("--model DIR or --synthetic is required");
  auto kv_dtype = ParseDType(kv_dtype_name);
  if (!kv_dtype.ok()) return fail(kv_dtype.status().ToString());
  std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{1024, 4096, 16384};
  if (!lengths_arg.empty()) {
    lengths.clear();
    std::stringstream ss(lengths_arg);
    std::string tok;
    while (std::getline(ss, tok, ',')) lengths.push_back(std::stoll(tok));
  }
  const double t_load0 = NowS();
  auto m = Model::Load(model_dir);
  if (!m.ok()) return fail(m.status().ToString());
  const double load_s = NowS() - t_load0;
  const ModelSpec& s = (*m)->spec();
  std::vector<int32_t> text_ids;
  if (!text_file.empty()) {
    auto tok = model::Tokenizer::Load(model_dir + "/tokenizer.model");
    if (!tok.ok()) return fail(tok.status().ToString());
    std::ifstream in(text_file);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    Status st = (*tok)->Encode(text, &text_ids);
    if (!st.ok()) return fail(st.ToString());
  }
  const auto methods = index::SelectorMethods();
  auto has = [&](const std::string& m) {
    return std::find(methods.begin(), methods.end(), m) != methods.end();
  };
  ThreadPool* pool = ThreadPool::Default();
  Json results = Json::array();
  for (int64_t n : lengths) {
    const auto ids = MakeTokens(text_ids, n, s.vocab);
    model::PrefillOptions po;
    po.chunk_size = chunk;
    model::PrefillResult pr;
    Json row = {{"tokens", n}};
    {
      KvCache cache(s, *kv_dtype);
      ResetPeakRss();
      Status st = model::Prefill(**m, ids, &cache, {}, po, &pr);
      if (!st.ok()) return fail(st.ToString());
      row["prefill_s"] = pr.seconds;
      row["prefill_tokens_per_s"] = n / pr.seconds;
      row["peak_rss_mb"] = ProcStatusMb("VmHWM:");
      row["kv_mb"] = cache.MemoryBytes() / 1048576.0;
    }
    std::fprintf(stderr, "prefill: %lld tokens in %.2f s (%.0f tok/s), peak RSS %.0f MB\n",
                 static_cast<long long>(n), pr.seconds, n / pr.seconds,
                 row["peak_rss_mb"].get<double>());
    if (!no_index) {
      CaptureSink cap;
      KvCache cache(s, *kv_dtype);
      model::PrefillResult pr2;
      Status st = model::Prefill(**m, ids, &cache, {&cap}, po, &pr2);
      if (!st.ok()) return fail(st.ToString());
      Json build = Json::object();
      Json serialize = Json::object();
      Json artifact_ratio = Json::object();
      double total = 0, total_with_serialize = 0;
      bool all = true;
      for (const std::string method : {"csa", "tactic"}) {
        if (!has(method)) {
          build[method] = nullptr;
          all = false;
          continue;
        }
        const size_t jobs = static_cast<size_t>(s.n_layers) * s.n_kv_heads;
        std::vector<Status> errs(jobs);
        double dt = 0, ser = 0;
        uint64_t artifact_bytes = 0;
        // One (layer, head) at a time: the builders parallelise internally
        // where they can, and run on the same 2 cores as the prefill. The
        // builds and, apart, the serialization of their artifacts (what the
        // server stores) are timed.
        for (size_t j = 0; j < jobs; ++j) {
          const double t0 = NowS();
          auto sel = index::BuildSelector(
              method,
              cap.Head(static_cast<int>(j / s.n_kv_heads), static_cast<int>(j % s.n_kv_heads)), {});
          dt += NowS() - t0;
          errs[j] = sel.ok() ? Status::OK() : sel.status();
          std::string bytes;
          const double t1 = NowS();
          if (sel.ok()) errs[j] = (*sel)->Serialize(&bytes);
          ser += NowS() - t1;
          artifact_bytes += bytes.size();
        }
        serialize[method] = ser;
        total_with_serialize += dt + ser;
        // K + V in bf16 for every (layer, kv head).
        const double kv_bytes = static_cast<double>(jobs) * n * s.head_dim * 2 * 2;
        artifact_ratio[method] = static_cast<double>(artifact_bytes) / kv_bytes;
        for (const auto& e : errs) {
          if (!e.ok()) return fail(method + " build: " + e.ToString());
        }
        build[method] = dt;
        total += dt;
        std::fprintf(stderr,
                     "prefill: %s build over %zu heads: %.2f s (%.1f%% of prefill), "
                     "serialize %.2f s\n",
                     method.c_str(), jobs, dt, 100 * dt / pr.seconds, ser);
      }
      row["index_build_s"] = build;
      row["index_serialize_s"] = serialize;
      row["index_build_and_serialize_overhead_pct"] =
          all ? Json(100.0 * total_with_serialize / pr.seconds) : Json(nullptr);
      // Serialized index bytes (default format: csa compact) / bf16 K+V bytes.
      row["index_to_kv_ratio"] = artifact_ratio;
      row["index_build_overhead_pct"] = all ? Json(100.0 * total / pr.seconds) : Json(nullptr);
    }
    results.push_back(row);
  }
  Json out = {{"bench", "prefill"},
              {"model", synthetic ? std::string("synthetic-ref-shape") : model_dir},
              {"architecture", s.architecture},
              {"n_layers", s.n_layers},
              {"n_q_heads", s.n_q_heads},
              {"n_kv_heads", s.n_kv_heads},
              {"head_dim", s.head_dim},
              {"hidden", s.hidden},
              {"weight_mb", (*m)->WeightBytes() / 1048576.0},
              {"load_s", load_s},
              {"threads", pool->size()},
              {"chunk", chunk},
              {"kv_dtype", kv_dtype_name},
              {"tokens_from", text_file.empty() ? std::string("random ids") : text_file},
              {"results", results}};
  if (!tmp_dir.empty()) std::filesystem::remove_all(tmp_dir);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

CTXCACHE_BENCH("prefill",
               "C++ prefill engine: tokens/s, peak RSS, CSA+Tactic build overhead (JSON)",
               RunPrefill);

}  // namespace ctxcache::bench
