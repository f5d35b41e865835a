// The types of the CPU Adam kernels (kernels/cpu_adam.h), apart so that the per-instruction-set
// kernel files include nothing else.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierd::kernels {

enum class DType : uint8_t { kF32, kBF16, kF16 };

struct AdamOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  // AdamW: the decay shrinks the weights directly (p *= 1 - lr * weight_decay). Adam (false):
  // the decay is added to the gradient (g += weight_decay * p), as torch.optim.Adam does.
  bool decoupled = true;
  // Gradients arrive multiplied by this (loss scaling); the step divides it out.
  float grad_scale = 1.0f;
};

// One parameter tensor and its state. `grad` holds n values of `grad_type`; `out`, when set, gets
// the updated weights as n values of `out_type` (kBF16 or kF16).
struct AdamTensor {
  float* param = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  DType grad_type = DType::kF32;
  void* out = nullptr;
  DType out_type = DType::kBF16;
  size_t n = 0;
};

// bf16 and fp16 conversions with round-to-nearest-even, as the kernels do them (out of line, in
// adam_portable.cc: the kernels call them for the elements a vector does not fill).
uint16_t ToBF16(float x);
float FromBF16(uint16_t x);
uint16_t ToF16(float x);
float FromF16(uint16_t x);

}  // namespace tierd::kernels
