// Native tests for the IPC close handshake's host-ring half (csrc/transport/ipc_close_handshake.*), over real shm rings.
#include "../../csrc/transport/ipc_close_handshake.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>

#include "../../csrc/transport/ring_tags.h"
#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using namespace std::chrono_literals;

constexpr auto kPatience = 100ms;

std::string ring_name(const char* test, int from, int to) {
  return shm_prefix() + "." + test + "." + std::to_string(from) + "to" + std::to_string(to);
}

// One end of a channel's host rings: it receives on its own ring and sends into the peer's.
struct End {
  ShmRingReceiver receiver;
  ShmRingSender sender;
  HostInbox inbox;

  End(const char* test, int self, int peer)
      : receiver(RingConfig{ring_name(test, peer, self), self, peer, 4, 4096, 10.0, "ipc"}),
        sender(RingConfig{ring_name(test, self, peer), self, peer, 4, 4096, 10.0, "ipc"}),
        inbox(receiver, 4, self, peer) {}

  void connect() { sender.wait_connected(); }
  void close() {
    sender.close();
    receiver.close();
  }
};

// Two ends of one channel, connected.
struct Pair {
  End a;
  End b;
  explicit Pair(const char* test) : a(test, 0, 1), b(test, 1, 0) {
    a.connect();
    b.connect();
  }
};

CloseOutcome handshake(End& end, bool unmapped, std::chrono::microseconds patience = kPatience) {
  return exchange_close_notes(end.sender, end.inbox, unmapped, patience);
}

std::string describe(const CloseOutcome& outcome) {
  return std::string("peer_unmapped ") + (outcome.peer_unmapped ? "true" : "false") + ", unreceived " +
         (outcome.unreceived ? "true" : "false");
}

void check_outcome(const CloseOutcome& outcome, bool peer_unmapped, bool unreceived) {
  CHECK_MSG(outcome.peer_unmapped == peer_unmapped && outcome.unreceived == unreceived, describe(outcome));
}

void test_ends_that_both_unmapped_free_their_memory() {
  Pair pair("both");
  auto b = std::async(std::launch::async, [&] { return handshake(pair.b, true); });
  check_outcome(handshake(pair.a, true), true, false);
  check_outcome(b.get(), true, false);
}

void test_a_message_never_received_keeps_the_posts() {
  Pair pair("unreceived");
  const DataNote note{0, 0};
  pair.b.sender.send_bytes(&note, sizeof(note), kTagData);
  auto b = std::async(std::launch::async, [&] { return handshake(pair.b, true); });
  check_outcome(handshake(pair.a, true), true, true);
  check_outcome(b.get(), true, false);
}

void test_a_peer_that_keeps_its_mappings_is_waited_for_briefly() {
  Pair pair("kept");
  const auto start = std::chrono::steady_clock::now();
  check_outcome(handshake(pair.a, true), false, false);
  const double waited = seconds_since(start);
  CHECK_MSG(waited >= 0.1 && waited < 2.0, std::to_string(waited) + " s");
}

void test_a_peer_closed_without_its_note_may_still_write() {
  Pair pair("no_note");
  pair.b.close();
  const auto start = std::chrono::steady_clock::now();
  check_outcome(handshake(pair.a, true), false, true);
  CHECK_MSG(seconds_since(start) < 0.1, "waited for a peer that had closed");
}

void test_a_grow_request_is_not_an_unreceived_message() {
  Pair pair("grow");
  const GrowRequest request{1 << 20, 0};
  pair.b.sender.send_bytes(&request, sizeof(request), kTagGrow);
  pair.b.sender.send_bytes(nullptr, 0, kTagUnmapped);
  check_outcome(handshake(pair.a, true), true, false);
}

void test_a_note_met_while_receiving_counts() {
  Pair pair("seen");
  pair.b.sender.send_bytes(nullptr, 0, kTagUnmapped);
  pair.a.inbox.poll(nullptr);
  CHECK(pair.a.inbox.peer_unmapped());
  check_outcome(handshake(pair.a, false, 0us), true, false);
}

// The driver closes a dead process's mappings, but whether its last copies were cut off first, nobody can tell.
void test_a_dead_peer_counts_as_unmapped_and_unreceived() {
  End a("dead", 0, 1);
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    End b("dead", 1, 0);
    b.connect();
    b.receiver.wait_connected();  // the parent attached: it has seen this process alive
    _exit(0);                     // and now it dies without closing, as a crash would
  }
  a.connect();
  int status = 0;
  waitpid(child, &status, 0);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status " + std::to_string(status));
  // The child's receiving ring lives on unlinked: only the parent's sender still maps it.
  check_outcome(handshake(a, true, 2s), true, true);
}

const TestCase kTestCases[] = {
    {"ends_that_both_unmapped_free_their_memory", test_ends_that_both_unmapped_free_their_memory, false},
    {"a_message_never_received_keeps_the_posts", test_a_message_never_received_keeps_the_posts, false},
    {"a_peer_that_keeps_its_mappings_is_waited_for_briefly", test_a_peer_that_keeps_its_mappings_is_waited_for_briefly,
     false},
    {"a_peer_closed_without_its_note_may_still_write", test_a_peer_closed_without_its_note_may_still_write, false},
    {"a_grow_request_is_not_an_unreceived_message", test_a_grow_request_is_not_an_unreceived_message, false},
    {"a_note_met_while_receiving_counts", test_a_note_met_while_receiving_counts, false},
    {"a_dead_peer_counts_as_unmapped_and_unreceived", test_a_dead_peer_counts_as_unmapped_and_unreceived, true},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_close_handshake", kTestCases, argc, argv); }
