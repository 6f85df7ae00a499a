// The C ABI (client/include/ctxcache/c.h) against a real ctxcached on
// loopback: bulk KV loads into caller buffers equal the pages FetchPages
// serves, any layout, layer order and priority; bad layouts are refused
// with INVALID_ARGUMENT naming the field and nothing written; a corrupted
// page is DATA_LOSS; index and page fetches. Only the C ABI is used: the
// library carries its own copy of the SDK and the generated messages.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ctxcache/c.h"
#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ServerProcess;
using testing::TempDir;

constexpr int kTokens = 301;  // 19 pages, the last one short

std::vector<std::string> ModelArgs() {
  return {"--model-dir",          testing::SourceDir() + "/tests/data/golden",
          "--default-model",      "llama3",
          "--max-context-tokens", "65536"};
}

struct Connected {
  ctxcache_client_t* c = nullptr;
  explicit Connected(const std::string& server) {
    ctxcache_options_t* o = ctxcache_options_create();
    ctxcache_options_set_server(o, server.c_str());
    ctxcache_options_set_max_attempts(o, 1);
    char* err = nullptr;
    EXPECT_EQ(ctxcache_connect(o, &c, &err), 0) << (err ? err : "");
    ctxcache_free(err);
    ctxcache_options_destroy(o);
  }
  ~Connected() { ctxcache_client_destroy(c); }
};

// Error code and message of a C call.
struct Err {
  char* msg = nullptr;
  ~Err() { ctxcache_free(msg); }
  std::string str() const { return msg ? msg : ""; }
};

std::string BuildRandom(ctxcache_client_t* c, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> tokens(n);
  for (auto& t : tokens) t = rng() % 512;
  char* id = nullptr;
  Err e;
  EXPECT_EQ(ctxcache_build_tokens(c, "", tokens.data(), tokens.size(), &id, &e.msg), 0) << e.str();
  std::string out = id ? id : "";
  ctxcache_free(id);
  return out;
}

// A page's raw payload: K rows then V rows.
struct Page {
  uint32_t block;
  uint32_t n_tokens;
  std::string k, v;
};

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.Start(tmp_.path() + "/data", ModelArgs())) << server_.log();
    conn_ = std::make_unique<Connected>(server_.address());
    id_ = BuildRandom(conn_->c, kTokens, 1);
    ASSERT_FALSE(id_.empty());
    Err e;
    ASSERT_EQ(ctxcache_get_context(conn_->c, id_.c_str(), &ctx_, nullptr, nullptr, &e.msg), 0)
        << e.str();
  }

  // Every page of (layer, head), by FetchPages (another RPC than FetchKV).
  std::vector<Page> Pages(uint32_t layer, uint32_t head) {
    const uint32_t n_blocks = (kTokens + 15) / 16;
    const size_t page_bytes = 2 * 16 * ctx_.head_dim * 2;
    std::vector<uint32_t> blocks(n_blocks);
    for (uint32_t b = 0; b < n_blocks; ++b) blocks[b] = b;
    std::string out(n_blocks * page_bytes, '\0');
    Err e;
    EXPECT_EQ(ctxcache_fetch_pages(conn_->c, id_.c_str(), layer, head, blocks.data(), n_blocks,
                                   out.data(), out.size(), &e.msg),
              0)
        << e.str();
    std::vector<Page> pages;
    for (uint32_t b = 0; b < n_blocks; ++b) {
      const uint32_t n = std::min<uint32_t>(16, kTokens - b * 16);
      const size_t half = n * ctx_.head_dim * 2;
      pages.push_back(
          {b, n, out.substr(b * page_bytes, half), out.substr(b * page_bytes + half, half)});
    }
    return pages;
  }

  // Checks that `buf` holds layer `layer`'s K (or V) at the given strides.
  void ExpectLayer(const std::vector<uint16_t>& buf, int64_t base, int64_t head_stride,
                   int64_t token_stride, uint32_t layer, bool k) {
    const size_t row = ctx_.head_dim * 2;
    for (uint32_t h = 0; h < ctx_.n_kv_heads; ++h) {
      for (const Page& p : Pages(layer, h)) {
        const std::string& src = k ? p.k : p.v;
        for (uint32_t t = 0; t < p.n_tokens; ++t) {
          const uint64_t tok = uint64_t{p.block} * 16 + t;
          const char* at = reinterpret_cast<const char*>(buf.data()) + base + h * head_stride +
                           static_cast<int64_t>(tok) * token_stride;
          ASSERT_EQ(std::memcmp(at, src.data() + t * row, row), 0)
              << "layer " << layer << " head " << h << " token " << tok << (k ? " K" : " V");
        }
      }
    }
  }

  TempDir tmp_;
  ServerProcess server_;
  std::string id_;
  std::unique_ptr<Connected> conn_;
  ctxcache_context_t ctx_{};
};

TEST_F(CApiTest, ContextShape) {
  EXPECT_EQ(ctxcache_abi_version(), CTXCACHE_ABI_VERSION);
  EXPECT_EQ(ctx_.n_tokens, static_cast<uint64_t>(kTokens));
  EXPECT_EQ(ctx_.n_layers, 2u);
  EXPECT_EQ(ctx_.n_kv_heads, 2u);
  EXPECT_EQ(ctx_.head_dim, 32u);
  EXPECT_EQ(ctx_.kv_dtype, CTXCACHE_BF16);
  EXPECT_EQ(ctx_.state, 2);
  char* proto = nullptr;
  size_t len = 0;
  Err e;
  ASSERT_EQ(ctxcache_get_context(conn_->c, id_.c_str(), &ctx_, &proto, &len, &e.msg), 0);
  // A serialized ContextInfo: field 1 (context_id), length-delimited, first.
  ASSERT_GT(len, 34u);
  EXPECT_EQ(proto[0], 0x0A);
  EXPECT_EQ(proto[1], 32);
  EXPECT_EQ(std::string(proto + 2, 32), id_);
  ctxcache_free(proto);
}

TEST_F(CApiTest, DenseLoadEqualsFetchPages) {
  const size_t elems = size_t{ctx_.n_layers} * ctx_.n_kv_heads * kTokens * ctx_.head_dim;
  std::vector<uint16_t> k(elems, 0xABAB), v(elems, 0xABAB);
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  ctxcache_load_progress_t p{};
  Err e;
  // Small frames: several frames per (layer, head).
  ASSERT_EQ(ctxcache_load_kv(conn_->c, id_.c_str(), nullptr, 0, 2, 1000, &layout, &p, &e.msg), 0)
      << e.str();
  EXPECT_EQ(p.layers_done, 2u);
  EXPECT_EQ(p.bytes_done, elems * 4);
  EXPECT_EQ(p.bytes_total, elems * 4);
  EXPECT_GT(p.frames, 4u);
  const int64_t head = int64_t{kTokens} * ctx_.head_dim * 2;
  for (uint32_t l = 0; l < 2; ++l) {
    ExpectLayer(k, l * head * 2, head, ctx_.head_dim * 2, l, true);
    ExpectLayer(v, l * head * 2, head, ctx_.head_dim * 2, l, false);
  }
}

TEST_F(CApiTest, StridedLayoutLayerOrderAndPriority) {
  // [token][slot][head][dim] with padding: layer slots 0, 1 = layers 1, 0.
  const int64_t row = ctx_.head_dim * 2, head_stride = row + 16, layer_stride = 2 * head_stride,
                token_stride = 2 * layer_stride + 8;
  const size_t bytes = static_cast<size_t>(token_stride) * kTokens;
  std::vector<uint16_t> k(bytes / 2, 0), v(bytes / 2, 0);
  ctxcache_kv_layout_t layout{k.data(),     v.data(),    bytes,        bytes,
                              layer_stride, head_stride, token_stride, CTXCACHE_BF16};
  const uint32_t layers[] = {1, 0};
  ctxcache_load_t* load = nullptr;
  Err e;
  ASSERT_EQ(ctxcache_load_kv_start(conn_->c, id_.c_str(), layers, 2, 1, 0, &layout, &load, &e.msg),
            0)
      << e.str();
  // Layer 0 is queued last; waiting for it takes it next and returns once it is in.
  ASSERT_EQ(ctxcache_load_wait_layer(load, 0, &e.msg), 0) << e.str();
  ctxcache_load_progress_t p{};
  ctxcache_load_progress(load, &p);
  EXPECT_GE(p.layers_done, 1u);
  Err bad;
  EXPECT_EQ(ctxcache_load_prioritize(load, 7, &bad.msg), 3);
  EXPECT_NE(bad.str().find("layer: 7"), std::string::npos) << bad.str();
  ASSERT_EQ(ctxcache_load_wait(load, &e.msg), 0) << e.str();
  EXPECT_EQ(ctxcache_load_done(load), 1);
  ctxcache_load_destroy(load);
  ExpectLayer(k, 0, head_stride, token_stride, 1, true);
  ExpectLayer(v, layer_stride, head_stride, token_stride, 0, false);
  ExpectLayer(k, layer_stride, head_stride, token_stride, 0, true);
}

TEST_F(CApiTest, BadLayoutsAreRefusedAndNothingIsWritten) {
  const size_t elems = size_t{ctx_.n_layers} * ctx_.n_kv_heads * kTokens * ctx_.head_dim;
  std::vector<uint16_t> k(elems, 0xABAB), v(elems, 0xABAB);
  const ctxcache_kv_layout_t good{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  struct Case {
    const char* field;
    ctxcache_kv_layout_t layout;
    std::vector<uint32_t> layers;
  };
  std::vector<Case> cases;
  auto with = [&](auto edit) {
    ctxcache_kv_layout_t l = good;
    edit(l);
    return l;
  };
  cases.push_back({"layout.k_capacity", with([](auto& l) { l.k_capacity -= 1; }), {}});
  cases.push_back({"layout.v_capacity", with([](auto& l) { l.v_capacity = 64; }), {}});
  cases.push_back({"layout.dtype", with([](auto& l) { l.dtype = CTXCACHE_F32; }), {}});
  cases.push_back({"layout.token_stride", with([](auto& l) { l.token_stride = 2; }), {}});
  cases.push_back({"layout: strides", with([](auto& l) { l.head_stride = -64; }), {}});
  cases.push_back({"layout.k: null", with([](auto& l) { l.k = nullptr; }), {}});
  cases.push_back({"layout.v_capacity",  // a huge stride overflows no check
                   with([](auto& l) {
                     l.layer_stride = INT64_MAX;
                     l.k_capacity = SIZE_MAX;
                   }),
                   {}});
  cases.push_back({"options.layers: 2 out of range", good, {0, 2}});
  cases.push_back({"options.layers: 1 given twice", good, {1, 1}});
  for (const Case& c : cases) {
    Err e;
    ctxcache_load_progress_t p{};
    EXPECT_EQ(ctxcache_load_kv(conn_->c, id_.c_str(), c.layers.data(), c.layers.size(), 0, 0,
                               &c.layout, &p, &e.msg),
              3)
        << c.field;
    EXPECT_NE(e.str().find(c.field), std::string::npos) << c.field << ": " << e.str();
  }
  for (size_t i = 0; i < elems; ++i) {
    ASSERT_EQ(k[i], 0xABAB) << i;
    ASSERT_EQ(v[i], 0xABAB) << i;
  }
  // The server's frame limit: refused by FetchKV, naming the field.
  Err frame;
  EXPECT_EQ(
      ctxcache_load_kv(conn_->c, id_.c_str(), nullptr, 0, 0, 64u << 20, &good, nullptr, &frame.msg),
      3);
  EXPECT_NE(frame.str().find("frame_bytes"), std::string::npos) << frame.str();
  for (size_t i = 0; i < elems; ++i) ASSERT_EQ(k[i], 0xABAB) << i;
  Err e;
  ctxcache_load_t* load = nullptr;
  EXPECT_EQ(ctxcache_load_kv_start(conn_->c, "00112233445566778899aabbccddeeff", nullptr, 0, 0, 0,
                                   &good, &load, &e.msg),
            5)
      << e.str();
  EXPECT_EQ(load, nullptr);
  Err e2;
  EXPECT_EQ(ctxcache_load_kv_start(conn_->c, "not-an-id", nullptr, 0, 0, 0, &good, &load, &e2.msg),
            3);
  EXPECT_NE(e2.str().find("context_id"), std::string::npos) << e2.str();
}

// Pages written into a whole-context layout (padded token rows, as a
// worker's host tier): the asked pages land where a bulk load puts them, the
// other rows keep their bytes; bad tables and layouts write nothing.
TEST_F(CApiTest, FetchPagesIntoALayout) {
  const size_t row = ctx_.head_dim * 2;
  const uint64_t padded = 19 * 16;  // the tier pads the last page
  const size_t elems = size_t{ctx_.n_layers} * ctx_.n_kv_heads * padded * ctx_.head_dim;
  std::vector<uint16_t> k(elems, 0xABCD), v(elems, 0xABCD);
  const int64_t hs = static_cast<int64_t>(padded * row), ls = hs * ctx_.n_kv_heads;
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, ls, hs, 0, CTXCACHE_BF16};
  const uint32_t b0[] = {0, 7, 18}, b1[] = {3};
  const uint32_t last = ctx_.n_layers - 1, head = ctx_.n_kv_heads - 1;
  const ctxcache_page_table_t tables[] = {{0, 0, b0, 3}, {last, head, b1, 1}};
  Err e;
  ASSERT_EQ(ctxcache_fetch_pages_into(conn_->c, id_.c_str(), tables, 2, &layout, &e.msg), 0)
      << e.str();
  const char* kb = reinterpret_cast<const char*>(k.data());
  const char* vb = reinterpret_cast<const char*>(v.data());
  size_t written = 0;
  for (const auto& t : tables) {
    const std::vector<Page> all = Pages(t.layer, t.kv_head);
    for (size_t i = 0; i < t.n_blocks; ++i) {
      const Page& p = all[t.blocks[i]];
      const int64_t at = t.layer * ls + t.kv_head * hs + int64_t{p.block} * 16 * row;
      EXPECT_EQ(std::memcmp(kb + at, p.k.data(), p.k.size()), 0) << t.layer << " " << p.block;
      EXPECT_EQ(std::memcmp(vb + at, p.v.data(), p.v.size()), 0) << t.layer << " " << p.block;
      written += p.n_tokens * ctx_.head_dim;
    }
  }
  const auto untouched = [](const std::vector<uint16_t>& buf) {
    return static_cast<size_t>(std::count(buf.begin(), buf.end(), 0xABCD));
  };
  EXPECT_EQ(untouched(k), elems - written);
  EXPECT_EQ(untouched(v), elems - written);

  // Bad input: INVALID_ARGUMENT naming the field, nothing written.
  std::vector<uint16_t> k2(elems, 0xABCD), v2(elems, 0xABCD);
  ctxcache_kv_layout_t fresh{k2.data(), v2.data(), elems * 2, elems * 2, ls, hs, 0, CTXCACHE_BF16};
  const uint32_t unsorted[] = {4, 2}, past[] = {19};
  const ctxcache_page_table_t bad_blocks[] = {{0, 0, b0, 3}, {1, 0, unsorted, 2}};
  const ctxcache_page_table_t bad_range[] = {{0, 0, past, 1}};
  const ctxcache_page_table_t bad_head[] = {{0, ctx_.n_kv_heads, b1, 1}};
  const ctxcache_page_table_t bad_layer[] = {{ctx_.n_layers, 0, b1, 1}};
  struct Case {
    const ctxcache_page_table_t* t;
    size_t n;
    ctxcache_kv_layout_t l;
    const char* field;
  };
  ctxcache_kv_layout_t small = fresh;
  small.v_capacity = static_cast<size_t>(ls * ctx_.n_layers - hs);  // one kv head short
  ctxcache_kv_layout_t f16 = fresh;
  f16.dtype = CTXCACHE_F16;
  for (const Case& c : {Case{bad_blocks, 2, fresh, "tables[1].blocks[1]"},
                        Case{bad_range, 1, fresh, "tables[0].blocks[0]"},
                        Case{bad_head, 1, fresh, "tables[0].kv_head"},
                        Case{bad_layer, 1, fresh, "tables[0].layer"},
                        Case{tables, 0, fresh, "tables"}, Case{tables, 2, small, "v_capacity"},
                        Case{tables, 2, f16, "layout.dtype"}}) {
    Err bad;
    EXPECT_EQ(ctxcache_fetch_pages_into(conn_->c, id_.c_str(), c.t, c.n, &c.l, &bad.msg), 3)
        << c.field;
    EXPECT_NE(bad.str().find(c.field), std::string::npos) << bad.str();
  }
  EXPECT_EQ(untouched(k2), elems);
  EXPECT_EQ(untouched(v2), elems);
}

TEST_F(CApiTest, FetchPagesAndIndex) {
  const uint32_t blocks[] = {0, 5, 18};
  const size_t page_bytes = 2 * 16 * ctx_.head_dim * 2;
  std::vector<char> out(3 * page_bytes, 0);
  Err e;
  ASSERT_EQ(
      ctxcache_fetch_pages(conn_->c, id_.c_str(), 1, 1, blocks, 3, out.data(), out.size(), &e.msg),
      0)
      << e.str();
  // The same bytes as a bulk load of layer 1.
  const size_t elems = size_t{ctx_.n_kv_heads} * kTokens * ctx_.head_dim;
  std::vector<uint16_t> k(elems), v(elems);
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  const uint32_t layer1[] = {1};
  ASSERT_EQ(ctxcache_load_kv(conn_->c, id_.c_str(), layer1, 1, 0, 0, &layout, nullptr, &e.msg), 0)
      << e.str();
  const size_t row = ctx_.head_dim * 2, head = kTokens * row;
  for (int i = 0; i < 3; ++i) {
    const size_t n = std::min<size_t>(16, kTokens - blocks[i] * 16);
    const char* kb = reinterpret_cast<const char*>(k.data()) + head + blocks[i] * 16 * row;
    const char* vb = reinterpret_cast<const char*>(v.data()) + head + blocks[i] * 16 * row;
    EXPECT_EQ(std::memcmp(out.data() + i * page_bytes, kb, n * row), 0) << i;
    EXPECT_EQ(std::memcmp(out.data() + i * page_bytes + n * row, vb, n * row), 0) << i;
  }
  Err small;
  EXPECT_EQ(ctxcache_fetch_pages(conn_->c, id_.c_str(), 1, 1, blocks, 3, out.data(), out.size() - 1,
                                 &small.msg),
            3);
  EXPECT_NE(small.str().find("out_capacity"), std::string::npos) << small.str();

  ctxcache_index_t* index = nullptr;
  ASSERT_EQ(ctxcache_fetch_index(conn_->c, id_.c_str(), "csa", &index, &e.msg), 0) << e.str();
  for (uint32_t l = 0; l < ctx_.n_layers; ++l) {
    for (uint32_t h = 0; h < ctx_.n_kv_heads; ++h) {
      const char* data = nullptr;
      size_t len = 0;
      ASSERT_EQ(ctxcache_index_get(index, l, h, &data, &len), 0) << l << "/" << h;
      EXPECT_GT(len, 0u);
    }
  }
  const char* data = nullptr;
  size_t len = 0;
  EXPECT_EQ(ctxcache_index_get(index, 9, 0, &data, &len), 5);
  // One layer's artifacts alone: the same bytes, and no other layer's.
  const uint32_t last[] = {ctx_.n_layers - 1};
  ctxcache_index_t* one = nullptr;
  ASSERT_EQ(ctxcache_fetch_index_layers(conn_->c, id_.c_str(), "csa", last, 1, &one, &e.msg), 0)
      << e.str();
  for (uint32_t h = 0; h < ctx_.n_kv_heads; ++h) {
    const char *a = nullptr, *b = nullptr;
    size_t la = 0, lb = 0;
    ASSERT_EQ(ctxcache_index_get(one, last[0], h, &a, &la), 0);
    ASSERT_EQ(ctxcache_index_get(index, last[0], h, &b, &lb), 0);
    EXPECT_EQ(std::string(a, la), std::string(b, lb));
    EXPECT_EQ(ctxcache_index_get(one, 0, h, &a, &la), 5);
  }
  ctxcache_index_destroy(one);
  const uint32_t past[] = {ctx_.n_layers};
  Err range;
  EXPECT_EQ(ctxcache_fetch_index_layers(conn_->c, id_.c_str(), "csa", past, 1, &one, &range.msg), 3);
  EXPECT_NE(range.str().find("layers"), std::string::npos) << range.str();
  ctxcache_index_destroy(index);
  Err unknown;
  EXPECT_EQ(ctxcache_fetch_index(conn_->c, id_.c_str(), "nope", &index, &unknown.msg), 3);
  EXPECT_NE(unknown.str().find("nope"), std::string::npos) << unknown.str();
}

// Open fds of process `pid` that are MapKV segments.
int SegmentFds(pid_t pid) {
  int n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().find("memfd:ctxcache-kv") != std::string::npos) ++n;
  }
  return n;
}

// Mappings of MapKV segments in this process.
int SegmentMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += line.find("memfd:ctxcache-kv") != std::string::npos;
  return n;
}

TEST_F(CApiTest, MapKVEqualsLoadAndLeavesNothingBehind) {
  const size_t elems = size_t{ctx_.n_layers} * ctx_.n_kv_heads * kTokens * ctx_.head_dim;
  std::vector<uint16_t> k(elems), v(elems);
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  Err e;
  ASSERT_EQ(ctxcache_load_kv(conn_->c, id_.c_str(), nullptr, 0, 0, 0, &layout, nullptr, &e.msg), 0)
      << e.str();
  ctxcache_map_t* map = nullptr;
  ASSERT_EQ(ctxcache_map_kv_start(conn_->c, id_.c_str(), nullptr, 0, &map, &e.msg), 0) << e.str();
  EXPECT_EQ(SegmentMappings(), 1);
  ASSERT_EQ(ctxcache_map_wait_layer(map, 1, &e.msg), 0) << e.str();
  ASSERT_EQ(ctxcache_map_wait(map, &e.msg), 0) << e.str();
  const void* data = nullptr;
  uint64_t size = 0;
  ctxcache_map_layout_t ml{};
  ctxcache_map_get(map, &data, &size, &ml);
  const size_t layer_half = elems * 2 / ctx_.n_layers;  // K (or V) bytes of one layer
  EXPECT_EQ(ml.n_slots, 2u);
  EXPECT_EQ(ml.v_offset, layer_half);
  EXPECT_EQ(ml.layer_stride, 2 * layer_half);
  EXPECT_EQ(ml.token_stride, ctx_.head_dim * 2u);
  EXPECT_EQ(ml.dtype, CTXCACHE_BF16);
  ASSERT_EQ(size, 2 * elems * 2);
  const char* base = static_cast<const char*>(data);
  for (uint32_t slot = 0; slot < 2; ++slot) {
    const char* kl = reinterpret_cast<const char*>(k.data()) + slot * layer_half;
    const char* vl = reinterpret_cast<const char*>(v.data()) + slot * layer_half;
    EXPECT_EQ(std::memcmp(base + slot * ml.layer_stride, kl, layer_half), 0) << slot;
    EXPECT_EQ(std::memcmp(base + slot * ml.layer_stride + ml.v_offset, vl, layer_half), 0) << slot;
  }
  ctxcache_map_destroy(map);
  // Unmapped here; the server keeps no fd once the segment was taken.
  EXPECT_EQ(SegmentMappings(), 0);
  // The broker closes its fd right after handing it over: wait a bounded
  // number of steps for that close.
  for (int i = 0; i < 500 && SegmentFds(server_.pid()) > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(SegmentFds(server_.pid()), 0);

  // One layer; another is not mapped.
  const uint32_t one[] = {1};
  ASSERT_EQ(ctxcache_map_kv_start(conn_->c, id_.c_str(), one, 1, &map, &e.msg), 0) << e.str();
  Err bad;
  EXPECT_EQ(ctxcache_map_wait_layer(map, 0, &bad.msg), 3);
  EXPECT_NE(bad.str().find("layer: 0"), std::string::npos) << bad.str();
  ASSERT_EQ(ctxcache_map_wait(map, &e.msg), 0) << e.str();
  ctxcache_map_get(map, &data, &size, &ml);
  EXPECT_EQ(ml.n_slots, 1u);
  EXPECT_EQ(std::memcmp(data, reinterpret_cast<const char*>(k.data()) + layer_half, layer_half), 0);
  ctxcache_map_destroy(map);

  Err unknown;
  const uint32_t five[] = {5};
  EXPECT_EQ(ctxcache_map_kv_start(conn_->c, id_.c_str(), five, 1, &map, &unknown.msg), 3);
  EXPECT_NE(unknown.str().find("layers: 5 out of range"), std::string::npos) << unknown.str();
}

TEST_F(CApiTest, SegmentSocketRefusesUnknownTokens) {
  const std::string path = tmp_.path() + "/data/shm.sock";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  for (const std::string& token : {std::string(32, '0'), std::string("short")}) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
    ASSERT_EQ(send(s, token.data(), token.size(), 0), static_cast<ssize_t>(token.size()));
    if (token.size() < 32) shutdown(s, SHUT_WR);
    char reply = 0;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    iovec iov{&reply, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(s, &msg, 0);
    close(s);
    EXPECT_EQ(CMSG_FIRSTHDR(&msg), nullptr) << "an fd for token " << token;
    if (token.size() == 32) {
      EXPECT_EQ(n, 1);
      EXPECT_EQ(reply, 'E');
    } else {
      EXPECT_EQ(n, 0);  // closed without a reply
    }
  }
}

// A decode session through the C ABI: the session core in this process
// (client mode) selects and returns what the server's does, across an
// append; full selects every token with its stored K; bad params and bad
// handles are INVALID_ARGUMENT or NOT_FOUND.
TEST_F(CApiTest, SessionCoreInClientModeEqualsServerMode) {
  const uint32_t hq = ctx_.n_q_heads, d = ctx_.head_dim, layers = ctx_.n_layers;
  const uint32_t g = hq / ctx_.n_kv_heads;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  ctxcache_session_t* here = nullptr;
  ctxcache_session_t* there = nullptr;
  Err e1, e2;
  ASSERT_EQ(ctxcache_session_open(conn_->c, id_.c_str(), "csa", "rho=0.1;", 1, &here, &e1.msg),
            0)
      << e1.str();
  ASSERT_EQ(ctxcache_session_open(conn_->c, id_.c_str(), "csa", "rho=0.1", 0, &there, &e2.msg),
            0)
      << e2.str();
  for (int step = 0; step < 2; ++step) {
    for (uint32_t layer = 0; layer < layers; ++layer) {
      std::vector<float> q(size_t{hq} * d);
      for (float& x : q) x = normal(rng);
      ctxcache_step_t* a = nullptr;
      ctxcache_step_t* b = nullptr;
      ASSERT_EQ(ctxcache_session_step(here, layer, q.data(), &a, nullptr), 0);
      ASSERT_EQ(ctxcache_session_step(there, layer, q.data(), &b, nullptr), 0);
      ASSERT_EQ(ctxcache_step_n_heads(a), ctx_.n_kv_heads);
      for (uint32_t h = 0; h < ctx_.n_kv_heads; ++h) {
        ASSERT_EQ(ctxcache_step_group(a, h), g);
        const int32_t *ia, *ib;
        const float *ka, *kb, *va, *vb;
        const uint32_t *pa, *pb;
        size_t na, nb, npa, npb;
        ASSERT_EQ(ctxcache_step_head(a, h, &ia, &na, &ka, &va, &pa, &npa), 0);
        ASSERT_EQ(ctxcache_step_head(b, h, &ib, &nb, &kb, &vb, &pb, &npb), 0);
        ASSERT_GT(na, 0u);
        ASSERT_LT(na, static_cast<size_t>(kTokens));  // rho 0.1: a selection, not all
        EXPECT_EQ(std::vector<int32_t>(ia, ia + na), std::vector<int32_t>(ib, ib + nb));
        EXPECT_EQ(std::vector<uint32_t>(pa, pa + npa), std::vector<uint32_t>(pb, pb + npb));
        for (size_t i = 0; i < na; ++i) {  // stored rows: the same values
          if (ia[i] >= kTokens) continue;
          EXPECT_EQ(std::memcmp(ka + i * d, kb + i * d, d * 4), 0) << "token " << ia[i];
        }
        for (uint32_t j = 0; j < g; ++j) {
          const int32_t *qa, *qb;
          size_t nqa, nqb;
          ASSERT_EQ(ctxcache_step_q_head(a, h, j, &qa, &nqa), 0);
          ASSERT_EQ(ctxcache_step_q_head(b, h, j, &qb, &nqb), 0);
          EXPECT_EQ(std::vector<int32_t>(qa, qa + nqa), std::vector<int32_t>(qb, qb + nqb));
        }
      }
      const int32_t* ids;
      const float *k, *v;
      const uint32_t* pages;
      size_t n, np;
      EXPECT_EQ(ctxcache_step_head(a, ctx_.n_kv_heads, &ids, &n, &k, &v, &pages, &np), 5);
      EXPECT_EQ(ctxcache_step_q_head(a, 0, g, &ids, &n), 5);
      ctxcache_step_destroy(a);
      ctxcache_step_destroy(b);
    }
    std::vector<float> kv(size_t{layers} * ctx_.n_kv_heads * d), qs(size_t{layers} * hq * d);
    for (float& x : kv) x = normal(rng);
    for (float& x : qs) x = normal(rng);
    ASSERT_EQ(ctxcache_session_append(here, kv.data(), kv.data(), qs.data(), nullptr), 0);
    ASSERT_EQ(ctxcache_session_append(there, kv.data(), kv.data(), qs.data(), nullptr), 0);
    EXPECT_EQ(ctxcache_session_n_tokens(here), kTokens + step + 1);
    EXPECT_EQ(ctxcache_session_n_tokens(there), kTokens + step + 1);
  }
  ctxcache_session_destroy(here);
  ctxcache_session_destroy(there);

  ctxcache_session_t* bad = nullptr;
  Err e3;
  EXPECT_EQ(ctxcache_session_open(conn_->c, id_.c_str(), "csa", "rho", 1, &bad, &e3.msg), 3);
  EXPECT_NE(e3.str().find("params: expected key=value"), std::string::npos) << e3.str();
  EXPECT_EQ(bad, nullptr);
  Err e4;
  EXPECT_EQ(ctxcache_session_append(nullptr, nullptr, nullptr, nullptr, &e4.msg), 3);
}

// Protobuf wire encoding, enough for an IngestHeader: the test uses only
// the C ABI, which takes the header serialized.
void PutVarint(uint64_t v, std::string* out) {
  for (; v >= 0x80; v >>= 7) out->push_back(static_cast<char>((v & 0x7F) | 0x80));
  out->push_back(static_cast<char>(v));
}
void PutBytes(int field, const std::string& bytes, std::string* out) {
  PutVarint(static_cast<uint64_t>(field) << 3 | 2, out);
  PutVarint(bytes.size(), out);
  *out += bytes;
}
// Field `field` (length-delimited) of a serialized message; "" if absent.
std::string FindBytes(const std::string& msg, int field) {
  size_t i = 0;
  auto varint = [&] {
    uint64_t v = 0;
    for (int shift = 0; i < msg.size(); shift += 7) {
      const auto b = static_cast<uint8_t>(msg[i++]);
      v |= uint64_t{b & 0x7Fu} << shift;
      if (b < 0x80) break;
    }
    return v;
  };
  while (i < msg.size()) {
    const uint64_t key = varint();
    switch (key & 7) {
      case 0: varint(); break;
      case 1: i += 8; break;
      case 5: i += 4; break;
      case 2: {
        const uint64_t n = varint();
        if (static_cast<int>(key >> 3) == field) return msg.substr(i, n);
        i += n;
        break;
      }
      default: return "";
    }
  }
  return "";
}

// An IngestHeader: the model spec (serialized), tokens, one quest index, a name.
std::string IngestHeader(const std::string& model, const std::vector<uint32_t>& tokens) {
  std::string ids, token_ids, index, out;
  for (uint32_t t : tokens) PutVarint(t, &ids);
  PutBytes(1, ids, &token_ids);  // TokenIds.ids, packed
  PutBytes(1, "quest", &index);  // IndexSpec.method
  PutBytes(1, model, &out);
  PutBytes(2, token_ids, &out);
  PutBytes(3, index, &out);
  PutBytes(4, "ingested-by-c", &out);
  return out;
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Ingest through the C ABI equals what was loaded: layer 0 from a
// token-major bf16 buffer ([t][h][d], strided), layer 1 from dense f32
// (the server converts: bf16 values round-trip exactly), in frames far
// smaller than a layer. Refused layouts, out-of-order layers and an early
// commit name the field and leave the stream usable.
TEST_F(CApiTest, StepsCountTheirBytesAndTheClientCacheItsHits) {
  const uint32_t hq = ctx_.n_q_heads, d = ctx_.head_dim;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(size_t{hq} * d);
  for (float& x : q) x = normal(rng);
  ctxcache_session_t* here = nullptr;
  ctxcache_session_t* there = nullptr;
  ASSERT_EQ(ctxcache_session_open(conn_->c, id_.c_str(), "csa", "rho=0.1", 1, &here, nullptr),
            0);
  ASSERT_EQ(ctxcache_session_open(conn_->c, id_.c_str(), "csa", "rho=0.1", 0, &there, nullptr),
            0);
  // The same query twice on layer 0: client mode fetches its pages once,
  // then finds them in its page cache; server mode receives them each time.
  std::vector<ctxcache_step_counts_t> mine(2), theirs(2);
  uint64_t pages_used = 0;
  for (int i = 0; i < 2; ++i) {
    ctxcache_step_t* a = nullptr;
    ctxcache_step_t* b = nullptr;
    ASSERT_EQ(ctxcache_session_step(here, 0, q.data(), &a, nullptr), 0);
    ASSERT_EQ(ctxcache_session_step(there, 0, q.data(), &b, nullptr), 0);
    ctxcache_step_counts(a, &mine[i]);
    ctxcache_step_counts(b, &theirs[i]);
    if (i == 0) {
      for (uint32_t h = 0; h < ctx_.n_kv_heads; ++h) {
        const int32_t* ids;
        const float *k, *v;
        const uint32_t* pages;
        size_t n, np;
        ASSERT_EQ(ctxcache_step_head(a, h, &ids, &n, &k, &v, &pages, &np), 0);
        pages_used += np;
      }
    }
    ctxcache_step_destroy(a);
    ctxcache_step_destroy(b);
  }
  ASSERT_GT(pages_used, 0u);
  EXPECT_EQ(mine[0].pages_fetched, pages_used);
  EXPECT_EQ(mine[0].cache_hits, 0u);
  EXPECT_GE(mine[0].bytes_received, pages_used * 2 * d);  // K and V, >= 1 byte each element
  EXPECT_EQ(mine[1].bytes_received, 0u);
  EXPECT_EQ(mine[1].pages_fetched, 0u);
  EXPECT_EQ(mine[1].cache_hits, pages_used);
  for (const auto& t : theirs) {  // the server sends the same pages every step
    EXPECT_EQ(t.bytes_received, mine[0].bytes_received);
    EXPECT_EQ(t.pages_fetched, pages_used);
    EXPECT_EQ(t.cache_hits, 0u);
  }
  ctxcache_page_cache_stats_t cache{}, none{};
  ctxcache_session_page_cache_stats(here, &cache);
  ctxcache_session_page_cache_stats(there, &none);
  EXPECT_EQ(cache.misses, pages_used);
  EXPECT_GE(cache.hits, pages_used);
  EXPECT_GT(cache.bytes, 0u);
  EXPECT_EQ(none.hits + none.misses + none.bytes, 0u);  // no client-side cache
  ctxcache_step_counts(nullptr, &mine[0]);              // NULLs are ignored
  ctxcache_session_page_cache_stats(here, nullptr);
  ctxcache_session_destroy(here);
  ctxcache_session_destroy(there);
}

TEST_F(CApiTest, IngestFromCallerBuffersEqualsLoad) {
  const uint32_t L = ctx_.n_layers, H = ctx_.n_kv_heads, D = ctx_.head_dim;
  const size_t elems = size_t{L} * H * kTokens * D;
  std::vector<uint16_t> k(elems), v(elems);
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  Err e;
  ASSERT_EQ(ctxcache_load_kv(conn_->c, id_.c_str(), nullptr, 0, 2, 0, &layout, nullptr, &e.msg),
            0)
      << e.str();
  char* proto = nullptr;
  size_t len = 0;
  ctxcache_context_t info{};
  ASSERT_EQ(ctxcache_get_context(conn_->c, id_.c_str(), &info, &proto, &len, nullptr), 0);
  const std::string model = FindBytes(std::string(proto, len), 5);  // ContextInfo.model
  ctxcache_free(proto);
  ASSERT_FALSE(model.empty());
  std::mt19937 rng(1);  // BuildRandom's tokens
  std::vector<uint32_t> tokens(kTokens);
  for (auto& t : tokens) t = rng() % 512;
  const std::string header = IngestHeader(model, tokens);

  Err bad;
  ctxcache_ingest_t* in = nullptr;
  EXPECT_EQ(ctxcache_ingest_start(conn_->c, "\xff\xff", 2, nullptr, &in, &bad.msg), 3);
  EXPECT_NE(bad.str().find("header: not a serialized"), std::string::npos) << bad.str();
  EXPECT_EQ(in, nullptr);
  Err no_tokens;
  std::string empty;
  PutBytes(1, model, &empty);
  EXPECT_EQ(ctxcache_ingest_start(conn_->c, empty.data(), empty.size(), nullptr, &in,
                                  &no_tokens.msg),
            3);
  EXPECT_NE(no_tokens.str().find("header.tokens: empty"), std::string::npos) << no_tokens.str();

  const ctxcache_ingest_options_t small{1000, 0, 0};  // frames far below a layer
  ASSERT_EQ(ctxcache_ingest_start(conn_->c, header.data(), header.size(), &small, &in, &e.msg), 0)
      << e.str();
  // Layer 0, token-major: element (h, t, j) at (t * H + h) * D + j.
  const size_t layer_elems = size_t{H} * kTokens * D;
  std::vector<uint16_t> k0(layer_elems), v0(layer_elems);
  for (uint32_t h = 0; h < H; ++h) {
    for (size_t t = 0; t < kTokens; ++t) {
      const size_t from = (size_t{h} * kTokens + t) * D, to = (t * H + h) * D;
      std::memcpy(&k0[to], &k[from], D * 2);
      std::memcpy(&v0[to], &v[from], D * 2);
    }
  }
  ctxcache_ingest_layer_t l0{k0.data(), v0.data(), nullptr, layer_elems * 2, layer_elems * 2,
                             0, int64_t{D} * 2, int64_t{H} * D * 2, 0, 0, CTXCACHE_BF16};
  struct Case {
    uint32_t layer;
    ctxcache_ingest_layer_t layout;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({1, l0, "layer: 1, expected 0"});
  cases.push_back({0, l0, "layout.k_capacity"});
  cases.back().layout.k_capacity -= 1;
  cases.push_back({0, l0, "layout.token_stride"});
  cases.back().layout.token_stride = 2;
  cases.push_back({0, l0, "layout.head_stride"});
  cases.back().layout.head_stride = -2;
  cases.push_back({0, l0, "layout.dtype"});
  cases.back().layout.dtype = 9;
  cases.push_back({0, l0, "layout.v: null buffer"});
  cases.back().layout.v = nullptr;
  for (const Case& c : cases) {
    Err err;
    EXPECT_EQ(ctxcache_ingest_write_layer(in, c.layer, &c.layout, &err.msg), 3) << c.field;
    EXPECT_NE(err.str().find(c.field), std::string::npos) << err.str();
  }
  ASSERT_EQ(ctxcache_ingest_write_layer(in, 0, &l0, &e.msg), 0) << e.str();
  Err early;
  EXPECT_EQ(ctxcache_ingest_commit(in, nullptr, nullptr, nullptr, nullptr, &early.msg), 9);
  EXPECT_NE(early.str().find("Commit after 1 layers"), std::string::npos) << early.str();
  std::vector<float> k1(layer_elems), v1(layer_elems);
  for (size_t i = 0; i < layer_elems; ++i) {
    k1[i] = Bf16ToFloat(k[layer_elems + i]);
    v1[i] = Bf16ToFloat(v[layer_elems + i]);
  }
  ctxcache_ingest_layer_t l1{k1.data(), v1.data(), nullptr, layer_elems * 4, layer_elems * 4,
                             0, 0, 0, 0, 0, CTXCACHE_F32};
  ASSERT_EQ(ctxcache_ingest_write_layer(in, 1, &l1, &e.msg), 0) << e.str();
  ctxcache_context_t stored{};
  char* stored_id = nullptr;
  ASSERT_EQ(ctxcache_ingest_commit(in, &stored, &stored_id, nullptr, nullptr, &e.msg), 0)
      << e.str();
  ctxcache_ingest_destroy(in);
  const std::string ingested = stored_id;
  ctxcache_free(stored_id);
  EXPECT_NE(ingested, id_);  // ingested KV lives apart from built KV
  EXPECT_EQ(stored.n_tokens, static_cast<uint64_t>(kTokens));
  EXPECT_EQ(stored.state, 2);

  std::vector<uint16_t> k2(elems), v2(elems);
  ctxcache_kv_layout_t back{k2.data(), v2.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  ASSERT_EQ(ctxcache_load_kv(conn_->c, ingested.c_str(), nullptr, 0, 1, 0, &back, nullptr,
                             &e.msg),
            0)
      << e.str();
  EXPECT_EQ(k2, k);
  EXPECT_EQ(v2, v);
}

TEST(CApiMapOffTest, MapKVOffIsFailedPrecondition) {
  TempDir tmp;
  ServerProcess server;
  std::vector<std::string> args = ModelArgs();
  args.insert(args.end(), {"--shm-socket", "off"});
  ASSERT_TRUE(server.Start(tmp.path() + "/data", args)) << server.log();
  Connected conn(server.address());
  const std::string id = BuildRandom(conn.c, 40, 4);
  ctxcache_map_t* map = nullptr;
  Err e;
  EXPECT_EQ(ctxcache_map_kv_start(conn.c, id.c_str(), nullptr, 0, &map, &e.msg), 9);
  EXPECT_NE(e.str().find("--shm-socket off"), std::string::npos) << e.str();
  EXPECT_FALSE(std::filesystem::exists(tmp.path() + "/data/shm.sock"));
}

TEST(CApiCorruptionTest, CorruptedPageIsDataLoss) {
  TempDir tmp;
  ServerProcess server;
  std::vector<std::string> args = ModelArgs();
  args.push_back("--fault-corrupt-pages-for-testing");
  ASSERT_TRUE(server.Start(tmp.path() + "/data", args)) << server.log();
  Connected conn(server.address());
  const std::string id = BuildRandom(conn.c, 100, 3);
  const size_t elems = 2 * 2 * 100 * 32;
  std::vector<uint16_t> k(elems), v(elems);
  ctxcache_kv_layout_t layout{k.data(), v.data(), elems * 2, elems * 2, 0, 0, 0, CTXCACHE_BF16};
  Err e;
  EXPECT_EQ(ctxcache_load_kv(conn.c, id.c_str(), nullptr, 0, 0, 0, &layout, nullptr, &e.msg), 15);
  EXPECT_NE(e.str().find("crc32c mismatch"), std::string::npos) << e.str();
  EXPECT_NE(e.str().find("block 0"), std::string::npos) << e.str();
  // The same for some pages only (FetchKV with page tables): the frame's
  // first page, block 2, is the corrupted one.
  const uint32_t blocks[] = {2, 5};
  const ctxcache_page_table_t tables[] = {{1, 1, blocks, 2}};
  Err some;
  EXPECT_EQ(ctxcache_fetch_pages_into(conn.c, id.c_str(), tables, 1, &layout, &some.msg), 15);
  EXPECT_NE(some.str().find("crc32c mismatch"), std::string::npos) << some.str();
  EXPECT_NE(some.str().find("layer 1, kv head 1, block 2"), std::string::npos) << some.str();
}

TEST(CApiConnectTest, BadOptionsAndUnreachableServer) {
  ctxcache_options_t* o = ctxcache_options_create();
  ctxcache_options_set_tls(o, nullptr, "/nonexistent.pem", "/nonexistent.key", nullptr);
  ctxcache_client_t* c = nullptr;
  Err e;
  EXPECT_EQ(ctxcache_connect(o, &c, &e.msg), 3);
  EXPECT_NE(e.str().find("tls_ca"), std::string::npos) << e.str();
  EXPECT_EQ(c, nullptr);
  ctxcache_options_set_tls(o, nullptr, nullptr, nullptr, nullptr);
  ctxcache_options_set_server(o, "127.0.0.1:1");
  ctxcache_options_set_max_attempts(o, 1);
  ctxcache_options_set_timeout(o, 5);
  Err e2;
  ASSERT_EQ(ctxcache_connect(o, &c, &e2.msg), 0) << e2.str();
  ctxcache_context_t info{};
  Err e3;
  EXPECT_EQ(
      ctxcache_get_context(c, "00112233445566778899aabbccddeeff", &info, nullptr, nullptr, &e3.msg),
      14);
  ctxcache_client_destroy(c);
  ctxcache_options_destroy(o);
}

}  // namespace
}  // namespace ctxcache
