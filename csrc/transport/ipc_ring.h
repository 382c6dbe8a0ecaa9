// CUDA-IPC ring: one direction of a point-to-point channel between two processes on one host, each
// process driving its own GPU (or both the same GPU). Plain C++17 over the CUDA runtime API; the
// driver's stream memory operations are reached through cudaGetDriverEntryPoint*, so nothing links
// libcuda directly.
//
// The receiver owns, on its device, one flags allocation (ready[K] and ack[K] uint32 counters, each in
// its own 64-byte line, zeroed once and never reallocated) and one data allocation of K slots per
// generation. Both are exported with cudaIpcGetMemHandle; export_handles()/grow() serialize them and
// the layer above carries the bytes to the sender (job store, host channel).
//
// Message seq (0, 1, 2, ... per direction) uses slot = seq % K and round = seq / K + 1 (uint32, compared
// wrap-safely by the GPU). Everything is stream-ordered, the host never blocks:
//   sender:   wait ack[slot] >= round - 1; copy regions into the peer slot; write ready[slot] = round
//   receiver: wait ready[slot] >= round;   copy regions out of the slot;    write ack[slot] = round
//
// Peer death: a stream waiting on a flag that a dead peer will never write never completes, and
// neither does anything queued behind it (nor cudaDeviceSynchronize, nor the destructors below, which
// synchronize before freeing/unmapping). That is why the host layer checks the peer's liveness over
// its metadata channel before enqueuing, and why a process whose peer died mid-transfer should call
// abandon() on its ring ends (or exit) instead of destroying them normally.
//
// Each end is used by one host thread at a time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pipecomm::transport {

// One contiguous piece of a message. `local` is a device pointer of the calling process on the
// calling end's device; `slot_offset` is where the piece lives inside the slot.
struct CopyRegion {
  void* local;
  size_t slot_offset;
  size_t bytes;
};

// Slot sizes are rounded up to a multiple of this.
inline constexpr size_t kIpcSlotAlignment = 256;

// What a serialized handle blob says (export_handles()/grow() output), for checks and diagnostics.
struct IpcRingHandleInfo {
  std::string pci_bus_id;  // of the receiver's device, e.g. "0000:1B:00.0"
  int32_t owner_pid = 0;
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  uint32_t generation = 0;
  uint64_t first_seq = 0;  // first message seq that uses this data generation
};

// Parses a blob; throws ProtocolError when it is not one.
IpcRingHandleInfo parse_ipc_ring_handles(const std::string& handles);

class IpcRingReceiver {
 public:
  // Allocates flags and the first data generation on `device`. error_prefix starts every error
  // message, e.g. "pipecomm ipc channel rank 1 -> rank 0".
  IpcRingReceiver(int device, uint32_t num_slots, size_t slot_bytes, std::string error_prefix = "");
  // Synchronizes the device, then frees every generation (unless abandon() was called).
  ~IpcRingReceiver();
  IpcRingReceiver(const IpcRingReceiver&) = delete;
  IpcRingReceiver& operator=(const IpcRingReceiver&) = delete;

  // Serialized handles of the flags and the newest data generation.
  std::string export_handles() const;

  // New data generation with slots of max(min_slot_bytes, 2 * slot_bytes()) bytes (rounded up) for
  // messages from first_seq on (no earlier than any message already enqueued); returns its
  // serialized handles, which the sender must update() to before it sends first_seq. Earlier
  // generations stay allocated until destruction, so receives already enqueued stay valid.
  std::string grow(size_t min_slot_bytes, uint64_t first_seq);

  // Enqueues on `stream` (of this end's device): wait ready[slot] >= round, one
  // cudaMemcpyAsync(local, slot + slot_offset, bytes) per region, write ack[slot] = round.
  // seq must be exactly the next one (0, 1, 2, ...). A region of 0 bytes copies nothing.
  void enqueue_receive(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream);
  void enqueue_receive(uint64_t seq, const std::vector<CopyRegion>& regions, cudaStream_t stream) {
    enqueue_receive(seq, regions.data(), regions.size(), stream);
  }

  // Skip synchronization and freeing in the destructor (leaks the device memory). For a process
  // whose peer died while streams still wait on its flags.
  void abandon() noexcept { abandoned_ = true; }

  int device() const { return device_; }
  uint32_t num_slots() const { return num_slots_; }
  size_t slot_bytes() const { return generations_.back().slot_bytes; }
  uint32_t generation() const { return generations_.back().generation; }
  uint64_t next_seq() const { return next_seq_; }

 private:
  struct Generation {
    uint32_t generation;
    uint64_t first_seq;
    size_t slot_bytes;
    void* data;
    cudaIpcMemHandle_t handle;
  };
  void add_generation(size_t slot_bytes, uint64_t first_seq);
  std::string serialize(const Generation& generation) const;
  void release_all() noexcept;

  int device_;
  uint32_t num_slots_;
  std::string error_prefix_;
  std::string pci_bus_id_;
  void* flags_ = nullptr;
  cudaIpcMemHandle_t flags_handle_{};
  std::vector<Generation> generations_;
  uint64_t next_seq_ = 0;
  bool abandoned_ = false;
};

class IpcRingSender {
 public:
  // Opens the receiver's flags and data with cudaIpcOpenMemHandle on `device`; enables peer access
  // when the receiver's device is another one visible in this process. Throws ChannelError when
  // the two devices cannot access each other (the layer above may then fall back to the shm ring).
  IpcRingSender(int device, const std::string& receiver_handles, std::string error_prefix = "");
  // Synchronizes the device, then closes every mapping (unless abandon() was called).
  ~IpcRingSender();
  IpcRingSender(const IpcRingSender&) = delete;
  IpcRingSender& operator=(const IpcRingSender&) = delete;

  // Maps a newer data generation (grow() output of the same receiver). Messages from its first_seq
  // on go there; older mappings stay open until destruction. Throws ProtocolError if this sender
  // already enqueued first_seq, or the blob is of another receiver. An already-mapped generation
  // is ignored.
  void update(const std::string& handles);

  // Enqueues on `stream` (of this end's device): wait ack[slot] >= round - 1, one
  // cudaMemcpyAsync(peer slot + slot_offset, local, bytes) per region, write ready[slot] = round.
  // Every region must fit the slot (ProtocolError naming seq, region and sizes otherwise, before
  // anything is enqueued). seq must be exactly the next one (0, 1, 2, ...).
  void enqueue_send(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream);
  void enqueue_send(uint64_t seq, const std::vector<CopyRegion>& regions, cudaStream_t stream) {
    enqueue_send(seq, regions.data(), regions.size(), stream);
  }

  // Enqueues on `stream` a wait until the receiver has copied message seq out of its slot
  // (ack[slot] >= round). For flushing or timing; the host does not block.
  void enqueue_wait_consumed(uint64_t seq, cudaStream_t stream);

  void abandon() noexcept { abandoned_ = true; }

  int device() const { return device_; }
  int peer_device() const { return peer_device_; }  // -1 when not visible in this process
  uint32_t num_slots() const { return num_slots_; }
  // Slot size of the newest mapped generation.
  size_t slot_bytes() const { return generations_.back().slot_bytes; }
  uint32_t generation() const { return generations_.back().generation; }
  uint64_t next_seq() const { return next_seq_; }

 private:
  struct Generation {
    uint32_t generation;
    uint64_t first_seq;
    size_t slot_bytes;
    void* data;  // mapped in this process
  };
  void release_all() noexcept;

  int device_;
  std::string error_prefix_;
  std::string pci_bus_id_;
  int32_t owner_pid_ = 0;
  int peer_device_ = -1;
  uint32_t num_slots_ = 0;
  std::string flags_handle_bytes_;
  void* flags_ = nullptr;  // mapped in this process
  std::vector<Generation> generations_;
  uint64_t next_seq_ = 0;
  bool abandoned_ = false;
};

}  // namespace pipecomm::transport
