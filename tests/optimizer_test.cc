// The out-of-core optimizer against a real daemon: state on NVMe streamed through a host budget
// much smaller than it, compared step by step with the same Adam applied in memory; persistence
// across optimizers and daemon restarts; torn steps, non-finite gradients and bad input.
#include "tierd/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu_adam.h"
#include "testing/daemon_process.h"

namespace tierd {
namespace {

using testing::DaemonProcess;

std::string DaemonBinary() { return testing::ExecutableDir() + "/../daemon/tierd"; }

// Two groups, 1.2 M parameters: 14 MiB of state against a 4 MiB host budget.
const std::vector<ParamGroup> kGroups = {{"embed", 700001}, {"layer0", 500000}};
constexpr uint64_t kBudget = 4 << 20;
constexpr uint64_t kSegment = 16 << 20;  // the host tier's segments

class OptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto daemon =
        DaemonProcess::Start({.binary = DaemonBinary(),
                              .args = {"--host_capacity=64MiB", "--host_segment_size=16MiB",
                                       "--device=none", "--probe_bytes=0"}});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    SetUpState();
  }
  // The initial weights (seeded) and zero moments, in memory: the reference's.
  void SetUpState() {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const ParamGroup& g : kGroups) {
      std::vector<float> p(g.params);
      for (float& x : p) x = normal(rng);
      params_.push_back(p);
      m_.emplace_back(g.params, 0.0f);
      v_.emplace_back(g.params, 0.0f);
    }
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
    }
  }

  OffloadedAdamOptions Options(const std::string& name = "model/adam") {
    OffloadedAdamOptions o;
    o.client.socket_dir = daemon_->socket_dir();
    o.name = name;
    o.host_budget_bytes = kBudget;
    o.threads = 2;
    o.hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
    return o;
  }

  std::unique_ptr<OffloadedAdam> Create(const OffloadedAdamOptions& o) {
    auto opt = OffloadedAdam::Create(kGroups, o);
    EXPECT_TRUE(opt.ok()) << opt.status();
    return opt.ok() ? std::move(*opt) : nullptr;
  }

  // Gradients for a step: bf16, different every step.
  std::vector<std::vector<uint16_t>> Gradients(int step, float scale) {
    std::mt19937 rng(100 + step);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::vector<uint16_t>> grads;
    for (const ParamGroup& g : kGroups) {
      std::vector<uint16_t> grad(g.params);
      for (uint16_t& x : grad) x = kernels::ToBF16(normal(rng) * scale);
      grads.push_back(std::move(grad));
    }
    return grads;
  }

  // The same step in memory (the reference), on groups `which`.
  void ReferenceStep(const std::vector<std::vector<uint16_t>>& grads, int step, float scale,
                     const std::vector<size_t>& which) {
    static kernels::ThreadPool pool(1, false);
    for (size_t g : which) {
      const kernels::AdamTensor t{.param = params_[g].data(),
                                  .m = m_[g].data(),
                                  .v = v_[g].data(),
                                  .grad = grads[g].data(),
                                  .grad_type = kernels::DType::kBF16,
                                  .n = kGroups[g].params};
      kernels::AdamStep(
          {&t, 1}, {.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true, .grad_scale = scale},
          step, pool);
    }
  }

  // The optimizer's initial weights: params_ (m and v zero).
  void SetAll(OffloadedAdam& opt) {
    for (size_t g = 0; g < kGroups.size(); ++g) {
      absl::Status set = opt.SetParams(g, params_[g]);
      ASSERT_TRUE(set.ok()) << set;
    }
  }

  void ExpectParams(OffloadedAdam& opt, const char* when) {
    for (size_t g = 0; g < kGroups.size(); ++g) {
      std::vector<float> got(kGroups[g].params);
      ASSERT_TRUE(opt.GetParams(g, got).ok());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], params_[g][i], 1e-6f * std::fabs(params_[g][i]) + 1e-12f)
            << when << ", group " << g << ", parameter " << i;
      }
    }
  }

  uint64_t PathBytes(Client& c, const char* name) {
    auto info = c.GetNodeInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    const PathStatus* p = info.ok() ? info->path(name) : nullptr;
    return p == nullptr ? 0 : p->bytes;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<std::vector<float>> params_, m_, v_;
};

TEST_F(OptimizerTest, StreamsStateThroughTheHostBudgetAndMatchesAdamInMemory) {
  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  EXPECT_FALSE(opt->resumed());
  EXPECT_GT(opt->state_bytes(), 3 * kBudget);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));

  for (int step = 1; step <= 3; ++step) {
    const float scale = 64.0f;
    auto grads = Gradients(step, scale);
    std::vector<std::vector<uint16_t>> out;
    for (const ParamGroup& g : kGroups) out.emplace_back(g.params);
    const uint64_t read_before = PathBytes(opt->client(), "nvme_to_host");
    const uint64_t written_before = PathBytes(opt->client(), "host_to_nvme");
    ASSERT_TRUE(opt->BeginStep(scale).ok());
    // Backward produces the last group's gradients first; step 2 gives them in declared order.
    const std::vector<size_t> order =
        step == 2 ? std::vector<size_t>{0, 1} : std::vector<size_t>{1, 0};
    for (size_t g : order) {
      ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16, out[g].data(),
                                 ScalarType::kBFloat16)
                      .ok());
    }
    auto stats = opt->FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->step, step);
    EXPECT_TRUE(stats->skipped_groups.empty());
    EXPECT_EQ(stats->state_bytes, opt->state_bytes());
    ReferenceStep(grads, step, scale, {0, 1});
    // The state did not fit: (nearly) all of it came up from NVMe and went back down.
    EXPECT_GE(PathBytes(opt->client(), "nvme_to_host") - read_before, opt->state_bytes() - kBudget);
    EXPECT_GE(PathBytes(opt->client(), "host_to_nvme") - written_before, opt->state_bytes());
    for (size_t g = 0; g < kGroups.size(); ++g) {
      for (size_t i = 0; i < kGroups[g].params; i += 997) {
        ASSERT_EQ(out[g][i], kernels::ToBF16(params_[g][i])) << "step " << step << " group " << g;
      }
    }
  }
  EXPECT_EQ(opt->steps_taken(), 3);
  ExpectParams(*opt, "after 3 steps");
}

// The shards a budget of `slots` keeps on the host, the tier having room beside it: all but the
// window the rest streams through, a quarter of the budget, at most eight shards and at least the
// shards in hand and two.
uint64_t ResidentShards(uint64_t slots, bool speculative) {
  const uint64_t per_shard = speculative ? 2 : 1;
  const uint64_t window = std::max<uint64_t>(per_shard + 2, std::min<uint64_t>(slots / 4, 8));
  return (slots - window) / per_shard;
}

// Scratch state has nothing to keep durable: what its budget holds beyond a window for the rest
// stays on the host between steps, and only the rest goes down to NVMe and up again.
TEST_F(OptimizerTest, ScratchStateKeepsWhatTheBudgetHoldsOnTheHostBetweenSteps) {
  // The optimizer's own shard size (the budget holds 24) and small shards (it holds 64: a
  // quarter would be 16, the window takes 8).
  for (auto [speculative, shard_params] : std::vector<std::pair<bool, uint64_t>>{
           {false, 0}, {true, 0}, {false, 16 * 1024}, {true, 16 * 1024}}) {
    SCOPED_TRACE(
        absl::StrCat(speculative ? "speculative" : "in place", ", shard_params ", shard_params));
    params_.clear(), m_.clear(), v_.clear();
    SetUpState();
    OffloadedAdamOptions o =
        Options(absl::StrCat(speculative ? "model/scratch-spec-" : "model/scratch-", shard_params));
    o.persistent = false;
    o.speculative = speculative;
    o.host_budget_bytes = 3 * kBudget;
    o.shard_params = shard_params;
    auto opt = Create(o);
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    const uint64_t shard_bytes = 12 * opt->shard_params();
    const uint64_t slots = o.host_budget_bytes / shard_bytes;
    ASSERT_EQ(slots, shard_params == 0 ? 24u : 64u);
    const uint64_t resident = ResidentShards(slots, speculative);
    ASSERT_GT(resident * shard_bytes, opt->state_bytes() / 4);
    ASSERT_LT(resident * shard_bytes, opt->state_bytes());
    for (int step = 1; step <= 5; ++step) {
      auto grads = Gradients(step, 1.0f);
      if (step == 5) {
        // Between steps the resident shards are not pinned: another job's burst takes the host
        // tier's room (56 of its 64 MiB), the daemon writes them down, and the step reads them.
        ClientOptions burst_options;
        burst_options.socket_dir = daemon_->socket_dir();
        auto burst = Client::Connect(burst_options);
        ASSERT_TRUE(burst.ok()) << burst.status();
        std::vector<ChunkSpec> specs(4, ChunkSpec{.size = 14 << 20, .home = Tier::kNvme});
        auto ids = (*burst)->AllocateIds(specs);
        ASSERT_TRUE(ids.ok()) << ids.status();
        auto held = (*burst)->AcquireIds(*ids, Tier::kHost, AccessMode::kOverwrite);
        ASSERT_TRUE(held.ok()) << held.status();
        absl::Status ready = (*burst)->Wait(held->ready, absl::Seconds(30));
        ASSERT_TRUE(ready.ok()) << ready;
        ASSERT_TRUE((*burst)->Release(*ids).ok());
        ASSERT_TRUE((*burst)->Free(*ids).ok());
      }
      const uint64_t read_before = PathBytes(opt->client(), "nvme_to_host");
      const uint64_t written_before = PathBytes(opt->client(), "host_to_nvme");
      ASSERT_TRUE(opt->BeginStep().ok());
      for (size_t g : {1, 0}) {
        ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
      }
      auto stats = opt->FinishStep();
      ASSERT_TRUE(stats.ok()) << stats.status();
      ReferenceStep(grads, step, 1.0f, {0, 1});
      if (step == 1 || step == 5) continue;  // the resident shards came up
      // Only the shards that are not resident moved, read and written once each (a group's
      // last shard is smaller than the others: within two shards).
      const uint64_t moved = opt->state_bytes() - resident * shard_bytes;
      const uint64_t read = PathBytes(opt->client(), "nvme_to_host") - read_before;
      const uint64_t written = PathBytes(opt->client(), "host_to_nvme") - written_before;
      EXPECT_LE(read, moved + 2 * shard_bytes) << "step " << step;
      EXPECT_LE(written, moved + 2 * shard_bytes) << "step " << step;
      EXPECT_GE(written, moved - 2 * shard_bytes) << "step " << step;
      EXPECT_LT(written, opt->state_bytes() * 3 / 4) << "step " << step;
    }
    ExpectParams(*opt, "after 5 steps, the last after a burst");
  }
}

// The budget is bytes: a model's many small groups (a block's norms and biases) each end in a
// shard smaller than the largest, and as many of them stay on the host as their bytes fit, not
// only as many as the budget has slots of the largest shard's size.
TEST_F(OptimizerTest, ScratchStateKeepsSmallShardsAsFarAsTheirBytesFit) {
  std::vector<ParamGroup> groups = {{"big", 256 * 1024}};  // one shard of the largest size
  for (int i = 0; i < 10; ++i) groups.push_back({absl::StrCat("norm", i), 20000});
  OffloadedAdamOptions o = Options("model/small-shards");
  o.persistent = false;
  o.shard_params = 256 * 1024;  // 3 MiB of state a shard
  // 24 MiB in the tier's 16 MiB segments holds 7 slots of 3 MiB (5 in a segment): a window of 3
  // leaves 12 MiB for the 11 shards' 5.4 MiB to stay in. Counted in slots, only 4 of the 11 would
  // stay.
  o.host_budget_bytes = 8 * 12 * o.shard_params;
  auto created = OffloadedAdam::Create(groups, o);
  ASSERT_TRUE(created.ok()) << created.status();
  OffloadedAdam& opt = **created;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<uint16_t>> grads;
  for (size_t g = 0; g < groups.size(); ++g) {
    params.emplace_back(groups[g].params, 0.5f);
    grads.emplace_back(groups[g].params, kernels::ToBF16(0.25f));
    ASSERT_TRUE(opt.SetParams(g, params[g]).ok());
  }
  for (int step = 1; step <= 3; ++step) {
    const uint64_t read_before = PathBytes(opt.client(), "nvme_to_host");
    ASSERT_TRUE(opt.BeginStep().ok());
    for (size_t g = groups.size(); g-- > 0;) {
      ASSERT_TRUE(opt.StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
    }
    auto stats = opt.FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (step == 1) continue;  // the state came up
    EXPECT_EQ(PathBytes(opt.client(), "nvme_to_host") - read_before, 0u) << "step " << step;
  }
}

// A chunk never spans two segments of the host tier: the optimizer's own shard size is at most the
// largest of which whole ones fill a segment, so that its budget holds the shards it counts.
TEST_F(OptimizerTest, ItsOwnShardsFillTheHostTiersSegmentsWithWholeShards) {
  OffloadedAdamOptions o = Options("model/segment-shards");
  o.persistent = false;
  o.host_budget_bytes = 1ull << 30;  // a 24th is 42.7 MiB, more than the 16 MiB segments
  auto opt = Create(o);
  ASSERT_NE(opt, nullptr);
  EXPECT_LE(12 * opt->shard_params(), kSegment);
  EXPECT_GT(12 * (opt->shard_params() + 1024), kSegment);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  auto grads = Gradients(1, 1.0f);
  ASSERT_TRUE(opt->BeginStep().ok());
  for (size_t g : {1, 0}) {
    ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
  }
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ReferenceStep(grads, 1, 1.0f, {0, 1});
  ExpectParams(*opt, "after a step");
}

TEST_F(OptimizerTest, HostHomeStateIsPinnedOnceAndStepsWithoutDaemonCalls) {
  OffloadedAdamOptions o = Options();
  o.home = Tier::kHost;
  o.host_budget_bytes = 4 * kBudget;
  auto opt = Create(o);
  ASSERT_NE(opt, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  auto acquisitions = [&] {
    auto s = opt->client().GetSessionStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->acquired_ready + s->acquired_waited : 0;
  };
  // A step of both groups, last group first (as backward gives them), beside the reference.
  auto step = [&](int n) {
    auto grads = Gradients(n, 1.0f);
    std::vector<std::vector<uint16_t>> out;
    for (const ParamGroup& g : kGroups) out.emplace_back(g.params);
    ASSERT_TRUE(opt->BeginStep(1.0f).ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16, out[g].data(),
                                 ScalarType::kBFloat16)
                      .ok());
    }
    auto stats = opt->FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ReferenceStep(grads, n, 1.0f, {0, 1});
  };
  ASSERT_NO_FATAL_FAILURE(step(1));
  const uint64_t after_first = acquisitions();
  ASSERT_NO_FATAL_FAILURE(step(2));
  ASSERT_NO_FATAL_FAILURE(step(3));
  // Steps 2 and 3 reused the first step's pins (the state's own bytes, nothing copied aside):
  // each acquired only the meta chunk, to mark the step begun and finished (persistent state).
  EXPECT_EQ(acquisitions(), after_first + 2 * 2);
  ExpectParams(*opt, "after 3 steps on pinned host state");
  // New state written through SetState lands in the same bytes the kept pins step.
  for (float& x : params_[0]) x *= 0.5f;
  ASSERT_TRUE(opt->SetState(0, params_[0], m_[0], v_[0]).ok());
  ASSERT_NO_FATAL_FAILURE(step(4));
  ExpectParams(*opt, "a step after SetState");
}

TEST_F(OptimizerTest, ResumesItsStateAfterTheProcessAndTheDaemonStop) {
  {
    auto opt = Create(Options());
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    for (int step = 1; step <= 2; ++step) {
      auto grads = Gradients(step, 1.0f);
      {
        absl::Status begun = opt->BeginStep();
        ASSERT_TRUE(begun.ok()) << begun;
      }
      for (size_t g = 0; g < kGroups.size(); ++g) {
        ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
      }
      ASSERT_TRUE(opt->FinishStep().ok());
      ReferenceStep(grads, step, 1.0f, {0, 1});
    }
  }
  daemon_->Kill();  // no orderly shutdown: what FinishStep acknowledged must be durable
  ASSERT_TRUE(daemon_->Restart().ok()) << daemon_->Log();

  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->resumed());
  EXPECT_EQ(opt->steps_taken(), 2);
  ExpectParams(*opt, "resumed");
  auto grads = Gradients(3, 1.0f);
  {
    absl::Status begun = opt->BeginStep();
    ASSERT_TRUE(begun.ok()) << begun;
  }
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
  }
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->step, 3);  // bias correction continues from the resumed count
  ReferenceStep(grads, 3, 1.0f, {0, 1});
  ExpectParams(*opt, "a step after resuming");
}

TEST_F(OptimizerTest, Bf16MomentsStepAsTheKernelDoesAndResumeOnlyAsBf16) {
  OffloadedAdamOptions o = Options();
  o.state_type = ScalarType::kBFloat16;
  o.shard_params = 64 * 1024;
  // The reference: the kernel over each shard's bf16 moments, seeded as the optimizer seeds them
  // (group << 16 ^ shard), so the two agree bit for bit.
  std::vector<std::vector<uint16_t>> m16, v16;
  uint64_t state_bytes = 0;
  for (const ParamGroup& g : kGroups) {
    m16.emplace_back(g.params, 0);
    v16.emplace_back(g.params, 0);
    for (uint64_t first = 0; first < g.params; first += o.shard_params) {
      const uint64_t n = std::min(o.shard_params, g.params - first);
      state_bytes += (n * 4 + 4095) / 4096 * 4096 + 2 * ((n * 2 + 4095) / 4096 * 4096);
    }
  }
  kernels::ThreadPool pool(1, false);
  auto reference_step = [&](const std::vector<std::vector<uint16_t>>& grads, int step) {
    for (size_t g = 0; g < kGroups.size(); ++g) {
      for (uint64_t first = 0, k = 0; first < kGroups[g].params; first += o.shard_params, ++k) {
        const kernels::AdamTensor t{.param = params_[g].data() + first,
                                    .m = m16[g].data() + first,
                                    .v = v16[g].data() + first,
                                    .grad = grads[g].data() + first,
                                    .grad_type = kernels::DType::kBF16,
                                    .n = std::min(o.shard_params, kGroups[g].params - first),
                                    .state_type = kernels::DType::kBF16,
                                    .seed = static_cast<uint32_t>(g << 16 | k)};
        kernels::AdamStep({&t, 1}, {.lr = 1e-2, .weight_decay = 0.01}, step, pool);
      }
    }
  };
  auto step = [&](OffloadedAdam& opt, int n) {
    auto grads = Gradients(n, 1.0f);
    ASSERT_TRUE(opt.BeginStep().ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt.StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
    }
    auto stats = opt.FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->state_bytes, state_bytes);
    reference_step(grads, n);
  };
  auto expect_state = [&](OffloadedAdam& opt, const char* when) {
    for (size_t g = 0; g < kGroups.size(); ++g) {
      std::vector<float> p(kGroups[g].params), m(kGroups[g].params), v(kGroups[g].params);
      ASSERT_TRUE(opt.GetState(g, OffloadedAdam::Part::kParams, p).ok());
      ASSERT_TRUE(opt.GetState(g, OffloadedAdam::Part::kM, m).ok());
      ASSERT_TRUE(opt.GetState(g, OffloadedAdam::Part::kV, v).ok());
      for (size_t i = 0; i < p.size(); ++i) {
        ASSERT_EQ(p[i], params_[g][i]) << when << ", group " << g << ", parameter " << i;
        ASSERT_EQ(m[i], kernels::FromBF16(m16[g][i])) << when << ", group " << g << ", m " << i;
        ASSERT_EQ(v[i], kernels::FromBF16(v16[g][i])) << when << ", group " << g << ", v " << i;
      }
    }
  };
  {
    auto opt = Create(o);
    ASSERT_NE(opt, nullptr);
    EXPECT_EQ(opt->state_bytes(), state_bytes);  // two thirds of fp32 moments' 12 bytes a param
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    for (int n = 1; n <= 2; ++n) ASSERT_NO_FATAL_FAILURE(step(*opt, n));
    ASSERT_NO_FATAL_FAILURE(expect_state(*opt, "after 2 steps"));
  }
  daemon_->Kill();
  ASSERT_TRUE(daemon_->Restart().ok()) << daemon_->Log();

  OffloadedAdamOptions as_f32 = o;
  as_f32.state_type = ScalarType::kFloat32;
  auto refused = OffloadedAdam::Create(kGroups, as_f32);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("keeps m and v in bfloat16, not in float32"),
            std::string::npos)
      << refused.status();
  o.state_type = ScalarType::kFloat16;
  auto f16 = OffloadedAdam::Create(kGroups, o);
  EXPECT_EQ(f16.status().code(), absl::StatusCode::kInvalidArgument) << f16.status();
  o.state_type = ScalarType::kBFloat16;

  auto opt = Create(o);
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->resumed());
  ASSERT_NO_FATAL_FAILURE(expect_state(*opt, "resumed"));
  ASSERT_NO_FATAL_FAILURE(step(*opt, 3));
  ASSERT_NO_FATAL_FAILURE(expect_state(*opt, "a step after resuming"));

  // A checkpoint's fp32 moments load rounded to nearest bf16.
  std::vector<float> m(kGroups[1].params, 1.0f + 1.0f / 512), v(kGroups[1].params, 3.0f);
  ASSERT_TRUE(opt->SetState(1, params_[1], m, v).ok());
  std::vector<float> got(kGroups[1].params);
  ASSERT_TRUE(opt->GetState(1, OffloadedAdam::Part::kM, got).ok());
  EXPECT_EQ(got, std::vector<float>(got.size(), 1.0f));
  ASSERT_TRUE(opt->GetState(1, OffloadedAdam::Part::kV, got).ok());
  EXPECT_EQ(got, v);
}

TEST_F(OptimizerTest, RefusesStateOfOtherGroupsUnlessReset) {
  {
    auto opt = Create(Options());
    ASSERT_NE(opt, nullptr);
    ASSERT_TRUE(opt->SetParams(0, params_[0]).ok());
  }
  const std::vector<ParamGroup> other = {{"embed", 700001}, {"layer0", 500001}};
  auto refused = OffloadedAdam::Create(other, Options());
  ASSERT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("'layer0' of 500000"), std::string::npos)
      << refused.status();

  OffloadedAdamOptions reset = Options();
  reset.reset = true;
  auto fresh = OffloadedAdam::Create(other, reset);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE((*fresh)->resumed());
  EXPECT_FALSE((*fresh)->initialized(0));
  EXPECT_EQ((*fresh)->steps_taken(), 0);
}

TEST_F(OptimizerTest, AStepThatDidNotFinishIsReportedAsDataLoss) {
  {
    // Declared first: the gradients must outlive the step that reads them (the optimizer's
    // destruction ends it).
    auto grads = Gradients(1, 1.0f);
    auto opt = Create(Options());
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    {
      absl::Status begun = opt->BeginStep();
      ASSERT_TRUE(begun.ok()) << begun;
    }
    ASSERT_TRUE(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16).ok());
    // The process stops here: group 0 may be updated, group 1 is not.
  }
  auto torn = OffloadedAdam::Create(kGroups, Options());
  ASSERT_TRUE(absl::IsDataLoss(torn.status())) << torn.status();
  EXPECT_NE(torn.status().message().find("step 1 did not finish"), std::string::npos)
      << torn.status();
  OffloadedAdamOptions reset = Options();
  reset.reset = true;
  EXPECT_TRUE(OffloadedAdam::Create(kGroups, reset).ok());
}

TEST_F(OptimizerTest, AGroupsGradientsMayBeReleasedOnceItsStepIsDoneWithThem) {
  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  auto grads = Gradients(1, 1.0f);
  ASSERT_TRUE(opt->BeginStep().ok());
  // Not queued this step: nothing to wait for.
  EXPECT_EQ(opt->WaitGroup(0, absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(opt->StepGroup(1, grads[1].data(), ScalarType::kBFloat16).ok());
  // Waited for from another thread, as a framework's releasing thread does while the driving
  // thread queues the next group.
  absl::Status waited;
  std::thread releaser([&] { waited = opt->WaitGroup(1, absl::Seconds(60)); });
  ASSERT_TRUE(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16).ok());
  releaser.join();
  ASSERT_TRUE(waited.ok()) << waited;
  // Done with group 1's gradients: overwriting them now cannot change the step.
  std::fill(grads[1].begin(), grads[1].end(), kernels::ToBF16(1000.0f));
  ASSERT_TRUE(opt->WaitGroup(0, absl::Seconds(60)).ok());
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  grads = Gradients(1, 1.0f);
  ReferenceStep(grads, 1, 1.0f, {0, 1});
  ExpectParams(*opt, "gradients overwritten after WaitGroup");
  // The step is over: nothing is queued.
  EXPECT_EQ(opt->WaitGroup(1, absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(OptimizerTest, ASpeculativeStepCanBeAbandonedAndLeavesTheStateAsItWas) {
  OffloadedAdamOptions o = Options();
  o.speculative = true;
  auto opt = Create(o);
  ASSERT_NE(opt, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  auto step = [&](int n, float scale, bool finish) {
    auto grads = Gradients(n, scale);
    ASSERT_TRUE(opt->BeginStep(scale).ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
    }
    if (!finish) {
      absl::Status abandoned = opt->AbandonStep();
      ASSERT_TRUE(abandoned.ok()) << abandoned;
      return;
    }
    auto stats = opt->FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->step, n);
    ReferenceStep(grads, n, scale, {0, 1});
  };
  ASSERT_NO_FATAL_FAILURE(step(1, 1.0f, true));
  ExpectParams(*opt, "a speculative step finished");
  // Step 2 taken with gradients that turn out wrong (scaled by 8, say), abandoned, and taken again.
  ASSERT_NO_FATAL_FAILURE(step(2, 8.0f, false));
  EXPECT_EQ(opt->steps_taken(), 1);
  ExpectParams(*opt, "a step abandoned");
  std::vector<float> m(kGroups[0].params);
  ASSERT_TRUE(opt->GetState(0, OffloadedAdam::Part::kM, m).ok());
  for (size_t i = 0; i < m.size(); i += 101) ASSERT_EQ(m[i], m_[0][i]) << "m " << i;
  ASSERT_NO_FATAL_FAILURE(step(2, 1.0f, true));
  ASSERT_NO_FATAL_FAILURE(step(3, 1.0f, true));
  ExpectParams(*opt, "two steps after the abandoned one");

  // Each shard has its two versions.
  auto chunks = opt->client().ListChunks();
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  size_t first = 0, second = 0;
  for (const ChunkInfo& c : *chunks) {
    if (c.name.starts_with("model/adam/embed/")) (c.name.ends_with(".1") ? second : first)++;
  }
  EXPECT_GT(first, 1u);
  EXPECT_EQ(first, second);

  OffloadedAdamOptions in_place = Options("model/in-place");
  auto plain = Create(in_place);
  ASSERT_NE(plain, nullptr);
  ASSERT_TRUE(plain->BeginStep().ok());
  EXPECT_EQ(plain->AbandonStep().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt->AbandonStep().code(), absl::StatusCode::kFailedPrecondition);  // no step begun
}

TEST_F(OptimizerTest, ASpeculativeStepInterruptedLeavesTheStepBeforeIt) {
  OffloadedAdamOptions o = Options();
  o.speculative = true;
  {
    auto grads = Gradients(2, 1.0f);  // outlives the step the optimizer's destruction ends
    auto opt = Create(o);
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    auto first = Gradients(1, 1.0f);
    ASSERT_TRUE(opt->BeginStep().ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt->StepGroup(g, first[g].data(), ScalarType::kBFloat16).ok());
    }
    ASSERT_TRUE(opt->FinishStep().ok());
    ReferenceStep(first, 1, 1.0f, {0, 1});
    ASSERT_TRUE(opt->BeginStep().ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
    }
    // The process stops here, its second step written in part or whole to the other versions.
  }
  daemon_->Kill();
  ASSERT_TRUE(daemon_->Restart().ok()) << daemon_->Log();
  auto opt = Create(o);
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->resumed());
  EXPECT_EQ(opt->steps_taken(), 1);
  ExpectParams(*opt, "resumed after an interrupted speculative step");
  auto grads = Gradients(2, 1.0f);
  ASSERT_TRUE(opt->BeginStep().ok());
  for (size_t g : {1, 0}) {
    ASSERT_TRUE(opt->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
  }
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->step, 2);
  ReferenceStep(grads, 2, 1.0f, {0, 1});
  ExpectParams(*opt, "step 2 taken again");
}

TEST_F(OptimizerTest, AGroupWithNonFiniteGradientsIsLeftAsItWas) {
  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  auto grads = Gradients(1, 1.0f);
  grads[1][kGroups[1].params - 3] = 0x7FC0;  // NaN, in the last shard's tail
  {
    absl::Status begun = opt->BeginStep();
    ASSERT_TRUE(begun.ok()) << begun;
  }
  ASSERT_TRUE(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16).ok());
  ASSERT_TRUE(opt->StepGroup(1, grads[1].data(), ScalarType::kBFloat16).ok());
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->skipped_groups, std::vector<size_t>{1});
  ReferenceStep(grads, 1, 1.0f, {0});
  ExpectParams(*opt, "group 1 skipped");
}

// A checkpoint's round trip: the whole state read out of one optimizer and loaded into another
// (scratch, with another group's hyperparameters and a step count set) steps on identically to
// the in-memory reference with those hyperparameters.
TEST_F(OptimizerTest, StateExportedAndLoadedElsewhereStepsOnWithEachGroupsHyperparameters) {
  auto first = Create(Options("model/first"));
  ASSERT_NE(first, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetAll(*first));
  auto grads = Gradients(1, 1.0f);
  ASSERT_TRUE(first->BeginStep().ok());
  for (size_t g : {1, 0}) {
    ASSERT_TRUE(first->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
  }
  ASSERT_TRUE(first->FinishStep().ok());
  ReferenceStep(grads, 1, 1.0f, {0, 1});

  OffloadedAdamOptions o = Options("model/second");
  o.persistent = false;
  auto second = Create(o);
  ASSERT_NE(second, nullptr);
  for (size_t g = 0; g < kGroups.size(); ++g) {
    std::vector<float> p(kGroups[g].params), m(p.size()), v(p.size());
    ASSERT_TRUE(first->GetState(g, OffloadedAdam::Part::kParams, p).ok());
    ASSERT_TRUE(first->GetState(g, OffloadedAdam::Part::kM, m).ok());
    ASSERT_TRUE(first->GetState(g, OffloadedAdam::Part::kV, v).ok());
    for (size_t i = 0; i < p.size(); i += 991) {
      ASSERT_EQ(m[i], m_[g][i]) << "group " << g << " m " << i;
      ASSERT_EQ(v[i], v_[g][i]) << "group " << g << " v " << i;
    }
    ASSERT_TRUE(second->SetState(g, p, m, v).ok());
  }
  ASSERT_TRUE(second->SetStepsTaken(1).ok());
  const AdamHyperparameters other{.lr = 3e-3, .beta1 = 0.8, .weight_decay = 0.0};
  ASSERT_TRUE(second->SetGroupHyperparameters(1, other).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      second->SetGroupHyperparameters(0, {.beta2 = 1.0})));  // refused, nothing changed
  EXPECT_TRUE(absl::IsInvalidArgument(second->SetGroupHyperparameters(0, {.eps = -1e-8})));
  EXPECT_TRUE(absl::IsOutOfRange(second->SetGroupHyperparameters(2, other)));

  grads = Gradients(2, 1.0f);
  ASSERT_TRUE(second->BeginStep().ok());
  for (size_t g : {1, 0}) {
    ASSERT_TRUE(second->StepGroup(g, grads[g].data(), ScalarType::kBFloat16).ok());
  }
  auto stats = second->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->step, 2);
  ReferenceStep(grads, 2, 1.0f, {0});
  static kernels::ThreadPool pool(1, false);
  const kernels::AdamTensor t{.param = params_[1].data(),
                              .m = m_[1].data(),
                              .v = v_[1].data(),
                              .grad = grads[1].data(),
                              .grad_type = kernels::DType::kBF16,
                              .n = kGroups[1].params};
  kernels::AdamStep({&t, 1}, {.lr = 3e-3, .beta1 = 0.8, .weight_decay = 0.0}, 2, pool);
  ExpectParams(*second, "loaded state, group 1 with its own hyperparameters");
}

TEST_F(OptimizerTest, CreatingAnExistingNameOrOpeningAMissingOneIsRefused) {
  OffloadedAdamOptions open = Options("model/typo");
  open.open = OffloadedAdamOptions::Open::kOpen;
  auto missing = OffloadedAdam::Create(kGroups, open);
  ASSERT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find("nothing to resume"), std::string::npos);
  {
    OffloadedAdamOptions create = Options();
    create.open = OffloadedAdamOptions::Open::kCreate;
    auto opt = Create(create);
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
  }
  OffloadedAdamOptions create = Options();
  create.open = OffloadedAdamOptions::Open::kCreate;
  auto exists = OffloadedAdam::Create(kGroups, create);
  ASSERT_TRUE(absl::IsAlreadyExists(exists.status())) << exists.status();
  OffloadedAdamOptions resume = Options();
  resume.open = OffloadedAdamOptions::Open::kOpen;
  auto opt = Create(resume);
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->resumed());
  ExpectParams(*opt, "opened, untouched by the refused create");
  resume.reset = true;
  EXPECT_TRUE(absl::IsInvalidArgument(OffloadedAdam::Create(kGroups, resume).status()));
}

// A job that moved between nodes, or changed its number of ranks, looks for a share this daemon
// does not have: the error names the shares of the same job it does have.
TEST_F(OptimizerTest, OpeningAMissingShareNamesTheSameJobsSharesThatAreHere) {
  for (const char* made : {"job/run.rank1of2", "job/run.rank3of4", "job/other.rank0of2"}) {
    OffloadedAdamOptions create = Options(made);
    create.open = OffloadedAdamOptions::Open::kCreate;
    ASSERT_NE(Create(create), nullptr) << made;
  }
  OffloadedAdamOptions open = Options("job/run.rank0of2");
  open.open = OffloadedAdamOptions::Open::kOpen;
  auto missing = OffloadedAdam::Create(kGroups, open);
  ASSERT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find(
                "(this daemon holds 'job/run.rank1of2', 'job/run.rank3of4': the same job's state"),
            std::string::npos)
      << missing.status();
  EXPECT_EQ(missing.status().message().find("job/other"), std::string::npos) << missing.status();
  // Unsharded, the job's name alone: the shares are the same job's too.
  open.name = "job/run";
  missing = OffloadedAdam::Create(kGroups, open);
  EXPECT_NE(missing.status().message().find("'job/run.rank1of2'"), std::string::npos)
      << missing.status();
}

// One tensor of a group in memory, stepped with its own step count as the reference.
struct TensorState {
  std::vector<float> p, m, v;
  int64_t steps = 0;
  void Step(const uint16_t* grad, const kernels::AdamOptions& o) {
    static kernels::ThreadPool pool(1, false);
    const kernels::AdamTensor t{.param = p.data(),
                                .m = m.data(),
                                .v = v.data(),
                                .grad = grad,
                                .grad_type = kernels::DType::kBF16,
                                .n = p.size()};
    kernels::AdamStep({&t, 1}, o, ++steps, pool);
  }
};

// The state of tensor `t` (of `sizes`) in group `g`, read back from the optimizer.
void ExpectTensor(OffloadedAdam& opt, size_t g, const std::vector<uint64_t>& sizes, size_t t,
                  const TensorState& want, bool exact, const std::string& when) {
  uint64_t first = 0;
  for (size_t i = 0; i < t; ++i) first += sizes[i];
  uint64_t params = 0;
  for (uint64_t n : sizes) params += n;
  for (auto [part, values] :
       {std::pair{OffloadedAdam::Part::kParams, &want.p},
        std::pair{OffloadedAdam::Part::kM, &want.m}, std::pair{OffloadedAdam::Part::kV, &want.v}}) {
    std::vector<float> got(params);
    ASSERT_TRUE(opt.GetState(g, part, got).ok());
    for (size_t i = 0; i < sizes[t]; ++i) {
      const float w = (*values)[i];
      if (exact) {
        ASSERT_EQ(got[first + i], w)
            << when << ", tensor " << t << ", part " << static_cast<int>(part) << ", element " << i;
      } else {
        ASSERT_NEAR(got[first + i], w, 1e-6f * std::fabs(w) + 1e-12f)
            << when << ", tensor " << t << ", part " << static_cast<int>(part) << ", element " << i;
      }
    }
  }
}

// torch steps only the parameters that have a gradient, and counts steps per parameter: a tensor
// left out of a step keeps its weights and moments bit for bit, and is bias-corrected by its own
// count when it is next stepped. Shards holding only such a tensor are not read at all.
// fp32 weights the caller keeps anyway (a streamed unit's next version) can be the master
// weights themselves: the state holds m and v only, and a step writes the weights once.
TEST_F(OptimizerTest, AGroupWhoseMasterIsItsOutStepsTheWeightsThereAndStoresOnlyTheMoments) {
  std::vector<ParamGroup> groups = kGroups;
  for (ParamGroup& g : groups) g.master = ParamGroup::Master::kOut;
  OffloadedAdamOptions o = Options("model/out-master");
  o.persistent = false;
  o.speculative = true;
  auto created = OffloadedAdam::Create(groups, o);
  ASSERT_TRUE(created.ok()) << created.status();
  OffloadedAdam& opt = **created;
  uint64_t params = 0;
  for (const ParamGroup& g : groups) params += g.params;
  // m and v, each page-rounded per shard: 8 bytes a parameter, not 12.
  EXPECT_LE(opt.state_bytes(), 8 * params + 2 * 4096 * 64);
  EXPECT_GT(opt.state_bytes(), 8 * params);
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::Status set = opt.SetParams(g, {});  // the weights are the caller's: m and v zeroed
    ASSERT_TRUE(set.ok()) << set;
  }
  // The caller's fp32 weights, which each step receives in `out` as they are.
  std::vector<std::vector<float>> weights = params_;
  auto step = [&](int n, float scale, bool finish) {
    auto grads = Gradients(n, scale);
    std::vector<std::vector<float>> out = weights;
    const uint64_t written_before = PathBytes(opt.client(), "host_to_nvme");
    ASSERT_TRUE(opt.BeginStep(scale).ok());
    for (size_t g : {1, 0}) {
      ASSERT_TRUE(opt.StepGroup(g, grads[g].data(), ScalarType::kBFloat16, out[g].data(),
                                ScalarType::kFloat32)
                      .ok());
    }
    if (!finish) {
      absl::Status abandoned = opt.AbandonStep();
      ASSERT_TRUE(abandoned.ok()) << abandoned;
      return;  // `out` is not kept: the weights stay as they were
    }
    auto stats = opt.FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->state_bytes, opt.state_bytes());
    // Down to NVMe: the moments once (the speculative version written), no master beside them.
    const uint64_t written = PathBytes(opt.client(), "host_to_nvme") - written_before;
    EXPECT_GE(written, opt.state_bytes() - kBudget);
    EXPECT_LE(written, opt.state_bytes());
    ReferenceStep(grads, n, scale, {0, 1});
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t i = 0; i < groups[g].params; ++i) {
        ASSERT_EQ(out[g][i], params_[g][i]) << "step " << n << " group " << g << " at " << i;
      }
    }
    weights = std::move(out);
  };
  ASSERT_NO_FATAL_FAILURE(step(1, 64.0f, true));
  ASSERT_NO_FATAL_FAILURE(step(2, 8.0f, false));  // abandoned: m and v as they were
  std::vector<float> m(groups[0].params);
  ASSERT_TRUE(opt.GetState(0, OffloadedAdam::Part::kM, m).ok());
  for (size_t i = 0; i < m.size(); ++i) ASSERT_EQ(m[i], m_[0][i]) << "m " << i;
  ASSERT_NO_FATAL_FAILURE(step(2, 64.0f, true));
  ASSERT_NO_FATAL_FAILURE(step(3, 64.0f, true));

  // What such a group cannot do, refused clearly.
  std::vector<float> got(groups[0].params);
  absl::Status read = opt.GetState(0, OffloadedAdam::Part::kParams, got);
  EXPECT_TRUE(absl::IsFailedPrecondition(read)) << read;
  EXPECT_TRUE(absl::IsInvalidArgument(opt.SetParams(0, params_[0])));
  absl::Status placed = opt.SetGroupPlace(0, StepPlace::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(placed)) << placed;
  EXPECT_TRUE(absl::StrContains(placed.message(), "stepped on the host")) << placed;
  auto grads = Gradients(4, 1.0f);
  std::vector<uint16_t> out16(groups[0].params);
  ASSERT_TRUE(opt.BeginStep().ok());
  EXPECT_TRUE(absl::IsInvalidArgument(opt.StepGroup(0, grads[0].data(), ScalarType::kBFloat16,
                                                    out16.data(), ScalarType::kBFloat16)));
  EXPECT_TRUE(absl::IsInvalidArgument(opt.StepGroup(0, grads[0].data(), ScalarType::kBFloat16)));
  ASSERT_TRUE(opt.AbandonStep().ok());
  EXPECT_EQ(opt.steps_taken(), 3);
  OffloadedAdamOptions persistent = Options("model/out-master-kept");
  auto refused = OffloadedAdam::Create(groups, persistent);
  ASSERT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "persistent")) << refused.status();
}

TEST_F(OptimizerTest, ATensorLeftOutOfAStepIsUntouchedAndKeepsItsOwnStepCount) {
  const std::vector<uint64_t> sizes = {300001, 200000, 200000};
  const std::vector<ParamGroup> groups = {{"block", 700001, sizes}};
  auto created = OffloadedAdam::Create(groups, Options());
  ASSERT_TRUE(created.ok()) << created.status();
  OffloadedAdam& opt = **created;
  ASSERT_TRUE(opt.SetParams(0, params_[0]).ok());
  std::vector<TensorState> ref;
  for (size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++]) {
    ref.push_back({{params_[0].begin() + at, params_[0].begin() + at + sizes[t]},
                   std::vector<float>(sizes[t]),
                   std::vector<float>(sizes[t])});
  }
  const kernels::AdamOptions o{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  const std::vector<std::vector<uint8_t>> flags = {
      {kTensorStep, kTensorStep, kTensorStep}, {kTensorStep, 0, kTensorStep}, {}};
  std::vector<std::vector<float>> before(3, std::vector<float>(700001));
  for (int step = 1; step <= 3; ++step) {
    auto grads = Gradients(step, 1.0f);
    if (step == 2) {
      for (int part = 0; part < 3; ++part) {
        ASSERT_TRUE(opt.GetState(0, static_cast<OffloadedAdam::Part>(part), before[part]).ok());
      }
    }
    ASSERT_TRUE(opt.BeginStep().ok());
    ASSERT_TRUE(opt.StepGroup(0, GroupStep{.grad = grads[0].data(),
                                           .grad_type = ScalarType::kBFloat16,
                                           .tensors = flags[step - 1]})
                    .ok());
    auto stats = opt.FinishStep();
    ASSERT_TRUE(stats.ok()) << stats.status();
    for (size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++]) {
      if (step == 2 && t == 1) continue;
      ref[t].Step(grads[0].data() + at, o);
    }
    if (step == 2) {
      // The middle tensor's own shards (16 Ki parameters each) were neither read nor written.
      EXPECT_LT(stats->state_bytes, opt.state_bytes() - 10 * 16 * 1024 * 12);
      for (int part = 0; part < 3; ++part) {
        std::vector<float> after(700001);
        ASSERT_TRUE(opt.GetState(0, static_cast<OffloadedAdam::Part>(part), after).ok());
        for (size_t i = sizes[0]; i < sizes[0] + sizes[1]; ++i) {
          ASSERT_EQ(after[i], before[part][i]) << "part " << part << ", element " << i;
        }
      }
    }
  }
  std::vector<int64_t> steps(3);
  ASSERT_TRUE(opt.GetTensorSteps(0, steps).ok());
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 2, 3}));
  EXPECT_EQ(opt.steps_taken(), 3);
  for (size_t t = 0; t < sizes.size(); ++t) {
    ASSERT_NO_FATAL_FAILURE(ExpectTensor(opt, 0, sizes, t, ref[t], false, "after 3 steps"));
  }
  // The counts are part of the state: a checkpoint sets them, and bad ones change nothing.
  EXPECT_TRUE(absl::IsInvalidArgument(opt.SetTensorSteps(0, std::vector<int64_t>{1, 2})));
  EXPECT_TRUE(absl::IsInvalidArgument(opt.SetTensorSteps(0, std::vector<int64_t>{1, -1, 2})));
  ASSERT_TRUE(opt.SetTensorSteps(0, std::vector<int64_t>{5, 6, 7}).ok());
  created->reset();
  auto resumed = OffloadedAdam::Create(groups, Options());
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE((*resumed)->GetTensorSteps(0, steps).ok());
  EXPECT_EQ(steps, (std::vector<int64_t>{5, 6, 7}));
}

// Weights changed by the caller between steps (a clamp, a load, an averaging swap) become the
// master weights before the step: stepped from, or only taken when the tensor has no gradient.
TEST_F(OptimizerTest, WeightsTakenInAStepReplaceTheMasterWeightsFirst) {
  const std::vector<uint64_t> sizes = {400001, 150000, 150000};
  const std::vector<ParamGroup> groups = {{"block", 700001, sizes}};
  for (bool speculative : {false, true}) {
    OffloadedAdamOptions options = Options(speculative ? "spec/adam" : "model/adam");
    options.speculative = speculative;
    options.host_budget_bytes = 2 * kBudget;
    auto created = OffloadedAdam::Create(groups, options);
    ASSERT_TRUE(created.ok()) << created.status();
    OffloadedAdam& opt = **created;
    ASSERT_TRUE(opt.SetParams(0, params_[0]).ok());
    std::vector<float> edited(params_[0].size());
    for (size_t i = 0; i < edited.size(); ++i) edited[i] = std::clamp(params_[0][i], -0.5f, 0.5f);
    auto grads = Gradients(1, 1.0f);
    const std::vector<uint8_t> flags = {kTensorStep | kTensorTakeWeights, kTensorTakeWeights,
                                        kTensorStep};
    ASSERT_TRUE(opt.BeginStep().ok());
    ASSERT_TRUE(opt.StepGroup(0, GroupStep{.grad = grads[0].data(),
                                           .grad_type = ScalarType::kBFloat16,
                                           .tensors = flags,
                                           .weights = edited.data()})
                    .ok());
    ASSERT_TRUE(opt.FinishStep().ok());
    const kernels::AdamOptions o{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
    for (size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++]) {
      const std::vector<float>& from = flags[t] & kTensorTakeWeights ? edited : params_[0];
      TensorState want{{from.begin() + at, from.begin() + at + sizes[t]},
                       std::vector<float>(sizes[t]),
                       std::vector<float>(sizes[t])};
      if (flags[t] & kTensorStep) want.Step(grads[0].data() + at, o);
      ASSERT_NO_FATAL_FAILURE(ExpectTensor(opt, 0, sizes, t, want, (flags[t] & kTensorStep) == 0,
                                           speculative ? "speculative" : "in place"));
    }
    // Weights to take need weights.
    ASSERT_TRUE(opt.BeginStep().ok());
    EXPECT_TRUE(absl::IsInvalidArgument(opt.StepGroup(
        0,
        GroupStep{.grad = grads[0].data(), .grad_type = ScalarType::kBFloat16, .tensors = flags})));
    ASSERT_TRUE(opt.FinishStep().ok());
  }
}

// torch's add_param_group, and params edited between steps: groups come and go, persistent state
// records them (its meta chunk replaced by a larger one as it grows), and a Create with the
// groups as they are now, in any order, resumes them.
TEST_F(OptimizerTest, GroupsAddedAndRemovedBetweenStepsAreRecordedAndResumedByName) {
  std::vector<TensorState> ref;  // embed, layer0, then the extras
  for (size_t g = 0; g < kGroups.size(); ++g) ref.push_back({params_[g], m_[g], v_[g]});
  std::vector<ParamGroup> extras;
  for (int i = 0; i < 60; ++i) {  // enough that the meta chunk outgrows its first page
    extras.push_back({absl::StrCat("extra.", i), 1000 + static_cast<uint64_t>(i)});
    ref.push_back({std::vector<float>(extras.back().params, 0.25f + i),
                   std::vector<float>(extras.back().params),
                   std::vector<float>(extras.back().params)});
  }
  const kernels::AdamOptions o{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  auto step_all = [&](OffloadedAdam& opt, int step, const std::vector<size_t>& live) {
    std::mt19937 rng(step);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    ASSERT_TRUE(opt.BeginStep().ok());
    std::vector<std::vector<uint16_t>> grads;
    for (size_t slot = 0; slot < live.size(); ++slot) {
      std::vector<uint16_t> grad(ref[live[slot]].p.size());
      for (uint16_t& x : grad) x = kernels::ToBF16(normal(rng));
      grads.push_back(std::move(grad));
      ASSERT_TRUE(opt.StepGroup(slot, grads.back().data(), ScalarType::kBFloat16).ok());
      ref[live[slot]].Step(grads.back().data(), o);
    }
    ASSERT_TRUE(opt.FinishStep().ok());
  };
  auto chunk_names = [&](OffloadedAdam& opt) {
    std::vector<std::string> names;
    auto chunks = opt.client().ListChunks();
    EXPECT_TRUE(chunks.ok()) << chunks.status();
    for (const ChunkInfo& c : chunks.ok() ? *chunks : std::vector<ChunkInfo>{}) {
      names.push_back(c.name);
    }
    return names;
  };
  std::vector<size_t> live = {0, 1};
  {
    auto opt = Create(Options());
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    ASSERT_NO_FATAL_FAILURE(step_all(*opt, 1, live));
    ASSERT_TRUE(opt->AddGroups(extras).ok());
    EXPECT_EQ(opt->group_count(), 62u);
    for (size_t i = 0; i < extras.size(); ++i) {
      EXPECT_FALSE(opt->initialized(2 + i));
      ASSERT_TRUE(opt->SetParams(2 + i, ref[2 + i].p).ok());
      live.push_back(2 + i);
    }
    ASSERT_NO_FATAL_FAILURE(step_all(*opt, 2, live));
    ASSERT_TRUE(opt->RemoveGroups(std::vector<size_t>{0, 5}).ok());  // embed and extra.3
    live.erase(live.begin() + 5);
    live.erase(live.begin());
    ASSERT_NO_FATAL_FAILURE(step_all(*opt, 3, live));
    const std::vector<std::string> names = chunk_names(*opt);
    for (const std::string& name : names) {
      EXPECT_FALSE(absl::StartsWith(name, "model/adam/embed/")) << name;
      EXPECT_FALSE(absl::StartsWith(name, "model/adam/extra.3/")) << name;
    }
    EXPECT_TRUE(std::count(names.begin(), names.end(), "model/adam/meta.1") == 1 &&
                std::count(names.begin(), names.end(), "model/adam/meta") == 0);
    // Bad edits change nothing.
    EXPECT_TRUE(absl::IsInvalidArgument(opt->AddGroups(std::vector<ParamGroup>{{"layer0", 5}})));
    EXPECT_TRUE(absl::IsOutOfRange(opt->RemoveGroups(std::vector<size_t>{60})));
    EXPECT_TRUE(absl::IsInvalidArgument(opt->RemoveGroups(std::vector<size_t>{1, 1})));
    EXPECT_EQ(opt->group_count(), 60u);
  }
  // The groups as they are now, the added ones first: resumed.
  std::vector<ParamGroup> now;
  for (size_t i = 0; i < extras.size(); ++i) {
    if (i != 3) now.push_back(extras[i]);
  }
  now.push_back(kGroups[1]);
  auto resumed = OffloadedAdam::Create(now, Options());
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE((*resumed)->resumed());
  EXPECT_EQ((*resumed)->steps_taken(), 3);
  for (size_t slot = 0; slot < now.size(); ++slot) {
    const size_t r = slot + 1 == now.size() ? 1 : (slot < 3 ? 2 + slot : 3 + slot);
    std::vector<uint64_t> one = {ref[r].p.size()};
    ASSERT_NO_FATAL_FAILURE(ExpectTensor(**resumed, slot, one, 0, ref[r], false, now[slot].name));
  }
  resumed->reset();
  // A group it no longer has is not this state.
  auto refused = OffloadedAdam::Create(kGroups, Options());
  ASSERT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("has no group 'embed'"), std::string::npos)
      << refused.status();
}

// A run that adds groups as it goes (progressive unfreezing) resumes the way it first ran: Create
// with the first groups resumes those and keeps the rest recorded, untouched, until the same
// AddGroups resumes them.
TEST_F(OptimizerTest, GroupsAddedLaterStayRecordedAndResumeWhenAddedAgain) {
  const kernels::AdamOptions o{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled = true};
  const std::vector<ParamGroup> late = {{"late", 5000}};
  TensorState late_ref{std::vector<float>(5000, 0.5f), std::vector<float>(5000),
                       std::vector<float>(5000)};
  std::vector<TensorState> ref;
  for (size_t g = 0; g < kGroups.size(); ++g) ref.push_back({params_[g], m_[g], v_[g]});
  auto step = [&](OffloadedAdam& opt, int n, const std::vector<TensorState*>& slots) {
    std::mt19937 rng(n);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    ASSERT_TRUE(opt.BeginStep().ok());
    std::vector<std::vector<uint16_t>> grads;
    for (size_t slot = 0; slot < slots.size(); ++slot) {
      grads.emplace_back(slots[slot]->p.size());
      for (uint16_t& x : grads.back()) x = kernels::ToBF16(normal(rng));
      ASSERT_TRUE(opt.StepGroup(slot, grads.back().data(), ScalarType::kBFloat16).ok());
      slots[slot]->Step(grads.back().data(), o);
    }
    ASSERT_TRUE(opt.FinishStep().ok());
  };
  {
    auto opt = Create(Options());
    ASSERT_NE(opt, nullptr);
    ASSERT_NO_FATAL_FAILURE(SetAll(*opt));
    ASSERT_NO_FATAL_FAILURE(step(*opt, 1, {&ref[0], &ref[1]}));
    ASSERT_TRUE(opt->AddGroups(late).ok());
    ASSERT_TRUE(opt->SetParams(2, late_ref.p).ok());
    ASSERT_NO_FATAL_FAILURE(step(*opt, 2, {&ref[0], &ref[1], &late_ref}));
  }
  {
    // Given one group of three: it resumes; the other two stay as they are.
    auto opt = OffloadedAdam::Create(std::vector<ParamGroup>{kGroups[1]}, Options());
    ASSERT_TRUE(opt.ok()) << opt.status();
    EXPECT_TRUE((*opt)->resumed());
    ASSERT_NO_FATAL_FAILURE(step(**opt, 3, {&ref[1]}));
  }
  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  // Of another size, the recorded group is not this one.
  auto other = opt->AddGroups(std::vector<ParamGroup>{{"late", 4000}});
  ASSERT_TRUE(absl::IsFailedPrecondition(other)) << other;
  EXPECT_EQ(opt->group_count(), 2u);
  ASSERT_TRUE(opt->AddGroups(late).ok());
  EXPECT_TRUE(opt->initialized(2));
  std::vector<int64_t> steps(1);
  for (size_t g = 0; g < 3; ++g) {
    ASSERT_TRUE(opt->GetTensorSteps(g, steps).ok());
    EXPECT_EQ(steps[0], (std::vector<int64_t>{2, 3, 1}[g])) << g;
  }
  for (size_t g = 0; g < 3; ++g) {
    const TensorState& want = g < 2 ? ref[g] : late_ref;
    std::vector<uint64_t> one = {want.p.size()};
    ASSERT_NO_FATAL_FAILURE(ExpectTensor(*opt, g, one, 0, want, false, "resumed"));
  }
}

// torch accepts parameters with no elements (and steps their count); so do groups and tensors.
TEST_F(OptimizerTest, GroupsAndTensorsWithoutParametersAreStepped) {
  const std::vector<ParamGroup> groups = {{"empty", 0, {0}}, {"mixed", 10, {0, 10, 0}}};
  auto created = OffloadedAdam::Create(groups, Options());
  ASSERT_TRUE(created.ok()) << created.status();
  OffloadedAdam& opt = **created;
  ASSERT_TRUE(opt.SetParams(0, {}).ok());
  ASSERT_TRUE(opt.SetParams(1, std::vector<float>(10, 1.0f)).ok());
  std::vector<uint16_t> grad(10, kernels::ToBF16(0.5f));
  const std::vector<uint8_t> flags = {kTensorStep, kTensorStep, 0};
  ASSERT_TRUE(opt.BeginStep().ok());
  ASSERT_TRUE(opt.StepGroup(0, GroupStep{.grad_type = ScalarType::kBFloat16}).ok());
  ASSERT_TRUE(opt.StepGroup(1, GroupStep{.grad = grad.data(),
                                         .grad_type = ScalarType::kBFloat16,
                                         .tensors = flags})
                  .ok());
  ASSERT_TRUE(opt.FinishStep().ok());
  std::vector<int64_t> empty(1), mixed(3);
  ASSERT_TRUE(opt.GetTensorSteps(0, empty).ok());
  ASSERT_TRUE(opt.GetTensorSteps(1, mixed).ok());
  EXPECT_EQ(empty, std::vector<int64_t>{1});
  EXPECT_EQ(mixed, (std::vector<int64_t>{1, 1, 0}));
  std::vector<float> p(10);
  ASSERT_TRUE(opt.GetParams(1, p).ok());
  EXPECT_LT(p[0], 1.0f);
}

TEST_F(OptimizerTest, BadCallsFailClearlyAndChangeNothing) {
  OffloadedAdamOptions small = Options();
  small.host_budget_bytes = 1 << 20;
  small.shard_params = 1 << 20;
  auto refused = OffloadedAdam::Create(kGroups, small);
  ASSERT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("fewer than 3 shards"), std::string::npos);
  // A shard is one chunk, and a chunk never spans two of the host tier's segments.
  OffloadedAdamOptions too_large = Options();
  too_large.shard_params = 2 << 20;  // 24 MiB of state, in 16 MiB segments
  refused = OffloadedAdam::Create(kGroups, too_large);
  ASSERT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("more than the host tier's segments hold"),
            std::string::npos)
      << refused.status();
  for (const std::vector<ParamGroup>& bad :
       {std::vector<ParamGroup>{}, std::vector<ParamGroup>{{"a/b", 10}},
        std::vector<ParamGroup>{{"a", 10}, {"a", 20}}, std::vector<ParamGroup>{{"a", 10, {4, 5}}},
        std::vector<ParamGroup>{{"a", 10, {4, 7}}}}) {
    EXPECT_TRUE(absl::IsInvalidArgument(OffloadedAdam::Create(bad, Options()).status()));
  }
  OffloadedAdamOptions bad_beta = Options();
  bad_beta.hyper.beta2 = 1.0f;
  EXPECT_TRUE(absl::IsInvalidArgument(OffloadedAdam::Create(kGroups, bad_beta).status()));

  auto opt = Create(Options());
  ASSERT_NE(opt, nullptr);
  auto grads = Gradients(1, 1.0f);
  EXPECT_TRUE(
      absl::IsFailedPrecondition(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16)));
  EXPECT_TRUE(absl::IsFailedPrecondition(opt->FinishStep().status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(opt->SetParams(0, std::span<const float>(params_[0]).first(5))));
  ASSERT_TRUE(opt->SetParams(0, params_[0]).ok());
  {
    absl::Status begun = opt->BeginStep();
    ASSERT_TRUE(begun.ok()) << begun;
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(opt->BeginStep()));
  EXPECT_TRUE(absl::IsOutOfRange(opt->StepGroup(2, grads[0].data(), ScalarType::kBFloat16)));
  EXPECT_TRUE(absl::IsInvalidArgument(opt->StepGroup(0, nullptr, ScalarType::kBFloat16)));
  // Group 1 never got weights.
  auto s = opt->StepGroup(1, grads[1].data(), ScalarType::kBFloat16);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("call SetParams"), std::string::npos) << s;
  ASSERT_TRUE(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16).ok());
  EXPECT_TRUE(
      absl::IsFailedPrecondition(opt->StepGroup(0, grads[0].data(), ScalarType::kBFloat16)));
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ReferenceStep(grads, 1, 1.0f, {0});
  std::vector<float> got(kGroups[0].params);
  ASSERT_TRUE(opt->GetParams(0, got).ok());
  for (size_t i = 0; i < got.size(); i += 101) {
    ASSERT_NEAR(got[i], params_[0][i], 1e-6f * std::fabs(params_[0][i]) + 1e-12f) << i;
  }
}

}  // namespace
}  // namespace tierd
