// Shared-memory segments of the shm ring: their names, creation, one mapping per shm object per process, and the
// sweep of segments whose creator died. The ring protocol over them is shm_ring.cpp's.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pipecomm::transport {

// Unlinks /dev/shm segments whose name starts with prefix and whose creator process is gone.
// Returns how many were removed.
size_t sweep_stale_segments(const std::string& prefix);

namespace detail {

inline constexpr const char* kShmDirectory = "/dev/shm";

// A MAP_SHARED mapping shared by every user in this process of the same shm object, so both ends
// of an in-process channel see one address (ThreadSanitizer only pairs atomics at equal addresses).
class MappedSegment {
 public:
  MappedSegment() = default;
  static MappedSegment map_fd(int fd, size_t bytes, const std::string& name);
  MappedSegment(MappedSegment&& other) noexcept;
  MappedSegment& operator=(MappedSegment&& other) noexcept;
  MappedSegment(const MappedSegment&) = delete;
  MappedSegment& operator=(const MappedSegment&) = delete;
  ~MappedSegment();

  std::byte* data() const { return base_; }
  void reset() noexcept;

 private:
  std::byte* base_ = nullptr;
};

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

struct ParsedSegmentName {
  std::string channel_name;  // with the leading '/'
  pid_t owner_pid;
  bool is_control;
};

// "<channel>.pid<owner>": every segment of one ring end; the control segment adds ".ctl", a data segment ".gen<n>".
std::string segment_stem(const std::string& channel_name, pid_t owner_pid);
std::string data_segment_name_for(const std::string& channel_name, pid_t owner_pid, uint32_t generation);
// Recognises only names this file creates, so sweeps never touch anybody else's segments.
std::optional<ParsedSegmentName> parse_segment_name(const std::string& entry);
std::vector<std::string> list_shm_entries();
// False once the process is gone or a zombie (killed, not yet reaped: it never runs again).
bool process_is_alive(pid_t pid);

// Creates (exclusively), sizes, reserves and maps a segment; unlinks it again if any step fails.
MappedSegment create_segment(const std::string& name, size_t bytes);
void unlink_quietly(const std::string& name);

size_t round_up_to_page(size_t bytes);
std::string os_error(const char* call, const std::string& name, int error);

}  // namespace detail
}  // namespace pipecomm::transport
