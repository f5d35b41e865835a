// The tierd demo: an offloaded training loop. A linear model of 100 M parameters (6144 outputs x
// 16384 inputs) is fitted by AdamW to a fixed batch. Its optimizer state — fp32 master weights, m
// and v, 1.2 GB, more than the daemon's whole host tier by default — lives on NVMe through the
// daemon and streams through a 256 MiB host budget each step. Backward hands each group of rows'
// gradients to the optimizer as soon as they are computed, so the optimizer works on early groups
// while later ones are still being computed. The state is persistent: a second run resumes it.
//
//   tierd-demo [SOCKET_DIR] [--iterations=8] [--reset]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tierd/optimizer.hpp"

namespace {

constexpr int kInputs = 16384;
constexpr int kOutputs = 6144;
constexpr int kBatch = 16;
constexpr int kRowsPerGroup = 512;  // 8.4 M parameters per group, 12 groups

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "demo: %s failed: %s\n", what, s.ToString().c_str());
  return 1;
}

std::string Gb(double bytes) { return absl::StrFormat("%.2f GB", bytes / 1e9); }

// Deterministic inputs in [-1, 1) and the target: a fixed linear map of them.
float Input(int b, int j) {
  const uint32_t h = static_cast<uint32_t>(b * 2654435761u) ^ static_cast<uint32_t>(j * 40503u);
  return static_cast<float>((h * 2246822519u) >> 8) / 8388608.0f - 1.0f;
}

// Runs fn(lo, hi) over [0, n) on two threads.
template <typename F>
void Parallel(int n, F fn) {
  std::thread other([&] { fn(n / 2, n); });
  fn(0, n / 2);
  other.join();
}

uint64_t PathBytes(tierd::Client& c, const char* name) {
  absl::StatusOr<tierd::NodeInfo> info = c.GetNodeInfo();
  if (!info.ok()) return 0;
  const tierd::PathStatus* p = info->path(name);
  return p == nullptr ? 0 : p->bytes;
}

}  // namespace

int main(int argc, char** argv) {
  tierd::OffloadedAdamOptions options;
  options.client.client_name = "tierd-demo";
  options.name = "demo/linear-adamw";
  options.home = tierd::Tier::kNvme;
  options.host_budget_bytes = 256ull << 20;
  options.hyper = {.lr = 2e-5, .weight_decay = 0.0};
  int iterations = 8;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--iterations=", 0) == 0) {
      if (!absl::SimpleAtoi(a.substr(13), &iterations) || iterations < 1) return 2;
    } else if (a == "--reset") {
      options.reset = true;
    } else {
      options.client.socket_dir = a;
    }
  }

  std::vector<tierd::ParamGroup> groups;
  for (int r = 0; r < kOutputs; r += kRowsPerGroup) {
    groups.push_back({absl::StrCat("rows", r), static_cast<uint64_t>(kRowsPerGroup) * kInputs});
  }
  const uint64_t params = static_cast<uint64_t>(kOutputs) * kInputs;
  const absl::Time start = absl::Now();
  auto created = tierd::OffloadedAdam::Create(groups, options);
  if (!created.ok()) return Fail(created.status(), "creating the optimizer");
  tierd::OffloadedAdam& opt = **created;
  absl::StatusOr<tierd::NodeInfo> node = opt.client().GetNodeInfo();
  if (!node.ok()) return Fail(node.status(), "GetNodeInfo");
  const tierd::TierStatus* host = node->tier(tierd::Tier::kHost);
  std::printf(
      "model: linear %d x %d, %.1f M parameters in %zu groups; AdamW state %s on NVMe, "
      "host budget %s (the host tier holds %s)\n",
      kOutputs, kInputs, params / 1e6, groups.size(), Gb(opt.state_bytes()).c_str(),
      Gb(options.host_budget_bytes).c_str(),
      host == nullptr ? "?" : Gb(host->capacity_bytes).c_str());

  // The fp32 weights the forward pass uses: the optimizer writes each step's new ones into them.
  std::vector<float> weights(params, 0.0f);
  if (opt.resumed()) {
    std::printf("resumed the optimizer state of an earlier run at step %lld\n",
                static_cast<long long>(opt.steps_taken()));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    std::span<float> rows(weights.data() + g * groups[g].params, groups[g].params);
    absl::Status s = opt.initialized(g) ? opt.GetParams(g, rows) : opt.SetParams(g, rows);
    if (!s.ok()) return Fail(s, "loading the weights");
  }

  std::vector<float> x(static_cast<size_t>(kBatch) * kInputs), y(kBatch * kOutputs);
  for (int b = 0; b < kBatch; ++b) {
    for (int j = 0; j < kInputs; ++j) x[b * kInputs + j] = Input(b, j);
    for (int i = 0; i < kOutputs; ++i) {  // y = 0.5 x[i] - 0.25 x[i + 6144] + 0.1 x[i + 12288]
      const int k = i + 2 * kOutputs < kInputs ? i + 2 * kOutputs : i;
      y[b * kOutputs + i] = 0.5f * x[b * kInputs + i] - 0.25f * x[b * kInputs + i + kOutputs] +
                            0.1f * x[b * kInputs + k];
    }
  }
  std::vector<float> grads(params), err(kBatch * kOutputs);
  const uint64_t read0 = PathBytes(opt.client(), "nvme_to_host");
  const uint64_t written0 = PathBytes(opt.client(), "host_to_nvme");
  const absl::Time loop_start = absl::Now();
  double optimizer_wait_s = 0, stall_s = 0;
  std::printf("%-6s %-12s %-9s %-22s %s\n", "step", "loss", "time", "optimizer after backward",
              "waiting for state");
  for (int it = 0; it < iterations; ++it) {
    const absl::Time t0 = absl::Now();
    // Forward: err = W x - y; loss = mean over the batch of |err|^2 / 2.
    double loss = 0;
    Parallel(kOutputs, [&](int lo, int hi) {
      for (int i = lo; i < hi; ++i) {
        const float* w = &weights[static_cast<size_t>(i) * kInputs];
        for (int b = 0; b < kBatch; ++b) {
          const float* xb = &x[b * kInputs];
          float dot = 0;
          for (int j = 0; j < kInputs; ++j) dot += w[j] * xb[j];
          err[b * kOutputs + i] = dot - y[b * kOutputs + i];
        }
      }
    });
    for (float e : err) loss += 0.5 * e * e / kBatch;
    // Backward, one group of rows at a time: dW = err x^T / batch, handed to the optimizer at once.
    if (absl::Status s = opt.BeginStep(); !s.ok()) return Fail(s, "BeginStep");
    for (size_t g = groups.size(); g-- > 0;) {  // the last layer's gradients come first
      const int r0 = static_cast<int>(g) * kRowsPerGroup;
      Parallel(kRowsPerGroup, [&](int lo, int hi) {
        for (int i = r0 + lo; i < r0 + hi; ++i) {
          float* gw = &grads[static_cast<size_t>(i) * kInputs];
          std::fill(gw, gw + kInputs, 0.0f);
          for (int b = 0; b < kBatch; ++b) {
            const float a = err[b * kOutputs + i] / kBatch;
            const float* xb = &x[b * kInputs];
            for (int j = 0; j < kInputs; ++j) gw[j] += a * xb[j];
          }
        }
      });
      float* rows = &grads[g * groups[g].params];
      if (absl::Status s =
              opt.StepGroup(g, rows, tierd::ScalarType::kFloat32, &weights[g * groups[g].params],
                            tierd::ScalarType::kFloat32);
          !s.ok()) {
        return Fail(s, "StepGroup");
      }
    }
    const absl::Time backward_done = absl::Now();
    absl::StatusOr<tierd::OptimizerStepStats> stats = opt.FinishStep();
    if (!stats.ok()) return Fail(stats.status(), "FinishStep");
    const double wait = absl::ToDoubleSeconds(absl::Now() - backward_done);
    optimizer_wait_s += wait;
    stall_s += absl::ToDoubleSeconds(stats->state_wait);
    std::printf("%-6lld %-12.6f %-9s %-22s %.2f s\n", static_cast<long long>(stats->step), loss,
                absl::StrFormat("%.2f s", absl::ToDoubleSeconds(absl::Now() - t0)).c_str(),
                absl::StrFormat("%.2f s", wait).c_str(), absl::ToDoubleSeconds(stats->state_wait));
  }
  const double loop_s = absl::ToDoubleSeconds(absl::Now() - loop_start);
  const double read = static_cast<double>(PathBytes(opt.client(), "nvme_to_host") - read0);
  const double written = static_cast<double>(PathBytes(opt.client(), "host_to_nvme") - written0);
  std::printf(
      "summary: %d steps in %.1f s (%.2f s per step, %.0f M parameters updated per second); NVMe "
      "read %s, written %s (%.2f GB/s both ways); per step, the optimizer's tail after backward "
      "%.2f s and its wait for state %.2f s; total run %.1f s\n",
      iterations, loop_s, loop_s / iterations, params * iterations / loop_s / 1e6, Gb(read).c_str(),
      Gb(written).c_str(), (read + written) / loop_s / 1e9, optimizer_wait_s / iterations,
      stall_s / iterations, absl::ToDoubleSeconds(absl::Now() - start));
  return 0;
}
