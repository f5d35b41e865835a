// The C ABI of the CPU Adam kernel (kernels/): one fused step over one tensor, on a pool of
// threads shared by the process.
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/adam_hyper.h"
#include "client/c_api_common.h"
#include "kernels/cpu_adam.h"
#include "tierd/client.h"

using tierd::c_abi::Guard;
using tierd::c_abi::Invalid;
using tierd::c_abi::KernelType;
using tierd::c_abi::ValidDType;

namespace {

// The pool behind tierd_cpu_adam_step: one per process, rebuilt when a call asks for another size.
absl::Mutex pool_mu;
std::unique_ptr<tierd::kernels::ThreadPool> pool ABSL_GUARDED_BY(pool_mu);
int pool_threads ABSL_GUARDED_BY(pool_mu) = -1;

}  // namespace

extern "C" {

tierd_status tierd_cpu_adam_step(float* param, float* m, float* v, const void* grad, int grad_dtype,
                                 void* out, int out_dtype, uint64_t n,
                                 const tierd_adam_hyper* hyper, float grad_scale, int64_t step,
                                 int threads) {
  if (param == nullptr || m == nullptr || v == nullptr || grad == nullptr || hyper == nullptr) {
    return Invalid("tierd_cpu_adam_step: NULL argument");
  }
  if (!ValidDType(grad_dtype) ||
      (out != nullptr && out_dtype != TIERD_BFLOAT16 && out_dtype != TIERD_FLOAT16)) {
    return Invalid(
        "tierd_cpu_adam_step: grad_dtype must be a tierd_dtype and out_dtype "
        "TIERD_BFLOAT16 or TIERD_FLOAT16");
  }
  if (step < 1 || !(grad_scale > 0) || threads < 0) {
    return Invalid("tierd_cpu_adam_step: step counts from 1, grad_scale > 0, threads >= 0");
  }
  return Guard([&] {
    const tierd::kernels::AdamTensor t{.param = param,
                                       .m = m,
                                       .v = v,
                                       .grad = grad,
                                       .grad_type = KernelType(grad_dtype),
                                       .out = out,
                                       .out_type = KernelType(out_dtype),
                                       .n = n};
    const tierd::kernels::AdamOptions o = tierd::KernelOptions(tierd::FromC(*hyper), grad_scale);
    absl::MutexLock lock(&pool_mu);
    if (pool == nullptr || pool_threads != threads) {
      pool.reset();
      pool = std::make_unique<tierd::kernels::ThreadPool>(threads);
      pool_threads = threads;
    }
    tierd::kernels::AdamStep({&t, 1}, o, step, *pool);
    return TIERD_OK;
  });
}

}  // extern "C"
