// `ctxcache fsck` on a real data dir: a context with one flipped byte in a
// page value (rewritten through RocksDB, so only the page's own crc32c can
// tell) is reported and, with --quarantine, quarantined; a locked data dir
// is refused clearly.
#include <gtest/gtest.h>

#include <string>

#include "storage/fsck.h"
#include "tests/service/server_process.h"
#include "tests/storage/test_util.h"

namespace ctxcache {
namespace {

using storage::ContextId;
using storage::Store;
using storage::testing::BuildContext;
using storage::testing::MakeSpec;
using storage::testing::OpenRaw;
using storage::testing::Tokens;
using testing::ServerProcess;
using testing::TempDir;

std::string Cli() { return testing::BinDir() + "/ctxcache"; }

storage::StoreOptions Options() {
  storage::StoreOptions o = storage::testing::TestOptions();
  o.min_free_disk_bytes = 0;
  return o;
}

// Builds two contexts in `dir` and flips a byte in a page of the first.
// Returns {bad, good}.
std::pair<ContextId, ContextId> MakeDirWithOneBadPage(const std::string& dir) {
  ContextId bad, good;
  {
    auto store = Store::Open(Options(), dir);
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    auto a = BuildContext(store->get(), MakeSpec(2, 2, 32), Tokens(64, 1));
    auto b = BuildContext(store->get(), MakeSpec(2, 2, 32), Tokens(64, 2));
    EXPECT_TRUE(a.ok() && b.ok());
    bad = *ContextId::FromBytes(a->context_id());
    good = *ContextId::FromBytes(b->context_id());
  }
  auto raw = OpenRaw(dir);
  EXPECT_NE(raw, nullptr);
  std::string key = storage::PageKey(bad, 1, 1, 2), value;
  EXPECT_TRUE(raw->db->Get(rocksdb::ReadOptions(), raw->cf("pages"), key, &value).ok());
  value[value.size() / 2] ^= 0x04;
  EXPECT_TRUE(raw->db->Put(rocksdb::WriteOptions(), raw->cf("pages"), key, value).ok());
  return {bad, good};
}

TEST(CliFsckTest, ReportsAFlippedPageByteAndQuarantinesOnRequest) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/data";
  auto [bad, good] = MakeDirWithOneBadPage(dir);

  std::string out;
  EXPECT_EQ(ServerProcess::RunCapture({Cli(), "fsck", "--data-dir", dir}, &out), 1) << out;
  EXPECT_NE(out.find(bad.ToHex() + "  corrupt"), std::string::npos) << out;
  EXPECT_NE(out.find("layer 1 kv_head 1 block 2"), std::string::npos) << out;
  EXPECT_NE(out.find(good.ToHex() + "  ok"), std::string::npos) << out;
  EXPECT_NE(out.find("fsck: 1 ok, 1 corrupt"), std::string::npos) << out;
  {  // report only: still served (and still corrupt)
    auto store = Store::Open(Options(), dir);
    ASSERT_TRUE(store.ok());
    EXPECT_TRUE((*store)->GetManifest(bad).ok());
  }

  EXPECT_EQ(
      ServerProcess::RunCapture({Cli(), "--json", "fsck", "--data-dir", dir, "--quarantine"}, &out),
      1)
      << out;
  EXPECT_NE(out.find("\"quarantined_now\":true"), std::string::npos) << out;
  {
    auto store = Store::Open(Options(), dir);
    ASSERT_TRUE(store.ok());
    EXPECT_EQ((*store)->GetManifest(bad).status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE((*store)->GetManifest(good).ok());
  }
  // Later runs keep reporting it: the dir holds a quarantined context.
  EXPECT_EQ(ServerProcess::RunCapture({Cli(), "fsck", "--data-dir", dir}, &out), 1) << out;
  EXPECT_NE(out.find(bad.ToHex() + "  quarantined"), std::string::npos) << out;
  EXPECT_NE(out.find("fsck: 1 ok, 0 corrupt, 1 quarantined before"), std::string::npos) << out;
}

TEST(CliFsckTest, CleanDirExitsZero) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/data";
  {
    auto store = Store::Open(Options(), dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE(BuildContext(store->get(), MakeSpec(1, 1, 16), Tokens(40, 3)).ok());
  }
  std::string out;
  EXPECT_EQ(ServerProcess::RunCapture({Cli(), "fsck", "--data-dir", dir}, &out), 0) << out;
  EXPECT_NE(out.find("fsck: 1 ok, 0 corrupt, 0 quarantined before"), std::string::npos) << out;
}

TEST(CliFsckTest, LockedDataDirIsRefusedClearly) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/data";
  auto store = Store::Open(Options(), dir);  // stands in for a running ctxcached
  ASSERT_TRUE(store.ok());
  std::string out;
  EXPECT_EQ(ServerProcess::RunCapture({Cli(), "fsck", "--data-dir", dir}, &out), 1) << out;
  EXPECT_NE(out.find("is in use (RocksDB LOCK held; is ctxcached running?)"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace ctxcache
