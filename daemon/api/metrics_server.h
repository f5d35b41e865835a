// The daemon's /metrics endpoint: a small HTTP server (civetweb, the server prometheus-cpp's pull
// exposer is built on) that answers GET and HEAD /metrics with the text exposition `collect`
// renders at that moment (prometheus-cpp's serializer; docs/dependencies.md says why not its
// exposer). One endpoint per node, for all sessions; loopback by default.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct mg_context;
struct mg_connection;

namespace tierd::daemon {

class MetricsServer {
 public:
  // `listen` is HOST:PORT (127.0.0.1:9477, [::1]:9477, 0.0.0.0:9477); port 0 takes a free one.
  // INVALID_ARGUMENT for a malformed address, UNAVAILABLE (naming it) when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              std::function<std::string()> collect);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The address actually bound, e.g. "127.0.0.1:9477", and the URL of its metrics.
  const std::string& address() const { return address_; }
  std::string url() const { return "http://" + address_ + "/metrics"; }
  // Whether only this host can reach it (127.0.0.0/8, ::1, localhost).
  bool loopback() const { return loopback_; }

 private:
  MetricsServer() = default;
  static int Handle(mg_connection* conn, void* self);
  // Opens and closes a connection to the listener, which wakes its accept loop.
  void Knock() const;

  std::function<std::string()> collect_;
  mg_context* ctx_ = nullptr;
  std::string address_;
  bool loopback_ = false;
  int port_ = 0;
  bool ipv6_ = false;
  std::string knock_host_;  // the host listened on (IPv4)
};

}  // namespace tierd::daemon
