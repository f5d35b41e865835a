// The types of the CPU Adam kernels (kernels/cpu_adam.h), apart so that the per-instruction-set
// kernel files include nothing else.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierd::kernels {

enum class DType : uint8_t { kF32, kBF16, kF16 };

// Hyperparameters in double, as the frameworks keep them: 1 - beta2 computed from a float beta2
// of 0.999 is 0.00099998713, 1.3e-5 off the intended 0.001. The kernels get each constant rounded
// once to float (MakeAdamConsts).
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // AdamW: the decay shrinks the weights directly (p *= 1 - lr * weight_decay). Adam (false):
  // the decay is added to the gradient (g += weight_decay * p), as torch.optim.Adam does.
  bool decoupled = true;
  // Gradients arrive multiplied by this (loss scaling); the step divides it out.
  double grad_scale = 1.0;
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
