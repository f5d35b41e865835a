// What sees every call of the daemon's API before and after its handler: a malformed request is
// answered as the client's error, and every request is counted and timed. rpc_server.cc registers
// RequestInterceptorFactory and is the only file that includes this one.
#pragma once

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "daemon/api/daemon_metrics.h"
#include "daemon/util/memory_trimmer.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"

namespace tierd::daemon {

// Sees every call: a request that is not a valid message of its method's type is the client's
// error (INVALID_ARGUMENT, naming the type), not the daemon's (gRPC answers INTERNAL); and, with
// metrics, counts every request by operation and status code and times it (tierd_requests_total,
// tierd_request_seconds), errors of any origin included. It tells the trimmer when the call is
// over: gRPC destroys a call's request and reply before its interceptors, so what the call freed
// is free by then. (Told when the request was parsed, the trimmer could trim while the handler
// still held it and hear nothing after.)
class RequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  RequestInterceptor(grpc::experimental::ServerRpcInfo* info, RpcMetrics* metrics,
                     MemoryTrimmer* trimmer)
      : metrics_(metrics), trimmer_(trimmer), start_(absl::Now()) {
    const absl::string_view method = info->method();  // "/tierd.v1.Tierd/Acquire"
    op_ = std::string(method.substr(method.rfind('/') + 1));
  }
  ~RequestInterceptor() override {
    if (trimmer_ != nullptr) trimmer_->Note();
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    // A request that failed to parse reaches this hook without a message.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      unparsed_ = methods->GetRecvMessage() == nullptr;
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      if (unparsed_ && status.error_code() == grpc::StatusCode::INTERNAL) {
        status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("the request is not a valid tierd.v1.", op_,
                                           "Request message (", status.error_message(), ")"));
        methods->ModifySendStatus(status);
      }
      if (metrics_ != nullptr) metrics_->Record(op_, status.error_code(), absl::Now() - start_);
    }
    methods->Proceed();
  }

 private:
  RpcMetrics* metrics_;
  MemoryTrimmer* trimmer_;
  std::string op_;
  absl::Time start_;
  bool unparsed_ = false;
};

class RequestInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `api`: the service whose methods it sees ("tierd.v1.Tierd").
  RequestInterceptorFactory(RpcMetrics* metrics, MemoryTrimmer* trimmer, absl::string_view api)
      : metrics_(metrics), trimmer_(trimmer), own_methods_(absl::StrCat("/", api, "/")) {}

  // tierd's own methods only: the standard services (health, reflection) are gRPC's, and the
  // health service's messages are not protobuf objects here.
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (!absl::StartsWith(info->method(), own_methods_)) return nullptr;
    return new RequestInterceptor(info, metrics_, trimmer_);
  }

 private:
  RpcMetrics* metrics_;
  MemoryTrimmer* trimmer_;
  const std::string own_methods_;  // "/tierd.v1.Tierd/"
};

}  // namespace tierd::daemon
