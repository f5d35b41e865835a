#include "client/c_api_common.h"

namespace tierd::c_abi {
namespace {

thread_local std::string last_error;

}  // namespace

tierd_status Fail(const absl::Status& s) {
  last_error = std::string(s.message());
  return static_cast<tierd_status>(static_cast<int>(s.code()));
}

}  // namespace tierd::c_abi

extern "C" const char* tierd_last_error(void) { return tierd::c_abi::last_error.c_str(); }
