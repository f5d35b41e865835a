// The CUDA backend: device pool segments are VMM allocations (cuMemCreate) exportable as POSIX
// fds, mapped into the daemon's address space for its own copies; copies run on one stream per
// direction; a completion thread per stream waits on an event after each copy and calls back.
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_driver.h"
#include "daemon/io/work_queue.h"
#include "daemon/tiers/device/device.h"

namespace tierd::daemon {

#ifdef TIERD_HAVE_CUDA
namespace {

// GPU memory for the device pool: one VMM allocation per segment, exported as a POSIX fd (which
// the client imports with cuMemImportFromShareableHandle; no ptrace rights or same-user
// requirement, unlike legacy CUDA IPC handles) and mapped here for the daemon's own copies.
class VmmBacking final : public SegmentBacking {
 public:
  VmmBacking(const CudaDriver* d, CUcontext ctx, CUdevice dev) : d_(d), ctx_(ctx), dev_(dev) {}

  absl::StatusOr<SegmentMemory> Create(uint32_t index, uint64_t size) override {
    (void)index;
    d_->cuCtxSetCurrent(ctx_);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev_;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (auto s = d_->Check(d_->cuMemGetAllocationGranularity(&granularity, &prop,
                                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                           "cuMemGetAllocationGranularity");
        !s.ok()) {
      return s;
    }
    if (size % granularity != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device.segment_size must be a multiple of the GPU's allocation granularity (",
          granularity, " bytes)"));
    }
    CUmemGenericAllocationHandle handle = 0;
    if (auto s = d_->Check(d_->cuMemCreate(&handle, size, &prop, 0), "cuMemCreate"); !s.ok()) {
      return s;
    }
    int fd = -1;
    CUdeviceptr ptr = 0;
    absl::Status s = d_->Check(
        d_->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
    if (s.ok()) s = d_->Check(d_->cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
    if (s.ok()) s = d_->Check(d_->cuMemMap(ptr, size, 0, handle, 0), "cuMemMap");
    if (s.ok()) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = dev_;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      s = d_->Check(d_->cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess");
    }
    // Fresh memory for a (possibly new) tenant: zero it. cuMemsetD8 is only queued on the legacy
    // default stream, which the non-blocking copy streams do not wait for, and the new tenant's
    // process writes through its own mapping: wait until the zeros are there.
    if (s.ok()) s = d_->Check(d_->cuMemsetD8(ptr, 0, size), "cuMemsetD8");
    if (s.ok()) s = d_->Check(d_->cuStreamSynchronize(nullptr), "cuStreamSynchronize");
    if (!s.ok()) {
      if (ptr != 0) {
        d_->cuMemUnmap(ptr, size);
        d_->cuMemAddressFree(ptr, size);
      }
      if (fd >= 0) close(fd);
      d_->cuMemRelease(handle);
      return s;
    }
    SegmentMemory memory;
    memory.fd = UniqueFd(fd);
    memory.base = reinterpret_cast<void*>(ptr);
    memory.handle = handle;
    return memory;
  }

  void Destroy(SegmentMemory& memory, uint64_t size) override {
    d_->cuCtxSetCurrent(ctx_);
    const auto ptr = reinterpret_cast<CUdeviceptr>(memory.base);
    if (ptr != 0) {
      d_->cuMemUnmap(ptr, size);
      d_->cuMemAddressFree(ptr, size);
    }
    if (memory.handle != 0) d_->cuMemRelease(memory.handle);
    memory = SegmentMemory();
  }

  std::string Describe() const override { return "CUDA VMM allocations exported as fds"; }

 private:
  const CudaDriver* d_;
  CUcontext ctx_;
  CUdevice dev_;
};

// One stream, and a queue whose thread reports its copies' completion in order.
class CudaStream {
 public:
  CudaStream(const CudaDriver* d, CUcontext ctx) : d_(d), ctx_(ctx) {
    d_->cuCtxSetCurrent(ctx_);
    d_->cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
  }
  ~CudaStream() {
    queue_.Drain();
    d_->cuCtxSetCurrent(ctx_);
    d_->cuStreamDestroy(stream_);
  }

  CUstream stream() const { return stream_; }

  // Call after enqueueing work on the stream: `done` runs once that work has finished.
  void Track(absl::Status issued, Device::Callback done) {
    CUevent event = nullptr;
    if (issued.ok()) {
      issued = d_->Check(d_->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    if (issued.ok()) issued = d_->Check(d_->cuEventRecord(event, stream_), "cuEventRecord");
    queue_.Post([this, event, issued, done = std::move(done)] {
      absl::Status status = issued;
      if (event != nullptr) {
        d_->cuCtxSetCurrent(ctx_);
        absl::Status s = d_->Check(d_->cuEventSynchronize(event), "copy on the GPU");
        if (status.ok()) status = s;
        d_->cuEventDestroy(event);
      }
      done(status);
    });
  }

  void Drain() { queue_.Drain(); }

 private:
  const CudaDriver* d_;
  CUcontext ctx_;
  CUstream stream_ = nullptr;
  WorkQueue queue_;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaDriver* d, CUdevice dev, CUcontext ctx, DeviceDescription description)
      : d_(d),
        dev_(dev),
        ctx_(ctx),
        description_(std::move(description)),
        h2d_(std::make_unique<CudaStream>(d, ctx)),
        d2h_(std::make_unique<CudaStream>(d, ctx)) {}
  // The streams go while the context they belong to is still retained: releasing the primary
  // context last destroys it and every stream in it.
  ~CudaDevice() override {
    Drain();
    h2d_.reset();
    d2h_.reset();
    d_->cuDevicePrimaryCtxRelease(dev_);
  }

  const DeviceDescription& description() const override { return description_; }
  std::unique_ptr<SegmentBacking> MakeBacking() override {
    return std::make_unique<VmmBacking>(d_, ctx_, dev_);
  }
  absl::Status RegisterHost(void* base, size_t size) override {
    d_->cuCtxSetCurrent(ctx_);
    return d_->Check(d_->cuMemHostRegister(base, size, CU_MEMHOSTREGISTER_PORTABLE),
                     "cuMemHostRegister");
  }
  absl::Status UnregisterHost(void* base) override {
    d_->cuCtxSetCurrent(ctx_);
    return d_->Check(d_->cuMemHostUnregister(base), "cuMemHostUnregister");
  }
  void CopyToDevice(void* device_dst, const void* host_src, uint64_t bytes,
                    Callback done) override {
    d_->cuCtxSetCurrent(ctx_);
    absl::Status s = d_->Check(d_->cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(device_dst),
                                                     host_src, bytes, h2d_->stream()),
                               "cuMemcpyHtoDAsync");
    h2d_->Track(s, std::move(done));
  }
  void CopyToHost(void* host_dst, const void* device_src, uint64_t bytes, Callback done) override {
    d_->cuCtxSetCurrent(ctx_);
    absl::Status s =
        d_->Check(d_->cuMemcpyDtoHAsync(host_dst, reinterpret_cast<CUdeviceptr>(device_src), bytes,
                                        d2h_->stream()),
                  "cuMemcpyDtoHAsync");
    d2h_->Track(s, std::move(done));
  }
  void Drain() override {
    h2d_->Drain();
    d2h_->Drain();
  }

 private:
  const CudaDriver* d_;
  CUdevice dev_;
  CUcontext ctx_;
  DeviceDescription description_;
  std::unique_ptr<CudaStream> h2d_;
  std::unique_ptr<CudaStream> d2h_;
};

}  // namespace

std::vector<std::unique_ptr<Device>> OpenCudaDevices(std::string* status) {
  std::vector<std::unique_ptr<Device>> devices;
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) {
    *status = std::string(driver.status().message());
    return devices;
  }
  const CudaDriver* d = *driver;
  int count = 0;
  if (absl::Status s = d->Check(d->cuDeviceGetCount(&count), "cuDeviceGetCount"); !s.ok()) {
    *status = std::string(s.message());
    return devices;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    CUcontext ctx = nullptr;
    CUuuid uuid{};
    char name[256] = {};
    size_t memory = 0;
    int vmm_fd = 0;
    if (!d->Check(d->cuDeviceGet(&dev, i), "cuDeviceGet").ok() ||
        !d->Check(d->cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid").ok() ||
        !d->Check(d->cuDeviceGetName(name, sizeof(name) - 1, dev), "cuDeviceGetName").ok() ||
        !d->Check(d->cuDeviceTotalMem(&memory, dev), "cuDeviceTotalMem").ok()) {
      continue;
    }
    d->cuDeviceGetAttribute(&vmm_fd,
                            CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    if (!vmm_fd) {
      *status = absl::StrCat(CudaDriver::UuidString(uuid), " cannot export memory as fds; skipped");
      continue;
    }
    if (!d->Check(d->cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain").ok()) {
      continue;
    }
    devices.push_back(std::make_unique<CudaDevice>(
        d, dev, ctx, DeviceDescription{CudaDriver::UuidString(uuid), name, memory, false}));
  }
  if (devices.empty() && status->empty()) *status = "no GPU found";
  return devices;
}

#else

std::vector<std::unique_ptr<Device>> OpenCudaDevices(std::string* status) {
  *status = "built without CUDA (TIERD_CUDA=OFF or no toolkit at build time)";
  return {};
}

#endif  // TIERD_HAVE_CUDA

}  // namespace tierd::daemon
