"""pipecomm: pipeline-parallel training for PyTorch with fused stage-boundary transport."""

from importlib.metadata import PackageNotFoundError, version

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from pipecomm import _C
from pipecomm._ops import accumulate_, pack, packed_nbytes, unpack_
from pipecomm.schedules.auto_schedule import starting_schedule
from pipecomm.runtime.failure import PeerFailedError
from pipecomm.parallel.mesh import ParallelContext, init
from pipecomm.splitting.partition import StageModule, merge_checkpoints, split
from pipecomm.pipeline import Pipeline
from pipecomm.schedules.offload import OffloadPlan, plan_offload
from pipecomm.schedules.planner import plan_schedule
from pipecomm.schedules.schedule import make_schedule
from pipecomm.schedules.simulation import simulate

try:
    __version__ = version("pipecomm")
except PackageNotFoundError:  # running from a source tree that was built in place, not installed
    __version__ = "0.0.0+local"

__all__ = [
    "OffloadPlan",
    "ParallelContext",
    "PeerFailedError",
    "Pipeline",
    "StageModule",
    "accumulate_",
    "build_info",
    "cuda_built",
    "init",
    "make_schedule",
    "merge_checkpoints",
    "pack",
    "packed_nbytes",
    "plan_offload",
    "plan_schedule",
    "simulate",
    "split",
    "starting_schedule",
    "unpack_",
]


def build_info() -> dict:
    """What the native extension was compiled with: pipecomm, torch and CUDA versions."""
    return {"version": __version__, **_C.build_info()}


def cuda_built() -> bool:
    """Whether the CUDA kernels were compiled in (not whether a GPU is visible now)."""
    return bool(_C.build_info()["cuda"])
