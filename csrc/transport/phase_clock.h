// With PIPECOMM_IPC_HOST_TIMING=1, the host time a channel's send or recv spends in each of its phases,
// summed over calls: where a small message's latency goes. Off, a lap is one predictable branch.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace pipecomm::transport {

template <size_t Phases>
class PhaseClock {
 public:
  explicit PhaseClock(const std::array<const char*, Phases>& names) : names_(names), enabled_(enabled()) {}

  void start() {
    if (enabled_) last_ = Clock::now();
  }

  // Ends `phase` (its index in names) now; the next one starts.
  void lap(size_t phase) {
    if (!enabled_) return;
    const Clock::time_point now = Clock::now();
    totals_[phase] += now - last_;
    ++laps_[phase];
    last_ = now;
  }

  // Per phase: its name, total microseconds and laps. Empty while timing is off.
  std::vector<std::tuple<std::string, double, uint64_t>> totals() const {
    std::vector<std::tuple<std::string, double, uint64_t>> out;
    if (!enabled_) return out;
    for (size_t phase = 0; phase < Phases; ++phase) {
      out.emplace_back(names_[phase], std::chrono::duration<double, std::micro>(totals_[phase]).count(),
                       laps_[phase]);
    }
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;

  static bool enabled() {
    const char* value = std::getenv("PIPECOMM_IPC_HOST_TIMING");
    return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
  }

  std::array<const char*, Phases> names_;
  bool enabled_;
  Clock::time_point last_{};
  std::array<Clock::duration, Phases> totals_{};
  std::array<uint64_t, Phases> laps_{};
};

}  // namespace pipecomm::transport
