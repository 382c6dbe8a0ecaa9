// Shared-memory segments of the shm ring: names, creation, the per-process mapping registry, the sweep.
#include "shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "errors.h"

namespace pipecomm::transport {
namespace detail {
namespace {

bool all_digits(const std::string& text, size_t begin, size_t end) {
  if (begin >= end) return false;
  return std::all_of(text.begin() + static_cast<std::ptrdiff_t>(begin), text.begin() + static_cast<std::ptrdiff_t>(end),
                     [](char c) { return c >= '0' && c <= '9'; });
}

struct SharedMapping {
  std::byte* base;
  size_t bytes;
  size_t users;
};

std::mutex& mapping_registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Keyed by the shm object's identity; an entry keeps the object mapped, so its inode cannot be reused.
std::map<std::pair<dev_t, ino_t>, SharedMapping>& mapping_registry() {
  static std::map<std::pair<dev_t, ino_t>, SharedMapping> registry;
  return registry;
}

size_t page_bytes() {
  static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return bytes;
}

}  // namespace

size_t round_up_to_page(size_t bytes) {
  const size_t page = page_bytes();
  const size_t at_least_one = std::max<size_t>(bytes, 1);
  if (at_least_one > SIZE_MAX - page) throw std::length_error("pipecomm shm ring: slot size overflows");
  return (at_least_one + page - 1) / page * page;
}

std::string os_error(const char* call, const std::string& name, int error) {
  return std::string(call) + "(" + name + ") failed: " + std::generic_category().message(error);
}

bool process_is_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) == -1 && errno == ESRCH) return false;
  // A killed child that its parent has not reaped yet still answers kill(), but never runs again.
  std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
  if (!stat_file) return true;
  std::string stat_line;
  std::getline(stat_file, stat_line);
  const size_t command_end = stat_line.rfind(')');
  if (command_end == std::string::npos || command_end + 2 >= stat_line.size()) return true;
  const char state = stat_line[command_end + 2];
  return state != 'Z' && state != 'X';
}

std::string segment_stem(const std::string& channel_name, pid_t owner_pid) {
  return channel_name + ".pid" + std::to_string(owner_pid);
}

std::string data_segment_name_for(const std::string& channel_name, pid_t owner_pid, uint32_t generation) {
  return segment_stem(channel_name, owner_pid) + ".gen" + std::to_string(generation);
}



// Recognises only names this file creates, so sweeps never touch anybody else's segments.
std::optional<ParsedSegmentName> parse_segment_name(const std::string& entry) {
  const size_t marker = entry.rfind(".pid");
  if (marker == std::string::npos || marker == 0) return std::nullopt;
  const size_t pid_begin = marker + 4;
  const size_t pid_end = entry.find('.', pid_begin);
  if (pid_end == std::string::npos || !all_digits(entry, pid_begin, pid_end) || pid_end - pid_begin > 9) {
    return std::nullopt;
  }
  const std::string suffix = entry.substr(pid_end);
  const bool is_control = suffix == ".ctl";
  const bool is_data = suffix.rfind(".gen", 0) == 0 && all_digits(suffix, 4, suffix.size());
  if (!is_control && !is_data) return std::nullopt;
  return ParsedSegmentName{"/" + entry.substr(0, marker),
                           static_cast<pid_t>(std::stol(entry.substr(pid_begin, pid_end - pid_begin))), is_control};
}

std::vector<std::string> list_shm_entries() {
  std::unique_ptr<DIR, int (*)(DIR*)> directory(opendir(kShmDirectory), closedir);
  if (!directory) {
    throw ChannelError("pipecomm shm ring: " + os_error("opendir", kShmDirectory, errno));
  }
  std::vector<std::string> entries;
  while (const dirent* entry = readdir(directory.get())) {
    if (entry->d_name[0] != '.') entries.emplace_back(entry->d_name);
  }
  return entries;
}


void unlink_quietly(const std::string& name) {
  // ENOENT is expected: whichever side maps a segment second unlinks it, the other may retry.
  if (!name.empty()) shm_unlink(name.c_str());
}

MappedSegment create_segment(const std::string& name, size_t bytes) {
  const int raw_fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (raw_fd < 0) {
    const int error = errno;
    throw ChannelError("pipecomm shm ring: " + os_error("shm_open", name, error) +
                       (error == EEXIST ? " (another ring of this process already uses the channel name)" : ""));
  }
  FileDescriptor fd(raw_fd);
  try {
    // A restrictive umask could strip the owner's write bit, which the peer needs for O_RDWR.
    if (fchmod(fd.get(), 0600) != 0) throw ChannelError("pipecomm shm ring: " + os_error("fchmod", name, errno));
    if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
      throw ChannelError("pipecomm shm ring: " + os_error("ftruncate", name, errno) + " for " +
                         std::to_string(bytes) + " bytes");
    }
    // Reserve the pages now: a full /dev/shm would otherwise surface later as SIGBUS on first write.
    if (const int error = posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); error != 0) {
      throw ChannelError("pipecomm shm ring: " + os_error("posix_fallocate", name, error) + " for " +
                         std::to_string(bytes) + " bytes (is " + kShmDirectory +
                         " too small? containers often need a larger --shm-size)");
    }
    return MappedSegment::map_fd(fd.get(), bytes, name);
  } catch (...) {
    unlink_quietly(name);
    throw;
  }
}

MappedSegment MappedSegment::map_fd(int fd, size_t bytes, const std::string& name) {
  struct stat status {};
  if (fstat(fd, &status) != 0) throw ChannelError("pipecomm shm ring: " + os_error("fstat", name, errno));
  const std::pair<dev_t, ino_t> identity{status.st_dev, status.st_ino};
  std::lock_guard<std::mutex> lock(mapping_registry_mutex());
  auto& registry = mapping_registry();
  MappedSegment mapped;
  if (auto existing = registry.find(identity); existing != registry.end()) {
    if (existing->second.bytes != bytes) {
      throw ProtocolError("pipecomm shm ring: segment " + name + " is already mapped with " +
                          std::to_string(existing->second.bytes) + " bytes, not " + std::to_string(bytes));
    }
    ++existing->second.users;
    mapped.base_ = existing->second.base;
  } else {
    void* address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) {
      throw ChannelError("pipecomm shm ring: " + os_error("mmap", name, errno) + " for " + std::to_string(bytes) +
                         " bytes");
    }
    mapped.base_ = static_cast<std::byte*>(address);
    registry.emplace(identity, SharedMapping{mapped.base_, bytes, 1});
  }
  return mapped;
}

MappedSegment::MappedSegment(MappedSegment&& other) noexcept : base_(std::exchange(other.base_, nullptr)) {}

MappedSegment& MappedSegment::operator=(MappedSegment&& other) noexcept {
  if (this != &other) {
    reset();
    base_ = std::exchange(other.base_, nullptr);
  }
  return *this;
}

MappedSegment::~MappedSegment() { reset(); }

void MappedSegment::reset() noexcept {
  if (base_ == nullptr) return;
  std::lock_guard<std::mutex> lock(mapping_registry_mutex());
  auto& registry = mapping_registry();
  const auto entry = std::find_if(registry.begin(), registry.end(),
                                  [&](const auto& item) { return item.second.base == base_; });
  if (entry == registry.end()) {
    std::fprintf(stderr, "pipecomm shm ring: internal error: mapping %p missing from registry\n",
                 static_cast<void*>(base_));
    std::abort();
  }
  if (--entry->second.users == 0) {
    munmap(entry->second.base, entry->second.bytes);
    registry.erase(entry);
  }
  base_ = nullptr;
}

}  // namespace detail

size_t sweep_stale_segments(const std::string& prefix) {
  const std::string stem = !prefix.empty() && prefix[0] == '/' ? prefix.substr(1) : prefix;
  if (stem.empty()) {
    throw std::invalid_argument("pipecomm shm ring: sweep_stale_segments needs a non-empty prefix");
  }
  size_t removed = 0;
  for (const std::string& entry : detail::list_shm_entries()) {
    if (entry.rfind(stem, 0) != 0) continue;
    const auto parsed = detail::parse_segment_name(entry);
    if (!parsed || detail::process_is_alive(parsed->owner_pid)) continue;
    if (shm_unlink(("/" + entry).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace pipecomm::transport
