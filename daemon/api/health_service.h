// The gRPC health checking protocol (grpc.health.v1.Health) for the daemon's RPC server: what
// grpc_health_probe and Kubernetes-style probes ask. Included by rpc_server.cc only.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpc_health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace tierd::daemon {

namespace health = ::grpc::health::v1;

// The gRPC health checking protocol, for the daemon as a whole ("") and for its API by name. A
// synchronous service of its own, not gRPC's default one: that one is a callback service, and a
// server with any callback service answers every synchronous call about 30 us later.
//
// Watch holds a server thread for as long as the watcher stays: at most kMaxWatchers at a time
// (RESOURCE_EXHAUSTED beyond), each woken by a change, a stop, or its own cancellation.
class HealthService final : public health::Health::Service {
 public:
  static constexpr int kMaxWatchers = 8;

  // `api`: the name the daemon's API answers to, beside "" (the daemon as a whole).
  explicit HealthService(std::string api) : api_(std::move(api)) {}

  // Until then NOT_SERVING; after Stop, NOT_SERVING for good and every watcher told so.
  void SetServing(bool serving) {
    absl::MutexLock lock(&mu_);
    if (!stopped_) serving_ = serving;
    changed_.SignalAll();
  }
  void Stop() {
    absl::MutexLock lock(&mu_);
    serving_ = false;
    stopped_ = true;
    changed_.SignalAll();
  }

  grpc::Status Check(grpc::ServerContext*, const health::HealthCheckRequest* req,
                     health::HealthCheckResponse* resp) override {
    if (!Known(req->service())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("no service '", req->service(), "' here; ask about '' (the ",
                                       "daemon) or '", api_, "'"));
    }
    absl::MutexLock lock(&mu_);
    resp->set_status(Status());
    return grpc::Status::OK;
  }

  grpc::Status Watch(grpc::ServerContext* ctx, const health::HealthCheckRequest* req,
                     grpc::ServerWriter<health::HealthCheckResponse>* writer) override {
    const bool known = Known(req->service());
    mu_.Lock();
    if (watchers_ >= kMaxWatchers) {
      mu_.Unlock();
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(kMaxWatchers, " health watchers already; use Check"));
    }
    ++watchers_;
    std::optional<health::HealthCheckResponse::ServingStatus> sent;
    for (;;) {
      const auto now = known ? Status() : health::HealthCheckResponse::SERVICE_UNKNOWN;
      if (now != sent) {
        health::HealthCheckResponse resp;
        resp.set_status(now);
        mu_.Unlock();  // a slow watcher holds up only its own thread
        const bool written = writer->Write(resp);
        mu_.Lock();
        if (!written) break;
        sent = now;
      }
      if (stopped_ || ctx->IsCancelled()) break;
      // Woken by a change or a stop; a watcher that went is noticed within the timeout.
      changed_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
    }
    --watchers_;
    mu_.Unlock();
    return grpc::Status::OK;
  }

 private:
  bool Known(const std::string& service) const { return service.empty() || service == api_; }
  health::HealthCheckResponse::ServingStatus Status() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_ ? health::HealthCheckResponse::SERVING
                    : health::HealthCheckResponse::NOT_SERVING;
  }

  const std::string api_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int watchers_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tierd::daemon
