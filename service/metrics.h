// A small Prometheus metrics registry and its text exposition (format 0.0.4),
// plus a minimal HTTP/1.1 server that serves it on GET /metrics.
//
// Naming: every metric starts with "ctxcache_", uses base units (seconds,
// bytes) and carries no per-context labels (bounded cardinality).
//
// Thread-safety: all metric updates are lock-free atomics or take a short
// per-family mutex; Render() and the HTTP server are safe to use concurrently
// with updates.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace ctxcache::service {

class Counter {
 public:
  void Inc(double v = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative histogram with fixed upper bounds (seconds or bytes).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Snapshot: per-bucket (non-cumulative) counts incl. +Inf, sum, count.
  void Snapshot(std::vector<uint64_t>* buckets, double* sum, uint64_t* count) const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Default latency buckets, 50 us .. 60 s.
std::vector<double> LatencyBuckets();

enum class MetricType { kCounter, kGauge, kHistogram };

class MetricsRegistry {
 public:
  // Unlabelled metrics. Returned pointers live as long as the registry.
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

  // A gauge computed at scrape time.
  void AddCallbackGauge(const std::string& name, const std::string& help,
                        std::function<double()> fn,
                        const std::map<std::string, std::string>& labels = {});
  // A counter whose (monotonic) value is read at scrape time.
  void AddCallbackCounter(const std::string& name, const std::string& help,
                          std::function<double()> fn);

  // The whole registry in Prometheus text format.
  std::string Render() const;

 private:
  struct Series {
    std::map<std::string, std::string> labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::function<double()> callback;
  };
  struct Family {
    std::string help;
    MetricType type;
    std::vector<std::unique_ptr<Series>> series;
  };
  Series* GetSeries(const std::string& name, const std::string& help, MetricType type,
                    const std::map<std::string, std::string>& labels);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;  // guarded by mu_
};

// Serves GET /metrics (and GET / with a pointer to it) over plain HTTP.
class MetricsHttpServer {
 public:
  explicit MetricsHttpServer(const MetricsRegistry* registry) : registry_(registry) {}
  ~MetricsHttpServer();

  // Binds host:port ("127.0.0.1:7701"; port 0 picks a free port) and starts
  // serving on a background thread.
  Status Start(const std::string& listen);
  // The bound port (after Start).
  int port() const { return port_; }
  void Stop();

 private:
  void ServeLoop();
  void HandleConnection(int fd);

  const MetricsRegistry* registry_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ctxcache::service
