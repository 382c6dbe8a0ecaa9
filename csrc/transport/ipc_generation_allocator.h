// Where an IPC receiver's data generations come from: torch's caching allocator, on a stream of their own.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "ipc_ring.h"

namespace pipecomm::transport {

// A shrink (or a grow's superseded generation) then gives memory back without a cudaFree, which may
// synchronize the device. Generations are allocated on a stream of their own: the allocator hands a
// block to a stream once that stream is past its last use, and a peer's copies into a generation follow
// no stream of this process, so no block may come with work of other streams still pending on it. Torch
// reuses given-back memory elsewhere after torch.cuda.empty_cache() or, by itself, under memory pressure.
class CachingGenerationAllocator final : public GenerationAllocator {
 public:
  explicit CachingGenerationAllocator(at::Device device) : device_(device) {
    const c10::cuda::CUDAGuard guard(device_);
    const cudaError_t error = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    TORCH_CHECK(error == cudaSuccess, "pipecomm ipc channel: cudaStreamCreateWithFlags failed: ",
                cudaGetErrorString(error));
  }
  ~CachingGenerationAllocator() override { (void)cudaStreamDestroy(stream_); }

  void* allocate(size_t bytes) override {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream_, device_.index()));
    try {
      held_.push_back(at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_)));
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;  // the ring then tries cudaMalloc and reports a failure in its own words
    }
    return held_.back().data_ptr();
  }

  void release(void* data, const std::vector<cudaStream_t>& readers) noexcept override {
    auto it = std::find_if(held_.begin(), held_.end(), [&](const at::Tensor& memory) { return memory.data_ptr() == data; });
    if (it == held_.end()) return;
    try {
      for (cudaStream_t reader : readers) {
        c10::cuda::CUDACachingAllocator::recordStream(it->storage().data_ptr(),
                                                      c10::cuda::getStreamFromExternal(reader, device_.index()));
      }
    } catch (...) {
      return;  // kept for the process's life rather than reused under a reader
    }
    held_.erase(it);
  }

 private:
  at::Device device_;
  cudaStream_t stream_ = nullptr;
  std::vector<at::Tensor> held_;  // the channel's call mutex covers every call
};

}  // namespace pipecomm::transport
