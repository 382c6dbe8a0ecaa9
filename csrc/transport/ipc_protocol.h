// The CUDA-IPC ring's protocol core in plain C++ (no CUDA, no torch): it decides every step of a message
// and emits it as data; ipc_ring.cpp runs the steps as CUDA stream operations, the native test
// (tests/native/test_ipc_protocol.cpp) on host threads.
//
// One ring is one direction of a channel between two processes on one host. The receiver owns one flags
// allocation (FlagsLayout: ready[K] and ack[K] uint32 counters and one `posted` counter, each in its own
// 64-byte line, zeroed once and never reallocated) and one data allocation of K slots per generation; it
// exports both, and handle blobs (HandleBlob) carry them to the sender.
//
// Numbering: message seq (0, 1, 2, ... per direction) uses slot = seq % K and round = seq / K + 1, in
// uint32 counters that every wait compares wrap-safely (counter_reached). Everything is stream-ordered,
// the host never blocks. The slot path:
//   sender:   wait ack[slot] >= round - 1; copy regions into the peer slot; write ready[slot] = round
//   receiver: wait ready[slot] >= round;   copy regions out of the slot;    write ack[slot] = round
// (round - 1 when the slot's previous message also went by slot; SenderProtocol states the general rule).
//
// Generations: each starts at a message seq (first_seq). Message seq lives in the generation with the
// largest first_seq <= seq, the newer one on a tie; both ends apply that rule (GenerationTable), so a
// generation made for a later message (a shrink, which must start beyond anything the sender may already
// have enqueued) and one made meanwhile for an earlier message (a grow) can coexist. A generation that no
// message from an end's next seq on can reach is given back at once: the sender unmaps it once its copies
// into it are done, the receiver hands it back with the streams that read it (the sender's writes precede
// those reads).
//
// Direct path ("posted receive"): the receiver may also offer, ahead of time, a destination buffer for
// message seq anywhere in an exportable allocation of its own. Its posts are numbered 0, 1, 2, ... (more
// than one may name the same message, e.g. after a layout change); post p raises posted to p + 1 on the
// stream the buffer was allocated on, and p, handle and offset reach the sender out of band. Then:
//   sender:   wait posted >= p + 1; copy regions into the buffer; write ready[slot] = round
//   receiver: wait ready[slot] >= round
// A direct message uses no slot data, so it is never acknowledged.
//
// Each protocol object belongs to one end and is used by one host thread at a time. A transfer is
// planned (plan_*: checks, then the steps; nothing changes), the plan is enqueued, and only then recorded
// (sent/received/posted): a refused message leaves the ring as it was.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "errors.h"

namespace pipecomm::transport {

// One contiguous piece of a message. `local` is a pointer of the calling process on the calling end's
// device; `slot_offset` is where the piece lives inside the slot (or posted buffer).
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

// What a serialized handle blob says (export_handles()/resize() output), for checks and diagnostics.
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

namespace ipc {

inline constexpr uint32_t kMaxSlots = 1u << 16;
inline constexpr size_t kFlagLineBytes = 64;  // every counter in its own line
// At most this many waits precede a step's copies (a send: the slot's ack or ready, and posted).
inline constexpr int kMaxStepWaits = 2;

// A stream of the end's device, opaque here: the protocol only compares streams and remembers them.
using StreamId = void*;

// Adds stream to the streams that touched something, once.
void remember_stream(std::vector<StreamId>& streams, StreamId stream);

// An IPC memory handle (cudaIpcMemHandle_t), carried as opaque bytes.
using IpcHandle = std::array<unsigned char, 64>;

// Whether a counter now at `value` has reached `target`, compared wrap-safely as the device does
// (CU_STREAM_WAIT_VALUE_GEQ): rounds wrap around uint32 without a stall.
constexpr bool counter_reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// Where message seq lives: its slot, and the round that slot's counters reach for it.
struct SlotPosition {
  uint32_t slot;
  uint32_t round;
};

SlotPosition slot_position(uint64_t seq, uint32_t num_slots);

// "message <seq>, slot <slot>, round <round>", for error messages.
std::string describe_message(uint64_t seq, uint32_t num_slots);

// Byte offsets of the counters in the receiver's flags allocation: ready[K], then ack[K], then posted.
class FlagsLayout {
 public:
  explicit FlagsLayout(uint32_t num_slots) : num_slots_(num_slots) {}
  size_t ready(uint32_t slot) const { return size_t{slot} * kFlagLineBytes; }
  size_t ack(uint32_t slot) const { return (size_t{num_slots_} + slot) * kFlagLineBytes; }
  size_t posted() const { return size_t{2} * num_slots_ * kFlagLineBytes; }
  size_t bytes() const { return (size_t{2} * num_slots_ + 1) * kFlagLineBytes; }

 private:
  uint32_t num_slots_;
};

// A counter of the flags allocation, by its byte offset there, and the value it is waited for or set to.
struct CounterValue {
  size_t offset = 0;
  uint32_t value = 0;
  const char* name = "";  // for error messages
};

// Where a step's copies go (a send) or come from (a receive).
struct CopyTarget {
  enum class Kind : uint8_t {
    none,          // the step copies nothing
    slot,          // a slot of data generation `generation`, `offset` bytes into that generation's data
    posted_buffer  // a posted buffer, `offset` bytes into the allocation its handle names
  };
  Kind kind = Kind::none;
  uint32_t generation = 0;
  size_t offset = 0;
};

// One stream-ordered step, run in this order: the owed write, the waits (each until its counter reaches
// its value), one copy per region between `local` and target + slot_offset, the signal.
struct Step {
  std::optional<CounterValue> owed_write;  // a post's counter write, made with this step (see plan_post)
  std::array<CounterValue, kMaxStepWaits> waits{};
  int wait_count = 0;
  const CopyRegion* regions = nullptr;
  size_t region_count = 0;
  bool into_target = true;  // a send copies into the target, a receive out of it
  CopyTarget target;
  std::optional<CounterValue> signal;

  void wait(const CounterValue& counter) { waits[wait_count++] = counter; }
};

// A post's counter write that cannot ride with a step on its own stream, enqueued alone on `stream`.
struct PostWrite {
  StreamId stream;
  CounterValue counter;
  uint64_t post;  // the post it completes
};

// Orders everything enqueued on `waiter` from now on after everything already enqueued on `before`.
struct StreamFence {
  StreamId before;
  StreamId waiter;
};

// What one send enqueues: its step on `stream` (SenderProtocol states what the step waits for).
struct SendPlan {
  uint64_t seq;
  SlotPosition position;
  StreamId stream;
  bool direct;
  uint64_t post;  // direct: the post whose buffer it fills
  Step step;

  std::string describe() const;  // for error messages: what the step moves, and where
};

// What one receive enqueues: an owed post write on another stream, if any, then its step on `stream`.
struct ReceivePlan {
  uint64_t seq;
  SlotPosition position;
  StreamId stream;
  bool direct;
  std::optional<PostWrite> post_write_before;  // on the last post's stream, before the step
  Step step;

  std::string describe() const;
};

// What one post enqueues before its own counter write, which it leaves owed (ReceiverProtocol::plan_post).
struct PostPlan {
  uint64_t post;
  StreamId stream;
  std::optional<PostWrite> owed_write;  // the previous post's, on its stream, ahead of the fence
  std::optional<StreamFence> fence;     // the previous post's stream before this one's
};

// A data generation as one end knows it.
struct Generation {
  uint32_t number;
  uint64_t first_seq;
  size_t slot_bytes;
  // The streams that copied into it (sender) or out of it (receiver): giving it back waits for them.
  std::vector<StreamId> streams;
};

// A generation the receiver is about to allocate.
struct NewGeneration {
  uint32_t number;
  uint64_t first_seq;
  size_t slot_bytes;   // rounded
  size_t total_bytes;  // of all K slots
};

// The generations an end still uses, and the rule that places a message in one of them.
class GenerationTable {
 public:
  // The generation holding message seq: of those starting at or before it, the latest start, the newer
  // on a tie; a ProtocolError when none does.
  const Generation& holding(uint64_t seq, const std::string& error_prefix) const;
  // The generation that messages from now on end up in (the table is never empty when asked).
  const Generation& latest() const { return *find_holding(UINT64_MAX); }
  // The generation numbered `number`, or nullptr when given back or never added.
  const Generation* find(uint32_t number) const;
  void add(Generation generation) { generations_.push_back(std::move(generation)); }
  void remember_stream(uint32_t number, StreamId stream);
  // Moves out the generations no message from next_seq on can reach: superseded by one that starts at or
  // before next_seq (generations made later start there or later, so they never revive one).
  std::vector<Generation> take_unreachable(uint64_t next_seq);
  size_t size() const { return generations_.size(); }

 private:
  const Generation* find_holding(uint64_t seq) const;

  std::vector<Generation> generations_;
};

// A handle blob: the receiver's identity, its flags and one data generation, as raw bytes between the
// processes (one host, so host byte order). The format is versioned; both ends check it.
struct HandleBlob {
  IpcRingHandleInfo info;
  IpcHandle flags_handle{};
  IpcHandle data_handle{};
  uint64_t data_offset = 0;  // of the generation's data in the allocation data_handle names
};

std::string serialize_handle_blob(const HandleBlob& blob);
// Throws ProtocolError ("pipecomm ipc ring: ...") when `bytes` is not a blob of this format.
HandleBlob read_handle_blob(const std::string& bytes);

// The receiving end: its generations, its receives and its posts.
class ReceiverProtocol {
 public:
  // ProtocolError when num_slots is out of [1, kMaxSlots].
  ReceiverProtocol(uint32_t num_slots, std::string error_prefix);

  // The next generation, of slot_bytes (rounded up) per slot, for messages from first_seq on; refused
  // (ProtocolError) for a message already received or a size that overflows. Nothing changes until
  // add_generation(), once its memory exists.
  NewGeneration plan_generation(size_t slot_bytes, uint64_t first_seq) const;
  void add_generation(const NewGeneration& generation);
  // The slot size a grow for message first_seq asks for: max(min_slot_bytes, twice its current slots).
  size_t grown_slot_bytes(size_t min_slot_bytes, uint64_t first_seq) const;

  // Slot path: wait ready[slot] >= round, copy out of the slot, write ack[slot] = round.
  ReceivePlan plan_receive(uint64_t seq, const CopyRegion* regions, size_t count, StreamId stream) const;
  // Direct path: wait ready[slot] >= round only (the sender wrote into a posted buffer).
  ReceivePlan plan_receive_direct(uint64_t seq, StreamId stream) const;
  void received(const ReceivePlan& plan);

  // Post `post` raises posted to post + 1 on `stream`, after everything the previous post's stream had
  // reached (a fence), so the counter only grows on the device whatever streams the posts come from.
  // The write itself is owed: it rides with the next receive on `stream`, in the same step as that
  // receive's wait, or goes alone before a receive or post on another stream.
  PostPlan plan_post(uint64_t post, StreamId stream) const;
  void posted(const PostPlan& plan);
  // How many posts (0 .. n - 1) have their counter write ordered before whatever is enqueued next on
  // `stream`: the written ones on the stream of the last post, none elsewhere.
  uint64_t posts_ordered_before(StreamId stream) const {
    return post_state_ != PostState::none && stream == last_post_stream_ ? written_posts_ : 0;
  }

  // Generations no message from next_seq() on can reach, moved out to be given back with their readers.
  std::vector<Generation> take_unreachable_generations() { return generations_.take_unreachable(next_seq_); }

  uint32_t num_slots() const { return num_slots_; }
  const FlagsLayout& flags() const { return flags_; }
  const GenerationTable& generations() const { return generations_; }
  uint64_t next_seq() const { return next_seq_; }

 private:
  enum class PostState {
    none,        // nothing posted yet
    write_owed,  // the last post's counter write is not enqueued yet
    written      // every post's counter write is enqueued
  };
  void check_not_received(uint64_t first_seq) const;
  // Where the owed post write, if any, goes for a receive on `stream`.
  void place_owed_post_write(ReceivePlan& plan) const;
  CounterValue posted_counter(uint64_t posts) const;

  uint32_t num_slots_;
  std::string error_prefix_;
  FlagsLayout flags_;
  GenerationTable generations_;
  uint32_t next_generation_ = 0;
  uint64_t next_seq_ = 0;
  PostState post_state_ = PostState::none;
  uint64_t posts_ = 0;          // the counter's value after the last post: its number + 1
  uint64_t written_posts_ = 0;  // the value last enqueued
  StreamId last_post_stream_ = nullptr;
};

// The sending end: which generation each message goes to, and what each send waits for.
//
// A direct message uses no slot data, so the sender remembers per slot the round of its last slot-path
// message and waits for that ack before reusing the slot's data. ready[slot] must still rise in message
// order: when a slot's previous message was enqueued on another stream, a send first waits
// ready[slot] >= round - 1 (or, after a slot-path message, the ack, as above). In a steady stream on one
// stream the direct path thus costs one wait and one write.
class SenderProtocol {
 public:
  // From the receiver's first blob (ProtocolError naming "receiver handles" when it is not one). Its
  // generation is added by add_generation(), once mapped.
  SenderProtocol(const std::string& receiver_handles, std::string error_prefix);

  // The blob of a generation to map, or nothing for one seen before. ProtocolError for a blob of another
  // receiver, or one starting at a message already sent.
  std::optional<HandleBlob> new_generation(const std::string& handles) const;
  void add_generation(const IpcRingHandleInfo& info);

  // Slot path: every region must fit the slot (ProtocolError naming seq, region and sizes otherwise).
  SendPlan plan_send(uint64_t seq, const CopyRegion* regions, size_t count, StreamId stream) const;
  // Direct path into post's buffer, `buffer_offset` bytes into its allocation, holding `capacity` bytes.
  // Waits posted >= post + 1 unless `posted_passed` says `stream` is already ordered after that write.
  SendPlan plan_send_direct(uint64_t seq, uint64_t post, size_t buffer_offset, size_t capacity,
                            const CopyRegion* regions, size_t count, StreamId stream, bool posted_passed) const;
  void sent(const SendPlan& plan);
  // What waits until the receiver has copied message seq out of its slot (a slot-path message).
  CounterValue consumed(uint64_t seq) const;

  std::vector<Generation> take_unreachable_generations() { return generations_.take_unreachable(next_seq_); }

  // The blob the sender connected with: whose ring this is, and its first generation.
  const HandleBlob& receiver() const { return receiver_; }
  uint32_t num_slots() const { return receiver_.info.num_slots; }
  const GenerationTable& generations() const { return generations_; }
  // The generation message next_seq() goes to.
  const Generation& next_generation() const { return generations_.holding(next_seq_, error_prefix_); }
  uint64_t next_seq() const { return next_seq_; }
  // Every stream a send was enqueued on: what closing waits for.
  const std::vector<StreamId>& send_streams() const { return send_streams_; }

 private:
  // What the next message in a slot must order itself after.
  struct SlotHistory {
    uint32_t slot_round = 0;    // round of the slot's last slot-path message; 0: none yet
    StreamId stream = nullptr;  // of the slot's last message (either path)
  };
  SendPlan plan(uint64_t seq, StreamId stream, bool direct) const;

  std::string error_prefix_;
  HandleBlob receiver_;
  FlagsLayout flags_;
  GenerationTable generations_;
  std::vector<uint32_t> known_generations_;  // every generation number mapped so far
  uint64_t next_seq_ = 0;
  std::vector<SlotHistory> slot_history_;
  std::vector<StreamId> send_streams_;
};

}  // namespace ipc
}  // namespace pipecomm::transport
