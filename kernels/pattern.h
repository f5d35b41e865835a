// Device kernels that write and verify a position-dependent byte pattern, for end-to-end checks of
// data that lives in GPU memory (tests and benchmarks on CUDA machines).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tierd::kernels {

// The byte at position i of a pattern seeded with `seed` (also computable on the host).
inline unsigned char PatternByte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed ^ (i >> 3)) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned char>(x >> (8 * (i & 7)));
}

// Fills `bytes` at device pointer `p` with the pattern.
cudaError_t FillPattern(void* p, uint64_t bytes, uint64_t seed, cudaStream_t stream);
// Adds the number of bytes at `p` that differ from the pattern to `*mismatches` (device memory).
cudaError_t CountMismatches(const void* p, uint64_t bytes, uint64_t seed,
                            unsigned long long* mismatches, cudaStream_t stream);

}  // namespace tierd::kernels
