// What the peer sent on an IPC channel's host ring, read ahead of the receives: its grow requests are
// answered at once, even behind messages this end has yet to receive.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "ipc_control.h"
#include "ipc_records.h"
#include "shm_ring.h"

namespace pipecomm::transport {

// Not thread-safe: its channel's call mutex covers every use.
class HostInbox {
 public:
  // Answers a grow request, or returns false when it cannot now: it is offered again at the next
  // poll, and later requests wait behind it.
  using GrowAnswer = std::function<bool(const GrowRequest&)>;

  // `ring`, from peer_rank to self_rank, holds at most num_slots messages unreleased.
  HostInbox(ShmRingReceiver& ring, uint32_t num_slots, int self_rank, int peer_rank);

  // Takes in whatever has arrived and hands each grow request to `answer` (an empty one leaves them
  // unanswered). Never waits. A ring failure (the peer closed or died, a malformed message) ends
  // the reading for good; failure() then holds it.
  void poll(const GrowAnswer& answer);

  // The next metadata or data message already taken in, in order; each is handed out once and stays
  // valid until released.
  std::optional<Message> next_message();
  // The next one, waited for up to timeout_s: each look polls with `answer`, and each pause services
  // `plane`, so that a peer waiting for this process's answer on another channel gets it too. Raises
  // the ring's failure, ProtocolError once `interrupted` is set and TimeoutError past the timeout,
  // worded as the ring's own receive words them.
  Message wait_for_message(const GrowAnswer& answer, ControlPlane& plane, double timeout_s,
                           const std::atomic<bool>& interrupted);
  // Hands message seq's slot back to the peer, with those of the control messages before it.
  void release(uint64_t seq);
  // How many of the ring's messages were handed back so far (they go back in ring order).
  uint64_t released() const { return released_; }

  // The ring's error that ended the reading, once all messages before it were handed out; else null.
  std::exception_ptr failure() const { return pending_messages() == 0 ? failure_ : nullptr; }
  // Whether the peer's last note said it unmapped this end's memory.
  bool peer_unmapped() const { return peer_unmapped_; }

 private:
  struct Entry {
    Message message;
    bool is_control;  // a grow request or the close note: never handed out
    bool done;        // a grow request answered, or any other message handed out
  };

  void take(const Message& message);
  void check_wait(const ServicingWait& wait, const std::atomic<bool>& interrupted) const;
  void answer_requests(const GrowAnswer& answer);
  void release_done_control();
  size_t pending_messages() const;

  ShmRingReceiver& ring_;
  uint32_t num_slots_;
  int self_rank_;
  int peer_rank_;
  std::string direction_;  // "pipecomm ipc channel rank <peer> -> rank <self>", which starts errors
  std::deque<Entry> entries_;  // taken from the ring and not yet released, in ring order
  std::exception_ptr failure_;
  bool peer_unmapped_ = false;
  uint64_t released_ = 0;
};

}  // namespace pipecomm::transport
