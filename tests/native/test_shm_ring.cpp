// Native tests for the shared-memory ring (csrc/transport/shm_ring.*); optional argv[1] runs one case.
#include "../../csrc/transport/shm_ring.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using Clock = std::chrono::steady_clock;

constexpr int kSenderRank = 3;
constexpr int kReceiverRank = 5;

std::string channel_name(const char* case_name) { return shm_prefix() + "." + case_name; }

RingConfig receiver_config(const std::string& name, uint32_t num_slots, size_t slot_bytes, double timeout_s) {
  return RingConfig{name, kReceiverRank, kSenderRank, num_slots, slot_bytes, timeout_s};
}

RingConfig sender_config(const std::string& name, double timeout_s) {
  RingConfig config;
  config.name = name;
  config.self_rank = kSenderRank;
  config.peer_rank = kReceiverRank;
  config.timeout_s = timeout_s;
  return config;
}

std::string join(const std::vector<std::string>& items) {
  std::string joined;
  for (const std::string& item : items) joined += (joined.empty() ? "" : ", ") + item;
  return joined;
}

// The SplitMix64 sequence proper: the state steps by the constant splitmix adds (Rng chains its outputs).
uint64_t splitmix64(uint64_t& state) {
  const uint64_t mixed = splitmix(state);
  state += 0x9E3779B97F4A7C15ull;
  return mixed;
}

void fill_pattern(std::byte* out, size_t bytes, uint64_t seed) {
  uint64_t state = seed;
  size_t offset = 0;
  for (; offset + 8 <= bytes; offset += 8) {
    const uint64_t word = splitmix64(state);
    std::memcpy(out + offset, &word, 8);
  }
  if (offset < bytes) {
    const uint64_t word = splitmix64(state);
    std::memcpy(out + offset, &word, bytes - offset);
  }
}

std::vector<std::byte> pattern(size_t bytes, uint64_t seed) {
  std::vector<std::byte> buffer(bytes);
  fill_pattern(buffer.data(), bytes, seed);
  return buffer;
}

bool matches_pattern(const void* data, size_t bytes, uint64_t seed) {
  static thread_local std::vector<std::byte> expected;
  expected.resize(bytes);
  fill_pattern(expected.data(), bytes, seed);
  return bytes == 0 || std::memcmp(data, expected.data(), bytes) == 0;
}

// Runs both sides concurrently; rethrows with both errors so the root cause is visible. A failing
// foreground closes its receiver so the background sender fails fast instead of timing out.
void run_concurrently(const std::function<void()>& background, const std::function<void()>& foreground,
                      ShmRingReceiver& foreground_receiver) {
  std::exception_ptr background_error;
  std::thread thread([&] {
    try {
      background();
    } catch (...) {
      background_error = std::current_exception();
    }
  });
  std::string foreground_message;
  try {
    foreground();
  } catch (const std::exception& error) {
    foreground_message = error.what();
    foreground_receiver.close();
  }
  thread.join();
  std::string background_message;
  if (background_error) {
    try {
      std::rethrow_exception(background_error);
    } catch (const std::exception& error) {
      background_message = error.what();
    }
  }
  if (!foreground_message.empty() || !background_message.empty()) {
    throw TestFailure("foreground: [" + foreground_message + "] background: [" + background_message + "]");
  }
}

// Forks a child running body; the child reports failures on stderr and through its exit code.
pid_t fork_child(const std::function<void()>& body) {
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) throw TestFailure("fork failed");
  if (child == 0) {
    int exit_code = 0;
    try {
      body();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "child %d failed: %s\n", static_cast<int>(getpid()), error.what());
      exit_code = 1;
    }
    std::fflush(nullptr);
    _exit(exit_code);
  }
  return child;
}

int wait_child(pid_t child) {
  int status = 0;
  if (waitpid(child, &status, 0) != child) throw TestFailure("waitpid failed");
  return status;
}

void check_child_succeeded(pid_t child) {
  const int status = wait_child(child);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status " + std::to_string(status));
}

// Blocks until the other process writes a byte, so fork-based cases can sequence their steps.
class Pipe {
 public:
  Pipe() {
    if (pipe(fds_) != 0) throw TestFailure("pipe failed");
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  ~Pipe() {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  void signal() const {
    const char byte = 1;
    if (write(fds_[1], &byte, 1) != 1) throw TestFailure("pipe write failed");
  }
  void wait() const {
    char byte = 0;
    if (read(fds_[0], &byte, 1) != 1) throw TestFailure("pipe read failed");
  }

 private:
  int fds_[2]{};
};

void sleep_forever() {
  while (true) pause();
}

// ---------------------------------------------------------------------------------------------
// Cases

void test_round_trip() {
  const std::string name = channel_name("round_trip");
  ShmRingReceiver receiver(receiver_config(name, 4, 64 << 10, 10.0));
  const auto first = pattern(5, 1);
  const auto second = pattern(17, 2);
  const auto fourth = pattern(100, 4);
  const std::vector<size_t> expected_sizes{5, 17, 0, 100};
  run_concurrently(
      [&] {
        ShmRingSender sender(sender_config(name, 10.0));
        sender.wait_connected();
        sender.send({{first.data(), 5}, {second.data(), 17}, {nullptr, 0}, {fourth.data(), 100}}, 7);
        sender.send_bytes(nullptr, 0, 8);
        sender.send(std::vector<MessagePart>{}, 9);
        const uint8_t tiny[3] = {0xA1, 0xB2, 0xC3};
        sender.send({{&tiny[0], 1}, {&tiny[1], 1}, {&tiny[2], 1}}, 0xFFFFFFFFu);
      },
      [&] {
        receiver.wait_connected();
        CHECK(receiver.sender_attached());
        const Message multi = receiver.recv();
        CHECK(multi.seq == 0 && multi.tag == 7);
        CHECK(reinterpret_cast<uintptr_t>(multi.data) % pipecomm::kPackAlignment == 0);
        const auto* bytes = static_cast<const std::byte*>(multi.data);
        CHECK(std::memcmp(bytes + 0, first.data(), 5) == 0);
        CHECK(std::memcmp(bytes + 16, second.data(), 17) == 0);
        CHECK(std::memcmp(bytes + 48, fourth.data(), 100) == 0);
        CHECK(multi.bytes == 148);
        receiver.release(0);

        const Message empty = receiver.recv();
        CHECK(empty.seq == 1 && empty.tag == 8 && empty.bytes == 0);
        const Message no_parts = receiver.recv();
        CHECK(no_parts.seq == 2 && no_parts.tag == 9 && no_parts.bytes == 0);
        receiver.release(1);
        receiver.release(2);

        const Message split = receiver.recv();
        CHECK(split.seq == 3 && split.tag == 0xFFFFFFFFu && split.bytes == 33);
        const auto* split_bytes = static_cast<const uint8_t*>(split.data);
        CHECK(split_bytes[0] == 0xA1 && split_bytes[16] == 0xB2 && split_bytes[32] == 0xC3);
        receiver.release(3);
      },
      receiver);
  const MessagePart parts[] = {{first.data(), 5}, {second.data(), 17}, {nullptr, 0}, {fourth.data(), 100}};
  CHECK(packed_message_bytes(parts, 4) == 148);
  CHECK(pipecomm::align_to_pack(0) == 0 && pipecomm::align_to_pack(1) == 16 && pipecomm::align_to_pack(16) == 16);
}

void test_ordering() {
  const std::string name = channel_name("ordering");
  constexpr uint64_t kMessages = 10000;
  ShmRingReceiver receiver(receiver_config(name, 8, 4096, 20.0));
  run_concurrently(
      [&] {
        ShmRingSender sender(sender_config(name, 20.0));
        uint8_t body[64];
        for (uint64_t seq = 0; seq < kMessages; ++seq) {
          const size_t body_bytes = seq % 61;
          for (size_t index = 0; index < body_bytes; ++index) body[index] = static_cast<uint8_t>(seq * 31 + index);
          sender.send({{&seq, sizeof(seq)}, {body, body_bytes}}, static_cast<uint32_t>(seq * 7));
        }
      },
      [&] {
        std::deque<Message> held;
        size_t mismatches = 0;
        for (uint64_t seq = 0; seq < kMessages; ++seq) {
          const Message message = receiver.recv();
          uint64_t carried_seq = 0;
          std::memcpy(&carried_seq, message.data, sizeof(carried_seq));
          const size_t body_bytes = seq % 61;
          const auto* body = static_cast<const uint8_t*>(message.data) + 16;
          bool body_ok = message.bytes == (body_bytes == 0 ? 16 : 16 + body_bytes);
          for (size_t index = 0; body_ok && index < body_bytes; ++index) {
            body_ok = body[index] == static_cast<uint8_t>(seq * 31 + index);
          }
          if (message.seq != seq || carried_seq != seq || message.tag != static_cast<uint32_t>(seq * 7) || !body_ok) {
            ++mismatches;
          }
          // Releasing in batches exercises holding several slots at once.
          held.push_back(message);
          if (held.size() >= 1 + (seq / 4) % 4) {
            for (const Message& done : held) receiver.release(done.seq);
            held.clear();
          }
        }
        for (const Message& done : held) receiver.release(done.seq);
        CHECK_MSG(mismatches == 0, std::to_string(mismatches) + " messages out of order or corrupted");
      },
      receiver);
}

struct PlannedMessage {
  uint32_t tag;
  std::vector<size_t> part_bytes;
};

// Sizes and contents derive from the seq alone, so both sides agree without sharing state.
PlannedMessage plan_message(uint64_t seq) {
  uint64_t state = seq * 0xD1B54A32D192ED03ull + 17;
  const uint64_t bucket = splitmix64(state) % 1000;
  size_t total = 0;
  if (bucket < 700) {
    total = splitmix64(state) % 2049;
  } else if (bucket < 980) {
    total = splitmix64(state) % (128 << 10);
  } else {
    total = (512 << 10) + splitmix64(state) % (3584 << 10);
  }
  PlannedMessage planned{static_cast<uint32_t>(splitmix64(state)), {}};
  const size_t num_parts = 1 + splitmix64(state) % 3;
  size_t remaining = total;
  for (size_t part = 0; part + 1 < num_parts; ++part) {
    const size_t bytes = remaining == 0 ? 0 : splitmix64(state) % (remaining + 1);
    planned.part_bytes.push_back(bytes);
    remaining -= bytes;
  }
  planned.part_bytes.push_back(remaining);
  return planned;
}

uint64_t part_seed(uint64_t seq, size_t part) { return seq * 8 + part + 1; }

void maybe_pause(uint64_t& state) {
  const uint64_t roll = splitmix64(state);
  if (roll % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds((roll >> 8) % 201));
}

constexpr uint64_t kStressMessages = 3000;
constexpr uint32_t kStressSlots = 4;
constexpr size_t kStressInitialSlotBytes = 4096;

void run_stress_sender(const std::string& name) {
  ShmRingSender sender(sender_config(name, 30.0));
  std::vector<std::vector<std::byte>> buffers(3);
  std::vector<MessagePart> parts;
  uint64_t delay_state = 99;
  for (uint64_t seq = 0; seq < kStressMessages; ++seq) {
    const PlannedMessage planned = plan_message(seq);
    parts.clear();
    for (size_t part = 0; part < planned.part_bytes.size(); ++part) {
      buffers[part].resize(planned.part_bytes[part]);
      fill_pattern(buffers[part].data(), planned.part_bytes[part], part_seed(seq, part));
      parts.push_back({buffers[part].data(), planned.part_bytes[part]});
    }
    maybe_pause(delay_state);
    sender.send(parts, planned.tag);
  }
}

bool stress_message_intact(const Message& message) {
  const PlannedMessage planned = plan_message(message.seq);
  size_t payload_end = 0;
  for (size_t bytes : planned.part_bytes) payload_end = pipecomm::align_to_pack(payload_end) + bytes;
  if (message.tag != planned.tag || message.bytes != payload_end) return false;
  const auto* data = static_cast<const std::byte*>(message.data);
  size_t offset = 0;
  for (size_t part = 0; part < planned.part_bytes.size(); ++part) {
    offset = pipecomm::align_to_pack(offset);
    if (!matches_pattern(data + offset, planned.part_bytes[part], part_seed(message.seq, part))) return false;
    offset += planned.part_bytes[part];
  }
  return true;
}

// Holds up to num_slots-1 messages and verifies them only at release, proving held slots (also
// across growth into a new generation) are never overwritten; shrinks now and then when empty.
void run_stress_receiver(ShmRingReceiver& receiver) {
  std::deque<Message> held;
  uint64_t decision_state = 7;
  size_t corrupted = 0;
  size_t shrinks = 0;
  auto release_oldest = [&] {
    if (!stress_message_intact(held.front())) ++corrupted;
    receiver.release(held.front().seq);
    held.pop_front();
  };
  for (uint64_t seq = 0; seq < kStressMessages; ++seq) {
    const Message message = receiver.recv();
    CHECK_MSG(message.seq == seq, "got message " + std::to_string(message.seq) + " expected " + std::to_string(seq));
    held.push_back(message);
    const size_t keep = splitmix64(decision_state) % kStressSlots;
    while (held.size() > keep) release_oldest();
    const bool grown = receiver.slot_bytes() > kStressInitialSlotBytes;
    if (seq % 20 == 0 && grown && held.empty() && receiver.shrink(kStressInitialSlotBytes)) ++shrinks;
    maybe_pause(decision_state);
  }
  while (!held.empty()) release_oldest();
  CHECK_MSG(corrupted == 0, std::to_string(corrupted) + " corrupted messages");
  CHECK_MSG(receiver.generation() >= 4, "only " + std::to_string(receiver.generation()) + " data generations");
  std::printf("  %llu messages, %u data generations, %zu shrinks, final slot %zu bytes\n",
              static_cast<unsigned long long>(kStressMessages), receiver.generation(), shrinks, receiver.slot_bytes());
}

void test_stress_threads() {
  const std::string name = channel_name("stress_threads");
  ShmRingReceiver receiver(receiver_config(name, kStressSlots, kStressInitialSlotBytes, 30.0));
  run_concurrently([&] { run_stress_sender(name); }, [&] { run_stress_receiver(receiver); }, receiver);
}

void test_stress_processes() {
  const std::string name = channel_name("stress_processes");
  ShmRingReceiver receiver(receiver_config(name, kStressSlots, kStressInitialSlotBytes, 30.0));
  const pid_t child = fork_child([&] { run_stress_sender(name); });
  try {
    run_stress_receiver(receiver);
  } catch (...) {
    kill(child, SIGKILL);
    wait_child(child);
    throw;
  }
  check_child_succeeded(child);
}

void test_grow_shrink() {
  const std::string name = channel_name("grow_shrink");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  ShmRingReceiver receiver(receiver_config(name, 2, 4096, 10.0));
  std::promise<void> shrunk;
  // The receiver grows whenever it sees a request, also inside an earlier recv(); the sender waits
  // for these before asking, so the generation checks below see one grow at a time.
  std::promise<void> first_checked;
  std::promise<void> second_checked;
  const std::vector<size_t> sizes{100, 1 << 20, 64, 3 << 20, 10, 0, 2 << 20};
  run_concurrently(
      [&] {
        ShmRingSender sender(sender_config(name, 10.0));
        auto send_planned = [&](size_t index) {
          const auto payload = pattern(sizes[index], index);
          sender.send_bytes(payload.data(), payload.size(), static_cast<uint32_t>(index));
        };
        // Bounded waits: a failed receiver never sets them, and the test must fail, not hang.
        auto await_receiver = [](std::promise<void>& signal, const char* what) {
          CHECK_MSG(signal.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready, what);
        };
        send_planned(0);
        await_receiver(first_checked, "the receiver never checked generation 1");
        send_planned(1);
        send_planned(2);
        await_receiver(second_checked, "the receiver never checked generation 2");
        send_planned(3);
        CHECK(sender.slot_bytes() >= (3u << 20));
        await_receiver(shrunk, "the receiver never shrank");
        send_planned(4);
        CHECK_MSG(sender.slot_bytes() == page, "sender slot " + std::to_string(sender.slot_bytes()));
        send_planned(5);
        send_planned(6);
        CHECK(sender.slot_bytes() >= (2u << 20));
      },
      [&] {
        auto expect = [&](const Message& message, size_t index) {
          CHECK(message.seq == index && message.tag == index && message.bytes == sizes[index]);
          CHECK_MSG(matches_pattern(message.data, message.bytes, index), "message " + std::to_string(index));
        };
        const Message small = receiver.recv();
        expect(small, 0);
        CHECK(receiver.generation() == 1 && receiver.slot_bytes() == 4096);
        first_checked.set_value();
        CHECK(!receiver.shrink(1));  // still holding message 0
        receiver.release(0);

        const Message large = receiver.recv();
        expect(large, 1);
        CHECK(receiver.generation() == 2 && receiver.slot_bytes() >= (1u << 20));
        second_checked.set_value();
        receiver.release(1);

        const Message held = receiver.recv();
        const Message larger = receiver.recv();  // grows while message 2 is held in the old generation
        expect(larger, 3);
        expect(held, 2);
        CHECK(receiver.generation() == 3 && receiver.slot_bytes() >= (3u << 20));
        receiver.release(2);
        receiver.release(3);

        CHECK(!receiver.shrink(64u << 20));  // not smaller
        CHECK(receiver.shrink(1));
        CHECK(receiver.generation() == 4 && receiver.slot_bytes() == page);
        CHECK(!receiver.shrink(1));  // previous resize not adopted yet
        shrunk.set_value();

        for (size_t index = 4; index < sizes.size(); ++index) {
          const Message message = receiver.recv();
          expect(message, index);
          receiver.release(index);
        }
        CHECK(receiver.generation() == 5 && receiver.slot_bytes() >= (2u << 20));
      },
      receiver);
}

void test_timeouts() {
  const std::string name = channel_name("timeouts");
  {
    ShmRingReceiver receiver(receiver_config(name, 4, 4096, 0.2));
    const auto start = Clock::now();
    const std::string unattached = expect_throw<TimeoutError>([&] { receiver.recv(); }, "recv before attach");
    check_contains(unattached, "pipecomm shm channel rank 3 -> rank 5: rank 5 timed out after 0.2 s waiting to "
                               "receive message 0 (rank 3 has not attached)");
    CHECK(seconds_since(start) >= 0.19 && seconds_since(start) < 2.0);
    check_contains(expect_throw<TimeoutError>([&] { receiver.wait_connected(); }, "receiver connect"),
                   "rank 5 timed out after 0.2 s waiting for rank 3 to attach");

    ShmRingSender sender(sender_config(name, 0.2));
    sender.send_bytes(nullptr, 0, 1);
    sender.send_bytes(nullptr, 0, 2);
    receiver.release(receiver.recv().seq);
    receiver.release(receiver.recv().seq);
    const auto idle_start = Clock::now();
    check_contains(expect_throw<TimeoutError>([&] { receiver.recv(); }, "recv idle"),
                   "pipecomm shm channel rank 3 -> rank 5: rank 5 timed out after 0.2 s waiting to receive message 2 "
                   "(rank 3 has sent 2 messages)");
    CHECK(seconds_since(idle_start) >= 0.19 && seconds_since(idle_start) < 2.0);
    CHECK(!receiver.try_recv().has_value());

    sender.send_bytes(nullptr, 0, 3);
    sender.send_bytes(nullptr, 0, 4);
    sender.send_bytes(nullptr, 0, 5);
    sender.send_bytes(nullptr, 0, 6);
    const auto full_start = Clock::now();
    check_contains(expect_throw<TimeoutError>([&] { sender.send_bytes(nullptr, 0, 7); }, "send on full ring"),
                   "pipecomm shm channel rank 3 -> rank 5: rank 3 timed out after 0.2 s waiting to send message 6 "
                   "(ring full: rank 5 has not released message 2)");
    CHECK(seconds_since(full_start) >= 0.19 && seconds_since(full_start) < 2.0);

    for (int index = 0; index < 4; ++index) receiver.release(receiver.recv().seq);
    const std::vector<std::byte> large(64 << 10);
    check_contains(expect_throw<TimeoutError>([&] { sender.send_bytes(large.data(), large.size(), 8); }, "send needing grow"),
                   "rank 3 timed out after 0.2 s waiting to send message 6 (rank 5 has not grown the slots to 65536 "
                   "bytes; it does so inside recv()/try_recv())");
  }
  ShmRingSender orphan(sender_config(channel_name("timeouts_no_receiver"), 0.2));
  check_contains(expect_throw<TimeoutError>([&] { orphan.wait_connected(); }, "sender connect"),
                 "pipecomm shm channel rank 3 -> rank 5: rank 3 timed out after 0.2 s waiting for rank 5 to create "
                 "the channel");
}

void test_closed_peer() {
  const std::string name = channel_name("closed_peer");
  {
    ShmRingReceiver receiver(receiver_config(name, 4, 4096, 5.0));
    ShmRingSender sender(sender_config(name, 5.0));
    for (uint32_t tag = 0; tag < 3; ++tag) sender.send_bytes(&tag, sizeof(tag), tag);
    sender.close();
    check_contains(expect_throw<ProtocolError>([&] { sender.send_bytes(nullptr, 0, 0); }, "send after close"),
                   "rank 3 cannot send: the channel was closed");
    for (uint64_t seq = 0; seq < 3; ++seq) {
      const Message message = receiver.recv();
      CHECK(message.seq == seq && message.tag == seq);
      receiver.release(seq);
    }
    const auto start = Clock::now();
    check_contains(expect_throw<ProtocolError>([&] { receiver.recv(); }, "recv after sender closed"),
                   "pipecomm shm channel rank 3 -> rank 5: peer rank 3 closed the channel while rank 5 was waiting to "
                   "receive message 3");
    CHECK(seconds_since(start) < 1.0);
    expect_throw<ProtocolError>([&] { receiver.try_recv(); }, "try_recv after sender closed");
  }
  ShmRingReceiver receiver(receiver_config(name, 4, 4096, 5.0));
  ShmRingSender sender(sender_config(name, 5.0));
  sender.send_bytes(nullptr, 0, 0);
  receiver.close();
  check_contains(expect_throw<ProtocolError>([&] { sender.send_bytes(nullptr, 0, 1); }, "send after receiver closed"),
                 "peer rank 5 closed the channel while rank 3 was waiting to send message 1");
  check_contains(expect_throw<ProtocolError>([&] { receiver.recv(); }, "recv after close"),
                 "rank 5 cannot receive: the channel was closed");
}

void test_release_order() {
  const std::string name = channel_name("release_order");
  ShmRingReceiver receiver(receiver_config(name, 2, 4096, 5.0));
  ShmRingSender sender(sender_config(name, 5.0));
  CHECK(!receiver.try_recv().has_value());
  sender.send_bytes(nullptr, 0, 0);
  sender.send_bytes(nullptr, 0, 1);
  const auto first = receiver.try_recv();
  CHECK(first.has_value() && first->seq == 0);
  CHECK(receiver.recv().seq == 1);
  check_contains(expect_throw<ProtocolError>([&] { receiver.release(1); }, "release out of order"),
                 "rank 5 released message 1 out of order: the next message to release is 0");
  check_contains(expect_throw<ProtocolError>([&] { receiver.recv(); }, "recv holding every slot"),
                 "rank 5 holds all 2 slots unreleased; release message 0 before receiving message 2");
  receiver.release(0);
  receiver.release(1);
  check_contains(expect_throw<ProtocolError>([&] { receiver.release(2); }, "release unreceived"),
                 "released message 2 out of order: no received message is waiting to be released");
}

void test_bad_setup() {
  const std::string name = channel_name("bad_setup");
  const std::string forged = name + ".pid" + std::to_string(getpid()) + ".ctl";
  const int fd = shm_open(forged.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, 4096) == 0);
  const uint32_t bogus_magic = 0xDEADBEEF;
  CHECK(pwrite(fd, &bogus_magic, sizeof(bogus_magic), 0) == sizeof(bogus_magic));
  close(fd);
  ShmRingSender sender(sender_config(name, 2.0));
  const std::string bad_header = expect_throw<ProtocolError>([&] { sender.wait_connected(); }, "bad magic");
  shm_unlink(forged.c_str());
  check_contains(bad_header, "bad header in " + forged);

  ShmRingReceiver receiver(receiver_config(name, 4, 4096, 2.0));
  RingConfig miswired = sender_config(name, 2.0);
  miswired.self_rank = 4;
  ShmRingSender wrong_rank(miswired);
  check_contains(expect_throw<ProtocolError>([&] { wrong_rank.wait_connected(); }, "miswired ranks"),
                 "belongs to channel rank 3 -> rank 5");
  ShmRingSender first(sender_config(name, 2.0));
  first.wait_connected();

  for (const char* bad_name : {"no_slash", "/", "/a/b"}) {
    RingConfig config = receiver_config(bad_name, 4, 4096, 1.0);
    expect_throw<std::invalid_argument>([&] { ShmRingReceiver invalid(config); }, bad_name);
  }
  RingConfig no_slots = receiver_config(name + "x", 0, 4096, 1.0);
  expect_throw<std::invalid_argument>([&] { ShmRingReceiver invalid(no_slots); }, "zero slots");
  expect_throw<std::invalid_argument>([] { sweep_stale_segments("/"); }, "empty sweep prefix");
}

void test_permissions() {
  const std::string name = channel_name("permissions");
  ShmRingReceiver receiver(receiver_config(name, 4, 4096, 5.0));
  const auto entries = segments_with_prefix(name);
  CHECK_MSG(entries.size() == 2, join(entries));  // control + first data generation
  for (const std::string& entry : entries) {
    struct stat status {};
    CHECK(stat(("/dev/shm/" + entry).c_str(), &status) == 0);
    CHECK_MSG((status.st_mode & 07777) == 0600, entry + " has mode " + std::to_string(status.st_mode & 07777));
    CHECK(status.st_uid == geteuid());
  }
  CHECK(std::find(entries.begin(), entries.end(), receiver.control_segment_name().substr(1)) != entries.end());
  ShmRingSender sender(sender_config(name, 5.0));
  sender.wait_connected();
  // Both sides map everything once attached, so no name is needed any more.
  CHECK_MSG(segments_with_prefix(name).empty(), join(segments_with_prefix(name)));
}

void test_peer_death() {
  {
    const std::string name = channel_name("peer_death_sender");
    ShmRingReceiver receiver(receiver_config(name, 4, 4096, 10.0));
    const pid_t child = fork_child([&] {
      ShmRingSender sender(sender_config(name, 10.0));
      for (uint64_t seq = 0; seq < 2; ++seq) sender.send_bytes(&seq, sizeof(seq), 11);
      raise(SIGKILL);
    });
    for (uint64_t seq = 0; seq < 2; ++seq) {
      const Message message = receiver.recv();
      CHECK(message.seq == seq && message.bytes == sizeof(seq) && message.tag == 11);
      CHECK(std::memcmp(message.data, &seq, sizeof(seq)) == 0);
      receiver.release(seq);
    }
    // The child stays an unreaped zombie here, which must still count as dead.
    const auto start = Clock::now();
    const std::string died = expect_throw<PeerDiedError>([&] { receiver.recv(); }, "recv from dead sender");
    const double elapsed = seconds_since(start);
    const int status = wait_child(child);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    check_contains(died, "pipecomm shm channel rank 3 -> rank 5: peer rank 3 (pid " + std::to_string(child) +
                             ") died while rank 5 was waiting to receive message 2");
    CHECK_MSG(elapsed < 1.0, std::to_string(elapsed) + " s to notice");
  }
  const std::string name = channel_name("peer_death_receiver");
  Pipe created;
  const pid_t child = fork_child([&] {
    ShmRingReceiver receiver(receiver_config(name, 2, 4096, 10.0));
    created.signal();
    sleep_forever();
  });
  created.wait();
  ShmRingSender sender(sender_config(name, 10.0));
  sender.send_bytes(nullptr, 0, 0);
  sender.send_bytes(nullptr, 0, 1);
  kill(child, SIGKILL);
  const auto start = Clock::now();
  const std::string died = expect_throw<PeerDiedError>([&] { sender.send_bytes(nullptr, 0, 2); }, "send to dead receiver");
  const double elapsed = seconds_since(start);
  wait_child(child);
  check_contains(died, "pipecomm shm channel rank 3 -> rank 5: peer rank 5 (pid " + std::to_string(child) +
                           ") died while rank 3 was waiting to send message 2");
  CHECK_MSG(elapsed < 1.0, std::to_string(elapsed) + " s to notice");
}

void test_crash_cleanup() {
  {
    // Killed receiver: the attached sender already unlinked every name, so nothing is left.
    const std::string name = channel_name("crash_receiver");
    Pipe created;
    const pid_t child = fork_child([&] {
      ShmRingReceiver receiver(receiver_config(name, 4, 4096, 10.0));
      created.signal();
      receiver.wait_connected();
      sleep_forever();
    });
    created.wait();
    ShmRingSender sender(sender_config(name, 10.0));
    sender.wait_connected();
    CHECK_MSG(segments_with_prefix(name).empty(), join(segments_with_prefix(name)));
    kill(child, SIGKILL);
    wait_child(child);
    sender.close();
    CHECK_MSG(segments_with_prefix(name).empty(), join(segments_with_prefix(name)));
  }
  {
    // Killed sender: the surviving receiver unlinks on close.
    const std::string name = channel_name("crash_sender");
    ShmRingReceiver receiver(receiver_config(name, 4, 4096, 10.0));
    const pid_t child = fork_child([&] {
      ShmRingSender sender(sender_config(name, 10.0));
      sender.wait_connected();
      raise(SIGKILL);
    });
    wait_child(child);
    CHECK_MSG(segments_with_prefix(name).empty(), join(segments_with_prefix(name)));
    expect_throw<PeerDiedError>([&] { receiver.recv(); }, "recv from killed sender");
    receiver.close();
    CHECK_MSG(segments_with_prefix(name).empty(), join(segments_with_prefix(name)));
  }
  // Killed before anyone attached: the names stay until a sweep, which spares live owners.
  const std::string orphan_name = channel_name("crash_orphan");
  const std::string live_name = channel_name("crash_live");
  Pipe created;
  const pid_t child = fork_child([&] {
    ShmRingReceiver receiver(receiver_config(orphan_name, 4, 4096, 10.0));
    created.signal();
    sleep_forever();
  });
  created.wait();
  kill(child, SIGKILL);
  wait_child(child);
  CHECK_MSG(segments_with_prefix(orphan_name).size() == 2, join(segments_with_prefix(orphan_name)));
  ShmRingReceiver live(receiver_config(live_name, 4, 4096, 10.0));
  const size_t removed = sweep_stale_segments(channel_name("crash_"));
  CHECK_MSG(removed == 2, std::to_string(removed) + " removed");
  CHECK_MSG(segments_with_prefix(orphan_name).empty(), join(segments_with_prefix(orphan_name)));
  CHECK(segments_with_prefix(live_name).size() == 2);
  CHECK(sweep_stale_segments(channel_name("crash_")) == 0);
}

// A forked child (e.g. a DataLoader worker) that closes inherited ends must leave the parent's channel working.
void test_fork_inherited() {
  const std::string name = channel_name("fork_inherited");
  ShmRingReceiver receiver(receiver_config(name, 4, 4096, 5.0));
  ShmRingSender sender(sender_config(name, 5.0));
  check_child_succeeded(fork_child([&] { receiver.close(); }));
  CHECK_MSG(segments_with_prefix(name).size() == 2, join(segments_with_prefix(name)));
  sender.send_bytes(nullptr, 0, 1);
  check_child_succeeded(fork_child([&] {
    sender.close();
    receiver.close();
  }));
  sender.send_bytes(nullptr, 0, 2);
  for (uint32_t tag = 1; tag <= 2; ++tag) {
    const Message message = receiver.recv();
    CHECK(message.tag == tag);
    receiver.release(message.seq);
  }
}

const TestCase kTestCases[] = {
    {"round_trip", test_round_trip, false},
    {"ordering", test_ordering, false},
    {"stress_threads", test_stress_threads, false},
    {"stress_processes", test_stress_processes, true},
    {"grow_shrink", test_grow_shrink, false},
    {"timeouts", test_timeouts, false},
    {"closed_peer", test_closed_peer, false},
    {"release_order", test_release_order, false},
    {"bad_setup", test_bad_setup, false},
    {"permissions", test_permissions, false},
    {"peer_death", test_peer_death, true},
    {"crash_cleanup", test_crash_cleanup, true},
    {"fork_inherited", test_fork_inherited, true},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("shm_ring", kTestCases, argc, argv); }
