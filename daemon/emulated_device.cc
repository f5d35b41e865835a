// The emulated device: memfd segments stand in for device memory (clients map them as they would
// import GPU memory), and each direction's copies run in order on a thread of its own, paced to the
// configured bandwidth and latency so that pipelining and overlap behave as on a real link.
#include <cstring>
#include <deque>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "daemon/device.h"
#include "daemon/host_memory.h"

namespace tierd {
namespace {

// One direction of the link: copies run in submission order, each taking latency + bytes/rate.
class EmulatedStream {
 public:
  EmulatedStream(double gbps, absl::Duration latency)
      : bytes_per_ns_(gbps), latency_(latency), thread_([this] { Loop(); }) {}
  ~EmulatedStream() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  void Copy(void* dst, const void* src, uint64_t bytes, Device::Callback done) {
    absl::MutexLock lock(&mu_);
    queue_.push_back({dst, src, bytes, std::move(done)});
    ++submitted_;
  }

  void Drain() {
    absl::MutexLock lock(&mu_);
    std::pair<EmulatedStream*, uint64_t> arg(this, submitted_);
    mu_.Await(absl::Condition(
        +[](std::pair<EmulatedStream*, uint64_t>* a)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->first->finished_ >= a->second; },
        &arg));
  }

 private:
  struct Op {
    void* dst;
    const void* src;
    uint64_t bytes;
    Device::Callback done;
  };

  void Loop() {
    absl::Time link_free = absl::Now();  // when the link finishes what it has
    for (;;) {
      Op op;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](EmulatedStream* s)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return !s->queue_.empty() || s->stopping_; },
            this));
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      const absl::Time start = std::max(absl::Now(), link_free);
      const absl::Time end =
          start + latency_ + absl::Nanoseconds(static_cast<int64_t>(op.bytes / bytes_per_ns_));
      std::memcpy(op.dst, op.src, op.bytes);
      absl::SleepFor(end - absl::Now());
      link_free = end;
      op.done(absl::OkStatus());
      absl::MutexLock lock(&mu_);
      ++finished_;
    }
  }

  const double bytes_per_ns_;  // GB/s == bytes/ns
  const absl::Duration latency_;
  absl::Mutex mu_;
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class EmulatedDevice final : public Device {
 public:
  explicit EmulatedDevice(const EmulatedDeviceOptions& options)
      : options_(options),
        to_device_(options.gbps, options.latency),
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

  absl::Status RegisterHost(void*, size_t) override { return absl::OkStatus(); }

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
  EmulatedDeviceOptions options_;
  DeviceDescription description_;
  EmulatedStream to_device_;
  EmulatedStream to_host_;
};

}  // namespace

std::unique_ptr<Device> MakeEmulatedDevice(const EmulatedDeviceOptions& options) {
  return std::make_unique<EmulatedDevice>(options);
}

}  // namespace tierd
