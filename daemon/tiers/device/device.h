// A GPU as the daemon uses it: memory for the device tier's pool, and copy engines between that
// memory and the host tier. Two backends: `cuda` (a real GPU, through the CUDA driver API loaded at
// run time) and `emulated` (host memory standing in for device memory, copies on threads at a
// configured bandwidth and latency) for machines without a GPU. The emulated backend says so in
// its description, in logs and in GetNodeInfo.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/segment_pool.h"
#include "daemon/util/fallbacks.h"

namespace tierd::daemon {

struct DeviceDescription {
  std::string uuid;  // "GPU-…"; devices are named by UUID, never by ordinal
  std::string name;
  uint64_t memory_bytes = 0;
  bool emulated = false;
};

class Device;

// A copy between host and device memory on one of the device's streams: the hops the chunk service
// routes chunks to and from the GPU over.
class DeviceHop final : public Hop {
 public:
  DeviceHop(Device* device, Path path) : device_(device), path_(path) {}
  void Copy(const HopJob& job, Done done) override;

 private:
  Device* const device_;
  const Path path_;
};

class Device {
 public:
  using Callback = std::function<void(absl::Status)>;
  Device() = default;
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // The device's hop on `path` (host to device, device to host); null on the other paths.
  Hop* hop(Path path) {
    if (path == Path::kHostToDevice) return &to_device_;
    if (path == Path::kDeviceToHost) return &to_host_;
    return nullptr;
  }

  virtual const DeviceDescription& description() const = 0;
  // The memory the device pool's segments are made of (exportable to clients as fds).
  virtual std::unique_ptr<SegmentBacking> MakeBacking() = 0;
  // Makes host memory DMA-capable for this device's copies (cuMemHostRegister), and undoes that;
  // memory must be unregistered before it is unmapped, or the driver keeps its pages pinned and may
  // refuse (or, worse, DMA from the old pages of) a later mapping at the same address.
  virtual absl::Status RegisterHost(void* base, size_t size) = 0;
  virtual absl::Status UnregisterHost(void* base) = 0;
  // Asynchronous copies on the device's host-to-device and device-to-host streams (one each, so
  // both directions run at once). `done` runs on a thread of the device's, never the caller's.
  virtual void CopyToDevice(void* device_dst, const void* host_src, uint64_t bytes,
                            Callback done) = 0;
  virtual void CopyToHost(void* host_dst, const void* device_src, uint64_t bytes,
                          Callback done) = 0;
  // Waits until every copy issued so far has called back.
  virtual void Drain() = 0;

 private:
  DeviceHop to_device_{this, Path::kHostToDevice};
  DeviceHop to_host_{this, Path::kDeviceToHost};
};

// Keeps every segment of the host tier registered with `device` while it lives: registers each
// segment's memory, moves the registration when a segment gets new memory (unregistering the old
// before it is unmapped), and unregisters everything when destroyed. A segment that cannot be
// registered is logged and served anyway (copies then stage through the driver).
class HostRegistration {
 public:
  // Segments the GPU refuses are reported in `fallbacks` (may be null).
  HostRegistration(SegmentPool* host, Device* device, Fallbacks* fallbacks = nullptr);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  void Remap(uint32_t segment, void* old_base, void* new_base, size_t size);

  SegmentPool* const host_;
  Device* const device_;
  Fallbacks* const fallbacks_;
  std::vector<void*> registered_;    // by segment; null where not registered
  std::vector<bool> refused_flags_;  // by segment: its current memory was refused
  size_t refused_ = 0;
  std::string last_refusal_;
  int observer_ = 0;
};

struct EmulatedDeviceOptions {
  uint64_t memory_bytes = 8ull << 30;
  double gbps = 24.0;  // per direction, like a PCIe 4.0 x16 link
  absl::Duration latency = absl::Microseconds(10);
  // The host-to-device copy of this number (from 1) and every later one fail (a failing link, for
  // tests); 0: none fail.
  int64_t upload_failures_from = 0;
};

std::unique_ptr<Device> MakeEmulatedDevice(const EmulatedDeviceOptions& options);

// The CUDA devices of this machine, or an empty list with the reason in `status` (no driver, no
// GPU, built without CUDA).
std::vector<std::unique_ptr<Device>> OpenCudaDevices(std::string* status);

}  // namespace tierd::daemon
