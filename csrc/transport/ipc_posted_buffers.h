// An IPC receiver's posted buffers: which it offered the peer, for which message and layout, and when
// one is dropped.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>

#include "ipc_records.h"
#include "ipc_ring.h"
#include "message.h"
#include "posted_buffer_pool.h"
#include "shm_ring.h"

namespace pipecomm::transport {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "post records carry a cudaIpcMemHandle_t's bytes");

inline cudaIpcMemHandle_t cuda_handle_of(const PostRecord& record) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, record.handle.data(), sizeof(handle));
  return handle;
}

// A message layout as a receiver caches it: shared by the posts predicted from it.
struct Layout {
  MessageMeta meta;
  uint64_t fingerprint;
  std::vector<int64_t> offsets;  // packed offsets of the present entries, total bytes last
};

std::shared_ptr<const Layout> make_layout(MessageMeta meta);

// A buffer this end posted for an incoming message.
struct PostedBuffer {
  uint64_t seq;
  uint64_t post;
  std::shared_ptr<const Layout> layout;
  at::Tensor buffer;    // uint8, layout->offsets.back() bytes
  cudaStream_t stream;  // it was allocated on
  // Posted before the peer could decide how to send message seq: if the layout is the peer's, the data goes
  // into this buffer for sure (a receive may then run ahead of the peer's note).
  bool before_decision;
};

// The message's tensors as views of a posted buffer at their packed offsets.
Entries views_of(const at::Tensor& buffer, const Layout& layout);

// Not thread-safe: the channel's call mutex covers every use.
class PostedBuffers {
 public:
  // Posts `depth` messages ahead of the one being received.
  PostedBuffers(at::Device device, uint64_t depth) : pool_(device), depth_(depth) {}

  // Offers buffers of `layout` for the depth messages from first_seq on that have none of it yet
  // (after a layout change, a message may hold a post of each), through `receiver`'s post counter
  // and on `post_ring`. Allocated on `caller`, so they are free for the peer's copies once that stream
  // reaches the posted counter. Optional work: whatever stops it (no room on the post ring, no
  // memory) leaves those messages to the slot path.
  // The posts for messages from `decided_after` on reach the peer before it decides how to send them.
  void post_ahead(uint64_t first_seq, const std::shared_ptr<const Layout>& layout, cudaStream_t caller,
                  IpcRingReceiver& receiver, ShmRingSender& post_ring, uint64_t decided_after);

  const PostedBuffer* find(uint64_t seq, uint64_t post) const;
  // The post for message seq of the layout `fingerprint` that the peer is sure to have had when it decided.
  const PostedBuffer* find_before_decision(uint64_t seq, uint64_t fingerprint) const;

  // Message seq was received: the other posts for it and earlier ones were passed over (the sender
  // never writes them).
  void drop_through(uint64_t seq);

  // Forgets every post. Unless `give_memory_back` (the peer unmapped it and is copying into none of
  // it), the pool keeps its memory for the life of the process.
  void close(bool give_memory_back);

 private:
  PostedBufferPool pool_;
  uint64_t depth_;
  std::deque<PostedBuffer> posts_;
  uint64_t posted_digest_ = 0;  // the layout posted last, and the first message without a post of it
  uint64_t unposted_seq_ = 0;
  uint64_t next_post_ = 0;
  bool enabled_ = true;
};

}  // namespace pipecomm::transport
