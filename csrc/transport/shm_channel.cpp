// pybind11 glue of a shared-memory channel: the two rings between this process and one peer.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "../pack_plan.h"
#include "bindings.h"
#include "shm_ring.h"

namespace pipecomm::transport {
namespace {

std::vector<MessagePart> host_parts(const std::vector<at::Tensor>& tensors, const char* what) {
  std::vector<MessagePart> parts;
  parts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& tensor = tensors[i];
    TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.is_contiguous(), "shm channel: ", what, "[", i,
                      "] must be a contiguous CPU tensor, got one on ", tensor.device());
    parts.push_back({tensor.const_data_ptr(), tensor.nbytes()});
  }
  return parts;
}

// Owns the ring this process receives on and the peer's ring it sends into. While a send waits
// for the peer, it keeps answering the peer's grow requests on the incoming ring, so two ranks
// that send oversized messages to each other before receiving do not deadlock.
class ShmChannel {
 public:
  ShmChannel(const std::string& incoming_name, const std::string& outgoing_name, int self_rank, int peer_rank,
             uint32_t num_slots, size_t slot_bytes, double timeout_s)
      : receiver_(RingConfig{incoming_name, self_rank, peer_rank, num_slots, slot_bytes, timeout_s}),
        sender_(RingConfig{outgoing_name, self_rank, peer_rank, num_slots, slot_bytes, timeout_s}),
        prefix_("pipecomm shm channel rank " + std::to_string(peer_rank) + " -> rank " + std::to_string(self_rank) +
                ": ") {
    sender_.set_wait_hook([this] { receiver_.service(); });
  }

  void connect() {
    sender_.wait_connected();
    receiver_.wait_connected();
  }

  void send_bytes(const std::string& payload, uint32_t tag) { sender_.send_bytes(payload.data(), payload.size(), tag); }

  void send_tensors(const std::vector<at::Tensor>& tensors, uint32_t tag) {
    sender_.send(host_parts(tensors, "tensors"), tag);
  }

  // Blocks until the next message is here and returns its tag, without consuming it.
  uint32_t next_tag() { return pending().tag; }

  py::bytes recv_bytes() {
    const Message message = pending();
    py::bytes payload(static_cast<const char*>(message.data), message.bytes);
    consume(message);
    return payload;
  }

  // Copies the next message into `outs`, laid out as the sender's parts were. A size mismatch
  // raises and leaves the message in place.
  void recv_into(const std::vector<at::Tensor>& outs) {
    const Message message = pending();
    const std::vector<MessagePart> parts = host_parts(outs, "outs");
    const size_t expected = packed_message_bytes(parts.data(), parts.size());
    TORCH_CHECK_VALUE(message.bytes == expected, prefix_, "message ", message.seq, " holds ", message.bytes,
                      " bytes but the receiving tensors need ", expected);
    std::vector<Segment> segments;
    size_t offset = 0;
    for (size_t i = 0; i < outs.size(); ++i) {
      offset = align_part_offset(offset);
      const auto bytes = static_cast<int64_t>(parts[i].bytes);
      segments.push_back({static_cast<const uint8_t*>(message.data) + offset, outs[i].data_ptr(), bytes, bytes});
      offset += parts[i].bytes;
    }
    {
      py::gil_scoped_release no_gil;
      copy_segments_cpu(segments);
    }
    consume(message);
  }

  bool shrink(size_t slot_bytes) { return receiver_.shrink(slot_bytes); }
  size_t incoming_slot_bytes() const { return receiver_.slot_bytes(); }

  void close() noexcept {
    sender_.close();
    receiver_.close();
  }

 private:
  Message pending() {
    if (!pending_) {
      py::gil_scoped_release no_gil;
      pending_ = receiver_.recv();
    }
    return *pending_;
  }

  void consume(const Message& message) {
    receiver_.release(message.seq);
    pending_.reset();
  }

  ShmRingReceiver receiver_;
  ShmRingSender sender_;
  std::string prefix_;
  std::optional<Message> pending_;
};

}  // namespace

void register_shm_channel(py::module_& module) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<ShmChannel>(module, "ShmChannel")
      .def(py::init<const std::string&, const std::string&, int, int, uint32_t, size_t, double>(),
           py::arg("incoming_name"), py::arg("outgoing_name"), py::arg("self_rank"), py::arg("peer_rank"),
           py::arg("num_slots"), py::arg("slot_bytes"), py::arg("timeout_s"))
      .def("connect", &ShmChannel::connect, release_gil())
      .def("send_bytes", &ShmChannel::send_bytes, release_gil())
      .def("send_tensors", &ShmChannel::send_tensors, release_gil())
      .def("next_tag", &ShmChannel::next_tag)
      .def("recv_bytes", &ShmChannel::recv_bytes)
      .def("recv_into", &ShmChannel::recv_into)
      .def("shrink", &ShmChannel::shrink)
      .def_property_readonly("incoming_slot_bytes", &ShmChannel::incoming_slot_bytes)
      .def("close", &ShmChannel::close);
  module.def("sweep_stale_segments", &sweep_stale_segments, py::arg("prefix"),
             "Unlinks /dev/shm segments with this prefix whose creator process is gone; returns how many.");
}

}  // namespace pipecomm::transport
