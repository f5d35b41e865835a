// The optimizer's device lane against a real daemon with an emulated device: groups placed on the
// device step their state in the daemon's device tier, beside the host lane, and end exactly where
// the same steps on the host end (the emulated device runs the CPU kernels, so bit for bit); the
// share that balances the lanes; and what a failing link, a device too small and a daemon gone
// mid-step do to a step.
#include <signal.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/adam_types.h"
#include "testing/daemon_process.h"
#include "tierd/optimizer.hpp"

namespace tierd {
namespace {

using testing::DaemonProcess;

std::string DaemonBinary() { return testing::ExecutableDir() + "/../daemon/tierd"; }

// Two groups of several shards each (16 Ki parameters a shard), the second of two tensors.
const std::vector<ParamGroup> kGroups = {{"embed", 200001, {}},
                                         {"layer0", 150000, {100000, 50000}}};
constexpr uint64_t kBudget = 4 << 20;

std::unique_ptr<DaemonProcess> StartDaemon(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--host_capacity=64MiB",       "--host_segment_size=16MiB",
                                   "--device=emulated",           "--device_capacity=32MiB",
                                   "--device_segment_size=16MiB", "--probe_bytes=0"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto daemon = DaemonProcess::Start({.binary = DaemonBinary(), .args = args});
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  return daemon.ok() ? std::move(*daemon) : nullptr;
}

OffloadedAdamOptions Options(const DaemonProcess& daemon, const std::string& name, Tier home) {
  OffloadedAdamOptions o;
  o.client.socket_dir = daemon.socket_dir();
  o.name = name;
  o.home = home;
  o.persistent = false;
  o.host_budget_bytes = kBudget;
  o.threads = 2;
  o.hyper = {.lr = 1e-2, .weight_decay = 0.01};
  return o;
}

std::vector<float> Initial(const ParamGroup& g, int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(g.params);
  for (float& x : p) x = normal(rng);
  return p;
}

std::vector<uint16_t> Gradient(const ParamGroup& g, int step, size_t group) {
  std::mt19937 rng(100 * step + static_cast<int>(group));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> grad(g.params);
  for (uint16_t& x : grad) x = kernels::ToBF16(normal(rng) * 8.0f);
  return grad;
}

std::unique_ptr<OffloadedAdam> Create(const OffloadedAdamOptions& o) {
  auto opt = OffloadedAdam::Create(kGroups, o);
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return nullptr;
  for (size_t g = 0; g < kGroups.size(); ++g) {
    absl::Status s = (*opt)->SetParams(g, Initial(kGroups[g], 7 + static_cast<int>(g)));
    EXPECT_TRUE(s.ok()) << s;
  }
  return std::move(*opt);
}

// A step of every group with this step's gradients; `out` receives the bf16 weights. The second
// group's second tensor has no gradient in odd steps (it is left as it is, as torch leaves it),
// unless `every_tensor`.
absl::StatusOr<OptimizerStepStats> Step(OffloadedAdam& opt, int step,
                                        std::vector<std::vector<uint16_t>>& out,
                                        bool every_tensor = false) {
  if (absl::Status s = opt.BeginStep(4.0f); !s.ok()) return s;
  std::vector<std::vector<uint16_t>> grads;
  out.assign(kGroups.size(), {});
  const std::vector<uint8_t> some = {kTensorStep,
                                     static_cast<uint8_t>(every_tensor || step % 2 == 0 ? 1 : 0)};
  for (size_t g = 0; g < kGroups.size(); ++g) grads.push_back(Gradient(kGroups[g], step, g));
  for (size_t g = 0; g < kGroups.size(); ++g) {
    out[g].assign(kGroups[g].params, 0);
    GroupStep gs{.grad = grads[g].data(),
                 .grad_type = ScalarType::kBFloat16,
                 .out = out[g].data(),
                 .out_type = ScalarType::kBFloat16};
    if (g == 1) gs.tensors = some;
    if (absl::Status s = opt.StepGroup(g, gs); !s.ok()) return s;
  }
  return opt.FinishStep();
}

// Bytes the daemon has moved over path `name` ("host_to_device", ...).
uint64_t PathBytes(OffloadedAdam& opt, const char* name) {
  auto info = opt.client().GetNodeInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  const PathStatus* p = info.ok() ? info->path(name) : nullptr;
  return p == nullptr ? 0 : p->bytes;
}

// Bytes in the daemon's device tier.
uint64_t DeviceUsed(OffloadedAdam& opt) {
  auto info = opt.client().GetNodeInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  const TierStatus* t = info.ok() ? info->tier(Tier::kDevice) : nullptr;
  return t == nullptr ? ~0ull : t->used_bytes;
}

void ExpectSameState(OffloadedAdam& a, OffloadedAdam& b, const std::string& when) {
  for (size_t g = 0; g < kGroups.size(); ++g) {
    for (auto part :
         {OffloadedAdam::Part::kParams, OffloadedAdam::Part::kM, OffloadedAdam::Part::kV}) {
      std::vector<float> x(kGroups[g].params), y(kGroups[g].params);
      ASSERT_TRUE(a.GetState(g, part, x).ok());
      ASSERT_TRUE(b.GetState(g, part, y).ok());
      ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0)
          << when << ": group " << g << ", part " << static_cast<int>(part);
    }
  }
}

class DeviceLaneTest : public ::testing::TestWithParam<Tier> {};

TEST_P(DeviceLaneTest, GroupsOnTheDeviceEndWhereTheSameStepsOnTheHostEnd) {
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto host = Create(Options(*daemon, "host/adam", GetParam()));
  auto split = Create(Options(*daemon, "split/adam", GetParam()));
  ASSERT_NE(host, nullptr);
  ASSERT_NE(split, nullptr);
  // Step by step the groups move: one on the device, both, the other, none.
  const std::vector<std::vector<StepPlace>> places = {{StepPlace::kHost, StepPlace::kDevice},
                                                      {StepPlace::kDevice, StepPlace::kDevice},
                                                      {StepPlace::kDevice, StepPlace::kHost},
                                                      {StepPlace::kHost, StepPlace::kHost}};
  for (int step = 1; step <= static_cast<int>(places.size()); ++step) {
    uint64_t on_device = 0;
    for (size_t g = 0; g < kGroups.size(); ++g) {
      const StepPlace place = places[step - 1][g];
      absl::Status s = split->SetGroupPlace(g, place);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(split->group_place(g), place);
      if (place == StepPlace::kDevice) {
        on_device += g == 0 || step % 2 == 0 ? kGroups[g].params : kGroups[g].tensors[0];
      }
    }
    std::vector<std::vector<uint16_t>> out_host, out_split;
    auto a = Step(*host, step, out_host);
    const uint64_t up = PathBytes(*split, "host_to_device");
    const uint64_t down = PathBytes(*split, "device_to_host");
    auto b = Step(*split, step, out_split);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(out_host, out_split) << "step " << step;
    EXPECT_EQ(b->device_params, on_device) << "step " << step;
    EXPECT_EQ(b->host_params + b->device_params, a->host_params) << "step " << step;
    EXPECT_EQ(b->device_busy > absl::ZeroDuration(), on_device > 0);
    // The device groups' state went up to the device and back: at least their stepped bytes.
    EXPECT_GE(PathBytes(*split, "host_to_device") - up, on_device * 12) << "step " << step;
    EXPECT_GE(PathBytes(*split, "device_to_host") - down, on_device * 12) << "step " << step;
    ASSERT_NO_FATAL_FAILURE(ExpectSameState(*host, *split, absl::StrCat("step ", step)));
  }
  // Every shard went home: nothing of the optimizer's is left in the device tier.
  EXPECT_EQ(DeviceUsed(*split), 0u);
}

INSTANTIATE_TEST_SUITE_P(Homes, DeviceLaneTest, ::testing::Values(Tier::kNvme, Tier::kHost),
                         [](const auto& info) {
                           return info.param == Tier::kNvme ? std::string("Nvme")
                                                            : std::string("Host");
                         });

// State kept in the device tier between steps (device_budget_bytes): what stays is not moved over
// the link again, the steps still end where the host's end, and reading the state (after even
// steps here) or placing the groups back on the host brings it home. In place and speculative (a
// step abandoned between).
class KeptStateTest : public ::testing::TestWithParam<bool> {};

TEST_P(KeptStateTest, KeptStateCrossesTheLinkOnceAndStepsAsTheHostDoes) {
  const bool speculative = GetParam();
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  OffloadedAdamOptions o = Options(*daemon, "kept/adam", Tier::kNvme);
  o.speculative = speculative;
  o.device_budget_bytes = 64 << 20;  // all of it
  auto kept = Create(o);
  OffloadedAdamOptions half = o;
  half.name = "half/adam";
  half.device_budget_bytes = (speculative ? 2 : 1) * 150000 * 12;  // about layer0's (stepped last)
  auto some = Create(half);
  auto host = Create(Options(*daemon, "host/adam", Tier::kNvme));
  ASSERT_NE(kept, nullptr);
  ASSERT_NE(some, nullptr);
  ASSERT_NE(host, nullptr);
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(kept->SetGroupPlace(g, StepPlace::kDevice).ok());
    ASSERT_TRUE(some->SetGroupPlace(g, StepPlace::kDevice).ok());
  }
  for (int step = 1; step <= 4; ++step) {
    if (speculative && step == 4) {  // begun, partly stepped on the device, and abandoned
      ASSERT_TRUE(kept->BeginStep().ok());
      const std::vector<uint16_t> grad = Gradient(kGroups[0], 9, 0);
      ASSERT_TRUE(kept->StepGroup(0, grad.data(), ScalarType::kBFloat16).ok());
      ASSERT_TRUE(kept->AbandonStep().ok());
    }
    std::vector<std::vector<uint16_t>> out_host, out_kept, out_some;
    auto a = Step(*host, step, out_host, true);
    ASSERT_TRUE(a.ok()) << a.status();
    for (OffloadedAdam* opt : {kept.get(), some.get()}) {
      const uint64_t up = PathBytes(*opt, "host_to_device");
      const uint64_t down = PathBytes(*opt, "device_to_host");
      auto b = Step(*opt, step, opt == kept.get() ? out_kept : out_some, true);
      ASSERT_TRUE(b.ok()) << b.status();
      const uint64_t moved_up = PathBytes(*opt, "host_to_device") - up;
      const uint64_t moved_down = PathBytes(*opt, "device_to_host") - down;
      const std::string what =
          absl::StrCat(opt == kept.get() ? "all kept" : "some kept", ", step ", step);
      EXPECT_EQ(b->device_params, a->host_params) << what;
      if (opt == kept.get()) {
        EXPECT_EQ(b->device_kept_bytes, b->state_bytes) << what;
      } else {
        EXPECT_GT(b->device_kept_bytes, 0u) << what;
        EXPECT_LT(b->device_kept_bytes, b->state_bytes) << what;
      }
      // What stays crossed the link in the first step, and again after it was read; the rest
      // goes up and down each step (the version a speculative step overwrites is never brought
      // up).
      const bool read_before = step % 2 == 1;
      EXPECT_EQ(moved_up, b->state_bytes - (read_before ? 0 : b->device_kept_bytes)) << what;
      EXPECT_EQ(moved_down, b->state_bytes - b->device_kept_bytes) << what;
    }
    EXPECT_EQ(out_host, out_kept) << "step " << step;
    EXPECT_EQ(out_host, out_some) << "step " << step;
    if (step % 2 == 1) {
      EXPECT_GT(DeviceUsed(*kept), 0u) << "step " << step;
      continue;
    }
    // Read between steps, the state is the host's.
    ASSERT_NO_FATAL_FAILURE(ExpectSameState(*host, *kept, absl::StrCat("step ", step)));
    ASSERT_NO_FATAL_FAILURE(ExpectSameState(*host, *some, absl::StrCat("step ", step)));
  }
  std::vector<std::vector<uint16_t>> out_host, out_kept;
  ASSERT_TRUE(Step(*host, 5, out_host).ok());
  ASSERT_TRUE(Step(*kept, 5, out_kept).ok());
  ASSERT_TRUE(Step(*some, 5, out_kept).ok());
  EXPECT_GT(DeviceUsed(*kept), 0u);
  // Back on the host, the groups' state goes home and the device tier is left empty.
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(kept->SetGroupPlace(g, StepPlace::kHost).ok());
    ASSERT_TRUE(some->SetGroupPlace(g, StepPlace::kHost).ok());
  }
  EXPECT_EQ(DeviceUsed(*kept), 0u);
  ASSERT_TRUE(Step(*host, 6, out_host).ok());
  ASSERT_TRUE(Step(*kept, 6, out_kept).ok());
  EXPECT_EQ(out_host, out_kept);
  ASSERT_NO_FATAL_FAILURE(ExpectSameState(*host, *kept, "on the host again"));
}

INSTANTIATE_TEST_SUITE_P(InPlaceAndSpeculative, KeptStateTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? std::string("Speculative") : std::string("InPlace");
                         });

// An optimizer whose device lane may keep all of its state on the device between steps.
std::unique_ptr<OffloadedAdam> CreateKept(const DaemonProcess& daemon, const std::string& name,
                                          Tier home) {
  OffloadedAdamOptions o = Options(daemon, name, home);
  o.device_budget_bytes = 64 << 20;
  return Create(o);
}

TEST(DeviceLane, KeptStateOutgrowingTheDeviceTierIsWrittenHomeForRoom) {
  // A 2 MiB device tier under a budget for all 4 MiB of state: the daemon writes kept shards
  // home to make room for the next (so every step brings state up again), and every step still
  // ends as the host's.
  auto daemon = StartDaemon({"--device_capacity=2MiB", "--device_segment_size=2MiB"});
  ASSERT_NE(daemon, nullptr);
  auto kept = CreateKept(*daemon, "over/adam", Tier::kNvme);
  auto host = Create(Options(*daemon, "host/adam", Tier::kNvme));
  ASSERT_NE(kept, nullptr);
  ASSERT_NE(host, nullptr);
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(kept->SetGroupPlace(g, StepPlace::kDevice).ok());
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::vector<uint16_t>> out_host, out_kept;
    ASSERT_TRUE(Step(*host, step, out_host).ok());
    const uint64_t up = PathBytes(*kept, "host_to_device");
    auto b = Step(*kept, step, out_kept);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_GT(PathBytes(*kept, "host_to_device") - up, b->state_bytes / 2) << "step " << step;
    EXPECT_EQ(out_host, out_kept) << "step " << step;
  }
  ASSERT_NO_FATAL_FAILURE(ExpectSameState(*host, *kept, "step 3"));
}

TEST(DeviceLane, KeptStateIsFreedWithItsOptimizerAndRefusedForPersistentState) {
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto kept = CreateKept(*daemon, "gone/adam", Tier::kHost);
  auto other = Create(Options(*daemon, "other/adam", Tier::kHost));
  ASSERT_NE(kept, nullptr);
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(kept->SetGroupPlace(0, StepPlace::kDevice).ok());
  std::vector<std::vector<uint16_t>> out;
  ASSERT_TRUE(Step(*kept, 1, out).ok());
  EXPECT_GT(DeviceUsed(*other), 0u);
  kept.reset();  // its session ends: the scratch state, wherever it is, is freed
  EXPECT_EQ(DeviceUsed(*other), 0u);

  OffloadedAdamOptions persistent = Options(*daemon, "durable/adam", Tier::kNvme);
  persistent.persistent = true;
  persistent.device_budget_bytes = 1 << 20;
  auto refused = OffloadedAdam::Create(kGroups, persistent);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("persistent"), std::string::npos);
}

TEST(DeviceLane, AGroupKeepsItsPlaceWhenOthersAreRemovedOrAdded) {
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto opt = Create(Options(*daemon, "groups/adam", Tier::kNvme));
  ASSERT_NE(opt, nullptr);
  ASSERT_TRUE(opt->SetGroupPlace(1, StepPlace::kDevice).ok());
  ASSERT_TRUE(opt->RemoveGroups(std::vector<size_t>{0}).ok());
  EXPECT_EQ(opt->group_place(0), StepPlace::kDevice);  // "layer0", now group 0
  ASSERT_TRUE(opt->AddGroups(std::vector<ParamGroup>{{"head", 40000, {}}}).ok());
  EXPECT_EQ(opt->group_place(1), StepPlace::kHost);
  ASSERT_TRUE(opt->SetParams(1, std::vector<float>(40000, 0.5f)).ok());
  ASSERT_TRUE(opt->BeginStep().ok());
  const std::vector<uint16_t> g0 = Gradient(kGroups[1], 1, 1);
  const std::vector<float> g1(40000, 0.25f);
  ASSERT_TRUE(opt->StepGroup(0, g0.data(), ScalarType::kBFloat16).ok());
  ASSERT_TRUE(opt->StepGroup(1, g1.data(), ScalarType::kFloat32).ok());
  auto stats = opt->FinishStep();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->device_params, kGroups[1].params);
  EXPECT_EQ(stats->host_params, 40000u);
}

TEST(DeviceLane, ASpeculativeStepOnTheDeviceCanBeAbandoned) {
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  OffloadedAdamOptions o = Options(*daemon, "spec/adam", Tier::kNvme);
  o.speculative = true;
  auto spec = Create(o);
  auto host = Create(Options(*daemon, "host/adam", Tier::kNvme));
  ASSERT_NE(spec, nullptr);
  ASSERT_NE(host, nullptr);
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(spec->SetGroupPlace(g, StepPlace::kDevice).ok());
  }
  std::vector<std::vector<uint16_t>> out_a, out_b;
  ASSERT_TRUE(Step(*spec, 1, out_a).ok());
  ASSERT_TRUE(Step(*host, 1, out_b).ok());
  // Step 2 begun and abandoned: the state is step 1's.
  ASSERT_TRUE(spec->BeginStep().ok());
  const std::vector<uint16_t> grad = Gradient(kGroups[0], 2, 0);
  ASSERT_TRUE(spec->StepGroup(0, grad.data(), ScalarType::kBFloat16).ok());
  ASSERT_TRUE(spec->AbandonStep().ok());
  ASSERT_NO_FATAL_FAILURE(ExpectSameState(*spec, *host, "abandoned"));
  ASSERT_TRUE(Step(*spec, 2, out_a).ok());
  ASSERT_TRUE(Step(*host, 2, out_b).ok());
  EXPECT_EQ(out_a, out_b);
  ASSERT_NO_FATAL_FAILURE(ExpectSameState(*spec, *host, "step 2"));
}

TEST(DeviceLane, TheShareBalancesTheLanesMeasuredRates) {
  EXPECT_DOUBLE_EQ(BalancedDeviceShare(1.0, 1.0), 0.5);
  // A host three times as slow per parameter gives the device three quarters.
  EXPECT_DOUBLE_EQ(BalancedDeviceShare(3.0, 1.0), 0.75);
  EXPECT_DOUBLE_EQ(BalancedDeviceShare(1.0, 3.0), 0.25);
  EXPECT_DOUBLE_EQ(BalancedDeviceShare(0.0, 1.0), 0.0);
  EXPECT_DOUBLE_EQ(BalancedDeviceShare(1.0, 0.0), 1.0);

  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto opt = Create(Options(*daemon, "share/adam", Tier::kNvme));
  ASSERT_NE(opt, nullptr);
  std::vector<std::vector<uint16_t>> out;
  auto rate = [](absl::Duration busy, uint64_t params) {
    return absl::ToDoubleSeconds(busy) / static_cast<double>(params);
  };
  auto first = Step(*opt, 1, out);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->device_params, 0u);
  EXPECT_EQ(opt->DeviceShare(), -1) << "the device lane has not stepped yet";
  ASSERT_TRUE(opt->SetGroupPlace(1, StepPlace::kDevice).ok());
  auto second = Step(*opt, 2, out);
  ASSERT_TRUE(second.ok()) << second.status();
  // The host lane's rate is the mean of steps 1 and 2 (each step counts half); the device's is
  // step 2's, its first.
  const double host =
      (rate(first->host_busy, first->host_params) + rate(second->host_busy, second->host_params)) /
      2;
  double device = rate(second->device_busy, second->device_params);
  EXPECT_DOUBLE_EQ(opt->DeviceShare(), BalancedDeviceShare(host, device));
  // Step 3 with both groups on the device: the device rate moves halfway to step 3's.
  ASSERT_TRUE(opt->SetGroupPlace(0, StepPlace::kDevice).ok());
  auto third = Step(*opt, 3, out);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->host_params, 0u);
  device = (device + rate(third->device_busy, third->device_params)) / 2;
  EXPECT_DOUBLE_EQ(opt->DeviceShare(), BalancedDeviceShare(host, device));
}

TEST(DeviceLane, AFailingLinkFailsTheStepAndLeavesTheStateAtHomeAsItWas) {
  // The daemon's first few uploads succeed; every later one fails.
  auto daemon = StartDaemon({"--emulated_upload_failures_from=4"});
  ASSERT_NE(daemon, nullptr);
  auto split = Create(Options(*daemon, "split/adam", Tier::kNvme));
  auto host = Create(Options(*daemon, "host/adam", Tier::kNvme));
  ASSERT_NE(split, nullptr);
  ASSERT_NE(host, nullptr);
  ASSERT_TRUE(split->SetGroupPlace(0, StepPlace::kDevice).ok());
  std::vector<std::vector<uint16_t>> out;
  auto failed = Step(*split, 1, out);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("group 'embed', shard"), std::string::npos)
      << failed.status();
  EXPECT_NE(failed.status().message().find("link failed"), std::string::npos) << failed.status();
  EXPECT_EQ(split->steps_taken(), 0);
  // The shards the device stepped before the link failed went home stepped (as an in-place step
  // that fails on the host leaves them); the rest, and the host lane's group, are as a host
  // optimizer has them after the same step. Redone on the host, the step ends the same.
  ASSERT_TRUE(split->SetGroupPlace(0, StepPlace::kHost).ok());
  std::vector<std::vector<uint16_t>> out_host;
  ASSERT_TRUE(Step(*host, 1, out_host).ok());
  std::vector<float> p(kGroups[1].params), q(kGroups[1].params);
  ASSERT_TRUE(split->GetParams(1, p).ok());
  ASSERT_TRUE(host->GetParams(1, q).ok());
  EXPECT_EQ(p, q) << "the host lane's group was stepped";
  // The daemon serves on, with nothing left in its device tier.
  EXPECT_EQ(DeviceUsed(*split), 0u);
}

TEST(DeviceLane, ADeviceTooSmallForAShardFailsTheStepClearly) {
  auto daemon = StartDaemon({"--device_segment_size=8MiB"});
  ASSERT_NE(daemon, nullptr);
  OffloadedAdamOptions o = Options(*daemon, "big/adam", Tier::kHost);
  constexpr uint64_t kParams = 1 << 20;
  o.shard_params = kParams;  // a 12 MiB shard: larger than the 8 MiB device segments
  auto opt = OffloadedAdam::Create(std::vector<ParamGroup>{{"g", kParams, {}}}, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->SetParams(0, std::vector<float>(kParams, 1.0f)).ok());
  ASSERT_TRUE((*opt)->SetGroupPlace(0, StepPlace::kDevice).ok());
  const std::vector<float> grad(kParams, 0.5f);
  ASSERT_TRUE((*opt)->BeginStep().ok());
  ASSERT_TRUE((*opt)->StepGroup(0, grad.data(), ScalarType::kFloat32).ok());
  auto stats = (*opt)->FinishStep();
  ASSERT_FALSE(stats.ok());
  EXPECT_NE(stats.status().message().find("on the device"), std::string::npos) << stats.status();
  // Nothing was stepped: on the host the step goes through.
  ASSERT_TRUE((*opt)->SetGroupPlace(0, StepPlace::kHost).ok());
  std::vector<float> p(kParams);
  ASSERT_TRUE((*opt)->GetParams(0, p).ok());
  EXPECT_EQ(p[12345], 1.0f);
  ASSERT_TRUE((*opt)->BeginStep().ok());
  ASSERT_TRUE((*opt)->StepGroup(0, grad.data(), ScalarType::kFloat32).ok());
  EXPECT_TRUE((*opt)->FinishStep().ok());
}

TEST(DeviceLane, ADaemonGoneMidStepFailsTheStepWithoutHanging) {
  // 4 MiB of state each way at 5 MB/s: stopped well before the step is done.
  auto daemon = StartDaemon({"--emulated_gbps=0.005"});
  ASSERT_NE(daemon, nullptr);
  auto opt = Create(Options(*daemon, "gone/adam", Tier::kNvme));
  ASSERT_NE(opt, nullptr);
  for (size_t g = 0; g < kGroups.size(); ++g) {
    ASSERT_TRUE(opt->SetGroupPlace(g, StepPlace::kDevice).ok());
  }
  std::vector<std::vector<uint16_t>> out;
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(200));
    daemon->Kill();
  });
  const absl::Time start = absl::Now();
  auto stats = Step(*opt, 1, out);
  killer.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsUnavailable(stats.status())) << stats.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
}

TEST(DeviceLane, PlacesAreRefusedClearlyWhereTheyCannotBe) {
  auto daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  auto opt = Create(Options(*daemon, "bad/adam", Tier::kNvme));
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(absl::IsOutOfRange(opt->SetGroupPlace(2, StepPlace::kDevice)));
  EXPECT_TRUE(absl::IsInvalidArgument(opt->SetGroupPlace(0, static_cast<StepPlace>(7))));
  ASSERT_TRUE(opt->BeginStep().ok());
  absl::Status during = opt->SetGroupPlace(0, StepPlace::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(during)) << during;
  ASSERT_TRUE(opt->FinishStep().ok());
  EXPECT_EQ(opt->group_place(0), StepPlace::kHost);

  OffloadedAdamOptions bf16 = Options(*daemon, "bf16/adam", Tier::kNvme);
  bf16.state_type = ScalarType::kBFloat16;
  auto b = Create(bf16);
  ASSERT_NE(b, nullptr);
  absl::Status s = b->SetGroupPlace(0, StepPlace::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("fp32 moments"), std::string::npos) << s;

  auto none = DaemonProcess::Start({.binary = DaemonBinary(),
                                    .args = {"--host_capacity=64MiB", "--host_segment_size=16MiB",
                                             "--device=none", "--probe_bytes=0"}});
  ASSERT_TRUE(none.ok()) << none.status();
  auto c = Create(Options(**none, "none/adam", Tier::kNvme));
  ASSERT_NE(c, nullptr);
  s = c->SetGroupPlace(0, StepPlace::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("device tier"), std::string::npos) << s;
  EXPECT_EQ(c->group_place(0), StepPlace::kHost);
}

}  // namespace
}  // namespace tierd
