// CUDA kernels of pack and unpack_: one persistent launch over byte chunks of every tensor.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../chunks.h"
#include "../pack_plan.h"
#include "launch.cuh"

namespace pipecomm {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
// Small enough that a 16 MB boundary message still spreads over every SM.
constexpr int64_t kChunkBytes = 1 << 14;
constexpr int kWordBytes = 16;
constexpr int kUnroll = 4;

// A 16-byte word of segment bytes [byte, byte + 16): source bytes below read_bytes, zero above.
__device__ __forceinline__ uint4 load_word(const uint8_t* source, int64_t byte, int64_t read_bytes) {
  if (byte + kWordBytes <= read_bytes) return *reinterpret_cast<const uint4*>(source + byte);
  uint8_t partial[kWordBytes];
#pragma unroll
  for (int k = 0; k < kWordBytes; ++k) partial[k] = byte + k < read_bytes ? source[byte + k] : 0;
  uint4 word;
  memcpy(&word, partial, kWordBytes);
  return word;
}

// table holds, for num_segments segments: source addresses, target addresses, bytes to read,
// bytes to write (the tail past the read bytes is zero-filled), and the chunk prefix.
__global__ __launch_bounds__(kThreads) void copy_segments_kernel(const int64_t* __restrict__ table,
                                                                 int64_t num_segments) {
  const int64_t* source_addresses = table;
  const int64_t* target_addresses = table + num_segments;
  const int64_t* read_bytes = table + 2 * num_segments;
  const int64_t* write_bytes = table + 3 * num_segments;
  const int64_t* prefix = table + 4 * num_segments;
  const int64_t total_chunks = prefix[num_segments];
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    const int64_t owner = chunk_owner(prefix, num_segments, chunk);
    const auto* source = reinterpret_cast<const uint8_t*>(source_addresses[owner]);
    auto* target = reinterpret_cast<uint8_t*>(target_addresses[owner]);
    const int64_t readable = read_bytes[owner];
    const int64_t start = (chunk - prefix[owner]) * kChunkBytes;
    const int64_t end = smaller(start + kChunkBytes, write_bytes[owner]);
    int64_t scalar_start = start;
    if (is_aligned(source, kWordBytes) && is_aligned(target, kWordBytes)) {
      const int64_t first_word = start / kWordBytes;
      const int64_t last_word = end / kWordBytes;
      for (int64_t base = first_word + threadIdx.x; base < last_word; base += kThreads * kUnroll) {
        uint4 words[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t word = base + u * kThreads;
          if (word < last_word) words[u] = load_word(source, word * kWordBytes, readable);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t word = base + u * kThreads;
          if (word < last_word) *reinterpret_cast<uint4*>(target + word * kWordBytes) = words[u];
        }
      }
      scalar_start = last_word * kWordBytes;
    }
    for (int64_t byte = scalar_start + threadIdx.x; byte < end; byte += kThreads) {
      target[byte] = byte < readable ? source[byte] : 0;
    }
  }
}

void copy_segments(const std::vector<Segment>& segments, const at::Device& device) {
  std::vector<int64_t> table;
  std::vector<int64_t> write_sizes;
  table.reserve(5 * segments.size() + 1);
  for (const Segment& s : segments) table.push_back(reinterpret_cast<int64_t>(s.source));
  for (const Segment& s : segments) table.push_back(reinterpret_cast<int64_t>(s.target));
  for (const Segment& s : segments) table.push_back(s.read_bytes);
  for (const Segment& s : segments) write_sizes.push_back(s.write_bytes);
  table.insert(table.end(), write_sizes.begin(), write_sizes.end());
  const std::vector<int64_t> prefix = chunk_prefix(write_sizes, kChunkBytes);
  if (prefix.back() == 0) return;
  table.insert(table.end(), prefix.begin(), prefix.end());
  const at::Tensor device_table = upload_table(table, device);
  const int64_t grid = persistent_grid(prefix.back(), kBlocksPerSm);
  copy_segments_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      device_table.const_data_ptr<int64_t>(), static_cast<int64_t>(segments.size()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor pack_cuda(at::TensorList tensors) {
  const PackPlan plan = plan_pack(tensors);
  const c10::cuda::CUDAGuard guard(plan.buffer.device());
  copy_segments(plan.segments, plan.buffer.device());
  return plan.buffer;
}

void unpack_cuda(const at::Tensor& buffer, at::TensorList outs) {
  const std::vector<Segment> segments = plan_unpack(buffer, outs);
  const c10::cuda::CUDAGuard guard(buffer.device());
  copy_segments(segments, buffer.device());
}

}  // namespace

TORCH_LIBRARY_IMPL(pipecomm, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack_", &unpack_cuda);
}

}  // namespace pipecomm
