// Native 2-process test of the CUDA-IPC ring (csrc/transport/ipc_ring.*). The parent forks before any
// CUDA call: process A is the receiver on GPU 0, process B the sender on GPU 1 (or GPU 0 as well when
// only one GPU is visible or the two cannot reach each other). They exchange the serialized handles
// and grow requests over a socketpair, and report each case to the parent over a pipe.
// Usage: test_ipc_ring [case]   (round_trip, direct, stress, resize or bandwidth; all by default)
#include "../../csrc/transport/ipc_ring.h"

#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using Clock = std::chrono::steady_clock;

constexpr double kPeerTimeoutS = 60.0;   // one wait for the other process
constexpr int kWatchdogS = 150;          // the parent kills both children after this
constexpr size_t MiB = size_t{1} << 20;

const char* g_role = "?";
int g_results_fd = -1;
std::string g_only_case;  // empty: all cases

[[noreturn]] void fail(const std::string& message) { throw TestFailure(message); }

void cuda_check(cudaError_t error, const char* call, int line) {
  if (error != cudaSuccess) {
    fail(std::string("line ") + std::to_string(line) + ": " + call + " failed: " + cudaGetErrorName(error) + ": " +
         cudaGetErrorString(error));
  }
}
#define CUDA_CHECK(call) cuda_check((call), #call, __LINE__)

void log_line(const std::string& text) {
  std::printf("[%s] %s\n", g_role, text.c_str());
  std::fflush(stdout);
}

void report(char kind, const std::string& name, const std::string& detail = {}) {
  std::string line = std::string(1, kind) + " " + g_role + "/" + name;
  if (!detail.empty()) line += ": " + detail.substr(0, 1500);
  for (char& c : line) {
    if (c == '\n') c = ' ';
  }
  line += "\n";
  // Under PIPE_BUF bytes, so the two children's lines never interleave.
  if (write(g_results_fd, line.data(), line.size()) < 0) std::perror("write results");
}

// ---- socket framing --------------------------------------------------------------------------------

void write_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(std::string("socket write failed: ") + std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void read_all(int fd, void* data, size_t bytes, Clock::time_point deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) fail("timed out waiting for the peer process: " + what);
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) fail(std::string("poll failed: ") + std::strerror(errno));
    if (ready == 0) continue;
    const ssize_t n = read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) fail("the peer process closed the socket (it failed or died) while waiting for: " + what);
    if (n < 0) fail(std::string("socket read failed: ") + std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void send_frame(int fd, const std::string& payload) {
  const uint64_t size = payload.size();
  write_all(fd, &size, sizeof(size));
  write_all(fd, payload.data(), payload.size());
}

std::string recv_frame(int fd, const std::string& what) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(kPeerTimeoutS));
  uint64_t size = 0;
  read_all(fd, &size, sizeof(size), deadline, what);
  CHECK_MSG(size < (uint64_t{1} << 24), "absurd frame size " + std::to_string(size));
  std::string payload(size, '\0');
  if (size > 0) read_all(fd, &payload[0], size, deadline, what);
  return payload;
}

// Both sides enter each case together, so a desynchronized pair fails fast and clearly.
void rendezvous(int fd, const std::string& name) {
  send_frame(fd, "case " + name);
  const std::string got = recv_frame(fd, "start of case " + name);
  CHECK_MSG(got == "case " + name, "peer is at '" + got + "', this process at case " + name);
}

// ---- CUDA helpers ----------------------------------------------------------------------------------

// Polls instead of cudaStreamSynchronize: a wait on a flag the peer never writes must fail the test,
// not hang it.
void sync_stream(cudaStream_t stream, const std::string& what, double timeout_s = kPeerTimeoutS) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(timeout_s));
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) CUDA_CHECK(status);
    if (Clock::now() > deadline) fail("timed out on the GPU: " + what);
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Owns what a case allocates. Released only after the case passed: after a failure a stream may wait
// forever on a flag, and freeing or unmapping would synchronize on it, so the process exits instead.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (auto it = cleanups_.rbegin(); it != cleanups_.rend(); ++it) (*it)();
  }

  template <typename T, typename... Args>
  T& make(Args&&... args) {
    T* object = new T(std::forward<Args>(args)...);
    cleanups_.push_back([object] { delete object; });
    return *object;
  }
  void* device(size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    cleanups_.push_back([p] { cudaFree(p); });
    return p;
  }
  unsigned char* pinned(size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 1)));
    cleanups_.push_back([p] { cudaFreeHost(p); });
    return static_cast<unsigned char*>(p);
  }
  cudaStream_t stream() {
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cleanups_.push_back([s] { cudaStreamDestroy(s); });
    return s;
  }
  cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    cleanups_.push_back([e] { cudaEventDestroy(e); });
    return e;
  }

 private:
  std::vector<std::function<void()>> cleanups_;
};

struct Context {
  int sock = -1;
  int device = 0;
  int other_device = -1;  // another visible GPU, or -1
  bool receiver = false;
};

// Calls f with another GPU current: the ring ends must switch to their own and restore the caller's.
void call_with_other_device_current(const Context& ctx, const std::function<void()>& f) {
  if (ctx.other_device < 0) return f();
  CUDA_CHECK(cudaSetDevice(ctx.other_device));
  f();
  int current = -1;
  CUDA_CHECK(cudaGetDevice(&current));
  CUDA_CHECK(cudaSetDevice(ctx.device));
  CHECK_MSG(current == ctx.other_device, "the ring end left device " + std::to_string(current) + " current");
}

// ---- case 1: round trip of several regions ---------------------------------------------------------

constexpr uint32_t kRoundTripSlots = 4;
constexpr size_t kRoundTripSlotBytes = 1 * MiB;
constexpr uint64_t kRoundTripMessages = 13;

std::vector<CopyRegion> round_trip_layout(uint64_t seq) {
  // local pointers are filled in by each side
  return {
      {nullptr, 0, 4096 + seq},
      {nullptr, 8193, 1000 + 3 * seq},           // odd slot offset and size
      {nullptr, 20000, 0},                       // empty region
      {nullptr, 65536, 200000 - 7 * seq},
      {nullptr, kRoundTripSlotBytes - 33, 33},   // ends exactly at the end of the slot
  };
}

unsigned char round_trip_byte(uint64_t seq, size_t region, size_t index) {
  const uint64_t word = splitmix(seq * 1000003 + region * 7919 + index / 8);
  return static_cast<unsigned char>(word >> (8 * (index % 8)));
}

void round_trip_receiver(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingReceiver>(ctx.device, kRoundTripSlots, kRoundTripSlotBytes,
                                           "test ipc channel rank 1 -> rank 0");
  CHECK_MSG(ring.slot_bytes() == kRoundTripSlotBytes, std::to_string(ring.slot_bytes()));
  CHECK(ring.num_slots() == kRoundTripSlots);
  const std::string handles = ring.export_handles();
  const IpcRingHandleInfo info = parse_ipc_ring_handles(handles);
  CHECK_MSG(info.num_slots == kRoundTripSlots && info.slot_bytes == kRoundTripSlotBytes && info.generation == 0 &&
                info.first_seq == 0 && info.owner_pid == getpid(),
            "parsed handle info");
  send_frame(ctx.sock, handles);
  cudaStream_t stream = arena.stream();

  // API misuse is refused before anything is enqueued.
  std::vector<CopyRegion> bad = round_trip_layout(0);
  bad[0].local = arena.device(1);
  bad[3].slot_offset = kRoundTripSlotBytes - 10;
  for (auto& r : bad) {
    if (r.local == nullptr) r.local = bad[0].local;
  }
  expect_protocol_error([&] { ring.enqueue_receive(1, bad, stream); }, "expected 0", "out-of-order receive");
  expect_protocol_error([&] { ring.enqueue_receive(0, bad, stream); }, "message 0 region 3", "oversized region");
  CHECK_MSG(ring.next_seq() == 0, "a refused receive advanced the sequence");
  expect_protocol_error([] { parse_ipc_ring_handles("not a handle blob"); }, "not an ipc ring handle", "garbage");

  size_t bad_bytes = 0;
  std::string first_bad;
  for (uint64_t seq = 0; seq < kRoundTripMessages; ++seq) {
    std::vector<CopyRegion> regions = round_trip_layout(seq);
    for (auto& region : regions) {
      region.local = arena.device(region.bytes);
      CUDA_CHECK(cudaMemsetAsync(region.local, 0xEE, region.bytes, stream));
    }
    if (seq % 3 == 1) std::this_thread::sleep_for(std::chrono::microseconds(300));  // let the sender run ahead
    if (seq % 2 == 1) {
      call_with_other_device_current(ctx, [&] { ring.enqueue_receive(seq, regions, stream); });
    } else {
      ring.enqueue_receive(seq, regions, stream);
    }
    sync_stream(stream, "round trip receive " + std::to_string(seq));
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      if (!host.empty()) CUDA_CHECK(cudaMemcpy(host.data(), regions[r].local, host.size(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < host.size(); ++i) {
        if (host[i] != round_trip_byte(seq, r, i)) {
          if (bad_bytes++ == 0) {
            first_bad = "message " + std::to_string(seq) + " region " + std::to_string(r) + " byte " +
                        std::to_string(i);
          }
        }
      }
    }
  }
  CHECK_MSG(bad_bytes == 0, std::to_string(bad_bytes) + " wrong bytes, first at " + first_bad);
  CHECK(recv_frame(ctx.sock, "end of round trip") == "done");
}

void round_trip_sender(Context& ctx, Arena& arena) {
  const std::string handles = recv_frame(ctx.sock, "receiver handles");
  auto& ring = arena.make<IpcRingSender>(ctx.device, handles, "test ipc channel rank 1 -> rank 0");
  CHECK(ring.slot_bytes() == kRoundTripSlotBytes && ring.num_slots() == kRoundTripSlots);
  cudaStream_t stream = arena.stream();

  std::vector<CopyRegion> bad = round_trip_layout(0);
  bad[0].local = arena.device(1);
  bad[1].slot_offset = kRoundTripSlotBytes + 1;
  for (auto& r : bad) {
    if (r.local == nullptr) r.local = bad[0].local;
  }
  expect_protocol_error([&] { ring.enqueue_send(3, bad, stream); }, "expected 0", "out-of-order send");
  expect_protocol_error([&] { ring.enqueue_send(0, bad, stream); }, "message 0 region 1", "oversized region");
  expect_protocol_error([&] { ring.enqueue_wait_consumed(0, stream); }, "not sent yet", "wait before send");
  expect_protocol_error([&] { ring.update("garbage"); }, "not an ipc ring handle", "garbage update");
  std::string foreign = handles;
  foreign[100] = static_cast<char>(foreign[100] ^ 0x5A);  // flags handle of "another" receiver
  expect_protocol_error([&] { ring.update(foreign); }, "another receiver", "foreign update");
  ring.update(handles);  // the mapped generation again: ignored
  CHECK_MSG(ring.next_seq() == 0 && ring.generation() == 0, "refused calls changed the sender");

  for (uint64_t seq = 0; seq < kRoundTripMessages; ++seq) {
    std::vector<CopyRegion> regions = round_trip_layout(seq);
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      for (size_t i = 0; i < host.size(); ++i) host[i] = round_trip_byte(seq, r, i);
      regions[r].local = arena.device(host.size());
      if (!host.empty()) {
        CUDA_CHECK(cudaMemcpyAsync(regions[r].local, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` dies at the end of this iteration
      }
    }
    if (seq % 2 == 1) {
      call_with_other_device_current(ctx, [&] { ring.enqueue_send(seq, regions, stream); });
    } else {
      ring.enqueue_send(seq, regions, stream);
    }
  }
  ring.enqueue_wait_consumed(kRoundTripMessages - 1, stream);
  sync_stream(stream, "round trip: last message consumed");
  send_frame(ctx.sock, "done");
}

// ---- case 1b: direct writes into posted buffers, mixed with slot messages ------------------------------

constexpr uint32_t kDirectSlots = 3;  // odd: each slot alternates direct and slot-path messages
constexpr size_t kDirectSlotBytes = 64 * 1024;
constexpr uint64_t kDirectMessages = 24;
constexpr size_t kDirectPoolBytes = 4 * MiB;  // one allocation, as a caching allocator's segment

// Even messages go direct (two regions, larger than a slot), odd ones by slot.
bool direct_message(uint64_t seq) { return seq % 2 == 0; }
std::vector<CopyRegion> direct_layout(uint64_t seq) {
  if (direct_message(seq)) return {{nullptr, 0, 100000 + seq}, {nullptr, 100352, 5000}};
  return {{nullptr, 0, 3000 + seq}, {nullptr, 4096, 17}};
}
// Where message seq's posted buffer lies in the pool: different for nearby messages.
size_t direct_pool_offset(uint64_t seq) { return (seq / 2 % 5) * 512 * 1024 + 256; }

struct PostFrame {
  uint64_t seq;
  uint64_t offset;
  uint64_t capacity;
  cudaIpcMemHandle_t handle;
};

void direct_receiver(Context& ctx, Arena& arena) {
  auto& ring =
      arena.make<IpcRingReceiver>(ctx.device, kDirectSlots, kDirectSlotBytes, "test ipc direct rank 1 -> rank 0");
  send_frame(ctx.sock, ring.export_handles());
  char* pool = static_cast<char*>(arena.device(kDirectPoolBytes));
  cudaStream_t streams[2] = {arena.stream(), arena.stream()};
  cudaStream_t stream = arena.stream();
  size_t bad_bytes = 0;
  for (uint64_t seq = 0; seq < kDirectMessages; ++seq) {
    std::vector<CopyRegion> regions = direct_layout(seq);
    if (direct_message(seq)) {
      char* buffer = pool + direct_pool_offset(seq);
      PostFrame post{seq, 0, 0, {}};
      size_t offset = 0;
      CHECK_MSG(ring.export_pointer(buffer, &post.handle, &offset), "export_pointer refused a cudaMalloc allocation");
      CHECK_MSG(offset == direct_pool_offset(seq), "offset " + std::to_string(offset));
      post.offset = offset;
      post.capacity = regions.back().slot_offset + regions.back().bytes;
      // The buffer's previous contents are written on the posting stream right before the post: the
      // sender's copy must land after them. Posts alternate streams to exercise the counter's fence.
      cudaStream_t post_stream = streams[seq / 2 % 2];
      CUDA_CHECK(cudaMemsetAsync(buffer, 0xEE, post.capacity, post_stream));
      ring.enqueue_post(seq / 2, post_stream);
      send_frame(ctx.sock, std::string(reinterpret_cast<const char*>(&post), sizeof(post)));
      for (auto& region : regions) region.local = buffer + region.slot_offset;
      ring.enqueue_receive_direct(seq, stream);
    } else {
      for (auto& region : regions) region.local = arena.device(region.bytes);
      ring.enqueue_receive(seq, regions, stream);
    }
    sync_stream(stream, "direct case receive " + std::to_string(seq));
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      CUDA_CHECK(cudaMemcpy(host.data(), regions[r].local, host.size(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < host.size(); ++i) bad_bytes += host[i] != round_trip_byte(seq, r, i);
    }
  }
  CHECK_MSG(bad_bytes == 0, std::to_string(bad_bytes) + " wrong bytes");
  expect_protocol_error([&] { ring.enqueue_post(3, stream); }, "already posted", "post number behind an earlier one");
  CHECK_MSG(!ring.export_pointer(nullptr, nullptr, nullptr), "exported a null pointer");
  CHECK(recv_frame(ctx.sock, "end of direct case") == "done");
}

void direct_sender(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingSender>(ctx.device, recv_frame(ctx.sock, "direct handles"),
                                         "test ipc direct rank 1 -> rank 0");
  // Runs of messages on two streams: a slot's messages must still flag ready in order.
  cudaStream_t streams[2] = {arena.stream(), arena.stream()};
  cudaStream_t stream = streams[0];
  for (uint64_t seq = 0; seq < kDirectMessages; ++seq) {
    stream = streams[seq / 5 % 2];
    std::vector<CopyRegion> regions = direct_layout(seq);
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      for (size_t i = 0; i < host.size(); ++i) host[i] = round_trip_byte(seq, r, i);
      regions[r].local = arena.device(host.size());
      CUDA_CHECK(cudaMemcpy(regions[r].local, host.data(), host.size(), cudaMemcpyHostToDevice));
    }
    if (!direct_message(seq)) {
      ring.enqueue_send(seq, regions, stream);
      continue;
    }
    const std::string frame = recv_frame(ctx.sock, "post of message " + std::to_string(seq));
    CHECK_MSG(frame.size() == sizeof(PostFrame), "post frame size");
    PostFrame post;
    std::memcpy(&post, frame.data(), sizeof(post));
    CHECK_MSG(post.seq == seq, "post for message " + std::to_string(post.seq));
    expect_protocol_error(
        [&] {
          ring.enqueue_send_direct(seq, seq / 2, post.handle, post.offset, post.capacity - 1, regions.data(),
                                   regions.size(), stream);
        },
        "region 1", "region past the posted buffer");
    expect_protocol_error(
        [&] {
          ring.enqueue_send_direct(seq + 1, seq / 2, post.handle, post.offset, post.capacity, regions.data(),
                                   regions.size(), stream);
        },
        "expected " + std::to_string(seq), "out-of-order direct send");
    const bool sent = ring.enqueue_send_direct(seq, seq / 2, post.handle, post.offset, post.capacity,
                                               regions.data(), regions.size(), stream);
    CHECK_MSG(sent, "could not map the receiver's allocation");
  }
  CHECK_MSG(ring.mapped_peer_allocations() == 1,
            std::to_string(ring.mapped_peer_allocations()) + " mappings of one pool");
  ring.enqueue_wait_consumed(kDirectMessages - 1, stream);  // odd: by slot
  sync_stream(streams[1], "direct case: sends on stream 1");
  sync_stream(streams[0], "direct case: last message consumed");
  send_frame(ctx.sock, "done");
}

// ---- case 2: ordering, flow control and growth under load --------------------------------------------

constexpr uint32_t kStressSlots = 4;
constexpr uint64_t kStressMessages = 2000;
constexpr size_t kStressInitialSlotBytes = 512 * 1024;
constexpr size_t kStressMaxBytes = 8 * MiB;
constexpr size_t kStressMaxBatch = 6;
// Message sources are windows of one pattern buffer at offsets that differ between nearby messages.
constexpr size_t kPatternBytes = 1021 * 4096 + 64 + kStressMaxBytes;

size_t stress_source_offset(uint64_t seq) { return (seq * 7919 % 1021) * 4096 + seq % 16; }

struct StressMessage {
  size_t bytes = 0;
  size_t needed_slot_bytes = 0;
  std::vector<CopyRegion> regions;  // local = offset into the message (as a pointer-sized integer)
};

// Both processes derive the same plan, standing in for the metadata the host channel carries.
StressMessage stress_plan(uint64_t seq) {
  Rng rng(seq ^ 0x5EEDull);
  const size_t cap = seq < 300 ? kStressInitialSlotBytes - 64 : seq < 600 ? 2 * MiB - 64 : kStressMaxBytes;
  StressMessage m;
  if (seq == 300) {
    m.bytes = 2 * MiB;  // forces the first grow
  } else if (seq == 600) {
    m.bytes = kStressMaxBytes;  // forces the second grow
  } else {
    switch (rng.below(10)) {
      case 0: m.bytes = 0; break;
      case 1: case 2: case 3: m.bytes = rng.below(4097); break;
      case 4: case 5: case 6: m.bytes = rng.below(256 * 1024 + 1); break;
      default: m.bytes = rng.below(cap + 1); break;
    }
  }
  if (m.bytes == 0 && rng.below(2) == 0) return m;  // no regions at all
  const size_t parts = 1 + rng.below(3);
  std::vector<size_t> cuts{0, m.bytes};
  for (size_t i = 1; i < parts; ++i) cuts.push_back(rng.below(m.bytes + 1));
  std::sort(cuts.begin(), cuts.end());
  size_t slot_offset = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const size_t bytes = cuts[i + 1] - cuts[i];
    m.regions.push_back({reinterpret_cast<void*>(cuts[i]), slot_offset, bytes});
    m.needed_slot_bytes = slot_offset + bytes;
    slot_offset = (slot_offset + bytes + 15) / 16 * 16;
  }
  return m;
}

std::vector<unsigned char> make_pattern() {
  std::vector<unsigned char> pattern(kPatternBytes);
  for (size_t i = 0; i < kPatternBytes; i += 8) {
    const uint64_t word = splitmix(i / 8 + 12345);
    std::memcpy(&pattern[i], &word, std::min<size_t>(8, kPatternBytes - i));
  }
  return pattern;
}

void stress_receiver(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingReceiver>(ctx.device, kStressSlots, kStressInitialSlotBytes,
                                           "test ipc channel rank 1 -> rank 0 (stress)");
  send_frame(ctx.sock, ring.export_handles());
  const std::vector<unsigned char> pattern = make_pattern();
  cudaStream_t stream = arena.stream();
  std::vector<unsigned char*> dest(kStressMaxBatch);
  std::vector<unsigned char*> host(kStressMaxBatch);
  for (size_t i = 0; i < kStressMaxBatch; ++i) {
    dest[i] = static_cast<unsigned char*>(arena.device(kStressMaxBytes));
    host[i] = arena.pinned(kStressMaxBytes);
  }
  Rng rng(99);
  size_t corrupted = 0, grows = 0, total_bytes = 0;
  std::string corrupted_list;
  const auto start = Clock::now();
  uint64_t seq = 0;
  while (seq < kStressMessages) {
    const size_t batch = std::min<uint64_t>(1 + rng.below(kStressMaxBatch), kStressMessages - seq);
    if (rng.below(4) == 0) std::this_thread::sleep_for(std::chrono::microseconds(100 + rng.below(400)));
    std::vector<StressMessage> plans;
    for (size_t b = 0; b < batch; ++b, ++seq) {
      StressMessage m = stress_plan(seq);
      if (m.needed_slot_bytes > ring.slot_bytes()) {
        // The upper layer's job, simulated: the sender asked for bigger slots for this message.
        const std::string request = recv_frame(ctx.sock, "grow request for message " + std::to_string(seq));
        const std::string expected = "grow " + std::to_string(seq) + " " + std::to_string(m.needed_slot_bytes);
        CHECK_MSG(request == expected, "got '" + request + "', expected '" + expected + "'");
        send_frame(ctx.sock, ring.grow(m.needed_slot_bytes, seq));
        ++grows;
        CHECK_MSG(ring.slot_bytes() >= m.needed_slot_bytes, "grow gave too little");
      }
      if (m.bytes > 0) CUDA_CHECK(cudaMemsetAsync(dest[b], 0xA5, m.bytes, stream));
      for (auto& region : m.regions) region.local = dest[b] + reinterpret_cast<uintptr_t>(region.local);
      ring.enqueue_receive(seq, m.regions, stream);
      if (m.bytes > 0) CUDA_CHECK(cudaMemcpyAsync(host[b], dest[b], m.bytes, cudaMemcpyDeviceToHost, stream));
      total_bytes += m.bytes;
      plans.push_back(std::move(m));
    }
    sync_stream(stream, "stress batch ending at message " + std::to_string(seq - 1));
    for (size_t b = 0; b < batch; ++b) {
      const uint64_t s = seq - batch + b;
      if (plans[b].bytes > 0 &&
          std::memcmp(host[b], pattern.data() + stress_source_offset(s), plans[b].bytes) != 0) {
        if (++corrupted <= 10) corrupted_list += " " + std::to_string(s);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  log_line("stress: " + std::to_string(kStressMessages) + " messages, " + std::to_string(total_bytes >> 20) +
           " MiB, " + std::to_string(grows) + " grows, final slot " + std::to_string(ring.slot_bytes()) +
           " bytes, generation " + std::to_string(ring.generation()) + ", " + std::to_string(corrupted) +
           " corrupted, " + std::to_string(seconds) + " s");
  CHECK_MSG(corrupted == 0, std::to_string(corrupted) + " corrupted messages, first:" + corrupted_list);
  CHECK_MSG(grows >= 2 && ring.generation() == grows, "grew " + std::to_string(grows) + " times");
  CHECK(recv_frame(ctx.sock, "end of stress") == "done");
}

void stress_sender(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingSender>(ctx.device, recv_frame(ctx.sock, "stress handles"),
                                         "test ipc channel rank 1 -> rank 0 (stress)");
  cudaStream_t stream = arena.stream();
  const std::vector<unsigned char> pattern = make_pattern();
  auto* source = static_cast<unsigned char*>(arena.device(kPatternBytes));
  CUDA_CHECK(cudaMemcpy(source, pattern.data(), kPatternBytes, cudaMemcpyHostToDevice));
  size_t grows = 0;
  for (uint64_t seq = 0; seq < kStressMessages; ++seq) {
    StressMessage m = stress_plan(seq);
    if (m.needed_slot_bytes > ring.slot_bytes()) {
      // Expected to refuse first, naming the message and the sizes.
      expect_protocol_error(
          [&] {
            std::vector<CopyRegion> r = m.regions;
            for (auto& region : r) region.local = source;
            ring.enqueue_send(seq, r, stream);
          },
          "message " + std::to_string(seq) + " region", "oversized stress message");
      send_frame(ctx.sock, "grow " + std::to_string(seq) + " " + std::to_string(m.needed_slot_bytes));
      ring.update(recv_frame(ctx.sock, "grown handles for message " + std::to_string(seq)));
      ++grows;
      CHECK_MSG(ring.slot_bytes() >= m.needed_slot_bytes, "update did not adopt the grown slots");
    }
    const size_t base = stress_source_offset(seq);
    for (auto& region : m.regions) region.local = source + base + reinterpret_cast<uintptr_t>(region.local);
    ring.enqueue_send(seq, m.regions, stream);  // the host never blocks on the receiver
  }
  ring.enqueue_wait_consumed(kStressMessages - 1, stream);
  sync_stream(stream, "stress: last message consumed");
  CHECK_MSG(grows >= 2 && ring.generation() == grows, "updated " + std::to_string(grows) + " times");
  send_frame(ctx.sock, "done");
}

// ---- case 2b: a shrink for a later message and a grow for an earlier one, side by side ---------------

constexpr uint32_t kResizeSlots = 4;
constexpr size_t kResizeInitialSlotBytes = 4096;
constexpr uint64_t kResizeGrowSeq = 3;  // the first message too big for the initial slots
constexpr size_t kResizeGrownSlotBytes = 64 * 1024;
constexpr uint64_t kResizeShrinkSeq = 8;  // the shrunk generation is made before the grow, for a later message
constexpr size_t kResizeShrunkSlotBytes = 1024;
constexpr uint64_t kResizeLastFullSeq = 15;
// Empty, and sent before the generation the receiver makes for it reaches the sender: with no data,
// the two ends may disagree on its generation without harm.
constexpr uint64_t kResizeLateSeq = 16;
constexpr size_t kResizeLateSlotBytes = 2048;

size_t resize_intended_slot_bytes(uint64_t seq) {
  return seq < kResizeGrowSeq ? kResizeInitialSlotBytes
                              : seq < kResizeShrinkSeq ? kResizeGrownSlotBytes : kResizeShrunkSlotBytes;
}

// The second region ends exactly at the end of the slot the message is meant for: a message that
// went by a smaller slot than intended is refused instead of passing unnoticed.
std::vector<CopyRegion> resize_layout(uint64_t seq) {
  if (seq == kResizeLateSeq) return {};
  const size_t slot = resize_intended_slot_bytes(seq);
  const size_t tail = slot / 2 - 8 * (seq % 3);
  return {{nullptr, 0, slot / 4 + seq}, {nullptr, slot - tail, tail}};
}

std::string resize_grow_request() {
  return "grow " + std::to_string(kResizeGrowSeq) + " " + std::to_string(kResizeGrownSlotBytes);
}

void resize_receiver(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingReceiver>(ctx.device, kResizeSlots, kResizeInitialSlotBytes,
                                           "test ipc resize rank 1 -> rank 0");
  send_frame(ctx.sock, ring.export_handles());
  cudaStream_t stream = arena.stream();
  size_t bad_bytes = 0;
  std::string first_bad;
  const auto receive = [&](uint64_t seq) {
    std::vector<CopyRegion> regions = resize_layout(seq);
    for (auto& region : regions) {
      region.local = arena.device(region.bytes);
      CUDA_CHECK(cudaMemsetAsync(region.local, 0xEE, region.bytes, stream));
    }
    ring.enqueue_receive(seq, regions, stream);
    sync_stream(stream, "resize case receive " + std::to_string(seq));
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      CUDA_CHECK(cudaMemcpy(host.data(), regions[r].local, host.size(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < host.size(); ++i) {
        if (host[i] != round_trip_byte(seq, r, i) && bad_bytes++ == 0) {
          first_bad = "message " + std::to_string(seq) + " region " + std::to_string(r) + " byte " + std::to_string(i);
        }
      }
    }
  };
  const auto expect_state = [&](size_t live, uint32_t generation, size_t slot_bytes, const std::string& when) {
    CHECK_MSG(ring.live_generations() == live && ring.generation() == generation && ring.slot_bytes() == slot_bytes,
              when + ": " + std::to_string(ring.live_generations()) + " live generations, newest " +
                  std::to_string(ring.generation()) + " of " + std::to_string(ring.slot_bytes()) +
                  "-byte slots; expected " + std::to_string(live) + ", " + std::to_string(generation) + ", " +
                  std::to_string(slot_bytes));
  };

  const auto expect_blob = [](const std::string& blob, uint32_t generation, uint64_t first_seq, size_t slot_bytes,
                              const std::string& what) {
    const IpcRingHandleInfo info = parse_ipc_ring_handles(blob);
    CHECK_MSG(info.generation == generation && info.first_seq == first_seq && info.slot_bytes == slot_bytes,
              what + " blob: generation " + std::to_string(info.generation) + ", first_seq " +
                  std::to_string(info.first_seq) + ", slot_bytes " + std::to_string(info.slot_bytes));
  };

  for (uint64_t seq = 0; seq < kResizeGrowSeq; ++seq) receive(seq);
  expect_state(1, 0, kResizeInitialSlotBytes, "before any resize");

  const std::string shrunk = ring.resize(kResizeShrunkSlotBytes, kResizeShrinkSeq);
  expect_blob(shrunk, 1, kResizeShrinkSeq, kResizeShrunkSlotBytes, "shrink");
  expect_state(2, 1, kResizeShrunkSlotBytes, "after the shrink");
  send_frame(ctx.sock, shrunk);

  const std::string request = recv_frame(ctx.sock, "grow request for message " + std::to_string(kResizeGrowSeq));
  CHECK_MSG(request == resize_grow_request(), "got '" + request + "', expected '" + resize_grow_request() + "'");
  std::string grown;
  call_with_other_device_current(ctx, [&] { grown = ring.grow(kResizeGrownSlotBytes, kResizeGrowSeq); });
  expect_blob(grown, 2, kResizeGrowSeq, kResizeGrownSlotBytes, "grow");
  // Generation 0 is already out of reach, but only a receive gives generations back; the shrunk one
  // still starts last, so it stays the one slot_bytes() describes.
  expect_state(3, 1, kResizeShrunkSlotBytes, "after the grow");
  send_frame(ctx.sock, grown);

  for (uint64_t seq = kResizeGrowSeq; seq <= kResizeLastFullSeq; ++seq) {
    if (seq == kResizeShrinkSeq) {
      CopyRegion too_big{arena.device(kResizeShrunkSlotBytes + 1), 0, kResizeShrunkSlotBytes + 1};
      expect_protocol_error([&] { ring.enqueue_receive(seq, &too_big, 1, stream); },
                            "exceeds slot_bytes " + std::to_string(kResizeShrunkSlotBytes) + " (data generation 1)",
                            "message bigger than the shrunk slots");
    }
    receive(seq);
    // From message 3 on nothing reaches generation 0; from message 8 on nothing reaches the grown one.
    expect_state(seq + 1 < kResizeShrinkSeq ? 2 : 1, 1, kResizeShrunkSlotBytes,
                 "after receiving message " + std::to_string(seq));
  }
  CHECK_MSG(bad_bytes == 0, std::to_string(bad_bytes) + " wrong bytes, first at " + first_bad);

  const std::string late = ring.resize(kResizeLateSlotBytes, kResizeLateSeq);
  expect_state(2, 3, kResizeLateSlotBytes, "after the late resize");
  send_frame(ctx.sock, late);
  receive(kResizeLateSeq);
  expect_state(1, 3, kResizeLateSlotBytes, "after receiving the late message");

  expect_protocol_error([&] { ring.resize(kResizeInitialSlotBytes, 0); }, "already received", "resize for message 0");
  expect_protocol_error([&] { ring.resize(kResizeInitialSlotBytes, kResizeLateSeq); }, "already received",
                        "resize for the last received message");
  expect_protocol_error([&] { ring.grow(kResizeInitialSlotBytes, kResizeLateSeq); }, "already received",
                        "grow for the last received message");
  expect_state(1, 3, kResizeLateSlotBytes, "after the refused resizes");
  CHECK_MSG(ring.next_seq() == kResizeLateSeq + 1, std::to_string(ring.next_seq()));
  CHECK(recv_frame(ctx.sock, "end of resize case") == "done");
}

void resize_sender(Context& ctx, Arena& arena) {
  const std::string initial = recv_frame(ctx.sock, "resize handles");
  auto& ring = arena.make<IpcRingSender>(ctx.device, initial, "test ipc resize rank 1 -> rank 0");
  cudaStream_t stream = arena.stream();
  const auto filled_regions = [&](uint64_t seq) {
    std::vector<CopyRegion> regions = resize_layout(seq);
    for (size_t r = 0; r < regions.size(); ++r) {
      std::vector<unsigned char> host(regions[r].bytes);
      for (size_t i = 0; i < host.size(); ++i) host[i] = round_trip_byte(seq, r, i);
      regions[r].local = arena.device(host.size());
      CUDA_CHECK(cudaMemcpy(regions[r].local, host.data(), host.size(), cudaMemcpyHostToDevice));
    }
    return regions;
  };
  const auto expect_next = [&](uint32_t generation, size_t slot_bytes, const std::string& when) {
    CHECK_MSG(ring.generation() == generation && ring.slot_bytes() == slot_bytes,
              when + ": message " + std::to_string(ring.next_seq()) + " would go to generation " +
                  std::to_string(ring.generation()) + " of " + std::to_string(ring.slot_bytes()) +
                  "-byte slots; expected " + std::to_string(generation) + ", " + std::to_string(slot_bytes));
  };

  for (uint64_t seq = 0; seq < kResizeGrowSeq; ++seq) ring.enqueue_send(seq, filled_regions(seq), stream);
  const std::string shrunk = recv_frame(ctx.sock, "shrunk handles");
  ring.update(shrunk);
  expect_next(0, kResizeInitialSlotBytes, "the shrink starts later");

  const std::vector<CopyRegion> first_grown = filled_regions(kResizeGrowSeq);
  expect_protocol_error([&] { ring.enqueue_send(kResizeGrowSeq, first_grown, stream); },
                        "exceeds slot_bytes " + std::to_string(kResizeInitialSlotBytes) + " (data generation 0)",
                        "message bigger than the initial slots");
  send_frame(ctx.sock, resize_grow_request());
  const std::string grown = recv_frame(ctx.sock, "grown handles");
  call_with_other_device_current(ctx, [&] { ring.update(grown); });

  for (uint64_t seq = kResizeGrowSeq; seq <= kResizeLastFullSeq; ++seq) {
    if (seq < kResizeShrinkSeq) {
      expect_next(2, kResizeGrownSlotBytes, "grown message");
    } else {
      expect_next(1, kResizeShrunkSlotBytes, "shrunk message");
    }
    if (seq == kResizeShrinkSeq) {
      CopyRegion too_big{arena.device(kResizeShrunkSlotBytes + 1), 0, kResizeShrunkSlotBytes + 1};
      expect_protocol_error([&] { ring.enqueue_send(seq, &too_big, 1, stream); },
                            "exceeds slot_bytes " + std::to_string(kResizeShrunkSlotBytes) + " (data generation 1)",
                            "message bigger than the shrunk slots");
    }
    ring.enqueue_send(seq, seq == kResizeGrowSeq ? first_grown : filled_regions(seq), stream);
  }

  // Blobs seen before are ignored, even those whose first message was sent long ago and whose
  // generation this end has already given back.
  ring.update(initial);
  ring.update(grown);
  ring.update(shrunk);
  expect_next(1, kResizeShrunkSlotBytes, "after repeated updates");

  ring.enqueue_send(kResizeLateSeq, filled_regions(kResizeLateSeq), stream);
  const std::string late = recv_frame(ctx.sock, "late handles");
  expect_protocol_error([&] { ring.update(late); },
                        "starts at message " + std::to_string(kResizeLateSeq) + ", but message " +
                            std::to_string(kResizeLateSeq) + " was already sent",
                        "update for a message already sent");
  expect_next(1, kResizeShrunkSlotBytes, "after the refused update");
  ring.enqueue_wait_consumed(kResizeLateSeq, stream);
  sync_stream(stream, "resize case: last message consumed");
  send_frame(ctx.sock, "done");
}

// ---- case 3: bandwidth (printed, not asserted) ------------------------------------------------------

struct BandwidthPhase {
  const char* name;
  size_t bytes;
  int messages;
  bool print;
};
constexpr BandwidthPhase kPhases[] = {
    {"warm-up 64 MiB", 64 * MiB, 4, false},
    {"64 MiB", 64 * MiB, 16, true},
    {"256 MiB", 256 * MiB, 8, true},
};
constexpr uint32_t kBandwidthSlots = 4;

void bandwidth_receiver(Context& ctx, Arena& arena) {
  auto& ring = arena.make<IpcRingReceiver>(ctx.device, kBandwidthSlots, 64 * MiB, "test ipc bandwidth");
  send_frame(ctx.sock, ring.export_handles());
  cudaStream_t stream = arena.stream();
  void* dest = arena.device(256 * MiB);
  uint64_t seq = 0;
  for (const BandwidthPhase& phase : kPhases) {
    // The receives are enqueued before the sender starts its clock.
    std::string handles;
    if (phase.bytes > ring.slot_bytes()) handles = ring.grow(phase.bytes, seq);
    for (int i = 0; i < phase.messages; ++i) {
      CopyRegion region{dest, 0, phase.bytes};
      ring.enqueue_receive(seq++, &region, 1, stream);
    }
    send_frame(ctx.sock, handles.empty() ? std::string("go") : handles);
    sync_stream(stream, std::string("bandwidth phase ") + phase.name);
    CHECK(recv_frame(ctx.sock, std::string("end of bandwidth phase ") + phase.name) == "done");
  }
}

void bandwidth_sender(Context& ctx, Arena& arena, bool same_device) {
  auto& ring = arena.make<IpcRingSender>(ctx.device, recv_frame(ctx.sock, "bandwidth handles"), "test ipc bandwidth");
  cudaStream_t stream = arena.stream();
  void* source = arena.device(256 * MiB);
  CUDA_CHECK(cudaMemset(source, 0x3C, 256 * MiB));
  cudaEvent_t start = arena.event();
  cudaEvent_t stop = arena.event();
  uint64_t seq = 0;
  for (const BandwidthPhase& phase : kPhases) {
    const std::string go = recv_frame(ctx.sock, std::string("go for bandwidth phase ") + phase.name);
    if (go != "go") ring.update(go);
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < phase.messages; ++i) {
      CopyRegion region{source, 0, phase.bytes};
      ring.enqueue_send(seq++, &region, 1, stream);
    }
    ring.enqueue_wait_consumed(seq - 1, stream);  // the receiver's ack of the last message is visible
    CUDA_CHECK(cudaEventRecord(stop, stream));
    sync_stream(stream, std::string("bandwidth phase ") + phase.name);
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (phase.print) {
      const double bytes = static_cast<double>(phase.bytes) * phase.messages;
      char line[256];
      std::snprintf(line, sizeof(line), "bandwidth %s x %d: %.3f ms, %.1f GB/s (%s, %u slots; not asserted)",
                    phase.name, phase.messages, ms, bytes / (ms * 1e-3) / 1e9,
                    same_device ? "both ends on one GPU" : "GPU 1 -> GPU 0", kBandwidthSlots);
      log_line(line);
    }
    send_frame(ctx.sock, "done");
  }
}

// ---- process bodies ---------------------------------------------------------------------------------

struct Case {
  const char* name;
  std::function<void(Context&, Arena&)> receiver;
  std::function<void(Context&, Arena&)> sender;
};

// Runs the cases in order; after the first failure the pair is out of step, so the process reports and
// exits at once (without freeing: a stream may wait forever on a flag the peer will not write).
int run_child(Context& ctx, const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    if (!g_only_case.empty() && g_only_case != c.name) continue;
    auto* arena = new Arena();
    try {
      rendezvous(ctx.sock, c.name);
      (ctx.receiver ? c.receiver : c.sender)(ctx, *arena);
      delete arena;
      report('P', c.name);
      log_line(std::string("PASS ") + c.name);
    } catch (const std::exception& error) {
      report('F', c.name, error.what());
      log_line(std::string("FAIL ") + c.name + ": " + error.what());
      std::fflush(stdout);
      close(ctx.sock);
      _exit(1);
    }
  }
  return 0;
}

int child_main(bool receiver, int sock) {
  g_role = receiver ? "receiver" : "sender";
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    report('S', "setup", error != cudaSuccess ? cudaGetErrorString(error) : "0 devices");
    return 0;
  }
  Context ctx;
  ctx.sock = sock;
  ctx.receiver = receiver;
  bool same_device = true;
  if (count >= 2) {
    int can_access = 0;
    if (cudaDeviceCanAccessPeer(&can_access, 1, 0) == cudaSuccess && can_access) {
      same_device = false;
    } else if (!receiver) {
      log_line("note: GPU 1 cannot access GPU 0 directly; both ends use GPU 0");
    }
  } else if (!receiver) {
    log_line("note: only one CUDA device visible; receiver and sender both use GPU 0 (IPC between two "
             "processes on one device)");
  }
  ctx.device = receiver || same_device ? 0 : 1;
  ctx.other_device = count >= 2 ? 1 - ctx.device : -1;
  if (cudaSetDevice(ctx.device) != cudaSuccess) {
    report('F', "setup", "cudaSetDevice failed");
    return 1;
  }
  const std::vector<Case> cases = {
      {"round_trip", round_trip_receiver, round_trip_sender},
      {"direct", direct_receiver, direct_sender},
      {"stress", stress_receiver, stress_sender},
      {"resize", resize_receiver, resize_sender},
      {"bandwidth", bandwidth_receiver,
       [same_device](Context& c, Arena& a) { bandwidth_sender(c, a, same_device); }},
  };
  return run_child(ctx, cases);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc > 1) g_only_case = argv[1];
  if (argc > 2 || (argc == 2 && g_only_case != "round_trip" && g_only_case != "direct" &&
                   g_only_case != "stress" && g_only_case != "resize" && g_only_case != "bandwidth")) {
    std::fprintf(stderr, "usage: %s [round_trip|direct|stress|resize|bandwidth]\n", argv[0]);
    return 2;
  }
  // A child whose peer already exited must report the failure, not die writing to the socket.
  signal(SIGPIPE, SIG_IGN);
  // No CUDA call in this process: the children initialize CUDA after the fork.
  int sockets[2];
  int results[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sockets) != 0 || pipe(results) != 0) {
    std::perror("socketpair/pipe");
    return 1;
  }
  std::fflush(stdout);
  pid_t pids[2] = {-1, -1};
  for (int role = 0; role < 2; ++role) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      close(results[0]);
      close(sockets[1 - role]);
      g_results_fd = results[1];
      int status = 1;
      try {
        status = child_main(role == 0, sockets[role]);
      } catch (const std::exception& error) {
        std::fprintf(stderr, "[%s] unexpected: %s\n", role == 0 ? "receiver" : "sender", error.what());
      }
      std::fflush(stdout);
      _exit(status);
    }
    pids[role] = pid;
  }
  close(results[1]);
  close(sockets[0]);
  close(sockets[1]);

  bool crashed[2] = {false, false};
  bool done[2] = {false, false};
  const auto deadline = Clock::now() + std::chrono::seconds(kWatchdogS);
  while (!done[0] || !done[1]) {
    for (int role = 0; role < 2; ++role) {
      if (done[role]) continue;
      int status = 0;
      const pid_t got = waitpid(pids[role], &status, WNOHANG);
      if (got == pids[role]) {
        done[role] = true;
        crashed[role] = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (WIFSIGNALED(status)) {
          std::printf("ipc_ring: %s process died of signal %d\n", role == 0 ? "receiver" : "sender",
                      WTERMSIG(status));
        }
      }
    }
    if (Clock::now() > deadline) {
      std::printf("ipc_ring: watchdog: killing the children after %d s\n", kWatchdogS);
      for (int role = 0; role < 2; ++role) {
        if (!done[role]) {
          kill(pids[role], SIGKILL);
          waitpid(pids[role], nullptr, 0);
          done[role] = true;
          crashed[role] = true;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  std::string lines;
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(results[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    lines.append(buffer, static_cast<size_t>(n));
  }
  int passed = 0, failed = 0, skipped = 0;
  bool reported_failure[2] = {false, false};
  size_t begin = 0;
  while (begin < lines.size()) {
    size_t end = lines.find('\n', begin);
    if (end == std::string::npos) end = lines.size();
    const std::string line = lines.substr(begin, end - begin);
    begin = end + 1;
    if (line.empty()) continue;
    if (line[0] == 'P') ++passed;
    if (line[0] == 'S') ++skipped;
    if (line[0] == 'F') {
      ++failed;
      std::printf("ipc_ring: FAILED %s\n", line.c_str() + 2);
      reported_failure[line.find(" receiver/") == 1 ? 0 : 1] = true;
    }
  }
  for (int role = 0; role < 2; ++role) {
    if (crashed[role] && !reported_failure[role]) {
      ++failed;
      std::printf("ipc_ring: FAILED %s process exited abnormally\n", role == 0 ? "receiver" : "sender");
    }
  }
  if (skipped > 0 && passed == 0 && failed == 0) {
    std::printf("ipc_ring: 0 passed, 0 failed (skipped: no CUDA device)\n");
    return 0;
  }
  std::printf("ipc_ring: %d passed, %d failed\n", passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}
