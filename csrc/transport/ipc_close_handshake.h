// The host-ring half of an IPC channel's close handshake: when an end may free the memory it exported.
//
// Freeing memory another process still has mapped is undefined behaviour (cudaIpcOpenMemHandle's
// documentation), so each end unmaps the peer's memory once its own sends are done and says so with a
// last note on its host ring; an end frees what it exported only when that note came, or when the peer
// died (its mappings died with it). Otherwise (a peer that closes much later, or whose sends never
// finished) it keeps that memory for the life of the process. Posted buffers are also kept when the peer
// sent a message this end never received (a step that failed half-way): its copy may still be writing
// into one of them.
#pragma once

#include <chrono>

#include "ipc_host_inbox.h"
#include "shm_ring.h"

namespace pipecomm::transport {

struct CloseOutcome {
  bool peer_unmapped;  // the peer's note came, or it died: what this end exported may be freed
  bool unreceived;     // the peer sent a message this end never received, or nobody can tell
};

// Sends this end's note if it `unmapped` the peer's memory, then reads the peer's messages for up to
// `patience` until its note comes (or came already). Grow requests are left unanswered.
CloseOutcome exchange_close_notes(ShmRingSender& host_sender, HostInbox& inbox, bool unmapped,
                                  std::chrono::microseconds patience) noexcept;

}  // namespace pipecomm::transport
