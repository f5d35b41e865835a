// The client library's use of the daemon's GPU, through the CUDA driver API (loaded at run time):
// the GPU found by UUID (its ordinal differs between processes under CUDA_VISIBLE_DEVICES), its
// primary context (the one the CUDA runtime and PyTorch use), device pool segments imported from
// the daemon's VMM fds, host memory registered for DMA, and stream waits on completion words.
//
// Every call makes the GPU's primary context current only for its own duration (push/pop), so the
// caller's current context is left as it was. Built without CUDA, Open() fails with a message and
// nothing else can be reached.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tierd::client_internal {

class CudaSession;

// Host memory page-locked and mapped for the GPU (cuMemHostRegister, portable to all contexts);
// unregistered on destruction. Must not outlive its CudaSession.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(HostRegistration&& o) noexcept
      : session_(std::exchange(o.session_, nullptr)), base_(o.base_), device_(o.device_) {}
  HostRegistration& operator=(HostRegistration&& o) noexcept;
  ~HostRegistration() { Reset(); }

  bool registered() const { return session_ != nullptr; }
  // The device address of a host address inside the registered range.
  uint64_t DeviceAddress(const void* host) const {
    return device_ + static_cast<uint64_t>(static_cast<const char*>(host) - base_);
  }

 private:
  friend class CudaSession;
  HostRegistration(const CudaSession* session, const char* base, uint64_t device)
      : session_(session), base_(base), device_(device) {}
  void Reset();

  const CudaSession* session_ = nullptr;
  const char* base_ = nullptr;
  uint64_t device_ = 0;
};

// A device pool segment of the daemon's, mapped into this process's device address space; unmapped
// on destruction. Must not outlive its CudaSession.
class DeviceMapping {
 public:
  ~DeviceMapping();
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;
  char* base() const { return reinterpret_cast<char*>(static_cast<uintptr_t>(ptr_)); }

 private:
  friend class CudaSession;
  DeviceMapping(const CudaSession* session, uint64_t size) : session_(session), size_(size) {}

  // [[maybe_unused]]: a build without CUDA never maps anything.
  [[maybe_unused]] const CudaSession* session_;
  [[maybe_unused]] uint64_t size_;
  [[maybe_unused]] uint64_t handle_ = 0;  // CUmemGenericAllocationHandle
  uint64_t ptr_ = 0;                      // CUdeviceptr of the reserved range
  [[maybe_unused]] bool mapped_ = false;
};

class CudaSession {
 public:
  // Opens the GPU with this UUID ("GPU-…") and retains its primary context. NOT_FOUND when this
  // process cannot see it (naming CUDA_VISIBLE_DEVICES), UNAVAILABLE without a driver,
  // FAILED_PRECONDITION when built without CUDA.
  static absl::StatusOr<std::unique_ptr<CudaSession>> Open(absl::string_view uuid);
  ~CudaSession();
  CudaSession(const CudaSession&) = delete;
  CudaSession& operator=(const CudaSession&) = delete;

  // The GPU's ordinal in this process (what cudaSetDevice and torch.device("cuda", n) take).
  int ordinal() const { return ordinal_; }

  // Page-locks and maps host memory for this GPU. `base` and `size` must be page-aligned.
  // `read_only`: the memory is mapped for reading only (a sealed shared base's segment).
  absl::StatusOr<HostRegistration> RegisterHost(void* base, size_t size,
                                                bool read_only = false) const;
  // Imports a VMM allocation exported by the daemon as a POSIX fd (the fd is not consumed).
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Import(int fd, uint64_t size) const;
  // Enqueues on `stream` (a CUstream / cudaStream_t; 0 is the legacy default stream) a wait until
  // the 32-bit word at `word`, inside `registration`, is cyclically ≥ `value`
  // ((int32_t)(*word - value) >= 0). Work enqueued after it on the stream runs only then; the
  // calling thread does not wait.
  absl::Status WaitValue(uintptr_t stream, const HostRegistration& registration, const void* word,
                         uint32_t value) const;

 private:
  friend class HostRegistration;
  friend class DeviceMapping;
  CudaSession() = default;

  // [[maybe_unused]]: a build without CUDA never opens a GPU.
  [[maybe_unused]] const void* driver_ = nullptr;  // const CudaDriver*
  [[maybe_unused]] int device_ = 0;                // CUdevice
  [[maybe_unused]] void* context_ = nullptr;       // CUcontext: the primary context, retained
  int ordinal_ = -1;
};

}  // namespace tierd::client_internal
