#include "service/metrics.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <sstream>

namespace ctxcache::service {

namespace {
void AtomicAdd(std::atomic<double>* a, double v) {
  double cur = a->load(std::memory_order_relaxed);
  while (!a->compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

std::string FormatDouble(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string EscapeLabel(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string LabelString(const std::map<std::string, std::string>& labels,
                        const std::string& extra_key = "", const std::string& extra_val = "") {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ",";
    out += k + "=\"" + EscapeLabel(v) + "\"";
    first = false;
  }
  if (!extra_key.empty()) {
    if (!first) out += ",";
    out += extra_key + "=\"" + extra_val + "\"";
  }
  return out + "}";
}
}  // namespace

void Counter::Inc(double v) { AtomicAdd(&value_, v); }
void Gauge::Add(double v) { AtomicAdd(&value_, v); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

void Histogram::Snapshot(std::vector<uint64_t>* buckets, double* sum, uint64_t* count) const {
  buckets->resize(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) (*buckets)[i] = counts_[i].load();
  *sum = sum_.load();
  *count = count_.load();
}

std::vector<double> LatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
          50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0,  60.0};
}

MetricsRegistry::Series* MetricsRegistry::GetSeries(
    const std::string& name, const std::string& help, MetricType type,
    const std::map<std::string, std::string>& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& fam = families_[name];
  if (fam.series.empty()) {
    fam.help = help;
    fam.type = type;
  }
  for (auto& s : fam.series) {
    if (s->labels == labels) return s.get();
  }
  auto s = std::make_unique<Series>();
  s->labels = labels;
  fam.series.push_back(std::move(s));
  return fam.series.back().get();
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help) {
  return GetCounter(name, help, {});
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const std::map<std::string, std::string>& labels) {
  Series* s = GetSeries(name, help, MetricType::kCounter, labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->counter) s->counter = std::make_unique<Counter>();
  return s->counter.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help) {
  return GetGauge(name, help, {});
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const std::map<std::string, std::string>& labels) {
  Series* s = GetSeries(name, help, MetricType::kGauge, labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->gauge) s->gauge = std::make_unique<Gauge>();
  return s->gauge.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds) {
  return GetHistogram(name, help, {}, std::move(bounds));
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const std::map<std::string, std::string>& labels,
                                         std::vector<double> bounds) {
  Series* s = GetSeries(name, help, MetricType::kHistogram, labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->histogram) s->histogram = std::make_unique<Histogram>(std::move(bounds));
  return s->histogram.get();
}

void MetricsRegistry::AddCallbackGauge(const std::string& name, const std::string& help,
                                       std::function<double()> fn,
                                       const std::map<std::string, std::string>& labels) {
  Series* s = GetSeries(name, help, MetricType::kGauge, labels);
  std::lock_guard<std::mutex> lock(mu_);
  s->callback = std::move(fn);
}

void MetricsRegistry::AddCallbackCounter(const std::string& name, const std::string& help,
                                         std::function<double()> fn) {
  Series* s = GetSeries(name, help, MetricType::kCounter, {});
  std::lock_guard<std::mutex> lock(mu_);
  s->callback = std::move(fn);
}

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, fam] : families_) {
    const char* type = fam.type == MetricType::kCounter ? "counter"
                       : fam.type == MetricType::kGauge ? "gauge"
                                                        : "histogram";
    out += "# HELP " + name + " " + fam.help + "\n";
    out += "# TYPE " + name + " " + type + "\n";
    for (const auto& s : fam.series) {
      if (fam.type == MetricType::kHistogram) {
        if (!s->histogram) continue;
        std::vector<uint64_t> buckets;
        double sum;
        uint64_t count;
        s->histogram->Snapshot(&buckets, &sum, &count);
        uint64_t cum = 0;
        const auto& bounds = s->histogram->bounds();
        for (size_t i = 0; i < buckets.size(); ++i) {
          cum += buckets[i];
          std::string le = i < bounds.size() ? FormatDouble(bounds[i]) : "+Inf";
          out += name + "_bucket" + LabelString(s->labels, "le", le) + " " + std::to_string(cum) +
                 "\n";
        }
        out += name + "_sum" + LabelString(s->labels) + " " + FormatDouble(sum) + "\n";
        out += name + "_count" + LabelString(s->labels) + " " + std::to_string(count) + "\n";
        continue;
      }
      double v = 0;
      if (s->counter) v = s->counter->value();
      if (s->gauge) v = s->gauge->value();
      if (s->callback) v = s->callback();
      out += name + LabelString(s->labels) + " " + FormatDouble(v) + "\n";
    }
  }
  return out;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

Status MetricsHttpServer::Start(const std::string& listen) {
  auto colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgumentError("--metrics-listen '" + listen + "': expected HOST:PORT");
  }
  std::string host = listen.substr(0, colon);
  std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return InvalidArgumentError("--metrics-listen '" + listen + "': " + gai_strerror(rc));
  }
  int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
    std::string err = std::strerror(errno);
    freeaddrinfo(res);
    if (fd >= 0) close(fd);
    return UnavailableError("cannot listen on --metrics-listen " + listen + ": " + err);
  }
  freeaddrinfo(res);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  listen_fd_ = fd;
  thread_ = std::thread([this] { ServeLoop(); });
  return Status::OK();
}

void MetricsHttpServer::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

void MetricsHttpServer::ServeLoop() {
  while (!stop_) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 100) <= 0) continue;
    int conn = accept(listen_fd_, nullptr, nullptr);
    if (conn < 0) continue;
    HandleConnection(conn);
    close(conn);
  }
}

void MetricsHttpServer::HandleConnection(int fd) {
  // Read the request head (bounded: 8 KiB, 1 s).
  std::string req;
  char buf[1024];
  while (req.size() < 8192 && req.find("\r\n\r\n") == std::string::npos) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 1000) <= 0) return;
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
  }
  std::string status = "200 OK";
  std::string type = "text/plain; version=0.0.4; charset=utf-8";
  std::string body;
  if (req.rfind("GET /metrics", 0) == 0) {
    body = registry_->Render();
  } else if (req.rfind("GET / ", 0) == 0) {
    body = "ctxcached: metrics at /metrics\n";
  } else {
    status = "404 Not Found";
    body = "not found; try GET /metrics\n";
  }
  std::string resp = "HTTP/1.1 " + status + "\r\nContent-Type: " + type +
                     "\r\nContent-Length: " + std::to_string(body.size()) +
                     "\r\nConnection: close\r\n\r\n" + body;
  size_t off = 0;
  while (off < resp.size()) {
    ssize_t n = write(fd, resp.data() + off, resp.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

}  // namespace ctxcache::service
