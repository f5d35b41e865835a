// The CUDA backend of DeviceKernels: kernels/gpu_adam.h on a stream of the optimizer's own, in
// the GPU's primary context (the one PyTorch and the client's imported device segments use).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/device_kernels.h"
#include "kernels/gpu_adam.h"

namespace tierd::internal {
namespace {

absl::Status CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class CudaKernels final : public DeviceKernels {
 public:
  CudaKernels(int ordinal, cudaStream_t stream, int* finite)
      : ordinal_(ordinal), stream_(stream), finite_(finite) {}
  ~CudaKernels() override {
    cudaSetDevice(ordinal_);
    cudaFree(finite_);
    cudaStreamDestroy(stream_);
  }

  absl::Status Step(std::span<const kernels::AdamTensor> tensors,
                    const kernels::AdamOptions& options) override {
    if (tensors.empty()) return absl::OkStatus();
    if (absl::Status s = CudaError(cudaSetDevice(ordinal_), "cudaSetDevice"); !s.ok()) return s;
    // The GPU kernel takes one step count and one gradient and output type per launch.
    std::map<int64_t, std::vector<kernels::GpuAdamTensor>> by_step;
    for (const kernels::AdamTensor& t : tensors) {
      absl::StatusOr<const void*> grad = Reach(t.grad);
      if (!grad.ok()) return grad.status();
      absl::StatusOr<const void*> out = Reach(t.out);
      if (!out.ok()) return out.status();
      by_step[t.step].push_back({.param = t.param,
                                 .m = static_cast<float*>(t.m),
                                 .v = static_cast<float*>(t.v),
                                 .grad = *grad,
                                 .out = const_cast<void*>(*out),
                                 .n = t.n});
    }
    const kernels::DType out_type = tensors[0].out_type;
    for (const auto& [step, group] : by_step) {
      const cudaError_t e = kernels::GpuAdamStep(group.data(), group.size(), tensors[0].grad_type,
                                                 out_type, options, step, stream_);
      if (absl::Status s = CudaError(e, "GpuAdamStep"); !s.ok()) return s;
    }
    return CudaError(cudaStreamSynchronize(stream_), "the device's Adam step");
  }

  absl::StatusOr<bool> Finite(std::span<const kernels::AdamTensor> tensors) override {
    if (tensors.empty()) return true;
    if (absl::Status s = CudaError(cudaSetDevice(ordinal_), "cudaSetDevice"); !s.ok()) return s;
    std::vector<kernels::GpuAdamTensor> grads;
    for (const kernels::AdamTensor& t : tensors) {
      absl::StatusOr<const void*> grad = Reach(t.grad);
      if (!grad.ok()) return grad.status();
      grads.push_back({.grad = *grad, .n = t.n});
    }
    int all = 1;
    cudaError_t e = cudaMemcpyAsync(finite_, &all, sizeof(all), cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess) {
      e = kernels::GpuGradientsFinite(grads.data(), grads.size(), tensors[0].grad_type, finite_,
                                      stream_);
    }
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(&all, finite_, sizeof(all), cudaMemcpyDeviceToHost, stream_);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (absl::Status s = CudaError(e, "the device's gradient check"); !s.ok()) return s;
    return all != 0;
  }

  absl::Status Upload(void* device_dst, const void* host_src, uint64_t bytes) override {
    return Transfer(device_dst, host_src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status Copy(void* device_dst, const void* device_src, uint64_t bytes) override {
    return Transfer(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice);
  }

 private:
  // The address the GPU reads or writes `p` at: device memory as it is; pinned host memory (torch's
  // pin_memory, the client's registered host segments) through its mapping for the device, which
  // the kernel then reads and writes over the link in place.
  static absl::StatusOr<const void*> Reach(const void* p) {
    if (p == nullptr) return p;
    cudaPointerAttributes a{};
    if (absl::Status s = CudaError(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
        !s.ok()) {
      return s;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return p;
    if (a.type == cudaMemoryTypeHost && a.devicePointer != nullptr) return a.devicePointer;
    return absl::FailedPreconditionError(absl::StrCat(
        "memory at ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
        " is not reachable by the GPU: a group stepped on the device takes its gradients and "
        "out in device memory or pinned host memory"));
  }

  absl::Status Transfer(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind) {
    if (absl::Status s = CudaError(cudaSetDevice(ordinal_), "cudaSetDevice"); !s.ok()) return s;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    return CudaError(e, "a copy for the device's step");
  }

  const int ordinal_;
  const cudaStream_t stream_;
  int* const finite_;  // device memory: the gradient check's verdict
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceKernels>> MakeCudaKernels(int ordinal) {
  if (absl::Status s = CudaError(cudaSetDevice(ordinal), "cudaSetDevice"); !s.ok()) return s;
  cudaStream_t stream = nullptr;
  if (absl::Status s =
          CudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  void* finite = nullptr;
  if (absl::Status s = CudaError(cudaMalloc(&finite, sizeof(int)), "cudaMalloc"); !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<DeviceKernels>(
      new CudaKernels(ordinal, stream, static_cast<int*>(finite)));
}

}  // namespace tierd::internal
