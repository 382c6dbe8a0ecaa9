// Host cost of each CUDA call the IPC channel makes per message: the floor of its small-message latency,
// which is bound by the host (bench/README, "p2p, session 4" and "session 5"). Prints a table and, with
// --json PATH, writes it. Every call is enqueued on one stream in rounds of kCallsPerRound, the stream is
// drained between rounds (untimed), and the median round gives the microseconds per call.
// Usage: bench_host_calls [--json PATH]
#include <cuda.h>  // driver API types only; the functions come from cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../../csrc/transport/sm_transfer.h"

namespace {

constexpr int kRounds = 41;
constexpr int kCallsPerRound = 256;  // well below a stream's queue depth, so no call waits for room
constexpr size_t kMessageBytes = 4096;

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s failed: CUresult %d\n", what, static_cast<int>(result));
    std::exit(1);
  }
}

template <typename Function>
Function driver_function(const char* symbol) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  check(cudaGetDriverEntryPointByVersion(symbol, &function, 12000, cudaEnableDefault, &status), symbol);
  if (status != cudaDriverEntryPointSuccess || function == nullptr) {
    std::fprintf(stderr, "driver entry point %s not found\n", symbol);
    std::exit(1);
  }
  return reinterpret_cast<Function>(function);
}

CUdeviceptr address(const void* pointer) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(pointer)); }

struct Result {
  std::string call;
  double microseconds;
};

// Median over rounds of the host time per call.
double time_call(cudaStream_t stream, const std::function<void()>& call) {
  std::vector<double> per_call;
  for (int round = 0; round < kRounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCallsPerRound; ++i) call();
    const auto stop = std::chrono::steady_clock::now();
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (round > 0) {  // the first round warms caches and lazy initialization
      per_call.push_back(std::chrono::duration<double, std::micro>(stop - start).count() / kCallsPerRound);
    }
  }
  std::nth_element(per_call.begin(), per_call.begin() + per_call.size() / 2, per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--json PATH]\n", argv[0]);
      return 2;
    }
  }
  using MemOp = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  using BatchMemOp = CUresult(CUDAAPI*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
  using PointerAttributes = CUresult(CUDAAPI*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
  const auto write_value32 = driver_function<MemOp>("cuStreamWriteValue32");
  const auto wait_value32 = driver_function<MemOp>("cuStreamWaitValue32");
  const auto batch_mem_op = driver_function<BatchMemOp>("cuStreamBatchMemOp");
  const auto pointer_attributes = driver_function<PointerAttributes>("cuPointerGetAttributes");

  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void* source = nullptr;
  void* destination = nullptr;
  uint32_t* flag = nullptr;  // zero: every wait below is already satisfied
  check(cudaMalloc(&source, kMessageBytes), "cudaMalloc");
  check(cudaMalloc(&destination, kMessageBytes), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&flag), 2 * sizeof(uint32_t)), "cudaMalloc");
  check(cudaMemset(flag, 0, 2 * sizeof(uint32_t)), "cudaMemset");
  void* peer = nullptr;
  if (devices > 1) {
    int can_access = 0;
    check(cudaDeviceCanAccessPeer(&can_access, 0, 1), "cudaDeviceCanAccessPeer");
    if (can_access) {
      check(cudaDeviceEnablePeerAccess(1, 0), "cudaDeviceEnablePeerAccess");
      check(cudaSetDevice(1), "cudaSetDevice");
      check(cudaMalloc(&peer, kMessageBytes), "cudaMalloc");
      check(cudaSetDevice(0), "cudaSetDevice");
    }
  }
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaEventRecord(event, stream), "cudaEventRecord");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  std::vector<Result> results;
  const auto add = [&](const std::string& name, const std::function<void()>& call) {
    results.push_back({name, time_call(stream, call)});
  };
  add("cudaMemcpyAsync 4 KB, same GPU",
      [&] { check(cudaMemcpyAsync(destination, source, kMessageBytes, cudaMemcpyDeviceToDevice, stream), "copy"); });
  if (peer != nullptr) {
    add("cudaMemcpyAsync 4 KB, to the peer GPU",
        [&] { check(cudaMemcpyAsync(peer, source, kMessageBytes, cudaMemcpyDeviceToDevice, stream), "copy"); });
  }
  add("cuStreamWriteValue32", [&] { check(write_value32(stream, address(flag + 1), 0, 0), "write"); });
  add("cuStreamWaitValue32 (satisfied)",
      [&] { check(wait_value32(stream, address(flag), 0, CU_STREAM_WAIT_VALUE_GEQ), "wait"); });
  add("cuStreamBatchMemOp (write + wait)", [&] {
    CUstreamBatchMemOpParams operations[2] = {};
    operations[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    operations[0].writeValue.address = address(flag + 1);
    operations[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    operations[1].waitValue.address = address(flag);
    operations[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    check(batch_mem_op(stream, 2, operations, 0), "batch");
  });
  add("cuPointerGetAttributes (3 attributes)", [&] {
    unsigned long long buffer_id = 0;
    CUdeviceptr start = 0;
    size_t size = 0;
    CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                        CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void* values[] = {&buffer_id, &start, &size};
    check(pointer_attributes(3, attributes, values, address(destination)), "attributes");
  });
  add("sm_transfer launch (copy 4 KB + flag)", [&] {
    pipecomm::transport::SmTransfer transfer;
    transfer.copies[0] = {destination, source, kMessageBytes};
    transfer.copy_count = 1;
    transfer.signal = flag + 1;
    check(pipecomm::transport::enqueue_sm_transfer(transfer, stream), "sm_transfer");
  });
  add("cudaEventRecord", [&] { check(cudaEventRecord(event, stream), "record"); });
  add("cudaStreamWaitEvent", [&] { check(cudaStreamWaitEvent(stream, event, 0), "wait event"); });

  std::printf("# host time per call, median of %d rounds of %d calls on one stream\n", kRounds - 1, kCallsPerRound);
  std::printf("%-42s %8s\n", "call", "us");
  for (const Result& result : results) std::printf("%-42s %8.2f\n", result.call.c_str(), result.microseconds);
  if (json_path != nullptr) {
    FILE* file = std::fopen(json_path, "w");
    if (file == nullptr) {
      std::perror(json_path);
      return 1;
    }
    std::fprintf(file, "{\"rounds\": %d, \"calls_per_round\": %d, \"us_per_call\": {", kRounds - 1, kCallsPerRound);
    for (size_t i = 0; i < results.size(); ++i) {
      std::fprintf(file, "%s\"%s\": %.4f", i ? ", " : "", results[i].call.c_str(), results[i].microseconds);
    }
    std::fprintf(file, "}}\n");
    std::fclose(file);
  }
  return 0;
}
