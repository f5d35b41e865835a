// A client process for integration tests: each command plays one role that must run in a process
// of its own (a second client, a client that gets killed, another user).
//
//   tierd-test-client SOCKET_DIR write-verify CHUNKS SIZE SEED
//   tierd-test-client SOCKET_DIR hold CHUNKS SIZE            (prints "ready ID..." then sleeps)
//   tierd-test-client SOCKET_DIR probe-foreign CHUNK_ID SEGMENTS   (run as another user)
//   tierd-test-client SOCKET_DIR nvme-random SEED OPS
//
// --as_user=NAME (first argument) drops to that user before connecting; it needs root.
#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"
#include "tierd/client.hpp"

namespace {

int Usage() {
  std::fprintf(stderr, "usage: tierd-test-client [--as_user=NAME] SOCKET_DIR COMMAND ARGS...\n");
  return 2;
}

uint64_t Arg(char** argv, int i) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(argv[i], &v)) {
    std::fprintf(stderr, "bad number '%s'\n", argv[i]);
    std::exit(2);
  }
  return v;
}

uint64_t Word(uint64_t seed, tierd::ChunkId id, size_t i) {
  return seed * 0x9E3779B97F4A7C15ull ^ id << 20 ^ i;
}

std::unique_ptr<tierd::Client> ConnectOrDie(const std::string& dir) {
  auto client = tierd::Client::Connect({.socket_dir = dir, .client_name = "test-client"});
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    std::exit(3);
  }
  return std::move(*client);
}

int WriteVerify(const std::string& dir, uint64_t chunks, uint64_t size, uint64_t seed) {
  auto client = ConnectOrDie(dir);
  std::vector<tierd::ChunkSpec> specs(chunks, tierd::ChunkSpec{.size = size});
  auto set = client->Allocate(specs);
  if (!set.ok()) return std::fprintf(stderr, "%s\n", set.status().ToString().c_str()), 1;
  for (int round = 0; round < 20; ++round) {
    {
      auto w = client->Acquire(set->ids(), tierd::Tier::kHost, tierd::AccessMode::kWrite);
      if (!w.ok() || !w->Wait().ok()) return 1;
      for (const auto& c : w->chunks()) {
        auto* words = static_cast<uint64_t*>(c.data);
        for (size_t i = 0; i < size / 8; ++i) words[i] = Word(seed + round, c.id, i);
      }
    }
    usleep(1000);  // let the other writer run
    auto r = client->Acquire(set->ids(), tierd::Tier::kHost, tierd::AccessMode::kRead);
    if (!r.ok() || !r->Wait().ok()) return 1;
    for (const auto& c : r->chunks()) {
      const auto* words = static_cast<const uint64_t*>(c.data);
      for (size_t i = 0; i < size / 8; ++i) {
        if (words[i] != Word(seed + round, c.id, i)) {
          std::printf("mismatch chunk %llu word %zu\n", static_cast<unsigned long long>(c.id), i);
          return 1;
        }
      }
    }
  }
  std::printf("verified %llu chunks\n", static_cast<unsigned long long>(chunks));
  return 0;
}

// Random allocate / write / evict to NVMe / prefetch / verify / free on this client's own chunks,
// checked against a model of what each chunk must hold.
int NvmeRandom(const std::string& dir, uint64_t seed, uint64_t ops) {
  auto client = ConnectOrDie(dir);
  std::mt19937_64 rng(seed);
  struct Model {
    tierd::ChunkId id;
    uint64_t size;
    uint64_t seed;
    bool on_host;
  };
  std::vector<Model> live;
  auto fill = [&](Model& m) -> bool {
    std::vector<tierd::ChunkId> one = {m.id};
    auto w = client->Acquire(one, tierd::Tier::kHost, tierd::AccessMode::kWrite);
    if (!w.ok()) return false;
    auto* words = static_cast<uint64_t*>((*w)[0].data);
    for (size_t i = 0; i < m.size / 8; ++i) words[i] = Word(m.seed, 0, i);
    return true;
  };
  auto verify = [&](const Model& m) -> bool {
    std::vector<tierd::ChunkId> one = {m.id};
    auto r = client->Acquire(one, tierd::Tier::kHost, tierd::AccessMode::kRead);
    if (!r.ok()) return false;
    const auto* words = static_cast<const uint64_t*>((*r)[0].data);
    for (size_t i = 0; i < m.size / 8; ++i) {
      if (words[i] != Word(m.seed, 0, i)) return false;
    }
    return true;
  };
  for (uint64_t op = 0; op < ops; ++op) {
    const int choice = live.empty() ? 0 : static_cast<int>(rng() % 4);
    if (choice == 0 && live.size() < 8) {
      const uint64_t size = 4096 * (1 + rng() % 512);
      auto ids = client->AllocateIds(std::vector<tierd::ChunkSpec>{{.size = size}});
      if (!ids.ok()) continue;  // host tier full for now
      Model m{(*ids)[0], size, rng(), true};
      if (!fill(m)) return std::printf("fill failed\n"), 1;
      live.push_back(m);
      continue;
    }
    if (live.empty()) continue;
    Model& m = live[rng() % live.size()];
    std::vector<tierd::ChunkId> one = {m.id};
    if (choice == 1 && m.on_host) {
      auto t = client->EvictIds(one, tierd::Tier::kNvme);
      if (!t.ok() || !client->Wait(*t).ok()) return std::printf("evict failed\n"), 1;
      m.on_host = false;
    } else if (choice == 2) {
      auto t = client->PrefetchIds(one, tierd::Tier::kHost);
      if (!t.ok()) return std::printf("prefetch: %s\n", t.status().ToString().c_str()), 1;
      absl::Status s = client->Wait(*t);
      if (absl::IsResourceExhausted(s)) continue;  // others hold the host tier
      if (!s.ok()) return std::printf("prefetch wait: %s\n", s.ToString().c_str()), 1;
      m.on_host = true;
      if (!verify(m)) return std::printf("MISMATCH in chunk %llu\n", (unsigned long long)m.id), 1;
      if (rng() % 2 == 0) {  // overwrite
        m.seed = rng();
        if (!fill(m)) return 1;
      }
    } else if (choice == 3) {
      if (!client->Free(one).ok()) return std::printf("free failed\n"), 1;
      m = live.back();
      live.pop_back();
    }
  }
  std::printf("ok %zu live\n", live.size());
  return 0;
}

// Like Hold, with the chunks brought to the device tier and acquired there.
int HoldDevice(const std::string& dir, uint64_t chunks, uint64_t size) {
  auto client = ConnectOrDie(dir);
  std::vector<tierd::ChunkSpec> specs(chunks, tierd::ChunkSpec{.size = size});
  auto ids = client->AllocateIds(specs);
  if (!ids.ok()) return 1;
  auto t = client->PrefetchIds(*ids, tierd::Tier::kDevice);
  if (!t.ok() || !client->Wait(*t).ok()) return 1;
  auto acquired = client->AcquireIds(*ids, tierd::Tier::kDevice, tierd::AccessMode::kWrite);
  if (!acquired.ok()) return 1;
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}

int Hold(const std::string& dir, uint64_t chunks, uint64_t size) {
  auto client = ConnectOrDie(dir);
  std::vector<tierd::ChunkSpec> specs(chunks, tierd::ChunkSpec{.size = size});
  auto ids = client->AllocateIds(specs);
  if (!ids.ok()) return 1;
  auto acquired = client->AcquireIds(*ids, tierd::Tier::kHost, tierd::AccessMode::kWrite);
  if (!acquired.ok()) return 1;
  std::string line = "ready";
  for (tierd::ChunkId id : *ids) absl::StrAppend(&line, " ", id);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  for (;;) pause();
}

std::string CodeName(const absl::Status& s) { return absl::StatusCodeToString(s.code()); }

// As another user: may open a session, but gets no segment fds and cannot touch the chunk.
int ProbeForeign(const std::string& dir, tierd::ChunkId id, uint32_t segments) {
  // The raw session protocol, to see exactly which fds the daemon hands out.
  auto sock = tierd::ConnectSeqpacket(dir + "/tierd.session.sock");
  if (!sock.ok()) return std::printf("connect %s\n", sock.status().ToString().c_str()), 1;
  tierd::HelloRequest hello{};
  hello.header = tierd::MakeHeader(tierd::SessionMessageType::kHello);
  tierd::HelloReply reply{};
  std::vector<tierd::UniqueFd> fds;
  if (!tierd::SendWithFds(sock->get(), &hello, sizeof(hello), {}).ok() ||
      !tierd::ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds).ok()) {
    return 1;
  }
  std::printf("hello_status %d fds %zu segments %u\n", reply.status_code, fds.size(),
              reply.segment_count);
  for (uint32_t seg = 0; seg < segments; ++seg) {
    tierd::MapSegmentRequest req{};
    req.header = tierd::MakeHeader(tierd::SessionMessageType::kMapSegment);
    req.segment = seg;
    req.tier = 1;  // host
    tierd::MapSegmentReply map{};
    std::vector<tierd::UniqueFd> seg_fds;
    if (!tierd::SendWithFds(sock->get(), &req, sizeof(req), {}).ok() ||
        !tierd::ReceiveWithFds(sock->get(), &map, sizeof(map), &seg_fds).ok()) {
      return 1;
    }
    std::printf("map_segment %u %s fds %zu\n", seg,
                absl::StatusCodeToString(static_cast<absl::StatusCode>(map.status_code)).c_str(),
                seg_fds.size());
  }
  auto client = ConnectOrDie(dir);
  std::vector<tierd::ChunkId> ids = {id};
  auto acquire = client->AcquireIds(ids, tierd::Tier::kHost, tierd::AccessMode::kRead).status();
  std::printf("acquire %s\n", CodeName(acquire).c_str());
  std::printf("stat %s\n", CodeName(client->Stat(ids).status()).c_str());
  std::printf("free %s\n", CodeName(client->Free(ids)).c_str());
  auto listed = client->ListChunks();
  std::printf("listed %zu\n", listed.ok() ? listed->size() : 999);
  return 0;
}

bool DropTo(const char* user) {
  passwd* pw = getpwnam(user);
  if (pw == nullptr) return false;
  gid_t groups[] = {pw->pw_gid};
  return setgroups(1, groups) == 0 && setgid(pw->pw_gid) == 0 && setuid(pw->pw_uid) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  int first = 1;
  if (argc > 1 && std::strncmp(argv[1], "--as_user=", 10) == 0) {
    if (!DropTo(argv[1] + 10)) {
      std::fprintf(stderr, "cannot become %s: %s\n", argv[1] + 10, std::strerror(errno));
      return 4;
    }
    first = 2;
  }
  if (argc < first + 2) return Usage();
  const std::string dir = argv[first];
  const std::string command = argv[first + 1];
  char** a = argv + first + 2;
  const int n = argc - first - 2;
  if (command == "write-verify" && n == 3) return WriteVerify(dir, Arg(a, 0), Arg(a, 1), Arg(a, 2));
  if (command == "hold" && n == 2) return Hold(dir, Arg(a, 0), Arg(a, 1));
  if (command == "hold-device" && n == 2) return HoldDevice(dir, Arg(a, 0), Arg(a, 1));
  if (command == "nvme-random" && n == 2) return NvmeRandom(dir, Arg(a, 0), Arg(a, 1));
  if (command == "probe-foreign" && n == 2) {
    return ProbeForeign(dir, Arg(a, 0), static_cast<uint32_t>(Arg(a, 1)));
  }
  return Usage();
}
