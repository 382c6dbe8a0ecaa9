// The native unit tests' shared checks and runner: named cases, one of them by argv[1], and no /dev/shm leaks.
#pragma once

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../../csrc/transport/errors.h"

#if defined(__SANITIZE_THREAD__)
#define NATIVE_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NATIVE_TEST_TSAN 1
#endif
#endif
#ifndef NATIVE_TEST_TSAN
#define NATIVE_TEST_TSAN 0
#endif

namespace native_test {

class TestFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail_check(const char* condition, const char* file, int line, const std::string& detail) {
  throw TestFailure(std::string(file) + ":" + std::to_string(line) + ": CHECK(" + condition + ") failed" +
                    (detail.empty() ? "" : ": " + detail));
}

#define CHECK(condition)                                                            \
  do {                                                                              \
    if (!(condition)) ::native_test::fail_check(#condition, __FILE__, __LINE__, ""); \
  } while (0)

#define CHECK_MSG(condition, detail)                                                     \
  do {                                                                                   \
    if (!(condition)) ::native_test::fail_check(#condition, __FILE__, __LINE__, (detail)); \
  } while (0)

// Runs body, which must throw Expected; returns the error's text.
template <typename Expected, typename Body>
std::string expect_throw(Body&& body, const char* description) {
  try {
    body();
  } catch (const Expected& error) {
    return error.what();
  } catch (const std::exception& error) {
    throw TestFailure(std::string(description) + ": threw the wrong exception type: " + error.what());
  }
  throw TestFailure(std::string(description) + ": did not throw");
}

inline void check_contains(const std::string& text, const std::string& needle) {
  if (text.find(needle) == std::string::npos) {
    throw TestFailure("expected \"" + needle + "\" in \"" + text + "\"");
  }
}

// Runs body, which must throw ProtocolError with needle in its text.
template <typename Body>
void expect_protocol_error(Body&& body, const std::string& needle, const std::string& description) {
  const std::string text =
      expect_throw<pipecomm::transport::ProtocolError>(std::forward<Body>(body), description.c_str());
  if (text.find(needle) == std::string::npos) {
    throw TestFailure(description + ": expected \"" + needle + "\" in \"" + text + "\"");
  }
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// SplitMix64's step: reproducible, well-mixed data from a seed, so both ends of a channel can derive it.
inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A seeded sequence for the randomized cases: a failure replays from the same seed.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return state_ = splitmix(state_); }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }

 private:
  uint64_t state_;
};

struct TestCase {
  const char* name;
  void (*run)();
  bool forks;  // not run under ThreadSanitizer
};

// Every shared-memory segment of this run starts with it, so leaks are attributable and runs do not collide.
inline std::string& shm_prefix() {
  static std::string prefix = "/pipecomm.t" + std::to_string(getpid());
  return prefix;
}

// The /dev/shm entries whose names start with the segment name prefix (leading '/' included), sorted.
inline std::vector<std::string> segments_with_prefix(const std::string& prefix) {
  const std::string stem = prefix.substr(1);
  std::vector<std::string> matches;
  DIR* directory = opendir("/dev/shm");
  // An unlistable /dev/shm would make every "no segments left" check pass.
  if (directory == nullptr) throw TestFailure("cannot list /dev/shm");
  while (const dirent* entry = readdir(directory)) {
    if (std::string(entry->d_name).rfind(stem, 0) == 0) matches.emplace_back(entry->d_name);
  }
  closedir(directory);
  std::sort(matches.begin(), matches.end());
  return matches;
}

// Runs every case, or only the one argv[1] names; a case fails if it throws or leaves segments behind.
template <size_t N>
int run_cases(const char* suite, const TestCase (&cases)[N], int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;
  shm_prefix();  // fixed here, before any case forks: a child must name its segments as the parent does
  int passed = 0;
  int failed = 0;
  int skipped = 0;
  for (const TestCase& test_case : cases) {
    if (only != nullptr && std::strcmp(only, test_case.name) != 0) continue;
    if (test_case.forks && NATIVE_TEST_TSAN) {
      std::printf("SKIP %s (forks; not run under ThreadSanitizer)\n", test_case.name);
      ++skipped;
      continue;
    }
    std::printf("RUN  %s\n", test_case.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      test_case.run();
      const std::vector<std::string> leaked = segments_with_prefix(shm_prefix());
      if (!leaked.empty()) throw TestFailure("left " + std::to_string(leaked.size()) + " segments in /dev/shm, e.g. " + leaked[0]);
      std::printf("PASS %s (%.2f s)\n", test_case.name, seconds_since(start));
      ++passed;
    } catch (const std::exception& error) {
      std::printf("FAIL %s: %s\n", test_case.name, error.what());
      ++failed;
      // Keep one failure from cascading into leak reports for the following cases.
      for (const std::string& entry : segments_with_prefix(shm_prefix())) shm_unlink(("/" + entry).c_str());
    }
    std::fflush(stdout);
  }
  if (passed + failed + skipped == 0) {
    std::printf("%s: no test case named '%s'\n", suite, only);
    return 2;
  }
  std::printf("%s: %d passed, %d failed, %d skipped\n", suite, passed, failed, skipped);
  return failed == 0 ? 0 : 1;
}

}  // namespace native_test
