// What the daemon and its clients agree on besides the protos and the session socket's messages
// (common/session_protocol.h): the sockets' names in the socket directory, the gRPC metadata key
// that carries a session's credential, and the size limits of gRPC messages.
#pragma once

namespace tierd {

inline constexpr char kRpcSocketName[] = "tierd.sock";              // gRPC
inline constexpr char kSessionSocketName[] = "tierd.session.sock";  // sessions, SOCK_SEQPACKET
// A session's credential, "<id>:<token>" from the session socket, on every call.
inline constexpr char kSessionMetadataKey[] = "tierd-session";
// What a client may send: a 1M-chunk batch is ~10 MiB.
inline constexpr int kMaxRequestBytes = 32 << 20;
// What the daemon may reply: Stat of a million named chunks is larger.
inline constexpr int kMaxReplyBytes = 256 << 20;

}  // namespace tierd
