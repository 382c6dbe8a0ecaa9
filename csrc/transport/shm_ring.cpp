// Shared-memory ring protocol: control block, flow control, growth and waiting (segments: shm_segment.cpp).
#include "shm_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>

#include "cpu_relax.h"
#include "shm_segment.h"

namespace pipecomm::transport {
namespace detail {

constexpr size_t kCacheLine = 64;
// How much of an abort's reason the control block carries to the peer.
constexpr size_t kAbortReasonBytes = 240;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "cross-process atomics must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "cross-process atomics must be lock-free");
// The kernel reads the futex word as a plain u32.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  alignof(std::atomic<uint32_t>) == alignof(uint32_t),
              "futex word must have the layout of uint32_t");

struct WakeWord {
  std::atomic<uint32_t> sequence;  // futex word, bumped after every change a waiter may care about
  std::atomic<uint32_t> sleepers;  // lets notifiers skip the wake syscall when nobody sleeps
};

struct alignas(kCacheLine) SlotHeader {
  std::atomic<uint64_t> published_seq;  // seq + 1 once message seq is complete in this slot
  uint64_t payload_bytes;
  uint32_t tag;
  uint32_t generation;  // data segment the payload was written into
};

// Zero is the initial value of every field: the segment comes zero-filled from ftruncate and no
// constructor runs on it, because the sender may already be polling magic while it is set up.
struct alignas(kCacheLine) ControlBlock {
  std::atomic<uint32_t> magic;  // published last; the plain fields below are valid once it is set
  uint32_t version;
  uint32_t num_slots;
  int32_t receiver_rank;
  int32_t sender_rank;
  int32_t receiver_pid;
  uint64_t control_bytes;

  std::atomic<int32_t> sender_pid;
  std::atomic<uint32_t> sender_closed;
  std::atomic<uint32_t> receiver_closed;
  std::atomic<uint32_t> published_generation;   // newest data segment created by the receiver
  std::atomic<uint32_t> sender_generation;      // data segment the sender writes into
  std::atomic<uint64_t> generation_switch_seq;  // first seq written into sender_generation
  std::atomic<uint64_t> grow_request_bytes;     // slot size the sender is blocked on, 0 if none
  // Why each end aborted (empty: it closed in order), written before its closed flag and read after it.
  uint32_t sender_reason_bytes;
  uint32_t receiver_reason_bytes;
  char sender_reason[kAbortReasonBytes];
  char receiver_reason[kAbortReasonBytes];

  // Producer and consumer counters live on separate cache lines to avoid false sharing.
  alignas(kCacheLine) std::atomic<uint64_t> write_count;
  WakeWord receiver_wake;
  alignas(kCacheLine) std::atomic<uint64_t> read_count;
  WakeWord sender_wake;
};

static_assert(std::is_standard_layout_v<ControlBlock> && std::is_trivially_destructible_v<ControlBlock>,
              "control block lives in shared memory and is never constructed or destroyed");

}  // namespace detail

namespace {

using detail::ControlBlock;
using detail::DataGeneration;
using detail::kAbortReasonBytes;
using detail::create_segment;
using detail::data_segment_name_for;
using detail::FileDescriptor;
using detail::kShmDirectory;
using detail::list_shm_entries;
using detail::MappedSegment;
using detail::os_error;
using detail::parse_segment_name;
using detail::process_is_alive;
using detail::round_up_to_page;
using detail::segment_stem;
using detail::unlink_quietly;
using detail::PeerStatus;
using detail::SlotHeader;
using detail::WaitFailure;
using detail::WakeWord;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x50435352;  // "PCSR"
constexpr uint32_t kVersion = 2;
constexpr uint32_t kFirstGeneration = 1;
constexpr uint32_t kMaxSlots = 1u << 16;
// Segment names get ".pid<pid>.gen<generation>" appended and must fit NAME_MAX.
constexpr size_t kMaxChannelNameBytes = 200;
// A peer usually answers within microseconds (a pipeline's host runs ahead of its GPU), and a
// futex sleep adds tens of microseconds of wake-up latency; so spin this long before sleeping.
constexpr auto kSpinDuration = std::chrono::microseconds(50);
constexpr int kSpinsPerClockRead = 64;
// Blocking waits wake at least this often to check peer liveness and the deadline.
constexpr auto kWaitSlice = std::chrono::milliseconds(50);
constexpr auto kAttachBackoffCap = std::chrono::milliseconds(1);

size_t control_block_bytes(uint32_t num_slots) {
  return sizeof(ControlBlock) + size_t{num_slots} * sizeof(SlotHeader);
}

SlotHeader& slot_header(ControlBlock* block, uint64_t seq) {
  auto* first = reinterpret_cast<SlotHeader*>(reinterpret_cast<std::byte*>(block) + sizeof(ControlBlock));
  return first[seq % block->num_slots];
}

std::string channel_label(const std::string& kind, int sender_rank, int receiver_rank) {
  return "pipecomm " + kind + " channel rank " + std::to_string(sender_rank) + " -> rank " +
         std::to_string(receiver_rank) + ": ";
}

std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), seconds >= 0.1 ? "%.1f" : "%.3g", seconds);
  return text;
}

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void validate_config(const RingConfig& config) {
  const std::string& name = config.name;
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    throw std::invalid_argument("pipecomm shm ring: channel name '" + name +
                                "' must start with '/' and contain no other '/'");
  }
  if (name.size() > kMaxChannelNameBytes) {
    throw std::invalid_argument("pipecomm shm ring: channel name '" + name + "' is longer than " +
                                std::to_string(kMaxChannelNameBytes) + " bytes");
  }
  if (config.num_slots == 0 || config.num_slots > kMaxSlots) {
    throw std::invalid_argument("pipecomm shm ring: num_slots must be in [1, " + std::to_string(kMaxSlots) +
                                "], got " + std::to_string(config.num_slots));
  }
  if (!(config.timeout_s > 0.0) || !std::isfinite(config.timeout_s)) {
    throw std::invalid_argument("pipecomm shm ring: timeout_s must be a positive number of seconds");
  }
}

void write_reason(char* field, uint32_t& length, const std::string& reason) noexcept {
  const size_t bytes = std::min(reason.size(), kAbortReasonBytes);
  std::memcpy(field, reason.data(), bytes);
  length = static_cast<uint32_t>(bytes);
}

// What a closed peer's error adds: the reason it aborted with, if any.
std::string abort_note(const char* field, uint32_t length) {
  if (length == 0) return "";
  return " (it aborted: " + std::string(field, std::min<size_t>(length, kAbortReasonBytes)) + ")";
}

uint32_t* futex_word(std::atomic<uint32_t>& word) { return reinterpret_cast<uint32_t*>(&word); }

// Not FUTEX_PRIVATE: the waiter and the notifier are different processes.
void sleep_on(WakeWord& wake, uint32_t observed, Clock::duration timeout) {
  const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  timespec relative{static_cast<time_t>(nanos / 1000000000), static_cast<long>(nanos % 1000000000)};
  wake.sleepers.fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, futex_word(wake.sequence), FUTEX_WAIT, observed, &relative, nullptr, 0);
  wake.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// seq_cst pairs with sleep_on: either the waiter's futex sees the new sequence, or we see its sleeper.
void notify(WakeWord& wake) {
  wake.sequence.fetch_add(1, std::memory_order_seq_cst);
  if (wake.sleepers.load(std::memory_order_seq_cst) != 0) {
    syscall(SYS_futex, futex_word(wake.sequence), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

// Spins briefly, then sleeps on the futex in bounded slices so a dead or closed peer, an interrupt from
// another thread of this process and the deadline are noticed. fail() must throw.
template <typename IsReady, typename GetPeerStatus, typename Fail>
void wait_for(WakeWord& wake, double timeout_s, const std::atomic<bool>& interrupted, IsReady&& is_ready,
              GetPeerStatus&& peer_status, Fail&& fail) {
  const auto deadline = Clock::now() + to_duration(timeout_s);
  const auto spin_until = Clock::now() + kSpinDuration;
  do {
    for (int spin = 0; spin < kSpinsPerClockRead; ++spin) {
      if (is_ready()) return;
      cpu_relax();
    }
  } while (Clock::now() < spin_until);
  auto next_liveness_check = Clock::now();
  while (true) {
    const uint32_t observed = wake.sequence.load(std::memory_order_acquire);
    if (is_ready()) return;
    if (interrupted.load(std::memory_order_acquire)) fail(WaitFailure::interrupted);
    const auto now = Clock::now();
    const bool check_liveness = now >= next_liveness_check;
    if (check_liveness) next_liveness_check = now + kWaitSlice;
    const PeerStatus status = peer_status(check_liveness);
    if (status != PeerStatus::alive) {
      // The peer may have published its last messages just before closing or dying.
      if (is_ready()) return;
      fail(status == PeerStatus::closed ? WaitFailure::peer_closed : WaitFailure::peer_died);
    }
    if (now >= deadline) fail(WaitFailure::timeout);
    sleep_on(wake, observed, std::min<Clock::duration>(deadline - now, kWaitSlice));
  }
}

DataGeneration create_data_generation(const std::string& name, uint32_t generation, size_t slot_bytes,
                                      uint32_t num_slots) {
  if (slot_bytes > SIZE_MAX / num_slots) throw std::length_error("pipecomm shm ring: data segment size overflows");
  DataGeneration created;
  created.generation = generation;
  created.slot_bytes = slot_bytes;
  created.name = name;
  created.segment = create_segment(name, slot_bytes * num_slots);
  return created;
}

}  // namespace

size_t packed_message_bytes(const MessagePart* parts, size_t num_parts) {
  size_t end = 0;
  for (size_t index = 0; index < num_parts; ++index) {
    if (parts[index].data == nullptr && parts[index].bytes != 0) {
      throw std::invalid_argument("pipecomm shm ring: message part " + std::to_string(index) +
                                  " has a null pointer but " + std::to_string(parts[index].bytes) + " bytes");
    }
    const size_t begin = align_to_pack(end);
    if (begin < end || parts[index].bytes > SIZE_MAX - begin) {
      throw std::length_error("pipecomm shm ring: message size overflows");
    }
    end = begin + parts[index].bytes;
  }
  return end;
}

// ---------------------------------------------------------------------------------------------
// Receiver

ShmRingReceiver::ShmRingReceiver(RingConfig config) : config_(std::move(config)), owner_pid_(getpid()) {
  validate_config(config_);
  error_prefix_ = channel_label(config_.kind, config_.peer_rank, config_.self_rank);
  control_name_ = segment_stem(config_.name, owner_pid_) + ".ctl";
  const size_t control_bytes = control_block_bytes(config_.num_slots);
  control_segment_ = create_segment(control_name_, control_bytes);
  try {
    control_ = reinterpret_cast<ControlBlock*>(control_segment_.data());
    control_->version = kVersion;
    control_->num_slots = config_.num_slots;
    control_->receiver_rank = config_.self_rank;
    control_->sender_rank = config_.peer_rank;
    control_->receiver_pid = owner_pid_;
    control_->control_bytes = control_bytes;
    active_ = create_data_generation(data_segment_name(kFirstGeneration), kFirstGeneration,
                                     round_up_to_page(config_.slot_bytes), config_.num_slots);
    control_->published_generation.store(kFirstGeneration, std::memory_order_relaxed);
    control_->sender_generation.store(kFirstGeneration, std::memory_order_relaxed);
    control_->magic.store(kMagic, std::memory_order_release);
  } catch (...) {
    unlink_quietly(control_name_);
    throw;
  }
}

ShmRingReceiver::~ShmRingReceiver() { close(); }

std::string ShmRingReceiver::data_segment_name(uint32_t generation) const {
  return data_segment_name_for(config_.name, owner_pid_, generation);
}

void ShmRingReceiver::ensure_open(const char* operation) const {
  if (control_ == nullptr) {
    throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) + " cannot " + operation +
                        ": the channel was closed");
  }
}

bool ShmRingReceiver::sender_attached() const {
  return control_ != nullptr && control_->sender_pid.load(std::memory_order_acquire) != 0;
}

void ShmRingReceiver::wait_connected() {
  ensure_open("wait for the sender");
  wait_for(
      control_->receiver_wake, config_.timeout_s, interrupted_, [&] { return sender_attached(); },
      [](bool) { return PeerStatus::alive; },
      [&](WaitFailure failure) {
        if (failure == WaitFailure::interrupted) {
          throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) +
                              " stopped waiting for the sender: another thread is closing the channel");
        }
        throw TimeoutError(error_prefix_ + "rank " + std::to_string(config_.self_rank) + " timed out after " +
                           format_seconds(config_.timeout_s) + " s waiting for rank " +
                           std::to_string(config_.peer_rank) + " to attach to " + control_name_);
      });
}

size_t ShmRingReceiver::slot_bytes() const { return pending_ ? pending_->slot_bytes : active_.slot_bytes; }

uint32_t ShmRingReceiver::generation() const { return pending_ ? pending_->generation : active_.generation; }

void ShmRingReceiver::publish_generation(size_t slot_bytes) {
  assert(!pending_ && "the sender can only adopt one pending generation at a time");
  const uint32_t generation = active_.generation + 1;
  pending_ = create_data_generation(data_segment_name(generation), generation, slot_bytes, config_.num_slots);
  control_->published_generation.store(generation, std::memory_order_release);
  notify(control_->sender_wake);
}

void ShmRingReceiver::retire_drained_generations() {
  const auto drained = std::remove_if(retired_.begin(), retired_.end(), [&](DataGeneration& retired) {
    if (retired.end_seq > released_count_) return false;
    unlink_quietly(retired.name);
    retired.segment.reset();
    return true;
  });
  retired_.erase(drained, retired_.end());
}

void ShmRingReceiver::service() {
  ensure_open("service");
  service_control();
}

// Only one generation is ever pending, so sender_generation can only move to pending_'s.
void ShmRingReceiver::service_control() {
  if (pending_ && control_->sender_generation.load(std::memory_order_acquire) == pending_->generation) {
    active_.end_seq = control_->generation_switch_seq.load(std::memory_order_relaxed);
    retired_.push_back(std::move(active_));
    active_ = std::move(*pending_);
    pending_.reset();
  }
  retire_drained_generations();
  const uint64_t requested = control_->grow_request_bytes.load(std::memory_order_acquire);
  if (requested > active_.slot_bytes && !pending_) {
    const size_t doubled = active_.slot_bytes > SIZE_MAX / 2 ? SIZE_MAX : active_.slot_bytes * 2;
    publish_generation(round_up_to_page(std::max<size_t>(requested, doubled)));
  }
}

bool ShmRingReceiver::message_ready(uint64_t seq) {
  service_control();
  const uint64_t published = slot_header(control_, seq).published_seq.load(std::memory_order_acquire);
  if (published > seq + 1) {
    throw ProtocolError(error_prefix_ + "slot of message " + std::to_string(seq) + " already holds message " +
                        std::to_string(published - 1) + ": the sender overwrote an unreleased slot");
  }
  return published == seq + 1;
}

Message ShmRingReceiver::take_message(uint64_t seq) {
  const SlotHeader& slot = slot_header(control_, seq);
  const DataGeneration* holder = nullptr;
  if (pending_ && pending_->generation == slot.generation) {
    holder = &*pending_;
  } else if (active_.generation == slot.generation) {
    holder = &active_;
  } else {
    for (const DataGeneration& retired : retired_) {
      if (retired.generation == slot.generation) holder = &retired;
    }
  }
  if (holder == nullptr) {
    throw ProtocolError(error_prefix_ + "message " + std::to_string(seq) + " was written into data generation " +
                        std::to_string(slot.generation) + ", which rank " + std::to_string(config_.self_rank) +
                        " does not have");
  }
  if (slot.payload_bytes > holder->slot_bytes) {
    throw ProtocolError(error_prefix_ + "message " + std::to_string(seq) + " claims " +
                        std::to_string(slot.payload_bytes) + " bytes but its slot holds " +
                        std::to_string(holder->slot_bytes));
  }
  next_recv_seq_ = seq + 1;
  const std::byte* data = holder->segment.data() + (seq % config_.num_slots) * holder->slot_bytes;
  return Message{seq, slot.tag, data, static_cast<size_t>(slot.payload_bytes)};
}

// Holding every slot would block the sender forever; fail now instead of timing out.
void ShmRingReceiver::check_receivable(uint64_t seq) const {
  if (seq - released_count_ >= config_.num_slots) {
    throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) + " holds all " +
                        std::to_string(config_.num_slots) + " slots unreleased; release message " +
                        std::to_string(released_count_) + " before receiving message " + std::to_string(seq));
  }
}

PeerStatus ShmRingReceiver::sender_status(bool check_liveness) const {
  if (control_->sender_closed.load(std::memory_order_acquire) != 0) return PeerStatus::closed;
  if (check_liveness) {
    const pid_t sender_pid = control_->sender_pid.load(std::memory_order_acquire);
    if (sender_pid != 0 && !process_is_alive(sender_pid)) return PeerStatus::died;
  }
  return PeerStatus::alive;
}

void ShmRingReceiver::raise_receive_failure(WaitFailure failure, uint64_t seq) const {
  const std::string self = "rank " + std::to_string(config_.self_rank);
  const std::string peer = "rank " + std::to_string(config_.peer_rank);
  const std::string waiting = " waiting to receive message " + std::to_string(seq);
  const pid_t sender_pid = control_->sender_pid.load(std::memory_order_acquire);
  switch (failure) {
    case WaitFailure::peer_closed:
      throw ProtocolError(error_prefix_ + "peer " + peer + " closed the channel" +
                          abort_note(control_->sender_reason, control_->sender_reason_bytes) + " while " + self +
                          " was" + waiting);
    case WaitFailure::peer_died:
      throw PeerDiedError(error_prefix_ + "peer " + peer + " (pid " + std::to_string(sender_pid) + ") died while " +
                          self + " was" + waiting);
    case WaitFailure::interrupted:
      throw ProtocolError(error_prefix_ + self + " stopped" + waiting + ": another thread is closing the channel");
    case WaitFailure::timeout:
      break;
  }
  const std::string progress =
      sender_pid == 0 ? peer + " has not attached"
                      : peer + " has sent " +
                            std::to_string(control_->write_count.load(std::memory_order_acquire)) + " messages";
  throw TimeoutError(error_prefix_ + self + " timed out after " + format_seconds(config_.timeout_s) + " s" +
                     waiting + " (" + progress + ")");
}

Message ShmRingReceiver::recv() {
  ensure_open("receive");
  const uint64_t seq = next_recv_seq_;
  check_receivable(seq);
  wait_for(
      control_->receiver_wake, config_.timeout_s, interrupted_, [&] { return message_ready(seq); },
      [&](bool check_liveness) { return sender_status(check_liveness); },
      [&](WaitFailure failure) { raise_receive_failure(failure, seq); });
  return take_message(seq);
}

void ShmRingReceiver::sleep_until_notified(std::chrono::microseconds longest) {
  // Read before the check: a message published after it changes the word, and the futex will not sleep.
  const uint32_t observed = control_->receiver_wake.sequence.load(std::memory_order_acquire);
  if (message_ready(next_recv_seq_)) return;
  sleep_on(control_->receiver_wake, observed, longest);
}

std::optional<Message> ShmRingReceiver::try_recv() {
  ensure_open("receive");
  const uint64_t seq = next_recv_seq_;
  check_receivable(seq);
  if (message_ready(seq)) return take_message(seq);
  const auto now = Clock::now();
  const bool check_liveness = now >= next_liveness_check_;
  if (check_liveness) next_liveness_check_ = now + kWaitSlice;
  const PeerStatus status = sender_status(check_liveness);
  if (status == PeerStatus::alive) return std::nullopt;
  if (message_ready(seq)) return take_message(seq);
  raise_receive_failure(status == PeerStatus::closed ? WaitFailure::peer_closed : WaitFailure::peer_died, seq);
}

void ShmRingReceiver::release(uint64_t seq) {
  ensure_open("release");
  if (seq != released_count_ || seq >= next_recv_seq_) {
    const std::string expectation =
        released_count_ < next_recv_seq_
            ? "the next message to release is " + std::to_string(released_count_) + "; messages are released in the "
                                                                                     "order they were received"
            : "no received message is waiting to be released";
    throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) + " released message " +
                        std::to_string(seq) + " out of order: " + expectation);
  }
  released_count_ = seq + 1;
  control_->read_count.store(released_count_, std::memory_order_release);
  notify(control_->sender_wake);
  retire_drained_generations();
}

bool ShmRingReceiver::shrink(size_t slot_bytes) {
  ensure_open("shrink");
  service_control();
  if (pending_ || released_count_ != next_recv_seq_ ||
      control_->write_count.load(std::memory_order_acquire) != released_count_) {
    return false;
  }
  const size_t target = round_up_to_page(slot_bytes);
  if (target >= active_.slot_bytes) return false;
  publish_generation(target);
  return true;
}

void ShmRingReceiver::interrupt() noexcept {
  interrupted_.store(true, std::memory_order_release);
  // recv() may be asleep on the futex: wake it now rather than at the end of its slice.
  if (control_ != nullptr) notify(control_->receiver_wake);
}

void ShmRingReceiver::close(const std::string& reason) noexcept {
  if (control_ == nullptr) return;
  // A forked child (e.g. a DataLoader worker) inherits this object but must not close the parent's channel.
  if (getpid() == owner_pid_) {
    write_reason(control_->receiver_reason, control_->receiver_reason_bytes, reason);
    control_->receiver_closed.store(1, std::memory_order_release);
    notify(control_->sender_wake);
    unlink_quietly(control_name_);
    unlink_quietly(active_.name);
    if (pending_) unlink_quietly(pending_->name);
    for (const DataGeneration& retired : retired_) unlink_quietly(retired.name);
  }
  active_.segment.reset();
  pending_.reset();
  retired_.clear();
  control_ = nullptr;
  control_segment_.reset();
}

// ---------------------------------------------------------------------------------------------
// Sender

ShmRingSender::ShmRingSender(RingConfig config) : config_(std::move(config)), owner_pid_(getpid()) {
  validate_config(config_);
  error_prefix_ = channel_label(config_.kind, config_.self_rank, config_.peer_rank);
}

ShmRingSender::~ShmRingSender() { close(); }

std::string ShmRingSender::data_segment_name(uint32_t generation) const {
  return data_segment_name_for(config_.name, receiver_pid_, generation);
}

void ShmRingSender::wait_connected() {
  if (closed_) {
    throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) +
                        " cannot connect: the channel was closed");
  }
  if (control_ != nullptr) return;
  const auto deadline = Clock::now() + to_duration(config_.timeout_s);
  Clock::duration backoff = std::chrono::microseconds(20);
  while (!try_attach()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(error_prefix_ + "rank " + std::to_string(config_.self_rank) + " timed out after " +
                         format_seconds(config_.timeout_s) + " s waiting for rank " +
                         std::to_string(config_.peer_rank) + " to create the channel (no live " + kShmDirectory +
                         config_.name + ".pid<pid>.ctl)");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min<Clock::duration>(backoff * 2, kAttachBackoffCap);
  }
}

bool ShmRingSender::try_attach() {
  std::vector<std::string> candidates;
  for (const std::string& entry : list_shm_entries()) {
    const auto parsed = parse_segment_name(entry);
    if (parsed && parsed->is_control && parsed->channel_name == config_.name && process_is_alive(parsed->owner_pid)) {
      candidates.push_back("/" + entry);
    }
  }
  if (candidates.empty()) return false;
  if (candidates.size() > 1) {
    throw ProtocolError(error_prefix_ + "several live receivers created this channel: " + candidates[0] + " and " +
                        candidates[1]);
  }
  const std::string& control_name = candidates.front();
  const int raw_fd = shm_open(control_name.c_str(), O_RDWR, 0);
  if (raw_fd < 0) {
    if (errno == ENOENT) return false;
    throw ChannelError(error_prefix_ + os_error("shm_open", control_name, errno));
  }
  FileDescriptor fd(raw_fd);
  struct stat status {};
  if (fstat(fd.get(), &status) != 0) throw ChannelError(error_prefix_ + os_error("fstat", control_name, errno));
  const auto segment_bytes = static_cast<size_t>(status.st_size);
  // The receiver has created the name but not sized it yet.
  if (segment_bytes < sizeof(ControlBlock)) return false;
  MappedSegment segment = MappedSegment::map_fd(fd.get(), segment_bytes, control_name);
  auto* block = reinterpret_cast<ControlBlock*>(segment.data());
  const uint32_t magic = block->magic.load(std::memory_order_acquire);
  if (magic == 0) return false;
  if (magic != kMagic || block->version != kVersion) {
    throw ProtocolError(error_prefix_ + "bad header in " + control_name + ": magic " + std::to_string(magic) +
                        " version " + std::to_string(block->version) + ", expected magic " + std::to_string(kMagic) +
                        " version " + std::to_string(kVersion));
  }
  if (block->num_slots == 0 || block->num_slots > kMaxSlots || block->control_bytes != segment_bytes ||
      control_block_bytes(block->num_slots) != segment_bytes) {
    throw ProtocolError(error_prefix_ + "bad header in " + control_name + ": " + std::to_string(block->num_slots) +
                        " slots do not match a segment of " + std::to_string(segment_bytes) + " bytes");
  }
  if (block->receiver_rank != config_.peer_rank || block->sender_rank != config_.self_rank) {
    throw ProtocolError(error_prefix_ + control_name + " belongs to channel rank " +
                        std::to_string(block->sender_rank) + " -> rank " + std::to_string(block->receiver_rank));
  }
  if (block->receiver_closed.load(std::memory_order_acquire) != 0) {
    throw ProtocolError(error_prefix_ + "peer rank " + std::to_string(config_.peer_rank) +
                        " closed the channel before rank " + std::to_string(config_.self_rank) + " attached");
  }
  int32_t no_sender = 0;
  if (!block->sender_pid.compare_exchange_strong(no_sender, owner_pid_, std::memory_order_acq_rel)) {
    throw ProtocolError(error_prefix_ + "another sender (pid " + std::to_string(no_sender) +
                        ") is already attached to " + control_name);
  }
  // Both sides have it mapped now; dropping the name means a crash leaves nothing in /dev/shm.
  unlink_quietly(control_name);
  control_segment_ = std::move(segment);
  control_ = block;
  receiver_pid_ = block->receiver_pid;
  config_.num_slots = block->num_slots;
  adopt_published_generation();
  notify(control_->receiver_wake);
  return true;
}

void ShmRingSender::adopt_published_generation() {
  const uint32_t generation = control_->published_generation.load(std::memory_order_acquire);
  if (data_segment_.data() != nullptr && generation == data_generation_) return;
  const std::string name = data_segment_name(generation);
  const std::string mapping = "rank " + std::to_string(config_.self_rank) + " was mapping data generation " +
                              std::to_string(generation);
  const int raw_fd = shm_open(name.c_str(), O_RDWR, 0);
  if (raw_fd < 0) {
    const int error = errno;
    if (error == ENOENT && control_->receiver_closed.load(std::memory_order_acquire) != 0) {
      // An abort's reason too, as a send's wait reports it: the peer may abort while this end maps a generation.
      throw ProtocolError(error_prefix_ + "peer rank " + std::to_string(config_.peer_rank) + " closed the channel" +
                          abort_note(control_->receiver_reason, control_->receiver_reason_bytes) + " while " +
                          mapping);
    }
    if (error == ENOENT && !process_is_alive(receiver_pid_)) {
      throw PeerDiedError(error_prefix_ + "peer rank " + std::to_string(config_.peer_rank) + " (pid " +
                          std::to_string(receiver_pid_) + ") died while " + mapping);
    }
    throw ChannelError(error_prefix_ + os_error("shm_open", name, error));
  }
  FileDescriptor fd(raw_fd);
  struct stat status {};
  if (fstat(fd.get(), &status) != 0) throw ChannelError(error_prefix_ + os_error("fstat", name, errno));
  const auto segment_bytes = static_cast<size_t>(status.st_size);
  if (segment_bytes == 0 || segment_bytes % config_.num_slots != 0) {
    throw ProtocolError(error_prefix_ + "data segment " + name + " has " + std::to_string(segment_bytes) +
                        " bytes, not a multiple of " + std::to_string(config_.num_slots) + " slots");
  }
  data_segment_ = MappedSegment::map_fd(fd.get(), segment_bytes, name);
  unlink_quietly(name);
  data_generation_ = generation;
  slot_bytes_ = segment_bytes / config_.num_slots;
  control_->generation_switch_seq.store(next_send_seq_, std::memory_order_relaxed);
  control_->sender_generation.store(generation, std::memory_order_release);
}

PeerStatus ShmRingSender::receiver_status(bool check_liveness) const {
  if (control_->receiver_closed.load(std::memory_order_acquire) != 0) return PeerStatus::closed;
  if (check_liveness && !process_is_alive(receiver_pid_)) return PeerStatus::died;
  return PeerStatus::alive;
}

void ShmRingSender::raise_send_failure(WaitFailure failure, uint64_t seq, const std::string& reason) const {
  const std::string self = "rank " + std::to_string(config_.self_rank);
  const std::string peer = "rank " + std::to_string(config_.peer_rank);
  const std::string waiting = " waiting to send message " + std::to_string(seq);
  switch (failure) {
    case WaitFailure::peer_closed:
      throw ProtocolError(error_prefix_ + "peer " + peer + " closed the channel" +
                          abort_note(control_->receiver_reason, control_->receiver_reason_bytes) + " while " + self +
                          " was" + waiting);
    case WaitFailure::peer_died:
      throw PeerDiedError(error_prefix_ + "peer " + peer + " (pid " + std::to_string(receiver_pid_) +
                          ") died while " + self + " was" + waiting);
    case WaitFailure::interrupted:
      throw ProtocolError(error_prefix_ + self + " stopped" + waiting + ": another thread is closing the channel");
    case WaitFailure::timeout:
      break;
  }
  throw TimeoutError(error_prefix_ + self + " timed out after " + format_seconds(config_.timeout_s) + " s" + waiting +
                     " (" + reason + ")");
}

void ShmRingSender::wait_for_slot(uint64_t seq) {
  const uint32_t num_slots = config_.num_slots;
  wait_for(
      control_->sender_wake, config_.timeout_s, interrupted_,
      [&] {
        if (wait_hook_) wait_hook_();
        return control_->read_count.load(std::memory_order_acquire) + num_slots > seq;
      },
      [&](bool check_liveness) { return receiver_status(check_liveness); },
      [&](WaitFailure failure) {
        raise_send_failure(failure, seq,
                           "ring full: rank " + std::to_string(config_.peer_rank) + " has not released message " +
                               std::to_string(seq - num_slots));
      });
}

// The receiver services the request inside recv()/try_recv(); we keep adopting whatever it publishes.
void ShmRingSender::grow_slots(size_t needed_bytes, uint64_t seq) {
  control_->grow_request_bytes.store(needed_bytes, std::memory_order_release);
  notify(control_->receiver_wake);
  wait_for(
      control_->sender_wake, config_.timeout_s, interrupted_,
      [&] {
        if (wait_hook_) wait_hook_();
        adopt_published_generation();
        return slot_bytes_ >= needed_bytes;
      },
      [&](bool check_liveness) { return receiver_status(check_liveness); },
      [&](WaitFailure failure) {
        raise_send_failure(failure, seq,
                           "rank " + std::to_string(config_.peer_rank) + " has not grown the slots to " +
                               std::to_string(needed_bytes) + " bytes; it does so inside recv()/try_recv()");
      });
  control_->grow_request_bytes.store(0, std::memory_order_relaxed);
}

void ShmRingSender::send(const MessagePart* parts, size_t num_parts, uint32_t tag) {
  if (num_parts != 0 && parts == nullptr) {
    throw std::invalid_argument("pipecomm shm ring: send got a null parts array with " + std::to_string(num_parts) +
                                " parts");
  }
  if (closed_) {
    throw ProtocolError(error_prefix_ + "rank " + std::to_string(config_.self_rank) +
                        " cannot send: the channel was closed");
  }
  wait_connected();
  const uint64_t seq = next_send_seq_;
  if (control_->receiver_closed.load(std::memory_order_acquire) != 0) {
    raise_send_failure(WaitFailure::peer_closed, seq, "");
  }
  const size_t payload_bytes = packed_message_bytes(parts, num_parts);
  wait_for_slot(seq);
  adopt_published_generation();
  if (payload_bytes > slot_bytes_) grow_slots(payload_bytes, seq);

  std::byte* slot_data = data_segment_.data() + (seq % config_.num_slots) * slot_bytes_;
  size_t offset = 0;
  for (size_t index = 0; index < num_parts; ++index) {
    offset = align_to_pack(offset);
    if (parts[index].bytes != 0) std::memcpy(slot_data + offset, parts[index].data, parts[index].bytes);
    offset += parts[index].bytes;
  }
  assert(offset == payload_bytes);
  SlotHeader& slot = slot_header(control_, seq);
  slot.payload_bytes = payload_bytes;
  slot.tag = tag;
  slot.generation = data_generation_;
  slot.published_seq.store(seq + 1, std::memory_order_release);
  control_->write_count.store(seq + 1, std::memory_order_release);
  notify(control_->receiver_wake);
  next_send_seq_ = seq + 1;
}

void ShmRingSender::send(const std::vector<MessagePart>& parts, uint32_t tag) {
  send(parts.data(), parts.size(), tag);
}

void ShmRingSender::send_bytes(const void* data, size_t bytes, uint32_t tag) {
  const MessagePart part{data, bytes};
  send(&part, 1, tag);
}

bool ShmRingSender::can_send_now() const {
  return !closed_ && control_ != nullptr && control_->receiver_closed.load(std::memory_order_acquire) == 0 &&
         control_->read_count.load(std::memory_order_acquire) + config_.num_slots > next_send_seq_;
}

void ShmRingSender::interrupt() noexcept {
  interrupted_.store(true, std::memory_order_release);
  // send() may be asleep on the futex: wake it now rather than at the end of its slice.
  if (control_ != nullptr) notify(control_->sender_wake);
}

void ShmRingSender::close(const std::string& reason) noexcept {
  if (closed_) return;
  closed_ = true;
  // A forked child (e.g. a DataLoader worker) inherits this object but must not close the parent's channel.
  if (control_ != nullptr && getpid() == owner_pid_) {
    write_reason(control_->sender_reason, control_->sender_reason_bytes, reason);
    control_->sender_closed.store(1, std::memory_order_release);
    notify(control_->receiver_wake);
    // If the receiver died after publishing a generation we never mapped, nobody else unlinks it.
    const uint32_t published = control_->published_generation.load(std::memory_order_acquire);
    if (published != data_generation_) unlink_quietly(data_segment_name(published));
  }
  data_segment_.reset();
  control_ = nullptr;
  control_segment_.reset();
}

}  // namespace pipecomm::transport
