// tierd-bench soak: one daemon shared for N minutes by clients of every kind — movers that check
// every byte they read back, a keeper of persistent chunks that must survive daemon crashes, and a
// hostile tenant (another user where the bench runs as root) — while clients and the daemon are
// SIGKILLed along the way. Reports operations, kills, faults, reclaim times, leaks (bytes, fds,
// RSS) and wrong bytes; exits 1 when any of crashes, wrong or lost bytes, escapes or leaks is not
// 0.
//
// Each role runs in a process of its own (`tierd-bench soak-client --role=...`), so that killing
// it is a real client crash; it reports counters as lines "key value" on stdout.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/sizes.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"

namespace tierd::bench {
namespace {

// Exit status of a client whose daemon went away (a daemon kill): not a failure.
constexpr int kDaemonGone = 3;
// Exit status of a client that found wrong data or an escape; the details are on its stderr.
constexpr int kClientFound = 4;
constexpr uint32_t kNobody = 65534;

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

// ---- the bench -------------------------------------------------------------------------------

struct SoakOptions {
  double minutes = 30;
  int movers = 3;
  absl::Duration client_kill_every = absl::Seconds(10);
  absl::Duration daemon_kill_every = absl::Minutes(4);
  std::string dir = "/tmp";
  bool json = false;
};

struct Totals {
  std::map<std::string, uint64_t> counters;  // summed over every client
  uint64_t client_kills = 0, daemon_kills = 0, daemon_crashes = 0, client_failures = 0;
  uint64_t reclaim_timeouts = 0;
  std::vector<double> reclaim_ms, probe_ms, restart_ms;
  std::vector<std::string> problems;
};

struct Child {
  std::string role;
  pid_t pid = -1;
  int out = -1;
  std::string pending;  // a partial line
  uint64_t session = 0;
  bool killed = false;
};

std::string ProcState(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? "" : stat.substr(paren + 2, 1);
}

size_t OpenFds(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Whether the other user (nobody) can run `binary`: not where a directory above it is closed
// to others (a checkout in a home directory of mode 700).
bool OtherUserCanRun(const std::string& binary) {
  const pid_t pid = fork();
  if (pid == 0) {
    const bool can = setgroups(0, nullptr) == 0 && setgid(kNobody) == 0 && setuid(kNobody) == 0 &&
                     access(binary.c_str(), X_OK) == 0;
    _exit(can ? 0 : 1);
  }
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

class SoakRun {
 public:
  explicit SoakRun(const SoakOptions& o) : o_(o), rng_(std::random_device{}()) {}

  int Run() {
    const bool root = geteuid() == 0;
    // Decided once, before the daemon's quota names the hostile tenant's user.
    hostile_uid_ = root && OtherUserCanRun(Self()) ? kNobody : geteuid();
    std::error_code ec;
    std::filesystem::create_directories(o_.dir, ec);
    region_ = std::make_unique<RegionFile>(absl::StrCat(o_.dir, "/soak-", getpid(), ".region"));
    config_ = absl::StrCat(o_.dir, "/soak-", getpid(), ".toml");
    state_ = absl::StrCat(o_.dir, "/soak-", getpid(), ".kept");
    std::ofstream(config_) << "[limits]\nconnections_per_uid = " << kConnections
                           << "\nsessions_per_uid = 16\nschedule_accesses_per_session = "
                           << kScheduleAccesses << "\n\n[[quota.users]]\nuid = " << hostile_uid_
                           << "\nhost = \"" << (kHostQuota >> 20) << "MiB\"\nnvme = \"256MiB\"\n";
    std::vector<std::string> args = {"--config=" + config_,
                                     "--host_capacity=1GiB",
                                     "--host_segment_size=64MiB",
                                     "--device=emulated",
                                     "--device_capacity=512MiB",
                                     "--device_segment_size=64MiB",
                                     absl::StrCat("--nvme_regions=", region_->path(), ":2GiB"),
                                     "--probe_bytes=16MiB",
                                     "--log_level=info"};
    auto d = testing::DaemonProcess::Start({.binary = testing::ExecutableDir() + "/../daemon/tierd",
                                            .args = args,
                                            .socket_group = root ? "nogroup" : ""});
    if (!d.ok()) Die(d.status(), "starting tierd");
    daemon_ = std::move(*d);
    Baseline();
    for (int i = 0; i < o_.movers; ++i) Spawn("mover");
    Spawn("keeper");
    Spawn("hostile");

    const absl::Time start = absl::Now();
    const absl::Time end = start + absl::Seconds(o_.minutes * 60);
    absl::Time next_client_kill = start + o_.client_kill_every;
    absl::Time next_daemon_kill = start + o_.daemon_kill_every;
    absl::Time next_probe = start;
    absl::Time next_status = start + absl::Minutes(1);
    while (absl::Now() < end) {
      Pump(absl::Milliseconds(100));
      Reap(/*respawn=*/true);
      if (!DaemonAlive()) {
        t_.daemon_crashes++;
        t_.problems.push_back("the daemon died on its own:\n" + Tail(daemon_->Log()));
        RestartDaemon(/*crashed=*/true);
        continue;
      }
      const absl::Time now = absl::Now();
      if (now >= next_probe) {
        Probe();
        next_probe = now + absl::Seconds(1);
      }
      if (now >= next_client_kill) {
        KillAClient();
        next_client_kill = absl::Now() + o_.client_kill_every;
      }
      if (now >= next_daemon_kill && end - now > absl::Minutes(1)) {
        t_.daemon_kills++;
        RestartDaemon(/*crashed=*/false);
        next_daemon_kill = absl::Now() + o_.daemon_kill_every;
      }
      if (now >= next_status && !o_.json) {
        std::fprintf(stderr,
                     "soak: %.0f s: %" PRIu64 " ops, %" PRIu64 " client kills, %" PRIu64
                     " daemon kills, %" PRIu64 " wrong bytes\n",
                     absl::ToDoubleSeconds(now - start), t_.counters["ops"], t_.client_kills,
                     t_.daemon_kills, t_.counters["wrong_bytes"]);
        next_status = now + absl::Minutes(1);
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    Finish();
    return Print(seconds);
  }

 private:
  static constexpr uint32_t kConnections = 32;
  static constexpr uint64_t kScheduleAccesses = 4096;
  static constexpr uint64_t kHostQuota = 128ull << 20;

  std::string Self() const { return testing::ExecutableDir() + "/tierd-bench"; }

  void Spawn(const std::string& role, bool final_pass = false) {
    std::vector<std::string> argv = {Self(),
                                     "soak-client",
                                     "--role=" + role,
                                     "--socket_dir=" + daemon_->socket_dir(),
                                     absl::StrCat("--seed=", rng_()),
                                     "--state=" + state_,
                                     absl::StrCat("--quota_host=", kHostQuota),
                                     absl::StrCat("--connections=", kConnections),
                                     absl::StrCat("--schedule_accesses=", kScheduleAccesses)};
    if (final_pass) argv.push_back("--final");
    const bool as_other = role == "hostile" && hostile_uid_ != geteuid();
    if (as_other) argv.push_back("--other_user");
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) Die(absl::ErrnoToStatus(errno, "pipe"), "soak");
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], 1);
      if (as_other &&
          (setgroups(0, nullptr) != 0 || setgid(kNobody) != 0 || setuid(kNobody) != 0)) {
        _exit(126);
      }
      execv(args[0], args.data());
      _exit(127);
    }
    close(pipe_fds[1]);
    fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    children_.push_back({.role = role, .pid = pid, .out = pipe_fds[0]});
  }

  // Reads what the children reported, for up to `wait`.
  void Pump(absl::Duration wait) {
    std::vector<pollfd> fds;
    for (const Child& c : children_) fds.push_back({c.out, POLLIN, 0});
    poll(fds.data(), fds.size(), static_cast<int>(absl::ToInt64Milliseconds(wait)));
    for (Child& c : children_) Drain(c);
  }

  void Drain(Child& c) {
    char buf[65536];
    for (;;) {
      const ssize_t n = read(c.out, buf, sizeof(buf));
      if (n <= 0) break;
      c.pending.append(buf, n);
    }
    size_t nl;
    while ((nl = c.pending.find('\n')) != std::string::npos) {
      const std::string line = c.pending.substr(0, nl);
      c.pending.erase(0, nl + 1);
      std::vector<std::string> kv = absl::StrSplit(line, ' ');
      uint64_t v = 0;
      if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &v)) continue;
      if (kv[0] == "session") {
        c.session = v;
      } else {
        t_.counters[kv[0]] += v;
      }
    }
  }

  // Collects the children that ended; a client that ended on its own other than because its
  // daemon went away is a failure (wrong data, an escape, an error it could not survive).
  void Reap(bool respawn) {
    for (size_t i = 0; i < children_.size();) {
      Child& c = children_[i];
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) != c.pid) {
        ++i;
        continue;
      }
      Drain(c);
      close(c.out);
      const bool by_us = c.killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (!by_us && code != 0 && code != kDaemonGone) {
        t_.client_failures++;
        t_.problems.push_back(absl::StrCat(c.role, " exited with status ", code));
      }
      const std::string role = c.role;
      children_.erase(children_.begin() + i);
      if (respawn) Spawn(role);
    }
  }

  bool DaemonAlive() const {
    const std::string s = ProcState(daemon_->pid());
    return !s.empty() && s != "Z";
  }

  // A call every second from a session of its own: the daemon answers everyone, whatever the
  // others do.
  void Probe() {
    if (probe_ == nullptr) {
      auto c = Client::Connect({.socket_dir = daemon_->socket_dir(), .client_name = "soak-probe"});
      if (!c.ok()) return;
      probe_ = std::move(*c);
    }
    absl::Status s;
    const double ms = TimeMs([&] { s = probe_->GetNodeInfo().status(); });
    if (!s.ok()) {
      probe_.reset();
      return;
    }
    t_.probe_ms.push_back(ms);
  }

  // SIGKILL one client at random and time until the daemon has ended its session.
  void KillAClient() {
    if (children_.empty()) return;
    Child& c = children_[rng_() % children_.size()];
    if (c.session == 0 || c.killed) return;
    const uint64_t session = c.session;
    kill(c.pid, SIGKILL);
    c.killed = true;
    t_.client_kills++;
    const absl::Time killed = absl::Now();
    for (;;) {
      if (probe_ == nullptr) Probe();
      if (probe_ == nullptr) return;
      auto info = probe_->GetNodeInfo(/*list_sessions=*/true);
      if (!info.ok()) return;
      bool open = false;
      for (const SessionSummary& s : info->session_list) open |= s.id == session;
      const absl::Duration took = absl::Now() - killed;
      if (!open) {
        t_.reclaim_ms.push_back(absl::ToDoubleMilliseconds(took));
        return;
      }
      if (took > absl::Seconds(30)) {
        t_.reclaim_timeouts++;
        t_.problems.push_back(
            absl::StrCat("session ", session, " of a killed ", c.role, " still open after 30 s"));
        return;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // SIGKILL the daemon (unless it died already) and start it again on the same state and
  // regions; the clients notice, end, and are started again.
  void RestartDaemon(bool crashed) {
    Scan(daemon_->Log());
    probe_.reset();
    const absl::Time t0 = absl::Now();
    absl::Status s = daemon_->Restart();
    if (!s.ok()) Die(s, "restarting tierd");
    if (!crashed) t_.restart_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    // The clients of the old daemon end (UNAVAILABLE); collect them before the baseline.
    for (absl::Time give_up = absl::Now() + absl::Seconds(30);
         !children_.empty() && absl::Now() < give_up;) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    for (Child& c : children_) {
      kill(c.pid, SIGKILL);
      c.killed = true;
      t_.problems.push_back(c.role + " did not notice its daemon's death within 30 s");
    }
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    Baseline();
    for (int i = 0; i < o_.movers; ++i) Spawn("mover");
    Spawn("keeper");
    Spawn("hostile");
  }

  // The daemon's descriptors and memory with only the probe connected.
  void Baseline() {
    Probe();
    absl::SleepFor(absl::Milliseconds(200));
    base_fds_ = OpenFds(daemon_->pid());
    base_rss_ = testing::RssBytes(daemon_->pid());
  }

  void Scan(const std::string& log) {
    for (const char* bad : {"AddressSanitizer", "runtime error", "Assertion", "critical",
                            "use-after-free", "Check failed"}) {
      if (absl::StrContains(log, bad)) {
        t_.problems.push_back(absl::StrCat("the daemon's log says '", bad, "':\n", Tail(log)));
      }
    }
  }

  static std::string Tail(const std::string& log) {
    return log.substr(log.size() > 3000 ? log.size() - 3000 : 0);
  }

  // Ends every client, lets the keeper check and free its chunks, and checks that the daemon holds
  // nothing more than when it started: no bytes, no chunks, no descriptors.
  void Finish() {
    for (Child& c : children_) {
      kill(c.pid, SIGKILL);
      c.killed = true;
    }
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    for (absl::Time give_up = absl::Now() + absl::Seconds(30);;) {
      Probe();
      auto info = probe_ ? probe_->GetNodeInfo() : absl::UnavailableError("no probe");
      if (info.ok() && info->sessions == 1) break;
      if (absl::Now() > give_up) {
        t_.problems.push_back("sessions of killed clients still open 30 s after the end");
        break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    Spawn("keeper", /*final_pass=*/true);
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    absl::SleepFor(absl::Milliseconds(500));
    auto info = probe_ ? probe_->GetNodeInfo() : absl::UnavailableError("no probe");
    if (!info.ok()) Die(info.status(), "GetNodeInfo");
    CheckSpace(*info);
    for (const TierStatus& tier : info->tiers) leaked_bytes_ += tier.used_bytes;
    leaked_chunks_ = info->chunks;
    end_fds_ = OpenFds(daemon_->pid());
    end_rss_ = testing::RssBytes(daemon_->pid());
    probe_.reset();
    Scan(daemon_->Log());
    const int stopped = daemon_->StopWithin(absl::Seconds(60));
    if (stopped != 0) t_.problems.push_back(absl::StrCat("tierd stopped with status ", stopped));
    std::filesystem::remove(config_);
    std::filesystem::remove(state_);
  }

  // Nothing moves: each tier's bytes in use must be the space its chunks take there.
  void CheckSpace(const NodeInfo& info) {
    auto chunks = probe_->ListChunks(/*all_sessions=*/true);
    if (!chunks.ok()) Die(chunks.status(), "ListChunks");
    std::map<Tier, uint64_t> space;
    for (const ChunkInfo& c : *chunks) {
      for (const auto& [tier, bytes] : c.space) space[tier] += bytes;
    }
    for (const TierStatus& tier : info.tiers) {
      if (tier.used_bytes == space[tier.tier]) continue;
      t_.problems.push_back(absl::StrCat("tier ", static_cast<int>(tier.tier), " has ",
                                         tier.used_bytes, " bytes in use; its chunks take ",
                                         space[tier.tier]));
    }
  }

  int Print(double seconds) {
    const uint64_t wrong = t_.counters["wrong_bytes"], lost = t_.counters["lost_bytes"];
    const uint64_t escapes = t_.counters["escapes"];
    const int64_t fds = static_cast<int64_t>(end_fds_) - static_cast<int64_t>(base_fds_);
    const double rss_mib = (static_cast<double>(end_rss_) - base_rss_) / (1 << 20);
    auto pct = [](const std::vector<double>& v, double q) {
      return v.empty() ? 0.0 : Percentile(v, q);
    };
    Reporter out("soak", o_.json);
    if (!o_.json) std::printf("tierd-bench soak: %.1f minutes\n", seconds / 60);
    out.Add({"minutes", seconds / 60, "min", "", ""});
    out.Add({"client_ops", static_cast<double>(t_.counters["ops"]), "ops", "",
             absl::StrFormat("%.0f per second", t_.counters["ops"] / seconds)});
    out.Add({"verified_gib", t_.counters["verified_bytes"] / double(1 << 30), "GiB", "",
             "bytes read back and checked by movers"});
    out.Add({"wrong_bytes", static_cast<double>(wrong), "B", "", "must be 0"});
    out.Add({"persistent_checks", static_cast<double>(t_.counters["persistent_checks"]), "", "",
             absl::StrCat(t_.counters["persisted"], " versions made durable")});
    out.Add(
        {"lost_bytes", static_cast<double>(lost), "B", "", "acknowledged, then gone: must be 0"});
    out.Add({"client_kills", static_cast<double>(t_.client_kills), "", "", "SIGKILL"});
    out.Add({"daemon_kills", static_cast<double>(t_.daemon_kills), "", "", "SIGKILL, restarted"});
    out.Add({"daemon_crashes", static_cast<double>(t_.daemon_crashes), "", "", "must be 0"});
    out.Add({"hostile_attacks", static_cast<double>(t_.counters["attacks"]), "", "",
             hostile_uid_ == geteuid() ? "as the same user" : "as another user"});
    out.Add({"escapes", static_cast<double>(escapes), "", "", "must be 0"});
    out.Add({"refused", static_cast<double>(t_.counters["refused"]), "", "",
             "busy or full: FAILED_PRECONDITION, RESOURCE_EXHAUSTED"});
    out.Add({"errors", static_cast<double>(t_.counters["errors"]), "", "", "other failed calls"});
    out.Add({"reclaim_p50_ms", pct(t_.reclaim_ms, 0.5), "ms", "", "killed client's session ended"});
    out.Add({"reclaim_p99_ms", pct(t_.reclaim_ms, 0.99), "ms", "", ""});
    out.Add({"reclaim_max_ms", pct(t_.reclaim_ms, 1.0), "ms", "", ""});
    out.Add({"probe_p99_ms", pct(t_.probe_ms, 0.99), "ms", "", "GetNodeInfo of a bystander"});
    out.Add({"probe_max_ms", pct(t_.probe_ms, 1.0), "ms", "", ""});
    out.Add({"restart_p50_ms", pct(t_.restart_ms, 0.5), "ms", "", "SIGKILL to serving again"});
    out.Add({"leaked_bytes", static_cast<double>(leaked_bytes_), "B", "",
             absl::StrCat(leaked_chunks_, " chunks left; must be 0")});
    out.Add({"leaked_fds", static_cast<double>(fds), "", "", "since the last start; must be 0"});
    out.Add({"rss_growth_mib", rss_mib, "MiB", "", "since the last start"});
    for (const std::string& p : t_.problems) std::fprintf(stderr, "soak: %s\n", p.c_str());
    const bool clean = wrong == 0 && lost == 0 && escapes == 0 && t_.daemon_crashes == 0 &&
                       t_.client_failures == 0 && t_.reclaim_timeouts == 0 && leaked_bytes_ == 0 &&
                       leaked_chunks_ == 0 && fds == 0 && t_.problems.empty();
    if (!o_.json) std::printf("%s\n", clean ? "clean" : "NOT CLEAN (see above)");
    return clean ? 0 : 1;
  }

  SoakOptions o_;
  std::mt19937_64 rng_;
  uint32_t hostile_uid_ = 0;
  std::unique_ptr<RegionFile> region_;
  std::string config_, state_;
  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> probe_;
  std::vector<Child> children_;
  Totals t_;
  size_t base_fds_ = 0, end_fds_ = 0;
  uint64_t base_rss_ = 0, end_rss_ = 0;
  uint64_t leaked_bytes_ = 0, leaked_chunks_ = 0;
};

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

int Soak(int argc, char** argv) {
  SoakOptions o;
  for (int i = 2; i < argc; ++i) {
    absl::string_view a = argv[i];
    double seconds = 0;
    bool ok = true;
    if (a == "--json") {
      o.json = true;
    } else if (absl::StartsWith(a, "--minutes=")) {
      ok = absl::SimpleAtod(a.substr(10), &o.minutes) && o.minutes > 0;
    } else if (absl::StartsWith(a, "--movers=")) {
      ok = absl::SimpleAtoi(a.substr(9), &o.movers) && o.movers >= 1 && o.movers <= 16;
    } else if (absl::StartsWith(a, "--kill_every=")) {
      ok = absl::SimpleAtod(a.substr(13), &seconds) && seconds > 0;
      o.client_kill_every = absl::Seconds(seconds);
    } else if (absl::StartsWith(a, "--daemon_kill_every=")) {
      ok = absl::SimpleAtod(a.substr(20), &seconds) && seconds > 0;
      o.daemon_kill_every = absl::Seconds(seconds);
    } else if (absl::StartsWith(a, "--dir=")) {
      o.dir = std::string(a.substr(6));
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: tierd-bench soak [--json] [--minutes=30] [--movers=3] "
                   "[--kill_every=SECONDS (10)] [--daemon_kill_every=SECONDS (240)] "
                   "[--dir=DIR (/tmp): the NVMe region]\n");
      return 2;
    }
  }
  return SoakRun(o).Run();
}

}  // namespace tierd::bench
