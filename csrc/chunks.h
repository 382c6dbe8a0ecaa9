// Splits many tensors into fixed-size chunks so one parallel loop or one launch covers the list.
#pragma once

#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define PIPECOMM_HOST_DEVICE __host__ __device__
#else
#define PIPECOMM_HOST_DEVICE
#endif

namespace pipecomm {

// prefix[i] is the index of tensor i's first chunk; prefix.back() is the total chunk count.
inline std::vector<int64_t> chunk_prefix(const std::vector<int64_t>& sizes, int64_t chunk_size) {
  std::vector<int64_t> prefix(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    prefix[i + 1] = prefix[i] + (sizes[i] + chunk_size - 1) / chunk_size;
  }
  return prefix;
}

// The tensor owning `chunk`: the largest i with prefix[i] <= chunk. Tensors with no chunks
// share their prefix with the next tensor, so they are never returned.
PIPECOMM_HOST_DEVICE inline int64_t chunk_owner(const int64_t* prefix, int64_t num_tensors,
                                                int64_t chunk) {
  int64_t low = 0;
  int64_t high = num_tensors - 1;
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (prefix[mid] <= chunk) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

}  // namespace pipecomm
