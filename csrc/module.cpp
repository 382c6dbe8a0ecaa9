// The pipecomm._C Python module: importing it runs the op registrars; it reports what was built.
#include <pybind11/pybind11.h>
#include <torch/version.h>

#include "pack_alignment.h"
#include "transport/bindings.h"

#ifdef PIPECOMM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict info;
  info["torch"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                  "." + std::to_string(TORCH_VERSION_PATCH);
#ifdef PIPECOMM_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#else
  info["cuda"] = false;
  info["cuda_version"] = py::none();
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pipecomm native extension";
  m.def("build_info", &build_info, "What this extension was compiled with: torch version, CUDA or not.");
  m.attr("PACK_ALIGNMENT") = pipecomm::kPackAlignment;
  pipecomm::transport::register_bindings(m);
}
