// GetNodeInfo's answer: the build, the tiers (NVMe's regions), the data paths, the devices, the
// fallbacks taken, the sessions (listed for an operator who asks), and the users with their
// limits and quotas. With rpc_server.cc, the only code that sees the generated API.
#pragma once

#include "absl/time/time.h"
#include "common/wire.h"
#include "daemon/api/rpc_server.h"
#include "tierd/v1/tierd.pb.h"

namespace tierd::daemon {

inline v1::Tier ToProto(TierKind tier) { return static_cast<v1::Tier>(WireValue(tier)); }

// Fills `out` for `session`; `started`: when the daemon began serving (its uptime).
void ReportNode(const RpcServerDeps& deps, const Session& session, bool list_sessions,
                absl::Time started, v1::GetNodeInfoResponse* out);

}  // namespace tierd::daemon
