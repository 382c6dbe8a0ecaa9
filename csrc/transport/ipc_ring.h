// CUDA-IPC ring: one direction of a point-to-point channel between two processes on one host, each
// process driving its own GPU (or both the same GPU). Plain C++17 over the CUDA runtime API; the
// driver's stream memory operations are reached through cudaGetDriverEntryPoint*, so nothing links
// libcuda directly.
//
// The receiver owns, on its device, one flags allocation (ready[K] and ack[K] uint32 counters and one
// `posted` counter, each in its own 64-byte line, zeroed once and never reallocated) and one data
// allocation of K slots per generation. Both are exported with cudaIpcGetMemHandle;
// export_handles()/resize() serialize them and the layer above carries the bytes to the sender (job
// store, host channel).
//
// Generations: each starts at a message seq (first_seq). Message seq lives in the generation with the
// largest first_seq <= seq, the newer one on a tie; both ends apply that rule, so a generation made
// for a later message (a shrink, which must start beyond anything the sender may already have
// enqueued) and one made meanwhile for an earlier message (a grow) can coexist. A generation that no
// message from an end's next seq on can reach is given back at once: the sender unmaps it once its
// copies into it are done, the receiver hands it back to its allocator with the streams that read it
// (the sender's writes precede those reads).
//
// Message seq (0, 1, 2, ... per direction) uses slot = seq % K and round = seq / K + 1 (uint32, compared
// wrap-safely by the GPU). Everything is stream-ordered, the host never blocks. The slot path:
//   sender:   wait ack[slot] >= round - 1; copy regions into the peer slot; write ready[slot] = round
//   receiver: wait ready[slot] >= round;   copy regions out of the slot;    write ack[slot] = round
// (round - 1 when the slot's previous message also went by slot; see below for the general rule).
//
// Direct path ("posted receive"): the receiver may also offer, ahead of time, a destination buffer for
// message seq anywhere in an IPC-exportable allocation of its own (export_pointer()). Its posts are
// numbered 0, 1, 2, ... (more than one may name the same message, e.g. after a layout change); for
// post p it enqueues posted = p + 1 on the stream it allocated the buffer on, and passes p, handle
// and offset to the sender out of band. Then:
//   sender:   wait posted >= p + 1; copy regions into the buffer; write ready[slot] = round
//   receiver: wait ready[slot] >= round
// A direct message uses no slot data, so it is never acknowledged: the sender remembers per slot
// the round of its last slot-path message and waits for that ack before reusing the slot's data.
// ready[slot] must still rise in message order: when a slot's previous message was enqueued on
// another stream, a send first waits ready[slot] >= round - 1 (or, after a slot-path message, the
// ack, as above). In a steady stream on one stream the direct path thus costs one wait and one write.
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

// The slot size a request of `bytes` gets (at least one alignment unit); ProtocolError, starting with
// prefix, when it overflows.
size_t round_slot_bytes(size_t bytes, const std::string& prefix);

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
  uint64_t posts_ordered_before(cudaStream_t stream) const {
    return posted_before_ && stream == last_post_stream_ ? written_posts_ : 0;
  }

  // Enqueues on `stream` (the one post's buffer was allocated on) posted = post + 1, after
  // everything earlier posts' streams had reached: the counter then only grows on the device,
  // whatever streams the posts came from. post must exceed every earlier one. The write itself goes
  // with the next receive enqueued on `stream`, in the same driver call (or ahead of a post on, or a
  // receive on, another stream); until then posts_ordered_before() does not count it.
  void enqueue_post(uint64_t post, cudaStream_t stream);

  int device() const { return device_; }
  uint32_t num_slots() const { return num_slots_; }
  // Of the generation that messages from now on end up in (the largest first_seq).
  size_t slot_bytes() const { return latest().slot_bytes; }
  uint32_t generation() const { return latest().generation; }
  // Data generations allocated now, given-back ones excluded.
  size_t live_generations() const { return generations_.size(); }
  uint64_t next_seq() const { return next_seq_; }

 private:
  struct Generation {
    uint32_t generation;
    uint64_t first_seq;
    size_t slot_bytes;
    void* data;
    cudaIpcMemHandle_t handle;
    size_t offset;  // of data in the allocation `handle` names
    bool from_allocator;
    std::vector<cudaStream_t> readers;
  };
  struct ExportedAllocation {
    unsigned long long buffer_id;
    uintptr_t base;
    cudaIpcMemHandle_t handle;
  };
  void add_generation(size_t slot_bytes, uint64_t first_seq);
  void check_not_received(uint64_t first_seq) const;
  const Generation& latest() const;
  void give_back_superseded() noexcept;
  void write_deferred_post();
  // The posted value to write ahead of a receive on `stream` (0: none owed there).
  uint32_t take_deferred_post(cudaStream_t stream);
  std::string serialize(const Generation& generation) const;
  void release_all() noexcept;

  int device_;
  uint32_t num_slots_;
  std::string error_prefix_;
  std::unique_ptr<GenerationAllocator> allocator_;
  std::vector<void*> superseded_owned_;  // cudaMalloc'd generations no message uses, freed at destruction
  size_t sm_max_bytes_;
  std::string pci_bus_id_;
  void* flags_ = nullptr;
  cudaIpcMemHandle_t flags_handle_{};
  std::vector<Generation> generations_;
  uint32_t next_generation_ = 0;
  uint64_t next_seq_ = 0;
  std::vector<ExportedAllocation> exported_;
  uint64_t next_post_ = 0;
  uint64_t written_posts_ = 0;  // the posted value last enqueued
  bool post_deferred_ = false;  // next_post_ is yet to be written
  bool posted_before_ = false;
  cudaStream_t last_post_stream_ = nullptr;
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

  // Maps another data generation (resize() output of the same receiver); messages go by the rule
  // above. Throws ProtocolError if this sender already enqueued first_seq, or the blob is of another
  // receiver. A generation seen before is ignored.
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
  uint32_t num_slots() const { return num_slots_; }
  // Slot size of the generation that message next_seq() goes to.
  size_t slot_bytes() const;
  uint32_t generation() const;
  uint64_t next_seq() const { return next_seq_; }

 private:
  struct Generation {
    uint32_t generation;
    uint64_t first_seq;
    size_t slot_bytes;
    char* base;  // the receiver's allocation, mapped in this process
    char* data;  // base + the generation's offset
    std::vector<cudaStream_t> writers;
  };
  // A receiver allocation that posted buffers lie in, mapped here. Unmapping waits for every copy
  // into it, so it remembers the streams those ran on.
  struct PeerAllocation {
    cudaIpcMemHandle_t handle;
    char* base;
    uint64_t last_use;
    std::vector<cudaStream_t> streams;
  };
  // What the next message in a slot must order itself after.
  struct SlotHistory {
    uint32_t slot_round = 0;  // round of the slot's last slot-path message; 0: none yet
    cudaStream_t stream = nullptr;  // of the slot's last message (either path)
  };
  // Evicted from the mapping cache; unmapped once every fence has passed.
  struct RetiredAllocation {
    char* base;
    std::vector<cudaEvent_t> fences;
  };
  PeerAllocation* map_peer_allocation(const cudaIpcMemHandle_t& handle);
  void map_generation(const IpcRingHandleInfo& info, const std::string& handles);
  void retire(char* base, const std::vector<cudaStream_t>& streams);
  void retire_superseded();
  void unmap_retired_allocations(bool all) noexcept;
  // Closes every mapping of the receiver's memory; its copies must be done.
  void close_mappings() noexcept;
  void release_all() noexcept;

  int device_;
  std::string error_prefix_;
  size_t sm_max_bytes_;
  std::string pci_bus_id_;
  int32_t owner_pid_ = 0;
  int peer_device_ = -1;
  uint32_t num_slots_ = 0;
  std::string flags_handle_bytes_;
  void* flags_ = nullptr;  // mapped in this process
  std::vector<Generation> generations_;
  std::vector<uint32_t> known_generations_;  // every generation number mapped so far
  uint64_t next_seq_ = 0;
  std::vector<SlotHistory> slot_history_;
  std::vector<cudaStream_t> send_streams_;  // every stream a send was enqueued on
  std::vector<PeerAllocation> peer_allocations_;
  std::vector<RetiredAllocation> retired_allocations_;
  uint64_t allocation_uses_ = 0;
  bool abandoned_ = false;
};

}  // namespace pipecomm::transport
