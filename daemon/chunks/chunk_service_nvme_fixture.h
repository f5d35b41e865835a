// The chunk service over a host pool and a real NVMe tier (io_uring on O_DIRECT region files in a
// scratch directory), with faults injected at the I/O engine's seam: the fixture the service's
// NVMe tests share (chunk_service_nvme_test.cc: requests and moves; _discard_test.cc: contents
// declared dead; _faults_test.cc: the drive failing; _recovery_test.cc: stops, crashes and the
// index; _quota_test.cc: limits and quotas).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/chunks/chunk_service.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "gtest/gtest.h"

namespace tierd::daemon {

inline constexpr uint64_t kSeg = 16 << 20;

class ChunkServiceNvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/tierd-nvme-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    HostPoolOptions o{.capacity = 4 * kSeg,
                      .segment_size = kSeg,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    host_ = std::move(*CreateHostPool(o));
    OpenTier();
    session_ = *sessions_.Open({1000, 1000, 1}, "test");
    MapPage(*session_);
  }
  void TearDown() override {
    // As the daemon does: moves in flight settle (their callbacks use the service) before the
    // service goes. A test may end as soon as its completion is marked, mid-callback.
    if (nvme_ != nullptr) nvme_->Drain();
    service_.reset();
    nvme_.reset();
    for (auto& [id, page] : pages_) munmap(page, kCompletionPageBytes);
    std::filesystem::remove_all(dir_);
  }

  void OpenTier() {
    NvmeOptions o;
    o.regions = {{dir_ + "/r0", 96 << 20}, {dir_ + "/r1", 96 << 20}};
    o.stripe_unit = 256 << 10;
    o.io_size = 128 << 10;
    o.queue_depth = 16;
    o.index_size = 1 << 20;
    o.wrap_backend = [this](std::unique_ptr<IoBackend> inner) {
      auto f = std::make_unique<FaultInjectingBackend>(std::move(inner));
      faults_ = f.get();
      return f;
    };
    InstanceId id{};
    id[0] = 7;
    auto tier = NvmeTier::Open(o, id, host_.get());
    ASSERT_TRUE(tier.ok()) << tier.status();
    nvme_ = std::move(*tier);
    service_ = std::make_unique<ChunkService>(NodeTiers(host_.get(), nvme_.get()));
  }

  void MapPage(const Session& s) {
    void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   s.completions->fd(), 0);
    ASSERT_NE(p, MAP_FAILED);
    pages_[s.id] = static_cast<CompletionPage*>(p);
  }
  absl::Status Wait(const Session& s, absl::StatusOr<SlotToken> token) {
    if (!token.ok()) return token.status();
    return WaitCompletion(*pages_.at(s.id), *token, absl::Seconds(30));
  }

  std::vector<ChunkId> Alloc(const Session& s, std::vector<uint64_t> sizes,
                             TierKind home = TierKind::kHost) {
    std::vector<ChunkRequest> r;
    for (uint64_t size : sizes) r.push_back({.size = size, .home = home});
    auto ids = service_->Allocate(s, r);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return *ids;
  }
  // Writes a pattern into the chunks' host copies (acquire for write, fill, release).
  void Write(const Session& s, const std::vector<ChunkId>& ids, uint64_t seed) {
    auto a = service_->Acquire(s, ids, TierKind::kHost, Access::kWrite);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(Wait(s, a->ready).ok());  // a chunk being brought in is overwritten on arrival
    for (size_t i = 0; i < ids.size(); ++i) {
      auto* w = static_cast<uint64_t*>(host_->Address(a->locations[i]));
      for (size_t j = 0; j < a->locations[i].size / 8; ++j) w[j] = Word(seed, ids[i], j);
    }
    ASSERT_TRUE(service_->Release(s, ids).ok());
  }
  // True if the host copies hold the pattern.
  bool Check(const Session& s, const std::vector<ChunkId>& ids, uint64_t seed,
             const std::vector<uint64_t>& sizes) {
    auto a = service_->Acquire(s, ids, TierKind::kHost, Access::kRead);
    if (!a.ok()) {
      ADD_FAILURE() << a.status();
      return false;
    }
    if (absl::Status ready = Wait(s, a->ready); !ready.ok()) {
      ADD_FAILURE() << ready;
      return false;
    }
    bool ok = true;
    for (size_t i = 0; i < ids.size() && ok; ++i) {
      const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[i]));
      for (size_t j = 0; j < sizes[i] / 8 && ok; ++j) ok = w[j] == Word(seed, ids[i], j);
    }
    EXPECT_TRUE(service_->Release(s, ids).ok());
    return ok;
  }
  // The daemon stops — cleanly (session_ ends, what lives in memory is written down) or by dying —
  // and starts again from what the drive and the index hold. Returns the chunks recovered.
  size_t Restart(bool clean) {
    if (clean) {
      service_->CloseSession(*session_);
      EXPECT_EQ(service_->WriteDownForStop(), 0u);
    }
    service_.reset();
    nvme_.reset();
    OpenTier();
    return service_->Recover(nvme_->RecoveredEntries());
  }
  static uint64_t Word(uint64_t seed, ChunkId id, size_t j) {
    return (seed * 0x9E3779B97F4A7C15ull) ^ (id << 32) ^ j;
  }

  std::string dir_;
  std::unique_ptr<SegmentPool> host_;
  std::unique_ptr<NvmeTier> nvme_;
  FaultInjectingBackend* faults_ = nullptr;
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> session_;
  std::map<SessionId, CompletionPage*> pages_;
};

}  // namespace tierd::daemon
