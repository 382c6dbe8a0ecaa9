// Reading an IPC channel's host ring ahead of its receives, answering grow requests on the way.
#include "ipc_host_inbox.h"

#include <cstring>

#include "ring_tags.h"

namespace pipecomm::transport {

HostInbox::HostInbox(ShmRingReceiver& ring, uint32_t num_slots, int self_rank, int peer_rank)
    : ring_(ring),
      num_slots_(num_slots),
      self_rank_(self_rank),
      peer_rank_(peer_rank),
      direction_("pipecomm ipc channel rank " + std::to_string(peer_rank) + " -> rank " + std::to_string(self_rank)) {}

void HostInbox::poll(const GrowAnswer& answer) {
  try {
    // Answers the ring's own grow (for a large metadata message) even when every slot is taken in.
    if (!failure_) ring_.service();
    // Taking in more than num_slots is refused by the ring, and the sender cannot have sent them.
    while (!failure_ && ring_.next_recv_seq() - ring_.released_count() < num_slots_) {
      const std::optional<Message> message = ring_.try_recv();
      if (!message) break;
      take(*message);
    }
  } catch (const ChannelError&) {
    failure_ = std::current_exception();
  }
  answer_requests(answer);
  release_done_control();
}

std::optional<Message> HostInbox::next_message() {
  for (Entry& entry : entries_) {
    if (entry.is_control || entry.done) continue;
    entry.done = true;
    return entry.message;
  }
  return std::nullopt;
}

Message HostInbox::wait_for_message(const GrowAnswer& answer, ControlPlane& plane, double timeout_s,
                                   const std::atomic<bool>& interrupted) {
  ServicingWait wait(timeout_s);
  while (true) {
    poll(answer);
    if (const std::optional<Message> message = next_message()) return *message;
    check_wait(wait, interrupted);
    wait.pause(plane, [this](std::chrono::microseconds longest) { ring_.sleep_until_notified(longest); });
  }
}

void HostInbox::check_wait(const ServicingWait& wait, const std::atomic<bool>& interrupted) const {
  if (const std::exception_ptr ended = failure()) std::rethrow_exception(ended);
  const bool stopped = interrupted.load(std::memory_order_acquire);
  if (!stopped && !wait.expired()) return;
  const uint64_t seq = ring_.next_recv_seq();
  const std::string self = "rank " + std::to_string(self_rank_);
  const std::string waiting = " waiting to receive message " + std::to_string(seq);
  if (stopped) {
    throw ProtocolError(direction_ + ": " + self + " stopped" + waiting + ": another thread is closing the channel");
  }
  throw TimeoutError(direction_ + ": " + self + " " + wait.timed_out() + waiting + " (rank " + std::to_string(peer_rank_) +
                     " has sent " + std::to_string(seq) + " messages)");
}

void HostInbox::release(uint64_t seq) {
  while (!entries_.empty() && entries_.front().message.seq <= seq) {
    ring_.release(entries_.front().message.seq);
    released_ = entries_.front().message.seq + 1;
    entries_.pop_front();
  }
  release_done_control();
}

void HostInbox::take(const Message& message) {
  if (message.tag == kTagGrow && message.bytes != sizeof(GrowRequest)) {
    throw ProtocolError(direction_ + ": host message " + std::to_string(message.seq) + " is a grow request of " +
                        std::to_string(message.bytes) + " bytes, not " + std::to_string(sizeof(GrowRequest)));
  }
  const bool close_note = message.tag == kTagUnmapped;
  if (close_note) peer_unmapped_ = true;
  entries_.push_back({message, message.tag == kTagGrow || close_note, close_note});
}

void HostInbox::answer_requests(const GrowAnswer& answer) {
  if (!answer) return;
  for (Entry& entry : entries_) {
    if (entry.message.tag != kTagGrow || entry.done) continue;
    GrowRequest request;
    std::memcpy(&request, entry.message.data, sizeof(request));
    if (!answer(request)) return;
    entry.done = true;
  }
}

// Control messages hold host slots the sender may be waiting for (with one slot, an answered request
// kept until the next receive would keep out the very message it was for), so they go back as soon as
// nothing before them is held.
void HostInbox::release_done_control() {
  while (!entries_.empty() && entries_.front().is_control && entries_.front().done) {
    ring_.release(entries_.front().message.seq);
    released_ = entries_.front().message.seq + 1;
    entries_.pop_front();
  }
}

size_t HostInbox::pending_messages() const {
  size_t pending = 0;
  for (const Entry& entry : entries_) pending += !entry.is_control && !entry.done;
  return pending;
}

}  // namespace pipecomm::transport
