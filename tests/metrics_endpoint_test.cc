// The daemon's /metrics endpoint, scraped over HTTP from a real daemon while a client moves data
// through every tier; the exposition is checked by promtool (Debian's prometheus package).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "testing/daemon_process.h"
#include "tierd/client.hpp"

namespace tierd {
namespace {

using testing::DaemonProcess;

std::string DaemonBinary() { return testing::ExecutableDir() + "/../daemon/tierd"; }

// The URL the daemon logged ("serving metrics on http://127.0.0.1:PORT/metrics").
// The address the daemon logs once its endpoint is up (the line may follow its socket's creation,
// which is what Start waits for).
std::string MetricsUrl(const DaemonProcess& d) {
  const std::regex line("serving metrics on (http://[^ \n]+)");
  for (absl::Time give_up = absl::Now() + absl::Seconds(10); absl::Now() < give_up;) {
    std::smatch m;
    const std::string log = d.Log();
    if (std::regex_search(log, m, line)) return m[1];
    absl::SleepFor(absl::Milliseconds(10));
  }
  return "";
}

struct HttpResponse {
  int status = 0;
  std::string headers, body;
};

// One HTTP/1.1 request to http://127.0.0.1:PORT/PATH; the server closes the connection.
HttpResponse Http(const std::string& url, const std::string& method = "GET") {
  HttpResponse r;
  std::smatch m;
  if (!std::regex_match(url, m, std::regex("http://127\\.0\\.0\\.1:([0-9]+)(/.*)"))) return r;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(m[1])));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return r;
  }
  const std::string request = absl::StrCat(
      method, " ", std::string(m[2]), " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  (void)!write(fd, request.data(), request.size());
  std::string all;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) all.append(buf, n);
  close(fd);
  const size_t split = all.find("\r\n\r\n");
  if (split == std::string::npos) return r;
  r.headers = all.substr(0, split);
  r.body = all.substr(split + 4);
  (void)absl::SimpleAtoi(std::string(r.headers.substr(9, 3)), &r.status);
  return r;
}

// Samples by their full series name ("tierd_x{a=\"b\"}").
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (absl::SimpleAtod(line.substr(space + 1), &v)) out[std::string(line.substr(0, space))] = v;
  }
  return out;
}

class MetricsEndpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto daemon = DaemonProcess::Start(
        {.binary = DaemonBinary(),
         .args = {"--host_capacity=64MiB", "--host_segment_size=16MiB", "--device=emulated",
                  "--device_capacity=32MiB", "--device_segment_size=16MiB", "--probe_bytes=0"}});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    url_ = MetricsUrl(*daemon_);
    ASSERT_FALSE(url_.empty()) << daemon_->Log();
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::string url_;
};

TEST_F(MetricsEndpointTest, CountsWhatAClientMovesThroughEveryTierAndPassesPromtool) {
  auto client = Client::Connect({.socket_dir = daemon_->socket_dir(), .client_name = "metrics"});
  ASSERT_TRUE(client.ok()) << client.status();
  Client& c = **client;
  constexpr uint64_t kChunk = 1 << 20, kChunks = 4;
  std::vector<ChunkSpec> specs(kChunks, ChunkSpec{.size = kChunk, .home = Tier::kNvme});
  auto ids = c.AllocateIds(specs);
  ASSERT_TRUE(ids.ok()) << ids.status();
  auto w = c.AcquireIds(*ids, Tier::kHost, AccessMode::kOverwrite);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(c.Wait(w->ready).ok());
  {  // An import: the daemon reads a file's bytes into a chunk.
    const std::string path = daemon_->socket_dir() + "/weights.bin";
    std::ofstream(path) << std::string(8192, 'w');
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    ASSERT_EQ(fstat(fd, &st), 0);
    const Client::FileRange range{.file_offset = 0, .chunk_offset = 0, .length = 8192};
    auto imported = c.Import((*ids)[0], fd, 8192,
                             st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec, {&range, 1});
    close(fd);
    ASSERT_TRUE(imported.ok()) << imported.status();
  }
  for (const AcquiredChunk& a : w->chunks) std::memset(a.data, 0x5a, kChunk);
  ASSERT_TRUE(c.Release(*ids).ok());
  auto down = c.EvictIds(*ids, Tier::kNvme);  // host -> NVMe
  ASSERT_TRUE(down.ok() && c.Wait(*down).ok());
  auto up = c.PrefetchIds(*ids, Tier::kDevice);  // NVMe -> host -> device
  ASSERT_TRUE(up.ok() && c.Wait(*up).ok());
  auto back = c.EvictIds(*ids, Tier::kHost);  // device -> host (written there, then dropped)
  ASSERT_TRUE(back.ok());
  (void)c.Wait(*back);
  const ChunkId unknown = 1ull << 60;
  EXPECT_TRUE(absl::IsNotFound(c.Free({&unknown, 1})));

  const HttpResponse r = Http(url_);
  ASSERT_EQ(r.status, 200) << r.headers;
  EXPECT_NE(r.headers.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  std::map<std::string, double> s = Samples(r.body);
  const double mib4 = kChunks * kChunk;
  EXPECT_GE(s["tierd_moved_bytes_total{path=\"host_to_nvme\"}"], mib4);
  EXPECT_GE(s["tierd_moved_bytes_total{path=\"nvme_to_host\"}"], mib4);
  // The PCIe paths name the GPU (here the emulated one) that tierd_device_info describes.
  std::smatch gpu;
  ASSERT_TRUE(
      std::regex_search(r.body, gpu, std::regex("\ntierd_device_info\\{device=\"([^\"]+)\"")))
      << r.body;
  EXPECT_GE(s["tierd_moved_bytes_total{path=\"host_to_device\",device=\"" + gpu[1].str() + "\"}"],
            mib4);
  EXPECT_GE(s["tierd_moves_total{path=\"host_to_nvme\"}"], kChunks);
  EXPECT_GE(s["tierd_transfer_seconds_count{path=\"host_to_nvme\"}"], kChunks);
  const std::string region = daemon_->socket_dir() + "/nvme0.region";
  EXPECT_GE(s["tierd_nvme_written_bytes_total{region=\"" + region + "\"}"], mib4);
  EXPECT_GE(s["tierd_nvme_read_bytes_total{region=\"" + region + "\"}"], mib4);
  EXPECT_EQ(s["tierd_sessions"], 1);
  EXPECT_EQ(s["tierd_imports_total{code=\"OK\"}"], 1);
  EXPECT_EQ(s["tierd_import_bytes_total{direct=\"true\"}"] +
                s["tierd_import_bytes_total{direct=\"false\"}"],
            8192);
  EXPECT_GE(s["tierd_chunks{state=\"ready\"}"] + s["tierd_chunks{state=\"moving\"}"], kChunks);
  EXPECT_EQ(s["tierd_requests_total{code=\"NOT_FOUND\",op=\"Free\"}"], 1);
  EXPECT_EQ(s["tierd_requests_total{code=\"OK\",op=\"Allocate\"}"], 1);
  EXPECT_GE(s["tierd_request_seconds_count{op=\"Acquire\"}"], 1);
  EXPECT_EQ(s["tierd_tier_capacity_bytes{tier=\"host\"}"], 64 << 20);
  EXPECT_NE(r.body.find("\ntierd_build_info{version=\""), std::string::npos);

  // Bounded labels only: no chunk or session ids.
  std::regex label_names("([a-z_]+)=\"");
  for (auto it = std::sregex_iterator(r.body.begin(), r.body.end(), label_names);
       it != std::sregex_iterator(); ++it) {
    const std::string name = (*it)[1];
    EXPECT_TRUE(name == "tier" || name == "path" || name == "state" || name == "result" ||
                name == "kind" || name == "op" || name == "code" || name == "le" ||
                name == "region" || name == "device" || name == "name" || name == "emulated" ||
                name == "version" || name == "build_type" || name == "cuda" || name == "uid" ||
                name == "limit" || name == "backend" || name == "what" || name == "direct")
        << "unexpected label " << name;
  }

  // Prometheus's own linter.
  const std::string file = daemon_->socket_dir() + "/metrics.txt";
  std::ofstream(file) << r.body;
  std::string out;
  const int rc = testing::RunProcess({"/bin/sh", "-c", "promtool check metrics < " + file}, &out);
  EXPECT_EQ(rc, 0) << out;
}

TEST_F(MetricsEndpointTest, AnswersOnlyGetAndHeadOnTheMetricsPath) {
  EXPECT_EQ(Http(url_, "POST").status, 405);
  EXPECT_EQ(Http(url_.substr(0, url_.rfind('/')) + "/other").status, 404);
  const HttpResponse head = Http(url_, "HEAD");
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty());
}

// Each connection holds one of the endpoint's workers until its request arrives: with two workers
// and a 10 s request timeout, two idle connections held every scrape back for 10 s.
TEST_F(MetricsEndpointTest, IdleConnectionsDoNotHoldAScrapeBack) {
  std::smatch m;
  ASSERT_TRUE(std::regex_match(url_, m, std::regex("http://127\\.0\\.0\\.1:([0-9]+)/metrics")));
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(m[1])));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));  // accepted and waiting for their requests
  const absl::Time asked = absl::Now();
  EXPECT_EQ(Http(url_).status, 200);
  EXPECT_LT(absl::Now() - asked, absl::Seconds(1));
  for (int fd : idle) close(fd);
}

TEST(MetricsListenTest, AnEndpointOtherHostsCanReachIsWarnedAbout) {
  auto daemon = DaemonProcess::Start(
      {.binary = DaemonBinary(),
       .args = {"--host_capacity=16MiB", "--host_segment_size=16MiB", "--device=none",
                "--probe_bytes=0", "--metrics_listen=0.0.0.0:0"}});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_NE((*daemon)->Log().find("is reachable from other hosts"), std::string::npos)
      << (*daemon)->Log();
  EXPECT_EQ((*daemon)->Stop(), 0);
}

TEST_F(MetricsEndpointTest, ADaemonWhosePortIsTakenSaysSoAndExits) {
  const std::string address = url_.substr(7, url_.rfind('/') - 7);  // 127.0.0.1:PORT
  auto second = DaemonProcess::Start(
      {.binary = DaemonBinary(),
       .args = {"--host_capacity=16MiB", "--host_segment_size=16MiB", "--device=none",
                "--probe_bytes=0", "--metrics_listen=" + address}});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(std::string(second.status().message()).find("cannot serve metrics on " + address),
            std::string::npos)
      << second.status();
}

TEST_F(MetricsEndpointTest, AMalformedAddressIsRefusedAtStart) {
  auto bad = DaemonProcess::Start({.binary = DaemonBinary(),
                                   .args = {"--host_capacity=16MiB", "--host_segment_size=16MiB",
                                            "--device=none", "--metrics_listen=localhost"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("is not HOST:PORT"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace tierd

namespace tierd {
namespace {

// What the machine refused is a metric for as long as it holds, not only a line in the start-up
// log.
TEST(MetricsFallbackTest, ADaemonWithoutIoUringSaysSoInItsMetrics) {
  auto daemon = DaemonProcess::Start({.binary = DaemonBinary(),
                                      .args = {"--host_capacity=32MiB", "--host_segment_size=16MiB",
                                               "--huge_pages=never", "--probe_bytes=0"},
                                      .without_io_uring = true});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string url = MetricsUrl(**daemon);
  ASSERT_FALSE(url.empty()) << (*daemon)->Log();
  const HttpResponse r = Http(url);
  ASSERT_EQ(r.status, 200);
  std::map<std::string, double> s = Samples(r.body);
  EXPECT_EQ(s["tierd_fallback{what=\"nvme_io_threads\"}"], 1) << r.body;
  // Huge pages were turned off, not refused: that is no fallback.
  EXPECT_EQ(s.count("tierd_fallback{what=\"host_small_pages\"}"), 0u);
  EXPECT_EQ((*daemon)->Stop(), 0);
}

}  // namespace
}  // namespace tierd
