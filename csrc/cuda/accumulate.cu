// CUDA kernel of accumulate_: one persistent launch per dtype pair over chunks of every tensor.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <utility>

#include "../accumulate_types.h"
#include "../chunks.h"
#include "../op_checks.h"
#include "launch.cuh"

namespace pipecomm {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
constexpr int64_t kChunkElements = 1 << 16;
// Eight elements per access: 16-byte loads of 16-bit grads, two 16-byte loads of fp32.
constexpr int kVecElements = 8;
// Independent vector loads per thread before any store, to keep enough bytes in flight.
constexpr int kUnroll = 2;

template <typename T>
struct alignas(sizeof(T) * kVecElements) Vec {
  T values[kVecElements];
};

template <typename acc_t, typename grad_t>
__device__ __forceinline__ acc_t accumulate_one(acc_t acc, grad_t grad, float scale) {
  return static_cast<acc_t>(static_cast<float>(acc) + scale * static_cast<float>(grad));
}

template <typename acc_t, typename grad_t>
__device__ void accumulate_vectorised(acc_t* __restrict__ acc, const grad_t* __restrict__ grad,
                                      int64_t count, float scale) {
  auto* acc_vecs = reinterpret_cast<Vec<acc_t>*>(acc);
  const auto* grad_vecs = reinterpret_cast<const Vec<grad_t>*>(grad);
  const int64_t num_vecs = count / kVecElements;
  for (int64_t base = threadIdx.x; base < num_vecs; base += kThreads * kUnroll) {
    Vec<acc_t> acc_regs[kUnroll];
    Vec<grad_t> grad_regs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * kThreads;
      if (index < num_vecs) {
        acc_regs[u] = acc_vecs[index];
        grad_regs[u] = grad_vecs[index];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * kThreads;
      if (index < num_vecs) {
#pragma unroll
        for (int k = 0; k < kVecElements; ++k) {
          acc_regs[u].values[k] = accumulate_one(acc_regs[u].values[k], grad_regs[u].values[k], scale);
        }
        acc_vecs[index] = acc_regs[u];
      }
    }
  }
  for (int64_t i = num_vecs * kVecElements + threadIdx.x; i < count; i += kThreads) {
    acc[i] = accumulate_one(acc[i], grad[i], scale);
  }
}

// table holds, for num_tensors tensors: accumulator addresses, grad addresses, numels, and the
// chunk prefix (num_tensors + 1 entries).
template <typename acc_t, typename grad_t>
__global__ __launch_bounds__(kThreads) void accumulate_kernel(const int64_t* __restrict__ table,
                                                              int64_t num_tensors, float scale) {
  const int64_t* acc_addresses = table;
  const int64_t* grad_addresses = table + num_tensors;
  const int64_t* numels = table + 2 * num_tensors;
  const int64_t* prefix = table + 3 * num_tensors;
  const int64_t total_chunks = prefix[num_tensors];
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    const int64_t owner = chunk_owner(prefix, num_tensors, chunk);
    const int64_t start = (chunk - prefix[owner]) * kChunkElements;
    const int64_t count = smaller(kChunkElements, numels[owner] - start);
    acc_t* acc = reinterpret_cast<acc_t*>(acc_addresses[owner]) + start;
    const grad_t* grad = reinterpret_cast<const grad_t*>(grad_addresses[owner]) + start;
    if (is_aligned(acc, sizeof(Vec<acc_t>)) && is_aligned(grad, sizeof(Vec<grad_t>))) {
      accumulate_vectorised(acc, grad, count, scale);
    } else {
      for (int64_t i = threadIdx.x; i < count; i += kThreads) {
        acc[i] = accumulate_one(acc[i], grad[i], scale);
      }
    }
  }
}

void accumulate_cuda(at::TensorList accumulators, at::TensorList grads, double scale) {
  check_accumulate_args(accumulators, grads);
  if (accumulators.empty()) return;
  const c10::cuda::CUDAGuard guard(accumulators[0].device());
  // One launch per dtype pair; tensors without elements need no work.
  std::map<std::pair<at::ScalarType, at::ScalarType>, std::vector<size_t>> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() > 0) {
      groups[{accumulators[i].scalar_type(), grads[i].scalar_type()}].push_back(i);
    }
  }
  for (const auto& [dtypes, members] : groups) {
    const auto num_tensors = static_cast<int64_t>(members.size());
    std::vector<int64_t> numels;
    std::vector<int64_t> table;
    table.reserve(4 * members.size() + 1);
    for (size_t index : members) table.push_back(reinterpret_cast<int64_t>(accumulators[index].data_ptr()));
    for (size_t index : members) table.push_back(reinterpret_cast<int64_t>(grads[index].const_data_ptr()));
    for (size_t index : members) numels.push_back(grads[index].numel());
    table.insert(table.end(), numels.begin(), numels.end());
    const std::vector<int64_t> prefix = chunk_prefix(numels, kChunkElements);
    table.insert(table.end(), prefix.begin(), prefix.end());
    const at::Tensor device_table = upload_table(table, accumulators[0].device());
    const int64_t grid = persistent_grid(prefix.back(), kBlocksPerSm);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    dispatch_accumulate_types(dtypes.first, dtypes.second, [&](auto acc_zero, auto grad_zero) {
      using acc_t = decltype(acc_zero);
      using grad_t = decltype(grad_zero);
      accumulate_kernel<acc_t, grad_t><<<grid, kThreads, 0, stream>>>(
          device_table.const_data_ptr<int64_t>(), num_tensors, static_cast<float>(scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pipecomm, CUDA, m) { m.impl("accumulate_", &accumulate_cuda); }

}  // namespace pipecomm
