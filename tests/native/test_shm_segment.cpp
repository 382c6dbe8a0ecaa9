// Native tests for the shm ring's segments (csrc/transport/shm_segment.*): names, one mapping per object, the sweep.
#include "../../csrc/transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "../../csrc/transport/errors.h"
#include "harness.h"

namespace {

using namespace pipecomm::transport;
using namespace pipecomm::transport::detail;
using namespace native_test;

void test_names_round_trip() {
  const std::string channel = shm_prefix() + ".names";
  const std::string control = segment_stem(channel, 4242) + ".ctl";
  const auto parsed_control = parse_segment_name(control.substr(1));
  CHECK(parsed_control && parsed_control->channel_name == channel && parsed_control->owner_pid == 4242 &&
        parsed_control->is_control);
  const auto parsed_data = parse_segment_name(data_segment_name_for(channel, 17, 3).substr(1));
  CHECK(parsed_data && parsed_data->owner_pid == 17 && !parsed_data->is_control);
  // Only the names this transport makes: anything else in /dev/shm is never swept.
  for (const char* foreign : {"pipecomm.x.pid12.gen", "pipecomm.x.pid.ctl", "pipecomm.x.pid12.ctlx", ".pid12.ctl",
                              "pipecomm.x.pid1234567890.ctl", "sem.pipecomm", "pipecomm.x.pid12a.gen1"}) {
    CHECK_MSG(!parse_segment_name(foreign), foreign);
  }
}

void test_one_mapping_per_object() {
  const std::string name = shm_prefix() + ".mapping" + ".pid" + std::to_string(getpid()) + ".gen1";
  MappedSegment created = create_segment(name, 3 * 4096);
  std::memset(created.data(), 7, 3 * 4096);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  CHECK(fd >= 0);
  {
    MappedSegment again = MappedSegment::map_fd(fd, 3 * 4096, name);
    CHECK(again.data() == created.data());  // one address per object in a process
    expect_protocol_error([&] { MappedSegment::map_fd(fd, 4096, name); }, "already mapped", "size mismatch");
  }
  CHECK(created.data()[3 * 4096 - 1] == std::byte{7});  // the first mapping outlives the second one's end
  close(fd);
  expect_throw<ChannelError>([&] { create_segment(name, 4096); }, "exclusive creation");
  unlink_quietly(name);
  unlink_quietly(name);  // a second unlink is no error
}

void test_sweep_spares_live_owners() {
  const std::string channel = shm_prefix() + ".sweep";
  const pid_t gone = 999999999;  // no such process
  MappedSegment live = create_segment(segment_stem(channel, getpid()) + ".ctl", 4096);
  MappedSegment dead = create_segment(segment_stem(channel, gone) + ".ctl", 4096);
  CHECK(process_is_alive(getpid()) && !process_is_alive(gone) && !process_is_alive(0));
  CHECK(sweep_stale_segments(channel) == 1);
  CHECK(segments_with_prefix(channel).size() == 1);
  CHECK(sweep_stale_segments(channel) == 0);
  expect_throw<std::invalid_argument>([] { sweep_stale_segments("/"); }, "empty sweep prefix");
  unlink_quietly(segment_stem(channel, getpid()) + ".ctl");
}

void test_pages() {
  CHECK(round_up_to_page(0) == round_up_to_page(1));
  CHECK(round_up_to_page(1) % 4096 == 0 && round_up_to_page(4097) >= 8192);
  expect_throw<std::length_error>([] { round_up_to_page(SIZE_MAX); }, "overflowing size");
}

const TestCase kTestCases[] = {
    {"names_round_trip", test_names_round_trip, false},
    {"one_mapping_per_object", test_one_mapping_per_object, false},
    {"sweep_spares_live_owners", test_sweep_spares_live_owners, false},
    {"pages", test_pages, false},
};

}  // namespace

int main(int argc, char** argv) { return run_cases("shm_segment", kTestCases, argc, argv); }
