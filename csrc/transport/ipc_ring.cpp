// CUDA-IPC ring: allocation, handle serialization, peer mapping and the stream-ordered protocol.
#include "ipc_ring.h"

#include <cuda.h>  // driver API types and enums only; the functions come from cudaGetDriverEntryPoint*
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
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

constexpr uint32_t kMagic = 0x52435049;  // "IPCR" in memory order on little-endian hosts
constexpr uint32_t kFormatVersion = 3;  // 2: the flags hold a `posted` line after ack[K]; 3: data offset
constexpr size_t kBusIdBytes = 32;
constexpr size_t kFlagLineBytes = 64;  // every counter in its own line
constexpr uint32_t kMaxSlots = 1u << 16;
// Peer allocations a sender keeps mapped (cudaIpcOpenMemHandle costs far more than a message), and
// exported allocations a receiver remembers; a caching allocator's steady state needs a handful.
constexpr size_t kMaxPeerAllocations = 64;
constexpr size_t kMaxExportedAllocations = 256;
// The ABI version of the stream memory operations we ask for: the _v2 entry points (CUDA 11.7+,
// the default from 12.0), which need no CAN_USE_STREAM_MEM_OPS_V1 attribute.
constexpr unsigned int kDriverApiVersion = 12000;

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
constexpr size_t kOffDataHandle = kOffFlagsHandle + sizeof(cudaIpcMemHandle_t);
constexpr size_t kOffDataOffset = kOffDataHandle + sizeof(cudaIpcMemHandle_t);  // of the data in its allocation
constexpr size_t kBlobBytes = kOffDataOffset + 8;
static_assert(sizeof(cudaIpcMemHandle_t) == 64, "unexpected cudaIpcMemHandle_t size");

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


// Where message seq lives: its slot, the round that slot's counters reach for it, and the slot's
// two counters in the flags allocation (ready[K], then ack[K], then posted, each in its own line).
struct SlotPosition {
  uint32_t slot;
  uint32_t round;
  const void* ready;
  const void* ack;

  std::string describe(uint64_t seq) const {
    return "message " + std::to_string(seq) + ", slot " + std::to_string(slot) + ", round " + std::to_string(round);
  }
};

SlotPosition slot_position(const void* flags, uint32_t num_slots, uint64_t seq) {
  const auto slot = static_cast<uint32_t>(seq % num_slots);
  const auto* base = static_cast<const char*>(flags);
  return {slot, static_cast<uint32_t>(seq / num_slots + 1), base + size_t{slot} * kFlagLineBytes,
          base + (size_t{num_slots} + slot) * kFlagLineBytes};
}

const void* posted_counter(const void* flags, uint32_t num_slots) {
  return static_cast<const char*>(flags) + size_t{2} * num_slots * kFlagLineBytes;
}

size_t flags_bytes_for(uint32_t num_slots) { return (size_t{2} * num_slots + 1) * kFlagLineBytes; }

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

cudaIpcMemHandle_t handle_at(const std::string& blob, size_t offset) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, blob.data() + offset, sizeof(handle));
  return handle;
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

// One stream-ordered step of the protocol: wait until each flag reaches its value, copy the regions into
// `slot` (a peer slot or posted buffer) or out of it (this end's slot), then write `signal` = value.
struct Step {
  struct Flag {
    const void* flag = nullptr;
    uint32_t value = 0;
    const char* name = "";  // for error messages
  };
  Flag waits[kSmTransferMaxWaits];
  int wait_count = 0;
  const CopyRegion* regions = nullptr;
  size_t count = 0;
  char* slot = nullptr;
  bool into_slot = true;
  Flag signal;  // none while its flag is null
  Flag prior_signal;  // a write owed from before (a deferred post), made ahead of the waits; none while null

  void wait(const void* flag, uint32_t value, const char* name) { waits[wait_count++] = {flag, value, name}; }
};

// A step that copies `regions` into `slot` (into_slot) or out of it, then raises `signal`.
Step copy_step(const CopyRegion* regions, size_t count, char* slot, bool into_slot, Step::Flag signal) {
  Step step;
  step.regions = regions;
  step.count = count;
  step.slot = slot;
  step.into_slot = into_slot;
  step.signal = signal;
  return step;
}

// A step that copies 1 .. sm_max_bytes bytes in at most kSmTransferMaxCopies pieces copies and raises its
// flag in one thread block (sm_transfer.h). A send's block also does the send's waits, which are for slots
// and buffers freed long before as a rule; a receive waits for its peer, which may take long, and a
// waiting block would hold its SM slot all that time, so a receive waits with a stream memory
// operation and then launches the block. Every other step runs as stream memory waits, one copy-engine
// copy per region and a memory write whose default flags put a barrier before it, so the data is
// visible before the flag.
// A step's prior signal and (unless a block polls them) its waits, in order. Each driver call costs the
// host microseconds, which bound a small message's latency, so two or more go in one batched call.
template <typename Describe>
void enqueue_memory_operations(const Step& step, bool with_waits, cudaStream_t stream, const DriverApi& api,
                               const std::string& prefix, const Describe& what) {
  const int waits = with_waits ? step.wait_count : 0;
  const bool prior = step.prior_signal.flag != nullptr;
  if (waits + (prior ? 1 : 0) > 1 && api.batch_mem_op != nullptr) {
    CUstreamBatchMemOpParams operations[kSmTransferMaxWaits + 1] = {};
    unsigned int count = 0;
    if (prior) {
      CUstreamBatchMemOpParams& write = operations[count++];
      write.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      write.writeValue.address = device_address(step.prior_signal.flag);
      write.writeValue.value = step.prior_signal.value;
      write.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    for (int w = 0; w < waits; ++w) {
      CUstreamBatchMemOpParams& wait = operations[count++];
      wait.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      wait.waitValue.address = device_address(step.waits[w].flag);
      wait.waitValue.value = step.waits[w].value;
      wait.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
    if (const CUresult result = api.batch_mem_op(stream, count, operations, 0); result != CUDA_SUCCESS) {
      std::string names = prior ? step.prior_signal.name : "";
      for (int w = 0; w < waits; ++w) names += std::string(names.empty() ? "" : " + ") + step.waits[w].name;
      check_driver(result, api, prefix, "cuStreamBatchMemOp", names + ", " + what());
    }
    return;
  }
  if (prior) {
    if (const CUresult result = api.write_value32(stream, device_address(step.prior_signal.flag),
                                                  step.prior_signal.value, CU_STREAM_WRITE_VALUE_DEFAULT);
        result != CUDA_SUCCESS) {
      check_driver(result, api, prefix, "cuStreamWriteValue32", std::string(step.prior_signal.name) + ", " + what());
    }
  }
  for (int w = 0; w < waits; ++w) {
    const Step::Flag& wait = step.waits[w];
    if (const CUresult result = api.wait_value32(stream, device_address(wait.flag), wait.value, CU_STREAM_WAIT_VALUE_GEQ);
        result != CUDA_SUCCESS) {
      check_driver(result, api, prefix, "cuStreamWaitValue32", std::string(wait.name) + ", " + what());
    }
  }
}

template <typename Describe>
void enqueue_step(const Step& step, size_t sm_max_bytes, cudaStream_t stream, const DriverApi& api,
                  const std::string& prefix, const Describe& what) {
  size_t bytes = 0;
  int pieces = 0;
  for (size_t i = 0; i < step.count; ++i) {
    bytes += step.regions[i].bytes;
    pieces += step.regions[i].bytes > 0 ? 1 : 0;
  }
  const bool by_block = bytes > 0 && bytes <= sm_max_bytes && pieces <= kSmTransferMaxCopies;
  const bool block_waits = by_block && step.into_slot;
  enqueue_memory_operations(step, /*with_waits=*/!block_waits, stream, api, prefix, what);
  if (by_block) {
    SmTransfer transfer;
    if (block_waits) {
      for (int w = 0; w < step.wait_count; ++w) {
        transfer.waits[w] = {static_cast<const uint32_t*>(step.waits[w].flag), step.waits[w].value};
      }
      transfer.wait_count = step.wait_count;
    }
    for (size_t i = 0; i < step.count; ++i) {
      const CopyRegion& region = step.regions[i];
      if (region.bytes == 0) continue;
      char* in_slot = step.slot + region.slot_offset;
      transfer.copies[transfer.copy_count++] =
          step.into_slot ? SmTransfer::Copy{in_slot, region.local, region.bytes}
                         : SmTransfer::Copy{region.local, in_slot, region.bytes};
    }
    transfer.signal = static_cast<uint32_t*>(const_cast<void*>(step.signal.flag));
    transfer.signal_value = step.signal.value;
    check_cuda(enqueue_sm_transfer(transfer, stream), prefix, "sm_transfer kernel launch", what());
    return;
  }
  for (size_t i = 0; i < step.count; ++i) {
    const CopyRegion& region = step.regions[i];
    if (region.bytes == 0) continue;
    char* in_slot = step.slot + region.slot_offset;
    if (const cudaError_t error =
            step.into_slot ? cudaMemcpyAsync(in_slot, region.local, region.bytes, cudaMemcpyDeviceToDevice, stream)
                           : cudaMemcpyAsync(region.local, in_slot, region.bytes, cudaMemcpyDeviceToDevice, stream);
        error != cudaSuccess) {
      check_cuda(error, prefix, "cudaMemcpyAsync", what() + ", region " + std::to_string(i));
    }
  }
  if (step.signal.flag == nullptr) return;
  if (const CUresult result = api.write_value32(stream, device_address(step.signal.flag), step.signal.value,
                                                CU_STREAM_WRITE_VALUE_DEFAULT);
      result != CUDA_SUCCESS) {
    check_driver(result, api, prefix, "cuStreamWriteValue32", std::string(step.signal.name) + ", " + what());
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

// Adds stream to the streams that touched something, once.
void remember(std::vector<cudaStream_t>& streams, cudaStream_t stream) {
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

// Whether generation a wins over b for a message both could hold: the later start, the newer on a tie.
template <typename Generation>
bool supersedes(const Generation& a, const Generation& b) {
  return a.first_seq != b.first_seq ? a.first_seq > b.first_seq : a.generation > b.generation;
}

// Where message seq lives: of the generations starting at or before it, the one that supersedes the rest;
// nullptr when none does.
template <typename Generations>
auto* find_holding(Generations& generations, uint64_t seq) {
  decltype(&generations.front()) holder = nullptr;
  for (auto& generation : generations) {
    if (generation.first_seq <= seq && (holder == nullptr || supersedes(generation, *holder))) holder = &generation;
  }
  return holder;
}

template <typename Generations>
auto* generation_holding(Generations& generations, uint64_t seq, const std::string& error_prefix) {
  auto* holder = find_holding(generations, seq);
  if (holder == nullptr) {
    throw ProtocolError(error_prefix + ": no data generation holds message " + std::to_string(seq));
  }
  return holder;
}

// Moves out of `generations` those no message from next_seq on can reach, i.e. superseded by one that
// starts at or before next_seq (generations made later start there or later, so they never revive one).
template <typename Generation>
std::vector<Generation> take_superseded(std::vector<Generation>& generations, uint64_t next_seq) {
  std::vector<Generation> superseded;
  const Generation* current = find_holding(generations, next_seq);
  if (current == nullptr) return superseded;
  const uint32_t keep = current->generation;
  auto kept = std::stable_partition(generations.begin(), generations.end(), [&](const Generation& generation) {
    return generation.generation == keep || generation.first_seq > next_seq;
  });
  std::move(kept, generations.end(), std::back_inserter(superseded));
  generations.erase(kept, generations.end());
  return superseded;
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

size_t round_slot_bytes(size_t bytes, const std::string& prefix) {
  if (bytes == 0) bytes = 1;
  if (bytes > std::numeric_limits<size_t>::max() - (kIpcSlotAlignment - 1)) {
    throw ProtocolError(prefix + ": slot size " + std::to_string(bytes) + " overflows");
  }
  return (bytes + kIpcSlotAlignment - 1) / kIpcSlotAlignment * kIpcSlotAlignment;
}

IpcRingHandleInfo parse_ipc_ring_handles(const std::string& handles) {
  const std::string prefix = "pipecomm ipc ring";
  if (handles.size() != kBlobBytes || get<uint32_t>(handles, kOffMagic) != kMagic) {
    throw ProtocolError(prefix + ": not an ipc ring handle blob (" + std::to_string(handles.size()) +
                        " bytes, expected " + std::to_string(kBlobBytes) + " with magic)");
  }
  const uint32_t version = get<uint32_t>(handles, kOffVersion);
  if (version != kFormatVersion) {
    throw ProtocolError(prefix + ": ipc ring handle blob of format version " + std::to_string(version) +
                        ", this build reads version " + std::to_string(kFormatVersion));
  }
  IpcRingHandleInfo info;
  const char* bus = handles.data() + kOffBusId;
  info.pci_bus_id.assign(bus, strnlen(bus, kBusIdBytes));
  info.owner_pid = get<int32_t>(handles, kOffPid);
  info.num_slots = get<uint32_t>(handles, kOffNumSlots);
  info.slot_bytes = get<uint64_t>(handles, kOffSlotBytes);
  info.generation = get<uint32_t>(handles, kOffGeneration);
  info.first_seq = get<uint64_t>(handles, kOffFirstSeq);
  if (info.num_slots == 0 || info.num_slots > kMaxSlots || info.slot_bytes == 0 || info.pci_bus_id.empty()) {
    throw ProtocolError(prefix + ": corrupt ipc ring handle blob (num_slots " + std::to_string(info.num_slots) +
                        ", slot_bytes " + std::to_string(info.slot_bytes) + ")");
  }
  return info;
}

// ---------------------------------------------------------------------------------------------------
// Receiver

IpcRingReceiver::IpcRingReceiver(int device, uint32_t num_slots, size_t slot_bytes, std::string error_prefix,
                                 std::unique_ptr<GenerationAllocator> allocator)
    : device_(device),
      num_slots_(num_slots),
      error_prefix_(prefix_or_default(std::move(error_prefix))),
      allocator_(std::move(allocator)),
      sm_max_bytes_(sm_max_bytes_from_environment(error_prefix_)) {
  if (num_slots == 0 || num_slots > kMaxSlots) {
    throw ProtocolError(error_prefix_ + ": num_slots must be in [1, " + std::to_string(kMaxSlots) + "], got " +
                        std::to_string(num_slots));
  }
  driver_api(error_prefix_);  // fail early if the stream memory operations are unavailable
  DeviceGuard guard(device_, error_prefix_);
  try {
    pci_bus_id_ = bus_id_of(device_, error_prefix_);
    const size_t flags_bytes = flags_bytes_for(num_slots_);
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
    add_generation(slot_bytes, 0);
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
  if (flags_ == nullptr && generations_.empty()) return;
  // Receives still queued may read any generation: release_after_sync lets them finish first.
  release_after_sync(device_, [&] {
    for (Generation& generation : generations_) {
      if (generation.from_allocator) {
        allocator_->release(generation.data, generation.readers);
      } else {
        (void)cudaFree(generation.data);
      }
    }
    for (void* data : superseded_owned_) (void)cudaFree(data);
    if (flags_ != nullptr) (void)cudaFree(flags_);
    if (post_fence_ != nullptr) (void)cudaEventDestroy(post_fence_);
  });
  generations_.clear();
  superseded_owned_.clear();
  flags_ = nullptr;
  post_fence_ = nullptr;
}


void IpcRingReceiver::add_generation(size_t slot_bytes, uint64_t first_seq) {
  const size_t rounded = round_slot_bytes(slot_bytes, error_prefix_);
  if (rounded > std::numeric_limits<size_t>::max() / num_slots_) {
    throw ProtocolError(error_prefix_ + ": " + std::to_string(num_slots_) + " slots of " + std::to_string(rounded) +
                        " bytes overflow");
  }
  const size_t total = rounded * num_slots_;
  Generation generation{};
  generation.generation = next_generation_;
  generation.first_seq = first_seq;
  generation.slot_bytes = rounded;
  const auto what = [&] {
    return "ring data generation " + std::to_string(generation.generation) + ", " + std::to_string(num_slots_) +
           " slots of " + std::to_string(rounded) + " bytes on device " + std::to_string(device_);
  };
  if (allocator_) {
    generation.data = allocator_->allocate(total);
    if (generation.data != nullptr) {
      if (export_pointer(generation.data, &generation.handle, &generation.offset)) {
        generation.from_allocator = true;
      } else {
        allocator_->release(generation.data, {});  // not exportable (expandable segments, say)
        generation.data = nullptr;
      }
    }
  }
  if (!generation.from_allocator) {
    check_cuda(cudaMalloc(&generation.data, total), error_prefix_, "cudaMalloc", what());
    const cudaError_t error = cudaIpcGetMemHandle(&generation.handle, generation.data);
    if (error != cudaSuccess) {
      (void)cudaFree(generation.data);
      check_cuda(error, error_prefix_, "cudaIpcGetMemHandle", what());
    }
    generation.offset = 0;
  }
  generations_.push_back(std::move(generation));
  ++next_generation_;
}

const IpcRingReceiver::Generation& IpcRingReceiver::latest() const {
  return *find_holding(generations_, std::numeric_limits<uint64_t>::max());
}

void IpcRingReceiver::give_back_superseded() noexcept {
  for (Generation& generation : take_superseded(generations_, next_seq_)) {
    if (generation.from_allocator) {
      allocator_->release(generation.data, generation.readers);
    } else {
      superseded_owned_.push_back(generation.data);  // cudaFree may synchronize the device: not now
    }
  }
}

std::string IpcRingReceiver::serialize(const Generation& generation) const {
  std::string blob(kBlobBytes, '\0');
  put<uint32_t>(blob, kOffMagic, kMagic);
  put<uint32_t>(blob, kOffVersion, kFormatVersion);
  std::memcpy(&blob[kOffBusId], pci_bus_id_.data(), std::min(pci_bus_id_.size(), kBusIdBytes - 1));
  put<int32_t>(blob, kOffPid, static_cast<int32_t>(getpid()));
  put<uint32_t>(blob, kOffNumSlots, num_slots_);
  put<uint64_t>(blob, kOffSlotBytes, static_cast<uint64_t>(generation.slot_bytes));
  put<uint32_t>(blob, kOffGeneration, generation.generation);
  put<uint64_t>(blob, kOffFirstSeq, generation.first_seq);
  std::memcpy(&blob[kOffFlagsHandle], &flags_handle_, sizeof(flags_handle_));
  std::memcpy(&blob[kOffDataHandle], &generation.handle, sizeof(generation.handle));
  put<uint64_t>(blob, kOffDataOffset, static_cast<uint64_t>(generation.offset));
  return blob;
}

std::string IpcRingReceiver::export_handles() const { return serialize(latest()); }

void IpcRingReceiver::check_not_received(uint64_t first_seq) const {
  if (first_seq < next_seq_) {
    throw ProtocolError(error_prefix_ + ": cannot start a data generation at message " + std::to_string(first_seq) +
                        ": message " + std::to_string(next_seq_ - 1) + " was already received");
  }
}

std::string IpcRingReceiver::resize(size_t slot_bytes, uint64_t first_seq) {
  check_not_received(first_seq);
  DeviceGuard guard(device_, error_prefix_);
  add_generation(slot_bytes, first_seq);
  return serialize(generations_.back());
}

std::string IpcRingReceiver::grow(size_t min_slot_bytes, uint64_t first_seq) {
  check_not_received(first_seq);  // before the lookup, which fails for a message given back
  const size_t old_bytes = generation_holding(generations_, first_seq, error_prefix_)->slot_bytes;
  const size_t doubled = old_bytes > std::numeric_limits<size_t>::max() / 2 ? old_bytes : old_bytes * 2;
  return resize(std::max(min_slot_bytes, doubled), first_seq);
}

void IpcRingReceiver::enqueue_receive(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream) {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_receive");
  Generation& generation = *generation_holding(generations_, seq, error_prefix_);
  check_regions(regions, count, generation.slot_bytes, generation.generation, seq, error_prefix_);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);

  const SlotPosition position = slot_position(flags_, num_slots_, seq);
  char* slot_data = static_cast<char*>(generation.data) + size_t{position.slot} * generation.slot_bytes;
  // Built only on failure: this is the per-message hot path.
  const auto what = [&] { return position.describe(seq); };

  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  Step step = copy_step(regions, count, slot_data, /*into_slot=*/false, {position.ack, position.round, "ack"});
  step.wait(position.ready, position.round, "ready");
  if (const uint32_t posted = take_deferred_post(stream)) {
    step.prior_signal = {posted_counter(flags_, num_slots_), posted, "posted"};
  }
  enqueue_step(step, sm_max_bytes_, stream, api, error_prefix_, [&] { return "out of the slot, " + what(); });
  remember(generation.readers, stream);
  ++next_seq_;
  if (generations_.size() > 1) give_back_superseded();
}

void IpcRingReceiver::enqueue_receive_direct(uint64_t seq, cudaStream_t stream) {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_receive_direct");
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  const SlotPosition position = slot_position(flags_, num_slots_, seq);
  Step step;
  step.wait(position.ready, position.round, "ready");
  if (const uint32_t posted = take_deferred_post(stream)) {
    step.prior_signal = {posted_counter(flags_, num_slots_), posted, "posted"};
  }
  enqueue_step(step, sm_max_bytes_, stream, api, error_prefix_, [&] { return position.describe(seq) + ", direct"; });
  ++next_seq_;
  if (generations_.size() > 1) give_back_superseded();
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
  if (posted_before_ && post < next_post_) {
    throw ProtocolError(error_prefix_ + ": enqueue_post got post " + std::to_string(post) + ", but post " +
                        std::to_string(next_post_ - 1) + " was already posted");
  }
  DeviceGuard guard(device_, error_prefix_);
  if (posted_before_ && stream != last_post_stream_) {
    // A later post on another stream must not raise the counter before the earlier post's stream
    // got there: order the new stream after the old one.
    write_deferred_post();
    if (post_fence_ == nullptr) {
      check_cuda(cudaEventCreateWithFlags(&post_fence_, cudaEventDisableTiming), error_prefix_,
                 "cudaEventCreateWithFlags", "post fence");
    }
    check_cuda(cudaEventRecord(post_fence_, last_post_stream_), error_prefix_, "cudaEventRecord", "post fence");
    check_cuda(cudaStreamWaitEvent(stream, post_fence_, 0), error_prefix_, "cudaStreamWaitEvent", "post fence");
  }
  // The counter write waits for the next receive on this stream, which makes it in the same driver call
  // as its own wait, at the same point of the stream: the host enqueues nothing in between.
  post_deferred_ = true;
  posted_before_ = true;
  last_post_stream_ = stream;
  next_post_ = post + 1;
}

void IpcRingReceiver::write_deferred_post() {
  if (!post_deferred_) return;
  const DriverApi& api = driver_api(error_prefix_);
  if (const CUresult result = api.write_value32(last_post_stream_, device_address(posted_counter(flags_, num_slots_)),
                                                static_cast<cuuint32_t>(next_post_), CU_STREAM_WRITE_VALUE_DEFAULT);
      result != CUDA_SUCCESS) {
    check_driver(result, api, error_prefix_, "cuStreamWriteValue32", "posted, post " + std::to_string(next_post_ - 1));
  }
  post_deferred_ = false;
  written_posts_ = next_post_;
}

uint32_t IpcRingReceiver::take_deferred_post(cudaStream_t stream) {
  if (!post_deferred_) return 0;
  if (stream != last_post_stream_) {
    write_deferred_post();
    return 0;
  }
  post_deferred_ = false;
  written_posts_ = next_post_;  // once the caller's step is enqueued, which is the next thing it does
  return static_cast<uint32_t>(next_post_);
}

// ---------------------------------------------------------------------------------------------------
// Sender

IpcRingSender::IpcRingSender(int device, const std::string& receiver_handles, std::string error_prefix)
    : device_(device),
      error_prefix_(prefix_or_default(std::move(error_prefix))),
      sm_max_bytes_(sm_max_bytes_from_environment(error_prefix_)) {
  IpcRingHandleInfo info;
  try {
    info = parse_ipc_ring_handles(receiver_handles);
  } catch (const ProtocolError& error) {
    throw ProtocolError(error_prefix_ + ": receiver handles: " + error.what());
  }
  pci_bus_id_ = info.pci_bus_id;
  owner_pid_ = info.owner_pid;
  num_slots_ = info.num_slots;
  slot_history_.resize(num_slots_);
  flags_handle_bytes_ = receiver_handles.substr(kOffFlagsHandle, sizeof(cudaIpcMemHandle_t));
  driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  try {
    int peer = -1;
    if (cudaDeviceGetByPCIBusId(&peer, pci_bus_id_.c_str()) != cudaSuccess) {
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
                           std::to_string(peer) + " (" + pci_bus_id_ +
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
    check_cuda(cudaIpcOpenMemHandle(&flags_, handle_at(receiver_handles, kOffFlagsHandle),
                                    cudaIpcMemLazyEnablePeerAccess),
               error_prefix_, "cudaIpcOpenMemHandle",
               "ring flags of pid " + std::to_string(owner_pid_) + " on " + pci_bus_id_);
    map_generation(info, receiver_handles);
  } catch (...) {
    release_all();
    throw;
  }
}

IpcRingSender::~IpcRingSender() { release_all(); }

void IpcRingSender::release_all() noexcept {
  if (abandoned_ || (flags_ == nullptr && generations_.empty())) return;
  // Sends still queued may touch any mapping: release_after_sync lets them finish first.
  release_after_sync(device_, [&] { close_mappings(); });
}

void IpcRingSender::close_mappings() noexcept {
  unmap_retired_allocations(/*all=*/true);
  for (Generation& generation : generations_) peer_mappings().release(generation.base);
  for (PeerAllocation& allocation : peer_allocations_) peer_mappings().release(allocation.base);
  if (flags_ != nullptr) (void)cudaIpcCloseMemHandle(flags_);
  generations_.clear();
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
  for (cudaStream_t stream : send_streams_) {
    cudaEvent_t fence = nullptr;
    if (cudaEventCreateWithFlags(&fence, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(fence, stream) != cudaSuccess) {
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

void IpcRingSender::retire(char* base, const std::vector<cudaStream_t>& streams) {
  RetiredAllocation retired{base, {}};
  for (cudaStream_t stream : streams) {
    cudaEvent_t fence = nullptr;
    check_cuda(cudaEventCreateWithFlags(&fence, cudaEventDisableTiming), error_prefix_, "cudaEventCreateWithFlags",
               "unmap fence");
    retired.fences.push_back(fence);
    check_cuda(cudaEventRecord(fence, stream), error_prefix_, "cudaEventRecord", "unmap fence");
  }
  retired_allocations_.push_back(std::move(retired));
}

void IpcRingSender::retire_superseded() {
  for (const Generation& generation : take_superseded(generations_, next_seq_)) retire(generation.base, generation.writers);
  unmap_retired_allocations(/*all=*/false);
}

void IpcRingSender::map_generation(const IpcRingHandleInfo& info, const std::string& handles) {
  auto* base = static_cast<char*>(peer_mappings().acquire(handle_at(handles, kOffDataHandle)));
  if (base == nullptr) {
    throw ChannelError(error_prefix_ + ": cudaIpcOpenMemHandle failed (ring data generation " +
                       std::to_string(info.generation) + " of pid " + std::to_string(owner_pid_) + " on " +
                       pci_bus_id_ + ")");
  }
  const size_t offset = static_cast<size_t>(get<uint64_t>(handles, kOffDataOffset));
  generations_.push_back({info.generation, info.first_seq, static_cast<size_t>(info.slot_bytes), base, base + offset, {}});
  known_generations_.push_back(info.generation);
}

size_t IpcRingSender::slot_bytes() const {
  return generation_holding(generations_, next_seq_, error_prefix_)->slot_bytes;
}

uint32_t IpcRingSender::generation() const {
  return generation_holding(generations_, next_seq_, error_prefix_)->generation;
}

void IpcRingSender::update(const std::string& handles) {
  IpcRingHandleInfo info;
  try {
    info = parse_ipc_ring_handles(handles);
  } catch (const ProtocolError& error) {
    throw ProtocolError(error_prefix_ + ": update: " + error.what());
  }
  if (info.pci_bus_id != pci_bus_id_ || info.owner_pid != owner_pid_ || info.num_slots != num_slots_ ||
      handles.compare(kOffFlagsHandle, sizeof(cudaIpcMemHandle_t), flags_handle_bytes_) != 0) {
    throw ProtocolError(error_prefix_ + ": update: handles of another receiver (pid " +
                        std::to_string(info.owner_pid) + " on " + info.pci_bus_id + ", " +
                        std::to_string(info.num_slots) + " slots; connected to pid " + std::to_string(owner_pid_) +
                        " on " + pci_bus_id_ + ", " + std::to_string(num_slots_) + " slots)");
  }
  if (std::find(known_generations_.begin(), known_generations_.end(), info.generation) != known_generations_.end()) {
    return;
  }
  if (info.first_seq < next_seq_) {
    throw ProtocolError(error_prefix_ + ": update: data generation " + std::to_string(info.generation) +
                        " starts at message " + std::to_string(info.first_seq) + ", but message " +
                        std::to_string(next_seq_ - 1) +
                        " was already sent; the receiver must resize() for a message the sender has not sent");
  }
  DeviceGuard guard(device_, error_prefix_);
  map_generation(info, handles);
}

void IpcRingSender::enqueue_send(uint64_t seq, const CopyRegion* regions, size_t count, cudaStream_t stream) {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_send");
  Generation& generation = *generation_holding(generations_, seq, error_prefix_);
  check_regions(regions, count, generation.slot_bytes, generation.generation, seq, error_prefix_);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);

  const SlotPosition position = slot_position(flags_, num_slots_, seq);
  char* slot_data = static_cast<char*>(generation.data) + size_t{position.slot} * generation.slot_bytes;
  // Built only on failure: this is the per-message hot path.
  const auto what = [&] { return position.describe(seq); };

  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  SlotHistory& history = slot_history_[position.slot];
  Step step = copy_step(regions, count, slot_data, /*into_slot=*/true, {position.ready, position.round, "ready"});
  if (history.slot_round > 0) step.wait(position.ack, history.slot_round, "ack");  // the last occupant copied out
  // After a direct message on another stream, that message's ready write must land first.
  if (seq >= num_slots_ && history.slot_round != position.round - 1 && history.stream != stream) {
    step.wait(position.ready, position.round - 1, "ready of the slot's previous message");
  }
  enqueue_step(step, sm_max_bytes_, stream, api, error_prefix_, [&] { return "into the peer slot, " + what(); });
  history.slot_round = position.round;
  history.stream = stream;
  remember(generation.writers, stream);
  remember(send_streams_, stream);
  ++next_seq_;
  if (generations_.size() > 1) retire_superseded();
}

bool IpcRingSender::enqueue_send_direct(uint64_t seq, uint64_t post, const cudaIpcMemHandle_t& handle,
                                        size_t offset, size_t capacity, const CopyRegion* regions, size_t count,
                                        cudaStream_t stream, bool posted_passed) {
  check_next_seq(seq, next_seq_, error_prefix_, "enqueue_send_direct");
  check_regions(regions, count, capacity, 0, seq, error_prefix_);
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  PeerAllocation* allocation = map_peer_allocation(handle);
  if (allocation == nullptr) return false;
  allocation->last_use = ++allocation_uses_;
  remember(allocation->streams, stream);

  const SlotPosition position = slot_position(flags_, num_slots_, seq);
  char* buffer = allocation->base + offset;
  // Built only on failure: this is the per-message hot path.
  const auto what = [&] { return position.describe(seq) + ", post " + std::to_string(post); };

  // From here on a failure leaves a half-enqueued message: the ring is unusable afterwards.
  SlotHistory& history = slot_history_[position.slot];
  Step step = copy_step(regions, count, buffer, /*into_slot=*/true, {position.ready, position.round, "ready"});
  // ready[slot] rises in message order: on one stream by itself, across streams after this wait.
  if (seq >= num_slots_ && history.stream != stream) {
    step.wait(position.ready, position.round - 1, "ready of the slot's previous message");
  }
  // The receiver's stream has passed the buffer's allocation: nothing of its own still uses that memory.
  if (!posted_passed) step.wait(posted_counter(flags_, num_slots_), static_cast<uint32_t>(post + 1), "posted");
  enqueue_step(step, sm_max_bytes_, stream, api, error_prefix_, [&] { return "into the posted buffer, " + what(); });
  history.stream = stream;
  remember(send_streams_, stream);
  ++next_seq_;
  if (generations_.size() > 1) retire_superseded();
  return true;
}

void IpcRingSender::enqueue_wait_consumed(uint64_t seq, cudaStream_t stream) {
  if (seq >= next_seq_) {
    throw ProtocolError(error_prefix_ + ": enqueue_wait_consumed(" + std::to_string(seq) +
                        "): that message was not sent yet (next is " + std::to_string(next_seq_) + ")");
  }
  const DriverApi& api = driver_api(error_prefix_);
  DeviceGuard guard(device_, error_prefix_);
  const SlotPosition position = slot_position(flags_, num_slots_, seq);
  check_driver(api.wait_value32(stream, device_address(position.ack), position.round, CU_STREAM_WAIT_VALUE_GEQ), api,
               error_prefix_, "cuStreamWaitValue32", "ack, " + position.describe(seq));
}

}  // namespace pipecomm::transport
