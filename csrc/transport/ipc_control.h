// The one control plane of a process's IPC channels: every call that waits services the incoming
// control (grow requests) of every live channel of the process, so ranks never wait on each other's answers.
//
// Why no wait can deadlock on an answer:
//  * Servicing never waits: an answer that cannot go now (no room on the post ring, which the asking
//    peer drains while it waits) is offered again at the next servicing.
//  * Every call on a channel holds the channel's call mutex from start to end. A call that waits
//    (past its first microseconds, and at least every 50 ms while a full host ring holds it) services
//    every member whose call mutex it can take with try_lock: a free one, or its own (the mutex is
//    recursive). A member whose mutex another thread holds is inside a call there, and that call
//    services it in its own waits, or soon ends and frees it for the next servicing. So while any thread
//    of a process waits in a channel call, every request that reached the process is answered.
//  * Hence two ranks that wait on each other, on one channel or on two (pipecomm's activations and
//    gradients channels, both carrying activations in V-shaped schedules), answer each other. A receive
//    also answers the request that comes before the message it waits for.
//  * The locks cannot form a cycle: servicing holds members_mutex_ and takes call mutexes only with
//    try_lock; a thread blocks on a call mutex only when it enters a call (or closes the channel),
//    holding no lock of this plane, and the holder (a servicing thread) never waits.
// A process that blocks outside channel calls (in a collective, say) answers once it calls in again, as
// the shm backend's growth does.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace pipecomm::transport {

class ControlPlane {
 public:
  // The plane of this process. Never destroyed, so a channel that outlives static destruction can
  // still leave it.
  static ControlPlane& process();

  ControlPlane() = default;
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  // A channel's place in the plane: while it lives, waiting calls anywhere in the process may run
  // `service` under `call_mutex`. `service` must never wait.
  class Membership {
   public:
    Membership(ControlPlane& plane, std::recursive_mutex& call_mutex, std::function<void()> service);
    // Waits for a servicing of this member in progress in another thread; none starts after.
    ~Membership();
    Membership(const Membership&) = delete;
    Membership& operator=(const Membership&) = delete;

   private:
    ControlPlane& plane_;
  };

  // Runs the service of every member whose call mutex this thread can take, and skips the others
  // (inside a call in another thread, which services them itself). Never waits for another thread's call
  // and never throws: a service keeps its failures for its channel's own calls. Called again from
  // inside a service, it returns at once.
  void service_all() noexcept;

 private:
  struct Member {
    const Membership* membership;
    std::recursive_mutex* call_mutex;
    std::function<void()> service;
  };

  std::mutex members_mutex_;
  std::vector<Member> members_;
};

// How a channel call waits for its peer while it services the plane: it spins at first (a peer usually
// answers within microseconds), then yields, then sleeps: on the futex of the ring it waits on when the
// caller gives one (woken at once by its own message, and back to service the plane at least every
// millisecond for other channels' requests), else in slices short enough that neither what it waits for
// nor another channel's request sits long unseen.
class ServicingWait {
 public:
  explicit ServicingWait(double timeout_s);

  bool expired() const { return Clock::now() >= deadline_; }
  using Sleeper = std::function<void(std::chrono::microseconds longest)>;
  // One pause between two looks at what the call waits for. Past the first microseconds, which are
  // kept for noticing the awaited message soon, it services `plane`. `sleep_until_notified`, if given,
  // sleeps until what the call waits for may have come, at most `longest`.
  void pause(ControlPlane& plane, const Sleeper& sleep_until_notified = nullptr);
  // "timed out after <timeout> s", worded as the rings word their timeouts.
  std::string timed_out() const;

 private:
  using Clock = std::chrono::steady_clock;

  Clock::time_point start_;
  Clock::time_point deadline_;
  double timeout_s_;
  Clock::duration sleep_;
};

}  // namespace pipecomm::transport
