// A CUDA-IPC channel between this process and one peer: metadata on shared-memory host rings, data
// by the copy engines straight into buffers the peer posted, else into its device slots; the host never
// waits on the GPU.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../op_checks.h"
#include "ipc_ring.h"
#include "message.h"
#include "phase_clock.h"
#include "posted_buffer_pool.h"
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

// A buffer offered for one incoming message, as the post ring carries it to the sender.
struct PostRecord {
  uint64_t seq;
  uint64_t post;         // the receiver's post number, which the data message names back
  uint64_t fingerprint;  // of the layout the buffer was allocated for
  uint64_t bytes;
  uint64_t offset;  // inside the allocation `handle` names
  cudaIpcMemHandle_t handle;
};
static_assert(std::is_trivially_copyable_v<PostRecord>, "post records are copied as bytes");

// Room for two posts per message ahead (one more after a layout change) and a few stale ones; more
// than the cap are dropped, which only sends those messages by slot.
uint32_t post_ring_slots(uint32_t num_slots) { return std::min<uint32_t>(num_slots, 1024) * 2 + 10; }

// The payload of a data message on the host ring.
struct DataNote {
  uint64_t post;  // the post the data went into (direct messages only)
  // Posts of the sender's own receiving end (0 .. posts_passed - 1) whose counter writes precede,
  // on the sender's stream, this message's ready write. A receiver whose stream waited for this
  // message knows them passed and skips the device wait on their counter when it sends into them.
  uint64_t posts_passed;
};

// A message layout as a receiver caches it: shared by the posts predicted from it.
struct Layout {
  MessageMeta meta;
  uint64_t fingerprint;
  std::vector<int64_t> offsets;  // packed offsets of the present entries, total bytes last
};

std::shared_ptr<const Layout> make_layout(MessageMeta meta) {
  std::vector<int64_t> nbytes;
  for (const EntryMeta& entry : meta) {
    if (entry.present) {
      nbytes.push_back(c10::multiply_integers(entry.sizes) * static_cast<int64_t>(c10::elementSize(entry.dtype)));
    }
  }
  const uint64_t digest = fingerprint(meta);
  return std::make_shared<const Layout>(Layout{std::move(meta), digest, packed_offsets_of_bytes(nbytes)});
}

// A buffer this end posted for an incoming message.
struct PostedBuffer {
  uint64_t seq;
  uint64_t post;
  std::shared_ptr<const Layout> layout;
  at::Tensor buffer;    // uint8, layout->offsets.back() bytes
  cudaStream_t stream;  // it was allocated on
};

// The message's tensors as views of the posted buffer at their packed offsets, built as at::empty
// builds a CUDA tensor, without a dispatcher call per entry.
Entries views_of(const at::Tensor& buffer, const Layout& layout) {
  Entries entries;
  entries.reserve(layout.meta.size());
  size_t present = 0;
  for (const EntryMeta& entry : layout.meta) {
    if (!entry.present) {
      entries.emplace_back(std::nullopt);
      continue;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()),
                                                     c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                     caffe2::TypeMeta::fromScalarType(entry.dtype));
    impl->set_sizes_contiguous(entry.sizes);
    // Packed offsets are multiples of kPackAlignment, which every element size divides.
    impl->set_storage_offset(layout.offsets[present++] / static_cast<int64_t>(c10::elementSize(entry.dtype)));
    entries.emplace_back(at::Tensor(std::move(impl)));
  }
  return entries;
}

void check_cuda(cudaError_t error, const char* call) {
  TORCH_CHECK(error == cudaSuccess, "pipecomm ipc channel: ", call, " failed: ", cudaGetErrorString(error));
}

// Ring data generations from torch's caching allocator, so a shrink (or a grow's superseded
// generation) gives memory back without a cudaFree, which may synchronize the device. They are
// allocated on a stream of their own: the allocator hands a block to a stream once that stream is past
// its last use, and a peer's copies into a generation follow no stream of this process, so no block
// may come with work of other streams still pending on it. Torch reuses given-back memory elsewhere
// after torch.cuda.empty_cache() or, by itself, under memory pressure.
class CachingGenerationAllocator final : public GenerationAllocator {
 public:
  explicit CachingGenerationAllocator(at::Device device) : device_(device) {
    const c10::cuda::CUDAGuard guard(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~CachingGenerationAllocator() override { (void)cudaStreamDestroy(stream_); }

  void* allocate(size_t bytes) override {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream_, device_.index()));
    try {
      held_.push_back(at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_)));
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;  // the ring then tries cudaMalloc and reports a failure in its own words
    }
    return held_.back().data_ptr();
  }

  void release(void* data, const std::vector<cudaStream_t>& readers) noexcept override {
    auto it = std::find_if(held_.begin(), held_.end(), [&](const at::Tensor& memory) { return memory.data_ptr() == data; });
    if (it == held_.end()) return;
    try {
      for (cudaStream_t reader : readers) {
        c10::cuda::CUDACachingAllocator::recordStream(it->storage().data_ptr(),
                                                      c10::cuda::getStreamFromExternal(reader, device_.index()));
      }
    } catch (...) {
      return;  // kept for the process's life rather than reused under a reader
    }
    held_.erase(it);
  }

 private:
  at::Device device_;
  cudaStream_t stream_ = nullptr;
  std::vector<at::Tensor> held_;  // the receiver's lock (receiver_mutex_) covers every call
};

// Not thread-safe: send, recv, shrink and close must not overlap (the Python Channel enforces it; a
// send reads the receiving side's posting state without a lock). grow() runs on the grow service
// thread under receiver_mutex_, and interrupt() may come at any time.
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
        send_direction_("pipecomm ipc channel rank " + std::to_string(self_rank) + " -> rank " +
                        std::to_string(peer_rank)),
        receive_direction_("pipecomm ipc channel rank " + std::to_string(peer_rank) + " -> rank " +
                           std::to_string(self_rank)),
        receiver_(device, num_slots, slot_bytes, receive_direction_,
                  std::make_unique<CachingGenerationAllocator>(device_)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())),
        // A sender decides on message n once its host ring took message n - 1, i.e. once this end
        // released message n - 1 - num_slots: posting num_slots + 1 ahead of each release keeps a
        // steady stream on the direct path, at that many messages' worth of memory.
        post_depth_(uint64_t{num_slots} + 1),
        received_(make_layout({})),
        sent_fingerprint_(fingerprint({})) {
    host_sender_.set_wait_hook([this] { host_receiver_.service(); });
    const c10::cuda::CUDAGuard guard(device_);
    check_cuda(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check_cuda(cudaEventCreateWithFlags(&channel_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }

  ~IpcChannel() {
    (void)cudaEventDestroy(caller_done_);
    (void)cudaEventDestroy(channel_done_);
  }

  py::bytes handles() {
    const std::lock_guard<std::mutex> lock(receiver_mutex_);
    return receiver_.export_handles();
  }

  void connect(const std::string& peer_handles) {
    sender_.emplace(device_.index(), peer_handles, send_direction_);
    host_sender_.wait_connected();
    host_receiver_.wait_connected();
    post_sender_.wait_connected();
    post_receiver_.wait_connected();
  }

  // Returns 0 once the message is enqueued, or, leaving everything untouched, the slot size the
  // peer must grow to first (the Python layer asks it to, then calls again).
  size_t send(const py::sequence& entries) {
    send_clock_.start();
    if (!failed_send_.empty()) {
      throw ChannelError(send_direction_ + ": a send failed after its note to the peer went out (" + failed_send_ +
                         "); the peer waits for that message, so this channel cannot send again");
    }
    const Entries outgoing = outgoing_entries(entries, device_, send_direction_);
    const std::vector<at::Tensor> tensors = present_tensors(outgoing);
    const std::vector<int64_t> offsets = packed_offsets(tensors);
    const auto needed = static_cast<size_t>(offsets.back());
    std::optional<MessageMeta> changed_meta;
    uint64_t digest = sent_fingerprint_;
    if (!describes(sent_meta_, outgoing)) {
      changed_meta = describe(outgoing);
      digest = fingerprint(*changed_meta);
    }
    py::gil_scoped_release no_gil;
    send_clock_.lap(kSendEntries);
    const PostRecord* post = post_for_next_message(digest, needed);
    send_clock_.lap(kSendPosts);
    if (post == nullptr && needed > sender_->slot_bytes()) return needed;
    if (changed_meta) {
      const std::string encoded = encode(*changed_meta);
      host_sender_.send_bytes(encoded.data(), encoded.size(), kTagMeta);
      sent_meta_ = std::move(*changed_meta);
      sent_fingerprint_ = digest;
    }
    const c10::cuda::CUDAGuard guard(device_);
    const bool on_caller_stream = needed <= kCallerStreamMaxBytes;
    const c10::cuda::CUDAStream stream = on_caller_stream ? caller_stream() : stream_;
    // The tensors were written on the caller's stream; large messages are copied on the channel's.
    if (!on_caller_stream) wait_for_caller();
    const std::vector<CopyRegion> regions = regions_of(tensors, offsets);
    // Large messages' copies run on the channel's stream, which was just ordered after the caller's:
    // what the caller's stream is known to follow, they follow too.
    const cudaStream_t caller = caller_stream().stream();
    // An allocation this process cannot map will not map later either.
    const bool direct = post != nullptr && sender_->can_map(post->handle);
    if (post != nullptr && !direct) direct_enabled_ = false;
    // Past a post this process could not map, the slot may still need to grow first; the meta,
    // already sent, then precedes the data that follows the growth, as the peer expects.
    if (!direct && needed > sender_->slot_bytes()) return needed;
    // The note goes out before the copy is enqueued: the peer's host then enqueues its receive while
    // this host enqueues the send, instead of after it. Nothing left to do can fail but the CUDA
    // calls themselves; if one does, the peer's stream waits for a message that never comes, as it
    // would for a peer that died, and this channel refuses to send again.
    // Read without receiver_mutex_: only this thread posts.
    const DataNote note{direct ? post->post : 0, receiver_.posts_ordered_before(caller)};
    host_sender_.send_bytes(&note, sizeof(note), direct ? kTagDataDirect : kTagData);
    send_clock_.lap(kSendNote);
    try {
      if (direct) {
        const bool posted_passed = caller == peer_posts_stream_ && post->post < peer_posts_passed_;
        if (!sender_->enqueue_send_direct(send_seq_, post->post, post->handle, static_cast<size_t>(post->offset),
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
    send_clock_.lap(kSendCopy);
    if (!on_caller_stream) {
      // Keeps the caching allocator from reusing their memory before the copies have read it.
      for (const at::Tensor& tensor : tensors) {
        c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
      }
    }
    ++send_seq_;
    send_clock_.lap(kSendRest);
    return 0;
  }

  py::tuple recv() {
    recv_clock_.start();
    Entries incoming;
    {
      py::gil_scoped_release no_gil;
      // A layout seen twice in a row is predicted for the next messages; a new one may be a one-off.
      // The posts for later messages go out while the peer's note is still on its way, off the path
      // from its arrival to this call's return (a change of layout in this message leaves them
      // unused, as the posts made before it are).
      const bool posted_early = last_layout_repeated_;
      if (posted_early) {
        const c10::cuda::CUDAGuard guard(device_);
        const std::lock_guard<std::mutex> lock(receiver_mutex_);
        post_ahead(recv_seq_ + 1, caller_stream().stream());
      }
      recv_clock_.lap(kRecvEarlyPosts);
      Message message = next_host_message();
      recv_clock_.lap(kRecvNoteWait);
      bool layout_changed = false;
      if (message.tag == kTagMeta) {
        received_ = make_layout(
            decode(std::string(static_cast<const char*>(message.data), message.bytes), receive_direction_));
        layout_changed = true;
        host_receiver_.release(message.seq);
        message = next_host_message();
      }
      if ((message.tag != kTagData && message.tag != kTagDataDirect) || message.bytes != sizeof(DataNote)) {
        throw ProtocolError(receive_direction_ + ": host message " + std::to_string(message.seq) + " has tag " +
                            std::to_string(message.tag) + " and " + std::to_string(message.bytes) +
                            " bytes where data was expected");
      }
      const bool direct = message.tag == kTagDataDirect;
      DataNote note;
      std::memcpy(&note, message.data, sizeof(note));
      const uint64_t post_number = note.post;
      const c10::cuda::CUDAGuard guard(device_);
      const c10::cuda::CUDAStream caller = caller_stream();
      const std::lock_guard<std::mutex> lock(receiver_mutex_);
      // Posted ahead of this message's wait, the posts' counter writes stay off the stream's
      // critical path.
      if (!layout_changed && !posted_early) post_ahead(recv_seq_ + 1, caller.stream());
      last_layout_repeated_ = !layout_changed;
      recv_clock_.lap(kRecvLatePosts);
      if (direct) {
        const PostedBuffer* post = find_post(recv_seq_, post_number);
        if (post == nullptr || (post->layout != received_ && post->layout->meta != received_->meta)) {
          throw ProtocolError(receive_direction_ + ": message " + std::to_string(recv_seq_) + " came into post " +
                              std::to_string(post_number) + ", but " +
                              (post ? "that buffer was posted for another layout"
                                    : "no such buffer was posted for it"));
        }
        receiver_.enqueue_receive_direct(recv_seq_, caller.stream());
        if (caller.stream() != post->stream) {
          c10::cuda::CUDACachingAllocator::recordStream(post->buffer.storage().data_ptr(), caller);
        }
        incoming = views_of(post->buffer, *received_);
        ++direct_recvs_;
      } else {
        incoming = allocate(received_->meta, device_);
        const std::vector<at::Tensor> tensors = present_tensors(incoming);
        const std::vector<CopyRegion> regions = regions_of(tensors, received_->offsets);
        if (static_cast<size_t>(received_->offsets.back()) <= kCallerStreamMaxBytes) {
          receiver_.enqueue_receive(recv_seq_, regions, caller.stream());
        } else {
          // The fresh outputs may reuse memory the caller's stream was still using.
          wait_for_caller();
          receiver_.enqueue_receive(recv_seq_, regions, stream_.stream());
          for (const at::Tensor& tensor : tensors) {
            c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
          }
          check_cuda(cudaEventRecord(channel_done_, stream_.stream()), "cudaEventRecord");
          check_cuda(cudaStreamWaitEvent(caller.stream(), channel_done_, 0), "cudaStreamWaitEvent");
        }
      }
      recv_clock_.lap(kRecvEnqueue);
      // Either way the caller's stream now waits for this message's ready write.
      peer_posts_passed_ = note.posts_passed;
      peer_posts_stream_ = caller.stream();
      // The other posts for this message were passed over: the sender never wrote them.
      drop_posts_through(recv_seq_);
      ++recv_seq_;
      // Released last: the sender may send one message further only once the posts for it are out.
      host_receiver_.release(message.seq);
      recv_clock_.lap(kRecvRelease);
    }
    py::tuple out = to_python(incoming);
    recv_clock_.lap(kRecvToPython);
    return out;
  }

  // Runs on the channel's grow service thread while the owner thread may be receiving.
  py::bytes grow(size_t min_slot_bytes, uint64_t first_seq) {
    std::string handles;
    {
      py::gil_scoped_release no_gil;
      const std::lock_guard<std::mutex> lock(receiver_mutex_);
      handles = receiver_.grow(min_slot_bytes, first_seq);
    }
    return handles;
  }

  void update(const std::string& peer_handles) { sender_->update(peer_handles); }

  // Gives the incoming slots a smaller generation, from a message the peer cannot have reached: it may
  // be num_slots + 1 messages ahead of what this end has received (its notes fill the host ring, and it
  // looks for new generations before each send). The old generation goes back to torch's caching
  // allocator once the messages before that one are received. Returns whether it shrank; not when the
  // slots are no bigger than slot_bytes, nor while the post ring is full (the peer is not sending).
  bool shrink(size_t slot_bytes) {
    const std::lock_guard<std::mutex> lock(receiver_mutex_);
    if (round_slot_bytes(slot_bytes, receive_direction_) >= receiver_.slot_bytes() || !post_sender_.can_send_now()) {
      return false;
    }
    const std::string handles = receiver_.resize(slot_bytes, recv_seq_ + receiver_.num_slots() + 1);
    post_sender_.send_bytes(handles.data(), handles.size(), kTagGeneration);
    return true;
  }

  bool transfers_done() const { return cudaStreamQuery(stream_.stream()) == cudaSuccess; }

  // Makes a send or recv waiting on the host rings in another thread raise ProtocolError at once;
  // close() follows. The only method that may overlap another.
  void interrupt() noexcept {
    const std::lock_guard<std::mutex> lock(closing_);
    host_sender_.interrupt();
    host_receiver_.interrupt();
  }

  // For a peer that died with copies still queued: the rings then leak their memory instead of
  // waiting forever for flags nobody will write.
  void abandon() {
    receiver_.abandon();
    if (sender_) sender_->abandon();
  }

  // The close handshake. Freeing memory another process still has mapped is undefined behaviour
  // (cudaIpcOpenMemHandle's documentation), so each end unmaps the peer's memory once its own sends
  // are done and says so with a last note; an end frees what it exported only when that note came,
  // or when the peer died (its mappings died with it). Otherwise (a peer that closes much later,
  // or whose sends never finished) it keeps that memory for the life of the process: the ring's flags
  // and slots, and the buffers it posted. Both waits are short, so close() stays quick.
  //
  // Posted buffers are also kept when the peer sent a message this end never received (a step that
  // failed half-way): its copy may still be writing into one of them. A non-empty reason (an abort's)
  // is quoted in the peer's error.
  void close(const std::string& reason) noexcept {
    const std::lock_guard<std::mutex> lock(closing_);
    constexpr auto kPatience = std::chrono::milliseconds(100);
    if (sender_ && sender_->unmap_when_done(kPatience)) {
      try {
        if (host_sender_.can_send_now()) host_sender_.send_bytes(nullptr, 0, kTagUnmapped);
      } catch (...) {
        // The peer closed or died already: it decides without the note.
      }
    }
    bool unreceived = false;
    bool peer_unmapped = peer_unmapped_;
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    try {
      while (!peer_unmapped) {
        std::optional<Message> message = host_receiver_.try_recv();
        if (!message) {
          if (std::chrono::steady_clock::now() >= deadline) break;
          std::this_thread::sleep_for(std::chrono::microseconds(50));
          continue;
        }
        if (message->tag == kTagUnmapped) {
          peer_unmapped = true;
        } else {
          unreceived = true;
        }
        host_receiver_.release(message->seq);
      }
    } catch (const PeerDiedError&) {
      peer_unmapped = true;  // the driver closed a dead process's mappings
      unreceived = true;     // but whether its last copies were cut off first, nobody can tell
    } catch (...) {
      unreceived = true;  // closed without the note, or the ring is in error: assume the worst
    }
    host_sender_.close(reason);
    host_receiver_.close(reason);
    post_sender_.close(reason);
    post_receiver_.close(reason);
    // Unreleased, the pool keeps its memory for the life of the process: a posted buffer the peer may
    // still map, or still be copying into, never serves another allocation.
    posts_.clear();
    if (peer_unmapped && !unreceived) posted_memory_.release();
    if (!peer_unmapped) receiver_.abandon();
  }

  // With PIPECOMM_IPC_HOST_TIMING=1: per phase of send and of recv, (name, total µs, calls).
  py::dict host_phase_times() const {
    py::dict times;
    times["send"] = send_clock_.totals();
    times["recv"] = recv_clock_.totals();
    return times;
  }

  uint64_t next_send_seq() const { return send_seq_; }
  uint64_t next_recv_seq() const { return recv_seq_; }
  uint64_t direct_sends() const { return direct_sends_; }
  uint64_t direct_recvs() const { return direct_recvs_; }

 private:
  c10::cuda::CUDAStream caller_stream() const { return at::cuda::getCurrentCUDAStream(device_.index()); }

  // The peer's next message on the host ring. Its close note, which comes just before its rings close,
  // is kept for this end's close; the wait goes on, so the ring reports the close (and an abort's reason).
  Message next_host_message() {
    Message message = host_receiver_.recv();
    while (message.tag == kTagUnmapped) {
      peer_unmapped_ = true;
      host_receiver_.release(message.seq);
      message = host_receiver_.recv();
    }
    return message;
  }

  void wait_for_caller() {
    check_cuda(cudaEventRecord(caller_done_, caller_stream().stream()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_.stream(), caller_done_, 0), "cudaStreamWaitEvent");
  }

  // Takes in what the peer put on the post ring: resized data generations, which the next send must
  // see (shrink() relies on it), and posts, kept while the direct path is on. Never waits.
  void drain_post_ring() {
    while (post_ring_open_) {
      std::optional<Message> message;
      try {
        message = post_receiver_.try_recv();
      } catch (const ChannelError&) {
        // The peer closed or died; the data ring reports that, and nothing more will come.
        post_ring_open_ = false;
        direct_enabled_ = false;
        return;
      }
      if (!message) return;
      if (message->tag == kTagGeneration) {
        const std::string handles(static_cast<const char*>(message->data), message->bytes);
        post_receiver_.release(message->seq);
        sender_->update(handles);
        continue;
      }
      if (message->tag != kTagPost || message->bytes != sizeof(PostRecord)) {
        throw ProtocolError(send_direction_ + ": post ring message " + std::to_string(message->seq) + " has tag " +
                            std::to_string(message->tag) + " and " + std::to_string(message->bytes) +
                            " bytes, neither a post record nor data generation handles");
      }
      PostRecord record;
      std::memcpy(&record, message->data, sizeof(record));
      post_receiver_.release(message->seq);
      if (direct_enabled_ && record.seq >= send_seq_) peer_posts_.push_back(record);
    }
  }

  // The peer's newest post for the next message if it has arrived and was made for this layout and
  // size. Never waits: a message without one goes by slot, so no send depends on the peer receiving.
  const PostRecord* post_for_next_message(uint64_t digest, size_t bytes) {
    drain_post_ring();
    if (!direct_enabled_) return nullptr;
    peer_posts_.erase(std::remove_if(peer_posts_.begin(), peer_posts_.end(),
                                     [&](const PostRecord& record) { return record.seq < send_seq_; }),
                      peer_posts_.end());
    for (auto it = peer_posts_.rbegin(); it != peer_posts_.rend(); ++it) {
      if (it->seq == send_seq_ && it->fingerprint == digest && it->bytes == bytes) return &*it;
    }
    return nullptr;
  }

  const PostedBuffer* find_post(uint64_t seq, uint64_t post) const {
    for (const PostedBuffer& posted : posts_) {
      if (posted.seq == seq && posted.post == post) return &posted;
    }
    return nullptr;
  }

  void drop_posts_through(uint64_t seq) {
    // Posts are in message order but after a layout change: the front ones go without moving the rest.
    while (!posts_.empty() && posts_.front().seq <= seq) posts_.pop_front();
    posts_.erase(std::remove_if(posts_.begin(), posts_.end(),
                                [&](const PostedBuffer& posted) { return posted.seq <= seq; }),
                 posts_.end());
  }

  // Offers buffers of the current layout for the post_depth_ messages from first_seq on that have
  // none of it yet (after a layout change, a message may hold a post of each). Allocated on the
  // caller's stream, so they are free for the peer's copies once that stream reaches the posted
  // counter. Optional work:
  // whatever stops it (no room on the post ring, no memory) leaves those messages to the slot path.
  // Called with receiver_mutex_ held.
  void post_ahead(uint64_t first_seq, cudaStream_t caller) {
    if (!posting_enabled_ || received_->offsets.back() == 0) return;
    const int64_t bytes = received_->offsets.back();
    const uint64_t digest = received_->fingerprint;
    // One layout's posts are made in message order, so the messages that have one of this layout are
    // those before unposted_seq_: a scan only when the layout differs from the last one posted (a
    // search per message costs microseconds with many slots).
    if (digest != posted_digest_) {
      posted_digest_ = digest;
      unposted_seq_ = 0;
      for (const PostedBuffer& posted : posts_) {
        if (posted.layout->fingerprint == digest) unposted_seq_ = std::max(unposted_seq_, posted.seq + 1);
      }
    }
    for (uint64_t seq = std::max(first_seq, unposted_seq_); seq < first_seq + post_depth_; ++seq) {
      if (!post_sender_.can_send_now()) return;  // the sender is not taking posts: it is not sending
      at::Tensor buffer;
      try {
        buffer = posted_memory_.allocate(bytes);
      } catch (const c10::OutOfMemoryError&) {
        return;
      }
      if (!buffer.defined()) {
        posting_enabled_ = false;  // no pool to keep its segments from being freed under the peer
        return;
      }
      PostRecord record{seq, next_post_, digest, static_cast<uint64_t>(bytes), 0, {}};
      size_t offset = 0;
      if (!receiver_.export_pointer(buffer.data_ptr(), &record.handle, &offset)) {
        posting_enabled_ = false;  // e.g. expandable segments: the slot path carries everything
        return;
      }
      record.offset = offset;
      receiver_.enqueue_post(next_post_++, caller);
      try {
        post_sender_.send_bytes(&record, sizeof(record), kTagPost);
      } catch (const ChannelError&) {
        posting_enabled_ = false;  // the peer closed: it sends nothing more
        return;
      }
      posts_.push_back({seq, record.post, received_, std::move(buffer), caller});
      unposted_seq_ = seq + 1;
    }
  }

  ShmRingReceiver host_receiver_;
  ShmRingSender host_sender_;
  ShmRingReceiver post_receiver_;  // posts for what this end sends
  ShmRingSender post_sender_;      // posts for what this end receives
  at::Device device_;
  std::string send_direction_;
  std::string receive_direction_;
  std::mutex receiver_mutex_;
  std::mutex closing_;  // interrupt() may come while another thread's call ends in close()
  IpcRingReceiver receiver_;
  std::optional<IpcRingSender> sender_;
  c10::cuda::CUDAStream stream_;
  uint64_t post_depth_;
  cudaEvent_t caller_done_ = nullptr;
  cudaEvent_t channel_done_ = nullptr;
  MessageMeta sent_meta_;
  std::shared_ptr<const Layout> received_;
  uint64_t sent_fingerprint_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
  std::vector<PostRecord> peer_posts_;
  // From the last data message received: the peer's posts known passed once peer_posts_stream_
  // reaches the point that message's receive was enqueued at.
  uint64_t peer_posts_passed_ = 0;
  cudaStream_t peer_posts_stream_ = nullptr;
  PostedBufferPool posted_memory_{device_};
  std::deque<PostedBuffer> posts_;
  uint64_t posted_digest_ = 0;  // the layout posted last, and the first message without a post of it
  uint64_t unposted_seq_ = 0;
  uint64_t next_post_ = 0;
  bool direct_enabled_ = true;
  bool post_ring_open_ = true;
  bool posting_enabled_ = true;
  std::string failed_send_;  // why a send failed after its note went out; empty while none did
  bool peer_unmapped_ = false;  // a receive met the peer's close note
  bool last_layout_repeated_ = false;  // the last message received came without a new layout
  uint64_t direct_sends_ = 0;
  uint64_t direct_recvs_ = 0;
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
      .def("recv", &IpcChannel::recv)
      .def("grow", &IpcChannel::grow, py::arg("min_slot_bytes"), py::arg("first_seq"))
      .def("update", &IpcChannel::update, py::arg("peer_handles"))
      .def("shrink", &IpcChannel::shrink, py::arg("slot_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("transfers_done", &IpcChannel::transfers_done)
      .def("host_phase_times", &IpcChannel::host_phase_times)
      .def("abandon", &IpcChannel::abandon)
      .def("interrupt", &IpcChannel::interrupt)
      .def("close", &IpcChannel::close, py::arg("reason") = "", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("next_send_seq", &IpcChannel::next_send_seq)
      .def_property_readonly("next_recv_seq", &IpcChannel::next_recv_seq)
      .def_property_readonly("direct_sends", &IpcChannel::direct_sends)
      .def_property_readonly("direct_recvs", &IpcChannel::direct_recvs);
}

}  // namespace pipecomm::transport
