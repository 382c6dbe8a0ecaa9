// The (accumulator, grad) dtype pairs accumulate_ supports, and a dispatcher over them.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace pipecomm {

// Calls fn(acc_t{}, grad_t{}) with the C++ types of a supported pair; check_accumulate_args has
// already rejected the others.
template <typename Fn>
void dispatch_accumulate_types(at::ScalarType acc, at::ScalarType grad, Fn&& fn) {
  if (acc == at::kFloat && grad == at::kFloat) return fn(float{}, float{});
  if (acc == at::kFloat && grad == at::kBFloat16) return fn(float{}, c10::BFloat16{});
  if (acc == at::kFloat && grad == at::kHalf) return fn(float{}, c10::Half{});
  if (acc == at::kBFloat16 && grad == at::kBFloat16) return fn(c10::BFloat16{}, c10::BFloat16{});
  if (acc == at::kHalf && grad == at::kHalf) return fn(c10::Half{}, c10::Half{});
  TORCH_INTERNAL_ASSERT(false, "accumulate_: unchecked dtype pair ", acc, ", ", grad);
}

}  // namespace pipecomm
