// The `ctxcache` CLI's conventions (docs/cli.md) against a real ctxcached:
// exit codes (0 ok, 1 refused, 2 usage, 3 unreachable), CTXCACHE_*
// environment variables below flags, defaults shown in the help, no server
// flags in the help of offline commands, and --version.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ServerProcess;
using testing::TempDir;

std::string Cli() { return testing::BinDir() + "/ctxcache"; }

int RunCli(std::vector<std::string> args, std::string* out) {
  args.insert(args.begin(), Cli());
  return ServerProcess::RunCapture(args, out);
}

// Sets an environment variable for the CLI processes this scope starts.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

class CliConventionsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    server_ = new ServerProcess();
    ASSERT_TRUE(server_->Start(tmp_->path() + "/data")) << server_->log();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete tmp_;
  }
  static std::string Address() { return server_->address(); }

  static inline TempDir* tmp_ = nullptr;
  static inline ServerProcess* server_ = nullptr;
};

TEST_F(CliConventionsTest, ExitCodesFollowTheDocumentedConvention) {
  std::string out;
  EXPECT_EQ(RunCli({"--server", Address(), "ls"}, &out), 0) << out;
  // 1: the server refused the call.
  EXPECT_EQ(RunCli({"--server", Address(), "show", std::string(32, '0')}, &out), 1) << out;
  EXPECT_EQ(RunCli({"--server", Address(), "evict", "not-an-id"}, &out), 1) << out;
  // 2: usage, whatever CLI11's own code (it used 106, 109 and 104).
  EXPECT_EQ(RunCli({"--server", Address(), "show"}, &out), 2) << out;                // missing id
  EXPECT_EQ(RunCli({"--server", Address(), "ls", "--no-such-flag"}, &out), 2) << out;
  EXPECT_EQ(RunCli({"--server", Address(), "--timeout", "soon", "ls"}, &out), 2) << out;
  EXPECT_EQ(RunCli({"no-such-command"}, &out), 2) << out;
  EXPECT_EQ(RunCli({}, &out), 2) << out;
  // 3: nothing listens on port 1; every command that calls the server agrees.
  for (const char* cmd : {"ls", "stats", "health", "cluster"}) {
    std::vector<std::string> args = {"--server", "127.0.0.1:1", "--timeout", "2",
                                     "--dial-timeout", "2", cmd};
    if (std::string(cmd) == "cluster") args.push_back("status");
    EXPECT_EQ(RunCli(args, &out), 3) << cmd << ": " << out;
    EXPECT_NE(out.find("127.0.0.1:1"), std::string::npos) << cmd << ": " << out;
  }
  EXPECT_EQ(RunCli({"--server", "127.0.0.1:1", "--dial-timeout", "1", "show", std::string(32, '0')},
                &out),
            3)
      << out;
  EXPECT_NE(out.find("--dial-timeout"), std::string::npos) << out;
}

TEST_F(CliConventionsTest, EnvironmentSetsFlagsAndFlagsWin) {
  std::string out;
  {
    ScopedEnv server("CTXCACHE_SERVER", Address());
    EXPECT_EQ(RunCli({"health"}, &out), 0) << out;
    EXPECT_EQ(RunCli({"ls"}, &out), 0) << out;
  }
  {
    ScopedEnv server("CTXCACHE_SERVER", "127.0.0.1:1");
    // A flag beats the variable, before or after the subcommand name.
    EXPECT_EQ(RunCli({"--server", Address(), "ls"}, &out), 0) << out;
    EXPECT_EQ(RunCli({"ls", "--server", Address()}, &out), 0) << out;
    EXPECT_EQ(RunCli({"--dial-timeout", "1", "ls"}, &out), 3) << out;
  }
  {
    ScopedEnv json("CTXCACHE_JSON", "1");
    EXPECT_EQ(RunCli({"--server", Address(), "health"}, &out), 0) << out;
    EXPECT_NE(out.find("\"status\":\"SERVING\""), std::string::npos) << out;
  }
}

TEST(CliHelpTest, ShowsDefaultsAndEnvironment) {
  std::string out;
  EXPECT_EQ(RunCli({"--help"}, &out), 0) << out;
  EXPECT_NE(out.find("CTXCACHE_SERVER"), std::string::npos) << out;
  EXPECT_NE(out.find("Exit codes"), std::string::npos) << out;
  EXPECT_EQ(RunCli({"ls", "--help"}, &out), 0) << out;
  const size_t timeout = out.find("--timeout");
  ASSERT_NE(timeout, std::string::npos) << out;
  EXPECT_NE(out.substr(timeout, out.find('\n', timeout) - timeout).find("=10"), std::string::npos)
      << out;
  EXPECT_NE(out.find("--dial-timeout"), std::string::npos) << out;
}

// Regression: keys and fsck listed --server, --tls-* and --api-key.
TEST(CliHelpTest, OfflineCommandsListNoServerFlags) {
  for (const char* cmd : {"keys", "fsck", "tokenize"}) {
    std::string out;
    EXPECT_EQ(RunCli({cmd, "--help"}, &out), 0) << out;
    for (const char* flag : {"--server", "--tls-ca", "--api-key", "--timeout"}) {
      EXPECT_EQ(out.find(flag), std::string::npos) << cmd << " lists " << flag << ":\n" << out;
    }
    EXPECT_NE(out.find("--json"), std::string::npos) << cmd << ":\n" << out;
  }
  std::string out;
  EXPECT_EQ(RunCli({"fsck", "--server", "127.0.0.1:1", "--data-dir", "/nonexistent"}, &out), 2)
      << out;
}

TEST(CliHelpTest, VersionPrintsVersionAndRevision) {
  std::string out;
  EXPECT_EQ(RunCli({"--version"}, &out), 0) << out;
  EXPECT_EQ(out.rfind("ctxcache ", 0), 0u) << out;
  EXPECT_NE(out.find("(revision "), std::string::npos) << out;
}

}  // namespace
}  // namespace ctxcache
