// The memory a receiver posts for the peer's copies: a private pool of torch's caching allocator, so that
// no segment the peer has mapped is freed while the channel is open.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <thread>

namespace pipecomm::transport {

// The peer maps each posted buffer's whole segment and keeps the mapping for later messages. Torch hands
// a received tensor's memory back to the cache when it dies, and empty_cache() or an out-of-memory retry
// then cudaFrees cached segments: freeing memory another process still maps is undefined behaviour.
// A private pool's segments are only freed once the pool is released, which the channel does after the
// peer said it unmapped them. Its blocks serve only later posts: a received tensor's memory, once free,
// is reused for the next message's buffer (same size, same segment, already mapped by the peer).
class PostedBufferPool {
 public:
  explicit PostedBufferPool(at::Device device) : device_(device), id_(at::cuda::graph_pool_handle()) {}

  PostedBufferPool(const PostedBufferPool&) = delete;
  PostedBufferPool& operator=(const PostedBufferPool&) = delete;

  // `bytes` of device memory from the pool, allocated on the calling thread (which the pool's filter
  // picks out, so other threads' allocations meanwhile stay in torch's ordinary pools). Throws
  // c10::OutOfMemoryError like at::empty; returns an undefined tensor once the pool is unusable.
  at::Tensor allocate(int64_t bytes) {
    if (!usable_) return {};
    const std::thread::id thread = std::this_thread::get_id();
    try {
      // Each begin takes a reference on the pool; the first one is kept until release().
      c10::cuda::CUDACachingAllocator::beginAllocateToPool(
          device_.index(), id_, [thread](cudaStream_t) { return std::this_thread::get_id() == thread; });
    } catch (const c10::Error&) {
      usable_ = false;
      return {};
    }
    at::Tensor buffer;
    try {
      buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
    } catch (...) {
      end_allocation();
      throw;
    }
    end_allocation();
    return buffer;
  }

  // Lets torch free the pool's segments once no tensor uses them: call only when the peer unmapped
  // them. Never called, the pool's memory stays reserved for the life of the process.
  void release() noexcept {
    usable_ = false;  // a released pool takes no more references
    if (!holding_) return;
    holding_ = false;
    try {
      c10::cuda::CUDACachingAllocator::releasePool(device_.index(), id_);
    } catch (...) {
      // Keeping the pool is the safe failure.
    }
  }

 private:
  void end_allocation() {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device_.index(), id_);
    if (holding_) {
      c10::cuda::CUDACachingAllocator::releasePool(device_.index(), id_);
    } else {
      holding_ = true;
    }
  }

  at::Device device_;
  decltype(at::cuda::graph_pool_handle()) id_;  // the pool id type moved between torch releases
  bool holding_ = false;
  bool usable_ = true;
};

}  // namespace pipecomm::transport
