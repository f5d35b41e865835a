// What the C ABI's parts share: how an error crosses it (once: the code is the return
// value, the message is tierd_last_error's) and the dtypes its kernels take. The parts:
// c_api.cc (sessions, chunks, views), c_api_node.cc (the node, schedules, shared bases, imports),
// c_api_kernels.cc (the CPU Adam kernel) and c_api_optimizer.cc (the out-of-core optimizer). No
// exception crosses it: every entry point runs its body in Guard.
#pragma once

#include <exception>
#include <string>

#include "absl/status/status.h"
#include "kernels/cpu_adam.h"
#include "tierd/client.h"

namespace tierd::c_abi {

// Records s's message for tierd_last_error (on this thread) and returns its code.
tierd_status Fail(const absl::Status& s);

inline tierd_status Done(const absl::Status& s) { return s.ok() ? TIERD_OK : Fail(s); }

inline tierd_status Invalid(const char* what) { return Fail(absl::InvalidArgumentError(what)); }

// Runs `body`, turning exceptions (e.g. std::bad_alloc) into TIERD_INTERNAL.
template <typename Body>
tierd_status Guard(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(std::string("tierd client: ") + e.what()));
  } catch (...) {
    return Fail(absl::InternalError("tierd client: unknown exception"));
  }
}

inline bool ValidDType(int t) {
  return t == TIERD_FLOAT32 || t == TIERD_BFLOAT16 || t == TIERD_FLOAT16;
}

inline kernels::DType KernelType(int t) {
  return t == TIERD_BFLOAT16  ? kernels::DType::kBF16
         : t == TIERD_FLOAT16 ? kernels::DType::kF16
                              : kernels::DType::kF32;
}

}  // namespace tierd::c_abi
