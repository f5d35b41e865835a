#include "daemon/chunks/path_meter.h"

#include <algorithm>
#include <cmath>

namespace tierd::daemon {

PathMeter::PathMeter() {
  meters_[Path::kNvmeToHost].bytes_per_second = 2e9;
  meters_[Path::kHostToNvme].bytes_per_second = 1.5e9;
  meters_[Path::kHostToDevice].bytes_per_second = 20e9;
  meters_[Path::kDeviceToHost].bytes_per_second = 20e9;
}

void PathMeter::Started(Path path, ChunkId id, uint64_t bytes, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Meter& m = meters_[path];
  if (m.in_flight++ == 0) {
    m.window_start = now;
    m.window_bytes = 0;
  }
  m.started[id] = {now, m.queued_bytes};
  m.queued_bytes += bytes;
}

void PathMeter::Done(Path path, ChunkId id, uint64_t bytes, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Meter& m = meters_[path];
  m.queued_bytes -= std::min(m.queued_bytes, bytes);
  m.window_bytes += bytes;
  m.bytes_total += bytes;
  ++m.moves_total;
  m.in_flight = std::max(m.in_flight - 1, 0);
  // How long the move took (the transfer-latency histogram), and how much of that its bytes and
  // those in flight ahead of it at the path's bandwidth do not account for: the latency, as mean
  // and mean deviation, the way TCP estimates round trips (plans use mean + 4 deviations). A
  // move queued behind others is slow for their bytes, which plans count already.
  if (auto started = m.started.find(id); started != m.started.end()) {
    const double took = absl::ToDoubleSeconds(now - started->second.at);
    transfer_seconds_[path].Observe(took);
    const double streamed = static_cast<double>(started->second.ahead + bytes) / m.bytes_per_second;
    const double sample = std::max(0.0, took - streamed);
    if (m.latency_seconds < 0) {
      m.latency_seconds = sample;
      m.latency_deviation = sample / 2;
    } else {
      m.latency_deviation =
          0.75 * m.latency_deviation + 0.25 * std::abs(sample - m.latency_seconds);
      m.latency_seconds = 0.875 * m.latency_seconds + 0.125 * sample;
    }
    m.started.erase(started);
  }
  // A sample per busy period, or every 20 ms of a long one; short ones say more about latency.
  const absl::Duration busy = now - m.window_start;
  if ((m.in_flight == 0 && busy >= absl::Milliseconds(1)) || busy >= absl::Milliseconds(20)) {
    const double sample = static_cast<double>(m.window_bytes) / absl::ToDoubleSeconds(busy);
    m.bytes_per_second = m.measured ? 0.7 * m.bytes_per_second + 0.3 * sample : sample;
    m.measured = true;
    m.window_start = now;
    m.window_bytes = 0;
  }
}

void PathMeter::Seed(const PathArray<double>& bytes_per_second) {
  absl::MutexLock lock(&mu_);
  for (Path p : kAllPaths) {
    if (bytes_per_second[p] <= 0) continue;
    meters_[p].probed = bytes_per_second[p];
    meters_[p].bytes_per_second = bytes_per_second[p];
    meters_[p].measured = true;
  }
}

PathArray<PathStatus> PathMeter::Status() const {
  absl::MutexLock lock(&mu_);
  PathArray<PathStatus> out;
  for (Path p : kAllPaths) {
    const Meter& m = meters_[p];
    out[p] = PathStatus{.path = p,
                        .bytes = m.bytes_total,
                        .moves = m.moves_total,
                        .bytes_per_second = m.bytes_per_second,
                        .measured = m.measured,
                        .probed_bytes_per_second = m.probed};
  }
  return out;
}

PathArray<PathLoad> PathMeter::Load() const {
  absl::MutexLock lock(&mu_);
  PathArray<PathLoad> out;
  for (Path p : kAllPaths) {
    const Meter& m = meters_[p];
    out[p] =
        PathLoad{.bytes_per_second = m.bytes_per_second,
                 .queued_bytes = m.queued_bytes,
                 .in_flight = m.in_flight,
                 .slow_latency = m.latency_seconds < 0
                                     ? absl::ZeroDuration()
                                     : absl::Seconds(m.latency_seconds + 4 * m.latency_deviation)};
  }
  return out;
}

}  // namespace tierd::daemon
