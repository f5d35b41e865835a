#include "daemon/api/metrics_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierd::daemon {
namespace {

// Splits HOST:PORT (HOST may be [v6]); the port is checked, the host is civetweb's to resolve.
absl::Status SplitAddress(const std::string& listen, std::string* host, int* port) {
  const size_t colon = listen.rfind(':');
  int p = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(listen.substr(colon + 1), &p) ||
      p < 0 || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address '", listen, "' is not HOST:PORT (e.g. 127.0.0.1:9477 or [::1]:9477)"));
  }
  *host = listen.substr(0, colon);
  *port = p;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::string()> collect) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitAddress(listen, &host, &port); !s.ok()) return s;
  mg_init_library(0);
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->collect_ = std::move(collect);
  // civetweb spells an IPv6 listener "+[::1]:PORT"; an IPv4 one "127.0.0.1:PORT".
  const std::string ports = absl::StrCat(host.front() == '[' ? "+" : "", host, ":", port);
  // Each connection holds a worker until its request arrives or times out: enough workers, and a
  // short enough wait, that a few idle connections cannot hold a scrape back.
  const char* options[] = {"listening_ports",    ports.c_str(), "num_threads", "16",
                           "request_timeout_ms", "2000",        nullptr};
  mg_callbacks callbacks{};
  char error_text[256] = {};
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  mg_init_data init{&callbacks, server.get(), options};
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ",
                                               error_text[0] != '\0' ? error_text : "failed"));
  }
  mg_set_request_handler(server->ctx_, "/metrics$", &MetricsServer::Handle, server.get());
  mg_server_port bound[2] = {};
  const int n = mg_get_server_ports(server->ctx_, 2, bound);
  server->address_ = absl::StrCat(host, ":", n > 0 ? bound[0].port : port);
  server->port_ = n > 0 ? bound[0].port : port;
  server->ipv6_ = host.front() == '[';
  server->knock_host_ = host;
  server->loopback_ = absl::StartsWith(host, "127.") || host == "[::1]" || host == "localhost";
  return server;
}

MetricsServer::~MetricsServer() {
  if (ctx_ == nullptr) return;
  // civetweb's accept loop polls its socket in quanta of two seconds and sees the stop request
  // only when a poll returns, so mg_stop alone takes up to two seconds (every daemon stop, every
  // test's daemon). A connection made after the request makes the poll return at once.
  std::atomic<bool> stopped{false};
  std::thread stopper([this, &stopped] {
    mg_stop(ctx_);
    stopped.store(true);
  });
  while (!stopped.load()) {
    Knock();
    absl::SleepFor(absl::Milliseconds(5));
  }
  stopper.join();
}

void MetricsServer::Knock() const {
  sockaddr_storage addr{};
  socklen_t length = 0;
  if (ipv6_) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port_));
    a->sin6_addr = in6addr_loopback;
    length = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port_));
    // A listener on one address is reached there; one on every address (0.0.0.0) or on a name
    // (localhost) through loopback.
    if (inet_pton(AF_INET, knock_host_.c_str(), &a->sin_addr) != 1 ||
        a->sin_addr.s_addr == htonl(INADDR_ANY)) {
      a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    length = sizeof(*a);
  }
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return;
  (void)connect(fd, reinterpret_cast<sockaddr*>(&addr), length);  // in progress is enough
  close(fd);
}

int MetricsServer::Handle(mg_connection* conn, void* self) {
  const mg_request_info* request = mg_get_request_info(conn);
  if (std::strcmp(request->request_method, "GET") != 0 &&
      std::strcmp(request->request_method, "HEAD") != 0) {
    mg_send_http_error(conn, 405, "only GET /metrics");
    return 405;
  }
  const std::string body = static_cast<MetricsServer*>(self)->collect_();
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
            body.size());
  if (std::strcmp(request->request_method, "GET") == 0) mg_write(conn, body.data(), body.size());
  return 200;
}

}  // namespace tierd::daemon
