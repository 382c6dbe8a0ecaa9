// CPU kernel of accumulate_: one parallel loop over fixed-size chunks of every tensor.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../accumulate_types.h"
#include "../chunks.h"
#include "../op_checks.h"

namespace pipecomm {
namespace {

// Small enough to balance threads over a list of uneven tensors, large enough to vectorise.
constexpr int64_t kChunkElements = 1 << 15;

template <typename acc_t, typename grad_t>
void accumulate_span(acc_t* __restrict__ acc, const grad_t* __restrict__ grad, int64_t count,
                     float scale) {
  for (int64_t i = 0; i < count; ++i) {
    acc[i] = static_cast<acc_t>(static_cast<float>(acc[i]) + scale * static_cast<float>(grad[i]));
  }
}

void accumulate_cpu(at::TensorList accumulators, at::TensorList grads, double scale) {
  check_accumulate_args(accumulators, grads);
  std::vector<int64_t> numels;
  numels.reserve(grads.size());
  for (const at::Tensor& grad : grads) numels.push_back(grad.numel());
  const std::vector<int64_t> prefix = chunk_prefix(numels, kChunkElements);
  const auto num_tensors = static_cast<int64_t>(numels.size());
  at::parallel_for(0, prefix.back(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t owner = chunk_owner(prefix.data(), num_tensors, chunk);
      const int64_t start = (chunk - prefix[owner]) * kChunkElements;
      const int64_t count = std::min(kChunkElements, numels[owner] - start);
      const at::Tensor& acc = accumulators[owner];
      const at::Tensor& grad = grads[owner];
      dispatch_accumulate_types(acc.scalar_type(), grad.scalar_type(), [&](auto acc_zero, auto grad_zero) {
        using acc_t = decltype(acc_zero);
        using grad_t = decltype(grad_zero);
        accumulate_span(acc.data_ptr<acc_t>() + start, grad.const_data_ptr<grad_t>() + start, count,
                        static_cast<float>(scale));
      });
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pipecomm, CPU, m) { m.impl("accumulate_", &accumulate_cpu); }

}  // namespace pipecomm
