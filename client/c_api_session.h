// A C ABI session handle, as the parts over tierd::Client share it (c_api.cc, c_api_node.cc),
// and the conversions between the ABI's ids and tokens and the C++ API's.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "tierd/client.h"
#include "tierd/client.hpp"

namespace tierd::c_abi {
struct ViewTable;  // c_api.cc: the chunks a handle holds and the DLPack views of them
}  // namespace tierd::c_abi

// The session is shared with the DLPack views of its chunks: a view keeps it (and the mappings
// its pointer is in) open after tierd_close until the view's deleter runs.
struct tierd_client {
  std::shared_ptr<tierd::Client> client;
  std::shared_ptr<tierd::c_abi::ViewTable> views;  // made by tierd_connect
};

namespace tierd::c_abi {

inline std::span<const tierd::ChunkId> Ids(size_t n, const tierd_chunk_id* ids) { return {ids, n}; }

inline tierd::CompletionToken Token(tierd_completion c) { return {c.slot, c.sequence}; }
inline tierd_completion Token(tierd::CompletionToken t) { return {t.slot, t.sequence}; }

}  // namespace tierd::c_abi
