// Helpers shared by the CLI subcommands.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "client/cli/command.h"
#include "common/status.h"
#include "ctxcache/client.h"

namespace ctxcache::cli {

// Copies the TLS options and the API key (from --api-key-file,
// $CTXCACHE_API_KEY or --api-key) into `o`.
Status ApplyCredentials(const GlobalOptions& global, client::ClientOptions* o);

// Connects with the global options and waits up to --dial-timeout for the
// connection. On failure prints the error, sets *exit_code (kExitUsage for
// bad options, kExitUnreachable when the server cannot be reached) and
// returns null.
std::unique_ptr<client::Client> ConnectOrExplain(const GlobalOptions& global, std::ostream& err,
                                                 int* exit_code);

// Prints "ctxcache: <message>" for a failed call and returns the exit code:
// kExitUnreachable for UNAVAILABLE and DEADLINE_EXCEEDED, else kExitFailed.
int Fail(const Status& s, const GlobalOptions& global, std::ostream& err);

// 1234567 -> "1.2 MB".
std::string HumanBytes(uint64_t bytes);
// ms since epoch -> "2026-11-21T06:00:00Z" ("-" for 0).
std::string HumanTime(int64_t ms);
nlohmann::json InfoToJson(const v1::ContextInfo& info);
std::string StateName(v1::ContextState s);

}  // namespace ctxcache::cli
