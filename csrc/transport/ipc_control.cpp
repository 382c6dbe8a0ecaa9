// The IPC channels' control plane: who services whose incoming control, and how a servicing call waits.
#include "ipc_control.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "cpu_relax.h"

namespace pipecomm::transport {
namespace {

// As the shm ring's waits: a peer usually answers within this, and a sleep costs tens of microseconds.
constexpr auto kSpinDuration = std::chrono::microseconds(50);
// Few, so that a spinning wait notices its message within a fraction of a microsecond.
constexpr int kRelaxesPerPause = 8;
// Then the core is offered to other threads for a while before the wait sleeps.
constexpr auto kYieldDuration = std::chrono::milliseconds(1);
constexpr auto kFirstSleep = std::chrono::microseconds(20);
// The longest a wait sleeps: how late it may see its message, or answer another channel's request.
constexpr auto kLongestSleep = std::chrono::microseconds(200);
// The longest a wait sleeps on its own ring's futex: how late it answers another channel's request.
constexpr auto kLongestNotifiedSleep = std::chrono::microseconds(1000);

// Whether this thread is inside service_all: a service that waits calls it again.
thread_local bool servicing = false;

}  // namespace

ControlPlane& ControlPlane::process() {
  static ControlPlane* const plane = new ControlPlane();
  return *plane;
}

ControlPlane::Membership::Membership(ControlPlane& plane, std::recursive_mutex& call_mutex,
                                     std::function<void()> service)
    : plane_(plane) {
  const std::lock_guard<std::mutex> lock(plane_.members_mutex_);
  plane_.members_.push_back({this, &call_mutex, std::move(service)});
}

ControlPlane::Membership::~Membership() {
  const std::lock_guard<std::mutex> lock(plane_.members_mutex_);
  auto& members = plane_.members_;
  members.erase(std::remove_if(members.begin(), members.end(),
                               [this](const Member& member) { return member.membership == this; }),
                members.end());
}

void ControlPlane::service_all() noexcept {
  if (servicing) return;
  servicing = true;
  {
    const std::lock_guard<std::mutex> lock(members_mutex_);
    for (Member& member : members_) {
      const std::unique_lock<std::recursive_mutex> call(*member.call_mutex, std::try_to_lock);
      if (!call.owns_lock()) continue;
      try {
        member.service();
      } catch (...) {
        // The member's own calls report what went wrong on its channel.
      }
    }
  }
  servicing = false;
}

ServicingWait::ServicingWait(double timeout_s)
    : start_(Clock::now()),
      deadline_(start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))),
      timeout_s_(timeout_s),
      sleep_(kFirstSleep) {}

void ServicingWait::pause(ControlPlane& plane, const Sleeper& sleep_until_notified) {
  const Clock::duration waited = Clock::now() - start_;
  if (waited < kSpinDuration) {
    for (int relax = 0; relax < kRelaxesPerPause; ++relax) cpu_relax();
    return;
  }
  plane.service_all();
  if (waited < kYieldDuration) {
    std::this_thread::yield();
  } else if (sleep_until_notified) {
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline_ - Clock::now());
    sleep_until_notified(std::max(std::chrono::microseconds(0), std::min(left, kLongestNotifiedSleep)));
  } else {
    std::this_thread::sleep_for(std::min<Clock::duration>(sleep_, deadline_ - Clock::now()));
    sleep_ = std::min<Clock::duration>(sleep_ * 2, kLongestSleep);
  }
}

std::string ServicingWait::timed_out() const {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), timeout_s_ >= 0.1 ? "%.1f" : "%.3g", timeout_s_);
  return std::string("timed out after ") + seconds + " s";
}

}  // namespace pipecomm::transport
