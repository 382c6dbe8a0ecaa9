// Every pipecomm op schema; the CPU and CUDA kernels register in cpu/ and cuda/.
#include <torch/library.h>

TORCH_LIBRARY(pipecomm, m) {
  // acc += scale * grad for whole lists in one launch; accumulators are fp32 or the grad's dtype.
  m.def("accumulate_(Tensor(a!)[] accumulators, Tensor[] grads, float scale=1.0) -> ()");
  // Gathers tensors of any dtypes and shapes into one uint8 buffer, each at a 16-byte-aligned offset.
  m.def("pack(Tensor[] tensors) -> Tensor");
  // Scatters a buffer laid out by pack into preallocated tensors.
  m.def("unpack_(Tensor buffer, Tensor(a!)[] outs) -> ()");
}
