// Internal: the greedy id of each row of a CUDA tensor of logits, in one kernel (cuda/greedy.cu;
// CUDA builds only). ATen's max over a row of a large vocabulary, and the finiteness check after
// it, took 60 us of a Llama-3.2-1B decode step under ncu (five kernels, outside the step's graph).
// Measured on an H200 (bench --generate --variant CUSTOMOPS_GREEDY_KERNEL=0, 16 layers, batch 1):
// 0.98 ms a token against 1.00 with ATen's.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace customops {

// logits [B, vocab] (float, half or bfloat16) on a CUDA device: (ids, the same ids with -1 where a
// row's largest logit is not finite), both int64 [B], as sample() gives them for greedy decoding.
// An id is the first position of its row's largest value, as at::max gives it.
std::pair<at::Tensor, at::Tensor> greedy_cuda(const at::Tensor& logits);

}  // namespace customops
