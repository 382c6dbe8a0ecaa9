// A CUDA-IPC channel between this process and one peer: metadata on shared-memory host rings, data
// by the copy engines into the peer's device slots, ordered by events; the host never waits on the GPU.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../op_checks.h"
#include "ipc_ring.h"
#include "message.h"
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

void check_cuda(cudaError_t error, const char* call) {
  TORCH_CHECK(error == cudaSuccess, "pipecomm ipc channel: ", call, " failed: ", cudaGetErrorString(error));
}

class IpcChannel {
 public:
  IpcChannel(const std::string& incoming_name, const std::string& outgoing_name, int self_rank, int peer_rank,
             int device, uint32_t num_slots, size_t slot_bytes, double timeout_s)
      : host_receiver_(RingConfig{incoming_name, self_rank, peer_rank, num_slots, 1 << 16, timeout_s}),
        host_sender_(RingConfig{outgoing_name, self_rank, peer_rank, num_slots, 1 << 16, timeout_s}),
        device_(at::kCUDA, static_cast<c10::DeviceIndex>(device)),
        send_direction_("pipecomm ipc channel rank " + std::to_string(self_rank) + " -> rank " +
                        std::to_string(peer_rank)),
        receive_direction_("pipecomm ipc channel rank " + std::to_string(peer_rank) + " -> rank " +
                           std::to_string(self_rank)),
        receiver_(device, num_slots, slot_bytes, receive_direction_),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())) {
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
  }

  // Returns 0 once the message is enqueued, or, leaving everything untouched, the slot size the
  // peer must grow to first (the Python layer asks it to, then calls again).
  size_t send(const py::sequence& entries) {
    const Entries outgoing = outgoing_entries(entries, device_, send_direction_);
    const std::vector<at::Tensor> tensors = present_tensors(outgoing);
    const std::vector<int64_t> offsets = packed_offsets(tensors);
    const auto needed = static_cast<size_t>(offsets.back());
    if (needed > sender_->slot_bytes()) return needed;
    MessageMeta meta = describe(outgoing);
    py::gil_scoped_release no_gil;
    if (meta != sent_meta_) {
      const std::string encoded = encode(meta);
      host_sender_.send_bytes(encoded.data(), encoded.size(), kTagMeta);
      sent_meta_ = std::move(meta);
    }
    const c10::cuda::CUDAGuard guard(device_);
    if (needed <= kCallerStreamMaxBytes) {
      sender_->enqueue_send(send_seq_, regions_of(tensors, offsets), caller_stream().stream());
    } else {
      // The tensors were written on the caller's stream; the copies run on the channel's stream.
      wait_for_caller();
      sender_->enqueue_send(send_seq_, regions_of(tensors, offsets), stream_.stream());
      // Keeps the caching allocator from reusing their memory before the copies have read it.
      for (const at::Tensor& tensor : tensors) {
        c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
      }
    }
    ++send_seq_;
    // Posted after the enqueue, so the receiver never waits on the device for a copy never issued.
    host_sender_.send_bytes(nullptr, 0, kTagData);
    return 0;
  }

  py::tuple recv() {
    Entries incoming;
    {
      py::gil_scoped_release no_gil;
      Message message = host_receiver_.recv();
      if (message.tag == kTagMeta) {
        received_meta_ = decode(std::string(static_cast<const char*>(message.data), message.bytes), receive_direction_);
        host_receiver_.release(message.seq);
        message = host_receiver_.recv();
      }
      if (message.tag != kTagData) {
        throw ProtocolError(receive_direction_ + ": host message " + std::to_string(message.seq) + " has tag " +
                            std::to_string(message.tag) + " where data was expected");
      }
      host_receiver_.release(message.seq);
      const c10::cuda::CUDAGuard guard(device_);
      incoming = allocate(received_meta_, device_);
      const std::vector<at::Tensor> tensors = present_tensors(incoming);
      const std::vector<int64_t> offsets = packed_offsets(tensors);
      const std::lock_guard<std::mutex> lock(receiver_mutex_);
      if (static_cast<size_t>(offsets.back()) <= kCallerStreamMaxBytes) {
        receiver_.enqueue_receive(recv_seq_, regions_of(tensors, offsets), caller_stream().stream());
      } else {
        // The fresh outputs may reuse memory the caller's stream was still using.
        wait_for_caller();
        receiver_.enqueue_receive(recv_seq_, regions_of(tensors, offsets), stream_.stream());
        for (const at::Tensor& tensor : tensors) {
          c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
        }
        check_cuda(cudaEventRecord(channel_done_, stream_.stream()), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(caller_stream().stream(), channel_done_, 0), "cudaStreamWaitEvent");
      }
      ++recv_seq_;
    }
    return to_python(incoming);
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

  bool transfers_done() const { return cudaStreamQuery(stream_.stream()) == cudaSuccess; }

  // For a peer that died with copies still queued: the rings then leak their memory instead of
  // waiting forever for flags nobody will write.
  void abandon() {
    receiver_.abandon();
    if (sender_) sender_->abandon();
  }

  void close() noexcept {
    host_sender_.close();
    host_receiver_.close();
  }

  uint64_t next_send_seq() const { return send_seq_; }
  uint64_t next_recv_seq() const { return recv_seq_; }

 private:
  c10::cuda::CUDAStream caller_stream() const { return at::cuda::getCurrentCUDAStream(device_.index()); }

  void wait_for_caller() {
    check_cuda(cudaEventRecord(caller_done_, caller_stream().stream()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_.stream(), caller_done_, 0), "cudaStreamWaitEvent");
  }

  ShmRingReceiver host_receiver_;
  ShmRingSender host_sender_;
  at::Device device_;
  std::string send_direction_;
  std::string receive_direction_;
  std::mutex receiver_mutex_;
  IpcRingReceiver receiver_;
  std::optional<IpcRingSender> sender_;
  c10::cuda::CUDAStream stream_;
  cudaEvent_t caller_done_ = nullptr;
  cudaEvent_t channel_done_ = nullptr;
  MessageMeta sent_meta_;
  MessageMeta received_meta_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
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
      .def("transfers_done", &IpcChannel::transfers_done)
      .def("abandon", &IpcChannel::abandon)
      .def("close", &IpcChannel::close)
      .def_property_readonly("next_send_seq", &IpcChannel::next_send_seq)
      .def_property_readonly("next_recv_seq", &IpcChannel::next_recv_seq);
}

}  // namespace pipecomm::transport
