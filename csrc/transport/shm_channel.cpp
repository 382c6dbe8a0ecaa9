// A shared-memory channel between this process and one peer: two rings, whole messages in C++.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "../pack_plan.h"
#include "errors.h"
#include "message.h"
#include "ring_tags.h"
#include "shm_ring.h"

namespace pipecomm::transport {
namespace {

std::vector<MessagePart> parts_of(const std::vector<at::Tensor>& tensors) {
  std::vector<MessagePart> parts;
  parts.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) parts.push_back({tensor.const_data_ptr(), tensor.nbytes()});
  return parts;
}

// Owns the ring this process receives on and the peer's ring it sends into. While a send waits
// for the peer, it keeps answering the peer's grow requests on the incoming ring, so two ranks
// that send oversized messages to each other before receiving do not deadlock; that is also why it
// is not thread-safe: a send would service the incoming ring under a recv in another thread. Calls
// must not overlap (the Python Channel enforces it), except interrupt(), which may come at any time.
class ShmChannel {
 public:
  ShmChannel(const std::string& incoming_name, const std::string& outgoing_name, int self_rank, int peer_rank,
             uint32_t num_slots, size_t slot_bytes, double timeout_s)
      : receiver_(RingConfig{incoming_name, self_rank, peer_rank, num_slots, slot_bytes, timeout_s}),
        sender_(RingConfig{outgoing_name, self_rank, peer_rank, num_slots, slot_bytes, timeout_s}),
        send_direction_("pipecomm shm channel rank " + std::to_string(self_rank) + " -> rank " +
                        std::to_string(peer_rank)),
        receive_direction_("pipecomm shm channel rank " + std::to_string(peer_rank) + " -> rank " +
                           std::to_string(self_rank)) {
    sender_.set_wait_hook([this] { receiver_.service(); });
  }

  void connect() {
    sender_.wait_connected();
    receiver_.wait_connected();
  }

  void send(const py::sequence& entries) {
    const Entries outgoing = outgoing_entries(entries, at::kCPU, send_direction_);
    MessageMeta meta = describe(outgoing);
    py::gil_scoped_release no_gil;
    if (meta != sent_meta_) {
      const std::string encoded = encode(meta);
      sender_.send_bytes(encoded.data(), encoded.size(), kTagMeta);
      sent_meta_ = std::move(meta);
    }
    std::vector<MessagePart> parts = parts_of(present_tensors(outgoing));
    if (!outgoing_notes_.empty()) parts.push_back({outgoing_notes_.data(), outgoing_notes_.size()});
    sender_.send(parts, kTagData);
    outgoing_notes_.clear();
  }

  // Goes with the next send, after its tensors (ring_tags.h says why).
  void send_note(const std::string& data) { append_note(outgoing_notes_, data); }

  py::tuple recv() {
    Entries incoming;
    {
      py::gil_scoped_release no_gil;
      Message message = receiver_.recv();
      if (message.tag == kTagMeta) {
        received_meta_ = decode(std::string(static_cast<const char*>(message.data), message.bytes), receive_direction_);
        receiver_.release(message.seq);
        message = receiver_.recv();
      }
      if (message.tag != kTagData) {
        throw ProtocolError(receive_direction_ + ": message " + std::to_string(message.seq) + " has tag " +
                            std::to_string(message.tag) + " where data was expected");
      }
      incoming = allocate(received_meta_, at::kCPU);
      copy_out(message, present_tensors(incoming));
      receiver_.release(message.seq);
    }
    return to_python(incoming);
  }

  // The oldest note not taken yet of those that came with the messages received; None if there is none.
  py::object recv_note() {
    if (notes_.empty()) return py::none();
    py::bytes note(notes_.front());
    notes_.pop_front();
    return note;
  }

  bool shrink(size_t slot_bytes) { return receiver_.shrink(slot_bytes); }

  // Makes a send or recv waiting in another thread raise ProtocolError at once; close() follows.
  void interrupt() noexcept {
    const std::lock_guard<std::mutex> lock(closing_);
    sender_.interrupt();
    receiver_.interrupt();
  }

  // Never waits for the peer; a non-empty reason (an abort's) is quoted in the peer's error. The ring
  // the peer sends on closes first: a peer whose recv woke to this close must find its next send refused,
  // not landing in a ring nobody reads.
  void close(const std::string& reason) noexcept {
    const std::lock_guard<std::mutex> lock(closing_);
    receiver_.close(reason);
    sender_.close(reason);
  }

 private:
  // Also keeps the notes that came after the tensors.
  void copy_out(const Message& message, const std::vector<at::Tensor>& outs) {
    const std::vector<MessagePart> parts = parts_of(outs);
    const size_t expected = packed_message_bytes(parts.data(), parts.size());
    const size_t notes_at = align_to_pack(expected);  // the offset of the part send() added for them
    const bool notes_follow =
        message.bytes > notes_at &&
        read_notes(static_cast<const uint8_t*>(message.data) + notes_at, message.bytes - notes_at, notes_);
    if (message.bytes != expected && !notes_follow) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(message.seq) + " holds " +
                          std::to_string(message.bytes) + " bytes but its metadata describes " +
                          std::to_string(expected) + " and no notes follow");
    }
    std::vector<Segment> segments;
    size_t offset = 0;
    for (size_t i = 0; i < outs.size(); ++i) {
      offset = align_to_pack(offset);
      const auto bytes = static_cast<int64_t>(parts[i].bytes);
      segments.push_back({static_cast<const uint8_t*>(message.data) + offset, outs[i].data_ptr(), bytes, bytes});
      offset += parts[i].bytes;
    }
    copy_segments_cpu(segments);
  }

  ShmRingReceiver receiver_;
  ShmRingSender sender_;
  std::string send_direction_;
  std::string receive_direction_;
  MessageMeta sent_meta_;
  MessageMeta received_meta_;
  std::string outgoing_notes_;      // sent with the next message (append_note's format)
  std::deque<std::string> notes_;  // came with the messages received, not taken by recv_note yet
  std::mutex closing_;  // interrupt() may come while another thread's call ends in close()
};

}  // namespace

void register_shm_channel(py::module_& module) {
  py::class_<ShmChannel>(module, "ShmChannel")
      .def(py::init<const std::string&, const std::string&, int, int, uint32_t, size_t, double>(),
           py::arg("incoming_name"), py::arg("outgoing_name"), py::arg("self_rank"), py::arg("peer_rank"),
           py::arg("num_slots"), py::arg("slot_bytes"), py::arg("timeout_s"))
      .def("connect", &ShmChannel::connect, py::call_guard<py::gil_scoped_release>())
      .def("send", &ShmChannel::send, py::arg("entries"))
      .def("recv", &ShmChannel::recv)
      .def("send_note", &ShmChannel::send_note, py::arg("data"))
      .def("recv_note", &ShmChannel::recv_note)
      .def("shrink", &ShmChannel::shrink, py::arg("slot_bytes"))
      .def("interrupt", &ShmChannel::interrupt)
      .def("close", &ShmChannel::close, py::arg("reason") = "");
  module.def("sweep_stale_segments", &sweep_stale_segments, py::arg("prefix"),
             "Unlinks /dev/shm segments with this prefix whose creator process is gone; returns how many.");
}

}  // namespace pipecomm::transport
