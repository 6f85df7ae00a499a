// ctxcached's Prometheus metrics, on prometheus-cpp (Debian 12:
// prometheus-cpp-dev): a registry of counters, gauges and histograms (plus
// gauges/counters computed at scrape time) and the HTTP endpoint that serves
// them (prometheus::Exposer, civetweb) on GET /metrics.
//
// Naming: every ctxcache metric starts with "ctxcache_", uses base units
// (seconds, bytes) and carries no per-context labels (bounded cardinality);
// the process_* metrics (process_metrics.h) keep their standard names.
// The endpoint also serves prometheus-cpp's own exposer_* scrape metrics.
//
// Thread-safety: metric updates are prometheus-cpp's (atomics; a histogram
// takes a short per-series mutex); Get*() take a registry mutex; Render() and
// the HTTP endpoint are safe to use concurrently with updates.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace ctxcache::service {

// The help text of ctxcache_evictions_total (registered at start and where
// EvictContext counts).
inline constexpr const char kEvictionsHelp[] =
    "Contexts evicted by EvictContext (explicit); TTL and capacity evictions are "
    "ctxcache_policy_evictions_total";

// A metric handle. Handles returned by MetricsRegistry are registered (they
// appear in Render() and on /metrics); a default-constructed one is a
// standalone metric that nothing exports.
class Counter {
 public:
  Counter();
  // Negative increments are ignored (counters are monotonic).
  void Inc(double v = 1.0) { metric_->Increment(v); }
  double value() const { return metric_->Value(); }

 private:
  friend class MetricsRegistry;
  explicit Counter(prometheus::Counter* registered) : metric_(registered) {}
  std::unique_ptr<prometheus::Counter> owned_;
  prometheus::Counter* metric_;
};

class Gauge {
 public:
  Gauge();
  void Set(double v) { metric_->Set(v); }
  void Add(double v) { metric_->Increment(v); }
  double value() const { return metric_->Value(); }

 private:
  friend class MetricsRegistry;
  explicit Gauge(prometheus::Gauge* registered) : metric_(registered) {}
  std::unique_ptr<prometheus::Gauge> owned_;
  prometheus::Gauge* metric_;
};

// Cumulative histogram with fixed upper bounds (seconds or bytes); a value v
// falls in the first bucket with v <= bound. Bounds are sorted and
// de-duplicated (prometheus-cpp requires strictly increasing bounds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v) { metric_->Observe(v); }
  const std::vector<double>& bounds() const { return bounds_; }
  // Snapshot: per-bucket (non-cumulative) counts incl. +Inf, sum, count.
  void Snapshot(std::vector<uint64_t>* buckets, double* sum, uint64_t* count) const;

 private:
  friend class MetricsRegistry;
  Histogram(std::vector<double> bounds, prometheus::Histogram* registered)
      : bounds_(std::move(bounds)), metric_(registered) {}
  std::vector<double> bounds_;
  std::unique_ptr<prometheus::Histogram> owned_;
  prometheus::Histogram* metric_;
};

// Default latency buckets, 50 us .. 60 s.
std::vector<double> LatencyBuckets();

enum class MetricType { kCounter, kGauge, kHistogram };

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Get* return the same handle for the same name and label set; handles live
  // as long as the registry. The first registration of a name fixes its type
  // and help text (and, for histograms, each series' bounds). Asking for a
  // name under another type, or an invalid metric/label name, logs a warning
  // and returns a standalone handle that is not exported.

  // Unlabelled metrics.
  Counter* GetCounter(const std::string& name, const std::string& help);
  Gauge* GetGauge(const std::string& name, const std::string& help);
  Gauge* GetGauge(const std::string& name, const std::string& help,
                  const std::map<std::string, std::string>& labels);
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds = LatencyBuckets());

  // Labelled metrics: one series per label set, e.g. {{"method","GetContext"}}.
  Counter* GetCounter(const std::string& name, const std::string& help,
                      const std::map<std::string, std::string>& labels);
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::map<std::string, std::string>& labels,
                          std::vector<double> bounds = LatencyBuckets());

  // A gauge computed at scrape time (by every Render() and every scrape of
  // the endpoint, outside the registry mutex). Registering the same name and
  // labels again replaces the function.
  void AddCallbackGauge(const std::string& name, const std::string& help,
                        std::function<double()> fn,
                        const std::map<std::string, std::string>& labels = {});
  // A counter whose (monotonic) value is read at scrape time.
  void AddCallbackCounter(const std::string& name, const std::string& help,
                          std::function<double()> fn);

  // The whole registry in Prometheus text format (0.0.4), families by name.
  std::string Render() const;

  // What prometheus::Exposer scrapes: every metric above, callbacks included.
  std::shared_ptr<prometheus::Collectable> collectable() const;

 private:
  class Collector;
  std::shared_ptr<Collector> collector_;
};

// Serves GET /metrics (and GET / with a pointer to it) over plain HTTP, with
// prometheus::Exposer (civetweb, 2 worker threads).
class MetricsHttpServer {
 public:
  explicit MetricsHttpServer(const MetricsRegistry* registry);
  ~MetricsHttpServer();

  // Binds host:port ("127.0.0.1:7701", "0.0.0.0:7701", "localhost:7701"; port
  // 0 picks a free port) and starts serving on background threads. IPv6
  // ("[::1]:7701") only where civetweb is built with IPv6 (Debian 12's is not:
  // host names then resolve to IPv4 and IPv6 literals are InvalidArgument).
  // A non-empty `bearer_token` is required on /metrics ("Authorization:
  // Bearer <token>"; 401 otherwise).
  Status Start(const std::string& listen, const std::string& bearer_token = "");
  // The bound port (after Start).
  int port() const { return port_; }
  // Stops serving (waits for in-flight scrapes). Idempotent.
  void Stop();

 private:
  const MetricsRegistry* registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  std::string wake_host_;  // numeric loopback-reachable address of the listener
  bool wake_v6_ = false;
};

}  // namespace ctxcache::service
