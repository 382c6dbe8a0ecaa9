// Argument checks and buffer layout shared by the CPU and CUDA kernels, so both fail alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "pack_alignment.h"

namespace pipecomm {

// Validates accumulate_'s lists: equal lengths, shapes, one device, supported dtype pairs,
// contiguity. Throws ValueError naming the offending index.
void check_accumulate_args(at::TensorList accumulators, at::TensorList grads);

// Validates pack's inputs: one device (the dispatcher never routes an empty list here).
void check_pack_args(at::TensorList tensors);

// Validates unpack_'s buffer and outputs against the layout of `outs`.
void check_unpack_args(const at::Tensor& buffer, at::TensorList outs);

// Byte offset of each tensor in the packed buffer, plus the total size as the last entry.
std::vector<int64_t> packed_offsets(at::TensorList tensors);

// The same layout from the tensors' byte sizes alone, for a receiver that knows only their metadata.
std::vector<int64_t> packed_offsets_of_bytes(c10::ArrayRef<int64_t> nbytes);

}  // namespace pipecomm
