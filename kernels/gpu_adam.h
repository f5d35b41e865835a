// GPU Adam and AdamW over device-resident optimizer state: the same step as the CPU kernels
// (kernels/cpu_adam.h), fused into one pass and applied to many tensors by one launch. Each block
// takes a fixed-size slice of one tensor; fp32 parameters and state move in 16-byte vectors
// wherever the slice is 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/adam_types.h"

namespace tierd::kernels {

// One tensor's device pointers. `grad` holds n values of the step's gradient type; `out`, when
// not null, receives the new weights in the step's output type.
struct GpuAdamTensor {
  float* param = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  void* out = nullptr;
  uint64_t n = 0;
};

// Enqueues one step (`step` counts from 1) over every tensor on `stream`, in as few launches as
// the kernel's parameter space allows (one per 32 tensors or 320 slices of 64 Ki elements).
// Every tensor of a call has the same gradient and output types. Returns the launch error.
cudaError_t GpuAdamStep(const GpuAdamTensor* tensors, size_t count, DType grad_type, DType out_type,
                        const AdamOptions& options, int64_t step, cudaStream_t stream);

// Sets *all_finite (device memory, an int the caller set to 1) to 0 when any gradient of any
// tensor is infinite or NaN.
cudaError_t GpuGradientsFinite(const GpuAdamTensor* tensors, size_t count, DType grad_type,
                               int* all_finite, cudaStream_t stream);

}  // namespace tierd::kernels
