// `ctxcache health` against a real ctxcached, and against a down server.
#include <gtest/gtest.h>

#include <string>

#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ServerProcess;
using testing::TempDir;

std::string Cli() { return testing::BinDir() + "/ctxcache"; }

TEST(CliHealthTest, ServingServerExitsZero) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data")) << server.log();
  std::string out;
  EXPECT_EQ(ServerProcess::RunCapture({Cli(), "health", "--server", server.address()}, &out), 0);
  EXPECT_EQ(out, "SERVING\n");
  EXPECT_EQ(
      ServerProcess::RunCapture({Cli(), "--json", "health", "--server", server.address()}, &out),
      0);
  EXPECT_NE(out.find("\"status\":\"SERVING\""), std::string::npos) << out;
}

TEST(CliHealthTest, DownServerPrintsOneClearLine) {
  std::string out;
  // Port 1 on loopback: nothing listens there.
  int code = ServerProcess::RunCapture(
      {Cli(), "health", "--server", "127.0.0.1:1", "--timeout", "2"}, &out);
  EXPECT_EQ(code, 3);  // unreachable (docs/cli.md)
  EXPECT_NE(out.find("cannot reach ctxcached at 127.0.0.1:1"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

}  // namespace
}  // namespace ctxcache
