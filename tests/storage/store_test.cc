// Store / ContextWriter / ContextReader: build, commit, abort, GC, dedup,
// prefix sharing, eviction, corruption, format version, memory bound.
#include "storage/store.h"

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <numeric>
#include <thread>
#include <tuple>

#include "common/crc32c.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"
#include "storage/fsck.h"
#include "storage/manifest_codec.h"
#include "tests/storage/test_util.h"

namespace ctxcache::storage {
namespace {

using testing::BuildContext;
using testing::DirBytes;
using testing::MakeSpec;
using testing::OpenRaw;
using testing::PageMatches;
using testing::TempDir;
using testing::TestOptions;
using testing::Tokens;
using testing::WriteKv;

std::vector<uint32_t> AllBlocks(uint32_t n) {
  std::vector<uint32_t> b(n);
  for (uint32_t i = 0; i < n; ++i) b[i] = i;
  return b;
}

ContextId IdOf(const v1::ContextManifest& m) { return *ContextId::FromBytes(m.context_id()); }

// Number of keys per column family that belong to `id` (store must be closed).
size_t CountKeys(const std::string& path, const std::string& cf, const ContextId& id) {
  auto raw = OpenRaw(path);
  EXPECT_NE(raw, nullptr);
  if (!raw) return 0;
  std::unique_ptr<rocksdb::Iterator> it(raw->db->NewIterator(rocksdb::ReadOptions(), raw->cf(cf)));
  size_t n = 0;
  for (it->Seek(ContextRangeBegin(id)); it->Valid() && it->key().compare(ContextRangeEnd(id)) < 0;
       it->Next()) {
    ++n;
  }
  return n;
}

class StoreTest : public ::testing::Test {
 protected:
  void Open(StoreOptions o) {
    store_.reset();
    auto s = Store::Open(o, dir_.path());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(s).value();
  }
  void Open() { Open(TestOptions(&clock_)); }
  void Close() { store_.reset(); }

  // With the store closed: flips a bit in the middle of the stored value of
  // page (layer, kv_head, block), past its header.
  void FlipStoredPageBit(const ContextId& id, uint32_t layer, uint32_t kv_head, uint32_t block) {
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    std::string key = PageKey(id, layer, kv_head, block), value;
    ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("pages"), key, &value).ok());
    value[value.size() / 2] ^= 0x10;
    ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("pages"), key, value).ok());
  }

  void ExpectAllPagesMatch(const ContextId& id) {
    auto r = store_->OpenReader(id);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const auto& m = (*r)->manifest().model();
    PageBatch batch;
    for (uint32_t l = 0; l < m.n_layers(); ++l) {
      for (uint32_t h = 0; h < m.n_kv_heads(); ++h) {
        for (auto method : {PageReadMethod::kMultiGet, PageReadMethod::kIterator}) {
          Status s = (*r)->ReadPages(l, h, AllBlocks((*r)->n_blocks()), &batch, method);
          ASSERT_TRUE(s.ok()) << s.ToString();
          for (size_t i = 0; i < batch.size(); ++i) {
            ASSERT_TRUE(PageMatches(batch, i, l, h))
                << "layer " << l << " head " << h << " block " << i;
          }
        }
      }
    }
  }

  TempDir dir_;
  ManualClock clock_;
  std::unique_ptr<Store> store_;
};

// The manifest parse Open() applies to every `meta` value (fuzzed by
// fuzz/fuzz_manifest): a stored manifest reads back; other bytes are DATA_LOSS.
TEST(DecodeManifestTest, RoundTripAndGarbage) {
  v1::ContextManifest m;
  m.set_context_id(std::string(16, '\x11'));
  m.set_state(v1::CONTEXT_STATE_READY);
  m.set_n_tokens(42);
  m.set_tenant("acme");
  v1::ContextManifest parsed;
  ASSERT_TRUE(DecodeManifest(EncodeManifest(m), &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), m.SerializeAsString());
  ASSERT_TRUE(DecodeManifest(m.SerializeAsString(), &parsed).ok());  // legacy unframed
  for (std::string bad : {std::string("\xff\xff\xff"), std::string("\x0a\x10x"),
                          std::string("\x82\x01\x02\xc3\x28")}) {  // last: tenant not UTF-8
    EXPECT_EQ(DecodeManifest(bad, &parsed).code(), StatusCode::kDataLoss);
  }
}

TEST_F(StoreTest, BuildCommitReadBackAllDtypes) {
  Open();
  for (v1::DType dt : {v1::DTYPE_BF16, v1::DTYPE_F16, v1::DTYPE_F32}) {
    auto spec = MakeSpec(2, 2, 32, dt);
    auto tokens = Tokens(100, static_cast<uint32_t>(dt));
    auto m = BuildContext(store_.get(), spec, tokens);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->state(), v1::CONTEXT_STATE_READY);
    EXPECT_EQ(m->n_tokens(), 100u);
    EXPECT_EQ(IdOf(*m), ContextId::Compute("fp-A", tokens));
    EXPECT_EQ(m->raw_kv_bytes(), 2u * 2 * 100 * 2 * 32 * (dt == v1::DTYPE_F32 ? 4 : 2));
    ExpectAllPagesMatch(IdOf(*m));
    auto r = store_->OpenReader(IdOf(*m));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)->n_blocks(), 7u);  // ceil(100 / 16)
    PageBatch b;
    ASSERT_TRUE((*r)->ReadPages(1, 1, std::vector<uint32_t>{0, 6}, &b).ok());
    EXPECT_EQ(b.n_tokens[0], 16u);
    EXPECT_EQ(b.n_tokens[1], 4u);  // partial last block
    auto toks = (*r)->ReadTokens();
    ASSERT_TRUE(toks.ok());
    EXPECT_EQ(*toks, tokens);
    EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
  }
}

TEST_F(StoreTest, EveryCodecThroughTheStore) {
  for (PageCodec codec : {PageCodec::kNone, PageCodec::kZstd, PageCodec::kZstdShuffle}) {
    StoreOptions o = TestOptions(&clock_);
    o.page_codec = {codec, 3};
    Open(o);
    auto m =
        BuildContext(store_.get(), MakeSpec(2, 2, 64), Tokens(90, 40 + static_cast<int>(codec)));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->page_codec(), static_cast<v1::PageCodec>(codec));
    ExpectAllPagesMatch(IdOf(*m));
    EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
  }
}

TEST_F(StoreTest, ReadyContextsSurviveReopen) {
  Open();
  auto m = BuildContext(store_.get(), MakeSpec(2, 2, 16), Tokens(50));
  ASSERT_TRUE(m.ok());
  Close();
  Open();
  ExpectAllPagesMatch(IdOf(*m));
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
  EXPECT_EQ(store_->GetStats().gc_contexts_at_open, 0u);
}

TEST_F(StoreTest, BuildingContextIsInvisibleAndAbortRemovesEverything) {
  Open();
  auto tokens = Tokens(200);
  BuildRequest req;
  req.model = MakeSpec(2, 2, 16);
  req.tokens = tokens;
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok());
  ASSERT_NE(start->writer, nullptr);
  ContextId id = start->writer->id();
  ASSERT_TRUE(WriteKv(start->writer.get(), 0, 150).ok());
  EXPECT_EQ(store_->GetManifest(id).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->OpenReader(id).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->GetStats().building_contexts, 1u);
  ASSERT_TRUE(start->writer->Abort().ok());
  EXPECT_EQ(store_->GetManifest(id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->GetStats().building_contexts, 0u);
  Close();
  for (const char* cf : {"pages", "tokens", "index"}) EXPECT_EQ(CountKeys(dir_.path(), cf, id), 0u);
}

TEST_F(StoreTest, WriterDestroyedWithoutCommitAborts) {
  Open();
  auto tokens = Tokens(64);
  BuildRequest req;
  req.model = MakeSpec(1, 1, 16);
  req.tokens = tokens;
  ContextId id;
  {
    auto start = store_->BeginBuild(req);
    ASSERT_TRUE(start.ok());
    id = start->writer->id();
    ASSERT_TRUE(WriteKv(start->writer.get(), 0, 64).ok());
  }
  EXPECT_EQ(store_->GetManifest(id).status().code(), StatusCode::kNotFound);
  // The id can be built again afterwards.
  EXPECT_TRUE(BuildContext(store_.get(), req.model, tokens).ok());
}

TEST_F(StoreTest, OpenGarbageCollectsBuildingContextsAndOrphans) {
  Open();
  auto ready = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(40, 1));
  ASSERT_TRUE(ready.ok());
  Close();
  // Simulate a crash mid-build: a BUILDING manifest with pages and tokens,
  // plus an orphaned page range with no manifest at all.
  ContextId building = ContextId::Compute("fp-A", Tokens(40, 2));
  ContextId orphan = ContextId::Compute("fp-A", Tokens(40, 3));
  {
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    v1::ContextManifest m;
    m.set_context_id(std::string(building.AsBytes()));
    m.set_state(v1::CONTEXT_STATE_BUILDING);
    rocksdb::WriteOptions wo;
    ASSERT_TRUE(
        raw->db->Put(wo, raw->cf("meta"), ManifestKey(building), m.SerializeAsString()).ok());
    for (uint32_t b = 0; b < 10; ++b) {
      ASSERT_TRUE(
          raw->db->Put(wo, raw->cf("pages"), PageKey(building, 0, 0, b), std::string(5000, 'x'))
              .ok());
      ASSERT_TRUE(
          raw->db->Put(wo, raw->cf("pages"), PageKey(orphan, 0, 1, b), std::string(5000, 'y'))
              .ok());
    }
    ASSERT_TRUE(raw->db->Put(wo, raw->cf("tokens"), TokenKey(building, 0), "abcd").ok());
  }
  Open();
  auto st = store_->GetStats();
  EXPECT_EQ(st.gc_contexts_at_open, 1u);
  EXPECT_EQ(st.orphan_prefixes_at_open, 1u);  // the range with no manifest at all
  EXPECT_EQ(st.ready_contexts, 1u);
  ExpectAllPagesMatch(IdOf(*ready));
  Close();
  for (const auto& id : {building, orphan}) {
    for (const char* cf : {"pages", "tokens", "meta"})
      EXPECT_EQ(CountKeys(dir_.path(), cf, id), 0u);
  }
  EXPECT_GT(CountKeys(dir_.path(), "pages", IdOf(*ready)), 0u);
}

TEST_F(StoreTest, BuildingAnExistingIdReturnsTheStoredManifest) {
  Open();
  auto spec = MakeSpec(1, 1, 16);
  auto tokens = Tokens(33);
  auto first = BuildContext(store_.get(), spec, tokens);
  ASSERT_TRUE(first.ok());
  BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  auto again = store_->BeginBuild(req);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->writer, nullptr);
  EXPECT_EQ(again->existing.context_id(), first->context_id());
  EXPECT_EQ(again->existing.committed_at_ms(), first->committed_at_ms());
  EXPECT_EQ(store_->ListContexts().size(), 1u);
}

TEST_F(StoreTest, ConcurrentBuildsOfTheSameIdEndInOneContext) {
  Open();
  auto spec = MakeSpec(2, 2, 16);
  auto tokens = Tokens(300);
  BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  auto a = store_->BeginBuild(req);
  ASSERT_TRUE(a.ok());
  ASSERT_NE(a->writer, nullptr);
  std::atomic<bool> b_done{false};
  StatusOr<BuildStart> b = InternalError("not run");
  std::thread t([&] {
    b = store_->BeginBuild(req);
    b_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(b_done.load());  // waits for the first build
  ASSERT_TRUE(WriteKv(a->writer.get(), 0, tokens.size()).ok());
  auto committed = a->writer->Commit();
  ASSERT_TRUE(committed.ok());
  t.join();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->writer, nullptr);
  EXPECT_EQ(b->existing.context_id(), committed->context_id());
  EXPECT_EQ(store_->ListContexts().size(), 1u);

  // If the first build aborts, the waiting one builds it.
  auto tokens2 = Tokens(64, 9);
  req.tokens = tokens2;
  auto c = store_->BeginBuild(req);
  ASSERT_TRUE(c.ok());
  StatusOr<BuildStart> d = InternalError("not run");
  std::thread t2([&] { d = store_->BeginBuild(req); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(c->writer->Abort().ok());
  t2.join();
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->writer, nullptr);
  ASSERT_TRUE(WriteKv(d->writer.get(), 0, tokens2.size()).ok());
  EXPECT_TRUE(d->writer->Commit().ok());
}

TEST_F(StoreTest, ChildReusesParentPagesWithoutCopying) {
  Open();
  auto spec = MakeSpec(2, 2, 16);
  auto ptoks = Tokens(100);  // 6 full blocks + 4 tokens
  auto parent = BuildContext(store_.get(), spec, ptoks);
  ASSERT_TRUE(parent.ok());
  auto ctoks = ptoks;
  auto extra = Tokens(60, 5);
  ctoks.insert(ctoks.end(), extra.begin(), extra.end());
  BuildRequest req;
  req.model = spec;
  req.tokens = ctoks;
  req.parent = IdOf(*parent);
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(start->writer->first_token(), 100u);
  ASSERT_TRUE(WriteKv(start->writer.get(), 100, 160, 7).ok());
  auto child = start->writer->Commit();
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->shared_blocks(), 6u);
  EXPECT_EQ(child->prefix_tokens(), 100u);
  // The child stores only blocks 6..9 (the boundary block copied + new ones).
  EXPECT_EQ(child->raw_kv_bytes(), 2u * 2 * (160 - 96) * 2 * 16 * 2);
  ExpectAllPagesMatch(IdOf(*child));
  EXPECT_TRUE(store_->Verify(IdOf(*child)).ok());

  // Grandchild: three owners.
  auto gtoks = ctoks;
  auto more = Tokens(40, 6);
  gtoks.insert(gtoks.end(), more.begin(), more.end());
  auto grand = BuildContext(store_.get(), spec, gtoks, IdOf(*child));
  ASSERT_TRUE(grand.ok()) << grand.status().ToString();
  ExpectAllPagesMatch(IdOf(*grand));

  // References keep ancestors alive.
  EXPECT_EQ(store_->Delete(IdOf(*parent)).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Delete(IdOf(*child)).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->Delete(IdOf(*grand)).ok());
  ASSERT_TRUE(store_->Delete(IdOf(*child)).ok());
  ExpectAllPagesMatch(IdOf(*parent));
  ASSERT_TRUE(store_->Delete(IdOf(*parent)).ok());
  Close();
  EXPECT_EQ(CountKeys(dir_.path(), "pages", IdOf(*parent)), 0u);
  EXPECT_EQ(CountKeys(dir_.path(), "pages", IdOf(*child)), 0u);
}

TEST_F(StoreTest, ChildRefcountsSurviveReopen) {
  Open();
  auto spec = MakeSpec(1, 1, 16);
  auto ptoks = Tokens(32);
  auto parent = BuildContext(store_.get(), spec, ptoks);
  ASSERT_TRUE(parent.ok());
  auto ctoks = ptoks;
  ctoks.push_back(7);
  auto child = BuildContext(store_.get(), spec, ctoks, IdOf(*parent));
  ASSERT_TRUE(child.ok());
  EXPECT_EQ(child->shared_blocks(), 2u);  // block-aligned prefix: nothing copied
  Close();
  Open();
  EXPECT_EQ(store_->Delete(IdOf(*parent)).status().code(), StatusCode::kFailedPrecondition);
  ExpectAllPagesMatch(IdOf(*child));
}

TEST_F(StoreTest, ChildMustExtendItsParent) {
  Open();
  auto spec = MakeSpec(1, 1, 16);
  auto ptoks = Tokens(20);
  auto parent = BuildContext(store_.get(), spec, ptoks);
  ASSERT_TRUE(parent.ok());
  BuildRequest req;
  req.model = spec;
  auto wrong = Tokens(30, 77);  // not an extension
  req.tokens = wrong;
  req.parent = IdOf(*parent);
  EXPECT_EQ(store_->BeginBuild(req).status().code(), StatusCode::kInvalidArgument);
  auto longer = ptoks;
  longer.push_back(1);
  req.tokens = longer;
  req.model.set_fingerprint("other-model");
  EXPECT_EQ(store_->BeginBuild(req).status().code(), StatusCode::kInvalidArgument);
  req.model = spec;
  req.parent = ContextId::Compute("x", ptoks);
  EXPECT_EQ(store_->BeginBuild(req).status().code(), StatusCode::kNotFound);
  // Failed child builds leave no reference behind.
  EXPECT_TRUE(store_->Delete(IdOf(*parent)).ok());
}

TEST_F(StoreTest, BadInputsGetClearErrors) {
  Open();
  auto spec = MakeSpec(2, 2, 16);
  BuildRequest req;
  req.model = spec;
  auto tokens = Tokens(40);
  req.tokens = tokens;
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok());
  ContextWriter* w = start->writer.get();
  std::vector<uint8_t> buf(40 * 16 * 4);
  EXPECT_EQ(w->AppendKV(0, 0, 0, 10, DType::kF32, buf.data(), buf.data()).code(),
            StatusCode::kInvalidArgument);  // wrong dtype
  EXPECT_EQ(w->AppendKV(2, 0, 0, 10, DType::kBF16, buf.data(), buf.data()).code(),
            StatusCode::kInvalidArgument);  // bad layer
  EXPECT_EQ(w->AppendKV(0, 2, 0, 10, DType::kBF16, buf.data(), buf.data()).code(),
            StatusCode::kInvalidArgument);  // bad head
  EXPECT_EQ(w->AppendKV(0, 0, 5, 10, DType::kBF16, buf.data(), buf.data()).code(),
            StatusCode::kInvalidArgument);  // gap
  EXPECT_EQ(w->AppendKV(0, 0, 0, 41, DType::kBF16, buf.data(), buf.data()).code(),
            StatusCode::kInvalidArgument);  // past n_tokens
  ASSERT_TRUE(w->AppendKV(0, 0, 0, 40, DType::kBF16, buf.data(), buf.data()).ok());
  auto c = w->Commit();  // other heads missing
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("layer 0 kv_head 1"), std::string_view::npos);
  ASSERT_TRUE(w->Abort().ok());

  BuildRequest bad = req;
  bad.model.set_kv_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(store_->BeginBuild(bad).status().code(), StatusCode::kInvalidArgument);
  bad = req;
  bad.model.set_head_dim(0);
  EXPECT_EQ(store_->BeginBuild(bad).status().code(), StatusCode::kInvalidArgument);
  bad = req;
  bad.tokens = {};
  EXPECT_EQ(store_->BeginBuild(bad).status().code(), StatusCode::kInvalidArgument);

  ContextId unknown = ContextId::Compute("nope", tokens);
  EXPECT_EQ(store_->GetManifest(unknown).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->OpenReader(unknown).status().code(), StatusCode::kNotFound);

  auto m = BuildContext(store_.get(), spec, tokens);
  ASSERT_TRUE(m.ok());
  auto r = store_->OpenReader(IdOf(*m));
  ASSERT_TRUE(r.ok());
  PageBatch b;
  EXPECT_EQ((*r)->ReadPages(0, 0, std::vector<uint32_t>{2, 1}, &b).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->ReadPages(0, 0, std::vector<uint32_t>{3}, &b).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->ReadPages(0, 9, std::vector<uint32_t>{0}, &b).code(),
            StatusCode::kInvalidArgument);
}

// ReadPages with fill_cache false (what FetchKV with page tables uses: a
// worker fetches each page once into its own tier) reads the same bytes and
// leaves the block cache as it is; the default keeps what it read there.
TEST_F(StoreTest, ReadPagesWithoutFillingTheBlockCache) {
  Open();
  auto m = BuildContext(store_.get(), MakeSpec(2, 2, 32), Tokens(64));
  ASSERT_TRUE(m.ok());
  const ContextId id = IdOf(*m);
  const std::vector<uint32_t> blocks{0, 1, 2, 3};
  for (auto method : {PageReadMethod::kMultiGet, PageReadMethod::kIterator}) {
    SCOPED_TRACE(method == PageReadMethod::kMultiGet ? "MultiGet" : "iterator");
    StoreOptions o = TestOptions(&clock_);
    o.page_read_method = method;
    Open(o);  // an empty block cache
    auto r = store_->OpenReader(id);
    ASSERT_TRUE(r.ok());
    const uint64_t before = store_->GetStats().block_cache_usage_bytes;
    PageBatch once, cached;
    ASSERT_TRUE((*r)->ReadPages(1, 1, blocks, &once, /*fill_cache=*/false).ok());
    EXPECT_EQ(store_->GetStats().block_cache_usage_bytes, before);
    ASSERT_TRUE((*r)->ReadPages(1, 1, blocks, &cached).ok());
    EXPECT_GT(store_->GetStats().block_cache_usage_bytes, before);
    EXPECT_EQ(once.data, cached.data);
    EXPECT_EQ(once.crc32c, cached.crc32c);
  }
}

TEST_F(StoreTest, FlippedBitInStoredPageIsDataLoss) {
  Open();
  auto spec = MakeSpec(2, 2, 32);
  auto m = BuildContext(store_.get(), spec, Tokens(64));
  ASSERT_TRUE(m.ok());
  ContextId id = IdOf(*m);
  Close();
  FlipStoredPageBit(id, 1, 0, 2);
  Open();
  auto r = store_->OpenReader(id);
  ASSERT_TRUE(r.ok());
  PageBatch b;
  for (auto method : {PageReadMethod::kMultiGet, PageReadMethod::kIterator}) {
    Status s = (*r)->ReadPages(1, 0, std::vector<uint32_t>{1, 2, 3}, &b, method);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    std::string msg(s.message());
    EXPECT_NE(msg.find(id.ToHex()), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer 1 kv_head 0 block 2"), std::string::npos) << msg;
    EXPECT_EQ(b.size(), 0u);  // nothing handed out
    EXPECT_TRUE(b.data.empty());
  }
  EXPECT_TRUE((*r)->ReadPages(1, 0, std::vector<uint32_t>{1, 3}, &b).ok());
  EXPECT_TRUE((*r)->ReadPages(0, 0, std::vector<uint32_t>{2}, &b).ok());
  EXPECT_EQ(store_->Verify(id).code(), StatusCode::kDataLoss);
}

// ScanPages (the bulk path: views of verified raw payloads, no batch) gives
// the same pages, crcs and token counts as ReadPages, for every codec and
// for a child whose pages come from three owners; a bad page stops the scan
// with DATA_LOSS naming it, before it is visited; a visitor's error stops it.
TEST_F(StoreTest, ScanPagesEqualsReadPagesAndStopsAtABadPage) {
  auto expect_scan_matches = [&](const ContextId& id) {
    auto r = store_->OpenReader(id);
    ASSERT_TRUE(r.ok());
    const auto& model = (*r)->manifest().model();
    for (uint32_t l = 0; l < model.n_layers(); ++l) {
      for (uint32_t h = 0; h < model.n_kv_heads(); ++h) {
        std::vector<uint32_t> all((*r)->n_blocks());
        std::iota(all.begin(), all.end(), 0u);
        PageBatch b;
        ASSERT_TRUE((*r)->ReadPages(l, h, all, &b).ok());
        uint32_t next = 1;  // scan blocks [1, n): a run not starting at 0
        Status s = (*r)->ScanPages(
            l, h, 1, (*r)->n_blocks() - 1,
            [&](uint32_t block, uint32_t n_tokens, uint32_t crc, std::string_view raw) {
              EXPECT_EQ(block, next++);
              EXPECT_EQ(n_tokens, b.n_tokens[block]);
              EXPECT_EQ(crc, b.crc32c[block]);
              EXPECT_EQ(raw,
                        std::string_view(reinterpret_cast<const char*>(b.K(block)), raw.size()));
              EXPECT_EQ(raw.size(), 2u * n_tokens * model.head_dim() *
                                        (model.kv_dtype() == v1::DTYPE_F32 ? 4 : 2));
              return Status::OK();
            });
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_EQ(next, (*r)->n_blocks());
      }
    }
    EXPECT_EQ((*r)->ScanPages(0, 0, 1, (*r)->n_blocks(), nullptr).code(),
              StatusCode::kInvalidArgument);
  };
  for (PageCodec codec : {PageCodec::kNone, PageCodec::kZstdShuffle}) {
    StoreOptions o = TestOptions(&clock_);
    o.page_codec = {codec, 3};
    Open(o);
    auto m = BuildContext(store_.get(), MakeSpec(2, 2, 32), Tokens(90, 60 + int(codec)));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    expect_scan_matches(IdOf(*m));
    Close();
  }
  Open();
  auto spec = MakeSpec(2, 2, 16);
  auto ptoks = Tokens(100);
  auto parent = BuildContext(store_.get(), spec, ptoks);
  ASSERT_TRUE(parent.ok());
  auto ctoks = ptoks;
  auto extra = Tokens(60, 5);
  ctoks.insert(ctoks.end(), extra.begin(), extra.end());
  auto child = BuildContext(store_.get(), spec, ctoks, IdOf(*parent));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto gtoks = ctoks;
  auto more = Tokens(40, 6);
  gtoks.insert(gtoks.end(), more.begin(), more.end());
  auto grand = BuildContext(store_.get(), spec, gtoks, IdOf(*child));
  ASSERT_TRUE(grand.ok()) << grand.status().ToString();
  expect_scan_matches(IdOf(*grand));

  {  // A visitor's error ends the scan.
    auto r = store_->OpenReader(IdOf(*grand));
    ASSERT_TRUE(r.ok());
    int visits = 0;
    EXPECT_EQ((*r)->ScanPages(0, 0, 0, 5,
                              [&](uint32_t, uint32_t, uint32_t, std::string_view) {
                                return ++visits == 2 ? CancelledError("enough") : Status::OK();
                              })
                  .code(),
              StatusCode::kCancelled);
    EXPECT_EQ(visits, 2);
  }

  // A flipped bit in a stored page.
  ContextId id = IdOf(*parent);
  Close();
  FlipStoredPageBit(id, 1, 0, 2);
  Open();
  auto pr = store_->OpenReader(id);
  ASSERT_TRUE(pr.ok());
  std::vector<uint32_t> visited;
  Status s =
      (*pr)->ScanPages(1, 0, 0, 4, [&](uint32_t block, uint32_t, uint32_t, std::string_view) {
        visited.push_back(block);
        return Status::OK();
      });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(std::string(s.message()).find("layer 1 kv_head 0 block 2"), std::string::npos)
      << s.ToString();
  EXPECT_EQ(visited, (std::vector<uint32_t>{0, 1}));
}

// Pages not in the block cache are read as up to read_io_depth concurrent
// MultiGets on the I/O pool: the batch is the same as a serial read, for a
// child (keys from two owners, not sorted overall) too, and of two bad pages
// the first is reported whichever I/O task finishes first.
TEST_F(StoreTest, ConcurrentPageReadsMatchSerialReadsAndReportTheFirstBadPage) {
  Open();
  auto spec = MakeSpec(2, 2, 32);
  auto parent = BuildContext(store_.get(), spec, Tokens(300, 5));
  ASSERT_TRUE(parent.ok());
  auto tokens = Tokens(300, 5);
  auto extra = Tokens(250, 6);
  tokens.insert(tokens.end(), extra.begin(), extra.end());
  auto child = BuildContext(store_.get(), spec, tokens, IdOf(*parent));
  ASSERT_TRUE(child.ok());
  const ContextId id = IdOf(*child);
  Close();
  {
    // Two bad pages of (1, 1), flushed into an SST so that they are read
    // from the file by the I/O pool, not found in a memtable.
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    for (uint32_t block : {22u, 29u}) {
      std::string key = PageKey(id, 1, 1, block), value;
      ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("pages"), key, &value).ok());
      value[value.size() - 3] ^= 0x01;
      ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("pages"), key, value).ok());
    }
    ASSERT_TRUE(raw->db->Flush(rocksdb::FlushOptions(), raw->cf("pages")).ok());
  }
  StoreOptions serial = TestOptions(&clock_);
  serial.block_cache_bytes = 0;  // every page is a miss
  serial.read_io_depth = 1;
  StoreOptions concurrent = serial;
  concurrent.read_io_depth = 8;
  concurrent.io_threads = 3;  // fewer threads than parts: tasks queue
  std::vector<PageBatch> got(2);
  for (int pass = 0; pass < 2; ++pass) {
    Open(pass == 0 ? serial : concurrent);
    auto r = store_->OpenReader(id);
    ASSERT_TRUE(r.ok());
    const auto all = AllBlocks((*r)->n_blocks());
    ASSERT_TRUE((*r)->ReadPages(0, 1, all, &got[pass]).ok());
    for (size_t i = 0; i < got[pass].size(); ++i) {
      ASSERT_TRUE(PageMatches(got[pass], i, 0, 1)) << "pass " << pass << " block " << i;
    }
    PageBatch bad;
    for (int repeat = 0; repeat < 5; ++repeat) {
      Status s = (*r)->ReadPages(1, 1, all, &bad);
      ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
      EXPECT_NE(s.message().find("layer 1 kv_head 1 block 22"), std::string_view::npos)
          << s.ToString();
      EXPECT_EQ(bad.size(), 0u);
    }
    std::vector<uint32_t> good;
    for (uint32_t b : all) {
      if (b != 22 && b != 29) good.push_back(b);
    }
    ASSERT_TRUE((*r)->ReadPages(1, 1, good, &bad).ok());
    for (size_t i = 0; i < bad.size(); ++i) ASSERT_TRUE(PageMatches(bad, i, 1, 1));
  }
  EXPECT_EQ(got[0].blocks, got[1].blocks);
  EXPECT_EQ(got[0].data, got[1].data);
  EXPECT_EQ(got[0].stored_bytes, got[1].stored_bytes);
}

TEST_F(StoreTest, ReadIoOptionsAreValidated) {
  for (auto [depth, threads, field] :
       {std::tuple<uint32_t, uint32_t, const char*>{0, 4, "read_io_depth"},
        {2000, 4, "read_io_depth"},
        {8, 0, "io_threads"}}) {
    StoreOptions o = TestOptions(&clock_);
    o.read_io_depth = depth;
    o.io_threads = threads;
    auto s = Store::Open(o, dir_.Sub("bad"));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(field), std::string_view::npos) << s.status().ToString();
  }
}

TEST_F(StoreTest, ArtifactsRoundTripChunkedAndVerified) {
  StoreOptions o = TestOptions(&clock_);
  Open(o);
  auto spec = MakeSpec(2, 2, 16);
  auto tokens = Tokens(32);
  BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok());
  std::string big(2'500'000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 % 251);
  ContextWriter* w = start->writer.get();
  ASSERT_TRUE(w->PutArtifact(1, 1, 3, "csa/tables", big).ok());
  ASSERT_TRUE(w->PutArtifact(kWholeContext, kWholeContext, 9, "meta", "hello").ok());
  EXPECT_EQ(w->PutArtifact(1, 1, 3, "dup", "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w->PutArtifact(5, 0, 3, "bad", "x").code(), StatusCode::kInvalidArgument);
  v1::IndexParams ip;
  ip.set_method("csa");
  (*ip.mutable_params())["m"] = "8";
  w->AddIndexParams(ip);
  ASSERT_TRUE(WriteKv(w, 0, 32).ok());
  auto m = w->Commit();
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->artifacts_size(), 2);
  EXPECT_EQ(m->artifacts(0).n_chunks(), 3u);  // 1 MiB chunks
  EXPECT_EQ(m->index_params(0).method(), "csa");
  auto r = store_->OpenReader(IdOf(*m));
  ASSERT_TRUE(r.ok());
  auto a = (*r)->ReadArtifact(1, 1, 3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, big);
  EXPECT_EQ(*(*r)->ReadArtifact(kWholeContext, kWholeContext, 9), "hello");
  EXPECT_EQ((*r)->ReadArtifact(0, 0, 3).status().code(), StatusCode::kNotFound);
  r->reset();
  Close();
  {
    auto raw = OpenRaw(dir_.path());
    std::string key = ArtifactKey(IdOf(*m), 1, 1, 3, 1), v;
    ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("index"), key, &v).ok());
    EXPECT_EQ(v.size(), 1u << 20);
    v[10] ^= 1;
    ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("index"), key, v).ok());
  }
  Open(o);
  auto r2 = store_->OpenReader(IdOf(*m));
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ((*r2)->ReadArtifact(1, 1, 3).status().code(), StatusCode::kDataLoss);
}

TEST_F(StoreTest, WriterMemoryIsBoundedFor32KTokens) {
  StoreOptions o = TestOptions(&clock_);
  o.ingest_pages = false;  // the memtable path: pages go through write batches
  o.write_batch_bytes = 256 << 10;
  o.max_writer_buffer_bytes = 1 << 20;
  o.page_codec.codec = PageCodec::kNone;
  Open(o);
  auto spec = MakeSpec(2, 2, 16);
  auto tokens = Tokens(32768);
  BuildRequest req;
  req.model = spec;
  req.tokens = tokens;
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  ContextWriter* w = start->writer.get();
  // Layer-major chunks of 1000 tokens ([n][heads][d] layout), like a prefill.
  const uint32_t chunk = 1000;
  std::vector<uint16_t> k(chunk * 2 * 16), v(chunk * 2 * 16);
  for (uint64_t t = 0; t < tokens.size(); t += chunk) {
    uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(chunk, tokens.size() - t));
    for (uint32_t l = 0; l < 2; ++l) {
      for (size_t i = 0; i < size_t{n} * 32; ++i) {
        k[i] = static_cast<uint16_t>(t + i + l);
        v[i] = static_cast<uint16_t>(t * 3 + i);
      }
      ASSERT_TRUE(w->AppendLayerKV(l, t, n, DType::kBF16, k.data(), v.data()).ok());
    }
  }
  auto m = w->Commit();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const uint64_t raw = m->raw_kv_bytes();
  EXPECT_EQ(raw, 32768ull * 2 * 2 * 2 * 16 * 2);   // 8 MiB
  const size_t staging = 2 * 2 * 2 * 16 * 16 * 2;  // one page per (layer, head)
  // One batch may overshoot by one value (page or key) before it is handed off.
  EXPECT_LE(w->peak_buffered_bytes(), staging + o.write_batch_bytes + 4096);
  EXPECT_LE(w->peak_buffered_bytes(), o.max_writer_buffer_bytes);
  EXPECT_GT(w->peak_buffered_bytes(), o.write_batch_bytes / 2);  // batches did fill up
  EXPECT_LT(w->peak_buffered_bytes() * 8, raw);
  EXPECT_EQ(w->buffered_bytes(), 0u);
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
}

TEST_F(StoreTest, IngestWriterMemoryIsBoundedFor32KTokens) {
  StoreOptions o = TestOptions(&clock_);
  o.ingest_pages = true;
  o.ingest_file_pages = 512;  // SSTs closed every 512 pages
  o.write_batch_bytes = 64 << 10;
  o.max_writer_buffer_bytes = 2 << 20;
  o.page_codec.codec = PageCodec::kNone;
  Open(o);
  auto tokens = Tokens(32768);
  BuildRequest req;
  req.model = MakeSpec(2, 2, 64);  // 32 MiB of KV
  req.tokens = tokens;
  auto start = store_->BeginBuild(req);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  ContextWriter* w = start->writer.get();
  const uint32_t chunk = 1000;
  std::vector<uint16_t> k(chunk * 2 * 64, 1), v(chunk * 2 * 64, 2);
  for (uint64_t t = 0; t < tokens.size(); t += chunk) {
    uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(chunk, tokens.size() - t));
    for (uint32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(w->AppendLayerKV(l, t, n, DType::kBF16, k.data(), v.data()).ok());
    }
  }
  auto m = w->Commit();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  // Per (layer, head): one partial page + one open SST (its 16 KiB block and
  // 256 KiB write buffers) and its index (512 pages).
  const size_t per_head = 2 * 16 * 64 * 2 + (16 << 10) + (256 << 10) + 512 * 48;
  EXPECT_LE(w->peak_buffered_bytes(), 4 * per_head + 4096);
  EXPECT_GT(w->peak_buffered_bytes(), 4 * 512 * 48 / 2);  // SST indexes did fill up
  EXPECT_LT(w->peak_buffered_bytes() * 8, m->raw_kv_bytes());
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
}

TEST_F(StoreTest, HeadMajorLayerChunksStoreWhatPerHeadAppendsStore) {
  StoreOptions o = TestOptions(&clock_);
  o.page_codec.codec = PageCodec::kNone;
  Open(o);
  const uint32_t H = 3, d = 8, L = 2;
  // Context a: AppendKV per head. Context b: AppendLayerKVStrided with an
  // ingest chunk's [heads][n][d] layout (strides of a head and a token).
  std::vector<ContextId> ids;
  for (int mode = 0; mode < 2; ++mode) {
    auto tokens = Tokens(70, 500 + mode);  // distinct tokens: two contexts
    BuildRequest req;
    req.model = MakeSpec(L, H, d);
    req.tokens = tokens;
    auto start = store_->BeginBuild(req);
    ASSERT_TRUE(start.ok()) << start.status().ToString();
    ContextWriter* w = start->writer.get();
    const uint64_t n_all = tokens.size();
    for (uint64_t t0 = 0; t0 < n_all; t0 += 33) {
      const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(33, n_all - t0));
      for (uint32_t l = 0; l < L; ++l) {
        std::vector<uint16_t> k(size_t{H} * n * d), v(k.size());
        for (uint32_t h = 0; h < H; ++h) {
          for (uint32_t t = 0; t < n; ++t) {
            for (uint32_t j = 0; j < d; ++j) {
              const size_t at = (size_t{h} * n + t) * d + j;
              k[at] = static_cast<uint16_t>(0x3f00 + ((l * 7 + h * 5 + t0 + t + j) % 97));
              v[at] = static_cast<uint16_t>(0x4000 + ((l * 3 + h * 11 + t0 + t * 2 + j) % 89));
            }
          }
        }
        if (mode == 0) {
          for (uint32_t h = 0; h < H; ++h) {
            ASSERT_TRUE(w->AppendKV(l, h, t0, n, DType::kBF16, k.data() + size_t{h} * n * d,
                                    v.data() + size_t{h} * n * d)
                            .ok());
          }
        } else {
          ASSERT_TRUE(w->AppendLayerKVStrided(l, t0, n, DType::kBF16, k.data(), v.data(),
                                              size_t{n} * d * 2, size_t{d} * 2)
                          .ok());
        }
      }
    }
    auto m = w->Commit();
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ids.push_back(IdOf(*m));
  }
  auto a = store_->OpenReader(ids[0]);
  auto b = store_->OpenReader(ids[1]);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)->n_blocks(), (*b)->n_blocks());
  for (uint32_t l = 0; l < L; ++l) {
    for (uint32_t h = 0; h < H; ++h) {
      PageBatch pa, pb;
      ASSERT_TRUE((*a)->ReadPages(l, h, AllBlocks((*a)->n_blocks()), &pa).ok());
      ASSERT_TRUE((*b)->ReadPages(l, h, AllBlocks((*b)->n_blocks()), &pb).ok());
      EXPECT_EQ(pa.data, pb.data) << "layer " << l << " head " << h;
      EXPECT_EQ(pa.crc32c, pb.crc32c);
    }
  }
}

TEST_F(StoreTest, TooSmallWriterBudgetIsRejected) {
  StoreOptions o = TestOptions(&clock_);
  o.write_batch_bytes = 64 << 10;
  o.max_writer_buffer_bytes = 200 << 10;
  Open(o);
  BuildRequest req;
  req.model = MakeSpec(32, 8, 128);  // 2 MiB of partial pages
  auto tokens = Tokens(10);
  req.tokens = tokens;
  auto s = store_->BeginBuild(req);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("max_writer_buffer_bytes"), std::string_view::npos);
}

TEST_F(StoreTest, CapacityEvictionIsLruAndSkipsPinned) {
  Open();
  auto spec = MakeSpec(1, 2, 32);
  std::vector<ContextId> ids;
  for (uint32_t i = 0; i < 4; ++i) {
    auto m = BuildContext(store_.get(), spec, Tokens(256, 100 + i), std::nullopt, 0, i == 0);
    ASSERT_TRUE(m.ok());
    ids.push_back(IdOf(*m));
    clock_.Advance(1000);
  }
  // Touch ids[1] so that ids[2] becomes the least recently used unpinned.
  {
    auto r = store_->OpenReader(ids[1]);
    ASSERT_TRUE(r.ok());
    PageBatch b;
    ASSERT_TRUE((*r)->ReadPages(0, 0, std::vector<uint32_t>{0}, &b).ok());
  }
  uint64_t used = store_->GetStats().stored_bytes;
  uint64_t per = used / 4;
  Close();
  StoreOptions o = TestOptions(&clock_);
  // 4 contexts over a budget of 3.5 -> above high (0.95); low 0.6 -> keep 2.
  o.eviction.capacity_bytes = per * 7 / 2;
  o.eviction.high_watermark = 0.95;
  o.eviction.low_watermark = 0.6;
  Open(o);
  auto rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  // LRU order among unpinned: ids[2] (t=2000), ids[3] (t=3000), ids[1] touched later.
  EXPECT_EQ(rep->deleted, (std::vector<ContextId>{ids[2], ids[3]}));
  EXPECT_TRUE(store_->GetManifest(ids[0]).ok());  // pinned, oldest
  EXPECT_TRUE(store_->GetManifest(ids[1]).ok());
  EXPECT_EQ(store_->GetManifest(ids[2]).status().code(), StatusCode::kNotFound);
  EXPECT_LE(store_->GetStats().stored_bytes, o.eviction.capacity_bytes * 0.6);
}

TEST_F(StoreTest, CommitOverHighWatermarkEvicts) {
  StoreOptions o = TestOptions(&clock_);
  Open(o);
  auto spec = MakeSpec(1, 1, 32);
  auto first = BuildContext(store_.get(), spec, Tokens(512, 1));
  ASSERT_TRUE(first.ok());
  uint64_t per = first->stored_bytes();
  Close();
  o.eviction.capacity_bytes = per * 3 / 2;
  Open(o);
  clock_.Advance(10);
  auto second = BuildContext(store_.get(), spec, Tokens(512, 2));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(store_->GetManifest(IdOf(*first)).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store_->GetManifest(IdOf(*second)).ok());
}

TEST_F(StoreTest, TtlExpiryUsesTheClock) {
  Open();
  auto spec = MakeSpec(1, 1, 16);
  auto a = BuildContext(store_.get(), spec, Tokens(20, 1), std::nullopt, /*ttl_ms=*/60'000);
  auto b = BuildContext(store_.get(), spec, Tokens(20, 2), std::nullopt, 0);
  auto c = BuildContext(store_.get(), spec, Tokens(20, 3), std::nullopt, 60'000, /*pinned=*/true);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->expires_at_ms(), clock_.NowMillis() + 60'000);
  auto rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->deleted.empty());
  clock_.Advance(60'001);
  rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->deleted, std::vector<ContextId>{IdOf(*a)});
  EXPECT_TRUE(store_->GetManifest(IdOf(*b)).ok());
  EXPECT_TRUE(store_->GetManifest(IdOf(*c)).ok());  // pinned
  ASSERT_TRUE(store_->SetPinned(IdOf(*c), false).ok());
  rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->deleted, std::vector<ContextId>{IdOf(*c)});
  ASSERT_TRUE(store_->SetExpiry(IdOf(*b), clock_.NowMillis() - 1).ok());
  rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->deleted, std::vector<ContextId>{IdOf(*b)});
}

// SetPinned and SetExpiry share one manifest update: each changes only its
// field, stamps the access time and persists synchronously (survives reopen
// without FlushAccessTimes); unknown ids are NotFound.
TEST_F(StoreTest, SetPinnedAndSetExpiryPersistTheirFieldAndTheAccessTime) {
  Open();
  auto m = BuildContext(store_.get(), MakeSpec(1, 1, 16), Tokens(16), std::nullopt, 60'000);
  ASSERT_TRUE(m.ok());
  const ContextId id = IdOf(*m);
  clock_.Advance(5000);
  {
    auto r = store_->OpenReader(id);  // touches the context
    ASSERT_TRUE(r.ok());
  }
  const int64_t touched = clock_.NowMillis();
  const int64_t expires = touched + 1'000'000;
  ASSERT_TRUE(store_->SetPinned(id, true).ok());
  EXPECT_EQ(store_->GetManifest(id)->expires_at_ms(), m->expires_at_ms());
  ASSERT_TRUE(store_->SetExpiry(id, expires).ok());
  EXPECT_TRUE(store_->GetManifest(id)->pinned());
  Close();
  Open();
  auto after = store_->GetManifest(id);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->pinned());
  EXPECT_EQ(after->expires_at_ms(), expires);
  EXPECT_EQ(after->last_access_ms(), touched);
  const ContextId unknown = ContextId::Compute("fp-A", Tokens(3));
  EXPECT_EQ(store_->SetPinned(unknown, true).code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->SetExpiry(unknown, expires).code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, LeasedContextIsDeletedWhenTheLastLeaseDrops) {
  Open();
  auto spec = MakeSpec(1, 2, 16);
  auto m = BuildContext(store_.get(), spec, Tokens(64), std::nullopt, 1000);
  ASSERT_TRUE(m.ok());
  ContextId id = IdOf(*m);
  auto reader = store_->OpenReader(id);
  ASSERT_TRUE(reader.ok());
  auto lease = store_->AcquireLease(id);
  ASSERT_TRUE(lease.ok());
  clock_.Advance(2000);
  auto rep = store_->RunEvictionPass();
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->deleted.empty());
  EXPECT_EQ(rep->deferred, std::vector<ContextId>{id});
  // Marked: no new sessions, but the open one still reads.
  EXPECT_EQ(store_->GetManifest(id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->OpenReader(id).status().code(), StatusCode::kNotFound);
  PageBatch b;
  ASSERT_TRUE((*reader)->ReadPages(0, 1, std::vector<uint32_t>{0, 3}, &b).ok());
  EXPECT_TRUE(testing::PageMatches(b, 1, 0, 1));
  reader->reset();
  lease->Release();  // last lease: deleted now
  Close();
  EXPECT_EQ(CountKeys(dir_.path(), "pages", id), 0u);
  EXPECT_EQ(CountKeys(dir_.path(), "meta", id), 0u);
}

TEST_F(StoreTest, ExplicitDeleteOfLeasedContextIsDeferred) {
  Open();
  auto m = BuildContext(store_.get(), MakeSpec(1, 1, 16), Tokens(16));
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(store_->SetPinned(IdOf(*m), true).ok());
  EXPECT_EQ(store_->Delete(IdOf(*m)).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->SetPinned(IdOf(*m), false).ok());
  {
    auto lease = store_->AcquireLease(IdOf(*m));
    ASSERT_TRUE(lease.ok());
    auto deferred = store_->Delete(IdOf(*m));
    ASSERT_TRUE(deferred.ok());
    EXPECT_TRUE(*deferred);
  }
  EXPECT_EQ(store_->GetManifest(IdOf(*m)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->Delete(IdOf(*m)).status().code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, EvictionReclaimsDiskSpace) {
  StoreOptions o = TestOptions(&clock_);
  o.page_codec.codec = PageCodec::kNone;  // incompressible size, easy to reason about
  Open(o);
  auto spec = MakeSpec(4, 4, 64);
  auto keep = BuildContext(store_.get(), spec, Tokens(256, 1));
  auto big = BuildContext(store_.get(), spec, Tokens(4096, 2));  // 16 MiB raw
  ASSERT_TRUE(keep.ok() && big.ok());
  const uint64_t before = DirBytes(dir_.path());
  ASSERT_GT(before, big->stored_bytes());
  auto deferred = store_->Delete(IdOf(*big));
  ASSERT_TRUE(deferred.ok());
  EXPECT_FALSE(*deferred);
  const uint64_t after = DirBytes(dir_.path());
  EXPECT_LT(after + big->stored_bytes() * 8 / 10, before)
      << "before " << before << " after " << after << " context " << big->stored_bytes();
  ExpectAllPagesMatch(IdOf(*keep));
}

TEST_F(StoreTest, LastAccessIsPersistedLazily) {
  Open();
  auto m = BuildContext(store_.get(), MakeSpec(1, 1, 16), Tokens(16));
  ASSERT_TRUE(m.ok());
  clock_.Advance(5000);
  {
    auto r = store_->OpenReader(IdOf(*m));
    ASSERT_TRUE(r.ok());
  }
  const int64_t touched = clock_.NowMillis();
  EXPECT_EQ(store_->GetManifest(IdOf(*m))->last_access_ms(), touched);
  ASSERT_TRUE(store_->FlushAccessTimes().ok());
  Close();
  Open();
  EXPECT_EQ(store_->GetManifest(IdOf(*m))->last_access_ms(), touched);
}

TEST_F(StoreTest, NewerFormatVersionIsRefused) {
  Open();
  Close();
  {
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    std::string v = {static_cast<char>(kFormatVersion + 1), 0, 0, 0};
    ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("meta"), FormatVersionKey(), v).ok());
  }
  auto s = Store::Open(TestOptions(&clock_), dir_.path());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("newer than this build supports"), std::string_view::npos)
      << s.status().ToString();
}

TEST_F(StoreTest, IngestPathForPagesWorksToo) {
  StoreOptions o = TestOptions(&clock_);
  o.ingest_pages = true;
  o.ingest_file_pages = 8;  // several files per (layer, head)
  o.write_batch_bytes = 64 << 10;
  Open(o);
  auto m = BuildContext(store_.get(), MakeSpec(2, 2, 64), Tokens(300));
  ASSERT_TRUE(m.ok());
  ExpectAllPagesMatch(IdOf(*m));
  Close();
  Open(o);
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
}

TEST_F(StoreTest, MemtablePathForPagesWorksToo) {
  StoreOptions o = TestOptions(&clock_);
  o.ingest_pages = false;
  o.write_batch_bytes = 64 << 10;
  Open(o);
  auto m = BuildContext(store_.get(), MakeSpec(2, 2, 64), Tokens(300));
  ASSERT_TRUE(m.ok());
  ExpectAllPagesMatch(IdOf(*m));
  Close();
  Open(o);
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
}

TEST_F(StoreTest, BlobFilesModeWorksToo) {
  StoreOptions o = TestOptions(&clock_);
  o.enable_blob_files = true;
  o.blob_cache_bytes = 1 << 20;
  Open(o);
  auto m = BuildContext(store_.get(), MakeSpec(2, 2, 64), Tokens(300));
  ASSERT_TRUE(m.ok());
  ExpectAllPagesMatch(IdOf(*m));
  EXPECT_TRUE(store_->Verify(IdOf(*m)).ok());
}

// ---- Issue #19 findings 8 and 9: quarantine instead of delete / no start --

// Builds a context named `name` (the name lets a test find its manifest in
// an SST file).
StatusOr<v1::ContextManifest> BuildNamed(Store* store, const std::vector<uint32_t>& tokens,
                                         const std::string& name) {
  BuildRequest req;
  req.model = MakeSpec(1, 2, 16);
  req.tokens = tokens;
  req.name = name;
  ASSIGN_OR_RETURN(BuildStart start, store->BeginBuild(req));
  RETURN_IF_ERROR(WriteKv(start.writer.get(), 0, tokens.size()));
  return start.writer->Commit();
}

// Rewrites the stored manifest value of `id` through RocksDB (so RocksDB's
// own block checksums stay valid) with edit(value).
void EditManifestValue(const std::string& path, const ContextId& id,
                       const std::function<void(std::string*)>& edit) {
  auto raw = OpenRaw(path);
  ASSERT_NE(raw, nullptr);
  std::string v;
  ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("meta"), ManifestKey(id), &v).ok());
  edit(&v);
  ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("meta"), ManifestKey(id), v).ok());
}

// Flips one byte of the first file of column family `cf` whose key range
// starts with `id`, at the first occurrence of `needle` in it (or at byte
// 32 if `needle` is empty): a RocksDB block checksum mismatch, not a
// RocksDB write.
void FlipByteInSst(const std::string& path, const std::string& cf, const ContextId& id,
                   const std::string& needle) {
  std::string file;
  {
    auto raw = OpenRaw(path);
    ASSERT_NE(raw, nullptr);
    for (const auto& c : raw->names) {
      if (c == cf) {
        ASSERT_TRUE(raw->db->Flush(rocksdb::FlushOptions(), raw->cf(c)).ok());
      }
    }
    std::vector<rocksdb::LiveFileMetaData> files;
    raw->db->GetLiveFilesMetaData(&files);
    for (const auto& f : files) {
      if (f.column_family_name != cf) continue;
      // meta keys: 'M' | id; data keys: id | ...
      std::string_view lo(f.smallestkey), hi(f.largestkey);
      std::string want = cf == "meta" ? ManifestKey(id) : std::string(id.AsBytes());
      if (lo.substr(0, want.size()) <= want && want <= hi.substr(0, want.size())) {
        file = f.db_path + f.name;
        break;
      }
    }
  }
  ASSERT_FALSE(file.empty()) << "no " << cf << " file holds " << id.ToHex();
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  size_t at = needle.empty() ? 32 : bytes.find(needle);
  ASSERT_NE(at, std::string::npos) << needle << " not in " << file;
  bytes[at] ^= 0x20;
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

bool HasManifest(const std::string& path, const ContextId& id) {
  auto raw = OpenRaw(path);
  EXPECT_NE(raw, nullptr);
  std::string v;
  return raw && raw->db->Get(rocksdb::ReadOptions(), raw->cf("meta"), ManifestKey(id), &v).ok();
}

// Checks that `id` is quarantined: not served, listed with a reason
// containing `why`, and its data still on disk after a reopen.
void ExpectQuarantined(Store* store, const ContextId& id, const std::string& why) {
  EXPECT_EQ(store->GetManifest(id).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(store->OpenReader(id).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(store->AcquireLease(id).status().code(), StatusCode::kDataLoss);
  for (const auto& m : store->ListContexts()) EXPECT_NE(IdOf(m), id);
  bool listed = false;
  for (const auto& m : store->ListQuarantined()) {
    if (IdOf(m) != id) continue;
    listed = true;
    EXPECT_EQ(m.state(), v1::CONTEXT_STATE_FAILED);
    EXPECT_NE(m.error().find(why), std::string::npos) << m.error();
  }
  EXPECT_TRUE(listed);
}

TEST_F(StoreTest, ManifestCorruptionQuarantines) {
  Open();
  auto a = BuildNamed(store_.get(), Tokens(40, 1), "alpha");
  auto b = BuildNamed(store_.get(), Tokens(40, 2), "bravo");
  ASSERT_TRUE(a.ok() && b.ok());
  Close();
  // One flipped byte in the serialized body: same length, still parses.
  EditManifestValue(dir_.path(), IdOf(*a), [](std::string* v) {
    ASSERT_TRUE(IsFramedManifest(*v));
    size_t at = v->find("alpha");
    ASSERT_NE(at, std::string::npos);
    (*v)[at] ^= 0x01;
  });
  for (int round = 0; round < 2; ++round) {  // kept across opens
    Open();
    ExpectQuarantined(store_.get(), IdOf(*a), "crc32c mismatch");
    EXPECT_EQ(store_->GetStats().quarantined_contexts, 1u);
    EXPECT_TRUE(store_->Verify(IdOf(*b)).ok());
    Close();
    EXPECT_GT(CountKeys(dir_.path(), "pages", IdOf(*a)), 0u) << "round " << round;
    EXPECT_TRUE(HasManifest(dir_.path(), IdOf(*a)));
  }
  // An explicit delete is the one way out.
  Open();
  ASSERT_TRUE(store_->Delete(IdOf(*a)).ok());
  EXPECT_EQ(store_->GetManifest(IdOf(*a)).status().code(), StatusCode::kNotFound);
  Close();
  EXPECT_EQ(CountKeys(dir_.path(), "pages", IdOf(*a)), 0u);
  EXPECT_FALSE(HasManifest(dir_.path(), IdOf(*a)));
}

TEST_F(StoreTest, UnparseableManifestQuarantines) {
  Open();
  auto a = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(40, 1));
  auto b = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(40, 2));
  ASSERT_TRUE(a.ok() && b.ok());
  Close();
  // Framed with a valid crc, body not a protobuf.
  EditManifestValue(dir_.path(), IdOf(*a), [](std::string* v) {
    std::string body = "\x0a\xff\xff\xff\xff\x0f";
    *v = EncodeManifest(v1::ContextManifest());
    std::string framed = v->substr(0, 2);
    uint32_t crc = crc32c::Value(body);
    for (int i = 0; i < 4; ++i) framed.push_back(static_cast<char>(crc >> (8 * i)));
    *v = framed + body;
  });
  // Unframed (a pre-framing value) that does not parse.
  EditManifestValue(dir_.path(), IdOf(*b), [](std::string* v) { *v = "\x0a\xff\xff"; });
  Open();
  ExpectQuarantined(store_.get(), IdOf(*a), "does not parse");
  ExpectQuarantined(store_.get(), IdOf(*b), "does not parse");
  Close();
  for (const auto& m : {*a, *b}) {
    EXPECT_GT(CountKeys(dir_.path(), "pages", IdOf(m)), 0u);
    EXPECT_TRUE(HasManifest(dir_.path(), IdOf(m)));
  }
}

TEST_F(StoreTest, UnframedManifestsFromOlderBuildsStillOpen) {
  Open();
  auto a = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(40, 1));
  ASSERT_TRUE(a.ok());
  Close();
  EditManifestValue(dir_.path(), IdOf(*a), [](std::string* v) {
    v1::ContextManifest m;
    ASSERT_TRUE(DecodeManifest(*v, &m).ok());
    *v = m.SerializeAsString();  // what a89af71 and earlier wrote
    ASSERT_FALSE(IsFramedManifest(*v));
  });
  {
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    std::string v1 = {1, 0, 0, 0};  // and their format_version
    ASSERT_TRUE(
        raw->db->Put(rocksdb::WriteOptions(), raw->cf("meta"), FormatVersionKey(), v1).ok());
  }
  Open();
  auto m = store_->GetManifest(IdOf(*a));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->state(), v1::CONTEXT_STATE_READY);
  ExpectAllPagesMatch(IdOf(*a));
  Close();
  // Upgraded in place: an older build now refuses the dir instead of taking
  // framed manifests for garbage.
  auto raw = OpenRaw(dir_.path());
  ASSERT_NE(raw, nullptr);
  std::string v;
  ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("meta"), FormatVersionKey(), &v).ok());
  EXPECT_EQ(v, std::string({static_cast<char>(kFormatVersion), 0, 0, 0}));
  EXPECT_EQ(kFormatVersion, 2u);
}

TEST_F(StoreTest, CorruptMetaBlockDegradesStartInsteadOfFailingIt) {
  Open();
  auto a = BuildNamed(store_.get(), Tokens(40, 1), "alpha-in-a-bad-block");
  auto b = BuildNamed(store_.get(), Tokens(40, 2), "bravo");
  ASSERT_TRUE(a.ok() && b.ok());
  Close();
  FlipByteInSst(dir_.path(), "meta", IdOf(*a), "alpha-in-a-bad-block");
  Open();  // asserts that Open succeeds
  ExpectQuarantined(store_.get(), IdOf(*a), "");
  // b shares the bad block; its own crc32c vouches for its manifest.
  ASSERT_TRUE(store_->GetManifest(IdOf(*b)).ok());
  ExpectAllPagesMatch(IdOf(*b));
  Close();
  EXPECT_GT(CountKeys(dir_.path(), "pages", IdOf(*a)), 0u);
  EXPECT_GT(CountKeys(dir_.path(), "tokens", IdOf(*a)), 0u);
}

TEST_F(StoreTest, CorruptTokensBlockDegradesStartInsteadOfFailingIt) {
  Open();
  auto a = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(4000, 1));
  auto b = BuildContext(store_.get(), MakeSpec(1, 2, 16), Tokens(4000, 2));
  ASSERT_TRUE(a.ok() && b.ok());
  Close();
  FlipByteInSst(dir_.path(), "tokens", IdOf(*a), "");
  Open();
  ExpectQuarantined(store_.get(), IdOf(*a), "tokens column family");
  ExpectAllPagesMatch(IdOf(*b));
  EXPECT_TRUE(store_->Verify(IdOf(*b)).ok());
  Close();
  EXPECT_GT(CountKeys(dir_.path(), "pages", IdOf(*a)), 0u);
  EXPECT_TRUE(HasManifest(dir_.path(), IdOf(*a)));
}

TEST_F(StoreTest, LockErrorIsRecognizedPrecisely) {
  Open();
  // The real error: a second Store on an open data dir.
  auto second = Store::Open(TestOptions(&clock_), dir_.path());
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(IsDataDirLockedError(second.status().message())) << second.status().ToString();
  // RocksDB's other-process wording.
  EXPECT_TRUE(IsDataDirLockedError(
      "open RocksDB at /d: IO error: While lock file: /d/LOCK: Resource temporarily unavailable"));
  // Errors that merely contain "lock".
  EXPECT_FALSE(IsDataDirLockedError(
      "open RocksDB at /d: Corruption: block checksum mismatch: stored = 1, computed = 2, type = "
      "1 in /d/000012.sst offset 0 size 4001"));
  EXPECT_FALSE(IsDataDirLockedError("Corruption: bad block contents in /d/MANIFEST-000005"));
  EXPECT_FALSE(IsDataDirLockedError("IO error: No such file or directory: /d/LOCK"));
}

TEST_F(StoreTest, FsckFindsAFlippedPageAndQuarantinesItWithItsChild) {
  Open();
  auto spec = MakeSpec(2, 2, 32);
  auto bad = BuildContext(store_.get(), spec, Tokens(64, 1));
  auto good = BuildContext(store_.get(), spec, Tokens(64, 2));
  ASSERT_TRUE(bad.ok() && good.ok());
  auto child_tokens = Tokens(64, 1);
  auto more = Tokens(40, 9);
  child_tokens.insert(child_tokens.end(), more.begin(), more.end());
  auto child = BuildContext(store_.get(), spec, child_tokens, IdOf(*bad));
  ASSERT_TRUE(child.ok());
  Close();
  {
    auto raw = OpenRaw(dir_.path());
    ASSERT_NE(raw, nullptr);
    std::string key = PageKey(IdOf(*bad), 0, 1, 3), value;
    ASSERT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("pages"), key, &value).ok());
    value[value.size() - 7] ^= 0x01;
    ASSERT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("pages"), key, value).ok());
  }
  Open();
  auto report = Fsck(store_.get(), FsckOptions());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->clean());
  EXPECT_EQ(report->ok, 1u);
  EXPECT_EQ(report->corrupt, 2u);  // the context and its child (it reads the bad page too)
  for (const auto& e : report->entries) {
    if (e.id == IdOf(*good)) {
      EXPECT_EQ(e.result, FsckEntry::Result::kOk);
    } else {
      EXPECT_EQ(e.result, FsckEntry::Result::kCorrupt);
      EXPECT_NE(e.detail.find("layer 0 kv_head 1 block 3"), std::string::npos) << e.detail;
    }
  }
  EXPECT_TRUE(store_->GetManifest(IdOf(*bad)).ok());  // report only

  FsckOptions q;
  q.quarantine = true;
  report = Fsck(store_.get(), q);
  ASSERT_TRUE(report.ok());
  Close();
  Open();  // persisted
  ExpectQuarantined(store_.get(), IdOf(*bad), "fsck: ");
  ExpectQuarantined(store_.get(), IdOf(*child), "");
  EXPECT_TRUE(store_->Verify(IdOf(*good)).ok());
  report = Fsck(store_.get(), FsckOptions());
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->ok, 1u);
  EXPECT_EQ(report->quarantined, 2u);
  // The parent cannot go before its (quarantined) child.
  EXPECT_EQ(store_->Delete(IdOf(*bad)).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->Delete(IdOf(*child)).ok());
  ASSERT_TRUE(store_->Delete(IdOf(*bad)).ok());
  EXPECT_EQ(store_->ListQuarantined().size(), 0u);
}

}  // namespace
}  // namespace ctxcache::storage
