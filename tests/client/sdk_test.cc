// SDK behaviour against a real ctxcached: the client-side page cache and its
// byte budget, next-layer prefetch, and retries across a server restart.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <random>
#include <set>
#include <thread>

#include "client/sdk/retry.h"
#include "client/worker/decode_worker.h"
#include "ctxcache/client.h"
#include "model/model.h"
#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ServerProcess;
using testing::TempDir;

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::string> ModelArgs() {
  // The golden llama3 declares 256 positions; these tests use longer contexts.
  return {"--model-dir", testing::SourceDir() + "/tests/data/golden", "--default-model", "llama3",
          "--max-context-tokens", "65536"};
}

StatusOr<v1::BuildProgress> BuildRandom(client::Client* c, int n, uint32_t seed) {
  v1::BuildContextRequest req;
  std::mt19937 rng(seed);
  for (int i = 0; i < n; ++i) req.mutable_tokens()->add_ids(rng() % 512);
  return c->Build(req, nullptr);
}

TEST(SdkTest, PageCacheHitsOnRepeatedStepsAndKeepsItsBudget) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data", ModelArgs())) << server.log();
  client::ClientOptions co;
  co.server = server.address();
  auto client = std::move(client::Client::Connect(co)).value();
  auto built = BuildRandom(client.get(), 800, 1);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  const std::string id = built->context().context_id();
  std::vector<float> q(4 * 32);
  std::mt19937 rng(2);
  std::normal_distribution<float> g;
  for (auto& x : q) x = g(rng);
  {
    client::SessionOptions so{.context_id = id,
                              .method = "csa",
                              .params = {{"budget", "64"}},
                              .mode = client::SelectMode::kClient};
    auto session = client->OpenSession(so);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    client::SelectedKV first, second;
    ASSERT_TRUE((*session)->Step(0, q.data(), &first).ok());
    EXPECT_GT(first.bytes_received, 0u);
    EXPECT_EQ(first.cache_hits, 0u);
    ASSERT_TRUE((*session)->Step(0, q.data(), &second).ok());
    EXPECT_EQ(second.bytes_received, 0u) << "repeated step must be served from the cache";
    EXPECT_EQ(second.cache_hits, first.pages);
    EXPECT_EQ(second.heads[0].ids, first.heads[0].ids);
    EXPECT_EQ(second.heads[0].k, first.heads[0].k);
    EXPECT_GT((*session)->page_cache_stats().hits, 0u);
  }
  {
    // A budget of ~3 decoded pages (16 tokens x 32 dims x 2 x 4 bytes each).
    const size_t budget = 3 * (16 * 32 * 2 * 4 + 64);
    client::SessionOptions so{.context_id = id,
                              .method = "csa",
                              .params = {{"budget", "64"}},
                              .mode = client::SelectMode::kClient,
                              .page_cache_bytes = budget};
    auto session = client->OpenSession(so);
    ASSERT_TRUE(session.ok());
    client::SelectedKV out;
    for (uint32_t layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE((*session)->Step(layer, q.data(), &out).ok());
      EXPECT_LE((*session)->page_cache_stats().bytes, budget);
    }
    EXPECT_GT((*session)->page_cache_stats().evictions, 0u);
  }
}

// One server with one random 800-token context (50 pages) of the golden
// llama3 model (2 layers, 4 q / 2 kv heads, d = 32), shared by the prefetch
// tests.
class PrefetchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    server_ = new ServerProcess();
    ASSERT_TRUE(server_->Start(tmp_->path() + "/data", ModelArgs())) << server_->log();
    client::ClientOptions co;
    co.server = server_->address();
    client_ = std::move(client::Client::Connect(co)).value().release();
    auto built = BuildRandom(client_, 800, 11);
    ASSERT_TRUE(built.ok()) << built.status().ToString();
    id_ = new std::string(built->context().context_id());
  }
  static void TearDownTestSuite() {
    delete client_;
    delete server_;
    delete tmp_;
    delete id_;
  }
  void SetUp() override { ASSERT_NE(id_, nullptr) << "suite set-up failed"; }

  static std::vector<float> RandomQueries(uint32_t seed) {
    std::vector<float> q(4 * 32);
    std::mt19937 rng(seed);
    std::normal_distribution<float> g;
    for (auto& x : q) x = g(rng);
    return q;
  }
  static std::unique_ptr<client::DecodeSession> Open(const std::string& method, bool prefetch,
                                                     client::SelectMode mode,
                                                     size_t cache_bytes = 256u << 20,
                                                     std::map<std::string, std::string> params = {
                                                         {"budget", "64"}}) {
    client::SessionOptions so{.context_id = *id_,
                              .method = method,
                              .params = std::move(params),
                              .mode = mode,
                              .page_cache_bytes = cache_bytes,
                              .prefetch = prefetch};
    auto s = client_->OpenSession(so);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  static void ExpectSameSelection(const client::SelectedKV& a, const client::SelectedKV& b) {
    ASSERT_EQ(a.heads.size(), b.heads.size());
    for (size_t h = 0; h < a.heads.size(); ++h) {
      EXPECT_EQ(a.heads[h].per_q_head, b.heads[h].per_q_head) << "kv head " << h;
      EXPECT_EQ(a.heads[h].ids, b.heads[h].ids) << "kv head " << h;
      EXPECT_EQ(a.heads[h].k, b.heads[h].k) << "kv head " << h;
      EXPECT_EQ(a.heads[h].v, b.heads[h].v) << "kv head " << h;
    }
  }

  static TempDir* tmp_;
  static ServerProcess* server_;
  static client::Client* client_;
  static std::string* id_;
};
TempDir* PrefetchTest::tmp_ = nullptr;
ServerProcess* PrefetchTest::server_ = nullptr;
client::Client* PrefetchTest::client_ = nullptr;
std::string* PrefetchTest::id_ = nullptr;

// Prefetch(l, q) then Step(l, q): every page comes from the cache, and the
// selections equal those of a session without prefetch, also after Appends
// (the prediction selectors follow the appended tokens) and when the
// predicted queries differ from the real ones.
TEST_F(PrefetchTest, PrefetchThenStepIsServedFromTheCacheAndChangesNothing) {
  for (const std::string method : {"csa", "oracle"}) {
    SCOPED_TRACE(method);
    auto with = Open(method, true, client::SelectMode::kClient);
    auto without = Open(method, false, client::SelectMode::kClient);
    ASSERT_TRUE(with && without);
    EXPECT_EQ(with->Prefetch(0, nullptr).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(with->Prefetch(2, RandomQueries(1).data()).code(), StatusCode::kInvalidArgument);
    uint64_t cold_pages = 0, cold_bytes = 0;
    for (uint32_t layer = 0; layer < 2; ++layer) {
      auto q = RandomQueries(10 + layer);
      client::SelectedKV a, b;
      ASSERT_TRUE(with->Prefetch(layer, q.data()).ok());
      ASSERT_TRUE(without->Prefetch(layer, q.data()).ok());  // disabled: no-op
      ASSERT_TRUE(with->Step(layer, q.data(), &a).ok());
      ASSERT_TRUE(without->Step(layer, q.data(), &b).ok());
      EXPECT_GT(b.pages, 0u);
      EXPECT_EQ(a.bytes_received, 0u) << "layer " << layer << ": all pages were prefetched";
      EXPECT_EQ(a.pages, 0u);
      EXPECT_EQ(a.cache_hits, b.pages + b.cache_hits);
      ExpectSameSelection(a, b);
      cold_pages += b.pages;
      cold_bytes += b.bytes_received;
    }
    client::PageCacheStats st = with->page_cache_stats();
    EXPECT_EQ(st.prefetch_requests, 2u);
    EXPECT_EQ(st.prefetch_failures, 0u);
    EXPECT_EQ(st.prefetched_pages, cold_pages);
    EXPECT_EQ(st.prefetch_hits, cold_pages);
    EXPECT_EQ(st.prefetched_bytes, cold_bytes);
    EXPECT_EQ(st.prefetch_hit_bytes, cold_bytes);
    EXPECT_EQ(st.misses, 0u);
    EXPECT_GT(st.prefetch_selector_bytes, 0u);
    client::PageCacheStats off = without->page_cache_stats();
    EXPECT_EQ(off.prefetch_requests, 0u);
    EXPECT_EQ(off.prefetched_pages, 0u);
    EXPECT_EQ(off.prefetch_selector_bytes, 0u);

    // Decode a few tokens: Append to both, prefetch with a wrong guess (a
    // different query) and with the right one; results stay identical.
    std::mt19937 rng(5);
    std::normal_distribution<float> g;
    std::vector<float> k(2 * 2 * 32), v(k.size()), qa(2 * 4 * 32);
    for (int t = 0; t < 4; ++t) {
      for (auto* buf : {&k, &v, &qa})
        for (auto& x : *buf) x = g(rng);
      ASSERT_TRUE(with->Append(k.data(), v.data(), qa.data()).ok());
      ASSERT_TRUE(without->Append(k.data(), v.data(), qa.data()).ok());
      for (uint32_t layer = 0; layer < 2; ++layer) {
        auto q = RandomQueries(100 + t * 2 + layer);
        auto guess = t % 2 ? q : RandomQueries(1000 + t);
        ASSERT_TRUE(with->Prefetch(layer, guess.data()).ok());
        client::SelectedKV a, b;
        ASSERT_TRUE(with->Step(layer, q.data(), &a).ok());
        ASSERT_TRUE(without->Step(layer, q.data(), &b).ok());
        ExpectSameSelection(a, b);
        if (t % 2) {
          EXPECT_EQ(a.bytes_received, 0u) << "t " << t << " layer " << layer;
        }
      }
    }
    EXPECT_EQ(with->page_cache_stats().prefetch_failures, 0u);
    EXPECT_TRUE(with->Close().ok());
    EXPECT_TRUE(without->Close().ok());
  }
}

// Streaming selects without queries: Step(l) prefetches layer l+1 by itself.
// csa's per-session rerank (session/session_params.h): the client-side
// selection applies it as the server does (same tokens, same K/V), and it
// changes what csa picks against the context's build value (6).
TEST_F(PrefetchTest, SessionRerankSelectsTheSameOnClientAndServer) {
  std::vector<std::vector<std::vector<int32_t>>> by_factor;
  for (const char* factor : {"6", "0", "12"}) {
    SCOPED_TRACE(factor);
    const std::map<std::string, std::string> params = {{"budget", "64"}, {"rerank", factor}};
    auto local = Open("csa", true, client::SelectMode::kClient, 256u << 20, params);
    auto remote = Open("csa", false, client::SelectMode::kServer, 256u << 20, params);
    ASSERT_TRUE(local && remote);
    std::vector<std::vector<int32_t>> picks;
    for (uint32_t layer = 0; layer < 2; ++layer) {
      auto q = RandomQueries(40 + layer);
      client::SelectedKV a, b;
      ASSERT_TRUE(local->Prefetch(layer, q.data()).ok());
      ASSERT_TRUE(local->Step(layer, q.data(), &a).ok());
      ASSERT_TRUE(remote->Step(layer, q.data(), &b).ok());
      ExpectSameSelection(a, b);
      for (const auto& h : a.heads)
        picks.insert(picks.end(), h.per_q_head.begin(), h.per_q_head.end());
    }
    by_factor.push_back(picks);
  }
  EXPECT_NE(by_factor[1], by_factor[0]);  // rerank 0 (the lists alone) differs from 6
  auto bad = client_->OpenSession(client::SessionOptions{.context_id = *id_,
                                                         .method = "quest",
                                                         .params = {{"rerank", "4"}},
                                                         .mode = client::SelectMode::kClient});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PrefetchTest, StreamingStepPrefetchesTheNextLayer) {
  auto with = Open("streaming", true, client::SelectMode::kClient);
  auto without = Open("streaming", false, client::SelectMode::kClient);
  ASSERT_TRUE(with && without);
  auto q = RandomQueries(3);
  client::SelectedKV a0, a1, b0, b1;
  ASSERT_TRUE(with->Step(0, q.data(), &a0).ok());
  ASSERT_TRUE(without->Step(0, q.data(), &b0).ok());
  EXPECT_GT(a0.bytes_received, 0u) << "nothing prefetches layer 0";
  ASSERT_TRUE(with->Step(1, q.data(), &a1).ok());
  ASSERT_TRUE(without->Step(1, q.data(), &b1).ok());
  EXPECT_EQ(b1.cache_hits, 0u);
  EXPECT_GT(b1.pages, 0u);
  EXPECT_EQ(a1.cache_hits, b1.pages) << "layer 1's pages were prefetched by Step(0)";
  EXPECT_EQ(a1.bytes_received, 0u);
  ExpectSameSelection(a0, b0);
  ExpectSameSelection(a1, b1);
  client::PageCacheStats st = with->page_cache_stats();
  EXPECT_EQ(st.prefetch_requests, 1u);
  EXPECT_EQ(st.prefetch_hits, b1.pages);
  EXPECT_EQ(st.prefetched_bytes, b1.bytes_received);
  EXPECT_EQ(without->page_cache_stats().prefetch_requests, 0u);
}

// GenerateRemote counts the context tokens its q heads attended: every
// token of every layer-step with full, the session's selection with a budget.
TEST_F(PrefetchTest, GenerateRemoteCountsTheContextTokensAttended) {
  auto model = model::Model::Load(testing::SourceDir() + "/tests/data/golden/llama3");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto info = client_->GetContext(*id_);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  const model::ModelSpec& spec = (*model)->spec();
  uint64_t attended[2] = {0, 0};
  int i = 0;
  for (const std::string method : {"full", "streaming"}) {
    SCOPED_TRACE(method);
    client::GenerateOptions go;
    go.session.context_id = *id_;
    go.session.method = method;
    if (method != "full") go.session.params = {{"rho", "0.1"}, {"page_fraction", "0.1"}};
    go.max_new_tokens = 4;
    auto r = client::GenerateRemote(**model, client_, {5, 17}, go);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    attended[i++] = r->context_tokens_attended;
    if (method == "full") {
      EXPECT_EQ(r->context_tokens_attended,
                uint64_t(info->n_tokens()) * spec.n_layers * spec.n_q_heads * r->steps);
      const uint64_t page = info->block_tokens();
      const uint64_t n_pages = (info->n_tokens() + page - 1) / page;
      EXPECT_EQ(r->context_pages_touched, n_pages * spec.n_layers * spec.n_kv_heads * r->steps);
    } else {
      EXPECT_GT(r->context_pages_touched, 0u);
    }
  }
  EXPECT_GT(attended[1], 0u);
  EXPECT_LT(attended[1], attended[0] / 2);
}

// The reference worker with speculative prefetch gives exactly the tokens
// (and logits) it gives without.
TEST_F(PrefetchTest, GenerateRemoteIsIdenticalWithAndWithoutPrefetch) {
  auto model = model::Model::Load(testing::SourceDir() + "/tests/data/golden/llama3");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const std::vector<int32_t> prompt = {5, 17, 42, 99};
  for (const std::string method : {"csa", "streaming"}) {
    SCOPED_TRACE(method);
    client::GenerateResult runs[2];
    for (int on = 0; on < 2; ++on) {
      client::GenerateOptions go;
      go.session.context_id = *id_;
      go.session.method = method;
      go.session.mode = client::SelectMode::kClient;
      go.session.prefetch = on == 1;
      go.max_new_tokens = 8;
      go.keep_logits = true;
      auto r = client::GenerateRemote(**model, client_, prompt, go);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      runs[on] = std::move(r).value();
    }
    EXPECT_EQ(runs[1].tokens, runs[0].tokens);
    EXPECT_EQ(runs[1].argmax, runs[0].argmax);
    // The pages (hence K/V) are bit-identical; the logits are compared with a
    // tolerance because two runs of the model itself differ in the last bits
    // (Eigen's reduction order depends on buffer alignment), prefetch or not.
    ASSERT_EQ(runs[1].logits.size(), runs[0].logits.size());
    for (size_t i = 0; i < runs[0].logits.size(); ++i) {
      ASSERT_EQ(runs[1].logits[i].size(), runs[0].logits[i].size());
      for (size_t j = 0; j < runs[0].logits[i].size(); ++j) {
        ASSERT_NEAR(runs[1].logits[i][j], runs[0].logits[i][j], 1e-4) << "position " << i;
      }
    }
    EXPECT_EQ(runs[0].page_cache.prefetch_requests, 0u);
    // One prefetch of layer 1 per token step (prompt + generated - 1).
    EXPECT_EQ(runs[1].page_cache.prefetch_requests, static_cast<uint64_t>(runs[1].steps));
    EXPECT_GT(runs[1].page_cache.prefetch_hits, 0u);
    EXPECT_EQ(runs[1].page_cache.prefetch_failures, 0u);
    EXPECT_LT(runs[1].bytes_received, runs[0].bytes_received)
        << "prefetched pages are not received by Steps";
  }
}

// With a budget of ~3 pages the prefetches evict and are evicted, the cache
// never exceeds its budget, and the Steps still return the right KV.
TEST_F(PrefetchTest, PageCacheKeepsItsBudgetWithPrefetch) {
  const size_t budget = 3 * (16 * 32 * 2 * 4 + 64);
  auto with = Open("csa", true, client::SelectMode::kClient, budget);
  auto without = Open("csa", false, client::SelectMode::kClient);
  ASSERT_TRUE(with && without);
  for (int round = 0; round < 3; ++round) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      auto q = RandomQueries(200 + round * 2 + layer);
      ASSERT_TRUE(with->Prefetch(layer, q.data()).ok());
      ASSERT_TRUE(with->Prefetch(1 - layer, RandomQueries(300 + round).data()).ok());
      client::SelectedKV a, b;
      ASSERT_TRUE(with->Step(layer, q.data(), &a).ok());
      ASSERT_TRUE(without->Step(layer, q.data(), &b).ok());
      ExpectSameSelection(a, b);
      EXPECT_LE(with->page_cache_stats().bytes, budget);
    }
  }
  EXPECT_TRUE(with->Close().ok());  // waits for the prefetches still in flight
  client::PageCacheStats st = with->page_cache_stats();
  EXPECT_LE(st.bytes, budget);
  EXPECT_GT(st.evictions, 0u);
  EXPECT_GT(st.prefetched_pages, 0u);
  EXPECT_EQ(st.prefetch_failures, 0u);
}

// Server mode: the server sends pages inline; Prefetch is a no-op.
TEST_F(PrefetchTest, PrefetchInServerModeIsANoOp) {
  auto with = Open("csa", true, client::SelectMode::kServer);
  auto plain = Open("csa", true, client::SelectMode::kServer);
  ASSERT_TRUE(with && plain);
  auto q = RandomQueries(4);
  EXPECT_TRUE(with->Prefetch(1, q.data()).ok());
  EXPECT_TRUE(with->Prefetch(0, nullptr).ok());
  EXPECT_EQ(with->Prefetch(2, q.data()).code(), StatusCode::kInvalidArgument);
  client::SelectedKV a, b;
  ASSERT_TRUE(with->Step(1, q.data(), &a).ok());
  ASSERT_TRUE(plain->Step(1, q.data(), &b).ok());
  ExpectSameSelection(a, b);
  EXPECT_EQ(a.bytes_received, b.bytes_received);
  EXPECT_GT(a.bytes_received, 0u);
  client::PageCacheStats st = with->page_cache_stats();
  EXPECT_EQ(st.prefetch_requests, 0u);
  EXPECT_EQ(st.prefetched_pages, 0u);
  EXPECT_EQ(st.hits + st.misses + st.bytes, 0u);
}

TEST(SdkTest, SessionsPastAConnectionsStreamLimitOpenOnFurtherConnections) {
  // The server takes 3 streams per connection: with sessions_per_connection
  // 3 the SDK opens 8 sessions (both modes) at once over 3 connections, and
  // a closed session's room is reused; assuming more, the 4th is refused.
  TempDir tmp;
  auto args = ModelArgs();
  args.insert(args.end(), {"--max-streams-per-connection", "3"});
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data", args)) << server.log();
  client::ClientOptions co;
  co.server = server.address();
  co.sessions_per_connection = 3;
  auto client = std::move(client::Client::Connect(co)).value();
  auto built = BuildRandom(client.get(), 96, 5);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  const std::string id = built->context().context_id();
  std::vector<float> q(4 * 32, 0.5f);
  std::vector<std::unique_ptr<client::DecodeSession>> sessions;
  for (int i = 0; i < 9; ++i) {
    client::SessionOptions so;
    so.context_id = id;
    so.method = "streaming";
    so.mode = i % 2 ? client::SelectMode::kClient : client::SelectMode::kServer;
    auto s = client->OpenSession(so);
    ASSERT_TRUE(s.ok()) << i << ": " << s.status().ToString();
    sessions.push_back(std::move(s).value());
    if (i == 7) {  // 8 open: close two, the next reuses their room
      ASSERT_TRUE(sessions[0]->Close().ok());
      sessions[1].reset();
    }
  }
  for (size_t i = 2; i < sessions.size(); ++i) {
    client::SelectedKV kv;
    ASSERT_TRUE(sessions[i]->Step(0, q.data(), &kv).ok()) << i;
    EXPECT_EQ(kv.heads.size(), 2u);
  }
  sessions.clear();
  co.sessions_per_connection = 100;
  co.max_attempts = 1;
  auto one = std::move(client::Client::Connect(co)).value();
  client::SessionOptions streaming;
  streaming.context_id = id;
  streaming.method = "streaming";
  for (int i = 0; i < 3; ++i) {
    auto s = one->OpenSession(streaming);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    sessions.push_back(std::move(s).value());
  }
  auto refused = one->OpenSession(streaming);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("max-streams-per-connection"), std::string::npos)
      << refused.status().ToString();
  sessions.clear();  // sessions do not outlive their client
}

TEST(SdkTest, RetriesAcrossAServerRestart) {
  TempDir tmp;
  const int port = FreePort();
  auto args = ModelArgs();
  args.insert(args.end(), {"--listen", "127.0.0.1:" + std::to_string(port)});
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data", args)) << server.log();
  client::ClientOptions co;
  co.server = "127.0.0.1:" + std::to_string(port);
  co.max_attempts = 10;
  co.initial_backoff_s = 0.1;
  auto client = std::move(client::Client::Connect(co)).value();
  auto built = BuildRandom(client.get(), 200, 3);
  ASSERT_TRUE(built.ok());
  const std::string id = built->context().context_id();
  EXPECT_EQ(server.Stop(), 0);
  // Restart after a while; the client's calls meanwhile see UNAVAILABLE and retry.
  ServerProcess restarted;
  std::thread restarter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    ASSERT_TRUE(restarted.Start(tmp.path() + "/data", args)) << restarted.log();
  });
  auto info = client->GetContext(id);
  restarter.join();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->n_tokens(), 200u);
  client::SessionOptions so;
  so.context_id = id;
  so.method = "streaming";
  auto session = client->OpenSession(so);
  EXPECT_TRUE(session.ok()) << session.status().ToString();
}

// Retry delays are jittered within [bound / 2, bound], so clients that failed
// together do not retry in lock step.
TEST(SdkTest, RetryBackoffIsJitteredWithinItsBound) {
  std::set<double> seen;
  for (int i = 0; i < 64; ++i) {
    const double d = client::internal::JitteredBackoff(0.4);
    EXPECT_GE(d, 0.2);
    EXPECT_LE(d, 0.4);
    seen.insert(d);
  }
  EXPECT_GT(seen.size(), 1u);
}

TEST(SdkTest, UnreachableServerIsUnavailableAfterRetries) {
  client::ClientOptions co;
  co.server = "127.0.0.1:1";
  co.max_attempts = 2;
  co.initial_backoff_s = 0.01;
  co.timeout_s = 2;
  auto client = std::move(client::Client::Connect(co)).value();
  auto s = client->GetStats();
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find("127.0.0.1:1"), std::string_view::npos);
  client::ClientOptions empty;
  empty.server = "";
  EXPECT_EQ(client::Client::Connect(empty).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache
