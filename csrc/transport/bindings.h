// Registers the channel runtime's Python classes on the extension module.
#pragma once

#include <pybind11/pybind11.h>

namespace pipecomm::transport {

void register_bindings(pybind11::module_& module);

}  // namespace pipecomm::transport
