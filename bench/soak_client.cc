// tierd-bench soak-client: the soak's clients, one role a process (bench/soak.h): movers that
// check every byte they read back, a keeper of persistent chunks that must survive daemon
// crashes, and a hostile tenant. The run that starts, kills and counts them is bench/soak.cc.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "bench/bench_util.h"
#include "bench/soak.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"

namespace tierd::bench {
namespace {

// ---- the bytes every chunk holds -----------------------------------------------------------
// Each 4 KiB block: a header {magic, tag, version, block} and words derived from all four, so a
// block of another chunk, version or place never passes.
constexpr uint64_t kMagic = 0x4b414f53'44524954ull;  // "TIRDSOAK"

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void FillBlock(uint64_t* w, uint64_t tag, uint64_t version, uint64_t block) {
  w[0] = kMagic;
  w[1] = tag;
  w[2] = version;
  w[3] = block;
  const uint64_t seed = Mix(tag ^ Mix(version ^ Mix(block)));
  for (size_t i = 4; i < 512; ++i) w[i] = seed + i * 0x9E3779B97F4A7C15ull;
}

void Fill(void* data, uint64_t size, uint64_t tag, uint64_t version) {
  auto* w = static_cast<uint64_t*>(data);
  for (uint64_t b = 0; b < size / 4096; ++b) FillBlock(w + b * 512, tag, version, b);
}

// The version a block holds, or 0 when it is not a whole, well-formed block of this chunk.
uint64_t BlockVersion(const uint64_t* w, uint64_t tag, uint64_t block) {
  if (w[0] != kMagic || w[1] != tag || w[3] != block) return 0;
  uint64_t expect[512];
  FillBlock(expect, tag, w[2], block);
  return std::memcmp(expect, w, sizeof(expect)) == 0 ? w[2] : 0;
}

// Bytes of the chunk whose block holds no version in `allowed`.
uint64_t WrongBytes(const void* data, uint64_t size, uint64_t tag,
                    std::initializer_list<uint64_t> allowed) {
  const auto* w = static_cast<const uint64_t*>(data);
  uint64_t wrong = 0;
  for (uint64_t b = 0; b < size / 4096; ++b) {
    const uint64_t v = BlockVersion(w + b * 512, tag, b);
    if (v == 0 || std::find(allowed.begin(), allowed.end(), v) == allowed.end()) wrong += 4096;
  }
  return wrong;
}

// ---- a client role ---------------------------------------------------------------------------

struct RoleOptions {
  std::string role;
  std::string socket_dir;
  std::string state;  // keeper: its file of acknowledged versions
  uint64_t seed = 1;
  bool final_pass = false;  // keeper: verify, then free everything
  uint64_t quota_host = 0;  // hostile: what its host quota is
  uint32_t connections = 0;
  uint64_t schedule_accesses = 0;
  bool other_user = false;  // hostile: runs as a user of its own
};

void Report(const char* key, uint64_t value) {
  std::printf("%s %" PRIu64 "\n", key, value);
  std::fflush(stdout);
}

// A failed call: a daemon that went away ends the role (the bench restarts it); anything but the
// refusals a busy shared daemon gives is counted.
void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  if (absl::IsUnavailable(s) || absl::IsCancelled(s) || absl::IsDeadlineExceeded(s)) {
    std::exit(kDaemonGone);
  }
  if (absl::IsFailedPrecondition(s) || absl::IsResourceExhausted(s)) {
    Report("refused", 1);
    return;
  }
  std::fprintf(stderr, "soak-client: %s: %s\n", what, s.ToString().c_str());
  Report("errors", 1);
}

std::unique_ptr<Client> ConnectOrLeave(const RoleOptions& o) {
  for (absl::Time give_up = absl::Now() + absl::Seconds(20);;) {
    auto c = Client::Connect({.socket_dir = o.socket_dir,
                              .client_name = "soak-" + o.role,
                              .rpc_timeout = absl::Seconds(20)});
    if (c.ok()) {
      Report("session", (*c)->session_id());
      return std::move(*c);
    }
    if (absl::Now() > give_up) std::exit(kDaemonGone);
    absl::SleepFor(absl::Milliseconds(200));
  }
}

// Scratch chunks moved between every pair of tiers, at random, each read back and checked.
int Mover(const RoleOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::unique_ptr<Client> c = ConnectOrLeave(o);
  struct Chunk {
    ChunkId id;
    uint64_t size, tag, version;
  };
  std::vector<Chunk> chunks;
  uint64_t next_tag = o.seed << 20;
  auto allocate = [&]() -> bool {
    const uint64_t size = (1 + rng() % 1024) * 4096;  // 4 KiB .. 4 MiB
    ChunkSpec spec{.size = size};
    auto ids = c->AllocateIds({&spec, 1});
    Check(ids.status(), "Allocate");
    if (!ids.ok()) return false;
    Chunk chunk{(*ids)[0], size, ++next_tag, 1};
    auto a = c->AcquireIds({&chunk.id, 1}, Tier::kHost, AccessMode::kWrite);
    Check(a.status(), "Acquire (write)");
    if (!a.ok()) return false;
    Check(c->Wait(a->ready), "Acquire (write)");
    Fill(a->chunks[0].data, size, chunk.tag, 1);
    Check(c->Release({&chunk.id, 1}), "Release");
    chunks.push_back(chunk);
    return true;
  };
  for (int i = 0; i < 16; ++i) allocate();
  uint64_t step = 0;
  for (;;) {
    if (chunks.empty()) {
      allocate();
      continue;
    }
    std::vector<ChunkId> batch;
    std::vector<Chunk*> picked;
    const size_t n = 1 + rng() % std::min<size_t>(4, chunks.size());
    for (size_t i = 0; i < n; ++i) {
      Chunk* ch = &chunks[rng() % chunks.size()];
      if (std::find(batch.begin(), batch.end(), ch->id) != batch.end()) continue;
      batch.push_back(ch->id);
      picked.push_back(ch);
    }
    const bool wait = rng() % 4 != 0;  // else the moves are left in flight
    auto settle = [&](absl::StatusOr<CompletionToken> t, const char* what) {
      Check(t.status(), what);
      if (!t.ok()) return;
      if (wait) {
        Check(c->Wait(*t), what);
      } else {
        c->Abandon(*t);
      }
    };
    switch (rng() % 9) {
      case 0:
        settle(c->EvictIds(batch, Tier::kNvme), "Evict to NVMe");
        break;
      case 1:
        settle(c->PrefetchIds(batch, Tier::kHost), "Prefetch to host");
        break;
      case 2:
        settle(c->PrefetchIds(batch, Tier::kDevice), "Prefetch to device");
        break;
      case 3: {  // up to the device and back down: the device copy is written back
        auto up = c->PrefetchIds(batch, Tier::kDevice);
        Check(up.status(), "Prefetch to device");
        if (!up.ok()) break;
        absl::Status there = c->Wait(*up);
        Check(there, "Prefetch to device");
        if (there.ok()) settle(c->EvictIds(batch, Tier::kHost), "Evict to host");
        break;
      }
      case 4:
      case 5: {  // read back, on the host or (emulated) device, and check every byte
        const Tier tier = rng() % 3 == 0 ? Tier::kDevice : Tier::kHost;
        auto a = c->AcquireIds(batch, tier, AccessMode::kRead);
        Check(a.status(), "Acquire (read)");
        if (!a.ok()) break;
        absl::Status ready = c->Wait(a->ready);
        Check(ready, "Acquire (read)");
        if (ready.ok()) {
          for (size_t i = 0; i < picked.size(); ++i) {
            const AcquiredChunk& got = a->chunks[i];
            if (!got.host_accessible) continue;
            const uint64_t wrong =
                WrongBytes(got.data, picked[i]->size, picked[i]->tag, {picked[i]->version});
            if (wrong != 0) {
              std::fprintf(stderr,
                           "soak-client: chunk %" PRIu64 " (%s): %" PRIu64
                           " wrong bytes of %" PRIu64 "\n",
                           got.id, tier == Tier::kHost ? "host" : "device", wrong, picked[i]->size);
            }
            Report("wrong_bytes", wrong);
            Report("verified_bytes", picked[i]->size);
          }
        }
        Check(c->Release(batch), "Release");
        break;
      }
      case 6: {  // a new version of the first
        Chunk* ch = picked[0];
        auto a = c->AcquireIds({&ch->id, 1}, Tier::kHost, AccessMode::kWrite);
        Check(a.status(), "Acquire (write)");
        if (!a.ok()) break;
        absl::Status ready = c->Wait(a->ready);
        Check(ready, "Acquire (write)");
        if (ready.ok()) Fill(a->chunks[0].data, ch->size, ch->tag, ++ch->version);
        Check(c->Release({&ch->id, 1}), "Release");
        break;
      }
      case 7: {  // free one (refused while it moves) and take another
        absl::Status freed = c->Free({&picked[0]->id, 1});
        Check(freed, "Free");
        if (freed.ok()) {
          chunks.erase(chunks.begin() + (picked[0] - chunks.data()));
          allocate();
        }
        break;
      }
      case 8: {  // a schedule over the chunks, stepped through: the planner moves them too
        if (step % 64 == 0) {
          std::vector<ScheduleStep> steps;
          for (const Chunk& ch : chunks) steps.push_back({{ch.id, Tier::kHost, AccessMode::kRead}});
          Check(c->SetSchedule(steps), "SetSchedule");
        }
        c->BeginStep(++step);
        break;
      }
    }
    Report("ops", 1);
  }
}

// The keeper's record of what the daemon acknowledged: per chunk, the last version whose Evict to
// NVMe completed, and the version being written (either may be what a restart finds).
struct Kept {
  uint64_t acked = 0;
  uint64_t writing = 0;
  // The keeper is filling the chunk's memory: if it dies now, it leaves the chunk torn itself (a
  // client's own half-done write), which the next keeper rewrites rather than checks.
  uint64_t filling = 0;
};

constexpr int kKeptChunks = 12;

uint64_t KeptSize(int i) { return (64ull << 10) << (i % 6); }  // 64 KiB .. 2 MiB

std::vector<Kept> LoadKept(const std::string& path) {
  std::vector<Kept> kept(kKeptChunks);
  std::ifstream in(path);
  for (Kept& k : kept) in >> k.acked >> k.writing >> k.filling;
  return kept;
}

void SaveKept(const std::string& path, const std::vector<Kept>& kept) {
  std::string text;
  for (const Kept& k : kept) absl::StrAppend(&text, k.acked, " ", k.writing, " ", k.filling, "\n");
  const std::string tmp = path + ".tmp";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd || write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()) ||
      fsync(fd.get()) != 0 || rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "soak-client: cannot save %s: %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
}

// Persistent chunks rewritten and made durable over and over; whatever was acknowledged must be
// there after any crash of the keeper or the daemon.
int Keeper(const RoleOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::unique_ptr<Client> c = ConnectOrLeave(o);
  std::vector<Kept> kept = LoadKept(o.state);
  std::vector<ChunkId> ids(kKeptChunks);
  // A new version of chunk i, made durable; acknowledged once its Evict to NVMe has completed.
  auto rewrite = [&](int i) {
    Kept& k = kept[i];
    k.writing = std::max(k.acked, k.writing) + 1;
    SaveKept(o.state, kept);
    auto a = c->AcquireIds({&ids[i], 1}, Tier::kHost, AccessMode::kWrite);
    Check(a.status(), "Acquire (write)");
    if (!a.ok()) return;
    absl::Status ready = c->Wait(a->ready);
    Check(ready, "Acquire (write)");
    if (ready.ok()) {
      k.filling = 1;
      SaveKept(o.state, kept);
      Fill(a->chunks[0].data, KeptSize(i), 1000 + i, k.writing);
      k.filling = 0;
      SaveKept(o.state, kept);
    }
    Check(c->Release({&ids[i], 1}), "Release");
    if (!ready.ok()) return;
    auto t = c->EvictIds({&ids[i], 1}, Tier::kNvme);
    Check(t.status(), "Evict (persist)");
    if (!t.ok()) return;
    absl::Status durable = c->Wait(*t);
    Check(durable, "Evict (persist)");
    if (durable.ok()) {
      k.acked = k.writing;
      SaveKept(o.state, kept);
      Report("persisted", 1);
    }
    Report("ops", 1);
  };
  int found = 0;
  std::vector<int> torn;
  // Open every chunk and check it: each block holds the acknowledged version or the one being
  // written when the last keeper or daemon died.
  for (int i = 0; i < kKeptChunks; ++i) {
    // At home on NVMe, where each acknowledged version is durable: a persistent chunk at home in
    // memory is lost, by design, when the daemon is killed while its newest version is there.
    ChunkSpec spec{.size = KeptSize(i),
                   .home = Tier::kNvme,
                   .name = absl::StrCat("soak-kept-", i),
                   .persistent = true,
                   .open_existing = true};
    auto opened = c->AllocateIds({&spec, 1});
    Check(opened.status(), "open persistent");
    if (!opened.ok()) return 1;
    ids[i] = (*opened)[0];
    if (kept[i].filling != 0) {
      Report("persistent_torn_by_keeper", 1);
      torn.push_back(i);
      continue;
    }
    if (kept[i].acked == 0) continue;
    auto a = c->AcquireIds({&ids[i], 1}, Tier::kHost, AccessMode::kRead);
    Check(a.status(), "Acquire (check)");
    if (!a.ok()) return 1;
    absl::Status ready = c->Wait(a->ready);
    uint64_t wrong = KeptSize(i);
    if (ready.ok()) {
      wrong =
          WrongBytes(a->chunks[0].data, KeptSize(i), 1000 + i, {kept[i].acked, kept[i].writing});
    } else if (!absl::IsDataLoss(ready)) {
      Check(ready, "Acquire (check)");
      return 1;
    }
    Check(c->Release({&ids[i], 1}), "Release");
    Report("persistent_checks", 1);
    if (wrong != 0) {
      std::fprintf(stderr,
                   "soak-client: persistent chunk %d: %" PRIu64 " of %" PRIu64
                   " bytes hold neither version %" PRIu64 " (acknowledged) nor %" PRIu64 " (%s)\n",
                   i, wrong, KeptSize(i), kept[i].acked, kept[i].writing,
                   ready.ok() ? "read" : std::string(ready.message()).c_str());
      Report("lost_bytes", wrong);
      ++found;
    }
  }
  if (o.final_pass) {
    Check(c->Free(ids), "Free");
    for (Kept& k : kept) k = {};
    SaveKept(o.state, kept);
    return found == 0 ? 0 : kClientFound;
  }
  if (found != 0) return kClientFound;
  for (int i : torn) rewrite(i);
  for (;;) rewrite(static_cast<int>(rng() % kKeptChunks));
}

// Raw bytes on the session socket: the daemon must close the connection, nothing else.
bool JunkIsRefused(const std::string& dir, std::mt19937_64& rng) {
  auto sock = ConnectSeqpacket(dir + "/tierd.session.sock");
  if (!sock.ok()) return true;  // refused outright (a limit): fine
  std::vector<uint8_t> junk(1 + rng() % 4096);
  for (uint8_t& b : junk) b = static_cast<uint8_t>(rng());
  if (rng() % 2 == 0 && junk.size() >= 4) std::memcpy(junk.data(), "TIRD", 4);
  if (send(sock->get(), junk.data(), junk.size(), MSG_NOSIGNAL) < 0) return true;
  pollfd p{sock->get(), POLLIN, 0};
  for (absl::Time give_up = absl::Now() + absl::Seconds(5); absl::Now() < give_up;) {
    if (poll(&p, 1, 100) > 0) {
      char buf[8192];
      const ssize_t n = recv(sock->get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0) return true;  // closed
      // An error reply is fine too; then the connection must close.
    }
  }
  return false;
}

// Another user who tries what a hostile or careless tenant would. Whatever it gets that it should
// not have is an escape.
int Hostile(const RoleOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::unique_ptr<Client> c = ConnectOrLeave(o);
  auto escape = [](const std::string& what) {
    std::fprintf(stderr, "soak-client: escape: %s\n", what.c_str());
    Report("escapes", 1);
  };
  for (;;) {
    Report("attacks", 1);
    switch (rng() % 7) {
      case 0: {  // the schedule cursor: garbage in its own completion page
        ChunkSpec spec{.size = 1 << 20};
        auto ids = c->AllocateIds({&spec, 1});
        Check(ids.status(), "Allocate");
        if (!ids.ok()) break;
        std::vector<ScheduleStep> steps = {{{(*ids)[0], Tier::kHost, AccessMode::kRead}}};
        Check(c->SetSchedule(steps), "SetSchedule");
        for (int i = 0; i < 50; ++i) {
          c->BeginStep(rng() % 2 ? rng() : rng() >> (rng() % 64));
          absl::SleepFor(absl::Milliseconds(2));
        }
        Check(c->SetSchedule({}), "SetSchedule (clear)");
        Check(c->Free(*ids), "Free");
        break;
      }
      case 1:  // junk on the session socket
        if (!JunkIsRefused(o.socket_dir, rng)) escape("junk on the session socket was not refused");
        break;
      case 2: {  // more connections than its limit
        std::vector<UniqueFd> held;
        uint32_t closed = 0;
        for (uint32_t i = 0; i < o.connections + 8; ++i) {
          auto sock = ConnectSeqpacket(o.socket_dir + "/tierd.session.sock");
          if (sock.ok()) held.push_back(std::move(*sock));
        }
        absl::SleepFor(absl::Milliseconds(200));
        for (UniqueFd& fd : held) {
          pollfd p{fd.get(), POLLIN, 0};
          char b;
          if (poll(&p, 1, 0) > 0 && recv(fd.get(), &b, 1, MSG_DONTWAIT) == 0) ++closed;
        }
        // Its own session holds one connection: at most connections - 1 more stay open.
        if (o.connections != 0 && held.size() - closed > o.connections) {
          escape(absl::StrCat(held.size() - closed, " connections stayed open; the limit is ",
                              o.connections));
        }
        break;
      }
      case 3: {  // fill its host quota, and then some
        std::vector<ChunkId> mine;
        uint64_t held = 0;
        absl::Status last;
        for (int i = 0; i < 256; ++i) {
          ChunkSpec spec{.size = 4 << 20};
          auto ids = c->AllocateIds({&spec, 1});
          if (!ids.ok()) {
            last = ids.status();
            break;
          }
          mine.push_back((*ids)[0]);
          held += 4 << 20;
        }
        if (o.quota_host != 0 && held > o.quota_host) {
          escape(absl::StrCat("allocated ", held, " host bytes past a quota of ", o.quota_host));
        }
        if (o.quota_host != 0 && absl::IsResourceExhausted(last) &&
            !absl::StrContains(last.message(), "quota.host") &&
            !absl::StrContains(last.message(), "full")) {
          escape(absl::StrCat("a refusal that names no quota: ", last.message()));
        }
        if (!mine.empty()) Check(c->Free(mine), "Free");
        break;
      }
      case 4: {  // a schedule past its limit
        if (o.schedule_accesses == 0) break;
        ChunkSpec spec{.size = 4096};
        auto ids = c->AllocateIds({&spec, 1});
        Check(ids.status(), "Allocate");
        if (!ids.ok()) break;
        std::vector<ScheduleStep> steps(o.schedule_accesses + 1,
                                        {{(*ids)[0], Tier::kHost, AccessMode::kRead}});
        absl::Status s = c->SetSchedule(steps);
        if (s.ok()) escape("a schedule past limits.schedule_accesses_per_session was accepted");
        if (!s.ok() && !absl::IsResourceExhausted(s)) Check(s, "SetSchedule (too long)");
        Check(c->Free(*ids), "Free");
        break;
      }
      case 5: {  // other tenants' chunks, by guessing ids (it holds none of its own now)
        for (int i = 0; i < 32; ++i) {
          const ChunkId id = 1 + rng() % 4096;
          auto info = c->Stat({&id, 1});
          // Another session's scratch chunk is never visible; another user's chunk of any kind
          // neither. (Running as the same user, its persistent chunks are the user's own.)
          if (info.ok() && (o.other_user || !(*info)[0].persistent)) {
            escape(absl::StrCat("Stat of chunk ", id, ", another tenant's, succeeded"));
          }
          if (o.other_user && c->Free({&id, 1}).ok()) {
            escape(absl::StrCat("Free of chunk ", id, ", another user's, succeeded"));
          }
        }
        break;
      }
      case 6: {  // leave in the middle of moves: the process ends here
        std::vector<ChunkSpec> specs(4, ChunkSpec{.size = 8 << 20});
        auto ids = c->AllocateIds(specs);
        Check(ids.status(), "Allocate");
        if (!ids.ok()) break;
        auto t = c->EvictIds(*ids, Tier::kNvme);
        Check(t.status(), "Evict");
        if (t.ok()) c->Wait(*t).IgnoreError();
        auto p = c->PrefetchIds(*ids, Tier::kHost);
        Check(p.status(), "Prefetch");
        std::fflush(stdout);
        _exit(0);
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace

int SoakClient(int argc, char** argv) {
  RoleOptions o;
  for (int i = 2; i < argc; ++i) {
    absl::string_view a = argv[i];
    auto value = [&](absl::string_view flag, std::string* out) {
      if (!absl::StartsWith(a, flag)) return false;
      *out = std::string(a.substr(flag.size()));
      return true;
    };
    std::string v;
    if (value("--role=", &o.role) || value("--socket_dir=", &o.socket_dir) ||
        value("--state=", &o.state)) {
    } else if (value("--seed=", &v)) {
      (void)absl::SimpleAtoi(v, &o.seed);
    } else if (value("--quota_host=", &v)) {
      (void)absl::SimpleAtoi(v, &o.quota_host);
    } else if (value("--connections=", &v)) {
      (void)absl::SimpleAtoi(v, &o.connections);
    } else if (value("--schedule_accesses=", &v)) {
      (void)absl::SimpleAtoi(v, &o.schedule_accesses);
    } else if (a == "--other_user") {
      o.other_user = true;
    } else if (a == "--final") {
      o.final_pass = true;
    }
  }
  signal(SIGPIPE, SIG_IGN);
  if (o.role == "mover") return Mover(o);
  if (o.role == "keeper") return Keeper(o);
  if (o.role == "hostile") return Hostile(o);
  std::fprintf(stderr, "tierd-bench soak-client: --role=mover|keeper|hostile\n");
  return 2;
}

}  // namespace tierd::bench
