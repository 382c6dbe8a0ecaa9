// Native tests of the CUDA-IPC ring's protocol core (csrc/transport/ipc_protocol.*): its plans checked
// exactly, and run by a host stepper the way a GPU runs them (host threads for streams, std::atomic
// counters for the flags, memcpy for the copies), natively and under ThreadSanitizer. argv[1] runs one case.
#include "../../csrc/transport/ipc_protocol.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using Clock = std::chrono::steady_clock;

constexpr char kPrefix[] = "test ipc protocol";
constexpr auto kWaitTimeout = std::chrono::seconds(30);
// ThreadSanitizer instruments every copy and atomic: fewer messages there, the same cases.
constexpr uint64_t kScale = NATIVE_TEST_TSAN ? 1 : 5;

// ---- the host device: streams, memory, IPC handles -----------------------------------------------------

// The first failure on any stream. Once raised, every stream skips what it has left and every wait gives
// up, so one failure ends the case instead of a cascade of timeouts.
std::atomic<bool> g_fault_raised{false};
std::mutex g_fault_mutex;
std::string g_fault;

void raise_fault(const std::string& what) {
  const std::lock_guard<std::mutex> lock(g_fault_mutex);
  if (g_fault.empty()) g_fault = what;
  g_fault_raised.store(true, std::memory_order_release);
}

std::string take_fault() {
  const std::lock_guard<std::mutex> lock(g_fault_mutex);
  std::string fault = std::move(g_fault);
  g_fault.clear();
  g_fault_raised.store(false, std::memory_order_release);
  return fault;
}

struct StreamAborted {};  // a wait giving up because another stream failed

// Polls until ready() holds, as a stream memory wait does; a TestFailure after kWaitTimeout.
template <typename Ready, typename Describe>
void wait_until(const Ready& ready, const Describe& what) {
  const auto deadline = Clock::now() + kWaitTimeout;
  for (unsigned polls = 0; !ready(); ++polls) {
    if (g_fault_raised.load(std::memory_order_acquire)) throw StreamAborted{};
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (polls % 256 == 255 && Clock::now() > deadline) throw TestFailure("timed out waiting for " + what());
  }
}

// A stream: one host thread running what is enqueued on it strictly in order, as a GPU stream does.
class HostStream {
 public:
  explicit HostStream(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}
  ~HostStream() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty()) raise_fault(name_ + " destroyed with work pending");
      stopping_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  ipc::StreamId id() { return this; }
  static HostStream& of(ipc::StreamId id) { return *static_cast<HostStream*>(id); }

  void enqueue(std::function<void()> operation) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(operation));
      ++enqueued_;
    }
    ready_.notify_all();
  }

  // An event: the point this stream has been enqueued up to.
  uint64_t record() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return enqueued_;
  }
  bool passed(uint64_t mark) const { return completed_.load(std::memory_order_acquire) >= mark; }

  // cudaStreamWaitEvent: what is enqueued here from now on runs after `other` passed `mark`.
  void wait_for(HostStream& other, uint64_t mark) {
    enqueue([&other, mark, name = other.name_] {
      wait_until([&] { return other.passed(mark); }, [&] { return "an event of " + name; });
    });
  }

  // Waits until everything enqueued so far ran; a TestFailure when anything failed on any stream.
  void synchronize() {
    const uint64_t mark = record();
    const auto deadline = Clock::now() + kWaitTimeout + std::chrono::seconds(5);
    while (!passed(mark)) {
      if (Clock::now() > deadline) throw TestFailure(name_ + " did not finish");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (g_fault_raised.load(std::memory_order_acquire)) throw TestFailure(take_fault());
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> operation;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        operation = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!g_fault_raised.load(std::memory_order_acquire)) {
        try {
          operation();
        } catch (const StreamAborted&) {
        } catch (const std::exception& error) {
          raise_fault(name_ + ": " + error.what());
        }
      }
      completed_.fetch_add(1, std::memory_order_release);
    }
  }

  std::string name_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  bool stopping_ = false;
  std::atomic<uint64_t> completed_{0};
  std::thread thread_;
};

// Holds `stream` until the test opens `gate`: a peer or a previous use that has not got there yet.
void hold_at(std::atomic<bool>& gate, HostStream& stream) {
  stream.enqueue([&gate] {
    wait_until([&] { return gate.load(std::memory_order_acquire); }, [] { return std::string("the gate"); });
  });
}

void synchronize(std::initializer_list<HostStream*> streams) {
  for (HostStream* stream : streams) stream->synchronize();
}

// Device memory of the host device. Every allocation lives until the case ends, so a late access is
// reported by the flags below instead of being undefined.
struct Allocation {
  uint64_t id;
  size_t bytes;
  unsigned char* data;
  std::atomic<int> mappings{0};       // opened by the sender and not closed
  std::atomic<bool> released{false};  // given back: the receiver's allocator may hand it to anyone now
  std::atomic<bool> freed{false};
};

constexpr unsigned char kPoison = 0xDD;  // what given-back memory holds: someone else's data

// Allocation, export and mapping by IPC handle, as the CUDA runtime provides them, on host memory.
class HostDevice {
 public:
  HostDevice() = default;
  HostDevice(const HostDevice&) = delete;
  HostDevice& operator=(const HostDevice&) = delete;
  ~HostDevice() {
    for (const auto& allocation : allocations_) std::free(allocation->data);
  }

  // Zero-filled, 64-byte aligned.
  Allocation& allocate(size_t bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    auto* data = static_cast<unsigned char*>(std::aligned_alloc(64, rounded));
    if (data == nullptr) throw std::bad_alloc();
    std::memset(data, 0, rounded);
    allocations_.push_back(std::make_unique<Allocation>());
    Allocation& allocation = *allocations_.back();
    allocation.id = next_id_++;
    allocation.bytes = bytes;
    allocation.data = data;
    return allocation;
  }

  // The receiver's flags: one std::atomic<uint32_t> at every counter the layout names.
  Allocation& allocate_flags(uint32_t num_slots) {
    const ipc::FlagsLayout layout(num_slots);
    Allocation& flags = allocate(layout.bytes());
    for (uint32_t slot = 0; slot < num_slots; ++slot) {
      new (flags.data + layout.ready(slot)) std::atomic<uint32_t>(0);
      new (flags.data + layout.ack(slot)) std::atomic<uint32_t>(0);
    }
    new (flags.data + layout.posted()) std::atomic<uint32_t>(0);
    return flags;
  }

  ipc::IpcHandle handle_of(const Allocation& allocation) const {
    ipc::IpcHandle handle{};
    std::memcpy(handle.data(), kHandleTag, sizeof(kHandleTag));
    std::memcpy(handle.data() + sizeof(kHandleTag), &allocation.id, sizeof(allocation.id));
    return handle;
  }

  // cudaIpcGetMemHandle of the allocation holding `pointer`, and pointer's offset there.
  bool export_pointer(const void* pointer, ipc::IpcHandle* handle, size_t* offset) const {
    const auto* address = static_cast<const unsigned char*>(pointer);
    for (const auto& allocation : allocations_) {
      if (address >= allocation->data && address < allocation->data + allocation->bytes && !allocation->freed) {
        *handle = handle_of(*allocation);
        *offset = static_cast<size_t>(address - allocation->data);
        return true;
      }
    }
    return false;
  }

  // cudaIpcOpenMemHandle: nullptr for a handle that names no live allocation, or one marked unmappable.
  Allocation* open(const ipc::IpcHandle& handle) {
    if (std::memcmp(handle.data(), kHandleTag, sizeof(kHandleTag)) != 0) return nullptr;
    uint64_t id = 0;
    std::memcpy(&id, handle.data() + sizeof(kHandleTag), sizeof(id));
    for (const auto& allocation : allocations_) {
      if (allocation->id == id && !allocation->freed && allocation->id != unmappable_) {
        allocation->mappings.fetch_add(1, std::memory_order_acq_rel);
        return allocation.get();
      }
    }
    return nullptr;
  }
  void close(Allocation& allocation) { allocation.mappings.fetch_sub(1, std::memory_order_acq_rel); }
  void refuse_mapping(const Allocation& allocation) { unmappable_ = allocation.id; }

  // A caching allocator hands given-back memory to its next user, who writes it: poison.
  void release(Allocation& allocation) {
    allocation.released.store(true, std::memory_order_release);
    std::memset(allocation.data, kPoison, allocation.bytes);
  }

  // cudaFree: undefined behaviour while another process still maps the memory.
  void free(Allocation& allocation) {
    CHECK_MSG(allocation.mappings.load(std::memory_order_acquire) == 0,
              "allocation " + std::to_string(allocation.id) + " freed while the sender still maps it");
    allocation.freed.store(true, std::memory_order_release);
  }

 private:
  static constexpr char kHandleTag[8] = {'h', 'o', 's', 't', '-', 'i', 'p', 'c'};
  std::vector<std::unique_ptr<Allocation>> allocations_;
  uint64_t next_id_ = 1;
  uint64_t unmappable_ = 0;
};

std::atomic<uint32_t>& counter_at(Allocation& flags, const ipc::CounterValue& counter) {
  return *std::launder(reinterpret_cast<std::atomic<uint32_t>*>(flags.data + counter.offset));
}

// A device memory wait's test: an acquire load, compared wrap-safely.
bool counter_reached(Allocation& flags, const ipc::CounterValue& counter) {
  return ipc::counter_reached(counter_at(flags, counter).load(std::memory_order_acquire), counter.value);
}

// A device memory write: a release store, everything before it visible first. Every counter only rises;
// one that would fall means two writes landed out of order.
void write_counter(Allocation& flags, const ipc::CounterValue& counter, const std::string& what) {
  const uint32_t before = counter_at(flags, counter).exchange(counter.value, std::memory_order_release);
  if (!ipc::counter_reached(counter.value, before)) {
    throw TestFailure(what + ": " + counter.name + " fell from " + std::to_string(before) + " to " +
                      std::to_string(counter.value));
  }
}

// Enqueues `step` on `stream` the way ipc_ring.cpp does on a GPU: the owed write, the waits, one copy per
// region between its local buffer and target + offset + slot_offset, the signal.
void enqueue_step(HostStream& stream, const ipc::Step& step, Allocation& flags, Allocation* target, size_t offset,
                  std::string what) {
  // The regions are copied now, as cudaMemcpyAsync's arguments are: the caller's array may go.
  std::vector<CopyRegion> regions(step.regions, step.regions + step.region_count);
  ipc::Step queued = step;
  queued.regions = nullptr;
  stream.enqueue([&flags, target, offset, queued, regions = std::move(regions), what = std::move(what)] {
    if (queued.owed_write) write_counter(flags, *queued.owed_write, what);
    for (int w = 0; w < queued.wait_count; ++w) {
      const ipc::CounterValue& wait = queued.waits[w];
      wait_until([&] { return counter_reached(flags, wait); },
                 [&] { return what + ": " + wait.name + " >= " + std::to_string(wait.value); });
    }
    for (const CopyRegion& region : regions) {
      if (region.bytes == 0) continue;
      if (target->released.load(std::memory_order_acquire) || target->freed.load(std::memory_order_acquire)) {
        throw TestFailure(what + ": copies " + (queued.into_target ? "into" : "out of") + " memory given back");
      }
      if (queued.into_target && target->mappings.load(std::memory_order_acquire) == 0) {
        throw TestFailure(what + ": copies into memory the sender unmapped");
      }
      if (offset + region.slot_offset + region.bytes > target->bytes) {
        throw TestFailure(what + ": a region ends past its allocation");
      }
      unsigned char* in_target = target->data + offset + region.slot_offset;
      if (queued.into_target) {
        std::memcpy(in_target, region.local, region.bytes);
      } else {
        std::memcpy(region.local, in_target, region.bytes);
      }
    }
    if (queued.signal) write_counter(flags, *queued.signal, what);
  });
}

void enqueue_write(HostStream& stream, Allocation& flags, const ipc::CounterValue& counter, std::string what) {
  stream.enqueue([&flags, counter, what = std::move(what)] { write_counter(flags, counter, what); });
}

// ---- the two ends over the host device (what ipc_ring.cpp does over CUDA) -----------------------------

// The stream of each reader or writer of something, and how far it was enqueued when that was given back.
using StreamMarks = std::vector<std::pair<HostStream*, uint64_t>>;

StreamMarks marks_of(const std::vector<ipc::StreamId>& streams) {
  StreamMarks marks;
  for (ipc::StreamId id : streams) marks.emplace_back(&HostStream::of(id), HostStream::of(id).record());
  return marks;
}

bool all_passed(const StreamMarks& marks) {
  return std::all_of(marks.begin(), marks.end(), [](const auto& mark) { return mark.first->passed(mark.second); });
}

class HostReceiver {
 public:
  HostReceiver(HostDevice& device, uint32_t num_slots, size_t slot_bytes)
      : device_(device), protocol_(num_slots, kPrefix), flags_(device.allocate_flags(num_slots)) {
    add_generation(protocol_.plan_generation(slot_bytes, 0));
  }

  std::string export_handles() const { return serialize(protocol_.generations().latest()); }

  std::string resize(size_t slot_bytes, uint64_t first_seq) {
    const ipc::NewGeneration generation = protocol_.plan_generation(slot_bytes, first_seq);
    add_generation(generation);
    return serialize(*protocol_.generations().find(generation.number));
  }

  std::string grow(size_t min_slot_bytes, uint64_t first_seq) {
    return resize(protocol_.grown_slot_bytes(min_slot_bytes, first_seq), first_seq);
  }

  void enqueue_receive(uint64_t seq, const std::vector<CopyRegion>& regions, HostStream& stream) {
    enqueue(protocol_.plan_receive(seq, regions.data(), regions.size(), stream.id()));
  }

  void enqueue_receive_direct(uint64_t seq, HostStream& stream) {
    enqueue(protocol_.plan_receive_direct(seq, stream.id()));
  }

  void enqueue_post(uint64_t post, HostStream& stream) {
    const ipc::PostPlan plan = protocol_.plan_post(post, stream.id());
    if (plan.owed_write) write_post(*plan.owed_write);
    if (plan.fence) {
      HostStream& before = HostStream::of(plan.fence->before);
      HostStream::of(plan.fence->waiter).wait_for(before, before.record());
    }
    protocol_.posted(plan);
  }

  uint64_t posts_ordered_before(HostStream& stream) const { return protocol_.posts_ordered_before(stream.id()); }

  // What a caching allocator does before reusing memory: given-back generations whose readers passed
  // go to their next user.
  void release_passed_generations() {
    for (auto it = given_back_.begin(); it != given_back_.end();) {
      if (!all_passed(it->readers)) {
        ++it;
        continue;
      }
      device_.release(*it->block);
      released_.push_back(it->generation);
      it = given_back_.erase(it);
    }
  }

  // The destructor's part once the device is idle: a failure if the sender still maps anything.
  void free_all() {
    release_passed_generations();
    CHECK_MSG(given_back_.empty(), "a given-back generation's readers never passed");
    for (const GenerationMemory& memory : memory_) device_.free(*memory.block);
    device_.free(flags_);
  }

  const ipc::ReceiverProtocol& protocol() const { return protocol_; }
  const std::vector<uint32_t>& released_generations() const { return released_; }
  Allocation& flags() { return flags_; }

 private:
  struct GenerationMemory {
    uint32_t generation;
    Allocation* block;
  };
  struct GivenBack {
    uint32_t generation;
    Allocation* block;
    StreamMarks readers;
  };

  void add_generation(const ipc::NewGeneration& generation) {
    memory_.push_back({generation.number, &device_.allocate(generation.total_bytes)});
    protocol_.add_generation(generation);
  }

  Allocation* block_of(uint32_t generation) const {
    for (const GenerationMemory& memory : memory_) {
      if (memory.generation == generation) return memory.block;
    }
    throw TestFailure("generation " + std::to_string(generation) + " has no memory");
  }

  std::string serialize(const ipc::Generation& generation) const {
    ipc::HandleBlob blob;
    blob.info = {"host:00.0", 4242, protocol_.num_slots(), generation.slot_bytes, generation.number,
                 generation.first_seq};
    blob.flags_handle = device_.handle_of(flags_);
    blob.data_handle = device_.handle_of(*block_of(generation.number));
    return ipc::serialize_handle_blob(blob);
  }

  void write_post(const ipc::PostWrite& write) {
    enqueue_write(HostStream::of(write.stream), flags_, write.counter, "post " + std::to_string(write.post));
  }

  void enqueue(const ipc::ReceivePlan& plan) {
    if (plan.post_write_before) write_post(*plan.post_write_before);
    Allocation* slot = plan.direct ? nullptr : block_of(plan.step.target.generation);
    enqueue_step(HostStream::of(plan.stream), plan.step, flags_, slot, plan.step.target.offset, plan.describe());
    protocol_.received(plan);
    if (protocol_.generations().size() > 1) {
      for (const ipc::Generation& generation : protocol_.take_unreachable_generations()) {
        given_back_.push_back({generation.number, block_of(generation.number), marks_of(generation.streams)});
        memory_.erase(std::find_if(memory_.begin(), memory_.end(), [&](const GenerationMemory& memory) {
          return memory.generation == generation.number;
        }));
      }
    }
    release_passed_generations();
  }

  HostDevice& device_;
  ipc::ReceiverProtocol protocol_;
  Allocation& flags_;
  std::vector<GenerationMemory> memory_;
  std::vector<GivenBack> given_back_;
  std::vector<uint32_t> released_;
};

// A buffer the receiver offered for one message, as the sender learns it out of band.
struct PostOffer {
  uint64_t seq;
  uint64_t post;
  ipc::IpcHandle handle;
  size_t offset;
  size_t capacity;
};

class HostSender {
 public:
  HostSender(HostDevice& device, const std::string& receiver_handles)
      : device_(device), protocol_(receiver_handles, kPrefix), flags_(device.open(protocol_.receiver().flags_handle)) {
    CHECK_MSG(flags_ != nullptr, "the receiver's flags cannot be mapped");
    map_generation(protocol_.receiver());
  }

  void update(const std::string& handles) {
    if (const std::optional<ipc::HandleBlob> blob = protocol_.new_generation(handles)) map_generation(*blob);
  }

  void enqueue_send(uint64_t seq, const std::vector<CopyRegion>& regions, HostStream& stream) {
    const ipc::SendPlan plan = protocol_.plan_send(seq, regions.data(), regions.size(), stream.id());
    enqueue_step(stream, plan.step, *flags_, mapping_of(plan.step.target.generation), plan.step.target.offset,
                 plan.describe());
    finish(plan);
  }

  bool enqueue_send_direct(uint64_t seq, const PostOffer& offer, const std::vector<CopyRegion>& regions,
                           HostStream& stream, bool posted_passed) {
    const ipc::SendPlan plan = protocol_.plan_send_direct(seq, offer.post, offer.offset, offer.capacity,
                                                          regions.data(), regions.size(), stream.id(), posted_passed);
    PeerAllocation* allocation = map_peer_allocation(offer.handle);
    if (allocation == nullptr) return false;
    ipc::remember_stream(allocation->streams, stream.id());
    enqueue_step(stream, plan.step, *flags_, allocation->block, plan.step.target.offset, plan.describe());
    finish(plan);
    return true;
  }

  void enqueue_wait_consumed(uint64_t seq, HostStream& stream) {
    const ipc::CounterValue ack = protocol_.consumed(seq);
    Allocation& flags = *flags_;
    stream.enqueue([&flags, ack, seq] {
      wait_until([&] { return counter_reached(flags, ack); }, [&] { return "ack of message " + std::to_string(seq); });
    });
  }

  // unmap_when_done(): closes every mapping once every send enqueued so far has run, waiting up to
  // `patience` for that.
  bool unmap_when_done(std::chrono::milliseconds patience) {
    const StreamMarks sends = marks_of(protocol_.send_streams());
    const auto deadline = Clock::now() + patience;
    while (!all_passed(sends)) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    unmap_retired(/*all=*/true);
    for (const MappedGeneration& generation : generations_) device_.close(*generation.block);
    for (const PeerAllocation& allocation : peer_allocations_) device_.close(*allocation.block);
    device_.close(*flags_);
    generations_.clear();
    peer_allocations_.clear();
    return true;
  }

  const ipc::SenderProtocol& protocol() const { return protocol_; }
  const std::vector<uint32_t>& unmapped_generations() const { return unmapped_; }

 private:
  struct MappedGeneration {
    uint32_t generation;
    Allocation* block;
  };
  struct PeerAllocation {
    ipc::IpcHandle handle;
    Allocation* block;
    std::vector<ipc::StreamId> streams;
  };
  struct Retired {
    uint32_t generation;
    Allocation* block;
    StreamMarks writers;
  };

  void map_generation(const ipc::HandleBlob& blob) {
    Allocation* block = device_.open(blob.data_handle);
    CHECK_MSG(block != nullptr, "generation " + std::to_string(blob.info.generation) + " cannot be mapped");
    generations_.push_back({blob.info.generation, block});
    protocol_.add_generation(blob.info);
  }

  Allocation* mapping_of(uint32_t generation) const {
    for (const MappedGeneration& mapped : generations_) {
      if (mapped.generation == generation) return mapped.block;
    }
    throw TestFailure("the sender has generation " + std::to_string(generation) + " unmapped");
  }

  PeerAllocation* map_peer_allocation(const ipc::IpcHandle& handle) {
    for (PeerAllocation& allocation : peer_allocations_) {
      if (allocation.handle == handle) return &allocation;
    }
    Allocation* block = device_.open(handle);
    if (block == nullptr) return nullptr;
    peer_allocations_.push_back({handle, block, {}});
    return &peer_allocations_.back();
  }

  void finish(const ipc::SendPlan& plan) {
    protocol_.sent(plan);
    if (protocol_.generations().size() > 1) {
      for (const ipc::Generation& generation : protocol_.take_unreachable_generations()) {
        retired_.push_back({generation.number, mapping_of(generation.number), marks_of(generation.streams)});
        generations_.erase(std::find_if(generations_.begin(), generations_.end(), [&](const MappedGeneration& m) {
          return m.generation == generation.number;
        }));
      }
      unmap_retired(/*all=*/false);
    }
  }

  // Unmaps retired generations whose writers passed the point they were retired at (all: unconditionally,
  // once the caller knows every send is done).
  void unmap_retired(bool all) {
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (!all && !all_passed(it->writers)) {
        ++it;
        continue;
      }
      device_.close(*it->block);
      unmapped_.push_back(it->generation);
      it = retired_.erase(it);
    }
  }

  HostDevice& device_;
  ipc::SenderProtocol protocol_;
  Allocation* flags_;
  std::vector<MappedGeneration> generations_;
  std::vector<PeerAllocation> peer_allocations_;
  std::vector<Retired> retired_;
  std::vector<uint32_t> unmapped_;
};

// ---- messages ----------------------------------------------------------------------------------------

unsigned char pattern_byte(uint64_t seq, size_t region, size_t index) {
  return static_cast<unsigned char>(splitmix(seq * 1000003 + region * 7919 + index / 8) >> (8 * (index % 8)));
}

// One message: where its regions lie in the slot (or posted buffer), its sources filled with its pattern,
// and the receiver's destinations for the slot path.
struct TestMessage {
  uint64_t seq = 0;
  std::vector<std::vector<unsigned char>> sources;
  std::vector<std::vector<unsigned char>> destinations;
  std::vector<CopyRegion> send_regions;
  std::vector<CopyRegion> receive_regions;

  size_t needed_bytes() const {
    size_t end = 0;
    for (const CopyRegion& region : send_regions) end = std::max(end, region.slot_offset + region.bytes);
    return end;
  }
};

// layout: (slot_offset, bytes) per region.
TestMessage make_message(uint64_t seq, const std::vector<std::pair<size_t, size_t>>& layout) {
  TestMessage message;
  message.seq = seq;
  for (size_t r = 0; r < layout.size(); ++r) {
    std::vector<unsigned char> source(layout[r].second);
    for (size_t i = 0; i < source.size(); ++i) source[i] = pattern_byte(seq, r, i);
    message.sources.push_back(std::move(source));
    message.destinations.emplace_back(layout[r].second, 0);
  }
  for (size_t r = 0; r < layout.size(); ++r) {
    message.send_regions.push_back({message.sources[r].data(), layout[r].first, layout[r].second});
    message.receive_regions.push_back({message.destinations[r].data(), layout[r].first, layout[r].second});
  }
  return message;
}

// Regions at 16-byte aligned offsets, as pack() lays tensors out, of random sizes up to max_bytes in all.
std::vector<std::pair<size_t, size_t>> random_layout(Rng& rng, size_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> layout;
  const size_t regions = rng.below(4);
  size_t offset = 0;
  for (size_t r = 0; r < regions && offset < max_bytes; ++r) {
    const size_t bytes = rng.below(4) == 0 ? 0 : 1 + rng.below((max_bytes - offset) / (regions - r));
    layout.emplace_back(offset, bytes);
    offset = (offset + bytes + 15) / 16 * 16;
  }
  return layout;
}

// Checks that `bytes` at `data` hold region `region` of message seq.
void check_region(uint64_t seq, size_t region, const unsigned char* data, size_t bytes, const char* where) {
  for (size_t i = 0; i < bytes; ++i) {
    if (data[i] != pattern_byte(seq, region, i)) {
      throw TestFailure("message " + std::to_string(seq) + " region " + std::to_string(region) + " byte " +
                        std::to_string(i) + " (" + where + "): got " + std::to_string(data[i]) + ", sent " +
                        std::to_string(pattern_byte(seq, region, i)));
    }
  }
}

void check_received(const TestMessage& message) {
  for (size_t r = 0; r < message.destinations.size(); ++r) {
    check_region(message.seq, r, message.destinations[r].data(), message.destinations[r].size(), "by slot");
  }
}

// Checks a direct message where the sender wrote it: in the posted buffer at `buffer`.
void check_received_in(const TestMessage& message, const unsigned char* buffer) {
  for (size_t r = 0; r < message.send_regions.size(); ++r) {
    check_region(message.seq, r, buffer + message.send_regions[r].slot_offset, message.send_regions[r].bytes,
                 "in the posted buffer");
  }
}

// Offers `capacity` bytes at `buffer` (in an exported allocation) for message seq as post `post` on
// `stream`: the buffer's previous contents are written there first, so the sender must order its copy
// after the post.
PostOffer offer_buffer(HostDevice& device, HostReceiver& receiver, unsigned char* buffer, size_t capacity,
                       uint64_t seq, uint64_t post, HostStream& stream) {
  PostOffer offer{seq, post, {}, 0, capacity};
  CHECK(device.export_pointer(buffer, &offer.handle, &offer.offset));
  stream.enqueue([buffer, capacity] { std::memset(buffer, 0xEE, capacity); });
  receiver.enqueue_post(post, stream);
  return offer;
}

// ---- cases ---------------------------------------------------------------------------------------------

// Slot and round numbering, the wrap-safe compare and the flags layout.
void test_numbering() {
  const ipc::SlotPosition third = ipc::slot_position(7, 3);
  CHECK(third.slot == 1 && third.round == 3);
  CHECK(ipc::slot_position(0, 3).slot == 0 && ipc::slot_position(0, 3).round == 1);
  CHECK(ipc::slot_position(2, 3).round == 1 && ipc::slot_position(3, 3).round == 2);
  CHECK(ipc::describe_message(7, 3) == "message 7, slot 1, round 3");

  // Rounds are uint32: with one slot, message 2^32 - 1 wraps its round to 0. Consecutive messages of a
  // slot still compare in order across the wrap, which is what every wait relies on.
  constexpr uint64_t kLastRound = uint64_t{0xFFFFFFFF};
  CHECK(ipc::slot_position(kLastRound - 1, 1).round == 0xFFFFFFFFu);
  CHECK(ipc::slot_position(kLastRound, 1).round == 0);
  CHECK(ipc::slot_position(kLastRound + 1, 1).round == 1);
  CHECK(ipc::slot_position(5 * kLastRound + 2, 5).round == 0);  // round 2^32 of slot 2 of five
  for (uint64_t seq = kLastRound - 3; seq < kLastRound + 3; ++seq) {
    const uint32_t round = ipc::slot_position(seq, 1).round;
    const uint32_t previous = ipc::slot_position(seq - 1, 1).round;
    CHECK_MSG(ipc::counter_reached(round, previous) && !ipc::counter_reached(previous, round),
              "message " + std::to_string(seq));
    // A send waits ready >= round - 1: met by the previous message's write, not by the one before it.
    CHECK(ipc::counter_reached(previous, round - 1));
    CHECK(!ipc::counter_reached(ipc::slot_position(seq - 2, 1).round, round - 1));
  }
  CHECK(ipc::counter_reached(5, 5) && ipc::counter_reached(6, 5) && !ipc::counter_reached(4, 5));
  CHECK(ipc::counter_reached(0, 0xFFFFFFFFu) && !ipc::counter_reached(0xFFFFFFFFu, 0));
  CHECK(ipc::counter_reached(0x7FFFFFFFu, 0) && !ipc::counter_reached(0x80000000u, 0));

  const ipc::FlagsLayout layout(4);
  CHECK(layout.ready(0) == 0 && layout.ready(3) == 192);
  CHECK(layout.ack(0) == 256 && layout.ack(3) == 448);
  CHECK(layout.posted() == 512 && layout.bytes() == 576);

  CHECK(round_slot_bytes(0, kPrefix) == 256 && round_slot_bytes(1, kPrefix) == 256);
  CHECK(round_slot_bytes(256, kPrefix) == 256 && round_slot_bytes(257, kPrefix) == 512);
  expect_protocol_error([] { round_slot_bytes(SIZE_MAX - 3, kPrefix); }, "overflows", "slot size overflow");
  expect_protocol_error([] { ipc::ReceiverProtocol(0, kPrefix); }, "num_slots must be in [1, 65536], got 0",
                        "no slots");
  expect_protocol_error([] { ipc::ReceiverProtocol(ipc::kMaxSlots + 1, kPrefix); }, "got 65537", "too many slots");
  const ipc::ReceiverProtocol receiver(ipc::kMaxSlots, kPrefix);
  expect_protocol_error([&] { receiver.plan_generation(SIZE_MAX / 1024, 0); }, "65536 slots of", "generation overflow");
}

template <typename T>
T field_at(const std::string& blob, size_t offset) {
  T value;
  std::memcpy(&value, blob.data() + offset, sizeof(T));
  return value;
}

// The blob format, byte for byte as version 3 defined it, and the checks on reading one.
void test_handle_blob() {
  ipc::HandleBlob blob;
  blob.info = {"0000:1B:00.0", 31337, 5, 1 << 20, 7, 123456789012ull};
  for (size_t i = 0; i < blob.flags_handle.size(); ++i) {
    blob.flags_handle[i] = static_cast<unsigned char>(i + 1);
    blob.data_handle[i] = static_cast<unsigned char>(200 - i);
  }
  blob.data_offset = 0x1234500;
  const std::string bytes = ipc::serialize_handle_blob(blob);
  CHECK(bytes.size() == 208);
  CHECK(field_at<uint32_t>(bytes, 0) == 0x52435049 && field_at<uint32_t>(bytes, 4) == 3);
  CHECK(std::string(bytes.data() + 8) == "0000:1B:00.0");
  CHECK(field_at<int32_t>(bytes, 40) == 31337 && field_at<uint32_t>(bytes, 44) == 5);
  CHECK(field_at<uint64_t>(bytes, 48) == (1 << 20) && field_at<uint32_t>(bytes, 56) == 7);
  CHECK(field_at<uint32_t>(bytes, 60) == 0 && field_at<uint64_t>(bytes, 64) == 123456789012ull);
  CHECK(std::memcmp(bytes.data() + 72, blob.flags_handle.data(), 64) == 0);
  CHECK(std::memcmp(bytes.data() + 136, blob.data_handle.data(), 64) == 0);
  CHECK(field_at<uint64_t>(bytes, 200) == 0x1234500);

  const ipc::HandleBlob read = ipc::read_handle_blob(bytes);
  CHECK(read.info.pci_bus_id == "0000:1B:00.0" && read.info.owner_pid == 31337 && read.info.num_slots == 5);
  CHECK(read.info.slot_bytes == (1 << 20) && read.info.generation == 7 && read.info.first_seq == 123456789012ull);
  CHECK(read.flags_handle == blob.flags_handle && read.data_handle == blob.data_handle);
  CHECK(read.data_offset == 0x1234500);
  CHECK(parse_ipc_ring_handles(bytes).first_seq == 123456789012ull);

  ipc::HandleBlob long_bus = blob;
  long_bus.info.pci_bus_id = std::string(40, 'b');
  CHECK(ipc::read_handle_blob(ipc::serialize_handle_blob(long_bus)).info.pci_bus_id == std::string(31, 'b'));

  const auto corrupted = [&](size_t offset, auto value) {
    std::string copy = bytes;
    std::memcpy(&copy[offset], &value, sizeof(value));
    return copy;
  };
  expect_protocol_error([] { ipc::read_handle_blob("not a handle blob"); }, "not an ipc ring handle blob", "garbage");
  expect_protocol_error([&] { ipc::read_handle_blob(bytes.substr(0, 207)); }, "207 bytes, expected 208", "short");
  expect_protocol_error([&] { ipc::read_handle_blob(bytes + "x"); }, "209 bytes", "long");
  expect_protocol_error([&] { ipc::read_handle_blob(corrupted(0, uint32_t{0x52435048})); }, "with magic", "magic");
  expect_protocol_error([&] { parse_ipc_ring_handles(corrupted(4, uint32_t{2})); }, "format version 2", "version");
  expect_protocol_error([&] { ipc::read_handle_blob(corrupted(44, uint32_t{0})); }, "corrupt", "no slots");
  expect_protocol_error([&] { ipc::read_handle_blob(corrupted(44, uint32_t{70000})); }, "num_slots 70000", "slots");
  expect_protocol_error([&] { ipc::read_handle_blob(corrupted(48, uint64_t{0})); }, "slot_bytes 0", "empty slots");
  expect_protocol_error([&] { ipc::read_handle_blob(corrupted(8, char{0})); }, "corrupt", "no bus id");

  // The sender takes blobs of its own receiver only, each generation once, and none for a message sent.
  expect_protocol_error([] { ipc::SenderProtocol("garbage", kPrefix); },
                        std::string(kPrefix) + ": receiver handles: pipecomm ipc ring: not an ipc ring handle blob",
                        "sender from garbage");
  ipc::SenderProtocol sender(bytes, kPrefix);
  sender.add_generation(sender.receiver().info);
  CHECK(!sender.new_generation(bytes).has_value());
  expect_protocol_error([&] { sender.new_generation("garbage"); }, std::string(kPrefix) + ": update: pipecomm ipc ring",
                        "update from garbage");
  ipc::HandleBlob other = blob;
  other.info.generation = 8;
  CHECK(sender.new_generation(ipc::serialize_handle_blob(other)).has_value());
  for (int field = 0; field < 4; ++field) {
    ipc::HandleBlob foreign = other;
    if (field == 0) foreign.info.owner_pid = 1;
    if (field == 1) foreign.info.pci_bus_id = "0000:2B:00.0";
    if (field == 2) foreign.info.num_slots = 4;
    if (field == 3) foreign.flags_handle[10] ^= 0x5A;
    expect_protocol_error([&] { sender.new_generation(ipc::serialize_handle_blob(foreign)); }, "another receiver",
                          "foreign blob");
  }
}

// The wait rules, plan by plan: what each send waits for after slot-path and direct messages on one or
// two streams, and where the receiver's owed post write goes; then the same messages run, data checked.
void test_wait_rules() {
  HostDevice device;
  HostStream sender_a("sender stream a");
  HostStream sender_b("sender stream b");
  HostStream receiver_stream("receiver stream");
  HostStream post_stream("post stream");
  HostReceiver receiver(device, 2, 4096);
  HostSender sender(device, receiver.export_handles());
  Allocation& pool = device.allocate(1 << 16);
  const ipc::FlagsLayout flags(2);

  const ipc::SenderProtocol& plans = sender.protocol();
  using Waits = std::vector<std::pair<size_t, uint32_t>>;  // (counter offset, value) per wait
  // A send's waits, checked with what every send does: write ready[slot] = round.
  const auto waits_of = [&](const ipc::SendPlan& plan) {
    CHECK(plan.step.signal && plan.step.signal->offset == flags.ready(plan.seq % 2) &&
          plan.step.signal->value == plan.seq / 2 + 1);
    Waits waits;
    for (int w = 0; w < plan.step.wait_count; ++w) {
      waits.emplace_back(plan.step.waits[w].offset, plan.step.waits[w].value);
    }
    return waits;
  };
  std::deque<TestMessage> messages;
  std::vector<std::pair<const TestMessage*, unsigned char*>> direct;
  uint64_t next_post = 0;
  // Message by message: its path, the sender's stream, whether the posted write is known passed, and
  // what the send must wait for.
  struct Expected {
    bool direct;
    HostStream* stream;
    bool posted_passed;
    Waits waits;
  };
  const std::vector<Expected> expected = {
      {false, &sender_a, false, {}},                                            // 0: slot 0, round 1
      {true, &sender_a, false, {{flags.posted(), 1}}},                          // 1: slot 1, round 1
      {false, &sender_a, false, {{flags.ack(0), 1}}},                           // 2: the ack covers order
      {false, &sender_b, false, {{flags.ready(1), 1}}},                         // 3: after direct 1 on a
      {true, &sender_a, false, {{flags.posted(), 2}}},                          // 4: same stream as 2
      {true, &sender_a, true, {{flags.ready(1), 2}}},                           // 5: after 3 on b, posted known
      {false, &sender_a, false, {{flags.ack(0), 2}}},                           // 6: last slot-path 2, then 4 on a
      {false, &sender_b, false, {{flags.ack(1), 2}, {flags.ready(1), 3}}},      // 7: ack of 3, ready of 5
  };
  for (uint64_t seq = 0; seq < expected.size(); ++seq) {
    const Expected& message_plan = expected[seq];
    messages.push_back(make_message(seq, {{0, 100 + seq}, {512, 33}}));
    const TestMessage& message = messages.back();
    if (message_plan.direct) {
      unsigned char* buffer = pool.data + 4096 * seq;
      const PostOffer offer = offer_buffer(device, receiver, buffer, 1024, seq, next_post++, post_stream);
      const ipc::SendPlan plan = plans.plan_send_direct(seq, offer.post, offer.offset, offer.capacity,
                                                        message.send_regions.data(), message.send_regions.size(),
                                                        message_plan.stream->id(), message_plan.posted_passed);
      CHECK_MSG(waits_of(plan) == message_plan.waits, "direct send of message " + std::to_string(seq));
      CHECK(plan.step.target.kind == ipc::CopyTarget::Kind::posted_buffer && plan.step.target.offset == offer.offset);
      // posted_passed: the caller knows its stream follows the buffer's previous use (a channel learns
      // it from the peer's messages; here the host waited for the posting stream).
      if (message_plan.posted_passed) post_stream.synchronize();
      CHECK(sender.enqueue_send_direct(seq, offer, message.send_regions, *message_plan.stream,
                                       message_plan.posted_passed));
      direct.emplace_back(&message, buffer);
    } else {
      const ipc::SendPlan plan = plans.plan_send(seq, message.send_regions.data(), message.send_regions.size(),
                                                 message_plan.stream->id());
      CHECK_MSG(waits_of(plan) == message_plan.waits, "slot send of message " + std::to_string(seq));
      CHECK(plan.step.target.kind == ipc::CopyTarget::Kind::slot && plan.step.target.offset == (seq % 2) * 4096);
      sender.enqueue_send(seq, message.send_regions, *message_plan.stream);
    }

    // The receive: its wait, and the post write it owes. A post's write goes with the next receive on
    // the post's stream; a receive elsewhere first writes it alone there.
    const bool on_post_stream = seq % 3 == 1;
    HostStream& stream = on_post_stream ? post_stream : receiver_stream;
    const ipc::ReceivePlan plan =
        message_plan.direct ? receiver.protocol().plan_receive_direct(seq, stream.id())
                            : receiver.protocol().plan_receive(seq, message.receive_regions.data(),
                                                               message.receive_regions.size(), stream.id());
    CHECK(plan.step.wait_count == 1 && plan.step.waits[0].offset == flags.ready(seq % 2) &&
          plan.step.waits[0].value == seq / 2 + 1);
    CHECK(plan.step.signal.has_value() == !message_plan.direct);
    // Each direct message follows a post whose write is still owed, not yet counted.
    const bool owes = message_plan.direct;
    CHECK(receiver.posts_ordered_before(post_stream) == (owes ? next_post - 1 : next_post));
    CHECK_MSG(plan.step.owed_write.has_value() == (owes && on_post_stream), "message " + std::to_string(seq));
    CHECK_MSG(plan.post_write_before.has_value() == (owes && !on_post_stream), "message " + std::to_string(seq));
    if (message_plan.direct) {
      receiver.enqueue_receive_direct(seq, stream);
    } else {
      receiver.enqueue_receive(seq, message.receive_regions, stream);
    }
    CHECK(receiver.posts_ordered_before(post_stream) == next_post);
    CHECK(receiver.posts_ordered_before(sender_a) == 0);
  }
  synchronize({&sender_a, &sender_b, &post_stream, &receiver_stream});
  for (const TestMessage& message : messages) {
    if (!expected[message.seq].direct) check_received(message);
  }
  for (const auto& [message, buffer] : direct) check_received_in(*message, buffer);
  CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
  receiver.free_all();
}

// A steady stream by slot, the sender running ahead: slots wrap around many times, rounds climb.
void test_slot_path() {
  constexpr uint32_t kSlots = 3;
  const uint64_t messages_count = 60 * kScale;
  HostDevice device;
  HostStream send_stream("sender stream");
  HostStream receive_stream("receiver stream");
  HostReceiver receiver(device, kSlots, 4096);
  HostSender sender(device, receiver.export_handles());
  Rng rng(7);
  std::deque<TestMessage> messages;
  for (uint64_t seq = 0; seq < messages_count; ++seq) messages.push_back(make_message(seq, random_layout(rng, 4096)));
  // All sends first: the sender's stream stops at each slot's ack until the receives catch up.
  for (const TestMessage& message : messages) sender.enqueue_send(message.seq, message.send_regions, send_stream);
  for (const TestMessage& message : messages) {
    receiver.enqueue_receive(message.seq, message.receive_regions, receive_stream);
  }
  sender.enqueue_wait_consumed(messages_count - 1, send_stream);
  synchronize({&send_stream, &receive_stream});
  for (const TestMessage& message : messages) check_received(message);
  const ipc::FlagsLayout flags(kSlots);
  for (uint32_t slot = 0; slot < kSlots; ++slot) {
    const uint64_t last_in_slot = messages_count - 1 - (messages_count - 1 - slot) % kSlots;
    const uint32_t last_round = ipc::slot_position(last_in_slot, kSlots).round;
    CHECK(counter_at(receiver.flags(), {flags.ready(slot), 0, ""}).load() == last_round);
    CHECK(counter_at(receiver.flags(), {flags.ack(slot), 0, ""}).load() == last_round);
  }
  expect_protocol_error([&] { sender.enqueue_send(messages_count + 1, {}, send_stream); },
                        "got message seq " + std::to_string(messages_count + 1) + ", expected " +
                            std::to_string(messages_count),
                        "send out of order");
  expect_protocol_error([&] { sender.enqueue_wait_consumed(messages_count, send_stream); }, "not sent yet",
                        "wait for a message not sent");
  std::vector<unsigned char> too_big(4097);
  expect_protocol_error([&] { receiver.enqueue_receive(messages_count, {{too_big.data(), 0, 4097}}, receive_stream); },
                        "region 0: slot_offset 0 + bytes 4097 exceeds slot_bytes 4096 (data generation 0)",
                        "receive larger than the slot");
  expect_protocol_error([&] { sender.enqueue_send(messages_count, {{nullptr, 0, 1}}, send_stream); },
                        "null local pointer for 1 bytes", "null source");
  CHECK(sender.protocol().next_seq() == messages_count && receiver.protocol().next_seq() == messages_count);
  CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
  receiver.free_all();
}

// A shrink made for a later message, then a grow for an earlier one while the shrink waits; each end
// gives a generation back once no message from its next seq on can reach it, and not before.
void test_grow_and_shrink() {
  constexpr uint32_t kSlots = 4;
  constexpr uint64_t kGrowSeq = 3;
  constexpr uint64_t kShrinkSeq = 8;
  constexpr uint64_t kLastSeq = 15;
  constexpr uint64_t kLateSeq = 16;  // empty, sent before its generation reaches the sender
  HostDevice device;
  HostStream send_stream("sender stream");
  HostStream receive_stream("receiver stream");
  HostReceiver receiver(device, kSlots, 4096);
  const std::string initial = receiver.export_handles();
  HostSender sender(device, initial);
  const auto intended = [&](uint64_t seq) { return seq < kGrowSeq ? 4096 : seq < kShrinkSeq ? 65536 : 1024; };
  // The last region ends at the end of the intended slot: a message in a smaller slot is refused.
  const auto message_for = [&](uint64_t seq) {
    if (seq == kLateSeq) return make_message(seq, {});
    const size_t slot = intended(seq);
    const size_t tail = slot / 2 - 8 * (seq % 3);
    return make_message(seq, {{0, slot / 4 + seq}, {slot - tail, tail}});
  };
  std::deque<TestMessage> messages;
  const auto transfer = [&](uint64_t seq) {
    messages.push_back(message_for(seq));
    sender.enqueue_send(seq, messages.back().send_regions, send_stream);
    receiver.enqueue_receive(seq, messages.back().receive_regions, receive_stream);
  };
  const auto expect_receiver = [&](size_t live, uint32_t generation, size_t slot_bytes, const std::string& when) {
    const auto& generations = receiver.protocol().generations();
    CHECK_MSG(generations.size() == live && generations.latest().number == generation &&
                  generations.latest().slot_bytes == slot_bytes,
              when + ": " + std::to_string(generations.size()) + " live, newest " +
                  std::to_string(generations.latest().number));
  };

  for (uint64_t seq = 0; seq < kGrowSeq; ++seq) transfer(seq);
  const std::string shrunk = receiver.resize(1024, kShrinkSeq);
  CHECK(parse_ipc_ring_handles(shrunk).generation == 1 && parse_ipc_ring_handles(shrunk).first_seq == kShrinkSeq);
  sender.update(shrunk);
  CHECK(sender.protocol().next_generation().number == 0);  // the shrink starts later

  TestMessage first_grown = message_for(kGrowSeq);
  expect_protocol_error([&] { sender.enqueue_send(kGrowSeq, first_grown.send_regions, send_stream); },
                        "exceeds slot_bytes 4096 (data generation 0)", "message bigger than the initial slots");
  const std::string grown = receiver.grow(65536, kGrowSeq);
  CHECK(parse_ipc_ring_handles(grown).generation == 2 && parse_ipc_ring_handles(grown).slot_bytes == 65536);
  expect_receiver(3, 1, 1024, "after the grow");
  sender.update(grown);
  CHECK(sender.protocol().next_generation().number == 2);

  // Generation 0's messages were all enqueued; it goes back once message 3, in generation 2, is.
  CHECK(receiver.released_generations().empty() && sender.unmapped_generations().empty());
  for (uint64_t seq = kGrowSeq; seq <= kLastSeq; ++seq) {
    if (seq == kShrinkSeq) {
      std::vector<unsigned char> source(1025);
      expect_protocol_error([&] { sender.enqueue_send(seq, {{source.data(), 0, 1025}}, send_stream); },
                            "exceeds slot_bytes 1024 (data generation 1)", "message bigger than the shrunk slots");
    }
    CHECK(sender.protocol().next_generation().number == (seq < kShrinkSeq ? 2u : 1u));
    transfer(seq);
    expect_receiver(seq + 1 < kShrinkSeq ? 2 : 1, 1, 1024, "after message " + std::to_string(seq));
    CHECK(sender.protocol().generations().size() == (seq + 1 < kShrinkSeq ? 2u : 1u));
  }
  synchronize({&send_stream, &receive_stream});
  receiver.release_passed_generations();
  CHECK(receiver.released_generations() == (std::vector<uint32_t>{0, 2}));

  // Blobs seen before are ignored, even of generations already given back.
  sender.update(initial);
  sender.update(grown);
  sender.update(shrunk);
  CHECK(sender.protocol().next_generation().number == 1);

  messages.push_back(message_for(kLateSeq));
  sender.enqueue_send(kLateSeq, messages.back().send_regions, send_stream);
  const std::string late = receiver.resize(2048, kLateSeq);
  expect_protocol_error([&] { sender.update(late); },
                        "starts at message 16, but message 16 was already sent", "update for a message sent");
  receiver.enqueue_receive(kLateSeq, messages.back().receive_regions, receive_stream);
  expect_receiver(1, 3, 2048, "after the late message");
  expect_protocol_error([&] { receiver.resize(4096, 0); }, "cannot start a data generation at message 0: message 16 "
                        "was already received", "resize for message 0");
  expect_protocol_error([&] { receiver.grow(4096, kLateSeq); }, "already received", "grow for a received message");
  expect_protocol_error([&] { receiver.protocol().plan_receive(kLateSeq + 1, nullptr, 1, receive_stream.id()); },
                        "1 regions passed as a null pointer", "null regions");

  synchronize({&send_stream, &receive_stream});
  for (const TestMessage& message : messages) check_received(message);
  CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
  CHECK(sender.unmapped_generations().size() == 2);
  receiver.free_all();
}

// Posted buffers: posts on two streams, two posts naming one message after a layout change, direct and
// slot-path messages mixed on two sender streams, and how far posts are ordered before each stream.
void test_direct_posts() {
  constexpr uint32_t kSlots = 3;  // odd: each slot alternates direct and slot-path messages
  const uint64_t messages_count = 12 * kScale;
  HostDevice device;
  HostStream sender_streams[2] = {HostStream("sender stream 0"), HostStream("sender stream 1")};
  HostStream post_streams[2] = {HostStream("post stream 0"), HostStream("post stream 1")};
  HostStream receive_stream("receiver stream");
  HostReceiver receiver(device, kSlots, 4096);
  HostSender sender(device, receiver.export_handles());
  Allocation& pool = device.allocate(size_t{64 * 1024} * (messages_count + 1));
  Rng rng(11);
  std::deque<TestMessage> messages;
  std::vector<std::pair<const TestMessage*, unsigned char*>> direct;
  std::vector<unsigned char*> abandoned;  // buffers of posts a later post replaced
  uint64_t post = 0;
  for (uint64_t seq = 0; seq < messages_count; ++seq) {
    HostStream& send_stream = sender_streams[seq / 5 % 2];
    if (seq % 2 == 1) {
      messages.push_back(make_message(seq, random_layout(rng, 4096)));
      sender.enqueue_send(seq, messages.back().send_regions, send_stream);
      receiver.enqueue_receive(seq, messages.back().receive_regions, receive_stream);
      continue;
    }
    // Larger than a slot: only the direct path can carry it.
    messages.push_back(make_message(seq, {{0, 10000 + seq}, {10240, 5000}}));
    const TestMessage& message = messages.back();
    unsigned char* buffer = pool.data + 64 * 1024 * seq;
    HostStream& post_stream = post_streams[seq / 2 % 2];
    if (seq % 4 == 0) {
      // A first layout's buffer, replaced before the sender used it: the message names the later post.
      abandoned.push_back(buffer + 32 * 1024);
      offer_buffer(device, receiver, abandoned.back(), 16384, seq, post++, post_streams[1 - seq / 2 % 2]);
    }
    const PostOffer offer = offer_buffer(device, receiver, buffer, 15240, seq, post++, post_stream);
    // The last post's write is owed, so it is not counted yet (a replaced post's is: the later post on
    // another stream wrote it); other streams are ordered after none.
    CHECK(receiver.posts_ordered_before(post_stream) == post - 1);
    CHECK(receiver.posts_ordered_before(post_streams[1 - seq / 2 % 2]) == 0);
    CHECK(receiver.posts_ordered_before(receive_stream) == 0);
    expect_protocol_error(
        [&] {
          PostOffer small = offer;
          small.capacity -= 1;
          sender.enqueue_send_direct(seq, small, message.send_regions, send_stream, false);
        },
        "region 1", "region past the posted buffer");
    expect_protocol_error([&] { sender.enqueue_send_direct(seq + 1, offer, message.send_regions, send_stream, false); },
                          "expected " + std::to_string(seq), "direct send out of order");
    CHECK(sender.enqueue_send_direct(seq, offer, message.send_regions, send_stream, false));
    receiver.enqueue_receive_direct(seq, seq % 4 == 0 ? post_stream : receive_stream);
    // Received on the post's stream, the write went with the receive; elsewhere alone, before it.
    CHECK(receiver.posts_ordered_before(post_stream) == post);
    direct.emplace_back(&message, buffer);
  }
  expect_protocol_error([&] { receiver.enqueue_post(post - 1, post_streams[0]); }, "already posted",
                        "post number behind an earlier one");
  for (HostStream& stream : sender_streams) stream.synchronize();
  synchronize({&post_streams[0], &post_streams[1], &receive_stream});
  for (const TestMessage& message : messages) {
    if (message.seq % 2 == 1) check_received(message);
  }
  for (const auto& [message, buffer] : direct) check_received_in(*message, buffer);
  for (const unsigned char* buffer : abandoned) {
    CHECK_MSG(std::all_of(buffer, buffer + 16384, [](unsigned char byte) { return byte == 0xEE; }),
              "a message landed in the buffer of a replaced post");
  }
  // An allocation the sender cannot map leaves the message unsent, for the slot path.
  Allocation& unmappable = device.allocate(4096);
  device.refuse_mapping(unmappable);
  const PostOffer refused =
      offer_buffer(device, receiver, unmappable.data, 4096, messages_count, post++, post_streams[0]);
  TestMessage last = make_message(messages_count, {{0, 100}});
  CHECK(!sender.enqueue_send_direct(messages_count, refused, last.send_regions, sender_streams[0], false));
  CHECK(sender.protocol().next_seq() == messages_count);
  sender.enqueue_send(messages_count, last.send_regions, sender_streams[0]);
  receiver.enqueue_receive(messages_count, last.receive_regions, receive_stream);
  synchronize({&sender_streams[0], &post_streams[0], &receive_stream});
  check_received(last);
  CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
  receiver.free_all();
}

// The posted wait is what keeps the sender's copy behind the buffer's previous use on the receiver's
// stream. The posting stream is held at a gate before that use: the planned send waits and the data
// arrives intact. The same send with the wait skipped lands first and is overwritten, which shows the
// stepper catches a plan that drops a wait it needs.
void test_posted_wait_orders_buffer() {
  for (const bool skip_posted_wait : {false, true}) {
    HostDevice device;
    HostStream send_stream("sender stream");
    HostStream post_stream("post stream");
    HostStream receive_stream("receiver stream");
    HostReceiver receiver(device, 2, 4096);
    HostSender sender(device, receiver.export_handles());
    Allocation& pool = device.allocate(8192);
    std::atomic<bool> gate{false};
    hold_at(gate, post_stream);
    const PostOffer offer = offer_buffer(device, receiver, pool.data, 8192, 0, 0, post_stream);
    TestMessage message = make_message(0, {{0, 6000}, {6016, 2000}});
    CHECK(sender.enqueue_send_direct(0, offer, message.send_regions, send_stream, skip_posted_wait));
    receiver.enqueue_receive_direct(0, receive_stream);
    if (skip_posted_wait) {
      send_stream.synchronize();  // the copy ran before the buffer's previous use
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      CHECK_MSG(!send_stream.passed(send_stream.record()), "the send ran before the post");
    }
    gate.store(true, std::memory_order_release);
    synchronize({&post_stream, &send_stream, &receive_stream});
    if (skip_posted_wait) {
      CHECK_MSG(pool.data[0] == 0xEE, "the stepper ran the buffer's previous use after a copy it should follow");
    } else {
      check_received_in(message, pool.data);
    }
    CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
    receiver.free_all();
  }
}

// Two processes each receiving and sending (a duplex channel). A post's write is ordered before what P
// enqueues next on the stream the write went with, so P tells Q in its next message; Q, having received
// that message on its stream, sends into the posted buffer without the posted wait (posted_passed).
void test_posts_ordered_before() {
  HostDevice device;
  HostStream p_stream("process P stream");
  HostStream q_stream("process Q stream");
  HostReceiver p_receiver(device, 2, 4096);  // ring Q -> P
  HostSender q_sender(device, p_receiver.export_handles());
  HostReceiver q_receiver(device, 2, 4096);  // ring P -> Q
  HostSender p_sender(device, q_receiver.export_handles());
  Allocation& pool = device.allocate(8192);

  // P offers a buffer for Q's message 1; the write is owed, so nothing counts yet.
  const PostOffer offer = offer_buffer(device, p_receiver, pool.data, 8192, 1, 0, p_stream);
  CHECK(p_receiver.posts_ordered_before(p_stream) == 0);
  TestMessage q0 = make_message(0, {{0, 3000}});
  q_sender.enqueue_send(0, q0.send_regions, q_stream);
  p_receiver.enqueue_receive(0, q0.receive_regions, p_stream);  // carries the owed write
  const uint64_t passed = p_receiver.posts_ordered_before(p_stream);
  CHECK(passed == 1 && p_receiver.posts_ordered_before(q_stream) == 0);
  // P's message to Q carries `passed` (ipc_channel's data note); Q receives it on q_stream.
  TestMessage p0 = make_message(100, {{0, 500}});
  p_sender.enqueue_send(0, p0.send_regions, p_stream);
  q_receiver.enqueue_receive(0, p0.receive_regions, q_stream);
  const bool posted_passed = offer.post < passed;
  TestMessage q1 = make_message(1, {{0, 7000}, {7040, 1000}});
  const ipc::SendPlan plan = q_sender.protocol().plan_send_direct(
      1, offer.post, offer.offset, offer.capacity, q1.send_regions.data(), q1.send_regions.size(), q_stream.id(),
      posted_passed);
  CHECK(posted_passed && plan.step.wait_count == 0);
  CHECK(q_sender.enqueue_send_direct(1, offer, q1.send_regions, q_stream, posted_passed));
  p_receiver.enqueue_receive_direct(1, p_stream);
  synchronize({&p_stream, &q_stream});
  check_received(q0);
  check_received(p0);
  check_received_in(q1, pool.data);
  CHECK(q_sender.unmap_when_done(std::chrono::seconds(10)) && p_sender.unmap_when_done(std::chrono::seconds(10)));
  p_receiver.free_all();
  q_receiver.free_all();
}

// Closing: the sender unmaps only once every send it enqueued has run, and the receiver frees only after.
void test_close_ordering() {
  HostDevice device;
  HostStream send_stream("sender stream");
  HostStream receive_stream("receiver stream");
  HostReceiver receiver(device, 2, 4096);
  HostSender sender(device, receiver.export_handles());
  std::atomic<bool> gate{false};
  hold_at(gate, receive_stream);
  std::deque<TestMessage> messages;
  for (uint64_t seq = 0; seq < 4; ++seq) {
    messages.push_back(make_message(seq, {{0, 1000 + seq}}));
    sender.enqueue_send(seq, messages.back().send_regions, send_stream);
    receiver.enqueue_receive(seq, messages.back().receive_regions, receive_stream);
  }
  // Messages 2 and 3 wait for the acks of 0 and 1, which wait for the gate: the sender must keep its mappings.
  CHECK(!sender.unmap_when_done(std::chrono::milliseconds(20)));
  CHECK(receiver.flags().mappings.load() == 1);
  gate.store(true, std::memory_order_release);
  CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
  CHECK(receiver.flags().mappings.load() == 0);
  synchronize({&send_stream, &receive_stream});
  for (const TestMessage& message : messages) check_received(message);
  receiver.free_all();
}

// Random messages, paths, streams, grows and shrinks, batch after batch, every byte checked.
void test_stress() {
  for (const uint32_t num_slots : {1u, 3u, 4u}) {
    HostDevice device;
    HostStream send_streams[2] = {HostStream("sender stream 0"), HostStream("sender stream 1")};
    HostStream receive_streams[2] = {HostStream("receiver stream 0"), HostStream("receiver stream 1")};
    HostReceiver receiver(device, num_slots, 1024);
    HostSender sender(device, receiver.export_handles());
    constexpr size_t kPoolBytes = size_t{4} << 20;
    Allocation& pool = device.allocate(kPoolBytes);
    Rng rng(1000 + num_slots);
    std::vector<std::string> undelivered;  // resize blobs on their way to the sender
    uint64_t seq = 0;
    uint64_t post = 0;
    size_t grows = 0, shrinks = 0, directs = 0;
    const uint64_t messages_count = 1000 * kScale;
    while (seq < messages_count) {
      const uint64_t batch_end = std::min(messages_count, seq + 1 + rng.below(12));
      std::deque<TestMessage> messages;
      std::vector<const TestMessage*> by_slot;
      std::vector<std::pair<const TestMessage*, unsigned char*>> direct;
      size_t pool_used = 0;
      for (; seq < batch_end; ++seq) {
        if (rng.below(25) == 0) {
          // A shrink, for a message neither end has reached.
          undelivered.push_back(receiver.resize(256 + rng.below(1024), seq + rng.below(3)));
          ++shrinks;
        }
        // The host channel delivers a blob before the sender reaches its first message, maybe earlier.
        for (auto it = undelivered.begin(); it != undelivered.end();) {
          if (parse_ipc_ring_handles(*it).first_seq <= seq || rng.below(3) == 0) {
            sender.update(*it);
            it = undelivered.erase(it);
          } else {
            ++it;
          }
        }
        const size_t max_bytes = rng.below(10) == 0 ? 24 * 1024 : 2048;
        messages.push_back(make_message(seq, random_layout(rng, max_bytes)));
        const TestMessage& message = messages.back();
        HostStream& send_stream = send_streams[rng.below(2)];
        HostStream& receive_stream = receive_streams[rng.below(2)];
        const bool is_direct = rng.below(3) == 0;
        if (is_direct) {
          HostStream& post_stream = receive_streams[rng.below(2)];
          const size_t capacity = std::max<size_t>(message.needed_bytes(), 1);
          if (rng.below(4) == 0) {  // a layout change: an earlier post for the same message, never used
            offer_buffer(device, receiver, pool.data + pool_used, capacity, seq, post++, receive_streams[rng.below(2)]);
            pool_used += (capacity + 255) / 256 * 256;
          }
          unsigned char* buffer = pool.data + pool_used;
          const PostOffer offer = offer_buffer(device, receiver, buffer, capacity, seq, post++, post_stream);
          pool_used += (capacity + 255) / 256 * 256;
          const bool receive_first = rng.below(2) == 0;
          if (receive_first) receiver.enqueue_receive_direct(seq, receive_stream);
          CHECK(sender.enqueue_send_direct(seq, offer, message.send_regions, send_stream, false));
          if (!receive_first) receiver.enqueue_receive_direct(seq, receive_stream);
          direct.emplace_back(&message, buffer);
          ++directs;
          continue;
        }
        if (message.needed_bytes() > sender.protocol().next_generation().slot_bytes) {
          sender.update(receiver.grow(message.needed_bytes(), seq));
          ++grows;
        }
        by_slot.push_back(&message);
        if (rng.below(2) == 0) {
          receiver.enqueue_receive(seq, message.receive_regions, receive_stream);
          sender.enqueue_send(seq, message.send_regions, send_stream);
        } else {
          sender.enqueue_send(seq, message.send_regions, send_stream);
          receiver.enqueue_receive(seq, message.receive_regions, receive_stream);
        }
      }
      synchronize({&send_streams[0], &send_streams[1], &receive_streams[0], &receive_streams[1]});
      for (const TestMessage* message : by_slot) check_received(*message);
      for (const auto& [message, buffer] : direct) check_received_in(*message, buffer);
      receiver.release_passed_generations();
      CHECK(pool_used <= kPoolBytes);
    }
    CHECK_MSG(grows > 0 && shrinks > 0 && directs > 0 && !receiver.released_generations().empty(),
              std::to_string(grows) + " grows, " + std::to_string(shrinks) + " shrinks, " + std::to_string(directs) +
                  " direct messages, " + std::to_string(receiver.released_generations().size()) + " given back");
    CHECK(sender.unmap_when_done(std::chrono::seconds(10)));
    receiver.free_all();
  }
}

// A failure names the first fault on a stream too, and clears it: left raised, it would abort the next case's streams.
template <void (*Body)()>
void reporting_stream_faults() {
  try {
    Body();
  } catch (const std::exception& error) {
    const std::string fault = take_fault();
    if (fault.empty()) throw;
    throw TestFailure(error.what() + std::string("; first on a stream: ") + fault);
  }
}

const TestCase kTestCases[] = {
    {"numbering", reporting_stream_faults<test_numbering>, false},
    {"handle_blob", reporting_stream_faults<test_handle_blob>, false},
    {"wait_rules", reporting_stream_faults<test_wait_rules>, false},
    {"slot_path", reporting_stream_faults<test_slot_path>, false},
    {"grow_and_shrink", reporting_stream_faults<test_grow_and_shrink>, false},
    {"direct_posts", reporting_stream_faults<test_direct_posts>, false},
    {"posted_wait_orders_buffer", reporting_stream_faults<test_posted_wait_orders_buffer>, false},
    {"posts_ordered_before", reporting_stream_faults<test_posts_ordered_before>, false},
    {"close_ordering", reporting_stream_faults<test_close_ordering>, false},
    {"stress", reporting_stream_faults<test_stress>, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_protocol", kTestCases, argc, argv); }
