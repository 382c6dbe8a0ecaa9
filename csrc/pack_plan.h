// What pack and unpack_ copy, as byte segments, shared by the CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace pipecomm {

// Copy read_bytes from source to target, then zero-fill target up to write_bytes.
struct Segment {
  const void* source;
  void* target;
  int64_t read_bytes;
  int64_t write_bytes;
};

struct PackPlan {
  at::Tensor buffer;
  std::vector<Segment> segments;
  // Contiguous copies of non-contiguous inputs, alive until the copy is enqueued.
  std::vector<at::Tensor> gathered;
};

// Checks the inputs, allocates the packed buffer and describes one segment per tensor.
PackPlan plan_pack(at::TensorList tensors);

// Checks the arguments and describes one segment per output.
std::vector<Segment> plan_unpack(const at::Tensor& buffer, at::TensorList outs);

// Runs the segments' copies on the CPU, in parallel over fixed-size chunks.
void copy_segments_cpu(const std::vector<Segment>& segments);

}  // namespace pipecomm
