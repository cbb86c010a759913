// Drops the `.grad` of variables (tch binds no way to do it, only zeroing): the next backward
// then hands each variable its gradient as computed, where a zeroed `.grad` costs one fill and
// one add kernel per variable per step (hundreds of launches for LoRA adapters). Errors come back
// as a malloc'd string (trainq_free_message, in offload.cpp).
#include <ATen/core/Tensor.h>
#include <cstdint>

#include "guarded.h"

extern "C" {

// Resets the gradient of each of the `n` tensors to undefined.
char* trainq_clear_grads(const at::Tensor* const* tensors, int64_t n) {
  return guarded([&] {
    for (int64_t i = 0; i < n; ++i) tensors[i]->mutable_grad().reset();
  });
}

}  // extern "C"
