// The dist channel's frames in native code: a fixed header per message, the metadata only when it changes
// (message.cpp's encoding, as the shm and IPC channels send it), and the tensors packed into one payload.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "../op_checks.h"
#include "errors.h"
#include "message.h"

namespace py = pybind11;

namespace pipecomm::transport {
namespace {

// A header is four int64: its kind, the message's sequence number, the bytes of the part that follows it
// (encoded metadata, or an abort's reason; 0 for none) and the bytes of the packed payload after that.
constexpr int64_t kHeaderFields = 4;
constexpr int64_t kData = 1;
constexpr int64_t kAbort = 2;
// An abort's reason is cut to this many bytes: it is quoted in an error message.
constexpr size_t kMaxReasonBytes = 4096;
// Metadata larger than this is refused before the receiver allocates for it.
constexpr int64_t kMaxMetaBytes = 1 << 24;

at::Tensor make_header(int64_t kind, int64_t seq, int64_t follow_bytes, int64_t payload_bytes) {
  at::Tensor header = at::empty({kHeaderFields}, at::kLong);
  int64_t* fields = header.data_ptr<int64_t>();
  fields[0] = kind;
  fields[1] = seq;
  fields[2] = follow_bytes;
  fields[3] = payload_bytes;
  return header;
}

at::Tensor bytes_tensor(const std::string& bytes) {
  at::Tensor tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

std::string tensor_bytes(const at::Tensor& tensor) {
  const at::Tensor host = tensor.to(at::kCPU).contiguous();
  return {static_cast<const char*>(host.const_data_ptr()), static_cast<size_t>(host.nbytes())};
}

int64_t packed_bytes(const MessageMeta& meta) {
  std::vector<int64_t> nbytes;
  for (const EntryMeta& entry : meta) {
    if (!entry.present) continue;
    int64_t numel = 1;
    for (const int64_t size : entry.sizes) numel *= size;
    nbytes.push_back(numel * static_cast<int64_t>(c10::elementSize(entry.dtype)));
  }
  return packed_offsets_of_bytes(nbytes).back();
}

at::Tensor pack(const std::vector<at::Tensor>& tensors) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pipecomm::pack", "")
                             .typed<at::Tensor(at::TensorList)>();
  return op.call(tensors);
}

void unpack(const at::Tensor& buffer, const std::vector<at::Tensor>& outs) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pipecomm::unpack_", "")
                             .typed<void(const at::Tensor&, at::TensorList)>();
  op.call(buffer, outs);
}

// One end's frames: sequence numbers both ways and the metadata last sent and received. A header is
// always a CPU tensor (it travels on the host); the payload is packed on the channel's device.
class MessageCodec {
 public:
  MessageCodec(const std::string& device, std::string send_direction, std::string receive_direction)
      : device_(device), send_direction_(std::move(send_direction)), receive_direction_(std::move(receive_direction)) {}

  // (header, metadata or None, payload or None, the tensors whose data the payload copies). A message whose
  // tensors hold no bytes has no payload: the receiver posts none for it.
  py::tuple encode(const py::sequence& entries) {
    const Entries outgoing = outgoing_entries(entries, device_, send_direction_);
    py::object meta = py::none();
    if (!sent_meta_ || !describes(*sent_meta_, outgoing)) {
      sent_meta_ = describe(outgoing);
      meta = py::cast(bytes_tensor(transport::encode(*sent_meta_)));
    }
    const std::vector<at::Tensor> present = present_tensors(outgoing);
    const int64_t payload_bytes = packed_bytes(*sent_meta_);
    py::object payload = py::none();
    if (payload_bytes > 0) payload = py::cast(pack(present));
    const int64_t meta_bytes = meta.is_none() ? 0 : meta.cast<at::Tensor>().numel();
    return py::make_tuple(make_header(kData, send_seq_++, meta_bytes, payload_bytes), meta, payload);
  }

  // (header, reason bytes) of the last frame this end sends: the peer's receive raises with the reason.
  py::tuple encode_abort(const std::string& reason) {
    const std::string text = reason.substr(0, kMaxReasonBytes);
    return py::make_tuple(make_header(kAbort, send_seq_, static_cast<int64_t>(text.size()), 0), bytes_tensor(text));
  }

  // ("data", metadata bytes, payload bytes) or ("abort", reason bytes, 0), from a header;
  // a header out of step with this end (a lost or extra message) is a ProtocolError.
  py::tuple read_header(const at::Tensor& header) {
    if (header.scalar_type() != at::kLong || header.numel() != kHeaderFields) {
      throw ProtocolError(receive_direction_ + ": a frame header must be " + std::to_string(kHeaderFields) + " int64");
    }
    const at::Tensor host = header.to(at::kCPU).contiguous();
    const int64_t* fields = host.const_data_ptr<int64_t>();
    const int64_t kind = fields[0], seq = fields[1], follow = fields[2], payload = fields[3];
    if (seq != recv_seq_) {
      throw ProtocolError(receive_direction_ + ": expected message " + std::to_string(recv_seq_) + " but frame " +
                          std::to_string(seq) + " arrived (the two ends are out of step)");
    }
    if (follow < 0 || payload < 0 || follow > kMaxMetaBytes) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(seq) + " has a corrupt header");
    }
    if (kind == kAbort) return py::make_tuple("abort", std::min<int64_t>(follow, kMaxReasonBytes), 0);
    if (kind != kData) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(seq) + " has unknown kind " +
                          std::to_string(kind));
    }
    if (follow == 0 && !received_meta_) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(seq) + " arrived before any metadata");
    }
    return py::make_tuple("data", follow, payload);
  }

  // The message's fresh tensors on the channel's device (tuple, None entries kept), after reading its
  // metadata if it came (`meta`); the payload's size is checked against the metadata before anything is
  // allocated.
  py::tuple allocate(const std::optional<at::Tensor>& meta, int64_t payload_bytes) {
    if (meta) received_meta_ = decode(tensor_bytes(*meta), receive_direction_);
    const int64_t expected = packed_bytes(*received_meta_);
    if (payload_bytes != expected) {
      throw ProtocolError(receive_direction_ + ": message " + std::to_string(recv_seq_) + " has a " +
                          std::to_string(payload_bytes) + "-byte payload but its metadata needs " +
                          std::to_string(expected) + " bytes (the two ends are out of step)");
    }
    ++recv_seq_;
    incoming_ = transport::allocate(*received_meta_, device_);
    return to_python(incoming_);
  }

  // Copies a received payload into the tensors allocate() returned last.
  void unpack_payload(const at::Tensor& payload) {
    unpack(payload.device() == device_ ? payload : payload.to(device_), present_tensors(incoming_));
    incoming_.clear();
  }

 private:
  at::Device device_;
  std::string send_direction_;
  std::string receive_direction_;
  std::optional<MessageMeta> sent_meta_;
  std::optional<MessageMeta> received_meta_;
  Entries incoming_;
  int64_t send_seq_ = 0;
  int64_t recv_seq_ = 0;
};

}  // namespace

void register_message_codec(py::module_& module) {
  py::class_<MessageCodec>(module, "MessageCodec")
      .def(py::init<const std::string&, std::string, std::string>(), py::arg("device"), py::arg("send_direction"),
           py::arg("receive_direction"))
      .def("encode", &MessageCodec::encode, py::arg("entries"))
      .def("encode_abort", &MessageCodec::encode_abort, py::arg("reason"))
      .def("read_header", &MessageCodec::read_header, py::arg("header"))
      .def("allocate", &MessageCodec::allocate, py::arg("meta"), py::arg("payload_bytes"))
      .def("unpack_payload", &MessageCodec::unpack_payload, py::arg("payload"));
  module.attr("FRAME_HEADER_FIELDS") = kHeaderFields;
}

}  // namespace pipecomm::transport
