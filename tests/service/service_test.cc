// End-to-end tests of ctxcached's ContextAdmin and DecodeService through the
// C++ SDK, against the real binary on loopback, with a tiny random-init
// Llama (tests/data/golden/llama3: 2 layers, 4 q / 2 kv heads, d = 32).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <set>
#include <thread>

#include "client/worker/decode_worker.h"
#include "common/dtype.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "index/csa.h"
#include "index/page_table.h"
#include "index/selector.h"
#include "model/decode.h"
#include "model/kv_cache.h"
#include "model/prefill.h"
#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ServerProcess;
using testing::TempDir;

std::string ModelDir() { return testing::SourceDir() + "/tests/data/golden"; }

std::vector<int32_t> RandomTokens(int n, uint32_t seed, int vocab = 512) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  // Repetitive structure so attention has something to find.
  for (int i = 0; i < n; ++i)
    t[i] = (i % 97 < 40) ? static_cast<int32_t>(rng() % vocab) : t[i % 40];
  return t;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(); }

  void StartServer(std::vector<std::string> extra = {}) {
    // The golden llama3 declares 256 positions; these tests use longer contexts.
    std::vector<std::string> args = {"--model-dir",         ModelDir(), "--default-model",
                                     "llama3",              "--default-indexes",
                                     "csa,tactic,lfps,quest", "--max-context-tokens", "65536"};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_TRUE(server_.Start(tmp_.path() + "/data", args)) << server_.log();
    client::ClientOptions o;
    o.server = server_.address();
    o.timeout_s = 60;
    client_ = std::move(client::Client::Connect(o)).value();
  }

  StatusOr<v1::BuildProgress> Build(const std::vector<int32_t>& tokens,
                                    std::vector<v1::BuildProgress>* progress = nullptr) {
    v1::BuildContextRequest req;
    for (int32_t t : tokens) req.mutable_tokens()->add_ids(static_cast<uint32_t>(t));
    req.set_name("test");
    (*req.mutable_labels())["suite"] = "service";
    return client_->Build(req, [&](const v1::BuildProgress& p) {
      if (progress) progress->push_back(p);
    });
  }

  // The context's `method` selectors, as a decode worker loads them from
  // FetchIndex: owned, and as [layer][kv head] pointers.
  void LoadSelectors(const std::string& id, const std::string& method,
                     const model::ModelSpec& spec,
                     std::vector<std::unique_ptr<index::Selector>>* owned,
                     std::vector<std::vector<index::Selector*>>* sels) {
    auto artifacts = client_->FetchIndex(id, method);
    ASSERT_TRUE(artifacts.ok()) << artifacts.status().ToString();
    sels->assign(spec.n_layers, {});
    for (int l = 0; l < spec.n_layers; ++l) {
      for (int h = 0; h < spec.n_kv_heads; ++h) {
        auto sel = index::LoadSelector(method, artifacts->at({l, h}));
        ASSERT_TRUE(sel.ok()) << sel.status().ToString();
        (*sels)[l].push_back(sel->get());
        owned->push_back(std::move(sel).value());
      }
    }
  }

  bool Healthy() {
    auto ch = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
    auto stub = grpc::health::v1::Health::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse resp;
    return stub->Check(&ctx, {}, &resp).ok() &&
           resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }

  TempDir tmp_;
  ServerProcess server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(ServiceTest, BuildStreamsMonotonicProgressAndIsIdempotent) {
  auto tokens = RandomTokens(700, 1);
  std::vector<v1::BuildProgress> progress;
  auto done = Build(tokens, &progress);
  ASSERT_TRUE(done.ok()) << done.status().ToString() << server_.log();
  ASSERT_GE(progress.size(), 3u);
  for (size_t i = 1; i < progress.size(); ++i) {
    EXPECT_GE(progress[i].phase(), progress[i - 1].phase());
    EXPECT_GE(progress[i].tokens_prefilled(), progress[i - 1].tokens_prefilled());
  }
  EXPECT_EQ(progress.back().phase(), v1::BuildProgress::DONE);
  EXPECT_EQ(done->context().state(), v1::CONTEXT_STATE_READY);
  EXPECT_EQ(done->context().n_tokens(), 700u);
  EXPECT_FALSE(done->reused());
  EXPECT_EQ(done->context().context_id().size(), 32u);
  // The same tokens again: same id, no work.
  auto again = Build(tokens);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->reused());
  EXPECT_EQ(again->context().context_id(), done->context().context_id());
  auto got = client_->GetContext(done->context().context_id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->n_tokens(), 700u);
  EXPECT_GT(got->bytes_by_kind().at("index/csa"), 0u);
  // The same tokens with different index params: ALREADY_EXISTS naming the
  // fix; nothing changes.
  v1::BuildContextRequest other;
  for (int32_t t : tokens) other.mutable_tokens()->add_ids(static_cast<uint32_t>(t));
  auto* idx = other.add_indexes();
  idx->set_method("csa");
  (*idx->mutable_params())["alpha"] = "0.5";
  auto conflict = client_->Build(other, nullptr);
  EXPECT_EQ(conflict.status().code(), StatusCode::kAlreadyExists) << conflict.status().ToString();
  EXPECT_NE(conflict.status().message().find("alpha=0.5"), std::string::npos)
      << conflict.status().message();
  EXPECT_NE(conflict.status().message().find("evict"), std::string::npos);
  auto after = client_->GetContext(done->context().context_id());
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->stored_bytes(), got->stored_bytes());
  // A request for a stored index with its params (explicit or default) reuses it.
  other.clear_indexes();
  other.add_indexes()->set_method("csa");
  auto subset = client_->Build(other, nullptr);
  ASSERT_TRUE(subset.ok()) << subset.status().ToString();
  EXPECT_TRUE(subset->reused());
  auto list = client_->ListContexts({});
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->contexts_size(), 1);
}

// Server-side selection must add nothing but transport: a session decodes
// exactly the tokens of the local SparseAttention with the same selectors.
TEST_F(ServiceTest, SessionMatchesLocalDecodeForEveryMethod) {
  auto tokens = RandomTokens(600, 2);
  auto done = Build(tokens);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  const std::string id = done->context().context_id();
  auto model = model::Model::Load(ModelDir() + "/llama3");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const model::ModelSpec& spec = (*model)->spec();
  model::KvCache cache(spec, DType::kBF16);
  model::PrefillResult pr;
  ASSERT_TRUE(model::Prefill(**model, tokens, &cache, {}, {}, &pr).ok());
  const std::vector<int32_t> prompt = {5, 17, 300, 42};
  const int64_t budget = 48;
  for (const char* method : {"csa", "tactic", "lfps", "quest", "streaming", "oracle", "full"}) {
    SCOPED_TRACE(method);
    // Local reference.
    std::vector<std::unique_ptr<index::Selector>> owned;
    std::vector<std::vector<index::Selector*>> sels;
    ASSERT_NO_FATAL_FAILURE(LoadSelectors(id, method, spec, &owned, &sels));
    model::KvCachePageFetcher pages(&cache, 16);
    model::SparseAttentionOptions so;
    so.params["budget"] = std::to_string(budget);
    auto sparse = model::SparseAttention::Create(spec, sels, &pages, pages.n_tokens(), so);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    std::vector<model::AttentionProvider*> providers = {sparse->get()};
    std::vector<int32_t> local;
    std::vector<float> logits;
    int64_t pos = static_cast<int64_t>(tokens.size());
    for (int32_t t : prompt)
      ASSERT_TRUE(model::DecodeStep(**model, t, pos++, providers, &logits).ok());
    for (int i = 0; i < 12; ++i) {
      int32_t next = model::Argmax(logits.data(), spec.vocab);
      local.push_back(next);
      ASSERT_TRUE(model::DecodeStep(**model, next, pos++, providers, &logits).ok());
    }
    // Through ctxcached, both selection modes.
    for (auto mode : {client::SelectMode::kServer, client::SelectMode::kClient}) {
      client::GenerateOptions go;
      go.session.context_id = id;
      go.session.method = method;
      go.session.params["budget"] = std::to_string(budget);
      go.session.mode = mode;
      go.max_new_tokens = 12;
      auto remote = client::GenerateRemote(**model, client_.get(), prompt, go);
      ASSERT_TRUE(remote.ok()) << remote.status().ToString();
      EXPECT_EQ(remote->tokens, local) << "mode " << static_cast<int>(mode);
      EXPECT_GT(remote->bytes_received, 0u);
    }
  }
}

// The three decode modes run one session core (session/sparse_session.h):
// server-side selection, the SDK's client mode and the embedded decode over
// the same stored pages agree exactly on every page table, every q head's
// selection and the logits, with the default session params (mass-ranked
// page cap, block-union tables, whole pages). The decode crosses from the
// stored context into appended tokens through a page that straddles both.
// A path that skipped the page cap or the page tables would differ in pages.
TEST_F(ServiceTest, ServerClientAndEmbeddedSessionsAgreeExactly) {
  const auto tokens = RandomTokens(600, 4);  // 600 = 37.5 pages of 16
  auto done = Build(tokens);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  const v1::ContextInfo& info = done->context();
  const std::string id = info.context_id();
  const int64_t n = static_cast<int64_t>(info.n_tokens());
  auto model = model::Model::Load(ModelDir() + "/llama3");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const model::ModelSpec& spec = (*model)->spec();
  model::KvCache stored(spec, DType::kBF16);
  ASSERT_TRUE(client::FetchContextKv(client_.get(), info, &stored, nullptr).ok());
  const std::vector<int32_t> seq = {5, 17, 300, 42, 7, 99, 123, 250, 31, 64, 8, 200};

  struct Trace {
    std::vector<std::vector<float>> logits;                // [step]
    std::vector<std::vector<std::vector<int32_t>>> heads;  // [step, layer, kv][q head of group]
    std::vector<std::vector<uint32_t>> pages;              // [step, layer, kv]
    std::vector<std::vector<float>> masses;                // [step, layer, kv][q head]
  };
  const int64_t page_budget = index::PageBudget(0.05, n + static_cast<int64_t>(seq.size()), 16);
  for (const char* method : {"csa", "oracle", "tactic", "quest"}) {
    SCOPED_TRACE(method);
    std::vector<std::unique_ptr<index::Selector>> owned;
    std::vector<std::vector<index::Selector*>> sels;
    ASSERT_NO_FATAL_FAILURE(LoadSelectors(id, method, spec, &owned, &sels));
    // Embedded: the model's KvCache is the page source.
    model::KvCachePageFetcher fetcher(&stored, static_cast<int>(info.block_tokens()));
    model::SparseAttentionOptions sparse_options;
    sparse_options.params = {{"estimate_mass", "1"}};
    auto sparse = model::SparseAttention::Create(spec, sels, &fetcher, n, sparse_options);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    Trace embedded;
    std::vector<float> logits;
    for (size_t i = 0; i < seq.size(); ++i) {
      ASSERT_TRUE(model::DecodeStep(**model, seq[i], n + static_cast<int64_t>(i),
                                    {sparse->get()}, &logits)
                      .ok());
      embedded.logits.push_back(logits);
      for (int l = 0; l < spec.n_layers; ++l) {
        for (const session::HeadStep& step : (*sparse)->last_steps(l)) {
          embedded.heads.push_back(step.per_q_head);
          embedded.pages.push_back(step.pages);
          embedded.masses.push_back(step.estimated_mass);
          if (std::string(method) == "csa") {
            // The page cap holds: budget + the sink page + current and recent.
            EXPECT_LE(static_cast<int64_t>(step.pages.size()), page_budget + 3);
          }
        }
      }
    }
    // Through ctxcached, both selection modes.
    for (auto mode : {client::SelectMode::kServer, client::SelectMode::kClient}) {
      SCOPED_TRACE(mode == client::SelectMode::kServer ? "server mode" : "client mode");
      client::SessionOptions so;
      so.context_id = id;
      so.method = method;
      so.mode = mode;
      so.params = {{"estimate_mass", "1"}};
      auto session = client_->OpenSession(so);
      ASSERT_TRUE(session.ok()) << session.status().ToString();
      client::RemoteAttention remote(spec, session->get(), n);
      Trace got;
      for (size_t i = 0; i < seq.size(); ++i) {
        ASSERT_TRUE(model::DecodeStep(**model, seq[i], n + static_cast<int64_t>(i), {&remote},
                                      &logits)
                        .ok());
        ASSERT_TRUE(remote.FlushAppend().ok());
        got.logits.push_back(logits);
        for (int l = 0; l < spec.n_layers; ++l) {
          for (const auto& head : remote.last_selected(l).heads) {
            got.heads.push_back(head.per_q_head);
            got.pages.push_back(head.pages);
            got.masses.push_back(head.estimated_mass);
          }
        }
      }
      EXPECT_EQ(got.pages, embedded.pages);
      EXPECT_EQ(got.heads, embedded.heads);
      // The per-step attention-mass estimate (HeadSelection.estimated_mass):
      // csa and oracle give one per q head in [0, 1], tactic (token budget)
      // and quest none; the wire carries the core's value (the queries may
      // differ in the last bit, as the logits below, so compared to 1e-4).
      ASSERT_EQ(got.masses.size(), embedded.masses.size());
      for (size_t i = 0; i < got.masses.size(); ++i) {
        ASSERT_EQ(got.masses[i].size(), embedded.masses[i].size());
        for (size_t j = 0; j < got.masses[i].size(); ++j) {
          EXPECT_NEAR(got.masses[i][j], embedded.masses[i][j], 1e-4);
        }
      }
      const bool estimates = std::string(method) == "csa" || std::string(method) == "oracle";
      for (const auto& m : got.masses) {
        ASSERT_EQ(m.size(), estimates ? static_cast<size_t>(spec.n_q_heads / spec.n_kv_heads) : 0u);
        for (float x : m) {
          EXPECT_GT(x, 0.0f);
          EXPECT_LE(x, 1.0f);
        }
      }
      double max_diff = 0;
      for (size_t i = 0; i < got.logits.size(); ++i) {
        for (size_t j = 0; j < got.logits[i].size(); ++j) {
          max_diff =
              std::max(max_diff, std::fabs(double(got.logits[i][j]) - embedded.logits[i][j]));
        }
      }
      // One attention routine on identical inputs; the model's Eigen GEMVs
      // may still differ in the last bit with the heap alignment of their
      // buffers (seen: 7e-7), so logits are compared to 1e-5.
      EXPECT_LE(max_diff, 1e-5);
      EXPECT_TRUE((*session)->Close().ok());
    }
  }
}

// index/ owns method defaults: a context built with no index params stores
// exactly CsaOptions' documented defaults (C is clamped only below 128 keys),
// with m resolved for the model's head_dim (what the build used).
TEST_F(ServiceTest, DefaultCsaParamsAreCsaOptionsDefaults) {
  auto done = Build(RandomTokens(700, 9));
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  const v1::IndexParams* csa = nullptr;
  for (const auto& ip : done->context().indexes()) {
    if (ip.method() == "csa") csa = &ip;
  }
  ASSERT_NE(csa, nullptr);
  const index::MethodParams stored(csa->params().begin(), csa->params().end());
  index::CsaOptions defaults;
  defaults.m = index::CsaSubspaces(0, static_cast<int>(done->context().model().head_dim()));
  EXPECT_EQ(stored, index::CsaOptionsToParams(defaults));
  auto parsed = index::ParseCsaOptions(stored);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->norm_weights);
  EXPECT_TRUE(parsed->compact);
  EXPECT_EQ(parsed->C, 128);
  // A context with fewer keys than C clamps it, and records the clamp.
  auto small = Build(RandomTokens(90, 10));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  for (const auto& ip : small->context().indexes()) {
    if (ip.method() == "csa") {
      EXPECT_EQ(ip.params().at("C"), "90");
    }
  }
}

// --max-sessions is a hard limit under concurrent Opens (the slot is
// reserved atomically, not checked then incremented), and failed Opens give
// their slot back.
TEST_F(ServiceTest, MaxSessionsHoldsUnderConcurrentOpens) {
  server_.Stop();
  StartServer({"--max-sessions", "4"});
  auto done = Build(RandomTokens(300, 11));
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  client::SessionOptions bad;
  bad.context_id = std::string(32, '0');  // unknown: NOT_FOUND, no slot kept
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(client_->OpenSession(bad).status().code(), StatusCode::kNotFound);
  }
  client::SessionOptions so;
  so.context_id = done->context().context_id();
  so.method = "streaming";
  constexpr int kThreads = 24;
  std::vector<std::unique_ptr<client::DecodeSession>> opened(kThreads);
  std::vector<Status> errors(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto s = client_->OpenSession(so);
      if (s.ok()) {
        opened[i] = std::move(s).value();
      } else {
        errors[i] = s.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  int ok = 0;
  for (int i = 0; i < kThreads; ++i) {
    if (opened[i]) {
      ++ok;
    } else {
      EXPECT_EQ(errors[i].code(), StatusCode::kResourceExhausted) << errors[i].ToString();
    }
  }
  EXPECT_EQ(ok, 4);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->open_sessions(), 4u);
}

TEST_F(ServiceTest, AppendChangesLaterSelections) {
  auto done = Build(RandomTokens(500, 3));
  ASSERT_TRUE(done.ok());
  const auto& info = done->context();
  const int nq = info.model().n_q_heads(), nkv = info.model().n_kv_heads(),
            d = info.model().head_dim(), L = info.model().n_layers();
  for (const char* method : {"csa", "oracle", "quest"}) {
    SCOPED_TRACE(method);
    client::SessionOptions so;
    so.context_id = info.context_id();
    so.method = method;
    so.params["budget"] = "16";
    auto session = client_->OpenSession(so);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    std::vector<float> q(size_t(nq) * d, 0.f);
    for (int i = 0; i < nq * d; ++i) q[i] = (i % d == 3) ? 4.0f : 0.01f;
    client::SelectedKV before;
    ASSERT_TRUE((*session)->Step(0, q.data(), &before).ok());
    for (const auto& h : before.heads) {
      for (int32_t id : h.ids) EXPECT_LT(id, 500);
    }
    // Append a token whose key is aligned with the query, much more than any context key.
    std::vector<float> k(size_t(L) * nkv * d, 0.f), v(k.size(), 1.0f);
    for (size_t i = 0; i < k.size(); ++i) k[i] = (i % d == 3) ? 1000.0f : 0.f;
    ASSERT_TRUE((*session)->Append(k.data(), v.data(), nullptr).ok());
    client::SelectedKV after;
    ASSERT_TRUE((*session)->Step(0, q.data(), &after).ok());
    bool found = false;
    for (const auto& h : after.heads) {
      found = found || std::find(h.ids.begin(), h.ids.end(), 500) != h.ids.end();
    }
    EXPECT_TRUE(found) << "the appended token 500 should be selected";
    ASSERT_TRUE((*session)->Close().ok());
  }
}

TEST_F(ServiceTest, FetchPagesEqualsStoredKv) {
  auto tokens = RandomTokens(300, 4);
  auto done = Build(tokens);
  ASSERT_TRUE(done.ok());
  auto model = model::Model::Load(ModelDir() + "/llama3");
  ASSERT_TRUE(model.ok());
  model::KvCache cache((*model)->spec(), DType::kBF16);
  model::PrefillResult pr;
  ASSERT_TRUE(model::Prefill(**model, tokens, &cache, {}, {}, &pr).ok());
  v1::FetchPagesRequest req;
  req.set_context_id(done->context().context_id());
  auto* t = req.add_tables();
  t->set_layer(1);
  t->set_kv_head(1);
  for (uint32_t b : {0u, 5u, 18u})
    t->add_blocks(b);  // 18 = the partial last block (300 = 18*16+12)
  std::vector<v1::Page> pages;
  ASSERT_TRUE(client_->FetchPages(req, &pages).ok());
  ASSERT_EQ(pages.size(), 3u);
  const int d = (*model)->spec().head_dim;
  for (const auto& p : pages) {
    std::vector<float> k(size_t(p.n_tokens()) * d), v(k.size()), want_k(k.size()), want_v(k.size());
    Bf16ToFloat(reinterpret_cast<const uint16_t*>(p.k().data()), k.data(), k.size());
    Bf16ToFloat(reinterpret_cast<const uint16_t*>(p.v().data()), v.data(), v.size());
    cache.Read(1, 1, int64_t{p.block()} * 16, int64_t{p.block()} * 16 + p.n_tokens(), want_k.data(),
               want_v.data());
    EXPECT_EQ(k, want_k) << "block " << p.block();
    EXPECT_EQ(v, want_v) << "block " << p.block();
  }
  EXPECT_EQ(pages[2].n_tokens(), 12u);
}

TEST_F(ServiceTest, WatchSeesEveryEvent) {
  std::vector<v1::ContextEvent> events;
  std::thread watcher([&] {
    client_
        ->Watch(
            {},
            [&](const v1::ContextEvent& ev) {
              events.push_back(ev);
              return events.size() < 3;
            },
            30)
        .IgnoreError();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto done = Build(RandomTokens(200, 5));
  ASSERT_TRUE(done.ok());
  ASSERT_TRUE(client_->Evict(done->context().context_id()).ok());
  watcher.join();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].type(), v1::ContextEvent::CREATED);
  EXPECT_EQ(events[1].type(), v1::ContextEvent::READY);
  EXPECT_EQ(events[2].type(), v1::ContextEvent::EVICTED);
  for (const auto& e : events) EXPECT_EQ(e.context().context_id(), done->context().context_id());
}

TEST_F(ServiceTest, EvictionWaitsForTheSessionLease) {
  auto done = Build(RandomTokens(200, 6));
  ASSERT_TRUE(done.ok());
  const std::string id = done->context().context_id();
  client::SessionOptions so;
  so.context_id = id;
  so.method = "streaming";
  auto session = client_->OpenSession(so);
  ASSERT_TRUE(session.ok());
  auto ev = client_->Evict(id);
  ASSERT_TRUE(ev.ok()) << ev.status().ToString();
  EXPECT_TRUE(ev->deferred());
  // The open session keeps working on its lease.
  std::vector<float> q(size_t(done->context().model().n_q_heads()) * 32, 0.5f);
  client::SelectedKV sel;
  EXPECT_TRUE((*session)->Step(0, q.data(), &sel).ok());
  ASSERT_TRUE((*session)->Close().ok());
  // Deleted once the lease dropped.
  StatusCode code = StatusCode::kOk;
  for (int i = 0; i < 50 && code != StatusCode::kNotFound; ++i) {
    code = client_->GetContext(id).status().code();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(code, StatusCode::kNotFound);
}

TEST_F(ServiceTest, ReadyContextsSurviveKillAndRestart) {
  auto done = Build(RandomTokens(250, 7));
  ASSERT_TRUE(done.ok());
  server_.Kill();  // SIGKILL: no clean shutdown
  StartServer();
  auto got = client_->GetContext(done->context().context_id());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->n_tokens(), 250u);
  client::SessionOptions so;
  so.context_id = got->context_id();
  so.method = "csa";
  auto session = client_->OpenSession(so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::vector<float> q(size_t(got->model().n_q_heads()) * 32, 0.5f);
  client::SelectedKV sel;
  EXPECT_TRUE((*session)->Step(1, q.data(), &sel).ok());
}

TEST_F(ServiceTest, ExtendSharesTheParentsPages) {
  auto parent_tokens = RandomTokens(640, 8);  // 40 full pages
  auto parent = Build(parent_tokens);
  ASSERT_TRUE(parent.ok());
  v1::ExtendContextRequest req;
  req.set_parent_id(parent->context().context_id());
  for (int i = 0; i < 32; ++i) req.mutable_tokens()->add_ids(static_cast<uint32_t>(i * 7 % 512));
  auto child = client_->Extend(req, nullptr);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->context().n_tokens(), 672u);
  EXPECT_EQ(child->context().parent_id(), parent->context().context_id());
  // Pages the child stores: only the 2 new blocks per (layer, kv head).
  const auto& info = child->context();
  const uint64_t page_raw = 2ull * 16 * info.model().head_dim() * 2;  // K+V bf16 per page
  const uint64_t new_raw = 2ull * info.model().n_layers() * info.model().n_kv_heads() * page_raw;
  EXPECT_EQ(info.raw_kv_bytes(), new_raw);
  EXPECT_LT(info.bytes_by_kind().at("pages"), parent->context().bytes_by_kind().at("pages") / 4);
  // The child's KV equals a from-scratch build of the same tokens.
  std::vector<int32_t> all = parent_tokens;
  for (int i = 0; i < 32; ++i) all.push_back(i * 7 % 512);
  v1::FetchPagesRequest fp;
  fp.set_context_id(info.context_id());
  auto* t = fp.add_tables();
  t->set_layer(1);
  t->set_kv_head(0);
  for (uint32_t b = 38; b < 42; ++b) t->add_blocks(b);
  std::vector<v1::Page> child_pages;
  ASSERT_TRUE(client_->FetchPages(fp, &child_pages).ok());
  auto model = model::Model::Load(ModelDir() + "/llama3");
  model::KvCache cache((*model)->spec(), DType::kBF16);
  model::PrefillResult pr;
  ASSERT_TRUE(model::Prefill(**model, all, &cache, {}, {}, &pr).ok());
  for (const auto& p : child_pages) {
    std::vector<float> k(size_t(p.n_tokens()) * 32), want(k.size());
    Bf16ToFloat(reinterpret_cast<const uint16_t*>(p.k().data()), k.data(), k.size());
    cache.Read(1, 0, int64_t{p.block()} * 16, int64_t{p.block()} * 16 + p.n_tokens(), want.data(),
               nullptr);
    for (size_t i = 0; i < k.size(); ++i) {
      ASSERT_NEAR(k[i], want[i], 0.02f * std::fabs(want[i]) + 1e-3f) << "block " << p.block();
    }
  }
}

// Every bad input gets the expected code and the server keeps serving.
TEST_F(ServiceTest, BadInputTable) {
  auto done = Build(RandomTokens(100, 9));
  ASSERT_TRUE(done.ok());
  const std::string id = done->context().context_id();
  // Admin.
  {
    v1::BuildContextRequest req;
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kInvalidArgument);
    req.mutable_tokens();  // 0 tokens
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kInvalidArgument);
    req.set_text("");
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kInvalidArgument);
    req.set_text("hello");  // llama3 test model has no tokenizer
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kFailedPrecondition);
    req.mutable_tokens()->add_ids(1);
    req.set_model("no-such-model");
    auto s = client_->Build(req, nullptr).status();
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("llama3"), std::string_view::npos) << s.ToString();
    req.set_model("");
    req.mutable_tokens()->add_ids(100000);  // outside the vocabulary
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kInvalidArgument);
    req.mutable_tokens()->clear_ids();
    req.mutable_tokens()->add_ids(1);
    req.add_indexes()->set_method("nope");
    EXPECT_EQ(client_->Build(req, nullptr).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(client_->GetContext("00112233445566778899aabbccddeeff").status().code(),
              StatusCode::kNotFound);
    EXPECT_EQ(client_->GetContext("xyz").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(client_->GetContext("").status().code(), StatusCode::kInvalidArgument);
  }
  // Decode: raw stream so out-of-order and malformed messages can be sent.
  auto ch = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::DecodeService::NewStub(ch);
  grpc::ClientContext ctx;
  auto stream = stub->Decode(&ctx);
  auto send = [&](const v1::DecodeRequest& r) {
    EXPECT_TRUE(stream->Write(r));
    v1::DecodeResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    return resp;
  };
  auto code_of = [](const v1::DecodeResponse& r) {
    return r.has_error() ? static_cast<StatusCode>(r.error().code()) : StatusCode::kOk;
  };
  v1::DecodeRequest step;
  step.mutable_step()->set_layer(0);
  EXPECT_EQ(code_of(send(step)), StatusCode::kFailedPrecondition);  // Step before Open
  v1::DecodeRequest open;
  open.mutable_open()->set_context_id("00112233445566778899aabbccddeeff");
  open.mutable_open()->set_method("csa");
  EXPECT_EQ(code_of(send(open)), StatusCode::kNotFound);
  open.mutable_open()->set_context_id(id);
  open.mutable_open()->set_method("bogus");
  EXPECT_EQ(code_of(send(open)), StatusCode::kInvalidArgument);
  open.mutable_open()->set_method("csa");
  (*open.mutable_open()->mutable_params())["rho"] = "7";
  EXPECT_EQ(code_of(send(open)), StatusCode::kInvalidArgument);
  open.mutable_open()->clear_params();
  auto opened = send(open);
  ASSERT_TRUE(opened.has_opened()) << opened.DebugString();
  const int nq = 4, d = 32;
  auto* t = step.mutable_step()->mutable_queries();
  t->set_dtype(v1::DTYPE_F32);
  t->add_shape(nq);
  t->add_shape(d - 1);  // wrong dims
  t->set_data(std::string(size_t(nq) * (d - 1) * 4, '\0'));
  EXPECT_EQ(code_of(send(step)), StatusCode::kInvalidArgument);
  t->set_shape(1, d);
  t->set_data(std::string(size_t(nq) * d * 4, '\0'));
  t->set_dtype(v1::DTYPE_UNSPECIFIED);  // wrong dtype
  EXPECT_EQ(code_of(send(step)), StatusCode::kInvalidArgument);
  t->set_dtype(v1::DTYPE_F32);
  std::vector<float> q(size_t(nq) * d, 0.1f);
  q[5] = NAN;
  t->set_data(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  EXPECT_EQ(code_of(send(step)), StatusCode::kInvalidArgument);  // NaN
  q[5] = INFINITY;
  t->set_data(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  EXPECT_EQ(code_of(send(step)), StatusCode::kInvalidArgument);  // Inf
  q[5] = 0.1f;
  t->set_data(reinterpret_cast<const char*>(q.data()), q.size() * 4);
  step.mutable_step()->set_layer(9);  // layer out of range
  EXPECT_EQ(code_of(send(step)), StatusCode::kInvalidArgument);
  step.mutable_step()->set_layer(1);
  EXPECT_EQ(code_of(send(step)), StatusCode::kOk);  // the session is still usable
  v1::DecodeRequest append;
  append.mutable_append()->mutable_k()->set_dtype(v1::DTYPE_F32);
  EXPECT_EQ(code_of(send(append)), StatusCode::kInvalidArgument);   // missing shapes
  EXPECT_EQ(code_of(send(open)), StatusCode::kFailedPrecondition);  // second Open
  stream->WritesDone();
  stream->Finish();
  // Oversized message: rejected by gRPC's size limit.
  {
    grpc::ClientContext c2;
    auto s2 = stub->Decode(&c2);
    v1::DecodeRequest big;
    big.mutable_step()->mutable_queries()->set_data(std::string(9u << 20, 'x'));
    s2->Write(big);
    v1::DecodeResponse r;
    s2->Read(&r);
    EXPECT_EQ(s2->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // FetchPages / FetchIndex errors.
  v1::FetchPagesRequest fp;
  fp.set_context_id(id);
  auto* table = fp.add_tables();
  table->set_layer(5);
  std::vector<v1::Page> pages;
  EXPECT_EQ(client_->FetchPages(fp, &pages).code(), StatusCode::kInvalidArgument);
  table->set_layer(0);
  table->add_blocks(1000);
  EXPECT_EQ(client_->FetchPages(fp, &pages).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->FetchIndex(id, "nope").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Healthy());
}

// Captures post-RoPE Q/K/V per layer: [heads][T][d] fp32.
class CaptureSink final : public model::PrefillSink {
 public:
  explicit CaptureSink(const model::ModelSpec& s)
      : spec_(s), q_(s.n_layers), k_(s.n_layers), v_(s.n_layers) {}
  Status OnChunk(int layer, int64_t, int64_t n, const float* q, const float* k,
                 const float* v) override {
    auto add = [&](std::vector<std::vector<float>>* dst, const float* src, int heads) {
      if (dst->empty()) dst->resize(heads);
      for (int h = 0; h < heads; ++h) {
        (*dst)[h].insert((*dst)[h].end(), src + size_t(h) * n * spec_.head_dim,
                         src + size_t(h + 1) * n * spec_.head_dim);
      }
    };
    add(&q_[layer], q, spec_.n_q_heads);
    add(&k_[layer], k, spec_.n_kv_heads);
    add(&v_[layer], v, spec_.n_kv_heads);
    return Status::OK();
  }
  const model::ModelSpec& spec_;
  std::vector<std::vector<std::vector<float>>> q_, k_, v_;  // [layer][head][T*d]
};

v1::Tensor MakeTensor(const std::vector<std::vector<float>>& heads, int64_t t0, int64_t n, int d) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  t.add_shape(static_cast<int64_t>(heads.size()));
  t.add_shape(n);
  t.add_shape(d);
  std::string data;
  for (const auto& h : heads) {
    data.append(reinterpret_cast<const char*>(h.data() + t0 * d), size_t(n) * d * 4);
  }
  t.set_data(data);
  return t;
}

TEST_F(ServiceTest, IngestEqualsBuildAndACutStreamStoresNothing) {
  auto first = Build(RandomTokens(64, 11));  // learn the server's ModelSpec (fingerprint)
  ASSERT_TRUE(first.ok());
  const v1::ModelSpec spec_proto = first->context().model();
  auto model = model::Model::Load(ModelDir() + "/llama3");
  ASSERT_TRUE(model.ok());
  const auto& spec = (*model)->spec();
  auto tokens = RandomTokens(400, 12);
  model::KvCache cache(spec, DType::kBF16);
  CaptureSink sink(spec);
  model::PrefillResult pr;
  ASSERT_TRUE(model::Prefill(**model, tokens, &cache, {&sink}, {}, &pr).ok());
  auto ch = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
  auto admin = v1::ContextAdmin::NewStub(ch);
  auto ingest = [&](int64_t cut_after_tokens, v1::ContextInfo* info,
                    const std::map<std::string, std::string>& csa_params = {}) {
    grpc::ClientContext ctx;
    auto writer = admin->IngestContext(&ctx, info);
    v1::IngestChunk h;
    *h.mutable_header()->mutable_model() = spec_proto;
    for (int32_t t : tokens) h.mutable_header()->mutable_tokens()->add_ids(t);
    auto* idx = h.mutable_header()->add_indexes();
    idx->set_method("csa");
    idx->mutable_params()->insert(csa_params.begin(), csa_params.end());
    EXPECT_TRUE(writer->Write(h));
    for (int64_t t0 = 0; t0 < static_cast<int64_t>(tokens.size()); t0 += 100) {
      if (t0 >= cut_after_tokens) break;
      for (int l = 0; l < spec.n_layers; ++l) {
        v1::IngestChunk c;
        auto* lc = c.mutable_chunk();
        lc->set_layer(l);
        lc->set_token_start(t0);
        lc->set_n_tokens(100);
        *lc->mutable_k() = MakeTensor(sink.k_[l], t0, 100, spec.head_dim);
        *lc->mutable_v() = MakeTensor(sink.v_[l], t0, 100, spec.head_dim);
        *lc->mutable_q() = MakeTensor(sink.q_[l], t0, 100, spec.head_dim);
        EXPECT_TRUE(writer->Write(c));
      }
    }
    if (cut_after_tokens >= static_cast<int64_t>(tokens.size())) {
      v1::IngestChunk c;
      c.mutable_commit();
      writer->Write(c);
    }
    writer->WritesDone();
    return writer->Finish();
  };
  // Cut off midway: ABORTED, nothing stored.
  v1::ContextInfo info;
  grpc::Status cut = ingest(200, &info);
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::ABORTED) << cut.error_message();
  EXPECT_EQ(client_->ListContexts({})->contexts_size(), 1);
  // Complete ingest.
  grpc::Status ok = ingest(1 << 30, &info);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(info.n_tokens(), 400u);
  // The same tokens again with other csa params: ALREADY_EXISTS, nothing changes.
  v1::ContextInfo again;
  grpc::Status conflict = ingest(1 << 30, &again, {{"alpha", "0.5"}});
  EXPECT_EQ(conflict.error_code(), grpc::StatusCode::ALREADY_EXISTS) << conflict.error_message();
  EXPECT_NE(conflict.error_message().find("alpha=0.5"), std::string::npos);
  EXPECT_EQ(client_->GetContext(info.context_id())->stored_bytes(), info.stored_bytes());
  // A build of the same tokens and indexes on the same model does its own
  // prefill (ingested KV is never reused by a build: docs/security.md), and
  // its index equals the ingest's.
  v1::BuildContextRequest same;
  for (int32_t t : tokens) same.mutable_tokens()->add_ids(t);
  same.add_indexes()->set_method("csa");
  auto built = client_->Build(same, nullptr);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  EXPECT_FALSE(built->reused());
  EXPECT_NE(built->context().context_id(), info.context_id());
  EXPECT_EQ(info.provenance(), v1::PROVENANCE_INGESTED);
  EXPECT_EQ(built->context().provenance(), v1::PROVENANCE_BUILT);
  auto a = client_->FetchIndex(info.context_id(), "csa");
  auto b = client_->FetchIndex(built->context().context_id(), "csa");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  // Pages equal the local KV.
  v1::FetchPagesRequest fp;
  fp.set_context_id(info.context_id());
  auto* t = fp.add_tables();
  t->set_layer(1);
  t->set_kv_head(1);
  t->add_blocks(7);
  std::vector<v1::Page> pages;
  ASSERT_TRUE(client_->FetchPages(fp, &pages).ok());
  std::vector<float> k(16 * 32), want(k.size());
  Bf16ToFloat(reinterpret_cast<const uint16_t*>(pages[0].k().data()), k.data(), k.size());
  cache.Read(1, 1, 7 * 16, 8 * 16, want.data(), nullptr);
  EXPECT_EQ(k, want);
}

// IngestContext with header.parent_id stores a child exactly as
// ExtendContext does when the client sends the KV the server's model would
// compute: the same pages (the parent's shared, the appended ones as sent),
// the same index artifacts and the same decode. Reuse, and every bad header.
TEST_F(ServiceTest, IngestChildEqualsExtendChild) {
  auto parent_tokens = RandomTokens(600, 21);  // 37.5 pages: the last one is shared in part
  auto parent = Build(parent_tokens);
  ASSERT_TRUE(parent.ok()) << parent.status().ToString();
  const v1::ContextInfo& pinfo = parent->context();
  std::vector<int32_t> appended = RandomTokens(100, 22);
  v1::ExtendContextRequest ereq;
  ereq.set_parent_id(pinfo.context_id());
  for (int32_t t : appended) ereq.mutable_tokens()->add_ids(static_cast<uint32_t>(t));
  auto extended = client_->Extend(ereq, nullptr);
  ASSERT_TRUE(extended.ok()) << extended.status().ToString();
  const v1::ContextInfo& einfo = extended->context();

  // The appended tokens' Q/K/V as the server's model computes them on top of
  // the parent's KV.
  auto model = model::Model::Load(ModelDir() + "/llama3");
  ASSERT_TRUE(model.ok());
  const auto& spec = (*model)->spec();
  model::KvCache cache(spec, DType::kBF16);
  model::PrefillResult pr;
  ASSERT_TRUE(model::Prefill(**model, parent_tokens, &cache, {}, {}, &pr).ok());
  CaptureSink sink(spec);
  ASSERT_TRUE(model::Prefill(**model, appended, &cache, {&sink}, {}, &pr).ok());

  auto ch = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
  auto admin = v1::ContextAdmin::NewStub(ch);
  // header edits the header; chunks start at token_start0 (the child's
  // convention: the parent's n_tokens).
  auto ingest = [&](const std::function<void(v1::IngestHeader*)>& header, v1::ContextInfo* info,
                    uint64_t token_start0 = 600) {
    grpc::ClientContext ctx;
    auto writer = admin->IngestContext(&ctx, info);
    v1::IngestChunk h;
    v1::IngestHeader* hd = h.mutable_header();
    *hd->mutable_model() = pinfo.model();
    hd->set_parent_id(pinfo.context_id());
    for (int32_t t : appended) hd->mutable_tokens()->add_ids(static_cast<uint32_t>(t));
    header(hd);
    bool ok = writer->Write(h);
    for (int64_t t0 = 0; ok && t0 < 100; t0 += 50) {
      for (int l = 0; ok && l < spec.n_layers; ++l) {
        v1::IngestChunk c;
        auto* lc = c.mutable_chunk();
        lc->set_layer(l);
        lc->set_token_start(token_start0 + t0);
        lc->set_n_tokens(50);
        *lc->mutable_k() = MakeTensor(sink.k_[l], t0, 50, spec.head_dim);
        *lc->mutable_v() = MakeTensor(sink.v_[l], t0, 50, spec.head_dim);
        *lc->mutable_q() = MakeTensor(sink.q_[l], t0, 50, spec.head_dim);
        ok = writer->Write(c);
      }
    }
    v1::IngestChunk c;
    c.mutable_commit();
    if (ok) writer->Write(c);
    writer->WritesDone();
    return writer->Finish();
  };
  v1::ContextInfo info;
  grpc::Status s = ingest([](v1::IngestHeader*) {}, &info);
  ASSERT_TRUE(s.ok()) << s.error_message() << server_.log();
  EXPECT_EQ(info.n_tokens(), 700u);
  EXPECT_EQ(info.parent_id(), pinfo.context_id());
  EXPECT_EQ(info.prefix_tokens(), 600u);
  EXPECT_EQ(info.provenance(), v1::PROVENANCE_INGESTED);
  EXPECT_NE(info.context_id(), einfo.context_id());  // ingested ids live apart
  EXPECT_EQ(info.raw_kv_bytes(), einfo.raw_kv_bytes());  // only its own pages
  EXPECT_EQ(info.name(), pinfo.name());
  EXPECT_EQ(info.labels().at("suite"), "service");
  ASSERT_EQ(info.indexes_size(), einfo.indexes_size());  // the parent's methods

  // Every page of the child equals the extend child's; the shared ones the
  // parent's.
  for (int l = 0; l < spec.n_layers; ++l) {
    for (int h = 0; h < spec.n_kv_heads; ++h) {
      auto fetch = [&](const std::string& id, uint32_t n_blocks) {
        v1::FetchPagesRequest fp;
        fp.set_context_id(id);
        auto* t = fp.add_tables();
        t->set_layer(l);
        t->set_kv_head(h);
        for (uint32_t b = 0; b < n_blocks; ++b) t->add_blocks(b);
        std::vector<v1::Page> pages;
        EXPECT_TRUE(client_->FetchPages(fp, &pages).ok());
        return pages;
      };
      auto got = fetch(info.context_id(), 44), want = fetch(einfo.context_id(), 44);
      auto par = fetch(pinfo.context_id(), 38);
      ASSERT_EQ(got.size(), 44u);
      ASSERT_EQ(want.size(), 44u);
      for (size_t i = 0; i < got.size(); ++i) {
        SCOPED_TRACE("layer " + std::to_string(l) + " head " + std::to_string(h) + " block " +
                     std::to_string(i));
        EXPECT_EQ(got[i].n_tokens(), want[i].n_tokens());
        EXPECT_EQ(got[i].k(), want[i].k());
        EXPECT_EQ(got[i].v(), want[i].v());
        if (i < 37) {
          EXPECT_EQ(got[i].k(), par[i].k());
          EXPECT_EQ(got[i].v(), par[i].v());
        }
      }
      // The last parent page, partly shared: its first 8 tokens are the parent's.
      EXPECT_EQ(got[37].k().substr(0, 8 * 32 * 2), par[37].k());
    }
  }
  // Same index artifacts for every method.
  for (const auto& ip : einfo.indexes()) {
    SCOPED_TRACE(ip.method());
    auto a = client_->FetchIndex(info.context_id(), ip.method());
    auto b = client_->FetchIndex(einfo.context_id(), ip.method());
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    EXPECT_EQ(*a, *b);
  }
  // A decode session on the child reads it as it reads the extend child.
  for (const char* method : {"csa", "quest"}) {
    std::vector<int32_t> tokens[2];
    int i = 0;
    for (const std::string& id : {info.context_id(), einfo.context_id()}) {
      client::GenerateOptions go;
      go.session.context_id = id;
      go.session.method = method;
      go.session.params["budget"] = "48";
      go.max_new_tokens = 8;
      auto r = client::GenerateRemote(**model, client_.get(), {5, 17, 300}, go);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      tokens[i++] = r->tokens;
    }
    EXPECT_EQ(tokens[0], tokens[1]) << method;
  }

  // The same child again: reused, nothing new stored.
  const int n_stored = client_->ListContexts({})->contexts_size();
  v1::ContextInfo again;
  s = ingest([](v1::IngestHeader*) {}, &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(again.context_id(), info.context_id());
  EXPECT_EQ(again.stored_bytes(), info.stored_bytes());

  // Bad headers and chunks: the right code, the field named, nothing stored.
  struct Bad {
    const char* what;
    std::function<void(v1::IngestHeader*)> edit;
    uint64_t token_start0;
    grpc::StatusCode code;
    const char* names;
  };
  const std::string unknown(32, 'a');
  const std::vector<Bad> bad = {
      {"malformed parent", [](v1::IngestHeader* h) { h->set_parent_id("xyz"); }, 600,
       grpc::StatusCode::INVALID_ARGUMENT, "header.parent_id"},
      {"unknown parent", [&](v1::IngestHeader* h) { h->set_parent_id(unknown); }, 600,
       grpc::StatusCode::NOT_FOUND, "header.parent_id"},
      {"other fingerprint",
       [](v1::IngestHeader* h) { h->mutable_model()->set_fingerprint("another model"); }, 600,
       grpc::StatusCode::FAILED_PRECONDITION, "header.model.fingerprint"},
      {"other kv_dtype",
       [](v1::IngestHeader* h) { h->mutable_model()->set_kv_dtype(v1::DTYPE_F32); }, 600,
       grpc::StatusCode::FAILED_PRECONDITION, "header.model.kv_dtype"},
      {"other head_dim", [](v1::IngestHeader* h) { h->mutable_model()->set_head_dim(64); }, 600,
       grpc::StatusCode::FAILED_PRECONDITION, "header.model.head_dim"},
      {"no appended tokens", [](v1::IngestHeader* h) { h->mutable_tokens()->clear_ids(); }, 600,
       grpc::StatusCode::INVALID_ARGUMENT, "header.tokens"},
      {"chunks from 0",  // (other tokens: the stored child would be reused)
       [](v1::IngestHeader* h) { h->mutable_tokens()->set_ids(0, 1); }, 0,
       grpc::StatusCode::INVALID_ARGUMENT, "start at the parent's n_tokens, 600"},
      {"too long",
       [](v1::IngestHeader* h) {
         for (int i = 0; i < 65536; ++i) h->mutable_tokens()->add_ids(1);
       },
       600, grpc::StatusCode::INVALID_ARGUMENT, "65536"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    v1::ContextInfo none;
    grpc::Status r = ingest(b.edit, &none, b.token_start0);
    EXPECT_EQ(r.error_code(), b.code) << r.error_message();
    EXPECT_NE(r.error_message().find(b.names), std::string::npos) << r.error_message();
  }
  EXPECT_EQ(client_->ListContexts({})->contexts_size(), n_stored);
  // The parent stays while the child references its pages.
  EXPECT_EQ(client_->Evict(pinfo.context_id()).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Healthy());
}

TEST_F(ServiceTest, FullQueueIsResourceExhaustedAndCancelCleansUp) {
  server_.Kill();
  StartServer({"--max-concurrent-builds", "1", "--build-queue-size", "0"});
  auto ch = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
  auto admin = v1::ContextAdmin::NewStub(ch);
  v1::BuildContextRequest big;
  for (int32_t t : RandomTokens(30000, 13)) big.mutable_tokens()->add_ids(t);
  grpc::ClientContext long_ctx;
  auto long_build = admin->BuildContext(&long_ctx, big);
  v1::BuildProgress p;
  ASSERT_TRUE(long_build->Read(&p));  // the first build is running
  // No queue: a second build is refused at once, with a retry hint.
  auto second = Build(RandomTokens(50, 14));
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted) << second.status().ToString();
  EXPECT_NE(second.status().message().find("retry"), std::string_view::npos);
  // Cancelling the running build aborts it and stores nothing.
  long_ctx.TryCancel();
  while (long_build->Read(&p)) {
  }
  EXPECT_EQ(long_build->Finish().error_code(), grpc::StatusCode::CANCELLED);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->n_contexts(), 0u);
  // The slot is free again and nothing BUILDING lingers: a build succeeds.
  StatusOr<v1::BuildProgress> third = UnavailableError("not run");
  for (int i = 0; i < 50; ++i) {
    third = Build(RandomTokens(50, 14));
    if (third.status().code() != StatusCode::kResourceExhausted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_EQ(client_->GetStats()->n_contexts(), 1u);
}

// By default a session fetches at most rho of the pages (plus page 0 and the
// recent pages); page_fraction=1 restores token-level paging.
TEST_F(ServiceTest, SessionsCapPagesAtRhoByDefault) {
  auto done = Build(RandomTokens(1600, 15));  // 100 pages
  ASSERT_TRUE(done.ok());
  std::vector<float> q(4 * 32);
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  for (auto& x : q) x = g(rng);
  auto pages_of = [&](std::map<std::string, std::string> params, client::SelectMode mode) {
    client::SessionOptions so;
    so.context_id = done->context().context_id();
    so.method = "oracle";
    so.params = params;
    so.mode = mode;
    auto session = client_->OpenSession(so);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    client::SelectedKV sel;
    EXPECT_TRUE((*session)->Step(0, q.data(), &sel).ok());
    size_t max_pages = 0;
    for (const auto& h : sel.heads) {
      std::set<int32_t> pages;
      for (int32_t id : h.ids) pages.insert(id / 16);
      max_pages = std::max(max_pages, pages.size());
    }
    return max_pages;
  };
  for (auto mode : {client::SelectMode::kServer, client::SelectMode::kClient}) {
    // rho 0.1 of 100 pages = 10, plus page 0 and the last 2 (recent).
    EXPECT_LE(pages_of({{"rho", "0.1"}}, mode), 13u);
    EXPECT_GT(pages_of({{"rho", "0.1"}, {"page_fraction", "1"}}, mode), 13u);
  }
  // With the cap every q head attends whole pages (whole_pages defaults to
  // 1), the same in both selection modes; whole_pages=0 keeps each head's own
  // 10% of the tokens.
  auto select = [&](std::map<std::string, std::string> params, client::SelectMode mode) {
    client::SessionOptions so;
    so.context_id = done->context().context_id();
    so.method = "csa";
    so.params = params;
    so.mode = mode;
    auto session = client_->OpenSession(so);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    client::SelectedKV sel;
    EXPECT_TRUE((*session)->Step(0, q.data(), &sel).ok());
    return sel;
  };
  const auto server = select({{"rho", "0.1"}}, client::SelectMode::kServer);
  const auto local = select({{"rho", "0.1"}}, client::SelectMode::kClient);
  ASSERT_EQ(server.heads.size(), local.heads.size());
  for (size_t h = 0; h < server.heads.size(); ++h) {
    EXPECT_EQ(server.heads[h].per_q_head, local.heads[h].per_q_head);
    std::set<int32_t> pages;
    for (int32_t id : server.heads[h].ids) pages.insert(id / 16);
    EXPECT_EQ(server.heads[h].ids.size(), pages.size() * 16) << "1600 tokens: all pages full";
    for (const auto& own : server.heads[h].per_q_head) EXPECT_EQ(own, server.heads[h].ids);
  }
  const auto own = select({{"rho", "0.1"}, {"whole_pages", "0"}}, client::SelectMode::kServer);
  for (const auto& head : own.heads) {
    for (const auto& sel : head.per_q_head) EXPECT_LE(sel.size(), 160u);  // 10% of 1600
  }
}

TEST_F(ServiceTest, CorruptPagesAreDetectedByTheClient) {
  server_.Kill();
  StartServer({"--fault-corrupt-pages-for-testing"});
  auto done = Build(RandomTokens(200, 10));
  ASSERT_TRUE(done.ok());
  client::SessionOptions so;
  so.context_id = done->context().context_id();
  so.method = "csa";
  auto session = client_->OpenSession(so);
  ASSERT_TRUE(session.ok());
  std::vector<float> q(4 * 32, 0.3f);
  client::SelectedKV sel;
  Status s = (*session)->Step(0, q.data(), &sel);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  v1::FetchPagesRequest fp;
  fp.set_context_id(so.context_id);
  auto* t = fp.add_tables();
  t->add_blocks(0);
  std::vector<v1::Page> pages;
  EXPECT_EQ(client_->FetchPages(fp, &pages).code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ctxcache
