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
#include "common/version.h"


namespace ctxcache::cli {

namespace {

// Flags of the commands that call a server. On the top-level app they also
// read the environment (flag > environment > default); the copies on each
// subcommand (so they may follow its name) do not, or an unset flag there
// would overwrite a flag given before the subcommand.
void AddConnectionFlags(CLI::App* a, GlobalOptions* g, bool with_env) {
  auto env = [with_env](CLI::Option* o, const char* name) {
    if (with_env) o->envname(name);
    return o;
  };
  env(a->add_option("--server", g->server, "ctxcached address HOST:PORT, or etcd://..."),
      "CTXCACHE_SERVER")
      ->capture_default_str();
  env(a->add_option("--timeout", g->timeout_s, "Per-RPC deadline in seconds"), "CTXCACHE_TIMEOUT")
      ->capture_default_str();
  env(a->add_option("--dial-timeout", g->dial_timeout_s,
                    "Seconds to wait for the connection before giving up (exit 3)"),
      "CTXCACHE_DIAL_TIMEOUT")
      ->capture_default_str();
  env(a->add_option("--tls-ca", g->tls_ca, "Use TLS; the server's CA bundle (PEM)"),
      "CTXCACHE_TLS_CA");
  env(a->add_option("--tls-cert", g->tls_cert, "Client certificate (PEM) for mTLS"),
      "CTXCACHE_TLS_CERT");
  env(a->add_option("--tls-key", g->tls_key, "Client private key (PEM) for mTLS"),
      "CTXCACHE_TLS_KEY");
  env(a->add_option("--tls-server-name", g->tls_server_name,
                    "Verify the server certificate against this name"),
      "CTXCACHE_TLS_SERVER_NAME");
  env(a->add_option("--api-key-file", g->api_key_file,
                    "File holding the API key (or set CTXCACHE_API_KEY)"),
      "CTXCACHE_API_KEY_FILE");
  a->add_option("--api-key", g->api_key,
                "API key (visible in the process list: prefer --api-key-file)");
}

void AddOutputFlags(CLI::App* a, GlobalOptions* g, bool with_env) {
  CLI::Option* json = a->add_flag("--json", g->json, "Print JSON instead of tables");
  if (with_env) json->envname("CTXCACHE_JSON");
}

constexpr const char* kFooter =
    "Environment: CTXCACHE_SERVER, CTXCACHE_TIMEOUT, CTXCACHE_DIAL_TIMEOUT, CTXCACHE_TLS_CA,\n"
    "CTXCACHE_TLS_CERT, CTXCACHE_TLS_KEY, CTXCACHE_TLS_SERVER_NAME, CTXCACHE_API_KEY_FILE,\n"
    "CTXCACHE_API_KEY, CTXCACHE_JSON (a flag overrides its variable).\n"
    "Exit codes: 0 ok; 1 the server refused the call (or health is not SERVING, or fsck\n"
    "found a problem); 2 usage: bad flags, values or input files; 3 the server could\n"
    "not be reached or did not answer in time (docs/cli.md).";

}  // namespace

int RunCli(int argc, char** argv) {
  CLI::App app{"ctxcache: admin CLI and reference decode worker for ctxcached", "ctxcache"};
  GlobalOptions global;
  AddConnectionFlags(&app, &global, /*with_env=*/true);
  AddOutputFlags(&app, &global, /*with_env=*/true);
  app.set_version_flag("--version", ctxcache::VersionString("ctxcache"),
                       "Print the version and exit");
  app.footer(kFooter);
  app.require_subcommand(1);

  std::map<CLI::App*, std::unique_ptr<Command>> commands;
  // offline: the command calls no server, so its help lists no server flags.
  auto add_command = [&](const char* name, const char* help, std::unique_ptr<Command> cmd,
                         bool offline) {
    CLI::App* sub = app.add_subcommand(name, help);
    // Let global flags also appear after the subcommand name.
    if (!offline) AddConnectionFlags(sub, &global, /*with_env=*/false);
    AddOutputFlags(sub, &global, /*with_env=*/false);
    cmd->Configure(sub);
    commands[sub] = std::move(cmd);
  };
  auto add = [&](const char* name, const char* help, std::unique_ptr<Command> cmd) {
    add_command(name, help, std::move(cmd), /*offline=*/false);
  };
  auto add_offline = [&](const char* name, const char* help, std::unique_ptr<Command> cmd) {
    add_command(name, help, std::move(cmd), /*offline=*/true);
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
  add("share", "Admin (own tenant) or operator: make a context readable by every tenant",
      std::make_unique<ShareCommand>(true));
  add("unshare", "Admin (own tenant) or operator: make a shared context private again",
      std::make_unique<ShareCommand>(false));
  add("stats", "Server statistics", std::make_unique<StatsCommand>());
  add("watch", "Stream context events (created, ready, extended, evicted, failed)",
      std::make_unique<WatchCommand>());
  add("generate", "Decode against a context with sparse attention (reference worker)",
      std::make_unique<GenerateCommand>());
  add("cluster", "Cluster status: nodes, health, owned contexts, replication lag",
      std::make_unique<ClusterCommand>());
  add("health", "Check the server's health (exit 0 if SERVING)", std::make_unique<HealthCommand>());
  add_offline("keys", "Manage API keys in a keys file (create, list, revoke, map-cert); offline",
      std::make_unique<KeysCommand>());
  add_offline("tokenize", "Tokenize text with a local model's tokenizer; prints token ids as JSON",
      std::make_unique<TokenizeCommand>());
  add_offline("fsck", "Check a data dir offline (server stopped): verify every context's checksums",
      std::make_unique<FsckCommand>());

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; CLI11's own codes (104, 106, 109, ...)
    // all mean usage.
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  for (auto& [sub, cmd] : commands) {
    if (sub->parsed()) return cmd->Run(global, std::cout, std::cerr);
  }
  return kExitUsage;
}

}  // namespace ctxcache::cli
