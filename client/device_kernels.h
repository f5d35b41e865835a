// The optimizer's kernels for the groups it steps on the device (OffloadedAdam::SetGroupPlace):
// Adam over state in device-tier chunks, gradients and new weights in device memory. Two
// backends, as the daemon's device has: `cuda` runs kernels/gpu_adam.h on a stream of the
// optimizer's own, and `emulated` (the daemon's host memory standing in for a GPU's) runs the CPU
// kernels over those host pointers — the same results bit for bit as a step on the host, which is
// what the tests check the device lane's bookkeeping against.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "kernels/adam_types.h"

namespace tierd::internal {

class DeviceKernels {
 public:
  virtual ~DeviceKernels() = default;
  // One step in place over tensors whose pointers are the device's (each tensor's own `step`
  // counts from 1). Returns when the device is done with them.
  virtual absl::Status Step(std::span<const kernels::AdamTensor> tensors,
                            const kernels::AdamOptions& options) = 0;
  // Whether every gradient is finite.
  virtual absl::StatusOr<bool> Finite(std::span<const kernels::AdamTensor> tensors) = 0;
  // Copies host memory to the device, and device memory to device memory; returns when done.
  virtual absl::Status Upload(void* device_dst, const void* host_src, uint64_t bytes) = 0;
  virtual absl::Status Copy(void* device_dst, const void* device_src, uint64_t bytes) = 0;
};

// The emulated device's: the CPU kernels on a pool of `threads` (0: one per CPU).
std::unique_ptr<DeviceKernels> MakeEmulatedKernels(int threads);
// The GPU of this CUDA ordinal's. FAILED_PRECONDITION when built without CUDA.
absl::StatusOr<std::unique_ptr<DeviceKernels>> MakeCudaKernels(int ordinal);

}  // namespace tierd::internal
