#include "client/cli/admin_commands.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "client/cli/cli_util.h"
#include "index/methods.h"

namespace ctxcache::cli {

namespace {

bool ParseKeyValues(const std::vector<std::string>& items, const char* flag,
                    std::map<std::string, std::string>* out, std::ostream& err) {
  for (const auto& kv : items) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      err << "ctxcache: " << flag << " '" << kv << "' must look like KEY=VALUE\n";
      return false;
    }
    (*out)[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return true;
}

const char* PhaseName(v1::BuildProgress::Phase p) {
  switch (p) {
    case v1::BuildProgress::QUEUED:
      return "queued";
    case v1::BuildProgress::TOKENIZING:
      return "tokenizing";
    case v1::BuildProgress::PREFILL:
      return "prefill";
    case v1::BuildProgress::INDEXING:
      return "indexing";
    case v1::BuildProgress::COMMITTING:
      return "committing";
    case v1::BuildProgress::DONE:
      return "done";
    default:
      return "starting";
  }
}

// Live progress: a redrawn bar on a TTY, a line per phase / 2 s otherwise.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(std::ostream& err) : err_(err), tty_(isatty(2)) {}
  void Update(const v1::BuildProgress& p) {
    auto now = std::chrono::steady_clock::now();
    double frac = 0;
    if (p.phase() == v1::BuildProgress::PREFILL && p.tokens_total() > 0) {
      frac = 0.9 * p.tokens_prefilled() / static_cast<double>(p.tokens_total());
    } else if (p.phase() == v1::BuildProgress::INDEXING && p.layers_total() > 0) {
      frac = 0.9 + 0.09 * p.layers_indexed() / static_cast<double>(p.layers_total());
    } else if (p.phase() >= v1::BuildProgress::COMMITTING) {
      frac = p.phase() == v1::BuildProgress::DONE ? 1.0 : 0.99;
    }
    std::ostringstream line;
    line << std::left << std::setw(10) << PhaseName(p.phase());
    if (p.phase() == v1::BuildProgress::QUEUED) {
      line << " position " << p.queue_position();
    } else {
      line << " " << p.tokens_prefilled() << "/" << p.tokens_total() << " tokens";
      if (p.layers_total())
        line << ", " << p.layers_indexed() << "/" << p.layers_total() << " layers indexed";
      line << ", " << HumanBytes(p.bytes_written()) << " written";
      if (p.tokens_per_s() > 0) line << ", " << static_cast<int64_t>(p.tokens_per_s()) << " tok/s";
      if (p.eta_s() > 0 && p.phase() == v1::BuildProgress::PREFILL) {
        line << ", ETA " << std::fixed << std::setprecision(1) << p.eta_s() << " s";
      }
    }
    if (tty_) {
      const int width = 30;
      int filled = static_cast<int>(frac * width);
      err_ << "\r\033[K[" << std::string(filled, '#') << std::string(width - filled, ' ') << "] "
           << std::setw(3) << static_cast<int>(frac * 100) << "% " << line.str() << std::flush;
      if (p.phase() == v1::BuildProgress::DONE) err_ << "\n";
    } else if (p.phase() != last_phase_ || now - last_ > std::chrono::seconds(2) ||
               p.phase() == v1::BuildProgress::DONE) {
      err_ << "build: " << static_cast<int>(frac * 100) << "% " << line.str() << "\n";
      last_ = now;
    }
    last_phase_ = p.phase();
  }

 private:
  std::ostream& err_;
  bool tty_;
  v1::BuildProgress::Phase last_phase_ = v1::BuildProgress::PHASE_UNSPECIFIED;
  std::chrono::steady_clock::time_point last_;
};

void PrintInfoTable(const v1::ContextInfo& info, std::ostream& out) {
  out << "context_id     " << info.context_id() << "\n"
      << "name           " << (info.name().empty() ? "-" : info.name()) << "\n"
      << "state          " << StateName(info.state()) << "\n"
      << "model          " << info.model_name() << " (" << info.model().n_layers() << " layers, "
      << info.model().n_q_heads() << " q / " << info.model().n_kv_heads()
      << " kv heads, d=" << info.model().head_dim() << ")\n"
      << "tokens         " << info.n_tokens() << " (pages of " << info.block_tokens() << ")\n"
      << "stored         " << HumanBytes(info.stored_bytes()) << " (raw KV "
      << HumanBytes(info.raw_kv_bytes()) << ")\n";
  for (const auto& [k, v] : info.bytes_by_kind()) {
    out << "  " << std::left << std::setw(17) << k << HumanBytes(v) << "\n";
  }
  out << "indexes        ";
  for (int i = 0; i < info.indexes_size(); ++i) {
    const auto& ip = info.indexes(i);
    out << (i ? "; " : "") << ip.method();
    std::string ps;
    for (const auto& [k, v] : ip.params()) ps += (ps.empty() ? "" : ",") + k + "=" + v;
    if (!ps.empty()) out << " (" << ps << ")";
  }
  out << (info.indexes_size() ? "" : "-") << "\n"
      << "created        " << HumanTime(info.created_at_ms()) << "\n"
      << "last access    " << HumanTime(info.last_access_ms()) << "\n"
      << "expires        " << HumanTime(info.expires_at_ms()) << "\n"
      << "pinned         " << (info.pinned() ? "yes" : "no") << "\n";
  if (!info.labels().empty()) {
    out << "labels         ";
    bool first = true;
    for (const auto& [k, v] : info.labels()) {
      out << (first ? "" : ",") << k << "=" << v;
      first = false;
    }
    out << "\n";
  }
  if (!info.parent_id().empty()) {
    out << "parent         " << info.parent_id() << " (shares " << info.prefix_tokens()
        << " tokens)\n";
  }
}

}  // namespace

void BuildCommand::Configure(CLI::App* sub) {
  sub->add_option("--file", file_, "Read the context text from FILE");
  sub->add_option("--text", text_, "The context text");
  sub->add_flag("--stdin", stdin_, "Read the context text from standard input");
  sub->add_option("--tokens", token_ids_, "Token ids instead of text")->delimiter(',');
  sub->add_option("--model", model_, "Model name under the server's --model-dir");
  sub->add_option("--name", name_, "A name for the context");
  sub->add_option("--label", labels_, "KEY=VALUE label (repeatable)");
  sub->add_option("--tenant", tenant_, "Tenant (another than the key's: operator only)");
  sub->add_option("--ttl", ttl_s_, "Time to live in seconds (0 = server default)");
  sub->add_flag("--pin", pin_, "Pin the context against eviction");
  sub->add_flag("--bos", bos_, "Prepend the tokenizer's BOS token");
  sub->add_option("--index", indexes_,
                  "Index method to build (repeatable): " + index::MethodNamesForMessages());
  sub->add_option("--index-param", index_params_,
                  "METHOD.KEY=VALUE index parameter (repeatable), e.g. csa.alpha=0.3");
}

int BuildCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  v1::BuildContextRequest req;
  int sources = !file_.empty() + !text_.empty() + stdin_ + !token_ids_.empty();
  if (sources != 1) {
    err << "ctxcache: build needs exactly one of --file, --text, --stdin or --tokens\n";
    return kExitUsage;
  }
  if (!file_.empty()) {
    std::ifstream f(file_);
    if (!f) {
      err << "ctxcache: cannot read --file " << file_ << "\n";
      return kExitUsage;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    req.set_text(ss.str());
  } else if (stdin_) {
    std::stringstream ss;
    ss << std::cin.rdbuf();
    req.set_text(ss.str());
  } else if (!text_.empty()) {
    req.set_text(text_);
  } else {
    for (uint32_t t : token_ids_) req.mutable_tokens()->add_ids(t);
  }
  req.set_model(model_);
  req.set_name(name_);
  req.set_tenant(tenant_);
  req.set_ttl_seconds(ttl_s_);
  req.set_pin(pin_);
  req.set_add_bos(bos_);
  std::map<std::string, std::string> labels;
  if (!ParseKeyValues(labels_, "--label", &labels, err)) return kExitUsage;
  req.mutable_labels()->insert(labels.begin(), labels.end());
  std::map<std::string, v1::IndexSpec*> by_method;
  for (const auto& m : indexes_) {
    auto* spec = req.add_indexes();
    spec->set_method(m);
    by_method[m] = spec;
  }
  for (const auto& p : index_params_) {
    auto dot = p.find('.');
    auto eq = p.find('=');
    if (dot == std::string::npos || eq == std::string::npos || eq < dot) {
      err << "ctxcache: --index-param '" << p << "' must look like METHOD.KEY=VALUE\n";
      return kExitUsage;
    }
    std::string method = p.substr(0, dot);
    if (!by_method.count(method)) {
      auto* spec = req.add_indexes();
      spec->set_method(method);
      by_method[method] = spec;
    }
    (*by_method[method]->mutable_params())[p.substr(dot + 1, eq - dot - 1)] = p.substr(eq + 1);
  }
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  ProgressPrinter printer(err);
  auto t0 = std::chrono::steady_clock::now();
  auto done = client->Build(req, [&](const v1::BuildProgress& p) {
    if (!global.json) printer.Update(p);
  });
  if (!done.ok()) return Fail(done.status(), global, err);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (global.json) {
    nlohmann::json j = InfoToJson(done->context());
    j["reused"] = done->reused();
    j["build_seconds"] = secs;
    out << j.dump() << "\n";
  } else {
    out << (done->reused() ? "reused existing context " : "built context ")
        << done->context().context_id() << ": " << done->context().n_tokens() << " tokens, "
        << HumanBytes(done->context().stored_bytes()) << " stored, " << std::fixed
        << std::setprecision(1) << secs << " s\n";
  }
  return 0;
}

void ListCommand::Configure(CLI::App* sub) {
  sub->add_option("--label", labels_, "Only contexts with KEY=VALUE (repeatable)");
  sub->add_option("--limit", limit_, "At most this many contexts")->capture_default_str();
  sub->add_option("--tenant", tenant_,
                  "Only this tenant's contexts (another than the key's: operator only)");
}

int ListCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  v1::ListContextsRequest req;
  std::map<std::string, std::string> labels;
  if (!ParseKeyValues(labels_, "--label", &labels, err)) return kExitUsage;
  req.mutable_label_filter()->insert(labels.begin(), labels.end());
  req.set_tenant(tenant_);
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  std::vector<v1::ContextInfo> all;
  while (all.size() < limit_) {
    req.set_page_size(std::min<uint32_t>(1000, limit_ - static_cast<uint32_t>(all.size())));
    auto resp = client->ListContexts(req);
    if (!resp.ok()) return Fail(resp.status(), global, err);
    all.insert(all.end(), resp->contexts().begin(), resp->contexts().end());
    if (resp->next_page_token().empty()) break;
    req.set_page_token(resp->next_page_token());
  }
  if (global.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& c : all) j.push_back(InfoToJson(c));
    out << nlohmann::json{{"contexts", j}}.dump() << "\n";
    return 0;
  }
  out << std::left << std::setw(34) << "CONTEXT_ID" << std::setw(20) << "NAME" << std::setw(8)
      << "STATE" << std::right << std::setw(10) << "TOKENS" << std::setw(12) << "STORED"
      << "  " << std::left << std::setw(16) << "INDEXES"
      << "PINNED\n";
  for (const auto& c : all) {
    std::string idx;
    for (const auto& ip : c.indexes()) idx += (idx.empty() ? "" : ",") + ip.method();
    out << std::left << std::setw(34) << c.context_id() << std::setw(20)
        << (c.name().empty() ? "-" : c.name().substr(0, 19)) << std::setw(8) << StateName(c.state())
        << std::right << std::setw(10) << c.n_tokens() << std::setw(12)
        << HumanBytes(c.stored_bytes()) << "  " << std::left << std::setw(16)
        << (idx.empty() ? "-" : idx) << (c.pinned() ? "yes" : "no") << "\n";
  }
  out << all.size() << " context(s)\n";
  return 0;
}

void ShowCommand::Configure(CLI::App* sub) {
  sub->add_option("ID", id_, "Context id (32 hex characters)")->required();
}

int ShowCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto info = client->GetContext(id_);
  if (!info.ok()) return Fail(info.status(), global, err);
  if (global.json) {
    out << InfoToJson(*info).dump() << "\n";
  } else {
    PrintInfoTable(*info, out);
  }
  return 0;
}

void EvictCommand::Configure(CLI::App* sub) {
  sub->add_option("ID", id_, "Context id")->required();
}

int EvictCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto r = client->Evict(id_);
  if (!r.ok()) return Fail(r.status(), global, err);
  if (global.json) {
    out << nlohmann::json{{"context_id", id_},
                          {"evicted", r->evicted()},
                          {"deferred", r->deferred()},
                          {"bytes_reclaimed", r->bytes_reclaimed()}}
               .dump()
        << "\n";
  } else if (r->deferred()) {
    out << "context " << id_ << " has open sessions; it will be evicted when they close\n";
  } else {
    out << "evicted " << id_ << " (" << HumanBytes(r->bytes_reclaimed()) << " reclaimed)\n";
  }
  return 0;
}

void PinCommand::Configure(CLI::App* sub) { sub->add_option("ID", id_, "Context id")->required(); }

int PinCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto r = client->Pin(id_, pin_);
  if (!r.ok()) return Fail(r.status(), global, err);
  if (global.json) {
    out << InfoToJson(*r).dump() << "\n";
  } else {
    out << (pin_ ? "pinned " : "unpinned ") << id_ << "\n";
  }
  return 0;
}

void ShareCommand::Configure(CLI::App* sub) {
  sub->add_option("context_id", id_, "Context id")->required();
}

int ShareCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto r = client->Share(id_, share_);
  if (!r.ok()) return Fail(r.status(), global, err);
  if (global.json) {
    out << InfoToJson(*r).dump() << "\n";
  } else {
    out << (share_ ? "shared " : "unshared ") << id_ << "\n";
  }
  return 0;
}

int StatsCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto s = client->GetStats();
  if (!s.ok()) return Fail(s.status(), global, err);
  std::string models;
  for (const auto& m : s->models()) models += (models.empty() ? "" : ", ") + m;
  if (global.json) {
    out << nlohmann::json{{"version", s->version()},
                          {"uptime_s", s->uptime_s()},
                          {"n_contexts", s->n_contexts()},
                          {"stored_bytes", s->stored_bytes()},
                          {"capacity_bytes", s->capacity_bytes()},
                          {"open_sessions", s->open_sessions()},
                          {"build_queue_depth", s->build_queue_depth()},
                          {"models", s->models()}}
               .dump()
        << "\n";
  } else {
    out << "version        " << s->version() << "\n"
        << "uptime         " << std::fixed << std::setprecision(0) << s->uptime_s() << " s\n"
        << "contexts       " << s->n_contexts() << "\n"
        << "stored         " << HumanBytes(s->stored_bytes()) << "\n"
        << "capacity       "
        << (s->capacity_bytes() ? HumanBytes(s->capacity_bytes()) : std::string("unlimited"))
        << "\n"
        << "open sessions  " << s->open_sessions() << "\n"
        << "build queue    " << s->build_queue_depth() << "\n"
        << "models         " << (models.empty() ? "-" : models) << "\n";
  }
  return 0;
}

void WatchCommand::Configure(CLI::App* sub) {
  sub->add_option("--context", id_, "Only events of this context");
  sub->add_option("--seconds", seconds_, "Stop after this many seconds (0 = never)");
  sub->add_option("--count", count_, "Stop after this many events (0 = never)");
}

int WatchCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  v1::WatchRequest req;
  req.set_context_id(id_);
  uint32_t seen = 0;
  Status s = client->Watch(
      req,
      [&](const v1::ContextEvent& ev) {
        std::string type = v1::ContextEvent::Type_Name(ev.type());
        if (global.json) {
          out << nlohmann::json{{"type", type},
                                {"at_ms", ev.at_ms()},
                                {"context", InfoToJson(ev.context())}}
                     .dump()
              << "\n";
        } else {
          out << HumanTime(ev.at_ms()) << " " << std::left << std::setw(9) << type
              << ev.context().context_id() << " " << ev.context().name() << "\n";
        }
        out.flush();
        return count_ == 0 || ++seen < count_;
      },
      seconds_);
  if (!s.ok()) return Fail(s, global, err);
  return 0;
}

}  // namespace ctxcache::cli
