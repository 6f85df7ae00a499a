// SDK behaviour against a real ctxcached: the client-side page cache and its
// byte budget, and retries across a server restart.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "ctxcache/client.h"
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
  return {"--model-dir", testing::SourceDir() + "/tests/data/golden", "--default-model", "llama3"};
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
