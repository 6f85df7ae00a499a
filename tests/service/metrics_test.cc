// Unit tests of service/metrics.{h,cc} (prometheus-cpp underneath): handles
// are stable per name and labels, Render() prints the right names, types and
// values (callbacks computed at scrape time), and MetricsHttpServer serves
// them over real HTTP on 127.0.0.1 with an ephemeral port.
#include "service/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "service/process_metrics.h"

#include "tests/service/http_get.h"

namespace ctxcache::service {
namespace {

using testing::HttpGet;

std::string Body(const std::string& resp) {
  auto pos = resp.find("\r\n\r\n");
  return pos == std::string::npos ? "" : resp.substr(pos + 4);
}

bool HasLine(const std::string& text, const std::string& line) {
  return ("\n" + text).find("\n" + line + "\n") != std::string::npos;
}

TEST(MetricsRegistryTest, SameNameAndLabelsGiveTheSameHandle) {
  MetricsRegistry m;
  Counter* c = m.GetCounter("ctxcache_t_total", "help");
  EXPECT_EQ(m.GetCounter("ctxcache_t_total", "other help is ignored"), c);
  Counter* get_ok = m.GetCounter("ctxcache_t_rpc_total", "h", {{"method", "Get"}, {"code", "OK"}});
  EXPECT_EQ(m.GetCounter("ctxcache_t_rpc_total", "h", {{"code", "OK"}, {"method", "Get"}}), get_ok);
  EXPECT_NE(m.GetCounter("ctxcache_t_rpc_total", "h", {{"method", "Put"}, {"code", "OK"}}), get_ok);

  Gauge* g = m.GetGauge("ctxcache_t_gauge", "g");
  EXPECT_EQ(m.GetGauge("ctxcache_t_gauge", "g"), g);
  Gauge* gl = m.GetGauge("ctxcache_t_info", "i", {{"version", "1"}});
  EXPECT_EQ(m.GetGauge("ctxcache_t_info", "i", {{"version", "1"}}), gl);
  EXPECT_NE(gl, g);

  Histogram* h = m.GetHistogram("ctxcache_t_seconds", "h");
  EXPECT_EQ(m.GetHistogram("ctxcache_t_seconds", "h"), h);
  EXPECT_EQ(h->bounds(), LatencyBuckets());
  Histogram* hl = m.GetHistogram("ctxcache_t_rpc_seconds", "h", {{"method", "Get"}});
  EXPECT_EQ(m.GetHistogram("ctxcache_t_rpc_seconds", "h", {{"method", "Get"}}), hl);
  EXPECT_NE(m.GetHistogram("ctxcache_t_rpc_seconds", "h", {{"method", "Put"}}), hl);

  // Updates through either pointer land in one series.
  c->Inc();
  m.GetCounter("ctxcache_t_total", "help")->Inc(2);
  EXPECT_DOUBLE_EQ(c->value(), 3.0);
}

TEST(MetricsRegistryTest, RenderPrintsNamesTypesAndValues) {
  MetricsRegistry m;
  m.GetCounter("ctxcache_builds_total", "Contexts built")->Inc(3);
  m.GetCounter("ctxcache_rpc_total", "RPCs", {{"method", "GetContext"}, {"code", "OK"}})->Inc();
  m.GetCounter("ctxcache_rpc_total", "RPCs", {{"method", "GetContext"}, {"code", "OK"}})->Inc();
  m.GetGauge("ctxcache_open_sessions", "Open decode sessions")->Set(4);
  m.GetGauge("ctxcache_open_sessions", "Open decode sessions")->Add(-1.5);
  m.GetGauge("ctxcache_build_info", "Build info", {{"version", "0.1.0"}, {"revision", "abc"}})
      ->Set(1);
  Histogram* h = m.GetHistogram("ctxcache_decode_step_duration_seconds", "Step time");
  h->Observe(0.0003);  // le 0.0005
  h->Observe(0.0005);  // le 0.0005 (bounds are inclusive)
  h->Observe(2.0);     // le 2.5
  h->Observe(100.0);   // +Inf only
  m.GetHistogram("ctxcache_rpc_duration_seconds", "RPC time", {{"method", "Decode"}}, {1, 2})
      ->Observe(1.5);

  std::string text = m.Render();
  EXPECT_TRUE(HasLine(text, "# HELP ctxcache_builds_total Contexts built")) << text;
  EXPECT_TRUE(HasLine(text, "# TYPE ctxcache_builds_total counter")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_builds_total 3")) << text;
  EXPECT_TRUE(HasLine(text, "# TYPE ctxcache_rpc_total counter")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_rpc_total{code=\"OK\",method=\"GetContext\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, "# TYPE ctxcache_open_sessions gauge")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_open_sessions 2.5")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_build_info{revision=\"abc\",version=\"0.1.0\"} 1")) << text;

  const std::string hn = "ctxcache_decode_step_duration_seconds";
  EXPECT_TRUE(HasLine(text, "# TYPE " + hn + " histogram")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_bucket{le=\"0.00025\"} 0")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_bucket{le=\"0.0005\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_bucket{le=\"2.5\"} 3")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_bucket{le=\"60\"} 3")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_bucket{le=\"+Inf\"} 4")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_count 4")) << text;
  EXPECT_TRUE(HasLine(text, hn + "_sum 102.0008")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_rpc_duration_seconds_bucket{method=\"Decode\",le=\"1\"} 0"))
      << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_rpc_duration_seconds_bucket{method=\"Decode\",le=\"2\"} 1"))
      << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_rpc_duration_seconds_count{method=\"Decode\"} 1")) << text;

  // Families come out sorted by name.
  EXPECT_LT(text.find("# HELP ctxcache_build_info"), text.find("# HELP ctxcache_builds_total"));
  EXPECT_LT(text.find("# HELP ctxcache_builds_total"), text.find("# HELP ctxcache_decode_step"));
  EXPECT_LT(text.find("# HELP ctxcache_rpc_duration"), text.find("# HELP ctxcache_rpc_total"));

  std::vector<uint64_t> buckets;
  double sum = 0;
  uint64_t count = 0;
  h->Snapshot(&buckets, &sum, &count);
  ASSERT_EQ(buckets.size(), LatencyBuckets().size() + 1);
  EXPECT_EQ(buckets[3], 2u);   // (0.00025, 0.0005]
  EXPECT_EQ(buckets[14], 1u);  // (1, 2.5]
  EXPECT_EQ(buckets.back(), 1u);
  EXPECT_EQ(count, 4u);
  EXPECT_DOUBLE_EQ(sum, 102.0008);
}

TEST(MetricsRegistryTest, CallbacksAreComputedAtScrapeTime) {
  MetricsRegistry m;
  std::atomic<int> scrapes{0};
  double pages = 10;
  m.AddCallbackGauge("ctxcache_uptime_seconds", "Uptime", [&] { return 1.0 * ++scrapes; });
  for (const char* kind : {"meta", "pages"}) {
    m.AddCallbackGauge("ctxcache_storage_bytes", "Bytes by kind",
                       [&, kind] { return std::string(kind) == "pages" ? pages : 7.0; },
                       {{"kind", kind}});
  }
  m.AddCallbackCounter("ctxcache_policy_evictions_total", "Policy evictions", [] { return 5.0; });

  std::string first = m.Render();
  EXPECT_TRUE(HasLine(first, "# TYPE ctxcache_uptime_seconds gauge")) << first;
  EXPECT_TRUE(HasLine(first, "ctxcache_uptime_seconds 1")) << first;
  EXPECT_TRUE(HasLine(first, "# HELP ctxcache_storage_bytes Bytes by kind")) << first;
  EXPECT_TRUE(HasLine(first, "ctxcache_storage_bytes{kind=\"meta\"} 7")) << first;
  EXPECT_TRUE(HasLine(first, "ctxcache_storage_bytes{kind=\"pages\"} 10")) << first;
  EXPECT_TRUE(HasLine(first, "# TYPE ctxcache_policy_evictions_total counter")) << first;
  EXPECT_TRUE(HasLine(first, "ctxcache_policy_evictions_total 5")) << first;

  pages = 4096;
  std::string second = m.Render();
  EXPECT_TRUE(HasLine(second, "ctxcache_uptime_seconds 2")) << second;
  EXPECT_TRUE(HasLine(second, "ctxcache_storage_bytes{kind=\"pages\"} 4096")) << second;

  // Re-registering the same name and labels replaces the function.
  m.AddCallbackGauge("ctxcache_uptime_seconds", "Uptime", [] { return 99.0; });
  std::string third = m.Render();
  EXPECT_TRUE(HasLine(third, "ctxcache_uptime_seconds 99")) << third;
  EXPECT_EQ(third.find("ctxcache_uptime_seconds 3"), std::string::npos) << third;
}

TEST(MetricsRegistryTest, MisusedNamesGetAStableHandleThatIsNotExported) {
  MetricsRegistry m;
  m.GetCounter("ctxcache_x_total", "x")->Inc();
  Gauge* wrong = m.GetGauge("ctxcache_x_total", "x as a gauge");
  ASSERT_NE(wrong, nullptr);
  EXPECT_EQ(m.GetGauge("ctxcache_x_total", "x as a gauge"), wrong);
  wrong->Set(42);
  Counter* invalid = m.GetCounter("not a metric name", "bad");
  ASSERT_NE(invalid, nullptr);
  EXPECT_EQ(m.GetCounter("not a metric name", "bad"), invalid);
  invalid->Inc();
  std::string text = m.Render();
  EXPECT_TRUE(HasLine(text, "# TYPE ctxcache_x_total counter")) << text;
  EXPECT_TRUE(HasLine(text, "ctxcache_x_total 1")) << text;
  EXPECT_EQ(text.find("42"), std::string::npos) << text;
  EXPECT_EQ(text.find("not a metric name"), std::string::npos) << text;
}

TEST(MetricsHttpServerTest, ServesMetricsOverHttpOnAnEphemeralPort) {
  MetricsRegistry m;
  Counter* c = m.GetCounter("ctxcache_builds_total", "Contexts built");
  c->Inc(2);
  m.GetHistogram("ctxcache_rpc_duration_seconds", "RPC time", {{"method", "GetContext"}})
      ->Observe(0.002);
  double bytes = 123;
  m.AddCallbackGauge("ctxcache_stored_bytes", "Stored bytes", [&] { return bytes; });

  MetricsHttpServer http(&m);
  Status s = http.Start("127.0.0.1:0");
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_GT(http.port(), 0);

  std::string resp = HttpGet(http.port(), "/metrics");
  ASSERT_NE(resp.find("HTTP/1.1 200 OK"), std::string::npos) << resp;
  EXPECT_NE(resp.find("Content-Type: text/plain"), std::string::npos) << resp;
  std::string body = Body(resp);
  EXPECT_TRUE(HasLine(body, "# TYPE ctxcache_builds_total counter")) << body;
  EXPECT_TRUE(HasLine(body, "ctxcache_builds_total 2")) << body;
  EXPECT_TRUE(HasLine(body, "# TYPE ctxcache_rpc_duration_seconds histogram")) << body;
  EXPECT_TRUE(
      HasLine(body, "ctxcache_rpc_duration_seconds_bucket{method=\"GetContext\",le=\"0.0025\"} 1"))
      << body;
  EXPECT_TRUE(HasLine(body, "ctxcache_stored_bytes 123")) << body;

  // Each scrape sees current values.
  c->Inc();
  bytes = 456;
  body = Body(HttpGet(http.port(), "/metrics"));
  EXPECT_TRUE(HasLine(body, "ctxcache_builds_total 3")) << body;
  EXPECT_TRUE(HasLine(body, "ctxcache_stored_bytes 456")) << body;

  std::string index = HttpGet(http.port(), "/");
  EXPECT_NE(index.find("HTTP/1.1 200 OK"), std::string::npos) << index;
  EXPECT_NE(index.find("/metrics"), std::string::npos) << index;
  std::string missing = HttpGet(http.port(), "/nope");
  EXPECT_NE(missing.find("HTTP/1.1 404"), std::string::npos) << missing;

  // Concurrent scrapes while the counter moves.
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop) c->Inc();
  });
  std::vector<std::thread> scrapers;
  std::atomic<int> good{0};
  for (int i = 0; i < 4; ++i) {
    scrapers.emplace_back([&] {
      if (HttpGet(http.port(), "/metrics").find("ctxcache_builds_total ") != std::string::npos) {
        ++good;
      }
    });
  }
  for (auto& t : scrapers) t.join();
  stop = true;
  writer.join();
  EXPECT_EQ(good.load(), 4);

  const int port = http.port();
  http.Stop();
  http.Stop();  // idempotent
  EXPECT_EQ(HttpGet(port, "/metrics"), "");
}

TEST(MetricsHttpServerTest, BadAddressesAreErrors) {
  MetricsRegistry m;
  MetricsHttpServer no_port(&m);
  EXPECT_EQ(no_port.Start("127.0.0.1").code(), StatusCode::kInvalidArgument);

  MetricsHttpServer first(&m);
  ASSERT_TRUE(first.Start("127.0.0.1:0").ok());
  MetricsHttpServer second(&m);
  Status s = second.Start("127.0.0.1:" + std::to_string(first.port()));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.ToString().find("--metrics-listen"), std::string::npos) << s.ToString();
  EXPECT_NE(s.ToString().find("in use"), std::string::npos) << s.ToString();

  // Debian 12's civetweb has no IPv6: a clear error, not a bind failure.
  MetricsHttpServer v6(&m);
  Status v6_status = v6.Start("[::1]:0");
  if (!v6_status.ok()) {
    EXPECT_EQ(v6_status.code(), StatusCode::kInvalidArgument) << v6_status.ToString();
    EXPECT_NE(v6_status.ToString().find("IPv6"), std::string::npos) << v6_status.ToString();
  }

  // Host names resolve as before.
  MetricsHttpServer by_name(&m);
  Status n = by_name.Start("localhost:0");
  ASSERT_TRUE(n.ok()) << n.ToString();
  EXPECT_GT(by_name.port(), 0);
}

// The process_* metrics read /proc/self: this process runs, holds memory and
// open files (stdin/out/err at least), and started before now.
TEST(ProcessMetricsTest, ReadsThisProcessAndRegistersStandardNames) {
  const ProcessStats st = ReadProcessStats();
  EXPECT_GT(st.resident_bytes, 0u);
  EXPECT_GE(st.virtual_bytes, st.resident_bytes);
  EXPECT_GE(st.open_fds, 3u);
  EXPECT_GE(st.max_fds, st.open_fds);
  EXPECT_GE(st.cpu_seconds, 0.0);
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_LE(st.start_time_seconds, now + 1);
  EXPECT_GT(st.start_time_seconds, now - 86400 * 365);
  MetricsRegistry m;
  RegisterProcessMetrics(&m);
  const std::string text = m.Render();
  EXPECT_TRUE(HasLine(text, "# TYPE process_cpu_seconds_total counter")) << text;
  for (const char* g : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                        "process_open_fds", "process_max_fds", "process_start_time_seconds"}) {
    EXPECT_TRUE(HasLine(text, std::string("# TYPE ") + g + " gauge")) << text;
  }
}

}  // namespace
}  // namespace ctxcache::service
