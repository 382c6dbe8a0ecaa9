// The channel runtime's error classes, shared by the shm and CUDA-IPC rings and mapped to Python by bindings.cpp.
#pragma once

#include <stdexcept>

namespace pipecomm::transport {

// Base of every channel failure, so bindings can map the whole family at once.
class ChannelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TimeoutError : public ChannelError {
 public:
  using ChannelError::ChannelError;
};

class PeerDiedError : public ChannelError {
 public:
  using ChannelError::ChannelError;
};

// Misuse or a peer that broke the protocol: closed peer, out-of-order release, bad header.
class ProtocolError : public ChannelError {
 public:
  using ChannelError::ChannelError;
};

}  // namespace pipecomm::transport
