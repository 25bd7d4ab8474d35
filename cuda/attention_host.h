// Host-side helpers of the attention kernels' launchers (cuda/attention.cu, cuda/cache_attention.cu):
// how a [B, H, S, D] tensor is handed to a kernel that reads rows of D with 16-byte loads.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace customops::cuda::attention {

// A tensor the kernels can read in place: unit last stride, the other strides and the data pointer
// 16-byte aligned. Else a fresh copy (contiguous() would keep a contiguous view at an odd offset).
inline at::Tensor readable(const at::Tensor& t) {
  const bool ok = t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The strides of B, H and S (D's is 1).
inline void strides_of(const at::Tensor& t, int64_t (&s)[3]) {
  for (int d = 0; d < 3; ++d) s[d] = t.stride(d);
}

}  // namespace customops::cuda::attention
