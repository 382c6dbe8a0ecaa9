// Native tests for the IPC control plane (csrc/transport/ipc_control.*): who services whom, and no crossed wait deadlocks.
#include "../../csrc/transport/ipc_control.h"

#include <atomic>
#include <exception>
#include <functional>
#include <chrono>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace native_test;
using Clock = std::chrono::steady_clock;

// A channel end as the plane sees it: a call mutex and a service that counts its runs.
struct FakeChannel {
  std::recursive_mutex call_mutex;
  int serviced = 0;  // plain: ThreadSanitizer reports a service that overlaps a call in another thread
  std::optional<ControlPlane::Membership> membership;

  void join(ControlPlane& plane, std::function<void()> service = {}) {
    if (!service) service = [this] { ++serviced; };
    membership.emplace(plane, call_mutex, std::move(service));
  }
};

void test_services_free_members_and_skips_busy_ones() {
  ControlPlane plane;
  FakeChannel idle, busy;
  idle.join(plane);
  busy.join(plane);
  std::promise<void> inside, leave;
  std::thread caller([&] {
    const std::lock_guard<std::recursive_mutex> call(busy.call_mutex);
    inside.set_value();
    leave.get_future().wait();
  });
  inside.get_future().wait();
  plane.service_all();
  CHECK(idle.serviced == 1);
  leave.set_value();
  caller.join();
  CHECK(busy.serviced == 0);  // read after the join: the caller's thread held it until then
  plane.service_all();
  CHECK(idle.serviced == 2 && busy.serviced == 1);
}

void test_a_call_services_its_own_channel() {
  ControlPlane plane;
  FakeChannel channel;
  channel.join(plane);
  const std::lock_guard<std::recursive_mutex> call(channel.call_mutex);
  plane.service_all();
  CHECK(channel.serviced == 1);
}

void test_servicing_from_a_service_returns_at_once() {
  ControlPlane plane;
  FakeChannel reentering, other;
  reentering.join(plane, [&] {
    ++reentering.serviced;
    plane.service_all();
  });
  other.join(plane);
  plane.service_all();
  CHECK(reentering.serviced == 1 && other.serviced == 1);
}

void test_leaving_waits_for_a_service_in_progress() {
  ControlPlane plane;
  FakeChannel channel;
  std::promise<void> started;
  std::atomic<int> runs{0};
  std::atomic<bool> finished{false};
  channel.join(plane, [&] {
    if (runs++ == 0) started.set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished = true;
  });
  std::thread servicer([&] { plane.service_all(); });
  started.get_future().wait();
  channel.membership.reset();
  CHECK_MSG(finished, "the membership ended while its service was still running");
  servicer.join();
  plane.service_all();
  CHECK(runs == 1);
}

// Waits inside a call on `channel` until `done`, servicing `plane` as a channel call's wait does.
void wait_in_call(FakeChannel& channel, ControlPlane& plane, const std::function<bool()>& done) {
  const std::lock_guard<std::recursive_mutex> call(channel.call_mutex);
  ServicingWait wait(10.0);
  while (!done()) {
    if (wait.expired()) throw TestFailure("a wait was never answered");
    wait.pause(plane);
  }
}

// Two processes (one plane each) with two channels between them, as pipecomm's activations and
// gradients channels: A asks on channel 1 and waits inside a call there, while B asks on channel 2
// and waits inside a call there; each wait must answer the other's request on the other channel.
// Then each makes one more call (a receive, say) that lasts until the other is done too. A third
// thread of A makes short calls on channel 2 meanwhile, so A's wait finds that channel busy at times.
void test_crossed_waits_answer_each_other() {
  ControlPlane plane_a, plane_b;
  FakeChannel a1, a2, b1, b2;  // process and channel
  std::atomic<bool> asked_on_1{false}, answered_on_1{false}, asked_on_2{false}, answered_on_2{false};
  std::atomic<int> processes_done{0};
  a1.join(plane_a);
  a2.join(plane_a, [&] {
    ++a2.serviced;
    if (asked_on_2) answered_on_2 = true;
  });
  b1.join(plane_b, [&] {
    ++b1.serviced;
    if (asked_on_1) answered_on_1 = true;
  });
  b2.join(plane_b);
  const auto process = [&](FakeChannel& asking, FakeChannel& next_call, ControlPlane& plane, std::atomic<bool>& asked,
                           const std::atomic<bool>& answered) {
    asked = true;
    wait_in_call(asking, plane, [&] { return answered.load(); });
    ++processes_done;
    wait_in_call(next_call, plane, [&] { return processes_done == 2; });
  };
  std::atomic<bool> stop_calls{false};
  std::thread other_calls([&] {
    while (!stop_calls) {
      {
        const std::lock_guard<std::recursive_mutex> call(a2.call_mutex);
        ++a2.serviced;  // the call's own work on the state its service touches
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  auto a_runs = std::async(std::launch::async, [&] { process(a1, a1, plane_a, asked_on_1, answered_on_1); });
  auto b_runs = std::async(std::launch::async, [&] { process(b2, b1, plane_b, asked_on_2, answered_on_2); });
  std::exception_ptr failure;
  for (auto* run : {&a_runs, &b_runs}) {
    try {
      run->get();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  stop_calls = true;
  other_calls.join();
  if (failure) std::rethrow_exception(failure);
}

void test_a_servicing_wait_ends_at_its_timeout() {
  const auto start = Clock::now();
  ControlPlane plane;
  ServicingWait wait(0.05);
  while (!wait.expired()) wait.pause(plane);
  const double waited = seconds_since(start);
  CHECK_MSG(waited >= 0.05 && waited < 1.0, std::to_string(waited) + " s");
  CHECK(wait.timed_out() == "timed out after 0.05 s");
  CHECK(ServicingWait(30).timed_out() == "timed out after 30.0 s");
}

const TestCase kTestCases[] = {
    {"services_free_members_and_skips_busy_ones", test_services_free_members_and_skips_busy_ones, false},
    {"a_call_services_its_own_channel", test_a_call_services_its_own_channel, false},
    {"servicing_from_a_service_returns_at_once", test_servicing_from_a_service_returns_at_once, false},
    {"leaving_waits_for_a_service_in_progress", test_leaving_waits_for_a_service_in_progress, false},
    {"crossed_waits_answer_each_other", test_crossed_waits_answer_each_other, false},
    {"a_servicing_wait_ends_at_its_timeout", test_a_servicing_wait_ends_at_its_timeout, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("ipc_control", kTestCases, argc, argv); }
