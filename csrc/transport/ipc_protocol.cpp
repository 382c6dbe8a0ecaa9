// The CUDA-IPC ring's protocol core: numbering, generations, the steps of sends, receives and posts, and
// the handle blob format.
#include "ipc_protocol.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>

namespace pipecomm::transport {

namespace {

constexpr uint32_t kMagic = 0x52435049;  // "IPCR" in memory order on little-endian hosts
constexpr uint32_t kFormatVersion = 3;  // 2: the flags hold a `posted` line after ack[K]; 3: data offset
constexpr size_t kBusIdBytes = 32;

// Blob layout (host byte order; both ends are on one host).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffBusId = 8;
constexpr size_t kOffPid = kOffBusId + kBusIdBytes;  // 40
constexpr size_t kOffNumSlots = kOffPid + 4;         // 44
constexpr size_t kOffSlotBytes = kOffNumSlots + 4;   // 48
constexpr size_t kOffGeneration = kOffSlotBytes + 8;  // 56
constexpr size_t kOffReserved = kOffGeneration + 4;   // 60
constexpr size_t kOffFirstSeq = kOffReserved + 4;     // 64
constexpr size_t kOffFlagsHandle = kOffFirstSeq + 8;  // 72
constexpr size_t kOffDataHandle = kOffFlagsHandle + sizeof(ipc::IpcHandle);
constexpr size_t kOffDataOffset = kOffDataHandle + sizeof(ipc::IpcHandle);  // of the data in its allocation
constexpr size_t kBlobBytes = kOffDataOffset + 8;
static_assert(sizeof(ipc::IpcHandle) == 64, "an IPC handle blob holds 64-byte handles");

template <typename T>
void put(std::string& blob, size_t offset, const T& value) {
  std::memcpy(&blob[offset], &value, sizeof(T));
}

template <typename T>
T get(const std::string& blob, size_t offset) {
  T value;
  std::memcpy(&value, blob.data() + offset, sizeof(T));
  return value;
}

// Checks every region before anything is enqueued, so a bad message leaves the ring usable.
void check_regions(const CopyRegion* regions, size_t count, size_t slot_bytes, uint32_t generation, uint64_t seq,
                   const std::string& prefix) {
  if (count > 0 && regions == nullptr) {
    throw ProtocolError(prefix + ": message " + std::to_string(seq) + ": " + std::to_string(count) +
                        " regions passed as a null pointer");
  }
  for (size_t i = 0; i < count; ++i) {
    const CopyRegion& region = regions[i];
    if (region.slot_offset > slot_bytes || region.bytes > slot_bytes - region.slot_offset) {
      throw ProtocolError(prefix + ": message " + std::to_string(seq) + " region " + std::to_string(i) +
                          ": slot_offset " + std::to_string(region.slot_offset) + " + bytes " +
                          std::to_string(region.bytes) + " exceeds slot_bytes " + std::to_string(slot_bytes) +
                          " (data generation " + std::to_string(generation) +
                          "); the receiver must grow() and the sender update() first");
    }
    if (region.bytes > 0 && region.local == nullptr) {
      throw ProtocolError(prefix + ": message " + std::to_string(seq) + " region " + std::to_string(i) +
                          ": null local pointer for " + std::to_string(region.bytes) + " bytes");
    }
  }
}

void check_next_seq(uint64_t seq, uint64_t expected, const std::string& prefix, const char* what) {
  if (seq != expected) {
    throw ProtocolError(prefix + ": " + what + " got message seq " + std::to_string(seq) + ", expected " +
                        std::to_string(expected) + " (sequence numbers go 0, 1, 2, ... per direction)");
  }
}

std::string describe_position(uint64_t seq, ipc::SlotPosition position) {
  return "message " + std::to_string(seq) + ", slot " + std::to_string(position.slot) + ", round " +
         std::to_string(position.round);
}

// Whether generation a wins over b for a message both could hold: the later start, the newer on a tie.
bool supersedes(const ipc::Generation& a, const ipc::Generation& b) {
  return a.first_seq != b.first_seq ? a.first_seq > b.first_seq : a.number > b.number;
}

}  // namespace

size_t round_slot_bytes(size_t bytes, const std::string& prefix) {
  if (bytes == 0) bytes = 1;
  if (bytes > std::numeric_limits<size_t>::max() - (kIpcSlotAlignment - 1)) {
    throw ProtocolError(prefix + ": slot size " + std::to_string(bytes) + " overflows");
  }
  return (bytes + kIpcSlotAlignment - 1) / kIpcSlotAlignment * kIpcSlotAlignment;
}

IpcRingHandleInfo parse_ipc_ring_handles(const std::string& handles) { return ipc::read_handle_blob(handles).info; }

namespace ipc {

void remember_stream(std::vector<StreamId>& streams, StreamId stream) {
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

SlotPosition slot_position(uint64_t seq, uint32_t num_slots) {
  return {static_cast<uint32_t>(seq % num_slots), static_cast<uint32_t>(seq / num_slots + 1)};
}

std::string describe_message(uint64_t seq, uint32_t num_slots) {
  return describe_position(seq, slot_position(seq, num_slots));
}

std::string SendPlan::describe() const {
  return direct ? "into the posted buffer, " + describe_position(seq, position) + ", post " + std::to_string(post)
                : "into the peer slot, " + describe_position(seq, position);
}

std::string ReceivePlan::describe() const {
  return direct ? describe_position(seq, position) + ", direct"
                : "out of the slot, " + describe_position(seq, position);
}

// ---------------------------------------------------------------------------------------------------
// Generations

const Generation* GenerationTable::find_holding(uint64_t seq) const {
  const Generation* holder = nullptr;
  for (const Generation& generation : generations_) {
    if (generation.first_seq <= seq && (holder == nullptr || supersedes(generation, *holder))) holder = &generation;
  }
  return holder;
}

const Generation& GenerationTable::holding(uint64_t seq, const std::string& error_prefix) const {
  const Generation* holder = find_holding(seq);
  if (holder == nullptr) {
    throw ProtocolError(error_prefix + ": no data generation holds message " + std::to_string(seq));
  }
  return *holder;
}

const Generation* GenerationTable::find(uint32_t number) const {
  for (const Generation& generation : generations_) {
    if (generation.number == number) return &generation;
  }
  return nullptr;
}

void GenerationTable::remember_stream(uint32_t number, StreamId stream) {
  for (Generation& generation : generations_) {
    if (generation.number == number) ipc::remember_stream(generation.streams, stream);
  }
}

std::vector<Generation> GenerationTable::take_unreachable(uint64_t next_seq) {
  std::vector<Generation> unreachable;
  const Generation* current = find_holding(next_seq);
  if (current == nullptr) return unreachable;
  const uint32_t keep = current->number;
  auto kept = std::stable_partition(generations_.begin(), generations_.end(), [&](const Generation& generation) {
    return generation.number == keep || generation.first_seq > next_seq;
  });
  std::move(kept, generations_.end(), std::back_inserter(unreachable));
  generations_.erase(kept, generations_.end());
  return unreachable;
}

// ---------------------------------------------------------------------------------------------------
// Handle blobs

std::string serialize_handle_blob(const HandleBlob& blob) {
  const IpcRingHandleInfo& info = blob.info;
  std::string bytes(kBlobBytes, '\0');
  put<uint32_t>(bytes, kOffMagic, kMagic);
  put<uint32_t>(bytes, kOffVersion, kFormatVersion);
  std::memcpy(&bytes[kOffBusId], info.pci_bus_id.data(), std::min(info.pci_bus_id.size(), kBusIdBytes - 1));
  put<int32_t>(bytes, kOffPid, info.owner_pid);
  put<uint32_t>(bytes, kOffNumSlots, info.num_slots);
  put<uint64_t>(bytes, kOffSlotBytes, info.slot_bytes);
  put<uint32_t>(bytes, kOffGeneration, info.generation);
  put<uint64_t>(bytes, kOffFirstSeq, info.first_seq);
  put<IpcHandle>(bytes, kOffFlagsHandle, blob.flags_handle);
  put<IpcHandle>(bytes, kOffDataHandle, blob.data_handle);
  put<uint64_t>(bytes, kOffDataOffset, blob.data_offset);
  return bytes;
}

HandleBlob read_handle_blob(const std::string& bytes) {
  const std::string prefix = "pipecomm ipc ring";
  if (bytes.size() != kBlobBytes || get<uint32_t>(bytes, kOffMagic) != kMagic) {
    throw ProtocolError(prefix + ": not an ipc ring handle blob (" + std::to_string(bytes.size()) +
                        " bytes, expected " + std::to_string(kBlobBytes) + " with magic)");
  }
  const uint32_t version = get<uint32_t>(bytes, kOffVersion);
  if (version != kFormatVersion) {
    throw ProtocolError(prefix + ": ipc ring handle blob of format version " + std::to_string(version) +
                        ", this build reads version " + std::to_string(kFormatVersion));
  }
  HandleBlob blob;
  IpcRingHandleInfo& info = blob.info;
  const char* bus = bytes.data() + kOffBusId;
  info.pci_bus_id.assign(bus, strnlen(bus, kBusIdBytes));
  info.owner_pid = get<int32_t>(bytes, kOffPid);
  info.num_slots = get<uint32_t>(bytes, kOffNumSlots);
  info.slot_bytes = get<uint64_t>(bytes, kOffSlotBytes);
  info.generation = get<uint32_t>(bytes, kOffGeneration);
  info.first_seq = get<uint64_t>(bytes, kOffFirstSeq);
  if (info.num_slots == 0 || info.num_slots > kMaxSlots || info.slot_bytes == 0 || info.pci_bus_id.empty()) {
    throw ProtocolError(prefix + ": corrupt ipc ring handle blob (num_slots " + std::to_string(info.num_slots) +
                        ", slot_bytes " + std::to_string(info.slot_bytes) + ")");
  }
  blob.flags_handle = get<IpcHandle>(bytes, kOffFlagsHandle);
  blob.data_handle = get<IpcHandle>(bytes, kOffDataHandle);
  blob.data_offset = get<uint64_t>(bytes, kOffDataOffset);
  return blob;
}

// ---------------------------------------------------------------------------------------------------
// Receiver

ReceiverProtocol::ReceiverProtocol(uint32_t num_slots, std::string error_prefix)
    : num_slots_(num_slots), error_prefix_(std::move(error_prefix)), flags_(num_slots) {
  if (num_slots == 0 || num_slots > kMaxSlots) {
    throw ProtocolError(error_prefix_ + ": num_slots must be in [1, " + std::to_string(kMaxSlots) + "], got " +
                        std::to_string(num_slots));
  }
}

void ReceiverProtocol::check_not_received(uint64_t first_seq) const {
  if (first_seq < next_seq_) {
    throw ProtocolError(error_prefix_ + ": cannot start a data generation at message " + std::to_string(first_seq) +
                        ": message " + std::to_string(next_seq_ - 1) + " was already received");
  }
}

NewGeneration ReceiverProtocol::plan_generation(size_t slot_bytes, uint64_t first_seq) const {
  check_not_received(first_seq);
  const size_t rounded = round_slot_bytes(slot_bytes, error_prefix_);
  if (rounded > std::numeric_limits<size_t>::max() / num_slots_) {
    throw ProtocolError(error_prefix_ + ": " + std::to_string(num_slots_) + " slots of " + std::to_string(rounded) +
                        " bytes overflow");
  }
  return {next_generation_, first_seq, rounded, rounded * num_slots_};
}

void ReceiverProtocol::add_generation(const NewGeneration& generation) {
  generations_.add({generation.number, generation.first_seq, generation.slot_bytes, {}});
  next_generation_ = generation.number + 1;
}

size_t ReceiverProtocol::grown_slot_bytes(size_t min_slot_bytes, uint64_t first_seq) const {
  check_not_received(first_seq);  // before the lookup, which fails for a message given back
  const size_t old_bytes = generations_.holding(first_seq, error_prefix_).slot_bytes;
  const size_t doubled = old_bytes > std::numeric_limits<size_t>::max() / 2 ? old_bytes : old_bytes * 2;
  return std::max(min_slot_bytes, doubled);
}

CounterValue ReceiverProtocol::posted_counter(uint64_t posts) const {
  return {flags_.posted(), static_cast<uint32_t>(posts), "posted"};
}

void ReceiverProtocol::place_owed_post_write(ReceivePlan& plan) const {
  if (post_state_ != PostState::write_owed) return;
  // On the post's own stream the write joins the receive's step, at the same point of the stream;
  // elsewhere it goes alone first, so the counter never waits behind a receive on another stream.
  if (plan.stream == last_post_stream_) {
    plan.step.owed_write = posted_counter(posts_);
  } else {
    plan.post_write_before = PostWrite{last_post_stream_, posted_counter(posts_), posts_ - 1};
  }
}

ReceivePlan ReceiverProtocol::plan_receive(uint64_t seq, const CopyRegion* regions, size_t count,
                                           StreamId stream) const {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_receive");
  const Generation& generation = generations_.holding(seq, error_prefix_);
  check_regions(regions, count, generation.slot_bytes, generation.number, seq, error_prefix_);
  ReceivePlan plan{seq, slot_position(seq, num_slots_), stream, /*direct=*/false, std::nullopt, Step{}};
  const SlotPosition& position = plan.position;
  plan.step.wait({flags_.ready(position.slot), position.round, "ready"});
  plan.step.regions = regions;
  plan.step.region_count = count;
  plan.step.into_target = false;
  plan.step.target = {CopyTarget::Kind::slot, generation.number, size_t{position.slot} * generation.slot_bytes};
  plan.step.signal = CounterValue{flags_.ack(position.slot), position.round, "ack"};
  place_owed_post_write(plan);
  return plan;
}

ReceivePlan ReceiverProtocol::plan_receive_direct(uint64_t seq, StreamId stream) const {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_receive_direct");
  ReceivePlan plan{seq, slot_position(seq, num_slots_), stream, /*direct=*/true, std::nullopt, Step{}};
  plan.step.wait({flags_.ready(plan.position.slot), plan.position.round, "ready"});
  place_owed_post_write(plan);
  return plan;
}

void ReceiverProtocol::received(const ReceivePlan& plan) {
  if (post_state_ == PostState::write_owed) {
    post_state_ = PostState::written;
    written_posts_ = posts_;
  }
  if (!plan.direct) generations_.remember_stream(plan.step.target.generation, plan.stream);
  ++next_seq_;
}

PostPlan ReceiverProtocol::plan_post(uint64_t post, StreamId stream) const {
  if (post_state_ != PostState::none && post < posts_) {
    throw ProtocolError(error_prefix_ + ": enqueue_post got post " + std::to_string(post) + ", but post " +
                        std::to_string(posts_ - 1) + " was already posted");
  }
  PostPlan plan{post, stream, std::nullopt, std::nullopt};
  if (post_state_ != PostState::none && stream != last_post_stream_) {
    // A later post on another stream must not raise the counter before the earlier post's stream got
    // there: its owed write goes first, then the new stream is ordered after the old one.
    if (post_state_ == PostState::write_owed) {
      plan.owed_write = PostWrite{last_post_stream_, posted_counter(posts_), posts_ - 1};
    }
    plan.fence = StreamFence{last_post_stream_, stream};
  }
  return plan;
}

void ReceiverProtocol::posted(const PostPlan& plan) {
  if (plan.owed_write) written_posts_ = posts_;
  post_state_ = PostState::write_owed;
  last_post_stream_ = plan.stream;
  posts_ = plan.post + 1;
}

// ---------------------------------------------------------------------------------------------------
// Sender

namespace {

HandleBlob read_receiver_handles(const std::string& handles, const std::string& prefix, const char* context) {
  try {
    return read_handle_blob(handles);
  } catch (const ProtocolError& error) {
    throw ProtocolError(prefix + ": " + context + ": " + error.what());
  }
}

}  // namespace

SenderProtocol::SenderProtocol(const std::string& receiver_handles, std::string error_prefix)
    : error_prefix_(std::move(error_prefix)),
      receiver_(read_receiver_handles(receiver_handles, error_prefix_, "receiver handles")),
      flags_(receiver_.info.num_slots),
      slot_history_(receiver_.info.num_slots) {}

std::optional<HandleBlob> SenderProtocol::new_generation(const std::string& handles) const {
  HandleBlob blob = read_receiver_handles(handles, error_prefix_, "update");
  const IpcRingHandleInfo& info = blob.info;
  const IpcRingHandleInfo& connected = receiver_.info;
  if (info.pci_bus_id != connected.pci_bus_id || info.owner_pid != connected.owner_pid ||
      info.num_slots != connected.num_slots || blob.flags_handle != receiver_.flags_handle) {
    throw ProtocolError(error_prefix_ + ": update: handles of another receiver (pid " +
                        std::to_string(info.owner_pid) + " on " + info.pci_bus_id + ", " +
                        std::to_string(info.num_slots) + " slots; connected to pid " +
                        std::to_string(connected.owner_pid) + " on " + connected.pci_bus_id + ", " +
                        std::to_string(connected.num_slots) + " slots)");
  }
  if (std::find(known_generations_.begin(), known_generations_.end(), info.generation) != known_generations_.end()) {
    return std::nullopt;
  }
  if (info.first_seq < next_seq_) {
    throw ProtocolError(error_prefix_ + ": update: data generation " + std::to_string(info.generation) +
                        " starts at message " + std::to_string(info.first_seq) + ", but message " +
                        std::to_string(next_seq_ - 1) +
                        " was already sent; the receiver must resize() for a message the sender has not sent");
  }
  return blob;
}

void SenderProtocol::add_generation(const IpcRingHandleInfo& info) {
  generations_.add({info.generation, info.first_seq, static_cast<size_t>(info.slot_bytes), {}});
  known_generations_.push_back(info.generation);
}

SendPlan SenderProtocol::plan(uint64_t seq, StreamId stream, bool direct) const {
  const SlotPosition position = slot_position(seq, num_slots());
  SendPlan plan{seq, position, stream, direct, 0, Step{}};
  plan.step.signal = CounterValue{flags_.ready(position.slot), position.round, "ready"};
  return plan;
}

SendPlan SenderProtocol::plan_send(uint64_t seq, const CopyRegion* regions, size_t count, StreamId stream) const {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_send");
  const Generation& generation = generations_.holding(seq, error_prefix_);
  check_regions(regions, count, generation.slot_bytes, generation.number, seq, error_prefix_);
  SendPlan plan = this->plan(seq, stream, /*direct=*/false);
  const SlotPosition& position = plan.position;
  plan.step.regions = regions;
  plan.step.region_count = count;
  plan.step.target = {CopyTarget::Kind::slot, generation.number, size_t{position.slot} * generation.slot_bytes};
  const SlotHistory& history = slot_history_[position.slot];
  // The slot's last slot-path occupant was copied out.
  if (history.slot_round > 0) plan.step.wait({flags_.ack(position.slot), history.slot_round, "ack"});
  // After a direct message on another stream, that message's ready write must land first.
  if (seq >= num_slots() && history.slot_round != position.round - 1 && history.stream != stream) {
    plan.step.wait({flags_.ready(position.slot), position.round - 1, "ready of the slot's previous message"});
  }
  return plan;
}

SendPlan SenderProtocol::plan_send_direct(uint64_t seq, uint64_t post, size_t buffer_offset, size_t capacity,
                                          const CopyRegion* regions, size_t count, StreamId stream,
                                          bool posted_passed) const {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_send_direct");
  check_regions(regions, count, capacity, 0, seq, error_prefix_);
  SendPlan plan = this->plan(seq, stream, /*direct=*/true);
  const SlotPosition& position = plan.position;
  plan.post = post;
  plan.step.regions = regions;
  plan.step.region_count = count;
  plan.step.target = {CopyTarget::Kind::posted_buffer, 0, buffer_offset};
  // ready[slot] rises in message order: on one stream by itself, across streams after this wait.
  if (seq >= num_slots() && slot_history_[position.slot].stream != stream) {
    plan.step.wait({flags_.ready(position.slot), position.round - 1, "ready of the slot's previous message"});
  }
  // The receiver's stream has passed the buffer's allocation: nothing of its own still uses that memory.
  if (!posted_passed) plan.step.wait({flags_.posted(), static_cast<uint32_t>(post + 1), "posted"});
  return plan;
}

void SenderProtocol::sent(const SendPlan& plan) {
  SlotHistory& history = slot_history_[plan.position.slot];
  if (!plan.direct) {
    history.slot_round = plan.position.round;
    generations_.remember_stream(plan.step.target.generation, plan.stream);
  }
  history.stream = plan.stream;
  remember_stream(send_streams_, plan.stream);
  ++next_seq_;
}

CounterValue SenderProtocol::consumed(uint64_t seq) const {
  if (seq >= next_seq_) {
    throw ProtocolError(error_prefix_ + ": enqueue_wait_consumed(" + std::to_string(seq) +
                        "): that message was not sent yet (next is " + std::to_string(next_seq_) + ")");
  }
  const SlotPosition position = slot_position(seq, num_slots());
  return {flags_.ack(position.slot), position.round, "ack"};
}

}  // namespace ipc
}  // namespace pipecomm::transport
