#include "client/cuda_session.h"

#include "absl/strings/str_cat.h"
#include "common/cuda_driver.h"

namespace tierd::client_internal {

#ifdef TIERD_HAVE_CUDA
namespace {

const CudaDriver& Driver(const void* driver) { return *static_cast<const CudaDriver*>(driver); }

// Makes the GPU's primary context current for one scope and restores the caller's afterwards.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& d, void* context) : d_(d) {
    pushed_ = d_.cuCtxPushCurrent(static_cast<CUcontext>(context)) == CUDA_SUCCESS;
  }
  ~ScopedContext() {
    CUcontext popped;
    if (pushed_) d_.cuCtxPopCurrent(&popped);
  }
  absl::Status status() const {
    return pushed_ ? absl::OkStatus()
                   : absl::InternalError("cannot make the GPU's primary context current");
  }

 private:
  const CudaDriver& d_;
  bool pushed_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaSession>> CudaSession::Open(absl::string_view uuid) {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  const CudaDriver& d = **driver;
  int count = 0;
  if (auto s = d.Check(d.cuDeviceGetCount(&count), "cuDeviceGetCount"); !s.ok()) return s;
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    CUuuid id{};
    if (d.cuDeviceGet(&dev, i) != CUDA_SUCCESS || d.cuDeviceGetUuid(&id, dev) != CUDA_SUCCESS ||
        CudaDriver::UuidString(id) != uuid) {
      continue;
    }
    auto session = std::unique_ptr<CudaSession>(new CudaSession());
    CUcontext ctx = nullptr;
    if (auto s = d.Check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
        !s.ok()) {
      return s;
    }
    session->driver_ = &d;
    session->device_ = dev;
    session->context_ = ctx;
    session->ordinal_ = i;
    return session;
  }
  return absl::NotFoundError(absl::StrCat("GPU ", uuid, " is not visible to this process (", count,
                                          " GPUs visible; check CUDA_VISIBLE_DEVICES)"));
}

CudaSession::~CudaSession() {
  if (context_ != nullptr) Driver(driver_).cuDevicePrimaryCtxRelease(device_);
}

absl::StatusOr<HostRegistration> CudaSession::RegisterHost(void* base, size_t size,
                                                           bool read_only) const {
  const CudaDriver& d = Driver(driver_);
  ScopedContext scope(d, context_);
  if (auto s = scope.status(); !s.ok()) return s;
  // Pages mapped read-only are registered only as such (the device may read, not write them).
  const unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                         (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0u);
  if (auto s = d.Check(d.cuMemHostRegister(base, size, flags), "cuMemHostRegister"); !s.ok()) {
    return s;
  }
  CUdeviceptr device = 0;
  if (auto s = d.Check(d.cuMemHostGetDevicePointer(&device, base, 0), "cuMemHostGetDevicePointer");
      !s.ok()) {
    d.cuMemHostUnregister(base);
    return s;
  }
  return HostRegistration(this, static_cast<const char*>(base), device);
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> CudaSession::Import(int fd, uint64_t size) const {
  const CudaDriver& d = Driver(driver_);
  ScopedContext scope(d, context_);
  if (auto s = scope.status(); !s.ok()) return s;
  auto m = std::unique_ptr<DeviceMapping>(new DeviceMapping(this, size));
  CUmemGenericAllocationHandle handle = 0;
  if (auto s = d.Check(d.cuMemImportFromShareableHandle(
                           &handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                       "cuMemImportFromShareableHandle");
      !s.ok()) {
    return s;
  }
  m->handle_ = handle;
  CUdeviceptr ptr = 0;
  if (auto s = d.Check(d.cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
      !s.ok()) {
    return s;
  }
  m->ptr_ = ptr;
  if (auto s = d.Check(d.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap"); !s.ok()) return s;
  m->mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (auto s = d.Check(d.cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess"); !s.ok()) {
    return s;
  }
  return m;
}

absl::Status CudaSession::WaitValue(uintptr_t stream, const HostRegistration& registration,
                                    const void* word, uint32_t value) const {
  const CudaDriver& d = Driver(driver_);
  ScopedContext scope(d, context_);
  if (auto s = scope.status(); !s.ok()) return s;
  return d.Check(
      d.cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), registration.DeviceAddress(word),
                            value, CU_STREAM_WAIT_VALUE_GEQ),
      "cuStreamWaitValue32");
}

HostRegistration& HostRegistration::operator=(HostRegistration&& o) noexcept {
  if (this != &o) {
    Reset();
    session_ = std::exchange(o.session_, nullptr);
    base_ = o.base_;
    device_ = o.device_;
  }
  return *this;
}

void HostRegistration::Reset() {
  if (session_ == nullptr) return;
  const CudaDriver& d = Driver(session_->driver_);
  ScopedContext scope(d, session_->context_);
  d.cuMemHostUnregister(const_cast<char*>(base_));
  session_ = nullptr;
}

DeviceMapping::~DeviceMapping() {
  const CudaDriver& d = Driver(session_->driver_);
  ScopedContext scope(d, session_->context_);
  if (mapped_) d.cuMemUnmap(ptr_, size_);
  if (ptr_ != 0) d.cuMemAddressFree(ptr_, size_);
  if (handle_ != 0) d.cuMemRelease(handle_);
}

#else  // !TIERD_HAVE_CUDA

absl::StatusOr<std::unique_ptr<CudaSession>> CudaSession::Open(absl::string_view) {
  return absl::FailedPreconditionError(
      "this client library was built without CUDA and cannot use the daemon's GPU");
}
CudaSession::~CudaSession() = default;
absl::StatusOr<HostRegistration> CudaSession::RegisterHost(void*, size_t, bool) const {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::StatusOr<std::unique_ptr<DeviceMapping>> CudaSession::Import(int, uint64_t) const {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::Status CudaSession::WaitValue(uintptr_t, const HostRegistration&, const void*,
                                    uint32_t) const {
  return absl::FailedPreconditionError("built without CUDA");
}
HostRegistration& HostRegistration::operator=(HostRegistration&& o) noexcept {
  session_ = std::exchange(o.session_, nullptr);
  return *this;
}
void HostRegistration::Reset() { session_ = nullptr; }
DeviceMapping::~DeviceMapping() = default;

#endif  // TIERD_HAVE_CUDA

}  // namespace tierd::client_internal
