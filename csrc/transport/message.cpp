// A channel message as the Python API sees it: checking, describing, encoding and allocating.
#include "message.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>

#include "errors.h"

namespace py = pybind11;

namespace pipecomm::transport {
namespace {

template <typename T>
void put(std::string& bytes, T value) {
  bytes.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
T take(const std::string& bytes, size_t& offset, const std::string& direction) {
  if (offset + sizeof(T) > bytes.size()) throw ProtocolError(direction + ": truncated metadata message");
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  offset += sizeof(T);
  return value;
}

}  // namespace

Entries outgoing_entries(const py::sequence& entries, const at::Device& device, const std::string& direction) {
  Entries checked;
  checked.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const py::handle entry = entries[i];
    if (entry.is_none()) {
      checked.emplace_back(std::nullopt);
      continue;
    }
    if (!THPVariable_Check(entry.ptr())) {
      throw py::type_error(direction + ": entry " + std::to_string(i) + " is a " +
                           std::string(py::str(entry.get_type().attr("__name__"))) + ", not a tensor");
    }
    const at::Tensor& tensor = THPVariable_Unpack(entry.ptr());
    // pybind11's own error type: a c10::ValueError thrown through this module crashed the process with
    // torch 2.11+cu130 (also before any channel error types were registered).
    if (tensor.device() != device) {
      throw py::value_error(direction + ": tensors[" + std::to_string(i) + "] is on " + tensor.device().str() +
                            ", but this channel carries tensors on " + device.str());
    }
    // Only a copy needs detaching: the channel reads the data, it never hands these tensors back.
    checked.emplace_back(tensor.is_contiguous() ? tensor : tensor.detach().contiguous());
  }
  return checked;
}

MessageMeta describe(const Entries& entries) {
  MessageMeta meta(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i]) continue;
    meta[i].present = true;
    meta[i].dtype = entries[i]->scalar_type();
    meta[i].sizes = entries[i]->sizes().vec();
  }
  return meta;
}

bool describes(const MessageMeta& meta, const Entries& entries) {
  if (meta.size() != entries.size()) return false;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (meta[i].present != entries[i].has_value()) return false;
    if (entries[i] && (meta[i].dtype != entries[i]->scalar_type() || entries[i]->sizes() != meta[i].sizes)) {
      return false;
    }
  }
  return true;
}

uint64_t fingerprint(const MessageMeta& meta) {
  uint64_t hash = 0xcbf29ce484222325ull;
  const auto mix = [&](uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xff;
      hash *= 0x100000001b3ull;
    }
  };
  mix(meta.size());
  for (const EntryMeta& entry : meta) {
    mix(entry.present ? 1 : 0);
    if (!entry.present) continue;
    mix(static_cast<uint64_t>(entry.dtype));
    mix(entry.sizes.size());
    for (const int64_t size : entry.sizes) mix(static_cast<uint64_t>(size));
  }
  return hash;
}

std::vector<at::Tensor> present_tensors(const Entries& entries) {
  std::vector<at::Tensor> tensors;
  for (const auto& entry : entries) {
    if (entry) tensors.push_back(*entry);
  }
  return tensors;
}

std::string encode(const MessageMeta& meta) {
  std::string bytes;
  put<uint32_t>(bytes, static_cast<uint32_t>(meta.size()));
  for (const EntryMeta& entry : meta) {
    put<uint8_t>(bytes, entry.present ? 1 : 0);
    if (!entry.present) continue;
    put<int8_t>(bytes, static_cast<int8_t>(entry.dtype));
    put<uint8_t>(bytes, static_cast<uint8_t>(entry.sizes.size()));
    for (int64_t size : entry.sizes) put<int64_t>(bytes, size);
  }
  return bytes;
}

MessageMeta decode(const std::string& bytes, const std::string& direction) {
  size_t offset = 0;
  const auto count = take<uint32_t>(bytes, offset, direction);
  // Each entry takes at least a byte: a larger count is corrupt, and would be a huge allocation here.
  if (count > bytes.size() - offset) throw ProtocolError(direction + ": truncated metadata message");
  MessageMeta meta(count);
  for (EntryMeta& entry : meta) {
    entry.present = take<uint8_t>(bytes, offset, direction) != 0;
    if (!entry.present) continue;
    const auto dtype = take<int8_t>(bytes, offset, direction);
    if (dtype < 0 || dtype >= static_cast<int8_t>(at::ScalarType::NumOptions)) {
      throw ProtocolError(direction + ": metadata names unknown dtype " + std::to_string(dtype));
    }
    entry.dtype = static_cast<at::ScalarType>(dtype);
    entry.sizes.resize(take<uint8_t>(bytes, offset, direction));
    for (int64_t& size : entry.sizes) {
      size = take<int64_t>(bytes, offset, direction);
      if (size < 0) throw ProtocolError(direction + ": metadata has a negative size");
    }
  }
  if (offset != bytes.size()) throw ProtocolError(direction + ": metadata message has trailing bytes");
  return meta;
}

Entries allocate(const MessageMeta& meta, const at::Device& device) {
  Entries entries;
  entries.reserve(meta.size());
  for (const EntryMeta& entry : meta) {
    if (entry.present) {
      entries.emplace_back(at::empty(entry.sizes, at::TensorOptions().dtype(entry.dtype).device(device)));
    } else {
      entries.emplace_back(std::nullopt);
    }
  }
  return entries;
}

py::tuple to_python(const Entries& entries) {
  py::tuple result(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    result[i] = entries[i] ? py::cast(*entries[i]) : py::none();
  }
  return result;
}

}  // namespace pipecomm::transport
