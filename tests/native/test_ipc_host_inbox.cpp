// Native tests for the IPC host ring's read-ahead inbox (csrc/transport/ipc_host_inbox.*), over real shm rings.
#include "../../csrc/transport/ipc_host_inbox.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/transport/ring_tags.h"
#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;

// One host ring, both ends in this process.
struct HostRing {
  ShmRingReceiver receiver;
  ShmRingSender sender;
  HostInbox inbox;

  HostRing(const char* name, uint32_t num_slots)
      : receiver(RingConfig{shm_prefix() + "." + name, 1, 0, num_slots, 4096, 10.0, "ipc"}),
        sender(RingConfig{shm_prefix() + "." + name, 0, 1, num_slots, 4096, 10.0, "ipc"}),
        inbox(receiver, num_slots, /*self_rank=*/1, /*peer_rank=*/0) {
    sender.wait_connected();
    receiver.wait_connected();
  }

  void send(uint32_t tag, uint64_t value = 0) { sender.send_bytes(&value, sizeof(value), tag); }
  void ask(uint64_t slot_bytes, uint64_t first_seq) {
    const GrowRequest request{slot_bytes, first_seq};
    sender.send_bytes(&request, sizeof(request), kTagGrow);
  }
};

uint64_t value_of(const Message& message) {
  uint64_t value = 0;
  std::memcpy(&value, message.data, sizeof(value));
  return value;
}

// Receives the next message, which must be `tag` carrying `value`, and releases it.
void receive(HostInbox& inbox, uint32_t tag, uint64_t value) {
  const std::optional<Message> message = inbox.next_message();
  CHECK_MSG(message.has_value(), "no message where tag " + std::to_string(tag) + " was expected");
  CHECK_MSG(message->tag == tag && value_of(*message) == value,
            "tag " + std::to_string(message->tag) + " value " + std::to_string(value_of(*message)));
  inbox.release(message->seq);
}

void test_answers_grow_requests_behind_unreceived_messages() {
  HostRing ring("behind", 8);
  std::vector<uint64_t> answered;
  const HostInbox::GrowAnswer answer = [&](const GrowRequest& request) {
    answered.push_back(request.slot_bytes * 1000 + request.first_seq);
    return true;
  };
  ring.send(kTagMeta, 1);
  ring.send(kTagData, 2);
  ring.ask(4096, 7);
  ring.send(kTagData, 3);
  ring.inbox.poll(answer);
  CHECK(answered == std::vector<uint64_t>{4096 * 1000 + 7});
  receive(ring.inbox, kTagMeta, 1);
  receive(ring.inbox, kTagData, 2);
  receive(ring.inbox, kTagData, 3);
  CHECK(!ring.inbox.next_message());
  CHECK(ring.receiver.released_count() == 4);
  CHECK(ring.inbox.released() == 4);  // the answered request among them, in ring order
  ring.inbox.poll(answer);
  CHECK(answered.size() == 1);  // answered once only
}

void test_a_request_that_cannot_be_answered_now_is_asked_again_first() {
  HostRing ring("again", 8);
  std::vector<uint64_t> asked;
  bool room = false;
  const HostInbox::GrowAnswer answer = [&](const GrowRequest& request) {
    asked.push_back(request.first_seq);
    return room;
  };
  ring.ask(4096, 1);
  ring.ask(8192, 2);
  ring.inbox.poll(answer);
  CHECK(asked == std::vector<uint64_t>{1});  // the second waits behind the first
  room = true;
  ring.inbox.poll(answer);
  CHECK((asked == std::vector<uint64_t>{1, 1, 2}));
  CHECK(ring.receiver.released_count() == 2);
  CHECK(ring.inbox.released() == 2);  // control messages go back by themselves once answered
}

// A ring of one slot holds nothing else while its grow request waits: the answered request must go
// back for the sender's next message to come.
void test_answered_requests_go_back_at_once() {
  HostRing ring("one_slot", 1);
  ring.ask(4096, 0);
  CHECK(!ring.sender.can_send_now());
  ring.inbox.poll([](const GrowRequest&) { return true; });
  CHECK(ring.sender.can_send_now());
  ring.send(kTagData, 5);
  ring.inbox.poll(nullptr);
  receive(ring.inbox, kTagData, 5);
}

void test_the_close_note_is_noted_not_handed_out() {
  HostRing ring("close_note", 4);
  ring.send(kTagData, 1);
  ring.sender.send_bytes(nullptr, 0, kTagUnmapped);
  ring.inbox.poll(nullptr);
  CHECK(ring.inbox.peer_unmapped());
  receive(ring.inbox, kTagData, 1);
  CHECK(!ring.inbox.next_message());
  CHECK(ring.receiver.released_count() == 2);
}

// Taking in a message beyond the ring's slots would be refused by the ring as a misuse.
void test_reads_no_further_ahead_than_the_ring_holds() {
  HostRing ring("full", 2);
  ring.send(kTagData, 1);
  ring.send(kTagData, 2);
  ring.inbox.poll(nullptr);
  ring.inbox.poll(nullptr);
  CHECK(!ring.inbox.failure());
  receive(ring.inbox, kTagData, 1);
  ring.send(kTagData, 3);
  ring.inbox.poll(nullptr);
  receive(ring.inbox, kTagData, 2);
  receive(ring.inbox, kTagData, 3);
}

void test_what_came_before_a_close_still_comes_out() {
  HostRing ring("closed", 4);
  ring.send(kTagData, 1);
  ring.sender.close("stage 0 failed");
  ring.inbox.poll(nullptr);
  CHECK_MSG(!ring.inbox.failure(), "a failure before the last message was handed out");
  receive(ring.inbox, kTagData, 1);
  const std::exception_ptr failure = ring.inbox.failure();
  CHECK(failure);
  const std::string text = expect_throw<ProtocolError>([&] { std::rethrow_exception(failure); }, "the close");
  check_contains(text, "rank 0 -> rank 1: peer rank 0 closed the channel (it aborted: stage 0 failed)");
}

void test_a_malformed_grow_request_is_a_failure() {
  HostRing ring("malformed", 4);
  ring.sender.send_bytes("abc", 3, kTagGrow);
  ring.inbox.poll([](const GrowRequest&) -> bool { throw TestFailure("a malformed request was answered"); });
  const std::exception_ptr failure = ring.inbox.failure();
  CHECK(failure);
  check_contains(expect_throw<ProtocolError>([&] { std::rethrow_exception(failure); }, "the request"),
                 "host message 0 is a grow request of 3 bytes");
}

// The sender in another thread, as the peer process would be: every message comes out once, in order,
// and every request is answered once, whatever the interleaving.
void test_a_concurrent_sender() {
  HostRing ring("concurrent", 4);
  constexpr uint64_t kMessages = 2000;
  std::thread sender([&] {
    for (uint64_t index = 0; index < kMessages; ++index) {
      if (index % 7 == 0) ring.ask(index, index);
      ring.send(kTagData, index);
    }
  });
  uint64_t answered = 0;
  const HostInbox::GrowAnswer answer = [&](const GrowRequest& request) {
    CHECK(request.first_seq == answered * 7);
    ++answered;
    return true;
  };
  for (uint64_t index = 0; index < kMessages; ++index) {
    std::optional<Message> message;
    while (!(message = ring.inbox.next_message())) ring.inbox.poll(answer);
    CHECK(value_of(*message) == index);
    ring.inbox.release(message->seq);
  }
  sender.join();
  ring.inbox.poll(answer);
  CHECK(answered == (kMessages + 6) / 7);
}

// A data note with the caller's notes after it (ring_tags.h) larger than the host ring's slots: the sender
// waits for the ring to grow, which the receiver's wait does, and the message comes out whole, in order.
void test_a_message_larger_than_a_slot_comes_out_whole_in_order() {
  HostRing ring("large", 2);
  std::string large(200 * 1024, '\0');
  for (size_t index = 0; index < large.size(); ++index) large[index] = static_cast<char>(index * 7 % 251);
  std::thread sender([&] {
    ring.send(kTagData, 1);
    ring.sender.send_bytes(large.data(), large.size(), kTagData);
    ring.send(kTagData, 2);
  });
  ControlPlane plane;
  std::atomic<bool> interrupted{false};
  const auto next = [&] { return ring.inbox.wait_for_message(nullptr, plane, 10.0, interrupted); };
  const Message first = next();
  CHECK(value_of(first) == 1);
  ring.inbox.release(first.seq);
  const Message second = next();
  CHECK(second.bytes == large.size() && std::memcmp(second.data, large.data(), large.size()) == 0);
  ring.inbox.release(second.seq);
  const Message last = next();
  CHECK(value_of(last) == 2);
  ring.inbox.release(last.seq);
  sender.join();
}

void test_a_wait_answers_requests_and_services_the_plane() {
  HostRing ring("wait", 4);
  ControlPlane plane;
  std::recursive_mutex other_channel;
  std::atomic<int> serviced{0};
  const ControlPlane::Membership member(plane, other_channel, [&] { ++serviced; });
  std::atomic<bool> interrupted{false};
  int answered = 0;
  std::thread sender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ring.ask(4096, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ring.send(kTagData, 9);
  });
  const Message message = ring.inbox.wait_for_message(
      [&](const GrowRequest&) {
        ++answered;
        return true;
      },
      plane, 10.0, interrupted);
  sender.join();
  CHECK(message.tag == kTagData && value_of(message) == 9);
  CHECK(answered == 1);
  CHECK_MSG(serviced > 0, "the wait never serviced the other channel");
  ring.inbox.release(message.seq);
}

void test_a_wait_times_out_in_the_rings_words() {
  HostRing ring("timeout", 4);
  ControlPlane plane;
  std::atomic<bool> interrupted{false};
  const auto start = std::chrono::steady_clock::now();
  const std::string text = expect_throw<TimeoutError>(
      [&] { ring.inbox.wait_for_message(nullptr, plane, 0.05, interrupted); }, "an empty ring");
  CHECK(seconds_since(start) < 2.0);
  CHECK(text == "pipecomm ipc channel rank 0 -> rank 1: rank 1 timed out after 0.05 s waiting to receive message 0 "
                "(rank 0 has sent 0 messages)");
}

void test_an_interrupted_wait_stops() {
  HostRing ring("interrupted", 4);
  ControlPlane plane;
  std::atomic<bool> interrupted{false};
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    interrupted = true;
  });
  const std::string text = expect_throw<ProtocolError>(
      [&] { ring.inbox.wait_for_message(nullptr, plane, 10.0, interrupted); }, "an interrupt");
  closer.join();
  CHECK(text == "pipecomm ipc channel rank 0 -> rank 1: rank 1 stopped waiting to receive message 0: another thread "
                "is closing the channel");
}

void test_a_wait_ends_when_the_peer_closes() {
  HostRing ring("peer_closed", 4);
  ControlPlane plane;
  std::atomic<bool> interrupted{false};
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ring.sender.close("boom");
  });
  const std::string text = expect_throw<ProtocolError>(
      [&] { ring.inbox.wait_for_message(nullptr, plane, 10.0, interrupted); }, "the peer's close");
  closer.join();
  check_contains(text, "rank 0 -> rank 1: peer rank 0 closed the channel (it aborted: boom) while rank 1 was waiting");
}

const TestCase kTestCases[] = {
    {"answers_grow_requests_behind_unreceived_messages", test_answers_grow_requests_behind_unreceived_messages, false},
    {"a_request_that_cannot_be_answered_now_is_asked_again_first",
     test_a_request_that_cannot_be_answered_now_is_asked_again_first, false},
    {"answered_requests_go_back_at_once", test_answered_requests_go_back_at_once, false},
    {"the_close_note_is_noted_not_handed_out", test_the_close_note_is_noted_not_handed_out, false},
    {"reads_no_further_ahead_than_the_ring_holds", test_reads_no_further_ahead_than_the_ring_holds, false},
    {"what_came_before_a_close_still_comes_out", test_what_came_before_a_close_still_comes_out, false},
    {"a_malformed_grow_request_is_a_failure", test_a_malformed_grow_request_is_a_failure, false},
    {"a_concurrent_sender", test_a_concurrent_sender, false},
    {"a_message_larger_than_a_slot_comes_out_whole_in_order", test_a_message_larger_than_a_slot_comes_out_whole_in_order,
     false},
    {"a_wait_answers_requests_and_services_the_plane", test_a_wait_answers_requests_and_services_the_plane, false},
    {"a_wait_times_out_in_the_rings_words", test_a_wait_times_out_in_the_rings_words, false},
    {"an_interrupted_wait_stops", test_an_interrupted_wait_stops, false},
    {"a_wait_ends_when_the_peer_closes", test_a_wait_ends_when_the_peer_closes, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_host_inbox", kTestCases, argc, argv); }
