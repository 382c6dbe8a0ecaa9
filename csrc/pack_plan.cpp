// What pack and unpack_ copy, as byte segments, shared by the CPU and CUDA kernels.
#include "pack_plan.h"

#include <ATen/ops/empty.h>

#include "op_checks.h"

namespace pipecomm {

PackPlan plan_pack(at::TensorList tensors) {
  check_pack_args(tensors);
  const std::vector<int64_t> offsets = packed_offsets(tensors);
  PackPlan plan;
  plan.buffer = at::empty({offsets.back()}, tensors[0].options().dtype(at::kByte));
  uint8_t* base = plan.buffer.data_ptr<uint8_t>();
  plan.gathered.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    plan.gathered.push_back(tensors[i].contiguous());
    plan.segments.push_back({plan.gathered.back().const_data_ptr(), base + offsets[i],
                             static_cast<int64_t>(tensors[i].nbytes()), offsets[i + 1] - offsets[i]});
  }
  return plan;
}

std::vector<Segment> plan_unpack(const at::Tensor& buffer, at::TensorList outs) {
  check_unpack_args(buffer, outs);
  const std::vector<int64_t> offsets = packed_offsets(outs);
  const uint8_t* base = buffer.const_data_ptr<uint8_t>();
  std::vector<Segment> segments;
  segments.reserve(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto bytes = static_cast<int64_t>(outs[i].nbytes());
    segments.push_back({base + offsets[i], outs[i].data_ptr(), bytes, bytes});
  }
  return segments;
}

}  // namespace pipecomm
