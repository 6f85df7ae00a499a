// The method registry (index/methods.h): the kind bytes are on disk and must
// never change; names and bytes are unique; the flags and param resolution
// the service relies on.
#include "index/methods.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <vector>
#include <set>
#include <string>

#include "index/csa.h"

namespace ctxcache::index {
namespace {

TEST(MethodsTest, KindBytesArePinnedAndUnique) {
  const std::map<std::string, uint8_t> on_disk = {{"csa", 1},  {"tactic", 2}, {"lfps", 3},
                                                  {"quest", 4}, {"full", 5},   {"oracle", 6},
                                                  {"streaming", 7}};
  std::set<uint8_t> kinds;
  std::set<std::string> names;
  for (const MethodInfo& m : Methods()) {
    ASSERT_TRUE(on_disk.count(std::string(m.name))) << m.name;
    EXPECT_EQ(m.artifact_kind, on_disk.at(std::string(m.name))) << m.name;
    EXPECT_TRUE(kinds.insert(m.artifact_kind).second) << m.name;
    EXPECT_TRUE(names.insert(std::string(m.name)).second) << m.name;
    EXPECT_NE(m.build, nullptr);
    EXPECT_NE(m.load, nullptr);
    EXPECT_NE(m.resolve, nullptr);
  }
  EXPECT_EQ(names.size(), on_disk.size());
  EXPECT_TRUE(names.count(std::string(kDefaultMethod)));
}

TEST(MethodsTest, FlagsAndLookup) {
  std::set<std::string> always, independent;
  for (const MethodInfo& m : Methods()) {
    if (m.always_built) always.insert(std::string(m.name));
    if (m.query_independent) independent.insert(std::string(m.name));
  }
  EXPECT_EQ(always, (std::set<std::string>{"full", "oracle", "streaming"}));
  EXPECT_EQ(independent, (std::set<std::string>{"full", "streaming"}));
  auto csa = FindMethodInfo("csa");
  ASSERT_TRUE(csa.ok());
  EXPECT_EQ((*csa)->name, "csa");
  auto bad = FindMethodInfo("nope");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'nope'"), std::string::npos);
  EXPECT_NE(bad.status().message().find(MethodNamesForMessages()), std::string::npos);
}

TEST(MethodsTest, CsaResolvesEveryOptionAndClampsCOnlyWhenNotRequested) {
  auto csa = FindMethodInfo("csa");
  ASSERT_TRUE(csa.ok());
  auto big = (*csa)->resolve({}, 10000, 40000, /*head_dim=*/0);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(*big, CsaOptionsToParams(CsaOptions{}));  // m stays 0: head_dim unknown
  auto small = (*csa)->resolve({}, 90, 360, 64);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->at("C"), "90");
  // m = 0 resolves for the model's head_dim (what the build uses); an asked m is kept.
  EXPECT_EQ(small->at("m"), "16");
  EXPECT_EQ((*csa)->resolve({}, 90, 360, 32)->at("m"), "8");
  auto asked = (*csa)->resolve({{"C", "64"}, {"alpha", "0.5"}, {"m", "4"}}, 90, 360, 64);
  ASSERT_TRUE(asked.ok());
  EXPECT_EQ(asked->at("C"), "64");
  EXPECT_EQ(asked->at("alpha"), "0.5");
  EXPECT_EQ(asked->at("m"), "4");
  EXPECT_EQ((*csa)->resolve({{"bogus", "1"}}, 90, 360, 64).status().code(),
            StatusCode::kInvalidArgument);
  // An extended context re-derives C from its own size, keeps the rest.
  MethodParams child = ParamsForExtend(**csa, *small);
  EXPECT_EQ(child.count("C"), 0u);
  EXPECT_EQ(child.at("alpha"), small->at("alpha"));
  auto tactic = FindMethodInfo("tactic");
  ASSERT_TRUE(tactic.ok());
  EXPECT_EQ(*(*tactic)->resolve({{"k", "v"}}, 90, 360, 64), (MethodParams{{"k", "v"}}));
}

// Issue #19 finding 1: sessions clone one loaded selector. For every
// method, appending to a clone leaves the original and its other clones as
// they were, and the clone selects what a selector loaded from its own
// serialized form (appended tokens in its tables) selects.
TEST(MethodsTest, ClonesAreIndependentAndAppendsMatchTheirSerializedForm) {
  const int d = 32, g = 2;
  const int64_t n = 600, extra = 90;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> keys((n + extra) * d), values((n + extra) * d), queries(g * n * d);
  for (float& x : keys) x = nd(rng);
  for (float& x : values) x = nd(rng);
  for (float& x : queries) x = nd(rng);
  HeadPrefill p;
  p.n_tokens = n;
  p.head_dim = d;
  p.group_size = g;
  p.keys = keys.data();
  p.values = values.data();
  p.n_queries = n;
  p.queries = queries.data();
  for (const MethodInfo& m : Methods()) {
    SCOPED_TRACE(std::string(m.name));
    MethodParams params;
    if (m.name == "csa") params = {{"m", "4"}, {"C", "16"}, {"format", "plain"}};
    if (m.name == "tactic") params = {{"recluster", "64"}};
    auto built = BuildSelector(m.name, p, params);
    ASSERT_TRUE(built.ok()) << built.status().ToString();
    std::string before;
    ASSERT_TRUE((*built)->Serialize(&before).ok());
    std::unique_ptr<Selector> a = (*built)->Clone(), b = (*built)->Clone();
    for (int64_t i = n; i < n + extra; ++i) {
      ASSERT_TRUE(a->Append(keys.data() + i * d, values.data() + i * d, queries.data()).ok());
    }
    std::string after_orig, after_b, bytes_a;
    ASSERT_TRUE((*built)->Serialize(&after_orig).ok());
    ASSERT_TRUE(b->Serialize(&after_b).ok());
    EXPECT_EQ(after_orig, before);
    EXPECT_EQ(after_b, before);
    EXPECT_EQ(b->n_tokens(), n);
    ASSERT_TRUE(a->Serialize(&bytes_a).ok());
    auto loaded = LoadSelector(m.name, bytes_a);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ((*loaded)->n_tokens(), n + extra);
    ArrayKeySource ks(keys.data(), n + extra, d);
    SelectInput in;
    in.n_queries = g;
    in.keys = &ks;
    for (int step = 0; step < 3; ++step) {
      in.queries = queries.data() + static_cast<int64_t>(step) * 97 * g * d;
      Selection x, y;
      ASSERT_TRUE(a->Select(in, &x, nullptr).ok());
      ASSERT_TRUE((*loaded)->Select(in, &y, nullptr).ok());
      EXPECT_EQ(x.per_head, y.per_head) << "step " << step;
    }
  }
}

}  // namespace
}  // namespace ctxcache::index
