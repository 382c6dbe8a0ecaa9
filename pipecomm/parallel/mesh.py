"""``pipecomm.init``: torch.distributed from the torchrun environment, and the data, pipeline and tensor-parallel mesh."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipecomm.runtime import fail_fast

__all__ = ["ParallelContext", "init"]


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits: its pipeline stage, data-parallel replica and tensor-parallel shard, their groups, its
    device, and the ("dp", "pp", "tp") mesh for torch's own APIs (``fully_shard(..., mesh=ctx.mesh["dp"])``,
    ``parallelize_module(..., ctx.mesh["tp"], ...)``)."""

    rank: int
    world_size: int
    stage: int
    num_stages: int
    dp_rank: int
    data_size: int
    tp_rank: int
    tensor_size: int
    pipeline_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    tensor_group: dist.ProcessGroup
    device: torch.device
    mesh: DeviceMesh


def init(pipeline_size: int | None = None, data_size: int = 1, tensor_size: int = 1, *,
         timeout: float = 300.0) -> ParallelContext:
    """Initialises torch.distributed (NCCL on GPUs, gloo on CPU) and a ("dp", "pp", "tp") device mesh.

    Reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; with none of them set it runs as a
    single process. An already initialised default group is used as it is. data_size × pipeline_size ×
    tensor_size must be the world size (``pipeline_size`` defaults to what is left). Tensor parallelism is
    innermost, then the pipeline: consecutive ranks form a tensor-parallel group, which then shares a host
    (its all-reduces are the most frequent), and a pipeline's neighbours are as close as the rest allows.
    """
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    pipeline_size = _check_sizes(world_size, pipeline_size, data_size, tensor_size)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            if world_size != 1:
                raise ValueError("init: WORLD_SIZE > 1 but MASTER_ADDR is not set; launch with torchrun")
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    mesh = init_device_mesh(device.type, (data_size, pipeline_size, tensor_size), mesh_dim_names=("dp", "pp", "tp"))
    global _mesh
    _mesh = mesh
    fail_fast.install()  # after torch's own excepthook: a rank that fails before its first Pipeline tells the peers
    return ParallelContext(
        rank=rank,
        world_size=world_size,
        stage=mesh.get_local_rank("pp"),
        num_stages=pipeline_size,
        dp_rank=mesh.get_local_rank("dp"),
        data_size=data_size,
        tp_rank=mesh.get_local_rank("tp"),
        tensor_size=tensor_size,
        pipeline_group=mesh.get_group("pp"),
        data_group=mesh.get_group("dp"),
        tensor_group=mesh.get_group("tp"),
        device=device,
        mesh=mesh,
    )


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The default group's rank of ``group``'s rank ``group_rank`` (None: the default group itself)."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def failure_scope(group: dist.ProcessGroup | None, data_group: dist.ProcessGroup | None) -> list[int] | None:
    """The global ranks whose failures stop a Pipeline over ``group``: None (the whole job) for the default group or
    a group of ``pipecomm.init``'s mesh, whose pipelines, replicas and tensor-parallel peers wait on each other; a
    group of the caller's own and its ``data_group`` otherwise, so that another model's Pipeline fails apart."""
    if group is None or (_mesh is not None and group in (_mesh.get_group("pp"), _mesh.get_group("dp"))):
        return None
    ranks = set(dist.get_process_group_ranks(group))
    if data_group is not None:
        ranks.update(dist.get_process_group_ranks(data_group))
    return sorted(ranks)


def named_mesh(names: tuple[str, ...]) -> DeviceMesh:
    """This rank's submesh of ``pipecomm.init``'s mesh with these dimension names (e.g. ("tp",))."""
    if _mesh is None:
        raise ValueError(f"a DTensor on a mesh of dimensions {names} crossed a stage boundary; the receiving rank "
                         "rebuilds it on pipecomm.init's mesh, and this process has none: call pipecomm.init")
    missing = set(names) - set(_mesh.mesh_dim_names)
    if missing:
        raise ValueError(f"a DTensor on a mesh of dimensions {names} crossed a stage boundary, but pipecomm.init's mesh "
                         f"has only {_mesh.mesh_dim_names}")
    return _mesh[names[0]] if len(names) == 1 else _mesh[names]


def _check_sizes(world_size: int, pipeline_size: int | None, data_size: int, tensor_size: int) -> int:
    """The pipeline size, once data × pipeline × tensor is known to be the world size: before any communication."""
    for name, size in (("data_size", data_size), ("tensor_size", tensor_size), ("pipeline_size", pipeline_size)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"init: {name} must be a positive int, got {size!r}")
    if pipeline_size is None:
        if world_size % (data_size * tensor_size):
            raise ValueError(f"init: the world size {world_size} is not divisible by data_size × tensor_size = "
                             f"{data_size} × {tensor_size}")
        pipeline_size = world_size // (data_size * tensor_size)
    if data_size * pipeline_size * tensor_size != world_size:
        raise ValueError(f"init: data_size × pipeline_size × tensor_size must equal the world size: {data_size} × "
                         f"{pipeline_size} × {tensor_size} != {world_size}")
    return pipeline_size


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_mesh: DeviceMesh | None = None  # the last pipecomm.init's, where DTensors crossing a stage boundary are rebuilt
