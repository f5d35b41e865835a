// The emulated device: memfd segments stand in for device memory (clients map them as they would
// import GPU memory), and each direction's copies run in order on a thread of its own, paced to the
// configured bandwidth and latency so that pipelining and overlap behave as on a real link.
#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "daemon/io/work_queue.h"
#include "daemon/tiers/device/device.h"
#include "daemon/tiers/host/host_memory.h"

namespace tierd::daemon {
namespace {

// One direction of the link: copies run in submission order on the queue's thread, each taking
// latency + bytes / rate. From copy `failures_from` on (counting from 1; 0: never), each fails
// without copying.
class EmulatedStream {
 public:
  EmulatedStream(double gbps, absl::Duration latency, int64_t failures_from = 0)
      : bytes_per_ns_(gbps), latency_(latency), failures_from_(failures_from) {}

  void Copy(void* dst, const void* src, uint64_t bytes, Device::Callback done) {
    queue_.Post([this, dst, src, bytes, done = std::move(done)] {
      if (failures_from_ > 0 && ++copies_ >= failures_from_) {
        done(absl::UnavailableError(
            "the emulated device's link failed (device.emulated_upload_failures_from)"));
        return;
      }
      const absl::Time start = std::max(absl::Now(), link_free_);
      const absl::Time end =
          start + latency_ + absl::Nanoseconds(static_cast<int64_t>(bytes / bytes_per_ns_));
      std::memcpy(dst, src, bytes);
      absl::SleepFor(end - absl::Now());
      link_free_ = end;
      done(absl::OkStatus());
    });
  }
  void Drain() { queue_.Drain(); }

 private:
  const double bytes_per_ns_;  // GB/s == bytes/ns
  const absl::Duration latency_;
  const int64_t failures_from_;
  int64_t copies_ = 0;                           // queue thread only
  absl::Time link_free_ = absl::InfinitePast();  // queue thread only
  WorkQueue queue_;  // last: its thread stops before the members it uses go
};

class EmulatedDevice final : public Device {
 public:
  explicit EmulatedDevice(const EmulatedDeviceOptions& options)
      : options_(options),
        to_device_(options.gbps, options.latency, options.upload_failures_from),
        to_host_(options.gbps, options.latency) {
    description_.uuid = "GPU-emulated-0";
    description_.name = absl::StrFormat("emulated device (%.1f GB/s per direction, %s latency)",
                                        options.gbps, absl::FormatDuration(options.latency));
    description_.memory_bytes = options.memory_bytes;
    description_.emulated = true;
  }

  const DeviceDescription& description() const override { return description_; }

  std::unique_ptr<SegmentBacking> MakeBacking() override {
    return std::make_unique<MemfdBacking>("tierd-emulated-device", HugePagePolicy::kNever,
                                          /*lock_memory=*/false);
  }

  // Registrations are kept as the CUDA driver keeps them, so that misuse fails here as it would on
  // a GPU: a range overlapping a registered one is refused, and so is unregistering an address
  // that is not the start of a registration.
  absl::Status RegisterHost(void* base, size_t size) override {
    const auto start = reinterpret_cast<uintptr_t>(base);
    absl::MutexLock lock(&mu_);
    for (const auto& [b, n] : registered_) {
      if (start < b + n && b < start + size) {
        return absl::AlreadyExistsError(
            absl::StrFormat("host memory %p (+%u bytes) overlaps registered memory %#x "
                            "(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)",
                            base, size, b));
      }
    }
    registered_.emplace(start, size);
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* base) override {
    absl::MutexLock lock(&mu_);
    if (registered_.erase(reinterpret_cast<uintptr_t>(base)) == 0) {
      return absl::NotFoundError(absl::StrFormat(
          "host memory %p is not registered (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)", base));
    }
    return absl::OkStatus();
  }

  void CopyToDevice(void* device_dst, const void* host_src, uint64_t bytes,
                    Callback done) override {
    to_device_.Copy(device_dst, host_src, bytes, std::move(done));
  }
  void CopyToHost(void* host_dst, const void* device_src, uint64_t bytes, Callback done) override {
    to_host_.Copy(host_dst, device_src, bytes, std::move(done));
  }
  void Drain() override {
    to_device_.Drain();
    to_host_.Drain();
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<uintptr_t, size_t> registered_ ABSL_GUARDED_BY(mu_);  // base -> size
  EmulatedDeviceOptions options_;
  DeviceDescription description_;
  EmulatedStream to_device_;
  EmulatedStream to_host_;
};

}  // namespace

std::unique_ptr<Device> MakeEmulatedDevice(const EmulatedDeviceOptions& options) {
  return std::make_unique<EmulatedDevice>(options);
}

}  // namespace tierd::daemon
