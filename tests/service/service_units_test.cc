// Unit tests of service/ that start no server: the build queue, the event
// hub, config parsing, CheckReusable, IngestBuilder and DecodeSession over a
// real RocksDB store in a temp dir, MapKV segments' seals and ShmCache.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>
#include <thread>

#include "common/dtype.h"
#include "index/csa.h"
#include "index/methods.h"
#include "service/build_pipeline.h"
#include "service/build_queue.h"
#include "service/config.h"
#include "service/connection_streams.h"
#include "service/decode_session.h"
#include "service/events.h"
#include "service/shm_broker.h"
#include "service/shm_cache.h"
#include "storage/keys.h"
#include "storage/manifest_codec.h"
#include "storage/store.h"
#include "tests/storage/test_util.h"

namespace ctxcache::service {
namespace {

using storage::testing::TempDir;

// ------------------------------------------------------------ BuildQueue --

TEST(BuildQueueTest, AdmitsQueuesRejectsAndCancelsInOrder) {
  BuildQueue q(/*max_running=*/1, /*max_waiting=*/1);
  ASSERT_TRUE(q.Acquire(nullptr, nullptr).ok());
  EXPECT_EQ(q.running(), 1u);
  std::atomic<uint32_t> seen_position{0};
  std::atomic<bool> second_done{false};
  std::thread second([&] {
    Status s = q.Acquire([&](uint32_t pos) { seen_position = pos; }, nullptr);
    EXPECT_TRUE(s.ok()) << s.ToString();
    second_done = true;
  });
  for (int i = 0; i < 200 && q.waiting() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(q.waiting(), 1u);
  // The queue is full: a third build is refused with a retry hint.
  Status third = q.Acquire(nullptr, nullptr);
  EXPECT_EQ(third.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.message().find("retry"), std::string::npos);
  EXPECT_FALSE(second_done.load());
  q.Release();
  second.join();
  EXPECT_TRUE(second_done.load());
  EXPECT_EQ(seen_position.load(), 1u);
  // A queued build that is cancelled leaves the queue.
  std::atomic<bool> cancel{false};
  std::thread fourth([&] {
    EXPECT_EQ(q.Acquire(nullptr, [&] { return cancel.load(); }).code(), StatusCode::kCancelled);
  });
  for (int i = 0; i < 200 && q.waiting() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  cancel = true;
  fourth.join();
  EXPECT_EQ(q.waiting(), 0u);
  q.Release();
  EXPECT_TRUE(q.Acquire(nullptr, nullptr).ok());
  q.Release();
}

// -------------------------------------------------------------- EventHub --

TEST(EventHubTest, DeliversToSubscribersAndDropsOldestWhenFull) {
  EventHub hub;
  auto a = hub.Subscribe();
  v1::ContextInfo info;
  info.set_context_id("00112233445566778899aabbccddeeff");
  hub.Publish(v1::ContextEvent::CREATED, info);
  hub.Publish(v1::ContextEvent::READY, info);
  {
    std::lock_guard<std::mutex> lock(a->mu);
    ASSERT_EQ(a->queue.size(), 2u);
    EXPECT_EQ(a->queue[0].type(), v1::ContextEvent::CREATED);
    EXPECT_EQ(a->queue[1].type(), v1::ContextEvent::READY);
    EXPECT_EQ(a->queue[1].context().context_id(), info.context_id());
    EXPECT_GT(a->queue[0].at_ms(), 0);
    a->queue.clear();
  }
  for (int i = 0; i < 4097; ++i) hub.Publish(v1::ContextEvent::EVICTED, info);
  {
    std::lock_guard<std::mutex> lock(a->mu);
    EXPECT_EQ(a->queue.size(), 4096u);
    EXPECT_EQ(a->dropped, 1u);
  }
  hub.Unsubscribe(a);
  hub.Publish(v1::ContextEvent::FAILED, info);
  {
    std::lock_guard<std::mutex> lock(a->mu);
    EXPECT_EQ(a->queue.back().type(), v1::ContextEvent::EVICTED);
  }
  auto b = hub.Subscribe();
  hub.CloseAll();
  std::lock_guard<std::mutex> lock(b->mu);
  EXPECT_TRUE(b->closed);
}

// ---------------------------------------------------------------- config --

StatusOr<ServerConfig> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ctxcached");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseServerConfig(static_cast<int>(argv.size()), argv.data());
}

TEST(ConfigTest, FlagsFileAndOverrides) {
  auto def = Parse({});
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ(def->default_indexes, "csa");
  auto flags = Parse({"--max-sessions", "7", "--data-dir", "/tmp/x"});
  ASSERT_TRUE(flags.ok()) << flags.status().ToString();
  EXPECT_EQ(flags->max_sessions, 7u);
  EXPECT_EQ(flags->data_dir, "/tmp/x");
  TempDir dir;
  const std::string file = dir.Sub("c.toml");
  std::ofstream(file) << "max-sessions = 9\ndata-dir = \"/tmp/from-file\"\n";
  auto from_file = Parse({"--config", file});
  ASSERT_TRUE(from_file.ok()) << from_file.status().ToString();
  EXPECT_EQ(from_file->max_sessions, 9u);
  EXPECT_EQ(from_file->data_dir, "/tmp/from-file");
  auto overridden = Parse({"--config", file, "--max-sessions", "3"});
  ASSERT_TRUE(overridden.ok());
  EXPECT_EQ(overridden->max_sessions, 3u);
  EXPECT_EQ(overridden->data_dir, "/tmp/from-file");
  EXPECT_NE(overridden->ToToml().find("max-sessions = 3"), std::string::npos)
      << overridden->ToToml();
  EXPECT_FALSE(Parse({"--no-such-flag"}).ok());
  EXPECT_FALSE(Parse({"--max-sessions", "lots"}).ok());
  // Kept MapKV segments need MapKV.
  EXPECT_EQ(def->shm_cache_mb, 0u);
  auto kept = Parse({"--shm-cache-mb", "64"});
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_NE(kept->ToToml().find("shm-cache-mb = 64"), std::string::npos);
  auto no_socket = Parse({"--shm-cache-mb", "64", "--shm-socket", "off"});
  ASSERT_EQ(no_socket.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_socket.status().message().find("--shm-socket off"), std::string::npos)
      << no_socket.status().message();
}

// One worker's channel must be able to hold every session the server allows.
TEST(ConfigTest, DefaultStreamsPerConnectionHoldMaxSessions) {
  auto def = Parse({});
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_GE(def->max_streams_per_connection, def->max_sessions);
}

// Regression: the stream past --max-streams-per-connection waited in the
// client for a free HTTP/2 stream; now it is refused at once, naming the flag.
TEST(ConnectionStreamsTest, RefusesTheStreamPastTheLimitAndCountsPerPeer) {
  ConnectionStreams streams(2);
  const std::string a = "ipv4:127.0.0.1:40000", b = "ipv6:[::1]:40001";
  auto a1 = streams.Admit(a);
  auto a2 = streams.Admit(a);
  ASSERT_TRUE(a1.ok() && a2.ok());
  auto a3 = streams.Admit(a);
  ASSERT_FALSE(a3.ok());
  EXPECT_EQ(a3.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(a3.status().message().find("--max-streams-per-connection=2"), std::string::npos)
      << a3.status().ToString();
  EXPECT_TRUE(streams.Admit(b).ok()) << "another connection has its own count";
  { ConnectionStreams::Guard released = std::move(a1).value(); }
  EXPECT_EQ(streams.open(a), 1u);
  auto a4 = streams.Admit(a);
  EXPECT_TRUE(a4.ok());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(streams.Admit("unix:").ok()) << "unix peers share a name";
  EXPECT_EQ(streams.open("unix:"), 0u);
}

// --------------------------------------------------------- CheckReusable --

TEST(CheckReusableTest, SameResolvedParamsReuseOthersNameTheFix) {
  v1::ContextManifest m;
  m.set_context_id(std::string(16, '\x01'));
  m.set_n_tokens(1000);
  v1::IndexParams* ip = m.add_index_params();
  ip->set_method("csa");
  for (const auto& [k, v] : index::CsaOptionsToParams(index::CsaOptions{})) {
    (*ip->mutable_params())[k] = v;
  }
  EXPECT_TRUE(CheckReusable(m, {IndexRequest{"csa", {}}}, 4).ok());
  EXPECT_TRUE(CheckReusable(m, {IndexRequest{"csa", {{"alpha", "0.125"}}}}, 4).ok());
  Status other = CheckReusable(m, {IndexRequest{"csa", {{"alpha", "0.3"}}}}, 4);
  EXPECT_EQ(other.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(other.message().find("evict"), std::string::npos) << other.ToString();
  EXPECT_EQ(CheckReusable(m, {IndexRequest{"tactic", {}}}, 4).code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(CheckReusable(m, {IndexRequest{"csa", {{"bogus", "1"}}}}, 4).code(),
            StatusCode::kInvalidArgument);
  // A context of a head_dim 64 model stores the m its build resolved (16):
  // default params and an explicit m=16 reuse it, another m does not.
  v1::ContextManifest d64 = m;
  d64.mutable_model()->set_head_dim(64);
  index::CsaOptions built;
  built.m = index::CsaSubspaces(0, 64);
  ASSERT_EQ(built.m, 16);
  d64.mutable_index_params(0)->clear_params();
  for (const auto& [k, v] : index::CsaOptionsToParams(built)) {
    (*d64.mutable_index_params(0)->mutable_params())[k] = v;
  }
  EXPECT_TRUE(CheckReusable(d64, {IndexRequest{"csa", {}}}, 4).ok());
  EXPECT_TRUE(CheckReusable(d64, {IndexRequest{"csa", {{"m", "16"}}}}, 4).ok());
  EXPECT_EQ(CheckReusable(d64, {IndexRequest{"csa", {{"m", "8"}}}}, 4).code(),
            StatusCode::kAlreadyExists);
}

// ------------------------------------------- IngestBuilder, DecodeSession --

class SessionStoreTest : public ::testing::Test {
 protected:
  static constexpr int kL = 2, kKV = 2, kQ = 4, kD = 16, kN = 100;

  void SetUp() override {
    auto store = storage::Store::Open(storage::StoreOptions{}, dir_.Sub("db"));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(store).value();
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    k_.resize(size_t{kL} * kKV * kN * kD);
    v_.resize(k_.size());
    q_.resize(size_t{kL} * kQ * kN * kD);
    for (auto& x : k_) x = nd(rng);
    for (auto& x : v_) x = nd(rng);
    for (auto& x : q_) x = nd(rng);
  }

  IngestBuilder::Header Header() const {
    IngestBuilder::Header h;
    h.model = storage::testing::MakeSpec(kL, kKV, kD);
    h.tokens = storage::testing::Tokens(kN);
    h.indexes = {IndexRequest{"csa", {}}};
    return h;
  }

  // Chunk [start, start + n) of `layer` in the ingest layout.
  void Chunk(int layer, int start, int n, std::vector<float>* k, std::vector<float>* v,
             std::vector<float>* q) const {
    k->resize(size_t{kKV} * n * kD);
    v->resize(k->size());
    q->resize(size_t{kQ} * n * kD);
    for (int h = 0; h < kKV; ++h) {
      for (int i = 0; i < n; ++i) {
        const size_t src = ((static_cast<size_t>(layer) * kKV + h) * kN + start + i) * kD;
        std::copy_n(k_.data() + src, kD, k->data() + (static_cast<size_t>(h) * n + i) * kD);
        std::copy_n(v_.data() + src, kD, v->data() + (static_cast<size_t>(h) * n + i) * kD);
      }
    }
    for (int h = 0; h < kQ; ++h) {
      for (int i = 0; i < n; ++i) {
        const size_t src = ((static_cast<size_t>(layer) * kQ + h) * kN + start + i) * kD;
        std::copy_n(q_.data() + src, kD, q->data() + (static_cast<size_t>(h) * n + i) * kD);
      }
    }
  }

  StatusOr<v1::ContextManifest> Ingest() {
    ASSIGN_OR_RETURN(auto b, IngestBuilder::Begin(store_.get(), Header(), BuildOptions{}));
    std::vector<float> k, v, q;
    for (int layer = 0; layer < kL; ++layer) {
      for (int start = 0; start < kN; start += 40) {
        const int n = std::min(40, kN - start);
        Chunk(layer, start, n, &k, &v, &q);
        RETURN_IF_ERROR(b->AddChunk(layer, start, n, k.data(), v.data(), q.data()));
      }
    }
    return b->Commit();
  }

  TempDir dir_;
  std::unique_ptr<storage::Store> store_;
  std::vector<float> k_, v_, q_;  // [layer][head][token][d]
};

TEST_F(SessionStoreTest, AManifestThatDisagreesWithItsIndexIsDataLoss) {
  // A manifest rewritten with a valid frame and checksum but n_tokens - 1:
  // the stored csa index covers one token more. Opening a session on it is
  // DATA_LOSS (stored data in error), not the caller's INVALID_ARGUMENT.
  auto manifest = Ingest();
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  auto id = storage::ContextId::FromBytes(manifest->context_id());
  ASSERT_TRUE(id.ok());
  store_.reset();
  {
    auto raw = storage::testing::OpenRaw(dir_.Sub("db"));
    ASSERT_NE(raw, nullptr);
    std::string v;
    ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("meta"),
                             storage::ManifestKey(*id), &v).ok());
    v1::ContextManifest m;
    ASSERT_TRUE(storage::DecodeManifest(v, &m).ok());
    m.set_n_tokens(m.n_tokens() - 1);
    ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("meta"), storage::ManifestKey(*id),
                             storage::EncodeManifest(m)).ok());
  }
  auto store = storage::Store::Open(storage::StoreOptions{}, dir_.Sub("db"));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  store_ = std::move(store).value();
  auto reader = store_->OpenReader(*id);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto session = DecodeSession::Open(std::move(reader).value(), "csa", {}, /*want_pages=*/true);
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), StatusCode::kDataLoss) << session.status().ToString();
  EXPECT_NE(session.status().message().find("covers " + std::to_string(kN) + " tokens"),
            std::string::npos)
      << session.status().ToString();
  // fsck's verification finds the same context inconsistent (its token ids).
  EXPECT_EQ(store_->Verify(*id).code(), StatusCode::kDataLoss);
}

TEST_F(SessionStoreTest, IngestRejectsBadChunksAndAbortsWithoutCommit) {
  {
    auto b = IngestBuilder::Begin(store_.get(), Header(), BuildOptions{});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    std::vector<float> k, v, q;
    Chunk(0, 0, 10, &k, &v, &q);
    EXPECT_EQ((*b)->AddChunk(0, 5, 10, k.data(), v.data(), q.data()).code(),
              StatusCode::kInvalidArgument);  // not contiguous
    EXPECT_EQ((*b)->AddChunk(kL, 0, 10, k.data(), v.data(), q.data()).code(),
              StatusCode::kInvalidArgument);  // layer out of range
    ASSERT_TRUE((*b)->AddChunk(0, 0, 10, k.data(), v.data(), q.data()).ok());
    EXPECT_EQ((*b)->Commit().status().code(), StatusCode::kFailedPrecondition);
  }  // destroyed uncommitted: nothing stays
  EXPECT_TRUE(store_->ListContexts().empty());
  IngestBuilder::Header bad = Header();
  bad.model.set_fingerprint("");
  EXPECT_EQ(IngestBuilder::Begin(store_.get(), bad, BuildOptions{}).status().code(),
            StatusCode::kInvalidArgument);
  bad = Header();
  bad.indexes = {IndexRequest{"nope", {}}};
  EXPECT_EQ(IngestBuilder::Begin(store_.get(), bad, BuildOptions{}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(SessionStoreTest, IngestBuildsALayersIndexesOnceTheLayerIsComplete) {
  // Layer 0's indexes are built while layer 1 has not arrived (the build
  // runs on the builder's thread: waited for, not timed); then the rest
  // commits. A builder destroyed while a layer's build runs leaves nothing
  // stored.
  for (bool commit : {false, true}) {
    auto b = IngestBuilder::Begin(store_.get(), Header(), BuildOptions{});
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    std::vector<float> k, v, q;
    for (int start = 0; start < kN; start += 40) {
      const int n = std::min(40, kN - start);
      Chunk(0, start, n, &k, &v, &q);
      ASSERT_TRUE((*b)->AddChunk(0, start, n, k.data(), v.data(), q.data()).ok());
    }
    if (!commit) continue;  // destroyed with layer 0's build queued or running
    EXPECT_EQ((*b)->WaitForIndexes(2).code(), StatusCode::kFailedPrecondition);  // 1 complete
    ASSERT_TRUE((*b)->WaitForIndexes(1).ok());
    EXPECT_EQ((*b)->layers_indexed(), 1);
    for (int layer = 1; layer < kL; ++layer) {
      for (int start = 0; start < kN; start += 40) {
        const int n = std::min(40, kN - start);
        Chunk(layer, start, n, &k, &v, &q);
        ASSERT_TRUE((*b)->AddChunk(layer, start, n, k.data(), v.data(), q.data()).ok());
      }
    }
    auto m = (*b)->Commit();
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*b)->layers_indexed(), kL);
    EXPECT_EQ(store_->ListContexts().size(), 1u);
    return;
  }
}

TEST_F(SessionStoreTest, SessionServesSelectedPagesAndAssemblesAppendedOnes) {
  auto manifest = Ingest();
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_EQ(manifest->n_tokens(), static_cast<uint64_t>(kN));
  // Ingesting the same tokens again reuses the context.
  auto again = IngestBuilder::Begin(store_.get(), Header(), BuildOptions{});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->reused());
  auto id = storage::ContextId::FromBytes(manifest->context_id());
  ASSERT_TRUE(id.ok());

  auto open = [&](const std::string& method, std::map<std::string, std::string> params) {
    auto reader = store_->OpenReader(*id);
    EXPECT_TRUE(reader.ok());
    return DecodeSession::Open(std::move(reader).value(), method, params, /*want_pages=*/true);
  };
  EXPECT_EQ(open("nope", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(open("tactic", {}).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(open("csa", {{"rho", "2"}}).status().code(), StatusCode::kInvalidArgument);

  auto session = open("oracle", {{"budget", "8"}});
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  DecodeSession& s = **session;
  std::vector<float> queries(size_t{kQ} * kD, 0.5f);
  SessionStep step;
  EXPECT_EQ(s.Step(kL, queries.data(), &step).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.Step(1, queries.data(), &step).ok());
  ASSERT_EQ(step.heads.size(), static_cast<size_t>(kKV));
  for (int h = 0; h < kKV; ++h) {
    const session::HeadStep& hs = step.heads[h];
    ASSERT_FALSE(hs.pages.empty());
    // Whole stored pages go out as stored, in page order; 100 tokens = 6
    // whole pages plus page 6 with 4 tokens, which is stored too.
    ASSERT_EQ(step.stored[h].size(), hs.n_whole_stored);
    for (size_t i = 0; i < step.stored[h].size(); ++i) {
      EXPECT_EQ(step.stored[h].blocks[i], hs.pages[i]);
    }
    // Every selected token lies in a fetched page.
    for (const auto& sel : hs.per_q_head) {
      EXPECT_LE(sel.size(), 8u);
      for (int32_t t : sel) {
        EXPECT_TRUE(std::binary_search(hs.pages.begin(), hs.pages.end(), uint32_t(t / 16)));
      }
    }
  }
  // One appended token: page 6 now holds 4 stored rows and the new one.
  std::vector<float> k(size_t{kL} * kKV * kD, 0.25f), v(k.size(), -0.5f);
  ASSERT_TRUE(s.Append(k.data(), v.data(), nullptr).ok());
  EXPECT_EQ(s.n_tokens(), kN + 1);
  ASSERT_TRUE(s.Step(1, queries.data(), &step).ok());
  for (int h = 0; h < kKV; ++h) {
    ASSERT_FALSE(step.assembled[h].empty()) << "the current page is always fetched";
    const auto& [block, page] = step.assembled[h].back();
    EXPECT_EQ(block, 6u);
    ASSERT_EQ(page->n_tokens, 5u);
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < kD; ++j) {
        const float want = Bf16ToFloat(FloatToBf16(
            k_[((size_t{1} * kKV + h) * kN + 96 + t) * kD + j]));  // stored as bf16
        EXPECT_EQ(page->k[size_t(t) * kD + j], want);
      }
    }
    EXPECT_EQ(page->k[size_t(4) * kD], 0.25f);
    EXPECT_EQ(page->v[size_t(4) * kD], -0.5f);
  }
  EXPECT_GT(s.bytes_served(), 0u);
}

// Exact-scoring methods gather the same stored keys at every step: the
// server's fetcher reads a page from the store once per session (within its
// cache budget), and again when the budget does not hold it.
TEST_F(SessionStoreTest, ReaderPageFetcherReadsEachPageOnceWithinItsBudget) {
  auto manifest = Ingest();
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  auto id = storage::ContextId::FromBytes(manifest->context_id());
  ASSERT_TRUE(id.ok());
  auto reader = store_->OpenReader(*id);
  ASSERT_TRUE(reader.ok());
  const std::vector<uint32_t> blocks = {0, 2, 5};
  ReaderPageFetcher cached(reader->get());
  session::PageMap first, second;
  ASSERT_TRUE(cached.Fetch(1, 1, blocks, &first).ok());
  const uint64_t once = cached.bytes_read();
  EXPECT_GT(once, 0u);
  ASSERT_TRUE(cached.Fetch(1, 1, blocks, &second).ok());
  EXPECT_EQ(cached.bytes_read(), once);  // served from the cache
  for (uint32_t b : blocks) EXPECT_EQ(first.at(b)->k, second.at(b)->k);
  session::PageMap other_head;
  ASSERT_TRUE(cached.Fetch(1, 0, blocks, &other_head).ok());
  EXPECT_EQ(cached.bytes_read(), 2 * once);  // keyed by (layer, kv head, block)
  EXPECT_NE(other_head.at(0)->k, first.at(0)->k);

  ReaderPageFetcher uncached(reader->get(), /*cache_bytes=*/0);
  session::PageMap a, b;
  ASSERT_TRUE(uncached.Fetch(1, 1, blocks, &a).ok());
  ASSERT_TRUE(uncached.Fetch(1, 1, blocks, &b).ok());
  EXPECT_EQ(uncached.bytes_read(), 2 * once);
  for (uint32_t blk : blocks) EXPECT_EQ(a.at(blk)->k, first.at(blk)->k);
}

// Issue #19 finding 1: the sessions of a context load its index once and
// share it, share one decoded-page cache, and account their memory; the
// index and the bytes go away with the last session.
TEST_F(SessionStoreTest, SessionsShareTheLoadedIndexAndThePageCacheAndAccountMemory) {
  auto manifest = Ingest();
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  auto id = storage::ContextId::FromBytes(manifest->context_id());
  ASSERT_TRUE(id.ok());
  MemoryBudget budget(64 << 20, nullptr);
  SharedIndexCache indexes(&budget);
  SharedPageCache pages(16 << 20);
  DecodeSessionOptions options;
  options.indexes = &indexes;
  options.pages = &pages;
  options.budget = &budget;
  options.max_appended_tokens = 3;
  auto open = [&](const std::string& method) {
    auto reader = store_->OpenReader(*id);
    EXPECT_TRUE(reader.ok());
    return DecodeSession::Open(std::move(reader).value(), method, {}, /*want_pages=*/true,
                               options);
  };
  {
    auto a = open("csa");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    const uint64_t after_first = budget.used();
    EXPECT_EQ(indexes.loaded_count(), 1u);
    EXPECT_GT(indexes.loaded_bytes(), 0u);
    auto b = open("csa");
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(indexes.loaded_count(), 1u);  // loaded once
    // The second session costs only its own state.
    EXPECT_EQ(budget.used() - after_first, (*b)->memory_bytes());
    EXPECT_LT((*b)->memory_bytes(), indexes.loaded_bytes());
    // Appends are charged, and capped by max_appended_tokens.
    std::vector<float> k(size_t{kL} * kKV * kD, 0.25f), v(k.size(), -0.5f);
    const uint64_t before = budget.used();
    for (int t = 0; t < 3; ++t) ASSERT_TRUE((*a)->Append(k.data(), v.data(), nullptr).ok());
    EXPECT_GT(budget.used(), before);
    Status over = (*a)->Append(k.data(), v.data(), nullptr);
    EXPECT_EQ(over.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(over.message().find("max_appended_tokens=3"), std::string::npos) << over.message();
    // b does not see a's tokens.
    EXPECT_EQ((*a)->n_tokens(), kN + 3);
    EXPECT_EQ((*b)->n_tokens(), kN);
    // One decoded-page cache: a page b's fetcher read is a hit for a new one.
    auto r1 = store_->OpenReader(*id);
    auto r2 = store_->OpenReader(*id);
    ASSERT_TRUE(r1.ok() && r2.ok());
    ReaderPageFetcher f1(r1->get(), pages), f2(r2->get(), pages);
    session::PageMap p1, p2;
    const std::vector<uint32_t> blocks = {0, 3};
    ASSERT_TRUE(f1.Fetch(1, 0, blocks, &p1).ok());
    EXPECT_GT(f1.bytes_read(), 0u);
    ASSERT_TRUE(f2.Fetch(1, 0, blocks, &p2).ok());
    EXPECT_EQ(f2.bytes_read(), 0u);
    EXPECT_EQ(p1.at(3).get(), p2.at(3).get());
    EXPECT_GT(pages.bytes(), 0u);
    // Another method is another index.
    auto c = open("oracle");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(indexes.loaded_count(), 2u);
  }
  EXPECT_EQ(indexes.loaded_count(), 0u);  // freed with the last session
  EXPECT_EQ(budget.used(), 0u);
  // A budget the index does not fit: RESOURCE_EXHAUSTED with the numbers.
  MemoryBudget tiny(1024, nullptr);
  SharedIndexCache tiny_indexes(&tiny);
  options.indexes = &tiny_indexes;
  options.budget = &tiny;
  auto refused = open("csa");
  ASSERT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("of budget 1024 bytes"), std::string::npos)
      << refused.status().message();
  EXPECT_EQ(tiny.used(), 0u);
}

// A segment of `size` bytes whose first byte is `tag`: its fd, the caller's.
int TaggedSegment(uint64_t size, uint8_t tag) {
  ShmSegment seg;
  EXPECT_TRUE(seg.Create(size).ok());
  seg.data()[0] = tag;
  return seg.ReleaseFd();
}

uint8_t FirstByte(int fd) {
  uint8_t b = 0;
  EXPECT_EQ(pread(fd, &b, 1, 0), 1);
  close(fd);
  return b;
}

TEST(ShmSegmentTest, OnlyTheFillMappingWritesASealedSegment) {
  ShmSegment seg;
  ASSERT_TRUE(seg.Create(8192).ok());
  ASSERT_TRUE(seg.sealed());
  seg.data()[100] = 7;  // the server's own mapping still writes
  const int fd = seg.DupFd();
  ASSERT_GE(fd, 0);
  uint8_t b = 1;
  EXPECT_EQ(pwrite(fd, &b, 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  EXPECT_EQ(ftruncate(fd, 4096), -1);
  // Reopening through /proc for writing does not help.
  const int again = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDWR);
  if (again >= 0) {
    EXPECT_EQ(pwrite(again, &b, 1, 0), -1);
    close(again);
  }
  void* ro = mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(ro, MAP_FAILED);
  EXPECT_EQ(static_cast<uint8_t*>(ro)[100], 7);
  munmap(ro, 8192);
  close(fd);
}

TEST(ShmCacheTest, KeepsSegmentsLeastRecentlyUsedOutWithinItsBudget) {
  ShmCache cache(3 * 4096);
  const std::string a = ShmCache::Key("aa", 1, {0, 1});
  const std::string b = ShmCache::Key("bb", 1, {0, 1});
  const std::string c = ShmCache::Key("cc", 1, {0});
  EXPECT_NE(ShmCache::Key("aa", 2, {0, 1}), a);  // rebuilt context: another key
  EXPECT_NE(ShmCache::Key("aa", 1, {1, 0}), a);  // another segment order
  EXPECT_EQ(cache.Lookup(a), -1);
  ASSERT_TRUE(cache.Insert(a, TaggedSegment(4096, 1), 4096));
  ASSERT_TRUE(cache.Insert(b, TaggedSegment(8192, 2), 8192));
  EXPECT_EQ(cache.bytes(), 3u * 4096);
  EXPECT_EQ(FirstByte(cache.Lookup(a)), 1);  // a is now the most recent
  ASSERT_TRUE(cache.Insert(c, TaggedSegment(4096, 3), 4096));  // b goes
  EXPECT_EQ(cache.Lookup(b), -1);
  EXPECT_EQ(FirstByte(cache.Lookup(c)), 3);
  EXPECT_EQ(cache.entries(), 2u);
  EXPECT_EQ(cache.bytes(), 2u * 4096);
  // Larger than the whole budget: not kept, nothing else lost.
  EXPECT_FALSE(cache.Insert(b, TaggedSegment(4 * 4096, 2), 4 * 4096));
  EXPECT_EQ(cache.entries(), 2u);
  // The same key again replaces its segment.
  ASSERT_TRUE(cache.Insert(c, TaggedSegment(4096, 4), 4096));
  EXPECT_EQ(FirstByte(cache.Lookup(c)), 4);
  EXPECT_EQ(cache.bytes(), 2u * 4096);
  // A context's segments go together, and only its own.
  ASSERT_TRUE(cache.Insert(ShmCache::Key("aa", 1, {1}), TaggedSegment(4096, 5), 4096));
  EXPECT_EQ(cache.DropContext("aa"), 2u * 4096);
  EXPECT_EQ(cache.Lookup(a), -1);
  EXPECT_EQ(FirstByte(cache.Lookup(c)), 4);
  EXPECT_EQ(cache.bytes(), 4096u);
}

}  // namespace
}  // namespace ctxcache::service
