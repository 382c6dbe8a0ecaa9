// CUDA-IPC ring: runs ipc_protocol.h's steps on the device (stream memory operations, copies, the SM path),
// and owns the device memory they touch: allocation, export, peer mapping and their release.
#include "ipc_ring.h"

#include <cuda.h>  // driver API types and enums only; the functions come from cudaGetDriverEntryPoint*
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "errors.h"
#include "sm_transfer.h"

#if !defined(CUDART_VERSION) || CUDART_VERSION < 12000
#error "pipecomm ipc_ring needs CUDA 12.0 or newer (cuStreamWaitValue32_v2 through the runtime's entry points)"
#endif

namespace pipecomm::transport {

namespace {

constexpr size_t kBusIdBytes = 32;
// Peer allocations a sender keeps mapped (cudaIpcOpenMemHandle costs far more than a message), and
// exported allocations a receiver remembers; a caching allocator's steady state needs a handful.
constexpr size_t kMaxPeerAllocations = 64;
constexpr size_t kMaxExportedAllocations = 256;
// The ABI version of the stream memory operations we ask for: the _v2 entry points (CUDA 11.7+,
// the default from 12.0), which need no CAN_USE_STREAM_MEM_OPS_V1 attribute.
constexpr unsigned int kDriverApiVersion = 12000;
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(ipc::IpcHandle), "unexpected cudaIpcMemHandle_t size");
static_assert(ipc::kMaxStepWaits <= kSmTransferMaxWaits, "a thread block polls every wait of a send");

using StreamMemOpFn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using ErrorStringFn = CUresult(CUDAAPI*)(CUresult, const char**);
using PointerGetAttributesFn = CUresult(CUDAAPI*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
using BatchMemOpFn = CUresult(CUDAAPI*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

std::string prefix_or_default(std::string prefix) {
  return prefix.empty() ? std::string("pipecomm ipc ring") : prefix;
}

std::string cuda_error_text(cudaError_t error) {
  const char* name = cudaGetErrorName(error);
  const char* text = cudaGetErrorString(error);
  return std::string(name ? name : "cudaError?") + " (" + std::to_string(static_cast<int>(error)) +
         "): " + (text ? text : "unknown error");
}

// Throws ChannelError for a failed runtime call. Clears the runtime's last-error state first, so a
// later cudaGetLastError() in unrelated code (kernel launch checks) does not report this failure.
void check_cuda(cudaError_t error, const std::string& prefix, const char* call, const std::string& detail = {}) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  throw ChannelError(prefix + ": " + call + (detail.empty() ? "" : " (" + detail + ")") +
                     " failed: " + cuda_error_text(error));
}

struct DriverApi {
  StreamMemOpFn wait_value32 = nullptr;
  StreamMemOpFn write_value32 = nullptr;
  ErrorStringFn get_error_name = nullptr;    // optional, for messages
  ErrorStringFn get_error_string = nullptr;  // optional, for messages
  PointerGetAttributesFn pointer_get_attributes = nullptr;  // optional: without it, no direct path
  BatchMemOpFn batch_mem_op = nullptr;  // optional: without it, one call per memory operation
};

void* lookup_driver_symbol(const char* symbol, bool required, const std::string& prefix) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  // cudaGetDriverEntryPoint is deprecated from CUDA 13.0; ByVersion exists since 12.5.
  const char* call = "cudaGetDriverEntryPointByVersion";
  cudaError_t error = cudaGetDriverEntryPointByVersion(symbol, &function, kDriverApiVersion, cudaEnableDefault, &status);
#else
  // 12.0 - 12.4: returns the newest ABI-compatible version for the runtime's version (>= 12.0: _v2).
  const char* call = "cudaGetDriverEntryPoint";
  cudaError_t error = cudaGetDriverEntryPoint(symbol, &function, cudaEnableDefault, &status);
#endif
  if (error == cudaSuccess && status == cudaDriverEntryPointSuccess && function != nullptr) return function;
  if (error != cudaSuccess) (void)cudaGetLastError();
  if (!required) return nullptr;
  throw ChannelError(prefix + ": " + call + "(" + symbol + ", version " + std::to_string(kDriverApiVersion) +
                     ") failed: " + (error != cudaSuccess ? cuda_error_text(error) : std::string("no error")) +
                     ", driver status " + std::to_string(static_cast<int>(status)) +
                     " (1: symbol not found, 2: driver too old)");
}

DriverApi load_driver_api(const std::string& prefix) {
  DriverApi api;
  api.wait_value32 = reinterpret_cast<StreamMemOpFn>(lookup_driver_symbol("cuStreamWaitValue32", true, prefix));
  api.write_value32 = reinterpret_cast<StreamMemOpFn>(lookup_driver_symbol("cuStreamWriteValue32", true, prefix));
  api.get_error_name = reinterpret_cast<ErrorStringFn>(lookup_driver_symbol("cuGetErrorName", false, prefix));
  api.get_error_string = reinterpret_cast<ErrorStringFn>(lookup_driver_symbol("cuGetErrorString", false, prefix));
  api.pointer_get_attributes =
      reinterpret_cast<PointerGetAttributesFn>(lookup_driver_symbol("cuPointerGetAttributes", false, prefix));
  api.batch_mem_op = reinterpret_cast<BatchMemOpFn>(lookup_driver_symbol("cuStreamBatchMemOp", false, prefix));
  return api;
}

// Loaded once per process (a failed load is retried by the next call: a throwing static initializer
// leaves the static uninitialized).
const DriverApi& driver_api(const std::string& prefix) {
  static const DriverApi api = load_driver_api(prefix);
  return api;
}

void check_driver(CUresult result, const DriverApi& api, const std::string& prefix, const char* call,
                  const std::string& detail) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.get_error_name == nullptr || api.get_error_name(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (api.get_error_string == nullptr || api.get_error_string(result, &text) != CUDA_SUCCESS) text = nullptr;
  throw ChannelError(prefix + ": " + call + " (" + detail + ") failed: " + (name ? name : "CUresult") + " (" +
                     std::to_string(static_cast<int>(result)) + "): " + (text ? text : "unknown error"));
}

CUdeviceptr device_address(const void* pointer) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(pointer));
}

// Makes `device` current for the scope, restoring the caller's current device afterwards.
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& prefix) {
    check_cuda(cudaGetDevice(&previous_), prefix, "cudaGetDevice");
    // Also when already current: cudaSetDevice makes the primary context current on this thread.
    check_cuda(cudaSetDevice(device), prefix, "cudaSetDevice", "device " + std::to_string(device));
    restore_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

std::string bus_id_of(int device, const std::string& prefix) {
  char buffer[kBusIdBytes] = {};
  check_cuda(cudaDeviceGetPCIBusId(buffer, static_cast<int>(sizeof(buffer) - 1), device), prefix,
             "cudaDeviceGetPCIBusId", "device " + std::to_string(device));
  return std::string(buffer);
}

cudaStream_t cuda_stream(ipc::StreamId stream) { return static_cast<cudaStream_t>(stream); }

std::vector<cudaStream_t> cuda_streams(const std::vector<ipc::StreamId>& streams) {
  std::vector<cudaStream_t> cuda;
  for (ipc::StreamId stream : streams) cuda.push_back(cuda_stream(stream));
  return cuda;
}

cudaIpcMemHandle_t cuda_handle(const ipc::IpcHandle& handle) {
  cudaIpcMemHandle_t cuda;
  std::memcpy(&cuda, handle.data(), sizeof(cuda));
  return cuda;
}

ipc::IpcHandle opaque_handle(const cudaIpcMemHandle_t& handle) {
  ipc::IpcHandle opaque;
  std::memcpy(opaque.data(), &handle, sizeof(handle));
  return opaque;
}

// The record of data generation `generation` among an end's per-generation device state.
template <typename Records>
auto record_of(Records& records, uint32_t generation) {
  return std::find_if(records.begin(), records.end(),
                      [&](const auto& record) { return record.generation == generation; });
}

// Where a counter of the receiver's flags allocation lies in this process.
char* counter_address(void* flags, const ipc::CounterValue& counter) {
  return static_cast<char*>(flags) + counter.offset;
}

// A step's owed write and (unless a block polls them) its waits, in order. Each driver call costs the
// host microseconds, which bound a small message's latency, so two or more go in one batched call.
template <typename Describe>
void enqueue_memory_operations(const ipc::Step& step, bool with_waits, void* flags, cudaStream_t stream,
                               const DriverApi& api, const std::string& prefix, const Describe& what) {
  const int waits = with_waits ? step.wait_count : 0;
  const bool owed = step.owed_write.has_value();
  if (waits + (owed ? 1 : 0) > 1 && api.batch_mem_op != nullptr) {
    CUstreamBatchMemOpParams operations[ipc::kMaxStepWaits + 1] = {};
    unsigned int count = 0;
    if (owed) {
      CUstreamBatchMemOpParams& write = operations[count++];
      write.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      write.writeValue.address = device_address(counter_address(flags, *step.owed_write));
      write.writeValue.value = step.owed_write->value;
      write.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    for (int w = 0; w < waits; ++w) {
      CUstreamBatchMemOpParams& wait = operations[count++];
      wait.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      wait.waitValue.address = device_address(counter_address(flags, step.waits[w]));
      wait.waitValue.value = step.waits[w].value;
      wait.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
    if (const CUresult result = api.batch_mem_op(stream, count, operations, 0); result != CUDA_SUCCESS) {
      std::string names = owed ? step.owed_write->name : "";
      for (int w = 0; w < waits; ++w) names += std::string(names.empty() ? "" : " + ") + step.waits[w].name;
      check_driver(result, api, prefix, "cuStreamBatchMemOp", names + ", " + what());
    }
    return;
  }
  if (owed) {
    if (const CUresult result = api.write_value32(stream, device_address(counter_address(flags, *step.owed_write)),
                                                  step.owed_write->value, CU_STREAM_WRITE_VALUE_DEFAULT);
        result != CUDA_SUCCESS) {
      check_driver(result, api, prefix, "cuStreamWriteValue32", std::string(step.owed_write->name) + ", " + what());
    }
  }
  for (int w = 0; w < waits; ++w) {
    const ipc::CounterValue& wait = step.waits[w];
    if (const CUresult result = api.wait_value32(stream, device_address(counter_address(flags, wait)), wait.value,
                                                 CU_STREAM_WAIT_VALUE_GEQ);
        result != CUDA_SUCCESS) {
      check_driver(result, api, prefix, "cuStreamWaitValue32", std::string(wait.name) + ", " + what());
    }
  }
}

// Enqueues a step whose copies go into `target` (a peer slot or posted buffer: a send) or come out of it
// (this end's slot: a receive); flags is the flags allocation as mapped here.
// A step that copies 1 .. sm_max_bytes bytes in at most kSmTransferMaxCopies pieces copies and raises its
// flag in one thread block (sm_transfer.h). A send's block also does the send's waits, which are for slots
// and buffers freed long before as a rule; a receive waits for its peer, which may take long, and a
// waiting block would hold its SM slot all that time, so a receive waits with a stream memory
// operation and then launches the block. Every other step runs as stream memory waits, one copy-engine
// copy per region and a memory write whose default flags put a barrier before it, so the data is
// visible before the flag.
template <typename Describe>
void enqueue_step(const ipc::Step& step, char* target, void* flags, size_t sm_max_bytes, cudaStream_t stream,
                  const DriverApi& api, const std::string& prefix, const Describe& what) {
  size_t bytes = 0;
  int pieces = 0;
  for (size_t i = 0; i < step.region_count; ++i) {
    bytes += step.regions[i].bytes;
    pieces += step.regions[i].bytes > 0 ? 1 : 0;
  }
  const bool by_block = bytes > 0 && bytes <= sm_max_bytes && pieces <= kSmTransferMaxCopies;
  const bool block_waits = by_block && step.into_target;
  enqueue_memory_operations(step, /*with_waits=*/!block_waits, flags, stream, api, prefix, what);
  if (by_block) {
    SmTransfer transfer;
    if (block_waits) {
      for (int w = 0; w < step.wait_count; ++w) {
        transfer.waits[w] = {reinterpret_cast<const uint32_t*>(counter_address(flags, step.waits[w])),
                             step.waits[w].value};
      }
      transfer.wait_count = step.wait_count;
    }
    for (size_t i = 0; i < step.region_count; ++i) {
      const CopyRegion& region = step.regions[i];
      if (region.bytes == 0) continue;
      char* in_target = target + region.slot_offset;
      transfer.copies[transfer.copy_count++] =
          step.into_target ? SmTransfer::Copy{in_target, region.local, region.bytes}
                           : SmTransfer::Copy{region.local, in_target, region.bytes};
    }
    if (step.signal) {
      transfer.signal = reinterpret_cast<uint32_t*>(counter_address(flags, *step.signal));
      transfer.signal_value = step.signal->value;
    }
    check_cuda(enqueue_sm_transfer(transfer, stream), prefix, "sm_transfer kernel launch", what());
    return;
  }
  for (size_t i = 0; i < step.region_count; ++i) {
    const CopyRegion& region = step.regions[i];
    if (region.bytes == 0) continue;
    char* in_target = target + region.slot_offset;
    if (const cudaError_t error =
            step.into_target ? cudaMemcpyAsync(in_target, region.local, region.bytes, cudaMemcpyDeviceToDevice, stream)
                             : cudaMemcpyAsync(region.local, in_target, region.bytes, cudaMemcpyDeviceToDevice, stream);
        error != cudaSuccess) {
      check_cuda(error, prefix, "cudaMemcpyAsync", what() + ", region " + std::to_string(i));
    }
  }
  if (!step.signal) return;
  if (const CUresult result = api.write_value32(stream, device_address(counter_address(flags, *step.signal)),
                                                step.signal->value, CU_STREAM_WRITE_VALUE_DEFAULT);
      result != CUDA_SUCCESS) {
    check_driver(result, api, prefix, "cuStreamWriteValue32", std::string(step.signal->name) + ", " + what());
  }
}

// PIPECOMM_IPC_SM_MAX_BYTES: messages up to this size are copied by one thread block (see enqueue_step);
// 0, the default, keeps every message on the copy engine and stream memory operations.
size_t sm_max_bytes_from_environment(const std::string& prefix) {
  const char* text = std::getenv("PIPECOMM_IPC_SM_MAX_BYTES");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || *text == '-') {
    throw ChannelError(prefix + ": PIPECOMM_IPC_SM_MAX_BYTES must be a byte count, not '" + text + "'");
  }
  return static_cast<size_t>(value);
}

// Runs release() on `device` once everything queued there has finished, then restores the
// caller's device; for destructors, so every error is swallowed.
template <typename Release>
void release_after_sync(int device, Release&& release) noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (cudaSetDevice(device) == cudaSuccess) {
    (void)cudaDeviceSynchronize();
    release();
  }
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

// Receiver allocations mapped in this process, shared by every sender in it: the runtime maps an
// allocation at most once per process, and two channels to one peer may both be offered buffers in
// the same caching-allocator segment.
class PeerMappings {
 public:
  // The allocation's address here (opened on the current device), or nullptr with the runtime's
  // error cleared when it cannot be mapped. Each success needs one release().
  void* acquire(const cudaIpcMemHandle_t& handle) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (Mapping& mapping : mappings_) {
      if (std::memcmp(&mapping.handle, &handle, sizeof(handle)) == 0) {
        ++mapping.users;
        return mapping.base;
      }
    }
    void* base = nullptr;
    if (cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    mappings_.push_back({handle, base, 1});
    return base;
  }

  void release(void* base) noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
      if (it->base == base && --it->users == 0) {
        (void)cudaIpcCloseMemHandle(base);
        mappings_.erase(it);
        return;
      }
    }
  }

 private:
  struct Mapping {
    cudaIpcMemHandle_t handle;
    void* base;
    int users;
  };
  std::mutex mutex_;
  std::vector<Mapping> mappings_;
};

PeerMappings& peer_mappings() {
  static auto* mappings = new PeerMappings();  // never destroyed: senders may outlive static destruction
  return *mappings;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Receiver

IpcRingReceiver::IpcRingReceiver(int device, uint32_t num_slots, size_t slot_bytes, std::string error_prefix,
                                 std::unique_ptr<GenerationAllocator> allocator)
    : device_(device),
      error_prefix_(prefix_or_default(std::move(error_prefix))),
      allocator_(std::move(allocator)),
      sm_max_bytes_(sm_max_bytes_from_environment(error_prefix_)),
      protocol_(num_slots, error_prefix_) {
  driver_api(error_prefix_);  // fail early if the stream memory operations are unavailable
  DeviceGuard guard(device_, error_prefix_);
  try {
    pci_bus_id_ = bus_id_of(device_, error_prefix_);
    const size_t flags_bytes = protocol_.flags().bytes();
    check_cuda(cudaMalloc(&flags_, flags_bytes), error_prefix_, "cudaMalloc",
               "ring flags, " + std::to_string(flags_bytes) + " bytes on device " + std::to_string(device_));
    // Zero on a private stream and wait for it, before the handles can reach any sender; no
    // device-wide synchronization.
    cudaStream_t stream = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), error_prefix_, "cudaStreamCreateWithFlags");
    cudaError_t error = cudaMemsetAsync(flags_, 0, flags_bytes, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    const cudaError_t destroy_error = cudaStreamDestroy(stream);
    check_cuda(error, error_prefix_, "cudaMemsetAsync/cudaStreamSynchronize", "zeroing the ring flags");
    check_cuda(destroy_error, error_prefix_, "cudaStreamDestroy");
    check_cuda(cudaIpcGetMemHandle(&flags_handle_, flags_), error_prefix_, "cudaIpcGetMemHandle", "ring flags");
    add_generation(protocol_.plan_generation(slot_bytes, 0));
  } catch (...) {
    release_all();
    throw;
  }
}

IpcRingReceiver::~IpcRingReceiver() { release_all(); }

void IpcRingReceiver::release_all() noexcept {
  if (abandoned_) {
    (void)allocator_.release();  // its generations stay allocated, as abandon() promises
    return;
  }
  if (flags_ == nullptr && memory_.empty()) return;
  // Receives still queued may read any generation: release_after_sync lets them finish first.
  release_after_sync(device_, [&] {
    for (const GenerationMemory& memory : memory_) {
      if (memory.from_allocator) {
        allocator_->release(memory.data, cuda_streams(protocol_.generations().find(memory.generation)->streams));
      } else {
        (void)cudaFree(memory.data);
      }
    }
    for (void* data : superseded_owned_) (void)cudaFree(data);
    if (flags_ != nullptr) (void)cudaFree(flags_);
    if (post_fence_ != nullptr) (void)cudaEventDestroy(post_fence_);
  });
  memory_.clear();
  superseded_owned_.clear();
  flags_ = nullptr;
  post_fence_ = nullptr;
}

void IpcRingReceiver::add_generation(const ipc::NewGeneration& generation) {
  GenerationMemory memory{generation.number, nullptr, {}, 0, false};
  const auto what = [&] {
    return "ring data generation " + std::to_string(generation.number) + ", " + std::to_string(num_slots()) +
           " slots of " + std::to_string(generation.slot_bytes) + " bytes on device " + std::to_string(device_);
  };
  if (allocator_) {
    memory.data = allocator_->allocate(generation.total_bytes);
    if (memory.data != nullptr) {
      if (export_pointer(memory.data, &memory.handle, &memory.offset)) {
        memory.from_allocator = true;
      } else {
        allocator_->release(memory.data, {});  // not exportable (expandable segments, say)
        memory.data = nullptr;
      }
    }
  }
  if (!memory.from_allocator) {
    check_cuda(cudaMalloc(&memory.data, generation.total_bytes), error_prefix_, "cudaMalloc", what());
    const cudaError_t error = cudaIpcGetMemHandle(&memory.handle, memory.data);
    if (error != cudaSuccess) {
      (void)cudaFree(memory.data);
      check_cuda(error, error_prefix_, "cudaIpcGetMemHandle", what());
    }
    memory.offset = 0;
  }
  memory_.push_back(memory);
  protocol_.add_generation(generation);
}

void IpcRingReceiver::give_back_unreachable() noexcept {
  for (const ipc::Generation& generation : protocol_.take_unreachable_generations()) {
    const auto memory = record_of(memory_, generation.number);
    if (memory->from_allocator) {
      allocator_->release(memory->data, cuda_streams(generation.streams));
    } else {
      superseded_owned_.push_back(memory->data);  // cudaFree may synchronize the device: not now
    }
    memory_.erase(memory);
  }
}

std::string IpcRingReceiver::serialize(const ipc::Generation& generation) const {
  const GenerationMemory& memory = *record_of(memory_, generation.number);
  ipc::HandleBlob blob;
  blob.info = {pci_bus_id_, static_cast<int32_t>(getpid()), num_slots(), generation.slot_bytes, generation.number,
               generation.first_seq};
  blob.flags_handle = opaque_handle(flags_handle_);
  blob.data_handle = opaque_handle(memory.handle);
  blob.data_offset = memory.offset;
  return ipc::serialize_handle_blob(blob);
}

std::string IpcRingReceiver::export_handles() const { return serialize(protocol_.generations().latest()); }

std::string IpcRingReceiver::resize(size_t slot_bytes, uint64_t first_seq) {
  const ipc::NewGeneration generation = protocol_.plan_generation(slot_bytes, first_seq);
  DeviceGuard guard(device_, error_prefix_);
  add_generation(generation);
  return serialize(*protocol_.generations().find(generation.number));
}

std::string IpcRingReceiver::grow(size_t min_slot_bytes, uint64_t first_seq) {
  return resize(protocol_.grown_slot_bytes(min_slot_bytes, first_seq), first_seq);
}

void IpcRingReceiver::enqueue_receive(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream) {
  enqueue_receive_plan(protocol_.plan_receive(seq, regions, count, stream));
}

void IpcRingReceiver::enqueue_receive_direct(uint64_t seq, cudaStream_t stream) {
  enqueue_receive_plan(protocol_.plan_receive_direct(seq, stream));
}

void IpcRingReceiver::enqueue_receive_plan(const ipc::ReceivePlan& plan) {
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  if (plan.post_write_before) enqueue_post_write(*plan.post_write_before);
  char* slot = plan.direct ? nullptr
                            : static_cast<char*>(record_of(memory_, plan.step.target.generation)->data) +
                                  plan.step.target.offset;
  // Built only on failure: this is the per-message hot path.
  enqueue_step(plan.step, slot, flags_, sm_max_bytes_, cuda_stream(plan.stream), api, error_prefix_,
               [&] { return plan.describe(); });
  protocol_.received(plan);
  if (protocol_.generations().size() > 1) give_back_unreachable();
}

void IpcRingReceiver::release_own_waits(uint64_t seq) noexcept {
  try {
    const DriverApi& api = driver_api(error_prefix_);
    DeviceGuard guard(device_, error_prefix_);
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return;
    for (; seq < protocol_.next_seq(); ++seq) {
      const ipc::SlotPosition position = ipc::slot_position(seq, protocol_.num_slots());
      const ipc::CounterValue ready{protocol_.flags().ready(position.slot), position.round, "ready"};
      (void)api.write_value32(stream, device_address(counter_address(flags_, ready)), ready.value,
                              CU_STREAM_WRITE_VALUE_DEFAULT);
    }
    (void)cudaStreamDestroy(stream);  // its writes still run
  } catch (const std::exception&) {
    // No driver entry point: nothing can be written; the waits stay, as for a peer that died.
  }
}

bool IpcRingReceiver::export_pointer(const void* pointer, cudaIpcMemHandle_t* handle, size_t* offset) {
  const DriverApi& api = driver_api(error_prefix_);
  if (api.pointer_get_attributes == nullptr || pointer == nullptr) return false;
  unsigned long long buffer_id = 0;
  CUdeviceptr range_start = 0;
  size_t range_size = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                      CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* values[] = {&buffer_id, &range_start, &range_size};
  if (api.pointer_get_attributes(3, attributes, values, device_address(pointer)) != CUDA_SUCCESS || range_start == 0) {
    return false;
  }
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  const auto base = static_cast<uintptr_t>(range_start);
  for (const ExportedAllocation& exported : exported_) {
    if (exported.buffer_id == buffer_id && exported.base == base) {
      *handle = exported.handle;
      *offset = address - base;
      return true;
    }
  }
  DeviceGuard guard(device_, error_prefix_);
  ExportedAllocation exported{buffer_id, base, {}};
  if (cudaIpcGetMemHandle(&exported.handle, reinterpret_cast<void*>(base)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // Freed allocations never come back under the same buffer id, so forgetting them all is safe.
  if (exported_.size() >= kMaxExportedAllocations) exported_.clear();
  exported_.push_back(exported);
  *handle = exported.handle;
  *offset = address - base;
  return true;
}

void IpcRingReceiver::enqueue_post(uint64_t post, cudaStream_t stream) {
  const ipc::PostPlan plan = protocol_.plan_post(post, stream);
  DeviceGuard guard(device_, error_prefix_);
  if (plan.owed_write) enqueue_post_write(*plan.owed_write);
  if (plan.fence) {
    if (post_fence_ == nullptr) {
      check_cuda(cudaEventCreateWithFlags(&post_fence_, cudaEventDisableTiming), error_prefix_,
                 "cudaEventCreateWithFlags", "post fence");
    }
    check_cuda(cudaEventRecord(post_fence_, cuda_stream(plan.fence->before)), error_prefix_, "cudaEventRecord",
               "post fence");
    check_cuda(cudaStreamWaitEvent(cuda_stream(plan.fence->waiter), post_fence_, 0), error_prefix_,
               "cudaStreamWaitEvent", "post fence");
  }
  protocol_.posted(plan);
}

void IpcRingReceiver::enqueue_post_write(const ipc::PostWrite& write) {
  const DriverApi& api = driver_api(error_prefix_);
  if (const CUresult result = api.write_value32(cuda_stream(write.stream),
                                                device_address(counter_address(flags_, write.counter)),
                                                write.counter.value, CU_STREAM_WRITE_VALUE_DEFAULT);
      result != CUDA_SUCCESS) {
    check_driver(result, api, error_prefix_, "cuStreamWriteValue32",
                 std::string(write.counter.name) + ", post " + std::to_string(write.post));
  }
}

// ---------------------------------------------------------------------------------------------------
// Sender

IpcRingSender::IpcRingSender(int device, const std::string& receiver_handles, std::string error_prefix)
    : device_(device),
      error_prefix_(prefix_or_default(std::move(error_prefix))),
      sm_max_bytes_(sm_max_bytes_from_environment(error_prefix_)),
      protocol_(receiver_handles, error_prefix_) {
  const IpcRingHandleInfo& receiver = protocol_.receiver().info;
  driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  try {
    int peer = -1;
    if (cudaDeviceGetByPCIBusId(&peer, receiver.pci_bus_id.c_str()) != cudaSuccess) {
      (void)cudaGetLastError();  // the receiver's GPU is not visible here; IPC may still map it
      peer = -1;
    }
    peer_device_ = peer;
    if (peer >= 0 && peer != device_) {
      int can_access = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can_access, device_, peer), error_prefix_, "cudaDeviceCanAccessPeer",
                 "device " + std::to_string(device_) + " -> " + std::to_string(peer));
      if (!can_access) {
        throw ChannelError(error_prefix_ + ": device " + std::to_string(device_) + " cannot access peer device " +
                           std::to_string(peer) + " (" + receiver.pci_bus_id +
                           ") directly, so CUDA IPC cannot connect them; use the host transport");
      }
      const cudaError_t error = cudaDeviceEnablePeerAccess(peer, 0);
      if (error == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        check_cuda(error, error_prefix_, "cudaDeviceEnablePeerAccess",
                   "device " + std::to_string(device_) + " -> " + std::to_string(peer));
      }
    }
    check_cuda(cudaIpcOpenMemHandle(&flags_, cuda_handle(protocol_.receiver().flags_handle),
                                    cudaIpcMemLazyEnablePeerAccess),
               error_prefix_, "cudaIpcOpenMemHandle",
               "ring flags of pid " + std::to_string(receiver.owner_pid) + " on " + receiver.pci_bus_id);
    map_generation(protocol_.receiver());
  } catch (...) {
    release_all();
    throw;
  }
}

IpcRingSender::~IpcRingSender() { release_all(); }

void IpcRingSender::release_all() noexcept {
  if (abandoned_ || (flags_ == nullptr && mapped_generations_.empty())) return;
  // Sends still queued may touch any mapping: release_after_sync lets them finish first.
  release_after_sync(device_, [&] { close_mappings(); });
}

void IpcRingSender::close_mappings() noexcept {
  unmap_retired_allocations(/*all=*/true);
  for (MappedGeneration& generation : mapped_generations_) peer_mappings().release(generation.base);
  for (PeerAllocation& allocation : peer_allocations_) peer_mappings().release(allocation.base);
  if (flags_ != nullptr) (void)cudaIpcCloseMemHandle(flags_);
  mapped_generations_.clear();
  peer_allocations_.clear();
  flags_ = nullptr;
}

bool IpcRingSender::unmap_when_done(std::chrono::microseconds patience) noexcept {
  if (abandoned_) return false;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  std::vector<cudaEvent_t> fences;
  bool done = true;
  for (ipc::StreamId stream : protocol_.send_streams()) {
    cudaEvent_t fence = nullptr;
    if (cudaEventCreateWithFlags(&fence, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(fence, cuda_stream(stream)) != cudaSuccess) {
      if (fence != nullptr) (void)cudaEventDestroy(fence);
      done = false;
      break;
    }
    fences.push_back(fence);
  }
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (done && !std::all_of(fences.begin(), fences.end(),
                              [](cudaEvent_t fence) { return cudaEventQuery(fence) == cudaSuccess; })) {
    if (std::chrono::steady_clock::now() >= deadline) done = false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  for (cudaEvent_t fence : fences) (void)cudaEventDestroy(fence);
  if (done) close_mappings();  // the retired ones' fences are older than the ones that just passed
  (void)cudaGetLastError();
  if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
  return done;
}

void IpcRingSender::unmap_retired_allocations(bool all) noexcept {
  auto it = retired_allocations_.begin();
  while (it != retired_allocations_.end()) {
    bool passed = true;
    for (cudaEvent_t fence : it->fences) {
      if (!all && cudaEventQuery(fence) != cudaSuccess) {
        passed = false;
        break;
      }
    }
    if (!passed) {
      ++it;
      continue;
    }
    for (cudaEvent_t fence : it->fences) (void)cudaEventDestroy(fence);
    peer_mappings().release(it->base);
    it = retired_allocations_.erase(it);
  }
  (void)cudaGetLastError();  // cudaEventQuery's cudaErrorNotReady
}

IpcRingSender::PeerAllocation* IpcRingSender::map_peer_allocation(const cudaIpcMemHandle_t& handle) {
  for (PeerAllocation& allocation : peer_allocations_) {
    if (std::memcmp(&allocation.handle, &handle, sizeof(handle)) == 0) return &allocation;
  }
  if (!retired_allocations_.empty()) unmap_retired_allocations(/*all=*/false);
  if (peer_allocations_.size() >= kMaxPeerAllocations) {
    // Evict the least recently used mapping; it is unmapped once the copies queued into it are done.
    auto victim =
        std::min_element(peer_allocations_.begin(), peer_allocations_.end(),
                         [](const PeerAllocation& a, const PeerAllocation& b) { return a.last_use < b.last_use; });
    retire(victim->base, victim->streams);
    peer_allocations_.erase(victim);
  }
  void* base = peer_mappings().acquire(handle);
  if (base == nullptr) return nullptr;
  peer_allocations_.push_back({handle, static_cast<char*>(base), 0, {}});
  return &peer_allocations_.back();
}

bool IpcRingSender::can_map(const cudaIpcMemHandle_t& handle) {
  DeviceGuard guard(device_, error_prefix_);
  return map_peer_allocation(handle) != nullptr;
}

void IpcRingSender::retire(char* base, const std::vector<ipc::StreamId>& streams) {
  RetiredAllocation retired{base, {}};
  for (ipc::StreamId stream : streams) {
    cudaEvent_t fence = nullptr;
    check_cuda(cudaEventCreateWithFlags(&fence, cudaEventDisableTiming), error_prefix_, "cudaEventCreateWithFlags",
               "unmap fence");
    retired.fences.push_back(fence);
    check_cuda(cudaEventRecord(fence, cuda_stream(stream)), error_prefix_, "cudaEventRecord", "unmap fence");
  }
  retired_allocations_.push_back(std::move(retired));
}

void IpcRingSender::retire_unreachable_generations() {
  for (const ipc::Generation& generation : protocol_.take_unreachable_generations()) {
    const auto mapped = record_of(mapped_generations_, generation.number);
    retire(mapped->base, generation.streams);
    mapped_generations_.erase(mapped);
  }
  unmap_retired_allocations(/*all=*/false);
}

void IpcRingSender::map_generation(const ipc::HandleBlob& blob) {
  auto* base = static_cast<char*>(peer_mappings().acquire(cuda_handle(blob.data_handle)));
  if (base == nullptr) {
    throw ChannelError(error_prefix_ + ": cudaIpcOpenMemHandle failed (ring data generation " +
                       std::to_string(blob.info.generation) + " of pid " +
                       std::to_string(protocol_.receiver().info.owner_pid) + " on " +
                       protocol_.receiver().info.pci_bus_id + ")");
  }
  mapped_generations_.push_back({blob.info.generation, base, base + blob.data_offset});
  protocol_.add_generation(blob.info);
}

void IpcRingSender::update(const std::string& handles) {
  const std::optional<ipc::HandleBlob> blob = protocol_.new_generation(handles);
  if (!blob) return;
  DeviceGuard guard(device_, error_prefix_);
  map_generation(*blob);
}

void IpcRingSender::enqueue_send(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream) {
  const ipc::SendPlan plan = protocol_.plan_send(seq, regions, count, stream);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  char* slot = record_of(mapped_generations_, plan.step.target.generation)->data + plan.step.target.offset;
  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  // The description is built only on failure: this is the per-message hot path.
  enqueue_step(plan.step, slot, flags_, sm_max_bytes_, stream, api, error_prefix_,
               [&] { return plan.describe(); });
  finish_send(plan);
}

bool IpcRingSender::enqueue_send_direct(uint64_t seq, uint64_t post, const cudaIpcMemHandle_t& handle,
                                        size_t offset, size_t capacity, const CopyRegion* regions, size_t count,
                                        cudaStream_t stream, bool posted_passed) {
  const ipc::SendPlan plan =
      protocol_.plan_send_direct(seq, post, offset, capacity, regions, count, stream, posted_passed);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  PeerAllocation* allocation = map_peer_allocation(handle);
  if (allocation == nullptr) return false;
  allocation->last_use = ++allocation_uses_;
  ipc::remember_stream(allocation->streams, stream);
  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  enqueue_step(plan.step, allocation->base + plan.step.target.offset, flags_, sm_max_bytes_, stream, api,
               error_prefix_, [&] { return plan.describe(); });
  finish_send(plan);
  return true;
}

void IpcRingSender::finish_send(const ipc::SendPlan& plan) {
  protocol_.sent(plan);
  if (protocol_.generations().size() > 1) retire_unreachable_generations();
}

void IpcRingSender::enqueue_wait_consumed(uint64_t seq, cudaStream_t stream) {
  const ipc::CounterValue ack = protocol_.consumed(seq);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  check_driver(api.wait_value32(stream, device_address(counter_address(flags_, ack)), ack.value,
                                CU_STREAM_WAIT_VALUE_GEQ),
               api, error_prefix_, "cuStreamWaitValue32", "ack, " + ipc::describe_message(seq, num_slots()));
}

}  // namespace pipecomm::transport
