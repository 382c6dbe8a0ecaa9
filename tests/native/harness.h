// The native unit tests' shared checks and runner: named cases, one of them by argv[1], and no /dev/shm leaks.
#pragma once

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

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

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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

inline std::vector<std::string> leaked_segments() {
  const std::string stem = shm_prefix().substr(1);
  std::vector<std::string> leaked;
  if (DIR* directory = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(directory)) {
      if (std::string(entry->d_name).rfind(stem, 0) == 0) leaked.emplace_back(entry->d_name);
    }
    closedir(directory);
  }
  return leaked;
}

// Runs every case, or only the one argv[1] names; a case fails if it throws or leaves segments behind.
template <size_t N>
int run_cases(const char* suite, const TestCase (&cases)[N], int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;
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
      const std::vector<std::string> leaked = leaked_segments();
      if (!leaked.empty()) throw TestFailure("left " + std::to_string(leaked.size()) + " segments in /dev/shm, e.g. " + leaked[0]);
      std::printf("PASS %s (%.2f s)\n", test_case.name, seconds_since(start));
      ++passed;
    } catch (const std::exception& error) {
      std::printf("FAIL %s: %s\n", test_case.name, error.what());
      ++failed;
      for (const std::string& entry : leaked_segments()) shm_unlink(("/" + entry).c_str());
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
