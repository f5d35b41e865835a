#include "common/cuda_driver.h"

#ifdef TIERD_HAVE_CUDA
#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tierd {
namespace {

#define TIERD_STR(x) #x
// Expands the header's versioning macros first (cuMemcpyHtoDAsync -> cuMemcpyHtoDAsync_v2).
#define TIERD_XSTR(x) TIERD_STR(x)

absl::StatusOr<CudaDriver*> Load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::UnavailableError(absl::StrCat("no CUDA driver (", dlerror(), ")"));
  }
  auto* d = new CudaDriver();
#define TIERD_CUDA_LOAD(name)                                                                   \
  d->name = reinterpret_cast<decltype(d->name)>(dlsym(lib, TIERD_XSTR(name)));                  \
  if (d->name == nullptr) {                                                                     \
    return absl::UnavailableError(                                                              \
        absl::StrCat("the CUDA driver lacks ", TIERD_XSTR(name), "; it is too old for tierd")); \
  }
  TIERD_CUDA_FUNCTIONS(TIERD_CUDA_LOAD)
#undef TIERD_CUDA_LOAD
  if (absl::Status s = d->Check(d->cuInit(0), "cuInit"); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("no usable GPU: ", s.message()));
  }
  return d;
}

}  // namespace

absl::StatusOr<const CudaDriver*> CudaDriver::Get() {
  static const absl::StatusOr<CudaDriver*> driver = Load();
  if (!driver.ok()) return driver.status();
  return *driver;
}

absl::Status CudaDriver::Check(CUresult result, const char* what) const {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  if (cuGetErrorString != nullptr) cuGetErrorString(result, &text);
  const auto code = result == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted
                                                       : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, " failed: CUDA error ", static_cast<int>(result),
                                         " (", text != nullptr ? text : "unknown", ")"));
}

std::string CudaDriver::UuidString(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

}  // namespace tierd

#endif  // TIERD_HAVE_CUDA
