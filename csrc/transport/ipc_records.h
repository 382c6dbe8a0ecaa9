// The fixed-size records an IPC channel's shared-memory rings carry, copied as bytes by both ends.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace pipecomm::transport {

// A cudaIpcMemHandle_t travels as its bytes, so that the units reading these records need no CUDA header.
inline constexpr size_t kIpcHandleBytes = 64;
using IpcHandleBytes = std::array<char, kIpcHandleBytes>;

// A buffer offered for one incoming message, as the post ring carries it to the sender.
struct PostRecord {
  uint64_t seq;
  uint64_t post;         // the receiver's post number, which the data message names back
  uint64_t fingerprint;  // of the layout the buffer was allocated for
  uint64_t bytes;
  uint64_t offset;  // inside the allocation `handle` names
  IpcHandleBytes handle;
};

// The payload of a data message on the host ring.
struct DataNote {
  uint64_t post;  // the post the data went into (direct messages only)
  // Posts of the sender's own receiving end (0 .. posts_passed - 1) whose counter writes precede,
  // on the sender's stream, this message's ready write. A receiver whose stream waited for this
  // message knows them passed and skips the device wait on their counter when it sends into them.
  uint64_t posts_passed;
};

// On the host ring: the sender needs slots of at least slot_bytes for message first_seq on. The
// receiver answers on the post ring with the grown generation's handles or, when it cannot grow them,
// with a refusal: this request again, then the reason as text.
struct GrowRequest {
  uint64_t slot_bytes;
  uint64_t first_seq;
};

static_assert(std::is_trivially_copyable_v<PostRecord> && std::is_trivially_copyable_v<DataNote> &&
                  std::is_trivially_copyable_v<GrowRequest>,
              "ring records are copied as bytes");

}  // namespace pipecomm::transport
