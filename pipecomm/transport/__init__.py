"""Point-to-point channels between two ranks: one fused transfer per message over CUDA IPC, shared memory or torch.distributed."""

from pipecomm.transport.channel import (
    Channel,
    ChannelError,
    ChannelTimeoutError,
    Handle,
    PeerDiedError,
    ProtocolError,
)
from pipecomm.transport.connecting import BACKENDS, DEFAULT_TIMEOUT, connect
from pipecomm.transport.dist import DistChannel
from pipecomm.transport.ipc import IpcChannel
from pipecomm.transport.lifetime import keep_forever
from pipecomm.transport.loopback import LoopbackChannel
from pipecomm.transport.shm import ShmChannel

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "Channel",
    "ChannelError",
    "ChannelTimeoutError",
    "DistChannel",
    "Handle",
    "IpcChannel",
    "LoopbackChannel",
    "PeerDiedError",
    "ProtocolError",
    "ShmChannel",
    "connect",
    "keep_forever",
]
