// One step of the IPC ring protocol (wait for flags, copy, write a flag) done by a single thread block
// instead of stream memory operations and the copy engine. For small messages: each memory operation
// and copy-engine launch costs a few microseconds of front-end latency, a block that polls and copies
// costs about one, and a one-block kernel leaves the rest of the GPU to compute.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pipecomm::transport {

inline constexpr int kSmTransferMaxWaits = 3;
inline constexpr int kSmTransferMaxCopies = 16;

struct SmTransfer {
  struct Wait {
    const uint32_t* flag;
    uint32_t value;  // until flag >= value, compared wrap-safely as the rounds are
  };
  struct Copy {
    void* destination;
    const void* source;
    uint64_t bytes;
  };
  Wait waits[kSmTransferMaxWaits];
  int wait_count = 0;
  Copy copies[kSmTransferMaxCopies];
  int copy_count = 0;
  uint32_t* signal = nullptr;  // written with release semantics at system scope after every copy
  uint32_t signal_value = 0;
};

// Launches the block on `stream`; returns the launch's error.
cudaError_t enqueue_sm_transfer(const SmTransfer& transfer, cudaStream_t stream);

}  // namespace pipecomm::transport
