// How far an IPC channel's receiver may run ahead of the peer's notes (ipc_channel.cpp, Channel.recv's layout
// key): plain arithmetic over what the receiver knows of its host ring, so that a model of both ends tests it.
//
// The peer decides how to send data message n (into a posted buffer, or by slot) right after its host ring took
// its previous host message, and that ring holds num_slots messages this end has not released. With the layout
// repeated, which a message received ahead must have, data message n is host message
// known_host_seq + n - known_data_seq (no metadata or grow request between), and fewer host messages before it
// only make it later.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace pipecomm::transport {

struct ReceiveAheadBounds {
  uint32_t num_slots;      // of the host ring
  uint64_t released;       // host messages this end released so far (they go back in order)
  int64_t known_data_seq;  // the last data message whose note this end read; -1: none yet
  int64_t known_host_seq;  // the host message that carried that note

  // The first data message that a post sent now reaches before the peer decides how to send it: the peer
  // decides on n after its ring took host message h(n - 1) >= known_host_seq + n - 1 - known_data_seq, which
  // needs a release this end has not made while released + num_slots <= h(n - 1).
  uint64_t first_decided_after_posting() const {
    if (known_data_seq < 0) return std::numeric_limits<uint64_t>::max();
    const int64_t first = static_cast<int64_t>(released) + known_data_seq - known_host_seq + 1 +
                          static_cast<int64_t>(num_slots);
    return static_cast<uint64_t>(std::max<int64_t>(first, 0));
  }

  // The first data message the peer cannot send before this end releases more: message n goes once its host
  // message known_host_seq + n - known_data_seq is below released + num_slots.
  int64_t first_unsendable() const {
    return static_cast<int64_t>(released) + static_cast<int64_t>(num_slots) - known_host_seq + known_data_seq;
  }
};

}  // namespace pipecomm::transport
