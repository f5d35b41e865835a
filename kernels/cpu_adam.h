// CPU Adam and AdamW over host-resident optimizer state: fp32 master weights, m and v, gradients
// in fp32, bf16 or fp16, and optionally the updated weights written out in bf16 or fp16 for the
// GPU. One fused pass over memory (read p, g, m, v; write p, m, v and the low-precision copy),
// vectorized with AVX-512 or AVX2 as the running CPU allows (a portable path otherwise), spread
// over a persistent pool of pinned threads.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/adam_types.h"
#include "kernels/thread_pool.h"

namespace tierd::kernels {

// Instruction sets the kernels are built for.
enum class Isa : uint8_t { kPortable, kAvx2, kAvx512 };
const char* IsaName(Isa isa);
// The best the running CPU supports.
Isa BestIsa();
bool Supported(Isa isa);

// True when every gradient is finite. A step with a non-finite gradient is usually skipped (and
// the loss scale lowered) rather than applied.
bool GradientsFinite(std::span<const AdamTensor> tensors, ThreadPool& pool, Isa isa = BestIsa());

// One step (`step` counts from 1, for bias correction) over every tensor, in place; a tensor
// whose own `step` is set uses that one instead.
// REQUIRES: Supported(isa); step >= 1; each tensor's step is 0 or >= 1.
void AdamStep(std::span<const AdamTensor> tensors, const AdamOptions& options, int64_t step,
              ThreadPool& pool, Isa isa = BestIsa());

// The memory's bound for AdamStep, for benchmarks: the same loads and stores over the same tensors
// (p, g, m, v read; p, m, v written) with one multiply-add per array instead of Adam's arithmetic.
// Changes p, m and v.
void BandwidthPass(std::span<const AdamTensor> tensors, ThreadPool& pool, Isa isa = BestIsa());

}  // namespace tierd::kernels
