// A C entry point to aten::_flash_attention_forward with cumulative sequence lengths (tch 0.24
// binds no *_forward op). Tensors cross the boundary as at::Tensor*, tch's own representation.
// Autograd records FlashAttentionBackward0 on the returned output, so gradients flow as for any
// other op. Errors come back as a malloc'd string for the caller to free (trainq_free_message,
// in offload.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward.h>

#include "guarded.h"

extern "C" {

// q (T, H, D), k/v (T, KV, D) with H % KV == 0; cu int32 (N+1,) on the same CUDA device.
// Writes the output (T, H, D) as a new at::Tensor* owned by the caller. Returns nullptr or an
// error message to release with trainq_free_message.
char* trainq_flash_varlen_forward(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                                  const at::Tensor* cu, int64_t max_len, at::Tensor** out) {
  return guarded([&] {
    auto result = at::_ops::_flash_attention_forward::call(
        *q, *k, *v, *cu, *cu, c10::SymInt(max_len), c10::SymInt(max_len),
        /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
        /*scale=*/std::nullopt, /*window_size_left=*/std::nullopt, /*window_size_right=*/std::nullopt,
        /*seqused_k=*/std::nullopt, /*alibi_slopes=*/std::nullopt);
    *out = new at::Tensor(std::move(std::get<0>(result)));
  });
}

}  // extern "C"
