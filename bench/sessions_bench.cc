// ctxcache-bench sessions: what decode sessions cost a real ctxcached
// (issue #19, findings 1 and 2), measured from /proc/<pid>/status.
//
//   1. start build/bin/ctxcached (default configuration, plus
//      --metrics-listen "" and ephemeral ports) hosting --model (default
//      models/ctxcache-ref);
//   2. build a context from --file (default tests/data/demo/document.txt,
//      the README demo's 9.5K-token document) with the csa index;
//   3. open --sessions csa sessions (default 256, the default
//      --max-sessions) on it over several connections, each Open followed
//      by one Step per layer; server RSS after 1, 2, 4, ... sessions;
//   4. --append tokens (default 64) to --append-sessions of them (default
//      16): RSS per appended token per session;
//   5. --idle-streams Decode streams (default 1000) over enough connections
//      that never send Open: server threads and RSS before, at the peak and
//      after the server closed them (--session-open-timeout-s, default 10).
// Prints one JSON object (last line of stdout).
// Usage: ctxcache-bench sessions [--model DIR] [--file F] [--sessions N]
//        [--append T] [--append-sessions S] [--idle-streams M]
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_registry.h"
#include "bench/bench_server.h"
#include "common/percentile.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::bench {
namespace {

long ProcStatusKb(pid_t pid, const std::string& field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return -1;
}

using Stream = grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>;

void SetTensor(v1::Tensor* t, std::vector<uint32_t> shape, const std::vector<float>& x) {
  t->set_dtype(v1::DTYPE_F32);
  for (uint32_t d : shape) t->add_shape(d);
  t->set_data(std::string(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float)));
}

// One channel per `per_channel` streams (the server allows 128 streams per
// connection by default).
std::vector<std::unique_ptr<v1::DecodeService::Stub>> Stubs(const std::string& address, int n) {
  std::vector<std::unique_ptr<v1::DecodeService::Stub>> stubs;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // its own connection
    args.SetMaxReceiveMessageSize(64 << 20);
    stubs.push_back(v1::DecodeService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  return stubs;
}

struct Session {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<Stream> stream;
};

int RunSessions(int argc, char** argv) {
  CLI::App app{"ctxcache-bench sessions"};
  std::string model_dir = "models/ctxcache-ref", file = "tests/data/demo/document.txt";
  int n_sessions = 256, append_tokens = 64, append_sessions = 16, idle_streams = 1000;
  app.add_option("--model", model_dir, "HF model directory");
  app.add_option("--file", file, "Document to build the context from");
  app.add_option("--sessions", n_sessions, "csa sessions to open on the context");
  app.add_option("--append", append_tokens, "Tokens each appending session appends");
  app.add_option("--append-sessions", append_sessions, "Sessions that append");
  app.add_option("--idle-streams", idle_streams, "Decode streams that never Open (0 = skip)");
  CLI11_PARSE(app, argc, argv);
  std::filesystem::path mp = std::filesystem::absolute(model_dir);
  if (!std::filesystem::exists(mp / "config.json")) {
    std::cerr << "ctxcache-bench sessions: no config.json in " << mp << "\n";
    return 2;
  }
  std::ifstream doc(file);
  if (!doc) {
    std::cerr << "ctxcache-bench sessions: cannot read " << file << "\n";
    return 2;
  }
  std::stringstream text;
  text << doc.rdbuf();
  std::string tmpl = (std::filesystem::temp_directory_path() / "ctxcache-sessions-XXXXXX").string();
  std::string dir = mkdtemp(tmpl.data());
  testing::ServerProcess server(SelfDir());
  StopOnExit stop_on_exit{&server};
  if (!server.Start(dir + "/data",
                    {"--metrics-listen", "", "--model-dir", mp.parent_path().string(),
                     "--default-model", mp.filename().string(), "--log-level", "warn"})) {
    std::cerr << "ctxcache-bench sessions: ctxcached did not start; see " << server.log_path()
              << "\n";
    return 1;
  }
  const pid_t pid = server.pid();
  auto admin = v1::ContextAdmin::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  v1::BuildContextRequest req;
  req.set_text(text.str());
  req.add_indexes()->set_method("csa");
  v1::BuildProgress last;
  {
    grpc::ClientContext ctx;
    auto r = admin->BuildContext(&ctx, req);
    while (r->Read(&last)) {
    }
    grpc::Status s = r->Finish();
    if (!s.ok()) {
      std::cerr << "ctxcache-bench sessions: build failed: " << s.error_message() << "\n";
      return 1;
    }
  }
  const v1::ContextInfo info = last.context();
  const uint32_t L = info.model().n_layers(), nq = info.model().n_q_heads(),
                 nkv = info.model().n_kv_heads(), d = info.model().head_dim();
  nlohmann::json out;
  out["bench"] = "sessions";
  out["model"] = mp.filename().string();
  out["n_tokens"] = info.n_tokens();
  out["shape"] = {{"layers", L}, {"q_heads", nq}, {"kv_heads", nkv}, {"head_dim", d}};

  // --- csa sessions on one context ---
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long rss0 = ProcStatusKb(pid, "VmRSS");
  auto stubs = Stubs(server.address(), (n_sessions + 99) / 100);
  std::vector<Session> sessions;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.f, 1.f);
  nlohmann::json curve = nlohmann::json::array();
  std::string error;
  auto step_all = [&](Stream* st) {
    for (uint32_t l = 0; l < L && error.empty(); ++l) {
      v1::DecodeRequest step;
      step.mutable_step()->set_layer(l);
      std::vector<float> q(size_t(nq) * d);
      for (float& x : q) x = g(rng);
      SetTensor(step.mutable_step()->mutable_queries(), {nq, d}, q);
      v1::DecodeResponse resp;
      if (!st->Write(step) || !st->Read(&resp) || !resp.has_step()) {
        error = "step: " + resp.error().message();
      }
    }
  };
  long rss1 = 0;
  // Open round trips: the first loads the context's csa index, later ones
  // share it (the baseline for the load's cost).
  std::vector<double> open_s;
  for (int i = 0; i < n_sessions && error.empty(); ++i) {
    Session s;
    s.ctx = std::make_unique<grpc::ClientContext>();
    s.stream = stubs[static_cast<size_t>(i) / 100]->Decode(s.ctx.get());
    v1::DecodeRequest open;
    open.mutable_open()->set_context_id(info.context_id());
    open.mutable_open()->set_method("csa");
    v1::DecodeResponse resp;
    const auto t_open = std::chrono::steady_clock::now();
    if (!s.stream->Write(open) || !s.stream->Read(&resp) || !resp.has_opened()) {
      error = "open " + std::to_string(i + 1) + ": " + resp.error().message();
      break;
    }
    open_s.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_open).count());
    step_all(s.stream.get());
    sessions.push_back(std::move(s));
    const int n = i + 1;
    if ((n & (n - 1)) == 0 || n == n_sessions) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const long rss = ProcStatusKb(pid, "VmRSS");
      if (n == 1) rss1 = rss;
      curve.push_back({{"sessions", n}, {"rss_mib", rss / 1024.0}});
    }
  }
  if (!error.empty()) {
    std::cerr << "ctxcache-bench sessions: " << error << "\n";
    return 1;
  }
  const long rssN = ProcStatusKb(pid, "VmRSS");
  out["csa_sessions"] = {
      {"sessions", n_sessions},
      {"rss_before_mib", rss0 / 1024.0},
      {"rss_first_session_mib", rss1 / 1024.0},
      {"first_session_mib", (rss1 - rss0) / 1024.0},
      {"rss_all_mib", rssN / 1024.0},
      {"per_session_after_first_kib",
       n_sessions > 1 ? static_cast<double>(rssN - rss1) / (n_sessions - 1) : 0.0},
      {"first_open_s", open_s.front()},
      {"later_open_s_p50", Percentile(std::vector<double>(open_s.begin() + 1, open_s.end()), 0.5)},
      {"curve", curve}};

  // --- appended tokens ---
  const int appenders = std::min<int>(append_sessions, static_cast<int>(sessions.size()));
  std::vector<float> k(size_t(L) * nkv * d), v(k.size());
  for (int t = 0; t < append_tokens && error.empty(); ++t) {
    for (int i = 0; i < appenders && error.empty(); ++i) {
      for (float& x : k) x = g(rng);
      for (float& x : v) x = g(rng);
      v1::DecodeRequest a;
      SetTensor(a.mutable_append()->mutable_k(), {L, nkv, d}, k);
      SetTensor(a.mutable_append()->mutable_v(), {L, nkv, d}, v);
      v1::DecodeResponse resp;
      if (!sessions[i].stream->Write(a) || !sessions[i].stream->Read(&resp) ||
          !resp.has_appended()) {
        error = "append: " + resp.error().message();
      }
    }
  }
  for (int i = 0; i < appenders && error.empty(); ++i) step_all(sessions[i].stream.get());
  if (!error.empty()) {
    std::cerr << "ctxcache-bench sessions: " << error << "\n";
    return 1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const long rssA = ProcStatusKb(pid, "VmRSS");
  const double raw_kv_kib = 2.0 * L * nkv * d * sizeof(float) / 1024.0;
  out["appended"] = {
      {"sessions", appenders},
      {"tokens_each", append_tokens},
      {"rss_mib", rssA / 1024.0},
      {"per_token_per_session_kib",
       appenders * append_tokens > 0
           ? static_cast<double>(rssA - rssN) / (appenders * append_tokens)
           : 0.0},
      {"kv_per_token_kib", raw_kv_kib}};
  for (Session& s : sessions) {
    v1::DecodeRequest close;
    close.mutable_close();
    v1::DecodeResponse resp;
    s.stream->Write(close);
    s.stream->Read(&resp);
    s.stream->WritesDone();
    s.stream->Finish();
  }
  sessions.clear();
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  out["rss_after_close_mib"] = ProcStatusKb(pid, "VmRSS") / 1024.0;

  // --- idle Decode streams ---
  if (idle_streams > 0) {
    const long threads0 = ProcStatusKb(pid, "Threads"), rss_i0 = ProcStatusKb(pid, "VmRSS");
    auto idle_stubs = Stubs(server.address(), (idle_streams + 99) / 100);
    std::vector<Session> idle;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < idle_streams; ++i) {
      Session s;
      s.ctx = std::make_unique<grpc::ClientContext>();
      s.stream = idle_stubs[static_cast<size_t>(i) / 100]->Decode(s.ctx.get());
      idle.push_back(std::move(s));
    }
    long peak_threads = threads0, peak_rss = rss_i0;
    for (int i = 0; i < 20; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      peak_threads = std::max(peak_threads, ProcStatusKb(pid, "Threads"));
      peak_rss = std::max(peak_rss, ProcStatusKb(pid, "VmRSS"));
    }
    int closed_by_server = 0;
    for (Session& s : idle) {
      v1::DecodeResponse resp;
      if (!s.stream->Read(&resp)) ++closed_by_server;  // blocks until the server closes it
      s.stream->Finish();
    }
    const double closed_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    out["idle_streams"] = {{"streams", idle_streams},
                           {"threads_before", threads0},
                           {"threads_peak", peak_threads},
                           {"threads_after", ProcStatusKb(pid, "Threads")},
                           {"rss_before_mib", rss_i0 / 1024.0},
                           {"rss_peak_mib", peak_rss / 1024.0},
                           {"rss_after_mib", ProcStatusKb(pid, "VmRSS") / 1024.0},
                           {"closed_by_server", closed_by_server},
                           {"all_closed_after_s", closed_s}};
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

CTXCACHE_BENCH("sessions",
               "RSS of csa sessions on one context, per appended token, and of idle Decode "
               "streams, on a real ctxcached (JSON)",
               RunSessions);

}  // namespace ctxcache::bench
