// Message kinds on the channels' shared-memory rings: what a message's payload is.
#pragma once

#include <cstdint>

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

}  // namespace pipecomm::transport
