// Native tests for the IPC sender's view of its peer's posts (csrc/transport/ipc_peer_posts.*), over a real shm ring.
#include "../../csrc/transport/ipc_peer_posts.h"

#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/transport/ring_tags.h"
#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;

constexpr uint64_t kLayoutA = 0xA;
constexpr uint64_t kLayoutB = 0xB;

// A post ring with the receiver's end (the data's sender) read by PeerPosts, both ends in this process.
struct PostRing {
  ShmRingReceiver receiver;
  ShmRingSender sender;
  std::vector<std::string> adopted;
  PeerPosts posts;

  explicit PostRing(const char* name)
      : receiver(RingConfig{shm_prefix() + "." + name, 0, 1, 16, 4096, 10.0, "ipc"}),
        sender(RingConfig{shm_prefix() + "." + name, 1, 0, 16, 4096, 10.0, "ipc"}),
        posts(receiver, "pipecomm ipc channel rank 0 -> rank 1",
              [this](const std::string& handles) { adopted.push_back(handles); }) {
    sender.wait_connected();
    receiver.wait_connected();
  }

  void post(uint64_t seq, uint64_t post, uint64_t fingerprint, uint64_t bytes) {
    PostRecord record{seq, post, fingerprint, bytes, 0, {}};
    record.handle[0] = static_cast<char>(post);
    sender.send_bytes(&record, sizeof(record), kTagPost);
  }
  void generation(const std::string& handles) { sender.send_bytes(handles.data(), handles.size(), kTagGeneration); }
  void refuse(const GrowRequest& request, const std::string& reason) {
    std::string payload(sizeof(request), '\0');
    std::memcpy(payload.data(), &request, sizeof(request));
    payload += reason;
    sender.send_bytes(payload.data(), payload.size(), kTagGrowRefused);
  }
};

uint64_t post_number(const std::optional<PostRecord>& record) {
  CHECK(record.has_value());
  CHECK(record->handle[0] == static_cast<char>(record->post));  // the handle's bytes came through
  return record->post;
}

void test_the_newest_post_of_the_layout_and_size_wins() {
  PostRing ring("newest");
  ring.post(0, 0, kLayoutA, 100);
  ring.post(0, 1, kLayoutB, 100);
  ring.post(0, 2, kLayoutA, 100);
  ring.post(1, 3, kLayoutA, 100);
  CHECK(post_number(ring.posts.post_for_next_message(0, kLayoutA, 100)) == 2);
  CHECK(post_number(ring.posts.post_for_next_message(0, kLayoutB, 100)) == 1);
  CHECK(!ring.posts.post_for_next_message(0, kLayoutA, 200));
  CHECK(post_number(ring.posts.post_for_next_message(1, kLayoutA, 100)) == 3);
  CHECK(!ring.posts.post_for_next_message(2, kLayoutA, 100));
}

void test_posts_for_messages_already_sent_are_dropped() {
  PostRing ring("stale");
  ring.post(3, 0, kLayoutA, 100);
  ring.post(5, 1, kLayoutA, 100);
  ring.posts.drain(5);  // messages 0 .. 4 went by slot meanwhile
  CHECK(!ring.posts.post_for_next_message(3, kLayoutA, 100));
  CHECK(post_number(ring.posts.post_for_next_message(5, kLayoutA, 100)) == 1);
}

void test_generations_are_adopted_in_order_as_they_come() {
  PostRing ring("generations");
  ring.generation("first");
  ring.post(0, 0, kLayoutA, 100);
  ring.generation("second");
  CHECK(post_number(ring.posts.post_for_next_message(0, kLayoutA, 100)) == 0);
  CHECK((ring.adopted == std::vector<std::string>{"first", "second"}));
}

void test_a_direct_path_turned_off_stays_off() {
  PostRing ring("off");
  ring.post(0, 0, kLayoutA, 100);
  CHECK(ring.posts.post_for_next_message(0, kLayoutA, 100));
  ring.posts.disable_direct();
  CHECK(!ring.posts.post_for_next_message(0, kLayoutA, 100));
  ring.post(1, 1, kLayoutA, 100);
  ring.generation("still adopted");
  CHECK(!ring.posts.post_for_next_message(1, kLayoutA, 100));
  CHECK(ring.adopted.size() == 1);
}

void test_a_refusal_answers_its_own_request_only() {
  PostRing ring("refusal");
  ring.refuse({65536, 3}, "out of memory");
  ring.posts.drain(3);
  CHECK(ring.posts.refusal_of({65536, 3}) == std::optional<std::string>("out of memory"));
  CHECK(!ring.posts.refusal_of({65536, 4}));
  CHECK(!ring.posts.refusal_of({131072, 3}));
}

void test_unknown_messages_are_protocol_errors() {
  PostRing ring("unknown");
  ring.sender.send_bytes("x", 1, 99);
  check_contains(expect_throw<ProtocolError>([&] { ring.posts.drain(0); }, "an unknown tag"),
                 "rank 0 -> rank 1: post ring message 0 has tag 99 and 1 bytes");
  PostRing truncated("truncated");
  truncated.sender.send_bytes("x", 1, kTagPost);
  check_contains(expect_throw<ProtocolError>([&] { truncated.posts.drain(0); }, "a short post"),
                 "post ring message 0 has tag 4 and 1 bytes");
}

void test_a_closed_peer_ends_the_direct_path() {
  PostRing ring("closed");
  ring.post(0, 0, kLayoutA, 100);
  ring.sender.close("bye");
  CHECK(!ring.posts.failure());
  ring.posts.drain(0);  // takes the post in, then meets the close
  CHECK(ring.posts.failure());
  CHECK(!ring.posts.post_for_next_message(0, kLayoutA, 100));
  check_contains(expect_throw<ProtocolError>([&] { std::rethrow_exception(ring.posts.failure()); }, "the close"),
                 "closed the channel (it aborted: bye)");
}

void test_posts_are_passed_on_the_stream_that_waited_only() {
  PostRing ring("passed");
  int stream = 0;
  int other_stream = 0;
  ring.posts.learn_passed(3, &stream);
  const PostRecord second{0, 2, kLayoutA, 100, 0, {}};
  const PostRecord third{0, 3, kLayoutA, 100, 0, {}};
  CHECK(ring.posts.passed(second, &stream));
  CHECK(!ring.posts.passed(third, &stream));
  CHECK(!ring.posts.passed(second, &other_stream));
}

const TestCase kTestCases[] = {
    {"the_newest_post_of_the_layout_and_size_wins", test_the_newest_post_of_the_layout_and_size_wins, false},
    {"posts_for_messages_already_sent_are_dropped", test_posts_for_messages_already_sent_are_dropped, false},
    {"generations_are_adopted_in_order_as_they_come", test_generations_are_adopted_in_order_as_they_come, false},
    {"a_direct_path_turned_off_stays_off", test_a_direct_path_turned_off_stays_off, false},
    {"a_refusal_answers_its_own_request_only", test_a_refusal_answers_its_own_request_only, false},
    {"unknown_messages_are_protocol_errors", test_unknown_messages_are_protocol_errors, false},
    {"a_closed_peer_ends_the_direct_path", test_a_closed_peer_ends_the_direct_path, false},
    {"posts_are_passed_on_the_stream_that_waited_only", test_posts_are_passed_on_the_stream_that_waited_only, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_peer_posts", kTestCases, argc, argv); }
