// Native unit test of the pipecomm ops through the dispatcher, against plain ATen references.
// One header per operator, not ATen/ATen.h: a third of the preprocessed lines, half the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

void call_accumulate(at::TensorList accumulators, at::TensorList grads, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pipecomm::accumulate_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  op.call(accumulators, grads, scale);
}

at::Tensor call_pack(at::TensorList tensors) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pipecomm::pack", "")
                       .typed<at::Tensor(at::TensorList)>();
  return op.call(tensors);
}

void call_unpack(const at::Tensor& buffer, at::TensorList outs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pipecomm::unpack_", "")
                       .typed<void(const at::Tensor&, at::TensorList)>();
  op.call(buffer, outs);
}

void expect(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

void test_accumulate_mixed_pairs() {
  const std::vector<std::pair<at::ScalarType, at::ScalarType>> pairs = {
      {at::kFloat, at::kFloat}, {at::kFloat, at::kBFloat16}, {at::kFloat, at::kHalf},
      {at::kBFloat16, at::kBFloat16}, {at::kHalf, at::kHalf}};
  const std::vector<int64_t> sizes = {0, 1, 7, 4097, 70001};
  std::vector<at::Tensor> accumulators, grads, expected;
  for (size_t i = 0; i < sizes.size() * pairs.size(); ++i) {
    const auto [acc_dtype, grad_dtype] = pairs[i % pairs.size()];
    const int64_t numel = sizes[i / pairs.size()];
    accumulators.push_back(at::randn({numel}).to(acc_dtype));
    grads.push_back(at::randn({numel}).to(grad_dtype));
    expected.push_back(accumulators.back().to(at::kFloat).add(grads.back().to(at::kFloat), 0.25).to(acc_dtype));
  }
  call_accumulate(accumulators, grads, 0.25);
  for (size_t i = 0; i < accumulators.size(); ++i) {
    expect(at::allclose(accumulators[i].to(at::kFloat), expected[i].to(at::kFloat), 1e-2, 1e-2),
           "accumulate_ differs from the reference at tensor " + std::to_string(i));
  }
}

void test_accumulate_rejects_shape_mismatch() {
  std::vector<at::Tensor> accumulators = {at::zeros({2, 3})};
  std::vector<at::Tensor> grads = {at::zeros({3, 2})};
  try {
    call_accumulate(accumulators, grads, 1.0);
  } catch (const c10::ValueError& error) {
    expect(std::string(error.what()).find("accumulators[0] has shape [2, 3]") != std::string::npos,
           std::string("unexpected message: ") + error.what());
    return;
  }
  throw std::runtime_error("a shape mismatch was accepted");
}

void test_pack_round_trip() {
  std::vector<at::Tensor> tensors = {at::randn({3, 5}), at::randint(0, 100, {7}, at::kLong),
                                     at::randn({0}), at::rand({9}).gt(0.5), at::randn({2, 2}).to(at::kBFloat16)};
  const at::Tensor buffer = call_pack(tensors);
  std::vector<at::Tensor> outs;
  int64_t expected_bytes = 0;
  for (const at::Tensor& tensor : tensors) {
    outs.push_back(at::empty_like(tensor));
    expected_bytes += (static_cast<int64_t>(tensor.nbytes()) + 15) / 16 * 16;
  }
  expect(buffer.numel() == expected_bytes, "pack's buffer has the wrong size");
  call_unpack(buffer, outs);
  for (size_t i = 0; i < tensors.size(); ++i) {
    expect(at::equal(outs[i], tensors[i]), "round trip differs at tensor " + std::to_string(i));
  }
}

}  // namespace

int main() {
  const std::vector<std::pair<std::string, std::function<void()>>> tests = {
      {"accumulate_mixed_pairs", test_accumulate_mixed_pairs},
      {"accumulate_rejects_shape_mismatch", test_accumulate_rejects_shape_mismatch},
      {"pack_round_trip", test_pack_round_trip},
  };
  int failed = 0;
  for (const auto& [name, test] : tests) {
    try {
      test();
      std::cout << "PASS " << name << "\n";
    } catch (const std::exception& error) {
      ++failed;
      std::cout << "FAIL " << name << ": " << error.what() << "\n";
    }
  }
  std::cout << "test_ops: " << tests.size() - failed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
