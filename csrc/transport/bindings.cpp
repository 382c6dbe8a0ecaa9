// Registers the channel runtime on the extension module: error types, then each channel kind.
#include "bindings.h"

#include "errors.h"

namespace py = pybind11;

namespace pipecomm::transport {

void register_shm_channel(py::module_& module);
void register_message_codec(py::module_& module);
#ifdef PIPECOMM_WITH_CUDA
void register_ipc_channel(py::module_& module);
#endif

namespace {

// Kept for the life of the process (the module holds them too), so nothing is released at exit.
struct ErrorTypes {
  PyObject* channel = nullptr;
  PyObject* timeout = nullptr;
  PyObject* peer_died = nullptr;
  PyObject* protocol = nullptr;
};

ErrorTypes& error_types() {
  static ErrorTypes types;
  return types;
}

// bases: one type or a tuple of them (PyErr_NewException takes either).
PyObject* add_error_type(py::module_& module, const char* name, py::handle bases) {
  const std::string qualified = module.attr("__name__").cast<std::string>() + "." + name;
  PyObject* type = PyErr_NewException(qualified.c_str(), bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  module.attr(name) = py::handle(type);
  return type;
}

}  // namespace

void register_bindings(py::module_& module) {
  ErrorTypes& types = error_types();
  types.channel = add_error_type(module, "ChannelError", PyExc_RuntimeError);
  // Also a builtin TimeoutError, so both `except ChannelError` and `except TimeoutError` catch it.
  types.timeout = add_error_type(module, "ChannelTimeoutError",
                                 py::make_tuple(py::handle(types.channel), py::handle(PyExc_TimeoutError)));
  types.peer_died = add_error_type(module, "PeerDiedError", types.channel);
  types.protocol = add_error_type(module, "ProtocolError", types.channel);
  // One translator that tries the most derived C++ types first: with one per type, pybind11 would try
  // the newest first, and the order of registration would decide which base swallows a derived error.
  py::register_local_exception_translator([](std::exception_ptr pending) {
    if (!pending) return;
    const ErrorTypes& known = error_types();
    try {
      std::rethrow_exception(pending);
    } catch (const TimeoutError& error) {
      PyErr_SetString(known.timeout, error.what());
    } catch (const PeerDiedError& error) {
      PyErr_SetString(known.peer_died, error.what());
    } catch (const ProtocolError& error) {
      PyErr_SetString(known.protocol, error.what());
    } catch (const ChannelError& error) {
      PyErr_SetString(known.channel, error.what());
    }
  });
  register_shm_channel(module);
  register_message_codec(module);
#ifdef PIPECOMM_WITH_CUDA
  register_ipc_channel(module);
#endif
}

}  // namespace pipecomm::transport
