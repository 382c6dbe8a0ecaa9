// CPU kernels of pack and unpack_: one parallel loop over byte chunks of every segment.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../chunks.h"
#include "../pack_plan.h"

namespace pipecomm {
namespace {

constexpr int64_t kChunkBytes = 1 << 18;

}  // namespace

void copy_segments_cpu(const std::vector<Segment>& segments) {
  std::vector<int64_t> write_sizes;
  for (const Segment& segment : segments) write_sizes.push_back(segment.write_bytes);
  const std::vector<int64_t> prefix = chunk_prefix(write_sizes, kChunkBytes);
  const auto num_segments = static_cast<int64_t>(segments.size());
  at::parallel_for(0, prefix.back(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const Segment& segment = segments[chunk_owner(prefix.data(), num_segments, chunk)];
      const auto* source = static_cast<const uint8_t*>(segment.source);
      auto* target = static_cast<uint8_t*>(segment.target);
      const int64_t start = (chunk - prefix[&segment - segments.data()]) * kChunkBytes;
      const int64_t end = std::min(start + kChunkBytes, segment.write_bytes);
      const int64_t copy_end = std::clamp(segment.read_bytes, start, end);
      std::memcpy(target + start, source + start, copy_end - start);
      std::memset(target + copy_end, 0, end - copy_end);
    }
  });
}

namespace {

at::Tensor pack_cpu(at::TensorList tensors) {
  const PackPlan plan = plan_pack(tensors);
  copy_segments_cpu(plan.segments);
  return plan.buffer;
}

void unpack_cpu(const at::Tensor& buffer, at::TensorList outs) {
  copy_segments_cpu(plan_unpack(buffer, outs));
}

}  // namespace

TORCH_LIBRARY_IMPL(pipecomm, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack_", &unpack_cpu);
}

}  // namespace pipecomm
