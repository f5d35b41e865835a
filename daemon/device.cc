#include "daemon/device.h"

#include "common/fmt_absl.h"
#include "daemon/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd {

HostRegistration::HostRegistration(SegmentPool* host, Device* device)
    : host_(host), device_(device) {
  // The pool calls the observer with its lock held, so calls never overlap.
  observer_ =
      host->AddRemapObserver([this](uint32_t segment, void* old_base, void* new_base, size_t size) {
        Remap(segment, old_base, new_base, size);
      });
}

HostRegistration::~HostRegistration() { host_->RemoveRemapObserver(observer_); }

void HostRegistration::Remap(uint32_t segment, void* old_base, void* new_base, size_t size) {
  if (segment >= registered_.size()) registered_.resize(segment + 1, nullptr);
  if (old_base != nullptr && registered_[segment] == old_base) {
    registered_[segment] = nullptr;
    if (absl::Status s = device_->UnregisterHost(old_base); !s.ok()) {
      TIERD_LOG_LIMITED(warn, "host segment {}: unregistering its old memory from the GPU: {}",
                        segment, s.message());
    }
  }
  if (new_base == nullptr) return;
  if (absl::Status s = device_->RegisterHost(new_base, size); !s.ok()) {
    TIERD_LOG_LIMITED(warn,
                      "host segment {} not registered with the GPU ({}); copies stage through "
                      "the driver",
                      segment, s.message());
    return;
  }
  registered_[segment] = new_base;
}

}  // namespace tierd
