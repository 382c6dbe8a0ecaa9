// Registers the channel runtime on the extension module: error types, then each channel kind.
#include "bindings.h"

#include "shm_ring.h"

namespace py = pybind11;

namespace pipecomm::transport {

void register_shm_channel(py::module_& module);
#ifdef PIPECOMM_WITH_CUDA
void register_ipc_channel(py::module_& module);
#endif

void register_bindings(py::module_& module) {
  // pybind11 tries the most recently registered translator first, so derived errors come last.
  static py::exception<ChannelError> channel_error(module, "ChannelError", PyExc_RuntimeError);
  py::register_exception<TimeoutError>(module, "ChannelTimeoutError", PyExc_TimeoutError);
  py::register_exception<PeerDiedError>(module, "PeerDiedError", channel_error.ptr());
  py::register_exception<ProtocolError>(module, "ProtocolError", channel_error.ptr());
  register_shm_channel(module);
#ifdef PIPECOMM_WITH_CUDA
  register_ipc_channel(module);
#endif
}

}  // namespace pipecomm::transport
