// Draining an IPC channel's post ring on the sending side, and choosing the post a message goes into.
#include "ipc_peer_posts.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "ring_tags.h"

namespace pipecomm::transport {

PeerPosts::PeerPosts(ShmRingReceiver& post_ring, std::string direction, AdoptGeneration adopt_generation)
    : ring_(post_ring), direction_(std::move(direction)), adopt_generation_(std::move(adopt_generation)) {}

void PeerPosts::drain(uint64_t next_seq) {
  while (!failure_) {
    std::optional<Message> message;
    try {
      message = ring_.try_recv();
    } catch (const ChannelError&) {
      // The peer closed or died: nothing more will come, and a send waiting for a grow learns why.
      failure_ = std::current_exception();
      direct_enabled_ = false;
      return;
    }
    if (!message) return;
    if (message->tag == kTagGeneration) {
      const std::string handles(static_cast<const char*>(message->data), message->bytes);
      ring_.release(message->seq);
      adopt_generation_(handles);
    } else if (message->tag == kTagGrowRefused && message->bytes >= sizeof(GrowRequest)) {
      refusal_.emplace();
      std::memcpy(&*refusal_, message->data, sizeof(GrowRequest));
      refusal_reason_.assign(static_cast<const char*>(message->data) + sizeof(GrowRequest),
                             message->bytes - sizeof(GrowRequest));
      ring_.release(message->seq);
    } else if (message->tag == kTagPost && message->bytes == sizeof(PostRecord)) {
      PostRecord record;
      std::memcpy(&record, message->data, sizeof(record));
      ring_.release(message->seq);
      if (direct_enabled_ && record.seq >= next_seq) posts_.push_back(record);
    } else {
      reject(*message);
    }
  }
}

std::optional<PostRecord> PeerPosts::post_for_next_message(uint64_t seq, uint64_t fingerprint, uint64_t bytes) {
  drain(seq);
  if (!direct_enabled_) return std::nullopt;
  posts_.erase(std::remove_if(posts_.begin(), posts_.end(), [&](const PostRecord& record) { return record.seq < seq; }),
               posts_.end());
  for (auto it = posts_.rbegin(); it != posts_.rend(); ++it) {
    if (it->seq == seq && it->fingerprint == fingerprint && it->bytes == bytes) return *it;
  }
  return std::nullopt;
}

std::optional<std::string> PeerPosts::refusal_of(const GrowRequest& request) const {
  if (!refusal_ || refusal_->first_seq != request.first_seq || refusal_->slot_bytes != request.slot_bytes) {
    return std::nullopt;
  }
  return refusal_reason_;
}

void PeerPosts::learn_passed(uint64_t posts_passed, const void* stream) {
  posts_passed_ = posts_passed;
  passed_stream_ = stream;
}

void PeerPosts::reject(const Message& message) const {
  throw ProtocolError(direction_ + ": post ring message " + std::to_string(message.seq) + " has tag " +
                      std::to_string(message.tag) + " and " + std::to_string(message.bytes) +
                      " bytes, neither a post record, data generation handles nor a refused grow");
}

}  // namespace pipecomm::transport
