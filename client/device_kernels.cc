#include "client/device_kernels.h"

#include <cstring>

#include "kernels/cpu_adam.h"
#include "kernels/thread_pool.h"

namespace tierd::internal {
namespace {

// Device memory is host memory here: the CPU kernels run on it as they would on the host tier.
class EmulatedKernels final : public DeviceKernels {
 public:
  explicit EmulatedKernels(int threads) : pool_(threads) {}

  absl::Status Step(std::span<const kernels::AdamTensor> tensors,
                    const kernels::AdamOptions& options) override {
    // Every tensor carries its own step; the call's is a placeholder they all override.
    kernels::AdamStep(tensors, options, 1, pool_);
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Finite(std::span<const kernels::AdamTensor> tensors) override {
    return kernels::GradientsFinite(tensors, pool_);
  }
  absl::Status Upload(void* device_dst, const void* host_src, uint64_t bytes) override {
    std::memcpy(device_dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status Copy(void* device_dst, const void* device_src, uint64_t bytes) override {
    std::memmove(device_dst, device_src, bytes);
    return absl::OkStatus();
  }

 private:
  kernels::ThreadPool pool_;
};

}  // namespace

std::unique_ptr<DeviceKernels> MakeEmulatedKernels(int threads) {
  return std::make_unique<EmulatedKernels>(threads);
}

#ifndef TIERD_CLIENT_CUDA_KERNELS
absl::StatusOr<std::unique_ptr<DeviceKernels>> MakeCudaKernels(int) {
  return absl::FailedPreconditionError(
      "the client library was built without CUDA: it cannot step optimizer state on a GPU");
}
#endif

}  // namespace tierd::internal
