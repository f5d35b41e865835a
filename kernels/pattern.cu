#include "kernels/pattern.h"

namespace tierd::kernels {
namespace {

__device__ unsigned char DevicePatternByte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed ^ (i >> 3)) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned char>(x >> (8 * (i & 7)));
}

__global__ void FillKernel(unsigned char* p, uint64_t bytes, uint64_t seed) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    p[i] = DevicePatternByte(seed, i);
  }
}

__global__ void CheckKernel(const unsigned char* p, uint64_t bytes, uint64_t seed,
                            unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    bad += p[i] != DevicePatternByte(seed, i);
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;

}  // namespace

cudaError_t FillPattern(void* p, uint64_t bytes, uint64_t seed, cudaStream_t stream) {
  FillKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<unsigned char*>(p), bytes, seed);
  return cudaGetLastError();
}

cudaError_t CountMismatches(const void* p, uint64_t bytes, uint64_t seed,
                            unsigned long long* mismatches, cudaStream_t stream) {
  CheckKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const unsigned char*>(p), bytes, seed,
                                                mismatches);
  return cudaGetLastError();
}

}  // namespace tierd::kernels
