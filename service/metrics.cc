#include "service/metrics.h"

#include <CivetServer.h>
#include <arpa/inet.h>
#include <civetweb.h>
#include <netdb.h>
#include <netinet/in.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "auth/crypto.h"

namespace ctxcache::service {

namespace {

using Labels = std::map<std::string, std::string>;

std::vector<double> SortedBounds(std::vector<double> bounds) {
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  return bounds;
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "?";
}

prometheus::ClientMetric CallbackSample(MetricType type, const Labels& labels, double v) {
  prometheus::ClientMetric m;
  for (const auto& [k, val] : labels) m.label.push_back({k, val});
  if (type == MetricType::kCounter) {
    m.counter.value = v;
  } else {
    m.gauge.value = v;
  }
  return m;
}

}  // namespace

// ---- Handles ----------------------------------------------------------------

Counter::Counter() : owned_(std::make_unique<prometheus::Counter>()), metric_(owned_.get()) {}

Gauge::Gauge() : owned_(std::make_unique<prometheus::Gauge>()), metric_(owned_.get()) {}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(SortedBounds(std::move(bounds))),
      owned_(std::make_unique<prometheus::Histogram>(bounds_)),
      metric_(owned_.get()) {}

void Histogram::Snapshot(std::vector<uint64_t>* buckets, double* sum, uint64_t* count) const {
  prometheus::ClientMetric m = metric_->Collect();
  buckets->assign(m.histogram.bucket.size(), 0);
  uint64_t prev = 0;
  for (size_t i = 0; i < m.histogram.bucket.size(); ++i) {
    (*buckets)[i] = m.histogram.bucket[i].cumulative_count - prev;
    prev = m.histogram.bucket[i].cumulative_count;
  }
  *sum = m.histogram.sample_sum;
  *count = m.histogram.sample_count;
}

std::vector<double> LatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
          50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0,  60.0};
}

// ---- Registry ---------------------------------------------------------------

// The registry's state, shared with the exposer (which holds it weakly).
// prometheus::Registry holds the stored metrics; the maps below make Get*()
// return the same handle for the same name and labels without going through
// prometheus::Family::Add (which builds a new metric before it looks up the
// labels), and hold the scrape-time callbacks, which prometheus-cpp has no
// metric type for: Collect() appends them to the registry's families.
class MetricsRegistry::Collector : public prometheus::Collectable {
 public:
  struct Callback {
    Labels labels;
    std::function<double()> fn;
  };
  struct Entry {
    MetricType type;
    std::string help;
    prometheus::Family<prometheus::Counter>* counters = nullptr;
    prometheus::Family<prometheus::Gauge>* gauges = nullptr;
    prometheus::Family<prometheus::Histogram>* histograms = nullptr;
    std::map<Labels, std::unique_ptr<Counter>> counter_series;
    std::map<Labels, std::unique_ptr<Gauge>> gauge_series;
    std::map<Labels, std::unique_ptr<Histogram>> histogram_series;
    std::vector<Callback> callbacks;
    std::string error;  // why prometheus-cpp rejected the family
  };

  // The entry for `name`, created with its prometheus family on first use.
  // nullptr, with the reason in *why, when the name is taken by another type.
  // An entry whose registration prometheus-cpp rejected (invalid name) has no
  // family and the reason in `error`. Requires mu.
  Entry* GetEntry(const std::string& name, const std::string& help, MetricType type,
                  std::string* why) {
    auto it = entries.find(name);
    if (it != entries.end()) {
      if (it->second.type == type) return &it->second;
      *why = std::string("already registered as a ") + TypeName(it->second.type);
      return nullptr;
    }
    Entry e;
    e.type = type;
    e.help = help;
    try {
      switch (type) {
        case MetricType::kCounter:
          e.counters = &prometheus::BuildCounter().Name(name).Help(help).Register(registry);
          break;
        case MetricType::kGauge:
          e.gauges = &prometheus::BuildGauge().Name(name).Help(help).Register(registry);
          break;
        case MetricType::kHistogram:
          e.histograms = &prometheus::BuildHistogram().Name(name).Help(help).Register(registry);
          break;
      }
    } catch (const std::exception& ex) {
      e.error = ex.what();
    }
    return &entries.emplace(name, std::move(e)).first->second;
  }

  // A standalone handle for a series that cannot be exported; the same one
  // for the same name and labels, and one warning. Requires mu.
  template <typename H, typename Make>
  H* Stray(std::map<std::pair<std::string, Labels>, std::unique_ptr<H>>* strays,
           const std::string& name, const Labels& labels, MetricType type, const std::string& why,
           Make make) {
    auto key = std::make_pair(name, labels);
    auto it = strays->find(key);
    if (it == strays->end()) {
      spdlog::warn("metrics: {} {}: {}; this series is not exported", TypeName(type), name, why);
      it = strays->emplace(std::move(key), make()).first;
    }
    return it->second.get();
  }

  // Adds or replaces the callback for these labels. Requires mu.
  static void SetCallback(Entry* e, const Labels& labels, std::function<double()> fn) {
    for (auto& cb : e->callbacks) {
      if (cb.labels == labels) {
        cb.fn = std::move(fn);
        return;
      }
    }
    e->callbacks.push_back({labels, std::move(fn)});
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families = registry.Collect();
    // Copy the callbacks, then call them without the lock: they may be slow
    // (RocksDB properties) and must not hold up Get*() on the RPC path.
    std::vector<std::pair<std::string, const Entry*>> with_callbacks;
    std::vector<std::vector<Callback>> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [name, e] : entries) {
        if (e.callbacks.empty()) continue;
        with_callbacks.emplace_back(name, &e);
        callbacks.push_back(e.callbacks);
      }
    }
    for (size_t i = 0; i < with_callbacks.size(); ++i) {
      const auto& [name, e] = with_callbacks[i];  // entries are never erased
      auto fam = std::find_if(families.begin(), families.end(),
                              [&](const prometheus::MetricFamily& f) { return f.name == name; });
      if (fam == families.end()) {
        prometheus::MetricFamily f;
        f.name = name;
        f.help = e->help;
        f.type = e->type == MetricType::kCounter ? prometheus::MetricType::Counter
                                                 : prometheus::MetricType::Gauge;
        families.push_back(std::move(f));
        fam = families.end() - 1;
      }
      for (const Callback& cb : callbacks[i]) {
        fam->metric.push_back(CallbackSample(e->type, cb.labels, cb.fn()));
      }
    }
    // Deterministic output: families by name, series by labels.
    std::sort(families.begin(), families.end(),
              [](const auto& a, const auto& b) { return a.name < b.name; });
    for (auto& f : families) {
      std::stable_sort(f.metric.begin(), f.metric.end(),
                       [](const auto& a, const auto& b) { return a.label < b.label; });
    }
    return families;
  }

  mutable std::mutex mu;
  prometheus::Registry registry;
  std::map<std::string, Entry> entries;  // guarded by mu; never erased
  // Handles for rejected registrations (standalone, not exported), guarded by mu.
  template <typename H>
  using StrayMap = std::map<std::pair<std::string, Labels>, std::unique_ptr<H>>;
  StrayMap<Counter> stray_counters;
  StrayMap<Gauge> stray_gauges;
  StrayMap<Histogram> stray_histograms;
};

MetricsRegistry::MetricsRegistry() : collector_(std::make_shared<Collector>()) {}
MetricsRegistry::~MetricsRegistry() = default;

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help) {
  return GetCounter(name, help, {});
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const Labels& labels) {
  Collector& c = *collector_;
  std::lock_guard<std::mutex> lock(c.mu);
  std::string why;
  if (Collector::Entry* e = c.GetEntry(name, help, MetricType::kCounter, &why)) {
    auto it = e->counter_series.find(labels);
    if (it != e->counter_series.end()) return it->second.get();
    why = e->error;
    if (e->counters) {
      try {
        auto& m = e->counters->Add(labels);
        return e->counter_series.emplace(labels, std::unique_ptr<Counter>(new Counter(&m)))
            .first->second.get();
      } catch (const std::exception& ex) {
        why = ex.what();
      }
    }
  }
  return c.Stray(&c.stray_counters, name, labels, MetricType::kCounter, why,
                 [] { return std::make_unique<Counter>(); });
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help) {
  return GetGauge(name, help, {});
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const Labels& labels) {
  Collector& c = *collector_;
  std::lock_guard<std::mutex> lock(c.mu);
  std::string why;
  if (Collector::Entry* e = c.GetEntry(name, help, MetricType::kGauge, &why)) {
    auto it = e->gauge_series.find(labels);
    if (it != e->gauge_series.end()) return it->second.get();
    why = e->error;
    if (e->gauges) {
      try {
        auto& m = e->gauges->Add(labels);
        return e->gauge_series.emplace(labels, std::unique_ptr<Gauge>(new Gauge(&m)))
            .first->second.get();
      } catch (const std::exception& ex) {
        why = ex.what();
      }
    }
  }
  return c.Stray(&c.stray_gauges, name, labels, MetricType::kGauge, why,
                 [] { return std::make_unique<Gauge>(); });
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds) {
  return GetHistogram(name, help, {}, std::move(bounds));
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const Labels& labels, std::vector<double> bounds) {
  Collector& c = *collector_;
  std::lock_guard<std::mutex> lock(c.mu);
  std::string why;
  if (Collector::Entry* e = c.GetEntry(name, help, MetricType::kHistogram, &why)) {
    auto it = e->histogram_series.find(labels);
    if (it != e->histogram_series.end()) return it->second.get();
    why = e->error;
    if (e->histograms) {
      bounds = SortedBounds(std::move(bounds));
      try {
        auto& m = e->histograms->Add(labels, bounds);
        return e->histogram_series
            .emplace(labels, std::unique_ptr<Histogram>(new Histogram(std::move(bounds), &m)))
            .first->second.get();
      } catch (const std::exception& ex) {
        why = ex.what();
      }
    }
  }
  return c.Stray(&c.stray_histograms, name, labels, MetricType::kHistogram, why,
                 [&] { return std::make_unique<Histogram>(std::move(bounds)); });
}

void MetricsRegistry::AddCallbackGauge(const std::string& name, const std::string& help,
                                       std::function<double()> fn, const Labels& labels) {
  Collector& c = *collector_;
  std::lock_guard<std::mutex> lock(c.mu);
  std::string why;
  Collector::Entry* e = c.GetEntry(name, help, MetricType::kGauge, &why);
  if (e && e->error.empty()) {
    c.SetCallback(e, labels, std::move(fn));
  } else {
    spdlog::warn("metrics: gauge {}: {}; not exported", name, e ? e->error : why);
  }
}

void MetricsRegistry::AddCallbackCounter(const std::string& name, const std::string& help,
                                         std::function<double()> fn) {
  Collector& c = *collector_;
  std::lock_guard<std::mutex> lock(c.mu);
  std::string why;
  Collector::Entry* e = c.GetEntry(name, help, MetricType::kCounter, &why);
  if (e && e->error.empty()) {
    c.SetCallback(e, {}, std::move(fn));
  } else {
    spdlog::warn("metrics: counter {}: {}; not exported", name, e ? e->error : why);
  }
}

std::string MetricsRegistry::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

std::shared_ptr<prometheus::Collectable> MetricsRegistry::collectable() const { return collector_; }

// ---- HTTP endpoint ----------------------------------------------------------

namespace {

void Reply(mg_connection* conn, int code, const char* reason, const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            code, reason, body.size());
  mg_write(conn, body.data(), body.size());
}

// Bearer tokens of the running endpoints, by listening port (civetweb's
// begin_request callback has no pointer back to our server object).
std::mutex tokens_mu;
std::map<int, std::string>& TokensByPort() {
  static auto* m = new std::map<int, std::string>();
  return *m;
}

bool TokenMatches(const mg_connection* conn, int port) {
  std::string want;
  {
    std::lock_guard<std::mutex> l(tokens_mu);
    auto it = TokensByPort().find(port);
    if (it == TokensByPort().end()) return true;  // no token configured
    want = "Bearer " + it->second;
  }
  const char* got = mg_get_header(conn, "Authorization");
  return auth::ConstantTimeEqual(got ? got : "", want);
}

// Runs before civetweb's URI handlers: everything but /metrics (which the
// exposer serves) is answered here, as the hand-rolled server did, and a
// scrape without the configured bearer token gets 401.
int BeginRequest(mg_connection* conn) {
  const mg_request_info* req = mg_get_request_info(conn);
  std::string uri = req->local_uri ? req->local_uri : "";
  if (uri == "/metrics" || uri.rfind("/metrics/", 0) == 0) {
    if (TokenMatches(conn, req->server_port)) return 0;
    Reply(conn, 401, "Unauthorized", "send the header 'Authorization: Bearer <token>'\n");
    return 401;
  }
  if (uri == "/" && std::strcmp(req->request_method, "GET") == 0) {
    Reply(conn, 200, "OK", "ctxcached: metrics at /metrics\n");
    return 200;
  }
  Reply(conn, 404, "Not Found", "not found; try GET /metrics\n");
  return 404;
}

// civetweb reports why it cannot start (bind errors) only through its log;
// mg_start runs on the thread that calls Start(), which keeps the first one.
thread_local std::string* start_error = nullptr;

int LogMessage(const mg_connection*, const char* message) {
  if (start_error && start_error->empty()) *start_error = message;
  spdlog::warn("metrics endpoint: {}", message);
  return 1;
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(const MetricsRegistry* registry) : registry_(registry) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

Status MetricsHttpServer::Start(const std::string& listen, const std::string& bearer_token) {
  auto colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgumentError("--metrics-listen '" + listen + "': expected HOST:PORT");
  }
  std::string host = listen.substr(0, colon);
  std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  // Resolve here (civetweb takes numeric addresses only), as before. Debian
  // 12's civetweb is built without IPv6: then only IPv4 addresses can work.
  const bool civetweb_ipv6 = mg_check_feature(8) != 0;
  if (!civetweb_ipv6 && host.find(':') != std::string::npos) {
    return InvalidArgumentError("--metrics-listen '" + listen +
                                "': IPv6 addresses are not supported (this civetweb is built "
                                "without IPv6); use an IPv4 address such as 0.0.0.0");
  }
  addrinfo hints{};
  hints.ai_family = civetweb_ipv6 ? AF_UNSPEC : AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return InvalidArgumentError("--metrics-listen '" + listen + "': " + gai_strerror(rc));
  }
  char numeric_host[NI_MAXHOST];
  char numeric_port[NI_MAXSERV];
  int rc = getnameinfo(res->ai_addr, res->ai_addrlen, numeric_host, sizeof(numeric_host),
                       numeric_port, sizeof(numeric_port), NI_NUMERICHOST | NI_NUMERICSERV);
  const bool v6 = res->ai_family == AF_INET6;
  freeaddrinfo(res);
  if (rc != 0) {
    return InvalidArgumentError("--metrics-listen '" + listen + "': " + gai_strerror(rc));
  }
  std::string bind = v6 ? "[" + std::string(numeric_host) + "]:" + numeric_port
                        : std::string(numeric_host) + ":" + numeric_port;
  wake_v6_ = v6;
  wake_host_ = numeric_host;
  if (wake_host_ == "0.0.0.0") wake_host_ = "127.0.0.1";
  if (wake_host_ == "::") wake_host_ = "::1";

  CivetCallbacks callbacks;
  callbacks.begin_request = &BeginRequest;
  callbacks.log_message = &LogMessage;
  std::string error;
  start_error = &error;
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", bind, "num_threads", "2", "request_timeout_ms",
                                 "5000"},
        &callbacks);
  } catch (const std::exception& ex) {
    start_error = nullptr;
    return UnavailableError("cannot listen on --metrics-listen " + listen + ": " +
                            (error.empty() ? ex.what() : error));
  }
  start_error = nullptr;
  exposer_->RegisterCollectable(registry_->collectable());
  std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  if (!bearer_token.empty()) {
    std::lock_guard<std::mutex> l(tokens_mu);
    TokensByPort()[port_] = bearer_token;
  }
  return Status::OK();
}

void MetricsHttpServer::Stop() {
  if (!exposer_) return;
  // civetweb's accept thread polls its listening socket in 2 s slices and only
  // then sees the stop flag, so a plain reset() takes up to 2 s (on every
  // ctxcached shutdown). Poke the socket until the exposer is gone: each
  // connection wakes the poll, and is closed at once.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (wake_v6_) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
      a6->sin6_family = AF_INET6;
      a6->sin6_port = htons(static_cast<uint16_t>(port_));
      if (inet_pton(AF_INET6, wake_host_.c_str(), &a6->sin6_addr) != 1) return;
      len = sizeof(sockaddr_in6);
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
      a4->sin_family = AF_INET;
      a4->sin_port = htons(static_cast<uint16_t>(port_));
      if (inet_pton(AF_INET, wake_host_.c_str(), &a4->sin_addr) != 1) return;
      len = sizeof(sockaddr_in);
    }
    while (!stopped.load()) {
      int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return;
      int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
      close(fd);
      if (rc != 0) return;  // listener closed: civetweb is past its accept loop
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  exposer_.reset();
  stopped = true;
  waker.join();
  std::lock_guard<std::mutex> l(tokens_mu);
  TokensByPort().erase(port_);
}

}  // namespace ctxcache::service
