// Native tests for the bounds on receiving ahead of the peer's notes (csrc/transport/ipc_receive_ahead.h): a model of
// both ends of an IPC channel over real shm rings, the peer deciding each message against the posts it has drained,
// as IpcChannel::send does, and this end posting and releasing as IpcChannel's receive does.
#include "../../csrc/transport/ipc_receive_ahead.h"

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/transport/ipc_host_inbox.h"
#include "../../csrc/transport/ipc_peer_posts.h"
#include "../../csrc/transport/ipc_records.h"
#include "../../csrc/transport/ring_tags.h"
#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kLayout = 0xA;
constexpr uint64_t kBytes = 4096;
constexpr uint32_t kSlots = 4;

void sleep_a_little(std::mt19937& rng) {
  if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
}

// `messages` data messages of one layout; this end posts `depth` messages ahead of the one it receives and holds its
// releases back at random. Checks the two bounds against what the peer did: every post made from
// first_decided_after_posting() on was in the peer's hands when it decided that message, and every message below
// first_unsendable() arrives without a further release.
void run_model(const char* name, uint64_t messages, uint64_t depth, unsigned seed) {
  ShmRingReceiver host_receiver(RingConfig{shm_prefix() + "." + name, 1, 0, kSlots, 4096, 10.0, "ipc"});
  ShmRingSender host_sender(RingConfig{shm_prefix() + "." + name, 0, 1, kSlots, 4096, 10.0, "ipc"});
  ShmRingReceiver post_receiver(RingConfig{shm_prefix() + "." + name + ".posts", 0, 1, 64, 4096, 10.0, "ipc"});
  ShmRingSender post_sender(RingConfig{shm_prefix() + "." + name + ".posts", 1, 0, 64, 4096, 10.0, "ipc"});
  host_sender.wait_connected();
  host_receiver.wait_connected();
  post_sender.wait_connected();
  post_receiver.wait_connected();
  HostInbox inbox(host_receiver, kSlots, /*self_rank=*/1, /*peer_rank=*/0);
  PeerPosts peer_posts(post_receiver, "pipecomm ipc channel rank 0 -> rank 1", [](const std::string&) {});

  std::vector<std::atomic<int>> found(messages);  // per message: 1 if the peer had a post for it when it decided
  std::thread peer([&] {
    std::mt19937 rng(seed + 1);
    for (uint64_t seq = 0; seq < messages; ++seq) {
      sleep_a_little(rng);
      const std::optional<PostRecord> post = peer_posts.post_for_next_message(seq, kLayout, kBytes);
      found[seq].store(post ? 1 : 0, std::memory_order_relaxed);
      const DataNote note{post ? post->post : 0, 0};
      host_sender.send_bytes(&note, sizeof(note), post ? kTagDataDirect : kTagData);  // waits while the ring is full
    }
  });

  std::mt19937 rng(seed);
  std::vector<int> decided_after(messages + depth + 1, 0);
  uint64_t posted_through = 0;  // messages below it have a post
  uint64_t next_post = 0;
  int64_t known_data = -1;
  int64_t known_host = -1;
  int64_t unreleased = -1;  // the newest host message read and not released; -1: none
  std::string failure;
  for (uint64_t seq = 0; seq < messages; ++seq) {
    const auto bounds = [&] { return ReceiveAheadBounds{kSlots, inbox.released(), known_data, known_host}; };
    // Some steps post less of the window (a full post ring, no memory): those posts come later, some of them too
    // late for the peer's decision, which is what the bound must tell.
    const uint64_t window_end = rng() % 2 == 0 ? seq + 1 + depth : std::min(seq + 1 + depth, posted_through + rng() % 2);
    for (uint64_t ahead = std::max(posted_through, seq + 1); ahead < window_end; ++ahead) {
      const PostRecord record{ahead, next_post++, kLayout, kBytes, 0, {}};
      decided_after[ahead] = ahead >= bounds().first_decided_after_posting();
      post_sender.send_bytes(&record, sizeof(record), kTagPost);
      posted_through = ahead + 1;
    }
    const bool must_come = static_cast<int64_t>(seq) < bounds().first_unsendable() && failure.empty();
    std::optional<Message> message;
    for (int attempt = must_come ? 0 : 1; attempt < 2 && !message; ++attempt) {
      if (attempt == 1 && unreleased >= 0) {
        inbox.release(static_cast<uint64_t>(unreleased));  // else the peer could never send it
        unreleased = -1;
      }
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(attempt == 0 ? 2 : 10);
      while (!(message = (inbox.poll(nullptr), inbox.next_message())) && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      if (!message && attempt == 0 && failure.empty()) {
        failure = "message " + std::to_string(seq) + " did not come without a release, though below first_unsendable";
      }
    }
    CHECK_MSG(message.has_value(), "message " + std::to_string(seq) + " never came");
    known_data = static_cast<int64_t>(seq);
    known_host = static_cast<int64_t>(message->seq);
    unreleased = static_cast<int64_t>(message->seq);
    if (rng() % 3 == 0) {  // else held back, as notes of messages received ahead are
      inbox.release(message->seq);
      unreleased = -1;
    }
    sleep_a_little(rng);
  }
  if (unreleased >= 0) inbox.release(static_cast<uint64_t>(unreleased));
  peer.join();
  CHECK_MSG(failure.empty(), failure);
  uint64_t guaranteed = 0;
  for (uint64_t seq = 0; seq < messages; ++seq) {
    if (!decided_after[seq]) continue;
    ++guaranteed;
    CHECK_MSG(found[seq].load() == 1, "the post for message " + std::to_string(seq) +
                                          " was made before the peer's decision by the bound, but it decided without it");
  }
  CHECK_MSG(guaranteed > messages / 4, "only " + std::to_string(guaranteed) + " posts were before the decision");
}

void test_posts_made_before_the_decision_are_taken() { run_model("ahead_posts", 400, kSlots + 1, 7); }

void test_a_deeper_post_window_keeps_the_bounds() { run_model("ahead_deep", 400, 2 * kSlots + 3, 11); }

void test_the_bounds_before_any_note() {
  const ReceiveAheadBounds none{kSlots, 0, -1, -1};
  CHECK(none.first_decided_after_posting() == UINT64_MAX);  // nothing known: no post is sure to come first
  CHECK(none.first_unsendable() == kSlots);                 // an empty ring takes num_slots messages
  // Messages 0..9 read, 0..7 released: the peer may already have sent up to 7 + num_slots.
  const ReceiveAheadBounds some{kSlots, 8, 9, 9};
  CHECK(some.first_unsendable() == 8 + kSlots);
  CHECK(some.first_decided_after_posting() == 8 + 1 + kSlots);
}

const TestCase kTestCases[] = {
    {"the_bounds_before_any_note", test_the_bounds_before_any_note, false},
    {"posts_made_before_the_decision_are_taken", test_posts_made_before_the_decision_are_taken, false},
    {"a_deeper_post_window_keeps_the_bounds", test_a_deeper_post_window_keeps_the_bounds, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_receive_ahead", kTestCases, argc, argv); }
