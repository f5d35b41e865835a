#include "daemon/tiers/device/device.h"

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

void DeviceHop::Copy(const HopJob& job, Done done) {
  auto called_back = [done = std::move(done)](absl::Status s) { done(std::move(s), 0); };
  if (path_ == Path::kHostToDevice) {
    device_->CopyToDevice(job.to_address, job.from_address, job.size, std::move(called_back));
  } else {
    device_->CopyToHost(job.to_address, job.from_address, job.size, std::move(called_back));
  }
}

HostRegistration::HostRegistration(SegmentPool* host, Device* device, Fallbacks* fallbacks)
    : host_(host), device_(device), fallbacks_(fallbacks) {
  // The pool calls the observer with its lock held, so calls never overlap.
  observer_ =
      host->AddRemapObserver([this](uint32_t segment, void* old_base, void* new_base, size_t size) {
        Remap(segment, old_base, new_base, size);
      });
}

HostRegistration::~HostRegistration() { host_->RemoveRemapObserver(observer_); }

void HostRegistration::Remap(uint32_t segment, void* old_base, void* new_base, size_t size) {
  if (segment >= registered_.size()) {
    registered_.resize(segment + 1, nullptr);
    refused_flags_.resize(segment + 1, false);
  }
  if (refused_flags_[segment]) {
    refused_flags_[segment] = false;
    --refused_;
  }
  if (old_base != nullptr && registered_[segment] == old_base) {
    registered_[segment] = nullptr;
    if (absl::Status s = device_->UnregisterHost(old_base); !s.ok()) {
      TIERD_LOG_LIMITED(warn, "host segment {}: unregistering its old memory from the GPU: {}",
                        segment, s.message());
    }
  }
  if (new_base != nullptr) {
    if (absl::Status s = device_->RegisterHost(new_base, size); s.ok()) {
      registered_[segment] = new_base;
    } else {
      TIERD_LOG_LIMITED(warn,
                        "host segment {} not registered with the GPU ({}); copies stage through "
                        "the driver",
                        segment, s.message());
      refused_flags_[segment] = true;
      ++refused_;
      last_refusal_ = std::string(s.message());
    }
  }
  if (fallbacks_ == nullptr || new_base == nullptr) return;
  if (refused_ == 0) {
    fallbacks_->Clear("host_segments_unregistered");
  } else {
    fallbacks_->Set("host_segments_unregistered",
                    absl::StrCat(refused_, " host segment(s) not registered with the GPU (",
                                 last_refusal_, "): their copies stage through the driver"));
  }
}

}  // namespace tierd::daemon
