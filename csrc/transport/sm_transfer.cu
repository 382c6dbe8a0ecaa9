// The one-block kernel behind sm_transfer.h.
#include "sm_transfer.h"

namespace pipecomm::transport {

namespace {

constexpr int kThreads = 512;
// Polls back to back first (a message about to land), then with short sleeps, which keep a long wait's
// load on the memory system and on the SM it shares negligible.
constexpr int kBusyPolls = 4096;
constexpr unsigned kSleepNanoseconds = 100;

__device__ uint32_t load_acquire(const uint32_t* flag) {
#if __CUDA_ARCH__ >= 700
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
#else  // a build for an older default architecture: a volatile load, then a fence
  const uint32_t value = *static_cast<const volatile uint32_t*>(flag);
  __threadfence_system();
  return value;
#endif
}

__device__ void store_release(uint32_t* flag, uint32_t value) {
#if __CUDA_ARCH__ >= 700
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
#else
  __threadfence_system();
  *static_cast<volatile uint32_t*>(flag) = value;
#endif
}

// Loads bypass L1: the source may be a slot the peer just wrote over NVLink.
__device__ void copy_bytes(char* destination, const char* source, uint64_t bytes) {
  uint64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(destination) | reinterpret_cast<uintptr_t>(source)) & 15) == 0) {
    const uint64_t vectors = bytes / 16;
    auto* to = reinterpret_cast<uint4*>(destination);
    const auto* from = reinterpret_cast<const uint4*>(source);
    for (uint64_t i = threadIdx.x; i < vectors; i += blockDim.x) to[i] = __ldcg(from + i);
    done = vectors * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < bytes; i += blockDim.x) destination[i] = __ldcg(source + i);
}

__global__ void __launch_bounds__(kThreads) sm_transfer_kernel(const SmTransfer transfer) {
  if (threadIdx.x == 0) {
    for (int w = 0; w < transfer.wait_count; ++w) {
      const SmTransfer::Wait& wait = transfer.waits[w];
      for (int poll = 0; static_cast<int32_t>(load_acquire(wait.flag) - wait.value) < 0; ++poll) {
#if __CUDA_ARCH__ >= 700
        if (poll >= kBusyPolls) __nanosleep(kSleepNanoseconds);
#endif
      }
    }
  }
  __syncthreads();  // with thread 0's acquire: every thread's copy reads what the flags published
  for (int c = 0; c < transfer.copy_count; ++c) {
    const SmTransfer::Copy& copy = transfer.copies[c];
    copy_bytes(static_cast<char*>(copy.destination), static_cast<const char*>(copy.source), copy.bytes);
  }
  __syncthreads();
  if (threadIdx.x == 0 && transfer.signal != nullptr) {
    __threadfence_system();  // every thread's stores, ordered by the barrier, before the flag
    store_release(transfer.signal, transfer.signal_value);
  }
}

}  // namespace

cudaError_t enqueue_sm_transfer(const SmTransfer& transfer, cudaStream_t stream) {
  sm_transfer_kernel<<<1, kThreads, 0, stream>>>(transfer);
  return cudaGetLastError();
}

}  // namespace pipecomm::transport
