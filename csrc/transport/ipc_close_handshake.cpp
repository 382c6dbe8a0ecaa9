// An IPC channel's last notes: each end tells the other it unmapped its memory, and reads whether the peer did.
#include "ipc_close_handshake.h"

#include <thread>

#include "ring_tags.h"

namespace pipecomm::transport {

CloseOutcome exchange_close_notes(ShmRingSender& host_sender, HostInbox& inbox, bool unmapped,
                                  std::chrono::microseconds patience) noexcept {
  if (unmapped) {
    try {
      if (host_sender.can_send_now()) host_sender.send_bytes(nullptr, 0, kTagUnmapped);
    } catch (...) {
      // The peer closed or died already: it decides without the note.
    }
  }
  CloseOutcome outcome{false, false};
  const auto deadline = std::chrono::steady_clock::now() + patience;
  try {
    while (true) {
      inbox.poll(nullptr);
      while (const std::optional<Message> message = inbox.next_message()) {
        outcome.unreceived = true;
        inbox.release(message->seq);
      }
      // The note is the peer's last message: whatever it sent before was counted above.
      if (inbox.peer_unmapped()) {
        outcome.peer_unmapped = true;
        break;
      }
      if (const std::exception_ptr failure = inbox.failure()) std::rethrow_exception(failure);
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  } catch (const PeerDiedError&) {
    outcome.peer_unmapped = true;  // the driver closed a dead process's mappings
    outcome.unreceived = true;     // but whether its last copies were cut off first, nobody can tell
  } catch (...) {
    outcome.unreceived = true;  // closed without the note, or the ring is in error: assume the worst
  }
  return outcome;
}

}  // namespace pipecomm::transport
