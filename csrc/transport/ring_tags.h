// Message kinds on the channels' shared-memory rings: what a message's payload is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>

namespace pipecomm::transport {

// A channel's host ring.
constexpr uint32_t kTagMeta = 1;
constexpr uint32_t kTagData = 2;
constexpr uint32_t kTagDataDirect = 3;  // the IPC channel's data, already in a buffer the receiver posted
constexpr uint32_t kTagUnmapped = 6;    // the IPC channel's last note: the sender unmapped the receiver's memory
constexpr uint32_t kTagGrow = 7;        // the IPC channel's request for bigger slots (a GrowRequest)
// The IPC channel's post ring, which runs from the data's receiver back to its sender.
constexpr uint32_t kTagPost = 4;         // a buffer offered for one message (a PostRecord)
constexpr uint32_t kTagGeneration = 5;   // handles of a resized data generation: a shrink, or a grow's answer
constexpr uint32_t kTagGrowRefused = 8;  // a grow that could not be answered: its GrowRequest, then why

// The caller's notes (Channel.send_note) ride at the end of the sender's next data message (kTagData or
// kTagDataDirect), after what that holds, rather than in ring slots of their own: a slot each would let
// fewer messages wait in the ring than the schedules' deadlock check counts on (validate's buffer_slots).
// Each is a uint64 length, then its bytes.
inline void append_note(std::string& notes, const std::string& note) {
  const uint64_t length = note.size();
  notes.append(reinterpret_cast<const char*>(&length), sizeof(length));
  notes += note;
}

// Splits what append_note built back into notes, onto the end of `notes`; false where the bytes are
// not such notes.
inline bool read_notes(const void* data, size_t bytes, std::deque<std::string>& notes) {
  const char* next = static_cast<const char*>(data);
  while (bytes > 0) {
    uint64_t length = 0;
    if (bytes < sizeof(length)) return false;
    std::memcpy(&length, next, sizeof(length));
    next += sizeof(length);
    bytes -= sizeof(length);
    if (length > bytes) return false;
    notes.emplace_back(next, length);
    next += length;
    bytes -= length;
  }
  return true;
}

}  // namespace pipecomm::transport
