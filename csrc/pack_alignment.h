// The one packing rule, for pack/unpack_, the shared-memory rings and pipecomm._C.PACK_ALIGNMENT alike.
#pragma once

#include <cstddef>

namespace pipecomm {

// Every packed tensor starts at a multiple of this many bytes, so vector loads stay aligned.
inline constexpr size_t kPackAlignment = 16;

constexpr size_t align_to_pack(size_t offset) {
  return (offset + kPackAlignment - 1) & ~(kPackAlignment - 1);
}

}  // namespace pipecomm
