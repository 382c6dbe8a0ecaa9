// Helpers every multi-tensor CUDA kernel here shares: metadata upload and grid sizing.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pipecomm {

// Copies a host int64 table to `device` through pinned memory, ordered on the current stream;
// the caching host allocator keeps the pinned block alive until the copy has run.
inline at::Tensor upload_table(const std::vector<int64_t>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return host.to(device, /*non_blocking=*/true);
}

// Enough resident blocks to keep every SM's memory pipeline full, no more than there are chunks.
inline int64_t persistent_grid(int64_t total_chunks, int64_t blocks_per_sm) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::min(total_chunks, sms * blocks_per_sm);
}

__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
__device__ __forceinline__ bool is_aligned(const T* pointer, size_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

}  // namespace pipecomm
