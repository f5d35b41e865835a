#include "kernels/gpu_adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/adam_impl.h"

namespace tierd::kernels {
namespace {

// A launch's tensors and the (tensor, slice) each block updates, passed as the kernel's parameter
// (3 KiB, within the 4 KiB every CUDA version accepts).
constexpr int kMaxTensors = 32;
constexpr int kMaxBlocks = 320;
constexpr uint64_t kSlice = 64 * 1024;  // elements per block
constexpr int kThreads = 512;

struct TensorTable {
  float* param[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  const void* grad[kMaxTensors];
  void* out[kMaxTensors];
  uint64_t n[kMaxTensors];
  uint32_t block_slice[kMaxBlocks];
  uint8_t block_tensor[kMaxBlocks];
};

template <DType G>
__device__ __forceinline__ float LoadGrad(const void* grad, uint64_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBF16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(grad)[i]);
  } else {
    return __half2float(static_cast<const __half*>(grad)[i]);
  }
}

// Four gradients from a 4-aligned index: one 16-byte load (fp32) or one 8-byte load (16-bit).
template <DType G>
__device__ __forceinline__ float4 LoadGrad4(const void* grad, uint64_t i) {
  if constexpr (G == DType::kF32) {
    return reinterpret_cast<const float4*>(grad)[i / 4];
  } else {
    const uint2 raw = reinterpret_cast<const uint2*>(grad)[i / 4];
    const uint16_t h[4] = {static_cast<uint16_t>(raw.x), static_cast<uint16_t>(raw.x >> 16),
                           static_cast<uint16_t>(raw.y), static_cast<uint16_t>(raw.y >> 16)};
    float f[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (G == DType::kBF16) {
        f[k] = __bfloat162float(__ushort_as_bfloat16(h[k]));
      } else {
        f[k] = __half2float(__ushort_as_half(h[k]));
      }
    }
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

template <DType O>
__device__ __forceinline__ uint16_t ToOut(float p) {
  if constexpr (O == DType::kF16) {
    return __half_as_ushort(__float2half_rn(p));
  } else {
    return __bfloat16_as_ushort(__float2bfloat16_rn(p));
  }
}

// The same arithmetic, in the same order, as the CPU kernels' ScalarUpdate.
__device__ __forceinline__ void Update(float& p, float& m, float& v, float g, const AdamConsts& c) {
  g = g * c.inv_scale;
  g = fmaf(c.l2, p, g);
  p = p * c.decay_mult;
  m = fmaf(c.b1, m, c.one_minus_b1 * g);
  v = fmaf(c.b2, v, c.one_minus_b2 * (g * g));
  const float denom = fmaf(sqrtf(v), c.inv_sqrt_bc2, c.eps);
  p = __fsub_rn(p, __fmul_rn(c.step_size, __fdiv_rn(m, denom)));  // not contracted to an fma
}

__device__ __forceinline__ bool Aligned(const void* p, uintptr_t a) {
  return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0;
}

template <DType G, DType O>
__global__ void __launch_bounds__(kThreads) AdamKernel(TensorTable t, AdamConsts c) {
  const int k = t.block_tensor[blockIdx.x];
  const uint64_t begin = static_cast<uint64_t>(t.block_slice[blockIdx.x]) * kSlice;
  const uint64_t end = min(begin + kSlice, t.n[k]);
  float* const param = t.param[k];
  float* const m = t.m[k];
  float* const v = t.v[k];
  const void* const grad = t.grad[k];
  uint16_t* const out = static_cast<uint16_t*>(t.out[k]);
  const uintptr_t grad_align = G == DType::kF32 ? 16 : 8;
  const bool vectors = Aligned(param, 16) && Aligned(m, 16) && Aligned(v, 16) &&
                       Aligned(grad, grad_align) && (out == nullptr || Aligned(out, 8));
  uint64_t scalar_begin = begin;
  if (vectors) {
    const uint64_t vector_end = begin + (end - begin) / 4 * 4;
    for (uint64_t i = begin + threadIdx.x * 4; i < vector_end; i += kThreads * 4) {
      float4 p = reinterpret_cast<float4*>(param)[i / 4];
      float4 m4 = reinterpret_cast<float4*>(m)[i / 4];
      float4 v4 = reinterpret_cast<float4*>(v)[i / 4];
      const float4 g = LoadGrad4<G>(grad, i);
      Update(p.x, m4.x, v4.x, g.x, c);
      Update(p.y, m4.y, v4.y, g.y, c);
      Update(p.z, m4.z, v4.z, g.z, c);
      Update(p.w, m4.w, v4.w, g.w, c);
      reinterpret_cast<float4*>(param)[i / 4] = p;
      reinterpret_cast<float4*>(m)[i / 4] = m4;
      reinterpret_cast<float4*>(v)[i / 4] = v4;
      if (out != nullptr) {
        const uint2 packed =
            make_uint2(ToOut<O>(p.x) | (static_cast<uint32_t>(ToOut<O>(p.y)) << 16),
                       ToOut<O>(p.z) | (static_cast<uint32_t>(ToOut<O>(p.w)) << 16));
        reinterpret_cast<uint2*>(out)[i / 4] = packed;
      }
    }
    scalar_begin = vector_end;
  }
  for (uint64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) {
    float p = param[i], mi = m[i], vi = v[i];
    Update(p, mi, vi, LoadGrad<G>(grad, i), c);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (out != nullptr) out[i] = ToOut<O>(p);
  }
}

template <DType G>
__global__ void __launch_bounds__(kThreads) FiniteKernel(TensorTable t, int* all_finite) {
  const int k = t.block_tensor[blockIdx.x];
  const uint64_t begin = static_cast<uint64_t>(t.block_slice[blockIdx.x]) * kSlice;
  const uint64_t end = min(begin + kSlice, t.n[k]);
  bool finite = true;
  for (uint64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    finite = finite && isfinite(LoadGrad<G>(t.grad[k], i));
  }
  if (__syncthreads_or(!finite) && threadIdx.x == 0) *all_finite = 0;
}

// Packs the tensors into tables of at most kMaxTensors tensors and kMaxBlocks slices and calls
// launch(table, blocks) for each; a tensor with more slices than a table holds spans several.
template <typename Launch>
cudaError_t ForEachTable(const GpuAdamTensor* tensors, size_t count, Launch launch) {
  TensorTable table{};
  int entries = 0, blocks = 0;
  auto flush = [&]() -> cudaError_t {
    if (blocks == 0) return cudaSuccess;
    launch(table, blocks);
    entries = blocks = 0;
    return cudaGetLastError();
  };
  for (size_t i = 0; i < count; ++i) {
    const GpuAdamTensor& tensor = tensors[i];
    const uint64_t slices = (tensor.n + kSlice - 1) / kSlice;
    for (uint64_t s = 0; s < slices; ++s) {
      if (entries == kMaxTensors || blocks == kMaxBlocks) {
        if (cudaError_t e = flush(); e != cudaSuccess) return e;
      }
      if (s == 0 || blocks == 0) {  // the tensor's entry, new or repeated in a new table
        table.param[entries] = tensor.param;
        table.m[entries] = tensor.m;
        table.v[entries] = tensor.v;
        table.grad[entries] = tensor.grad;
        table.out[entries] = tensor.out;
        table.n[entries] = tensor.n;
        ++entries;
      }
      table.block_tensor[blocks] = static_cast<uint8_t>(entries - 1);
      table.block_slice[blocks] = static_cast<uint32_t>(s);
      ++blocks;
    }
  }
  return flush();
}

template <DType G>
cudaError_t StepWithGrad(const GpuAdamTensor* tensors, size_t count, DType out_type,
                         const AdamConsts& c, cudaStream_t stream) {
  return ForEachTable(tensors, count, [&](const TensorTable& table, int blocks) {
    if (out_type == DType::kF16) {
      AdamKernel<G, DType::kF16><<<blocks, kThreads, 0, stream>>>(table, c);
    } else {
      AdamKernel<G, DType::kBF16><<<blocks, kThreads, 0, stream>>>(table, c);
    }
  });
}

}  // namespace

cudaError_t GpuAdamStep(const GpuAdamTensor* tensors, size_t count, DType grad_type, DType out_type,
                        const AdamOptions& options, int64_t step, cudaStream_t stream) {
  if (step < 1) return cudaErrorInvalidValue;
  const AdamConsts c = MakeAdamConsts(options, step);
  switch (grad_type) {
    case DType::kF32:
      return StepWithGrad<DType::kF32>(tensors, count, out_type, c, stream);
    case DType::kBF16:
      return StepWithGrad<DType::kBF16>(tensors, count, out_type, c, stream);
    case DType::kF16:
      return StepWithGrad<DType::kF16>(tensors, count, out_type, c, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t GpuGradientsFinite(const GpuAdamTensor* tensors, size_t count, DType grad_type,
                               int* all_finite, cudaStream_t stream) {
  return ForEachTable(tensors, count, [&](const TensorTable& table, int blocks) {
    switch (grad_type) {
      case DType::kF32:
        FiniteKernel<DType::kF32><<<blocks, kThreads, 0, stream>>>(table, all_finite);
        break;
      case DType::kBF16:
        FiniteKernel<DType::kBF16><<<blocks, kThreads, 0, stream>>>(table, all_finite);
        break;
      case DType::kF16:
        FiniteKernel<DType::kF16><<<blocks, kThreads, 0, stream>>>(table, all_finite);
        break;
    }
  });
}

}  // namespace tierd::kernels
