// The IPC sender's view of its peer's post ring: buffers posted for coming messages, resized data
// generations, and refused grows. Plain C++; a post's stream is known only by its address.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ipc_records.h"
#include "shm_ring.h"

namespace pipecomm::transport {

// Not thread-safe: its channel's call mutex covers every use.
class PeerPosts {
 public:
  // Maps a generation the peer resized its slots to (IpcRingSender::update).
  using AdoptGeneration = std::function<void(const std::string& handles)>;

  // `direction` ("pipecomm ipc channel rank 0 -> rank 1") starts errors.
  PeerPosts(ShmRingReceiver& post_ring, std::string direction, AdoptGeneration adopt_generation);

  // Takes in what the peer put on the post ring: generations, adopted at once (the next send must
  // see a shrink's); posts for message next_seq on, kept while the direct path is on; refusals. Never
  // waits. Once the ring fails (the peer closed or died) nothing more comes: the direct path is off
  // and failure() holds the ring's error.
  void drain(uint64_t next_seq);

  // Drains, then returns the peer's newest post for message seq if it has arrived and was made for
  // this layout and size; posts for earlier messages are dropped. Never waits: a message without one
  // goes by slot, so no send depends on the peer receiving.
  std::optional<PostRecord> post_for_next_message(uint64_t seq, uint64_t fingerprint, uint64_t bytes);

  // No more posts are kept or offered: an allocation this process could not map will not map later.
  void disable_direct() { direct_enabled_ = false; }

  // Why the peer refused `request`, if it did (a refusal of an earlier request does not count).
  std::optional<std::string> refusal_of(const GrowRequest& request) const;
  std::exception_ptr failure() const { return failure_; }

  // From the peer's last data message, received on `stream`: its posts 0 .. posts_passed - 1 have
  // their counter writes behind what `stream` has waited for.
  void learn_passed(uint64_t posts_passed, const void* stream);
  // Whether a send on `stream` may skip the device wait for `post`'s counter.
  bool passed(const PostRecord& post, const void* stream) const {
    return stream == passed_stream_ && post.post < posts_passed_;
  }

 private:
  [[noreturn]] void reject(const Message& message) const;

  ShmRingReceiver& ring_;
  std::string direction_;
  AdoptGeneration adopt_generation_;
  std::vector<PostRecord> posts_;
  std::optional<GrowRequest> refusal_;  // the request the last refusal answered, and why
  std::string refusal_reason_;
  std::exception_ptr failure_;
  uint64_t posts_passed_ = 0;
  const void* passed_stream_ = nullptr;
  bool direct_enabled_ = true;
};

}  // namespace pipecomm::transport
