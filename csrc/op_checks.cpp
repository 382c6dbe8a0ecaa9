// Argument checks and buffer layout shared by the CPU and CUDA kernels.
#include "op_checks.h"

#include <c10/util/Exception.h>

namespace pipecomm {
namespace {

bool is_grad_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_one_device(at::TensorList tensors, const char* op, const char* list_name,
                      const at::Device& device, const char* first_name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == device, op, ": ", list_name, "[", i, "] is on ",
                      tensors[i].device(), " but ", first_name, " is on ", device);
  }
}

}  // namespace

void check_accumulate_args(at::TensorList accumulators, at::TensorList grads) {
  TORCH_CHECK_VALUE(accumulators.size() == grads.size(), "accumulate_: got ", accumulators.size(),
                    " accumulators but ", grads.size(), " grads");
  if (accumulators.empty()) return;
  const at::Device device = accumulators[0].device();
  check_one_device(accumulators, "accumulate_", "accumulators", device, "accumulators[0]");
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& acc = accumulators[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK_VALUE(grad.device() == acc.device(), "accumulate_: accumulators[", i, "] is on ",
                      acc.device(), " but grads[", i, "] is on ", grad.device());
    TORCH_CHECK_VALUE(acc.sizes() == grad.sizes(), "accumulate_: accumulators[", i,
                      "] has shape ", acc.sizes(), " but grads[", i, "] has shape ", grad.sizes());
    TORCH_CHECK_VALUE(is_grad_dtype(grad.scalar_type()), "accumulate_: grads[", i,
                      "] has dtype ", grad.scalar_type(),
                      " but grads must be Float, BFloat16 or Half");
    TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat || acc.scalar_type() == grad.scalar_type(),
                      "accumulate_: accumulators[", i, "] has dtype ", acc.scalar_type(),
                      " but grads[", i, "] has dtype ", grad.scalar_type(),
                      "; an accumulator must be Float or its grad's dtype");
    TORCH_CHECK_VALUE(acc.is_contiguous(), "accumulate_: accumulators[", i, "] is not contiguous");
    TORCH_CHECK_VALUE(grad.is_contiguous(), "accumulate_: grads[", i, "] is not contiguous");
  }
}

void check_pack_args(at::TensorList tensors) {
  check_one_device(tensors, "pack", "tensors", tensors[0].device(), "tensors[0]");
}

void check_unpack_args(const at::Tensor& buffer, at::TensorList outs) {
  TORCH_CHECK_VALUE(buffer.dim() == 1 && buffer.scalar_type() == at::kByte,
                    "unpack_: buffer must be a 1-D uint8 tensor");
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "unpack_: buffer is not contiguous");
  check_one_device(outs, "unpack_", "outs", buffer.device(), "buffer");
  for (size_t i = 0; i < outs.size(); ++i) {
    TORCH_CHECK_VALUE(outs[i].is_contiguous(), "unpack_: outs[", i, "] is not contiguous");
  }
  const int64_t needed = packed_offsets(outs).back();
  TORCH_CHECK_VALUE(buffer.numel() == needed, "unpack_: buffer holds ", buffer.numel(),
                    " bytes but outs need ", needed);
}

std::vector<int64_t> packed_offsets(at::TensorList tensors) {
  std::vector<int64_t> nbytes;
  nbytes.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) nbytes.push_back(static_cast<int64_t>(tensor.nbytes()));
  return packed_offsets_of_bytes(nbytes);
}

std::vector<int64_t> packed_offsets_of_bytes(c10::ArrayRef<int64_t> nbytes) {
  std::vector<int64_t> offsets;
  offsets.reserve(nbytes.size() + 1);
  int64_t offset = 0;
  for (const int64_t bytes : nbytes) {
    offsets.push_back(offset);
    offset += static_cast<int64_t>(align_to_pack(static_cast<size_t>(bytes)));
  }
  offsets.push_back(offset);
  return offsets;
}

}  // namespace pipecomm
