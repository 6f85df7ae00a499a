#include "index/synthetic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <vector>

namespace ctxcache::index {
namespace {

// 64-bit FNV-1a, continued over several byte ranges.
class Fnv1a {
 public:
  template <typename T>
  void Add(const std::vector<T>& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(T); ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ULL;
    }
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

uint64_t HashHead(const SyntheticHead& h) {
  Fnv1a f;
  f.Add(h.keys);
  f.Add(h.values);
  f.Add(h.prefill_queries);
  f.Add(h.prefill_positions);
  f.Add(h.decode_queries);
  f.Add(h.decode_keys);
  f.Add(h.decode_values);
  return f.value();
}

struct PinnedCase {
  const char* name;
  SyntheticOptions options;
  uint64_t want;
};

std::vector<PinnedCase> PinnedCases() {
  std::vector<PinnedCase> cases;
  cases.push_back({"defaults", SyntheticOptions{}, 0x0caea93254030196ULL});

  SyntheticOptions small;
  small.n_tokens = 64;
  small.head_dim = 16;
  small.latent_dim = 8;  // must be <= head_dim / 2
  small.group_size = 2;
  small.n_decode_steps = 3;
  small.n_topics = 8;
  small.mean_segment = 8;
  cases.push_back({"small", small, 0xee10705c7e6ebbb9ULL});

  SyntheticOptions no_rope;
  no_rope.n_tokens = 1000;
  no_rope.head_dim = 64;
  no_rope.n_prefill_queries = 300;  // fewer rows than tokens: spaced positions
  no_rope.rope_theta = 0;
  no_rope.seed = 7;
  cases.push_back({"no_rope", no_rope, 0x16ac50ea1e4f1335ULL});

  SyntheticOptions no_sinks;
  no_sinks.n_tokens = 2048;
  no_sinks.n_sinks = 0;
  no_sinks.heavy_hitter_std = 0;
  no_sinks.n_decode_steps = 0;
  no_sinks.seed = 3;
  cases.push_back({"no_sinks", no_sinks, 0x05f785e83ca46f43ULL});

  SyntheticOptions vocab;
  vocab.n_tokens = 3000;
  vocab.vocab_size = 500;
  vocab.retrieval_prob = 0.5;
  vocab.salience_sigma = 0.8;
  vocab.spectrum_decay = 0.5;
  vocab.seed = 11;
  cases.push_back({"vocab", vocab, 0x7fb9c1819f4c4835ULL});

  // Not one of the four required sets: also pins the heavy-hitter path.
  SyntheticOptions heavy;
  heavy.n_tokens = 1500;
  heavy.head_dim = 32;
  heavy.latent_dim = 16;
  heavy.group_size = 3;
  heavy.heavy_hitter_std = 1.0;
  heavy.n_sinks = 2;
  heavy.seed = 5;
  cases.push_back({"heavy_hitters", heavy, 0x5810f9f8ef57f1b6ULL});
  return cases;
}

// The generator feeds benchmarks and fidelity tests whose numbers are only
// comparable if its output never drifts: pin every byte of it (in the
// default Release build; see tests/index/CMakeLists.txt).
TEST(SyntheticTest, OutputIsPinned) {
  for (const PinnedCase& c : PinnedCases()) {
    auto head = GenerateSyntheticHead(c.options);
    ASSERT_TRUE(head.ok()) << c.name << ": " << head.status().message();
    const SyntheticOptions& o = c.options;
    const int64_t n_prefill = std::min(o.n_prefill_queries, o.n_tokens);
    EXPECT_EQ(head->keys.size(), static_cast<size_t>(o.n_tokens * o.head_dim)) << c.name;
    EXPECT_EQ(head->values.size(), head->keys.size()) << c.name;
    EXPECT_EQ(head->n_prefill(), n_prefill) << c.name;
    EXPECT_EQ(head->prefill_queries.size(),
              static_cast<size_t>(o.group_size * n_prefill * o.head_dim))
        << c.name;
    EXPECT_EQ(head->decode_queries.size(),
              static_cast<size_t>(o.n_decode_steps * o.group_size * o.head_dim))
        << c.name;
    EXPECT_EQ(head->decode_keys.size(), static_cast<size_t>(o.n_decode_steps * o.head_dim))
        << c.name;
    const uint64_t got = HashHead(*head);
    std::printf("pinned %-14s 0x%016" PRIx64 "ULL\n", c.name, got);
#ifdef CTXCACHE_PINNED_FLOAT_BUILD
    EXPECT_EQ(got, c.want) << c.name;
#else
    // Another build's float code: the bytes are pinned for Release only.
    EXPECT_EQ(got, HashHead(*GenerateSyntheticHead(c.options))) << c.name;
#endif
  }
}

TEST(SyntheticTest, SameSeedSameOutputOtherSeedDiffers) {
  SyntheticOptions o;
  o.n_tokens = 256;
  o.head_dim = 32;
  o.latent_dim = 8;
  auto a = GenerateSyntheticHead(o);
  auto b = GenerateSyntheticHead(o);
  o.seed = 2;
  auto c = GenerateSyntheticHead(o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(HashHead(*a), HashHead(*b));
  EXPECT_NE(HashHead(*a), HashHead(*c));
}

TEST(SyntheticTest, RejectsBadOptions) {
  auto expect_invalid = [](const SyntheticOptions& o, const char* what) {
    auto head = GenerateSyntheticHead(o);
    ASSERT_FALSE(head.ok()) << what;
    EXPECT_EQ(head.status().code(), StatusCode::kInvalidArgument) << what;
  };
  SyntheticOptions o;
  o.n_tokens = 15;
  expect_invalid(o, "n_tokens < 16");
  o = {};
  o.head_dim = 33;
  expect_invalid(o, "odd head_dim");
  o = {};
  o.group_size = 0;
  expect_invalid(o, "group_size 0");
  o = {};
  o.n_prefill_queries = 0;
  expect_invalid(o, "no prefill queries");
  o = {};
  o.n_decode_steps = -1;
  expect_invalid(o, "negative decode steps");
  o = {};
  o.latent_dim = o.head_dim / 2 + 1;
  expect_invalid(o, "latent_dim > head_dim/2");
  o = {};
  o.retrieval_prob = 1.5;
  expect_invalid(o, "retrieval_prob > 1");
  o = {};
  o.logit_std = 0;
  expect_invalid(o, "logit_std 0");
  o = {};
  o.heavy_hitter_std = -1;
  expect_invalid(o, "negative heavy_hitter_std");
  o = {};
  o.n_sinks = static_cast<int>(o.n_tokens);
  expect_invalid(o, "n_sinks == n_tokens");
}

}  // namespace
}  // namespace ctxcache::index
