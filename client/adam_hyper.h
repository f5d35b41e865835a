// The Adam hyperparameters cross three boundaries, each mapped in one function here: the C ABI's
// tierd_adam_hyper to and from the public C++ AdamHyperparameters, and those to the kernels'
// AdamOptions (with the step's loss scale). Python fills the ctypes mirror of the C struct in one
// place too (python/tierd/torch.py, _hyper).
#pragma once

#include "kernels/adam_types.h"
#include "tierd/client.h"
#include "tierd/optimizer.hpp"

namespace tierd {

inline AdamHyperparameters FromC(const tierd_adam_hyper& h) {
  return {.lr = h.lr,
          .beta1 = h.beta1,
          .beta2 = h.beta2,
          .eps = h.eps,
          .weight_decay = h.weight_decay,
          .adamw = h.adamw != 0};
}

inline tierd_adam_hyper ToC(const AdamHyperparameters& h) {
  return {.lr = h.lr,
          .beta1 = h.beta1,
          .beta2 = h.beta2,
          .eps = h.eps,
          .weight_decay = h.weight_decay,
          .adamw = h.adamw ? 1 : 0};
}

inline kernels::AdamOptions KernelOptions(const AdamHyperparameters& h, double grad_scale) {
  return {.lr = h.lr,
          .beta1 = h.beta1,
          .beta2 = h.beta2,
          .eps = h.eps,
          .weight_decay = h.weight_decay,
          .decoupled = h.adamw,
          .grad_scale = grad_scale};
}

}  // namespace tierd
