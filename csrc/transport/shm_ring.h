// Shared-memory ring: one direction of a point-to-point channel between two processes on one host.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../pack_alignment.h"
#include "errors.h"
#include "shm_segment.h"

namespace pipecomm::transport {

// Both sides pass the same name; the receiver's num_slots and slot_bytes win, the sender adopts them.
struct RingConfig {
  std::string name;  // POSIX shm style, e.g. "/pipecomm.<jobid>.<src>to<dst>"
  int self_rank = 0;
  int peer_rank = 0;
  uint32_t num_slots = 4;
  size_t slot_bytes = size_t{1} << 20;
  double timeout_s = 300.0;
  std::string kind = "shm";  // errors name the channel "pipecomm <kind> channel rank <a> -> rank <b>"
};

struct MessagePart {
  const void* data;
  size_t bytes;
};

// Points into the receiver's slot; valid until release(seq) or close().
struct Message {
  uint64_t seq;
  uint32_t tag;
  const void* data;
  size_t bytes;
};

// Payload size of a message: parts at kPackAlignment offsets (pack_alignment.h), without padding after the last part.
size_t packed_message_bytes(const MessagePart* parts, size_t num_parts);

namespace detail {

struct ControlBlock;

enum class WaitFailure { timeout, peer_closed, peer_died, interrupted };
enum class PeerStatus { alive, closed, died };

// One data segment of the receiver: num_slots slots of slot_bytes each.
struct DataGeneration {
  uint32_t generation = 0;
  size_t slot_bytes = 0;
  std::string name;
  MappedSegment segment;
  // First message seq the sender wrote into the next generation; set once this one is retired.
  uint64_t end_seq = 0;
};

}  // namespace detail

// Each end is used by one thread at a time (not thread-safe), except that interrupt() may come from
// another thread at any time but during close(); the two ends may live in different threads or processes.
class ShmRingReceiver {
 public:
  // Creates the control and first data segment; does not wait for the sender.
  explicit ShmRingReceiver(RingConfig config);
  ~ShmRingReceiver();
  ShmRingReceiver(const ShmRingReceiver&) = delete;
  ShmRingReceiver& operator=(const ShmRingReceiver&) = delete;

  void wait_connected();
  bool sender_attached() const;

  Message recv();
  std::optional<Message> try_recv();
  // Acknowledges a received message, handing its slot back to the sender; strictly in order.
  void release(uint64_t seq);

  // Answers the sender's pending grow request without receiving; recv() and try_recv() do it too.
  void service();

  // Sleeps until the sender publishes something (the next message, say), at most `longest`; returns at once
  // if the next message is already there. For a caller that polls with try_recv() but must wake for its
  // message as soon as recv() would.
  void sleep_until_notified(std::chrono::microseconds longest);

  // Swaps to smaller slots if the ring is empty and no resize is in flight; returns whether it did.
  bool shrink(size_t slot_bytes);

  // Makes a recv() or wait_connected() waiting in another thread raise ProtocolError at once, and every
  // later wait too; the caller then closes this end once that thread has left.
  void interrupt() noexcept;

  // Tells the sender, unmaps and unlinks everything; outstanding Messages become invalid. A non-empty
  // reason (an abort's) is quoted in the sender's error.
  void close(const std::string& reason = {}) noexcept;

  size_t slot_bytes() const;
  uint32_t generation() const;
  uint64_t next_recv_seq() const { return next_recv_seq_; }
  uint64_t released_count() const { return released_count_; }
  const std::string& control_segment_name() const { return control_name_; }

 private:
  void ensure_open(const char* operation) const;
  void service_control();
  void retire_drained_generations();
  void publish_generation(size_t slot_bytes);
  bool message_ready(uint64_t seq);
  Message take_message(uint64_t seq);
  void check_receivable(uint64_t seq) const;
  detail::PeerStatus sender_status(bool check_liveness) const;
  [[noreturn]] void raise_receive_failure(detail::WaitFailure failure, uint64_t seq) const;
  std::string data_segment_name(uint32_t generation) const;

  RingConfig config_;
  pid_t owner_pid_;
  std::string error_prefix_;
  std::string control_name_;
  detail::MappedSegment control_segment_;
  detail::ControlBlock* control_ = nullptr;
  detail::DataGeneration active_;  // the generation the sender writes into
  std::optional<detail::DataGeneration> pending_;  // published, not yet adopted by the sender
  std::vector<detail::DataGeneration> retired_;    // still holding unreleased messages
  uint64_t next_recv_seq_ = 0;
  uint64_t released_count_ = 0;
  std::chrono::steady_clock::time_point next_liveness_check_{};
  std::atomic<bool> interrupted_{false};
};

class ShmRingSender {
 public:
  // Does not touch shared memory; the receiver may not exist yet.
  explicit ShmRingSender(RingConfig config);
  ~ShmRingSender();
  ShmRingSender(const ShmRingSender&) = delete;
  ShmRingSender& operator=(const ShmRingSender&) = delete;

  // Waits (up to timeout_s) for the receiver's segment to appear and attaches to it.
  void wait_connected();
  bool connected() const { return control_ != nullptr; }

  // Copies the parts into the next slot; blocks while the ring is full or the slot must grow.
  void send(const MessagePart* parts, size_t num_parts, uint32_t tag);
  void send(const std::vector<MessagePart>& parts, uint32_t tag);
  void send_bytes(const void* data, size_t bytes, uint32_t tag);
  // Whether a send() of up to slot_bytes() would go ahead at once: attached, neither end closed and a
  // slot free. For optional messages that are dropped rather than waited for.
  bool can_send_now() const;

  // Called repeatedly while send() waits for the receiver. A duplex channel passes its own
  // receiver's service(), so two ends sending oversized messages to each other cannot deadlock.
  void set_wait_hook(std::function<void()> hook) { wait_hook_ = std::move(hook); }

  // Makes a send() waiting in another thread raise ProtocolError at once, and every later wait too; the
  // caller then closes this end once that thread has left.
  void interrupt() noexcept;

  // Lets the receiver drain what was sent, then report the close, quoting a non-empty reason (an abort's).
  void close(const std::string& reason = {}) noexcept;

  uint64_t next_send_seq() const { return next_send_seq_; }
  size_t slot_bytes() const { return slot_bytes_; }

 private:
  bool try_attach();
  void adopt_published_generation();
  void wait_for_slot(uint64_t seq);
  void grow_slots(size_t needed_bytes, uint64_t seq);
  detail::PeerStatus receiver_status(bool check_liveness) const;
  [[noreturn]] void raise_send_failure(detail::WaitFailure failure, uint64_t seq,
                                       const std::string& reason) const;
  std::string data_segment_name(uint32_t generation) const;

  RingConfig config_;
  pid_t owner_pid_;
  std::string error_prefix_;
  bool closed_ = false;
  detail::MappedSegment control_segment_;
  detail::ControlBlock* control_ = nullptr;
  pid_t receiver_pid_ = 0;
  detail::MappedSegment data_segment_;
  uint32_t data_generation_ = 0;
  size_t slot_bytes_ = 0;
  uint64_t next_send_seq_ = 0;
  std::function<void()> wait_hook_;
  std::atomic<bool> interrupted_{false};
};

}  // namespace pipecomm::transport
