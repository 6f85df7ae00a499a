// The method registry (index/methods.h): the kind bytes are on disk and must
// never change; names and bytes are unique; the flags and param resolution
// the service relies on.
#include "index/methods.h"

#include <gtest/gtest.h>

#include <map>
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
  auto big = (*csa)->resolve({}, 10000, 40000);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(*big, CsaOptionsToParams(CsaOptions{}));
  auto small = (*csa)->resolve({}, 90, 360);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->at("C"), "90");
  auto asked = (*csa)->resolve({{"C", "64"}, {"alpha", "0.5"}}, 90, 360);
  ASSERT_TRUE(asked.ok());
  EXPECT_EQ(asked->at("C"), "64");
  EXPECT_EQ(asked->at("alpha"), "0.5");
  EXPECT_EQ((*csa)->resolve({{"bogus", "1"}}, 90, 360).status().code(),
            StatusCode::kInvalidArgument);
  // An extended context re-derives C from its own size, keeps the rest.
  MethodParams child = ParamsForExtend(**csa, *small);
  EXPECT_EQ(child.count("C"), 0u);
  EXPECT_EQ(child.at("alpha"), small->at("alpha"));
  auto tactic = FindMethodInfo("tactic");
  ASSERT_TRUE(tactic.ok());
  EXPECT_EQ(*(*tactic)->resolve({{"k", "v"}}, 90, 360), (MethodParams{{"k", "v"}}));
}

}  // namespace
}  // namespace ctxcache::index
