#include <iostream>
#include <map>
#include <memory>

#include "client/cli/admin_commands.h"
#include "client/cli/command.h"
#include "client/cli/fsck_command.h"
#include "client/cli/generate_command.h"
#include "client/cli/cluster_command.h"
#include "client/cli/health_command.h"
#include "client/cli/keys_command.h"
#include "client/cli/tokenize_command.h"

namespace ctxcache::cli {

int RunCli(int argc, char** argv) {
  CLI::App app{"ctxcache: admin CLI and reference decode worker for ctxcached", "ctxcache"};
  GlobalOptions global;
  auto add_globals = [&](CLI::App* a) {
    a->add_option("--server", global.server, "ctxcached address HOST:PORT");
    a->add_flag("--json", global.json, "Print JSON instead of tables");
    a->add_option("--timeout", global.timeout_s, "Per-RPC deadline in seconds");
    a->add_option("--tls-ca", global.tls_ca, "Use TLS; the server's CA bundle (PEM)");
    a->add_option("--tls-cert", global.tls_cert, "Client certificate (PEM) for mTLS");
    a->add_option("--tls-key", global.tls_key, "Client private key (PEM) for mTLS");
    a->add_option("--tls-server-name", global.tls_server_name,
                  "Verify the server certificate against this name");
    a->add_option("--api-key-file", global.api_key_file,
                  "File holding the API key (or set CTXCACHE_API_KEY)");
    a->add_option("--api-key", global.api_key,
                  "API key (visible in the process list: prefer --api-key-file)");
  };
  add_globals(&app);
  app.require_subcommand(1);

  std::map<CLI::App*, std::unique_ptr<Command>> commands;
  auto add = [&](const char* name, const char* help, std::unique_ptr<Command> cmd) {
    CLI::App* sub = app.add_subcommand(name, help);
    // Let global flags also appear after the subcommand name.
    add_globals(sub);
    cmd->Configure(sub);
    commands[sub] = std::move(cmd);
  };
  add("build", "Build a context from text or token ids (progress bar on a TTY)",
      std::make_unique<BuildCommand>());
  add("ls", "List contexts", std::make_unique<ListCommand>());
  add("show", "Show one context: manifest, sizes per artifact kind, index params",
      std::make_unique<ShowCommand>());
  add("evict", "Evict a context (deferred while sessions are open)",
      std::make_unique<EvictCommand>());
  add("pin", "Pin a context against eviction", std::make_unique<PinCommand>(true));
  add("unpin", "Unpin a context", std::make_unique<PinCommand>(false));
  add("share", "Admin: make a context readable by every tenant",
      std::make_unique<ShareCommand>(true));
  add("unshare", "Admin: make a shared context private to its tenant again",
      std::make_unique<ShareCommand>(false));
  add("stats", "Server statistics", std::make_unique<StatsCommand>());
  add("watch", "Stream context events (created, ready, extended, evicted, failed)",
      std::make_unique<WatchCommand>());
  add("generate", "Decode against a context with sparse attention (reference worker)",
      std::make_unique<GenerateCommand>());
  add("cluster", "Cluster status: nodes, health, owned contexts, replication lag",
      std::make_unique<ClusterCommand>());
  add("health", "Check the server's health (exit 0 if SERVING)", std::make_unique<HealthCommand>());
  add("keys", "Manage API keys in a keys file (create, list, revoke, map-cert); offline",
      std::make_unique<KeysCommand>());
  add("tokenize", "Tokenize text with a local model's tokenizer; prints token ids as JSON",
      std::make_unique<TokenizeCommand>());
  add("fsck", "Check a data dir offline (server stopped): verify every context's checksums",
      std::make_unique<FsckCommand>());

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (auto& [sub, cmd] : commands) {
    if (sub->parsed()) return cmd->Run(global, std::cout, std::cerr);
  }
  return 2;
}

}  // namespace ctxcache::cli
