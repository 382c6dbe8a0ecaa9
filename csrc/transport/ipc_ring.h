// CUDA-IPC ring: one direction of a point-to-point channel between two processes on one host, each
// process driving its own GPU (or both the same GPU). Plain C++17 over the CUDA runtime API; the
// driver's stream memory operations are reached through cudaGetDriverEntryPoint*, so nothing links
// libcuda directly.
//
// The protocol (slots, rounds, generations, the direct path, posts) is ipc_protocol.h's: it plans every
// step, and these classes carry the steps out on the device. The receiver's flags allocation (zeroed
// once, never reallocated) and its data generations live in device memory of its GPU and are exported
// with cudaIpcGetMemHandle; export_handles()/resize() serialize them, the layer above carries the bytes
// to the sender (job store, host channel), and the sender maps them with cudaIpcOpenMemHandle. A step's
// waits and writes are stream memory operations (batched into one driver call when a step has two or
// more), its copies one cudaMemcpyAsync per region; the default flags of a memory write put a barrier
// before it, so the data is visible before the flag. A superseded generation goes back to the
// GenerationAllocator with the streams that read it; the sender unmaps one behind events recorded on
// the streams that wrote it.
//
// Peer death: a stream waiting on a flag that a dead peer will never write never completes, and
// neither does anything queued behind it (nor cudaDeviceSynchronize, nor the destructors below, which
// synchronize before freeing/unmapping). That is why the host layer checks the peer's liveness over
// its metadata channel before enqueuing, and why a process whose peer died mid-transfer should call
// abandon() on its ring ends (or exit) instead of destroying them normally.
//
// Small messages: with PIPECOMM_IPC_SM_MAX_BYTES=N, a message of 1 .. N bytes is copied by one thread block
// with loads and stores, which also raises the flag (sm_transfer.h): one launch instead of a copy-engine
// copy per tensor and a memory write. A send's block also polls the send's flags; a receive waits with
// the stream memory operation first, so no block sits on an SM while waiting for the peer. Off by default;
// the flags mean the same either way, so the two ends need not agree.
//
// Each end is used by one host thread at a time.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ipc_protocol.h"  // CopyRegion, round_slot_bytes, IpcRingHandleInfo, parse_ipc_ring_handles

namespace pipecomm::transport {

// Where a receiver's data generations come from. A caching allocator (torch's) lets a generation go
// back without cudaFree, which may synchronize the device: a hang while a stream waits on a peer.
class GenerationAllocator {
 public:
  virtual ~GenerationAllocator() = default;
  // Device memory of the receiver's device, or nullptr when there is none to give.
  virtual void* allocate(size_t bytes) = 0;
  // Takes memory back; `readers` (streams of the receiver's device) may still be reading it, so it
  // must not be reused before they pass their current point.
  virtual void release(void* data, const std::vector<cudaStream_t>& readers) noexcept = 0;
};

class IpcRingReceiver {
 public:
  // Allocates flags and the first data generation on `device`. error_prefix starts every error
  // message, e.g. "pipecomm ipc channel rank 1 -> rank 0". Data generations come from `allocator`
  // when given and exportable there; otherwise from cudaMalloc, and those are freed only at
  // destruction.
  IpcRingReceiver(int device, uint32_t num_slots, size_t slot_bytes, std::string error_prefix = "",
                  std::unique_ptr<GenerationAllocator> allocator = nullptr);
  // Synchronizes the device, then frees every generation (unless abandon() was called).
  ~IpcRingReceiver();
  IpcRingReceiver(const IpcRingReceiver&) = delete;
  IpcRingReceiver& operator=(const IpcRingReceiver&) = delete;

  // Serialized handles of the flags and of the generation that messages from now on end up in.
  std::string export_handles() const;

  // New data generation with slots of slot_bytes (rounded up) for messages from first_seq on (no
  // earlier than the next message to enqueue); returns its serialized handles, which the sender must
  // update() to before it sends first_seq. Generations it supersedes are given back once the
  // receives of their last messages are enqueued.
  std::string resize(size_t slot_bytes, uint64_t first_seq);
  // resize() to max(min_slot_bytes, twice the slots that message first_seq would use).
  std::string grow(size_t min_slot_bytes, uint64_t first_seq);

  // Enqueues on `stream` (of this end's device): wait ready[slot] >= round, one
  // cudaMemcpyAsync(local, slot + slot_offset, bytes) per region, write ack[slot] = round.
  // seq must be exactly the next one (0, 1, 2, ...). A region of 0 bytes copies nothing.
  void enqueue_receive(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream);
  void enqueue_receive(uint64_t seq, const std::vector<CopyRegion>& regions, cudaStream_t stream) {
    enqueue_receive(seq, regions.data(), regions.size(), stream);
  }

  // For a message the sender wrote into a posted buffer: enqueues on `stream` only the wait
  // ready[slot] >= round (no copy, no acknowledgement). seq must be exactly the next one.
  void enqueue_receive_direct(uint64_t seq, cudaStream_t stream);

  // For the messages from seq up to next_seq() whose receives were enqueued ahead of data that will not
  // come (the peer sent them otherwise): writes their ready flags from this end, on a stream of its own, so
  // that the streams waiting on them go on (reading what is there) instead of never completing. The ring
  // carries no message afterwards.
  void release_own_waits(uint64_t seq) noexcept;

  // Skip synchronization and freeing in the destructor (leaks the device memory, the allocator's
  // generations included). For a process whose peer died while streams still wait on its flags, and
  // for one whose peer may still have this end's memory mapped: freeing exported memory before the
  // importer closes its mapping is undefined behaviour.
  void abandon() noexcept { abandoned_ = true; }

  // Where `pointer` (device memory of this end's device) lies for a peer process: the IPC handle of
  // the allocation holding it and its offset there. Returns false, with the runtime's error cleared,
  // when that allocation cannot be exported (e.g. virtual-memory or stream-ordered allocations):
  // the caller then keeps to the slot path. Handles are cached per allocation (by the driver's
  // buffer id, unique for the process's lifetime), so a steady stream of buffers costs one driver
  // query each.
  bool export_pointer(const void* pointer, cudaIpcMemHandle_t* handle, size_t* offset);

  // How many posts (0 .. n - 1) have their counter write ordered before whatever is enqueued next
  // on `stream`: all of them on the stream of the last post (earlier posts' streams are chained to
  // it), none elsewhere.
  uint64_t posts_ordered_before(cudaStream_t stream) const { return protocol_.posts_ordered_before(stream); }

  // Enqueues on `stream` (the one post's buffer was allocated on) posted = post + 1, after
  // everything earlier posts' streams had reached: the counter then only grows on the device,
  // whatever streams the posts came from. post must exceed every earlier one. The write itself goes
  // with the next receive enqueued on `stream`, in the same driver call (or ahead of a post on, or a
  // receive on, another stream); until then posts_ordered_before() does not count it.
  void enqueue_post(uint64_t post, cudaStream_t stream);

  int device() const { return device_; }
  uint32_t num_slots() const { return protocol_.num_slots(); }
  // Of the generation that messages from now on end up in (the largest first_seq).
  size_t slot_bytes() const { return protocol_.generations().latest().slot_bytes; }
  uint32_t generation() const { return protocol_.generations().latest().number; }
  // Data generations allocated now, given-back ones excluded.
  size_t live_generations() const { return protocol_.generations().size(); }
  uint64_t next_seq() const { return protocol_.next_seq(); }

 private:
  // The device memory of a data generation (the protocol knows the rest of it).
  struct GenerationMemory {
    uint32_t generation;
    void* data;
    cudaIpcMemHandle_t handle;
    size_t offset;  // of data in the allocation `handle` names
    bool from_allocator;
  };
  struct ExportedAllocation {
    unsigned long long buffer_id;
    uintptr_t base;
    cudaIpcMemHandle_t handle;
  };
  void add_generation(const ipc::NewGeneration& generation);
  void enqueue_receive_plan(const ipc::ReceivePlan& plan);
  void enqueue_post_write(const ipc::PostWrite& write);
  void give_back_unreachable() noexcept;
  std::string serialize(const ipc::Generation& generation) const;
  void release_all() noexcept;

  int device_;
  std::string error_prefix_;
  std::unique_ptr<GenerationAllocator> allocator_;
  size_t sm_max_bytes_;
  ipc::ReceiverProtocol protocol_;
  std::vector<void*> superseded_owned_;  // cudaMalloc'd generations no message uses, freed at destruction
  std::string pci_bus_id_;
  void* flags_ = nullptr;
  cudaIpcMemHandle_t flags_handle_{};
  std::vector<GenerationMemory> memory_;  // of every generation in protocol_.generations()
  std::vector<ExportedAllocation> exported_;
  cudaEvent_t post_fence_ = nullptr;
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

  // Maps another data generation (resize() output of the same receiver); messages go by the
  // generation rule of ipc_protocol.h. Throws ProtocolError if this sender already enqueued first_seq,
  // or the blob is of another receiver. A generation seen before is ignored.
  void update(const std::string& handles);

  // Enqueues on `stream` (of this end's device): wait for the ack of the slot's last slot-path
  // message (round - 1 when all go by slot; after a direct message on another stream, also
  // ready[slot] >= round - 1), one cudaMemcpyAsync(peer slot + slot_offset, local, bytes) per region,
  // write ready[slot] = round.
  // Every region must fit the slot (ProtocolError naming seq, region and sizes otherwise, before
  // anything is enqueued). seq must be exactly the next one (0, 1, 2, ...).
  void enqueue_send(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream);
  void enqueue_send(uint64_t seq, const std::vector<CopyRegion>& regions, cudaStream_t stream) {
    enqueue_send(seq, regions.data(), regions.size(), stream);
  }

  // The direct path: like enqueue_send, but the regions' slot_offset are relative to the receiver's
  // buffer of `post` (made for message seq), which lies `offset` bytes into the allocation `handle`
  // names and holds `capacity` bytes (ProtocolError before anything is enqueued if a region does not
  // fit). Waits posted >= post + 1 before copying, unless `posted_passed` says `stream` is already
  // ordered after that write (the caller knows it from the peer's messages). Returns false, having
  // enqueued nothing and kept seq unsent, when that allocation cannot be mapped here: the caller then
  // uses the slot path.
  bool enqueue_send_direct(uint64_t seq, uint64_t post, const cudaIpcMemHandle_t& handle, size_t offset,
                           size_t capacity, const CopyRegion* regions, size_t count, cudaStream_t stream,
                           bool posted_passed = false);

  // Maps the receiver allocation `handle` names (or finds it mapped). False, with the runtime's error
  // cleared, when it cannot be mapped here; after true, enqueue_send_direct with that handle does not
  // return false.
  bool can_map(const cudaIpcMemHandle_t& handle);

  // Enqueues on `stream` a wait until the receiver has copied message seq out of its slot
  // (ack[slot] >= round). For flushing or timing; the host does not block. Only for a message sent
  // by the slot path: direct messages are never acknowledged.
  void enqueue_wait_consumed(uint64_t seq, cudaStream_t stream);

  void abandon() noexcept { abandoned_ = true; }

  // Closes every mapping of the receiver's memory once every send enqueued so far has finished,
  // waiting up to `patience` for that (no device synchronization); returns whether it did. The
  // receiver may free its memory only after that. No send may follow.
  bool unmap_when_done(std::chrono::microseconds patience) noexcept;

  int device() const { return device_; }
  int peer_device() const { return peer_device_; }  // -1 when not visible in this process
  size_t mapped_peer_allocations() const { return peer_allocations_.size(); }
  uint32_t num_slots() const { return protocol_.num_slots(); }
  // Slot size of the generation that message next_seq() goes to.
  size_t slot_bytes() const { return protocol_.next_generation().slot_bytes; }
  uint32_t generation() const { return protocol_.next_generation().number; }
  uint64_t next_seq() const { return protocol_.next_seq(); }

 private:
  // A data generation of the receiver, mapped in this process.
  struct MappedGeneration {
    uint32_t generation;
    char* base;  // the receiver's allocation
    char* data;  // base + the generation's offset
  };
  // A receiver allocation that posted buffers lie in, mapped here. Unmapping waits for every copy
  // into it, so it remembers the streams those ran on.
  struct PeerAllocation {
    cudaIpcMemHandle_t handle;
    char* base;
    uint64_t last_use;
    std::vector<ipc::StreamId> streams;
  };
  // Evicted from the mapping cache; unmapped once every fence has passed.
  struct RetiredAllocation {
    char* base;
    std::vector<cudaEvent_t> fences;
  };
  PeerAllocation* map_peer_allocation(const cudaIpcMemHandle_t& handle);
  void map_generation(const ipc::HandleBlob& blob);
  // Records the send once `plan` is enqueued; retires the generations no later send reaches.
  void finish_send(const ipc::SendPlan& plan);
  void retire(char* base, const std::vector<ipc::StreamId>& streams);
  void retire_unreachable_generations();
  void unmap_retired_allocations(bool all) noexcept;
  // Closes every mapping of the receiver's memory; its copies must be done.
  void close_mappings() noexcept;
  void release_all() noexcept;

  int device_;
  std::string error_prefix_;
  size_t sm_max_bytes_;
  ipc::SenderProtocol protocol_;
  int peer_device_ = -1;
  void* flags_ = nullptr;  // mapped in this process
  std::vector<MappedGeneration> mapped_generations_;  // of every generation in protocol_.generations()
  std::vector<PeerAllocation> peer_allocations_;
  std::vector<RetiredAllocation> retired_allocations_;
  uint64_t allocation_uses_ = 0;
  bool abandoned_ = false;
};

}  // namespace pipecomm::transport
