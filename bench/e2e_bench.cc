// ctxcache-bench e2e: decode steps through a real ctxcached on loopback.
//
// Workloads (one run):
//   1. start build/bin/ctxcached on a temp data dir with ephemeral ports;
//   2. build a context of N tokens (32K; 4K with --quick) from the model
//      (--model DIR, default models/ctxcache-ref, else the tiny test model);
//   3. for csa (rho 0.05, capped at 5% of the pages: the default), csa_tokens
//      (the same without the page cap) and full: S sessions (1 and 8) each run
//      --steps decode steps; a step = one Step per layer with server-side
//      selection and pages, then one Append (streaming update);
//   4. report per-step latency p50/p99, bytes on the wire per step, the
//      ratios csa vs full, and sessions/s at 8 sessions;
//   5. "prefetch": client-side selection (SelectMode::kClient) through the
//      reference worker (GenerateRemote: the real model decodes --steps
//      tokens after an 8-token prompt) for csa (speculative next-layer
//      prefetch) and streaming (automatic next-layer prefetch), prefetch
//      off vs on: step latency, bytes received by Steps, prefetch hit rate,
//      wasted prefetch bytes, and whether the tokens are identical.
// Queries/keys appended are seeded Gaussians (selection cost does not depend
// on their values; page volume does, through the budget).
// Usage: ctxcache-bench e2e [--quick] [--model DIR] [--tokens N] [--steps S]
//                           [--only all|sessions|prefetch]
#include <signal.h>
#include <stdlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench/bench_registry.h"
#include "bench/bench_server.h"
#include "client/worker/decode_worker.h"
#include "common/percentile.h"
#include "ctxcache/client.h"
#include "model/model.h"

namespace ctxcache::bench {
namespace {

struct RunResult {
  std::vector<double> step_us;
  double bytes_per_step = 0;
  double wall_s = 0;
  int sessions = 0;
  std::string error;
};

RunResult RunSessions(const std::string& address, const v1::ContextInfo& info,
                      const std::string& method, const std::map<std::string, std::string>& params,
                      int n_sessions, int steps) {
  RunResult r;
  r.sessions = n_sessions;
  const uint32_t L = info.model().n_layers(), nq = info.model().n_q_heads(),
                 nkv = info.model().n_kv_heads(), d = info.model().head_dim();
  std::vector<std::vector<double>> lat(n_sessions);
  std::vector<uint64_t> bytes(n_sessions, 0);
  std::vector<std::string> errors(n_sessions);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < n_sessions; ++s) {
    threads.emplace_back([&, s] {
      client::ClientOptions co;
      co.server = address;
      co.max_message_bytes = 64 << 20;
      auto client = std::move(client::Client::Connect(co)).value();
      client::SessionOptions so;
      so.context_id = info.context_id();
      so.method = method;
      so.params = params;
      auto session = client->OpenSession(so);
      if (!session.ok()) {
        errors[s] = session.status().ToString();
        return;
      }
      std::mt19937 rng(1234 + s);
      std::normal_distribution<float> g(0.f, 1.f);
      std::vector<float> q(size_t(nq) * d), k(size_t(L) * nkv * d), v(k.size()),
          qa(size_t(L) * nq * d);
      client::SelectedKV sel;
      for (int step = 0; step < steps; ++step) {
        auto ts = std::chrono::steady_clock::now();
        for (uint32_t layer = 0; layer < L; ++layer) {
          for (auto& x : q) x = g(rng);
          Status st = (*session)->Step(layer, q.data(), &sel);
          if (!st.ok()) {
            errors[s] = st.ToString();
            return;
          }
          bytes[s] += sel.bytes_received;
        }
        for (auto& x : k) x = g(rng);
        for (auto& x : v) x = g(rng);
        for (auto& x : qa) x = g(rng);
        Status st = (*session)->Append(k.data(), v.data(), qa.data());
        if (!st.ok()) {
          errors[s] = st.ToString();
          return;
        }
        lat[s].push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - ts)
                .count());
      }
      (*session)->Close().IgnoreError();
    });
  }
  for (auto& t : threads) t.join();
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t total = 0;
  for (int s = 0; s < n_sessions; ++s) {
    if (!errors[s].empty()) r.error = errors[s];
    r.step_us.insert(r.step_us.end(), lat[s].begin(), lat[s].end());
    total += bytes[s];
  }
  r.bytes_per_step = r.step_us.empty() ? 0 : static_cast<double>(total) / r.step_us.size();
  return r;
}

// Prefetch off vs on through the reference worker, client-side selection.
// Returns false (with *error) on a failed run.
bool RunPrefetch(const std::string& address, const std::filesystem::path& model_path,
                 const v1::ContextInfo& info, uint32_t vocab, int steps, nlohmann::json* out,
                 std::string* error) {
  auto model = model::Model::Load(model_path.string());
  if (!model.ok()) {
    *error = "load model: " + model.status().ToString();
    return false;
  }
  client::ClientOptions co;
  co.server = address;
  co.max_message_bytes = 64 << 20;
  auto client = std::move(client::Client::Connect(co)).value();
  std::mt19937 rng(99);
  std::vector<int32_t> prompt(8);
  for (auto& t : prompt) t = static_cast<int32_t>(3 + rng() % (vocab - 3));
  auto run = [&](const std::string& method, bool prefetch, int n_new,
                 client::GenerateResult* res) -> bool {
    client::GenerateOptions go;
    go.session.context_id = info.context_id();
    go.session.method = method;
    go.session.params = {{"rho", "0.05"}};
    go.session.mode = client::SelectMode::kClient;
    go.session.prefetch = prefetch;
    go.max_new_tokens = n_new;
    auto r = client::GenerateRemote(**model, client.get(), prompt, go);
    if (!r.ok()) {
      *error = method + (prefetch ? " prefetch on: " : " prefetch off: ") + r.status().ToString();
      return false;
    }
    *res = std::move(r).value();
    return true;
  };
  for (const std::string method : {"csa", "streaming"}) {
    client::GenerateResult warm, off, on;
    // Warm-up (server block cache, model pages), then off and on.
    if (!run(method, false, 4, &warm) || !run(method, false, steps, &off) ||
        !run(method, true, steps, &on)) {
      return false;
    }
    nlohmann::json m;
    for (const auto& [name, r] :
         {std::pair<std::string, const client::GenerateResult*>{"off", &off}, {"on", &on}}) {
      std::vector<double> ms;
      for (double x : r->step_seconds) ms.push_back(x * 1e3);
      double mean = 0;
      for (double x : ms) mean += x;
      mean = ms.empty() ? 0 : mean / static_cast<double>(ms.size());
      const client::PageCacheStats& st = r->page_cache;
      const double needed = static_cast<double>(st.hits + st.misses);
      nlohmann::json j;
      j["step_p50_ms"] = Percentile(ms, 0.5);
      j["step_p99_ms"] = Percentile(ms, 0.99);
      j["step_mean_ms"] = mean;
      j["token_steps"] = r->steps;
      // Bytes the Steps received (what stalls a step) and all page bytes on
      // the wire (Steps + prefetch).
      j["step_bytes_per_step"] = static_cast<double>(r->bytes_received) / r->steps;
      j["wire_bytes_per_step"] =
          static_cast<double>(r->bytes_received + st.prefetched_bytes) / r->steps;
      j["page_lookups"] = st.hits + st.misses;
      j["cache_hits"] = st.hits;
      j["cache_misses"] = st.misses;
      j["prefetch_requests"] = st.prefetch_requests;
      j["prefetched_pages"] = st.prefetched_pages;
      j["prefetch_hits"] = st.prefetch_hits;
      // Fraction of the pages Steps needed that a prefetch had brought.
      j["prefetch_hit_rate"] = needed > 0 ? st.prefetch_hits / needed : 0.0;
      // Fraction of the pages Steps would have fetched themselves that a
      // prefetch fetched instead.
      j["prefetch_coverage"] = st.prefetch_hits + st.misses > 0
                                   ? static_cast<double>(st.prefetch_hits) /
                                         static_cast<double>(st.prefetch_hits + st.misses)
                                   : 0.0;
      j["prefetched_bytes"] = st.prefetched_bytes;
      j["wasted_prefetch_bytes"] = st.prefetched_bytes - st.prefetch_hit_bytes;
      j["wasted_prefetch_fraction"] =
          st.prefetched_bytes > 0
              ? static_cast<double>(st.prefetched_bytes - st.prefetch_hit_bytes) /
                    static_cast<double>(st.prefetched_bytes)
              : 0.0;
      j["prefetch_failures"] = st.prefetch_failures;
      j["prefetch_wait_ms_per_step"] = st.prefetch_wait_seconds * 1e3 / r->steps;
      j["prediction_selector_bytes"] = st.prefetch_selector_bytes;
      m[name] = j;
    }
    m["tokens_identical"] = off.tokens == on.tokens;
    m["p50_speedup"] = m["off"]["step_p50_ms"].get<double>() /
                       std::max(1e-9, m["on"]["step_p50_ms"].get<double>());
    (*out)[method] = m;
  }
  return true;
}

int RunE2e(int argc, char** argv) {
  CLI::App app{"ctxcache-bench e2e"};
  bool quick = false;
  std::string model_dir;
  int64_t n_tokens = 0;
  int steps = 0;
  app.add_flag("--quick", quick, "4K tokens, fewer steps (< 60 s)");
  app.add_option("--model", model_dir, "HF model directory (default models/ctxcache-ref)");
  app.add_option("--tokens", n_tokens, "Context tokens (default 32768, 4096 with --quick)");
  app.add_option("--steps", steps, "Decode steps per session (default 32, 8 with --quick)");
  std::string only = "all";
  app.add_option("--only", only, "Workloads: all (default), sessions or prefetch")
      ->check(CLI::IsMember({"all", "sessions", "prefetch"}));
  CLI11_PARSE(app, argc, argv);
  if (n_tokens == 0) n_tokens = quick ? 4096 : 32768;
  if (steps == 0) steps = quick ? 8 : 32;
  if (model_dir.empty()) {
    model_dir = std::filesystem::exists("models/ctxcache-ref/config.json")
                    ? "models/ctxcache-ref"
                    : "tests/data/golden/llama3";
  }
  std::filesystem::path mp = std::filesystem::absolute(model_dir);
  if (!std::filesystem::exists(mp / "config.json")) {
    std::cerr << "ctxcache-bench e2e: no config.json in " << mp << "; pass --model DIR\n";
    return 2;
  }
  std::string tmpl = (std::filesystem::temp_directory_path() / "ctxcache-e2e-XXXXXX").string();
  std::string dir = mkdtemp(tmpl.data());
  testing::ServerProcess server(SelfDir());
  StopOnExit stop_on_exit{&server};
  if (!StartBenchServer(dir, mp.parent_path().string(), mp.filename().string(), &server)) {
    std::cerr << "ctxcache-bench e2e: ctxcached did not start; see " << server.log_path() << "\n";
    return 1;
  }
  client::ClientOptions co;
  co.server = server.address();
  auto client = std::move(client::Client::Connect(co)).value();
  v1::BuildContextRequest req;
  std::mt19937 rng(7);
  // Vocabulary from the model config.
  std::ifstream cf(mp / "config.json");
  nlohmann::json cfg = nlohmann::json::parse(cf);
  const uint32_t vocab = cfg.value("vocab_size", 512);
  for (int64_t i = 0; i < n_tokens; ++i) req.mutable_tokens()->add_ids(3 + rng() % (vocab - 3));
  req.add_indexes()->set_method("csa");
  auto tb = std::chrono::steady_clock::now();
  auto built = client->Build(req, nullptr);
  if (!built.ok()) {
    std::cerr << "ctxcache-bench e2e: build failed: " << built.status().ToString() << "\n";
    return 1;
  }
  double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tb).count();
  const v1::ContextInfo info = built->context();
  nlohmann::json out;
  out["bench"] = "e2e";
  out["quick"] = quick;
  out["model"] = mp.filename().string();
  out["n_tokens"] = n_tokens;
  out["steps_per_session"] = steps;
  out["build_s"] = build_s;
  out["layers"] = info.model().n_layers();
  if (only != "sessions") {
    nlohmann::json pf;
    std::string error;
    auto t0 = std::chrono::steady_clock::now();
    if (!RunPrefetch(server.address(), mp, info, vocab, steps, &pf, &error)) {
      std::cerr << "ctxcache-bench e2e: prefetch: " << error << "\n";
      return 1;
    }
    pf["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out["prefetch"] = pf;
  }
  if (only == "prefetch") {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    std::cout << out.dump() << std::endl;
    return 0;
  }
  std::map<std::string, RunResult> one, eight;
  // csa: 5% of the tokens per q head, at most 5% of the pages (the session
  // default); csa_tokens: the same selection without the page cap.
  const std::map<std::string, std::pair<std::string, std::map<std::string, std::string>>> runs = {
      {"csa", {"csa", {{"rho", "0.05"}}}},
      {"csa_tokens", {"csa", {{"rho", "0.05"}, {"page_fraction", "1"}}}},
      {"full", {"full", {}}}};
  for (const auto& [method, run] : runs) {
    one[method] = RunSessions(server.address(), info, run.first, run.second, 1, steps);
    eight[method] = RunSessions(server.address(), info, run.first, run.second, 8, steps);
    for (auto* r : {&one[method], &eight[method]}) {
      if (!r->error.empty()) {
        std::cerr << "ctxcache-bench e2e: " << method << ": " << r->error << "\n";
        return 1;
      }
    }
    nlohmann::json m;
    m["step_p50_us_1"] = Percentile(one[method].step_us, 0.5);
    m["step_p99_us_1"] = Percentile(one[method].step_us, 0.99);
    m["step_p50_us_8"] = Percentile(eight[method].step_us, 0.5);
    m["step_p99_us_8"] = Percentile(eight[method].step_us, 0.99);
    m["bytes_per_step"] = one[method].bytes_per_step;
    m["sessions_per_s_8"] = 8.0 / eight[method].wall_s;
    m["steps_per_s_8"] = eight[method].step_us.size() / eight[method].wall_s;
    out[method] = m;
  }
  out["step_p50_us"] = out["csa"]["step_p50_us_1"];
  out["step_p99_us"] = out["csa"]["step_p99_us_1"];
  out["bytes_per_step"] = out["csa"]["bytes_per_step"];
  out["speedup_vs_full"] = out["full"]["step_p50_us_1"].get<double>() /
                           std::max(1.0, out["csa"]["step_p50_us_1"].get<double>());
  out["bytes_ratio_vs_full"] = out["full"]["bytes_per_step"].get<double>() /
                               std::max(1.0, out["csa"]["bytes_per_step"].get<double>());
  out["p99_over_p50_at_8"] = out["csa"]["step_p99_us_8"].get<double>() /
                             std::max(1.0, out["csa"]["step_p50_us_8"].get<double>());
  out["sessions_per_s"] = out["csa"]["sessions_per_s_8"];
  if (out.contains("csa_paged")) {  // only when a csa_paged run is configured
    out["paged_speedup_vs_full"] = out["full"]["step_p50_us_1"].get<double>() /
                                   std::max(1.0, out["csa_paged"]["step_p50_us_1"].get<double>());
    out["paged_bytes_ratio_vs_full"] =
        out["full"]["bytes_per_step"].get<double>() /
        std::max(1.0, out["csa_paged"]["bytes_per_step"].get<double>());
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::cout << out.dump() << std::endl;
  return 0;
}

CTXCACHE_BENCH("e2e", "decode steps through ctxcached on loopback (csa vs full)", RunE2e);

}  // namespace
}  // namespace ctxcache::bench
