// A CUDA-IPC channel between this process and one peer: metadata on shared-memory host rings, data
// by the copy engines straight into buffers the peer posted, else into its device slots; the host never
// waits on the GPU. Its control (grow requests and their answers) runs on the process's control plane.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../op_checks.h"
#include "ipc_close_handshake.h"
#include "ipc_control.h"
#include "ipc_generation_allocator.h"
#include "ipc_host_inbox.h"
#include "ipc_peer_posts.h"
#include "ipc_posted_buffers.h"
#include "ipc_receive_ahead.h"
#include "ipc_records.h"
#include "ipc_ring.h"
#include "message.h"
#include "phase_clock.h"
#include "ring_tags.h"
#include "shm_ring.h"

namespace pipecomm::transport {
namespace {

// One region per tensor, at the offsets pack() gives them (packed_offsets), so both ends agree from
// shapes alone.
std::vector<CopyRegion> regions_of(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets) {
  std::vector<CopyRegion> regions;
  regions.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    regions.push_back({tensors[i].data_ptr(), static_cast<size_t>(offsets[i]), tensors[i].nbytes()});
  }
  return regions;
}

// Messages up to this size are copied on the caller's stream: no events to order two streams, so
// less latency, and the copy engine's few microseconds barely delay the caller's next kernel.
// Larger ones go on the channel's stream and overlap the caller's compute.
constexpr size_t kCallerStreamMaxBytes = size_t{1} << 20;

bool on_caller_stream(size_t bytes) { return bytes <= kCallerStreamMaxBytes; }

// Room for two posts per message ahead (one more after a layout change) and a few stale ones; more
// than the cap are dropped, which only sends those messages by slot.
uint32_t post_ring_slots(uint32_t num_slots) { return std::min<uint32_t>(num_slots, 1024) * 2 + 10; }

// Layout keys remembered per channel: a run with ever new shapes (a sequence length per step) keeps only the latest.
constexpr size_t kMaxLayoutKeys = 64;

// PIPECOMM_RUN_AHEAD=1 turns receiving ahead of the peer's note on (recv's layout key is ignored otherwise).
// Off by default: a mispredicted message can fail a step or wait on this host (docs/transport.md says when).
bool run_ahead_enabled() {
  const char* value = std::getenv("PIPECOMM_RUN_AHEAD");
  return value != nullptr && std::string(value) == "1";
}

// How long each half of the close handshake waits for the peer: both are short, so close() stays quick.
constexpr auto kClosePatience = std::chrono::milliseconds(100);

// The most of a refused grow's reason that goes to the peer: well within a post ring slot.
constexpr size_t kRefusalReasonBytes = 1024;

void check_cuda(cudaError_t error, const char* call) {
  TORCH_CHECK(error == cudaSuccess, "pipecomm ipc channel: ", call, " failed: ", cudaGetErrorString(error));
}

// A ring's error, raised again as the same kind of error after `context`.
[[noreturn]] void rethrow_after(const std::exception_ptr& failure, const std::string& context) {
  try {
    std::rethrow_exception(failure);
  } catch (const PeerDiedError& error) {
    throw PeerDiedError(context + error.what());
  } catch (const TimeoutError& error) {
    throw TimeoutError(context + error.what());
  } catch (const ProtocolError& error) {
    throw ProtocolError(context + error.what());
  } catch (const ChannelError& error) {
    throw ChannelError(context + error.what());
  }
}

// A message to send, as the caller's entries describe it.
struct OutgoingMessage {
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> offsets;  // packed, total bytes last
  size_t bytes;
  uint64_t fingerprint;
  std::optional<MessageMeta> changed_meta;  // set when it differs from the last message's
};

// Not thread-safe: send, recv, shrink and close must not overlap (the Python Channel enforces it).
// Each holds call_mutex_ from start to end, which any waiting call in the process also takes (with
// try_lock) to service this channel's incoming control; interrupt() may come at any time.
class IpcChannel {
 public:
  IpcChannel(const std::string& incoming_name, const std::string& outgoing_name, int self_rank, int peer_rank,
             int device, uint32_t num_slots, size_t slot_bytes, double timeout_s)
      : host_receiver_(RingConfig{incoming_name, self_rank, peer_rank, num_slots, 1 << 16, timeout_s, "ipc"}),
        host_sender_(RingConfig{outgoing_name, self_rank, peer_rank, num_slots, 1 << 16, timeout_s, "ipc"}),
        // The data receiver sends posts: its post ring runs against its data ring.
        post_receiver_(RingConfig{outgoing_name + ".posts", self_rank, peer_rank, post_ring_slots(num_slots), 4096,
                                  timeout_s, "ipc"}),
        post_sender_(RingConfig{incoming_name + ".posts", self_rank, peer_rank, post_ring_slots(num_slots), 4096,
                                timeout_s, "ipc"}),
        device_(at::kCUDA, static_cast<c10::DeviceIndex>(device)),
        self_rank_(self_rank),
        peer_rank_(peer_rank),
        send_direction_("pipecomm ipc channel rank " + std::to_string(self_rank) + " -> rank " +
                        std::to_string(peer_rank)),
        receive_direction_("pipecomm ipc channel rank " + std::to_string(peer_rank) + " -> rank " +
                           std::to_string(self_rank)),
        timeout_s_(timeout_s),
        receiver_(device, num_slots, slot_bytes, receive_direction_,
                  std::make_unique<CachingGenerationAllocator>(device_)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())),
        inbox_(host_receiver_, num_slots, self_rank, peer_rank),
        peer_posts_(post_receiver_, send_direction_, [this](const std::string& handles) { sender_->update(handles); }),
        // A sender decides on message n once its host ring took message n - 1, i.e. once this end
        // released message n - 1 - num_slots: posting num_slots + 1 ahead of each release keeps a
        // steady stream on the direct path, at that many messages' worth of memory.
        posted_(device_, uint64_t{num_slots} + 1),
        received_(make_layout({})),
        sent_fingerprint_(fingerprint({})),
        initial_slot_bytes_(round_slot_bytes(slot_bytes, receive_direction_)),
        idle_run_to_give_back_(2 * (uint64_t{num_slots} + 1)) {
    // The ring calls its hook once before it knows whether the send must wait at all; the later calls
    // are a wait, in which this process answers whatever its peers asked.
    host_sender_.set_wait_hook([this] {
      if (host_send_waited_) ControlPlane::process().service_all();
      host_send_waited_ = true;
    });
    const c10::cuda::CUDAGuard guard(device_);
    check_cuda(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check_cuda(cudaEventCreateWithFlags(&channel_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }

  ~IpcChannel() {
    membership_.reset();  // before anything a servicing thread would touch goes
    (void)cudaEventDestroy(caller_done_);
    (void)cudaEventDestroy(channel_done_);
  }

  py::bytes handles() {
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    return receiver_.export_handles();
  }

  void connect(const std::string& peer_handles) {
    sender_.emplace(device_.index(), peer_handles, send_direction_);
    host_sender_.wait_connected();
    host_receiver_.wait_connected();
    post_sender_.wait_connected();
    post_receiver_.wait_connected();
    membership_.emplace(ControlPlane::process(), call_mutex_, [this] {
      inbox_.poll(grow_answer_);
      settle_arrived();  // the peer may be waiting for those releases to send what this process waits for
    });
  }

  void send(const py::sequence& entries) {
    send_clock_.start();
    refuse_after_failed_send();
    OutgoingMessage message = outgoing_message(entries);
    py::gil_scoped_release no_gil;
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    settle_arrived();
    send_clock_.lap(kSendEntries);
    const c10::cuda::CUDAGuard guard(device_);
    const std::optional<PostRecord> post = mappable_post(message);
    if (!post && message.bytes > sender_->slot_bytes()) grow_peer_slots(message.bytes);
    send_clock_.lap(kSendPosts);
    send_layout_if_changed(message);
    const c10::cuda::CUDAStream stream = copy_stream(message.bytes);
    send_data_note(post);
    send_clock_.lap(kSendNote);
    enqueue_copy(message, post, stream);
    send_clock_.lap(kSendCopy);
    keep_until_copied(message);
    ++send_seq_;
    send_clock_.lap(kSendRest);
  }

  // Goes with the next send's data note (ring_tags.h says why).
  void send_note(const std::string& data) {
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    append_note(outgoing_notes_, data);
  }

  // With a layout key (Channel.recv's), a message whose key came before with the layout this end posts for
  // returns at once, the caller's stream waiting on the device for its data, and its note is checked later
  // (settle_ahead): the host runs ahead of the peer's.
  py::tuple recv(std::optional<int64_t> layout_key) {
    recv_clock_.start();
    Entries incoming;
    {
      py::gil_scoped_release no_gil;
      const std::lock_guard<std::recursive_mutex> call(call_mutex_);
      incoming = layout_key && run_ahead_ ? receive_keyed(*layout_key) : receive_in_order();
    }
    py::tuple out = to_python(incoming);
    recv_clock_.lap(kRecvToPython);
    return out;
  }

  // Checks every message received ahead against its note; raises ProtocolError for one the peer sent otherwise.
  void settle() {
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    settle_ahead();
  }

  // The oldest note not taken yet of those that came with the messages received; None if there is none.
  py::object recv_note() {
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    {
      py::gil_scoped_release no_gil;
      settle_ahead();  // the notes of messages received ahead come with their checks
    }
    if (notes_.empty()) return py::none();
    py::bytes note(notes_.front());
    notes_.pop_front();
    return note;
  }

  // Gives the incoming slots a smaller generation, from a message the peer cannot have reached: it may
  // be num_slots + 1 messages ahead of what this end has received (its notes fill the host ring, and it
  // looks for new generations before each send). The old generation goes back to torch's caching
  // allocator once the messages before that one are received. Returns whether it shrank; not when the
  // slots are no bigger than slot_bytes, nor while the post ring is full (the peer is not sending).
  bool shrink(size_t slot_bytes) {
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    settle_ahead();  // its first message counts from those received in order
    if (round_slot_bytes(slot_bytes, receive_direction_) >= receiver_.slot_bytes() || !post_sender_.can_send_now()) {
      return false;
    }
    const std::string handles = receiver_.resize(slot_bytes, recv_seq_ + receiver_.num_slots() + 1);
    post_sender_.send_bytes(handles.data(), handles.size(), kTagGeneration);
    return true;
  }

  bool transfers_done() const { return cudaStreamQuery(stream_.stream()) == cudaSuccess; }

  // The stream a large message is copied on, as torch.cuda.Stream takes it (stream_id, device_index, device_type):
  // an event recorded there after a send is one the caller's stream can wait on before writing the sent tensors.
  py::tuple channel_stream() const {
    const c10::StreamData3 data = stream_.pack3();
    return py::make_tuple(data.stream_id, data.device_index, static_cast<int>(data.device_type));
  }

  // Makes a send or recv waiting in another thread raise ProtocolError at once; close() follows. The
  // only method that may overlap another.
  void interrupt() noexcept {
    const std::lock_guard<std::mutex> lock(closing_);
    interrupted_.store(true, std::memory_order_release);
    host_sender_.interrupt();
  }

  // For a peer that died with copies still queued: the rings then leak their memory instead of
  // waiting forever for flags nobody will write.
  void abandon() {
    receiver_.abandon();
    if (sender_) sender_->abandon();
  }

  // The close handshake (ipc_close_handshake.h): each end frees the memory it exported only once the
  // peer said it unmapped it. A non-empty reason (an abort's) is quoted in the peer's error.
  void close(const std::string& reason) noexcept {
    const std::lock_guard<std::mutex> closing(closing_);
    const std::lock_guard<std::recursive_mutex> call(call_mutex_);
    if (reason.empty()) {
      try {
        settle_ahead();  // the close handshake reads the host ring after those notes
      } catch (const std::exception&) {
        // Closing all the same: the caller that received ahead learns of it from its own settle.
      }
    }
    // Data that will not come now (an abort, a refused message): the caller's streams must not wait forever.
    if (!ahead_.empty()) receiver_.release_own_waits(ahead_.front().seq);
    membership_.reset();  // a closing channel answers no more requests
    const bool unmapped = sender_ && sender_->unmap_when_done(kClosePatience);
    const CloseOutcome outcome = exchange_close_notes(host_sender_, inbox_, unmapped, kClosePatience);
    // The rings the peer's send uses close before those its recv waits on, so that a peer whose recv
    // woke to this close finds its next send refused.
    host_receiver_.close(reason);
    post_sender_.close(reason);
    host_sender_.close(reason);
    post_receiver_.close(reason);
    posted_.close(/*give_memory_back=*/outcome.peer_unmapped && !outcome.unreceived);
    if (!outcome.peer_unmapped) receiver_.abandon();
  }

  // With PIPECOMM_IPC_HOST_TIMING=1: per phase of send and of recv, (name, total µs, calls).
  py::dict host_phase_times() const {
    py::dict times;
    times["send"] = send_clock_.totals();
    times["recv"] = recv_clock_.totals();
    return times;
  }

  uint64_t direct_sends() const { return direct_sends_; }
  uint64_t direct_recvs() const { return direct_recvs_; }
  uint64_t ahead_recvs() const { return ahead_recvs_; }

 private:
  c10::cuda::CUDAStream caller_stream() const { return at::cuda::getCurrentCUDAStream(device_.index()); }

  void wait_for_caller() {
    check_cuda(cudaEventRecord(caller_done_, caller_stream().stream()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_.stream(), caller_done_, 0), "cudaStreamWaitEvent");
  }

  // The ring's hook tells a wait from its first look (host_send_waited_).
  void send_on_host_ring(const void* data, size_t bytes, uint32_t tag) {
    host_send_waited_ = false;
    host_sender_.send_bytes(data, bytes, tag);
  }

  std::string rank_name(int rank) const { return "rank " + std::to_string(rank); }

  // ---- The send's steps.

  void refuse_after_failed_send() const {
    if (failed_send_.empty()) return;
    throw ChannelError(send_direction_ + ": a send failed after its note to the peer went out (" + failed_send_ +
                       "); the peer waits for that message, so this channel cannot send again");
  }

  OutgoingMessage outgoing_message(const py::sequence& entries) const {
    const Entries outgoing = outgoing_entries(entries, device_, send_direction_);
    OutgoingMessage message;
    message.tensors = present_tensors(outgoing);
    message.offsets = packed_offsets(message.tensors);
    message.bytes = static_cast<size_t>(message.offsets.back());
    message.fingerprint = sent_fingerprint_;
    if (!describes(sent_meta_, outgoing)) {
      message.changed_meta = describe(outgoing);
      message.fingerprint = fingerprint(*message.changed_meta);
    }
    return message;
  }

  // The peer's post for this message if one came that this process can map. An allocation it cannot
  // map will not map later either: the direct path then ends.
  std::optional<PostRecord> mappable_post(const OutgoingMessage& message) {
    const std::optional<PostRecord> post = peer_posts_.post_for_next_message(send_seq_, message.fingerprint, message.bytes);
    if (post && !sender_->can_map(cuda_handle_of(*post))) {
      peer_posts_.disable_direct();
      return std::nullopt;
    }
    return post;
  }

  // Asks the peer on the host ring for slots of at least `bytes` from this message on, and waits for
  // the grown generation on the post ring. The wait services the control plane, so a peer waiting for
  // this process's answer meanwhile, on this channel or another, gets it.
  void grow_peer_slots(size_t bytes) {
    const GrowRequest request{bytes, send_seq_};
    send_on_host_ring(&request, sizeof(request), kTagGrow);
    ServicingWait wait(timeout_s_);
    while (true) {
      peer_posts_.drain(send_seq_);
      if (sender_->slot_bytes() >= bytes) return;
      check_grow_wait(request, wait);
      wait.pause(ControlPlane::process());
    }
  }

  // Ends a wait for a grow that cannot come: refused, the peer gone, an interrupt, or the timeout.
  void check_grow_wait(const GrowRequest& request, const ServicingWait& wait) const {
    const std::optional<std::string> refusal = peer_posts_.refusal_of(request);
    const std::exception_ptr gone = peer_posts_.failure() ? peer_posts_.failure() : inbox_.failure();
    const bool stopped = interrupted_.load(std::memory_order_acquire);
    if (!refusal && !gone && !stopped && !wait.expired()) return;
    const std::string growth = " to grow its slots to " + std::to_string(request.slot_bytes) + " bytes for message " +
                               std::to_string(request.first_seq);
    const std::string self = send_direction_ + ": " + rank_name(self_rank_);
    const std::string waiting = " waiting for " + rank_name(peer_rank_) + growth;
    if (refusal) throw ChannelError(send_direction_ + ": " + rank_name(peer_rank_) + " failed" + growth + ": " + *refusal);
    if (gone) rethrow_after(gone, self + " stopped" + waiting + ": ");
    if (stopped) throw ProtocolError(self + " stopped" + waiting + ": another thread is closing the channel");
    throw TimeoutError(self + " " + wait.timed_out() + waiting);
  }

  void send_layout_if_changed(OutgoingMessage& message) {
    if (!message.changed_meta) return;
    const std::string encoded = encode(*message.changed_meta);
    send_on_host_ring(encoded.data(), encoded.size(), kTagMeta);
    sent_meta_ = std::move(*message.changed_meta);
    sent_fingerprint_ = message.fingerprint;
  }

  // The tensors were written on the caller's stream; large messages are copied on the channel's,
  // ordered after it.
  c10::cuda::CUDAStream copy_stream(size_t bytes) {
    if (on_caller_stream(bytes)) return caller_stream();
    wait_for_caller();
    return stream_;
  }

  // The note goes out before the copy is enqueued: the peer's host then enqueues its receive while
  // this host enqueues the send, instead of after it. Nothing left to do can fail but the CUDA
  // calls themselves; if one does, the peer's stream waits for a message that never comes, as it
  // would for a peer that died, and this channel refuses to send again.
  void send_data_note(const std::optional<PostRecord>& post) {
    const DataNote note{post ? post->post : 0, receiver_.posts_ordered_before(caller_stream().stream())};
    const uint32_t tag = post ? kTagDataDirect : kTagData;
    if (outgoing_notes_.empty()) {
      send_on_host_ring(&note, sizeof(note), tag);
      return;
    }
    std::string with_notes(reinterpret_cast<const char*>(&note), sizeof(note));
    with_notes += outgoing_notes_;
    send_on_host_ring(with_notes.data(), with_notes.size(), tag);
    outgoing_notes_.clear();
  }

  void enqueue_copy(const OutgoingMessage& message, const std::optional<PostRecord>& post,
                    const c10::cuda::CUDAStream& stream) {
    const std::vector<CopyRegion> regions = regions_of(message.tensors, message.offsets);
    try {
      if (post) {
        // Large messages' copies run on the channel's stream, which was just ordered after the
        // caller's: what the caller's stream is known to follow, they follow too.
        const bool posted_passed = peer_posts_.passed(*post, caller_stream().stream());
        if (!sender_->enqueue_send_direct(send_seq_, post->post, cuda_handle_of(*post), static_cast<size_t>(post->offset),
                                          static_cast<size_t>(post->bytes), regions.data(), regions.size(),
                                          stream.stream(), posted_passed)) {
          throw ChannelError("the posted buffer's allocation could no longer be mapped");
        }
        ++direct_sends_;
      } else {
        sender_->enqueue_send(send_seq_, regions, stream.stream());
      }
    } catch (const std::exception& error) {
      failed_send_ = "message " + std::to_string(send_seq_) + ": " + error.what();
      throw;
    }
  }

  // Keeps the caching allocator from reusing the tensors' memory before the channel stream's copies
  // have read it.
  void keep_until_copied(const OutgoingMessage& message) const {
    if (on_caller_stream(message.bytes)) return;
    for (const at::Tensor& tensor : message.tensors) {
      c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
    }
  }

  // ---- The receive's steps.

  Entries receive_in_order() {
    settle_ahead();
    return receive_message();
  }

  // The key's layout, learned from the last message received in order with it: if it is the one this end
  // posts for and the post for this message reached the peer before it decided how to send it, the message
  // goes into that post unless its layout differs, which settle_ahead then reports. Only as far as the peer can
  // send without a release this end has not made: then nothing the caller's stream waits for waits on this
  // host, and a device synchronization here (the caching allocator's, the user's) cannot hang.
  Entries receive_keyed(int64_t key) {
    settle_arrived();
    if (!mispredicted_.empty()) throw ProtocolError(mispredicted_);
    const auto learned = learned_layouts_.find(key);
    if (learned != learned_layouts_.end() && learned->second == received_->fingerprint && direct_recvs_ > 0) {
      // The notes of the messages received ahead come before this one's: waiting for them costs less.
      if (static_cast<int64_t>(recv_seq_) >= first_unsendable()) settle_ahead();
      if (const PostedBuffer* post = posted_.find_before_decision(recv_seq_, received_->fingerprint)) {
        return receive_ahead(*post);
      }
    }
    Entries incoming = receive_in_order();
    if (learned_layouts_.size() >= kMaxLayoutKeys) learned_layouts_.clear();
    learned_layouts_[key] = received_->fingerprint;
    return incoming;
  }

  Entries receive_ahead(const PostedBuffer& post) {
    const c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream caller = caller_stream();
    receiver_.enqueue_receive_direct(recv_seq_, caller.stream());
    if (caller.stream() != post.stream) {
      c10::cuda::CUDACachingAllocator::recordStream(post.buffer.storage().data_ptr(), caller);
    }
    Entries incoming = views_of(post.buffer, *received_);
    ahead_.push_back({recv_seq_, post.post, caller.stream()});
    ++direct_recvs_;
    ++ahead_recvs_;
    ++recv_seq_;
    posted_.post_ahead(recv_seq_, received_, caller.stream(), receiver_, post_sender_, first_decided_after_posting());
    return incoming;
  }

  // The notes of the messages received ahead, each checked: it went into the post the receive read.
  void settle_ahead() {
    if (!mispredicted_.empty()) throw ProtocolError(mispredicted_);
    while (!ahead_.empty()) check_ahead(wait_for_host_message());
  }

  // Those whose notes are in, without waiting: each checked and its host message released, as soon as can be,
  // for the peer's sends are held back by what is not. A message sent otherwise is raised by the next settle.
  void settle_arrived() {
    // Not from inside this channel's own wait for a host message (its pauses service the control plane, this
    // channel included): that wait hands out the next message itself.
    if (ahead_.empty() || !mispredicted_.empty() || waiting_for_message_) return;
    inbox_.poll(grow_answer_);
    try {
      while (!ahead_.empty()) {
        const std::optional<Message> message = inbox_.next_message();
        if (!message) return;
        check_ahead(*message);
      }
    } catch (const std::exception& error) {
      if (mispredicted_.empty()) mispredicted_ = error.what();  // raised by the next settle
      receiver_.release_own_waits(ahead_.front().seq);
    }
  }

  // The note of the oldest message received ahead: it must say the data went into the post the receive read.
  void check_ahead(const Message& message) {
    const ReceivedAhead ahead = ahead_.front();
    const bool direct = message.tag == kTagDataDirect;
    const DataNote note = message.tag == kTagMeta ? DataNote{} : data_note_of(message);
    if (!direct || note.post != ahead.post) {
      mispredicted_ = receive_direction_ + ": message " + std::to_string(ahead.seq) +
                      " was received ahead of its note, as the layout its key had before, but the peer sent " +
                      (message.tag == kTagMeta ? "another layout" : "it elsewhere") +
                      ": what the caller's stream read is not that message. The layout key must name the "
                      "message's layout (unset PIPECOMM_RUN_AHEAD to receive in order)";
      receiver_.release_own_waits(ahead.seq);
      throw ProtocolError(mispredicted_);
    }
    keep_notes_after(message);
    known_data_seq_ = static_cast<int64_t>(ahead.seq);
    known_host_seq_ = static_cast<int64_t>(message.seq);
    peer_posts_.learn_passed(note.posts_passed, ahead.stream);
    posted_.drop_through(ahead.seq);
    inbox_.release(message.seq);
    ahead_.pop_front();
  }

  ReceiveAheadBounds ahead_bounds() const {
    return {receiver_.num_slots(), inbox_.released(), known_data_seq_, known_host_seq_};
  }
  uint64_t first_decided_after_posting() const { return ahead_bounds().first_decided_after_posting(); }
  int64_t first_unsendable() const { return ahead_bounds().first_unsendable(); }

  Entries receive_message() {
    const bool posted_early = post_early();
    recv_clock_.lap(kRecvEarlyPosts);
    Message message = wait_for_host_message();
    recv_clock_.lap(kRecvNoteWait);
    const bool layout_changed = message.tag == kTagMeta;
    if (layout_changed) message = adopt_layout(message);
    const DataNote note = data_note_of(message);
    keep_notes_after(message);
    known_data_seq_ = static_cast<int64_t>(recv_seq_);
    known_host_seq_ = static_cast<int64_t>(message.seq);
    const c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream caller = caller_stream();
    // Posted ahead of this message's wait, the posts' counter writes stay off the stream's critical path.
    if (!layout_changed && !posted_early) {
      posted_.post_ahead(recv_seq_ + 1, received_, caller, receiver_, post_sender_, first_decided_after_posting());
    }
    last_layout_repeated_ = !layout_changed;
    recv_clock_.lap(kRecvLatePosts);
    const bool direct = message.tag == kTagDataDirect;
    Entries incoming = direct ? receive_direct(note.post, caller) : receive_by_slot(caller);
    recv_clock_.lap(kRecvEnqueue);
    finish_receive(message, note, caller);
    give_back_idle_slots(!direct && static_cast<size_t>(received_->offsets.back()) > initial_slot_bytes_);
    recv_clock_.lap(kRecvRelease);
    return incoming;
  }

  // Slots grown for large messages sit unused while the posts carry every large message (a pipeline's steady
  // state: each slot holds a message's size, num_slots of them, beside the posts' own buffers; a small message
  // between, as a loss broadcast, fits the slots connect gave). After a run of messages none of which needed the
  // grown slots, they shrink back to that size, their memory to torch's allocator. The run asked for doubles at
  // each give-back, so a stream that keeps needing them regrows them a few times at most: a grow costs the sender
  // a round trip to this end.
  void give_back_idle_slots(bool used_grown_slots) {
    idle_run_ = used_grown_slots ? 0 : idle_run_ + 1;
    if (idle_run_ < idle_run_to_give_back_ || receiver_.slot_bytes() <= initial_slot_bytes_) return;
    bool shrank = false;
    try {
      shrank = shrink(initial_slot_bytes_);
    } catch (const ChannelError&) {
      return;  // the peer closed the post ring: the message is received all the same, the next call says why
    }
    if (shrank) {
      idle_run_ = 0;
      idle_run_to_give_back_ *= 2;
    }
  }

  // A layout seen twice in a row is predicted for the next messages; a new one may be a one-off.
  // The posts for later messages go out while the peer's note is still on its way, off the path
  // from its arrival to this call's return (a change of layout in this message leaves them
  // unused, as the posts made before it are). Returns whether it posted.
  bool post_early() {
    if (!last_layout_repeated_) return false;
    const c10::cuda::CUDAGuard guard(device_);
    posted_.post_ahead(recv_seq_ + 1, received_, caller_stream(), receiver_, post_sender_,
                       first_decided_after_posting());
    return true;
  }

  // The peer's next metadata or data note. The wait services the control plane: the grow request a
  // slot-path message may need comes before it, and a peer waiting for this process's answer on
  // another channel gets it too.
  Message wait_for_host_message() {
    const bool outer = waiting_for_message_;
    waiting_for_message_ = true;
    try {
      Message message = inbox_.wait_for_message(grow_answer_, ControlPlane::process(), timeout_s_, interrupted_);
      waiting_for_message_ = outer;
      return message;
    } catch (...) {
      waiting_for_message_ = outer;
      throw;
    }
  }

  // A metadata message: the layout of this message and the next ones. Returns the data note after it.
  Message adopt_layout(const Message& meta) {
    received_ = make_layout(decode(std::string(static_cast<const char*>(meta.data), meta.bytes), receive_direction_));
    inbox_.release(meta.seq);
    return wait_for_host_message();
  }

  DataNote data_note_of(const Message& message) const {
    if ((message.tag != kTagData && message.tag != kTagDataDirect) || message.bytes < sizeof(DataNote)) {
      throw ProtocolError(receive_direction_ + ": host message " + std::to_string(message.seq) + " has tag " +
                          std::to_string(message.tag) + " and " + std::to_string(message.bytes) +
                          " bytes where data was expected");
    }
    DataNote note;
    std::memcpy(&note, message.data, sizeof(note));
    return note;
  }

  // The caller's notes that came after the data note, for recv_note.
  void keep_notes_after(const Message& message) {
    const size_t after = message.bytes - sizeof(DataNote);
    if (!read_notes(static_cast<const char*>(message.data) + sizeof(DataNote), after, notes_)) {
      throw ProtocolError(receive_direction_ + ": host message " + std::to_string(message.seq) + " holds " +
                          std::to_string(after) + " bytes after its data note that are no notes");
    }
  }

  // The message came into the buffer this end posted for it: the caller's stream waits for its ready
  // flag, and the tensors are views of the buffer.
  Entries receive_direct(uint64_t post_number, const c10::cuda::CUDAStream& caller) {
    const PostedBuffer* post = posted_.find(recv_seq_, post_number);
    if (post == nullptr || (post->layout != received_ && post->layout->meta != received_->meta)) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(recv_seq_) + " came into post " +
                          std::to_string(post_number) + ", but " +
                          (post ? "that buffer was posted for another layout" : "no such buffer was posted for it"));
    }
    receiver_.enqueue_receive_direct(recv_seq_, caller.stream());
    if (caller.stream() != post->stream) {
      c10::cuda::CUDACachingAllocator::recordStream(post->buffer.storage().data_ptr(), caller);
    }
    ++direct_recvs_;
    return views_of(post->buffer, *received_);
  }

  // The message is in this end's slot: copied out into fresh tensors.
  Entries receive_by_slot(const c10::cuda::CUDAStream& caller) {
    Entries incoming = allocate(received_->meta, device_);
    const std::vector<at::Tensor> tensors = present_tensors(incoming);
    const std::vector<CopyRegion> regions = regions_of(tensors, received_->offsets);
    if (on_caller_stream(static_cast<size_t>(received_->offsets.back()))) {
      receiver_.enqueue_receive(recv_seq_, regions, caller.stream());
      return incoming;
    }
    // The fresh outputs may reuse memory the caller's stream was still using.
    wait_for_caller();
    receiver_.enqueue_receive(recv_seq_, regions, stream_.stream());
    for (const at::Tensor& tensor : tensors) {
      c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
    }
    check_cuda(cudaEventRecord(channel_done_, stream_.stream()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(caller.stream(), channel_done_, 0), "cudaStreamWaitEvent");
    return incoming;
  }

  void finish_receive(const Message& message, const DataNote& note, const c10::cuda::CUDAStream& caller) {
    // Either way the caller's stream now waits for this message's ready write.
    peer_posts_.learn_passed(note.posts_passed, caller.stream());
    posted_.drop_through(recv_seq_);
    ++recv_seq_;
    // Released last: the sender may send one message further only once the posts for it are out.
    inbox_.release(message.seq);
  }

  // ---- Answering the peer's control.

  // Grows this end's slots as the peer asked and sends it the new generation's handles, or why not.
  // False, to be asked again later, while the post ring has no room (the peer drains it as it waits).
  bool answer_grow(const GrowRequest& request) {
    if (!post_sender_.can_send_now()) return false;
    std::string answer;
    uint32_t tag = kTagGeneration;
    try {
      answer = receiver_.grow(request.slot_bytes, request.first_seq);
    } catch (const std::exception& error) {
      answer.assign(reinterpret_cast<const char*>(&request), sizeof(request));
      answer.append(std::string(error.what()).substr(0, kRefusalReasonBytes));
      tag = kTagGrowRefused;
    }
    try {
      post_sender_.send_bytes(answer.data(), answer.size(), tag);
    } catch (const ChannelError&) {
      // The peer closed or died: its own wait reports that.
    }
    return true;
  }

  ShmRingReceiver host_receiver_;
  ShmRingSender host_sender_;
  ShmRingReceiver post_receiver_;  // posts for what this end sends
  ShmRingSender post_sender_;      // posts for what this end receives
  at::Device device_;
  int self_rank_;
  int peer_rank_;
  std::string send_direction_;
  std::string receive_direction_;
  double timeout_s_;
  std::recursive_mutex call_mutex_;  // held by each call, and by whoever services this channel
  std::mutex closing_;  // interrupt() may come while another thread's call ends in close()
  std::atomic<bool> interrupted_{false};
  IpcRingReceiver receiver_;
  std::optional<IpcRingSender> sender_;
  c10::cuda::CUDAStream stream_;
  cudaEvent_t caller_done_ = nullptr;
  cudaEvent_t channel_done_ = nullptr;
  HostInbox inbox_;
  PeerPosts peer_posts_;
  PostedBuffers posted_;
  const HostInbox::GrowAnswer grow_answer_ = [this](const GrowRequest& request) { return answer_grow(request); };
  std::optional<ControlPlane::Membership> membership_;  // from connect() to close()
  MessageMeta sent_meta_;
  std::string outgoing_notes_;     // sent with the next message's data note (append_note's format)
  std::deque<std::string> notes_;  // came with the messages received, not taken by recv_note yet
  std::shared_ptr<const Layout> received_;
  uint64_t sent_fingerprint_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
  std::string failed_send_;  // why a send failed after its note went out; empty while none did
  bool host_send_waited_ = false;
  bool last_layout_repeated_ = false;  // the last message received came without a new layout
  // Received ahead of their notes, in order: the message, the post it was read from, the stream that waited.
  struct ReceivedAhead {
    uint64_t seq;
    uint64_t post;
    cudaStream_t stream;
  };
  std::deque<ReceivedAhead> ahead_;
  std::unordered_map<int64_t, uint64_t> learned_layouts_;  // layout key -> the fingerprint it came with
  const bool run_ahead_ = run_ahead_enabled();
  std::string mispredicted_;  // why a message received ahead was not the one read; every call raises it since
  bool waiting_for_message_ = false;  // inside wait_for_host_message
  // The last data message whose note this end read: its number and the host ring message that carried it.
  int64_t known_data_seq_ = -1;
  int64_t known_host_seq_ = -1;
  const size_t initial_slot_bytes_;
  uint64_t idle_run_to_give_back_;  // give_back_idle_slots': messages in a row not in the grown slots, to shrink them
  uint64_t idle_run_ = 0;           // received in order since the last that needed the grown slots
  uint64_t direct_sends_ = 0;
  uint64_t direct_recvs_ = 0;
  uint64_t ahead_recvs_ = 0;
  enum SendPhase : size_t { kSendEntries, kSendPosts, kSendNote, kSendCopy, kSendRest };
  enum RecvPhase : size_t { kRecvEarlyPosts, kRecvNoteWait, kRecvLatePosts, kRecvEnqueue, kRecvRelease, kRecvToPython };
  PhaseClock<5> send_clock_{{"entries", "posts", "note", "copy", "rest"}};
  PhaseClock<6> recv_clock_{{"early_posts", "note_wait", "late_posts", "enqueue", "release", "to_python"}};
};

}  // namespace

void register_ipc_channel(py::module_& module) {
  py::class_<IpcChannel>(module, "IpcChannel")
      .def(py::init<const std::string&, const std::string&, int, int, int, uint32_t, size_t, double>(),
           py::arg("incoming_name"), py::arg("outgoing_name"), py::arg("self_rank"), py::arg("peer_rank"),
           py::arg("device"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("timeout_s"))
      .def("handles", &IpcChannel::handles)
      .def("connect", &IpcChannel::connect, py::arg("peer_handles"), py::call_guard<py::gil_scoped_release>())
      .def("send", &IpcChannel::send, py::arg("entries"))
      .def("recv", &IpcChannel::recv, py::arg("layout_key") = std::nullopt)
      .def("settle", &IpcChannel::settle, py::call_guard<py::gil_scoped_release>())
      .def("send_note", &IpcChannel::send_note, py::arg("data"), py::call_guard<py::gil_scoped_release>())
      .def("recv_note", &IpcChannel::recv_note)
      .def("shrink", &IpcChannel::shrink, py::arg("slot_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("transfers_done", &IpcChannel::transfers_done)
      .def("channel_stream", &IpcChannel::channel_stream)
      .def("host_phase_times", &IpcChannel::host_phase_times)
      .def("abandon", &IpcChannel::abandon)
      .def("interrupt", &IpcChannel::interrupt)
      .def("close", &IpcChannel::close, py::arg("reason") = "", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("direct_sends", &IpcChannel::direct_sends)
      .def_property_readonly("direct_recvs", &IpcChannel::direct_recvs)
      .def_property_readonly("ahead_recvs", &IpcChannel::ahead_recvs);
}

}  // namespace pipecomm::transport
