// A channel message as the Python API sees it: a sequence of tensors or None, and its metadata.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <vector>

namespace pipecomm::transport {

using Entries = std::vector<std::optional<at::Tensor>>;

// dtype and shape of one entry; None entries are kept so the receiver rebuilds the same tuple.
struct EntryMeta {
  bool present = false;
  at::ScalarType dtype = at::kByte;
  std::vector<int64_t> sizes;

  bool operator==(const EntryMeta& other) const {
    return present == other.present && dtype == other.dtype && sizes == other.sizes;
  }
};

using MessageMeta = std::vector<EntryMeta>;

// The caller's entries, checked: tensors on `device` (made contiguous), None kept; anything else is
// a TypeError naming its index. `direction` starts error messages.
Entries outgoing_entries(const pybind11::sequence& entries, const at::Device& device, const std::string& direction);

MessageMeta describe(const Entries& entries);
// Whether `meta` describes `entries`, without building their metadata (the per-message check).
bool describes(const MessageMeta& meta, const Entries& entries);
// A 64-bit digest of the metadata (FNV-1a), equal on both ends for equal metadata.
uint64_t fingerprint(const MessageMeta& meta);
std::vector<at::Tensor> present_tensors(const Entries& entries);

// A compact binary form sent only when the metadata changes.
std::string encode(const MessageMeta& meta);
MessageMeta decode(const std::string& bytes, const std::string& direction);

// Fresh tensors for a message with this metadata, on `device`.
Entries allocate(const MessageMeta& meta, const at::Device& device);

pybind11::tuple to_python(const Entries& entries);

}  // namespace pipecomm::transport
