"""What every schedule is: each action once, on the rank holding its stage, after the actions it depends on."""

from __future__ import annotations

from collections.abc import Mapping

from pipecomm.schedules.schedule import COMPUTE_KINDS, FORWARD_KINDS, Action, Kind, Schedule, counterpart

__all__: list[str] = []


def check_structure(schedule: Schedule) -> None:
    if schedule.num_ranks < 1 or len(schedule.actions) != schedule.num_ranks:
        raise ValueError(f"schedule has {len(schedule.actions)} action lists for num_ranks={schedule.num_ranks}")
    # Every action once, where it belongs: (rank, index in that rank's list).
    positions: dict[Action, tuple[int, int]] = {}
    for rank, program in enumerate(schedule.actions):
        for index, action in enumerate(program):
            if not 0 <= action.stage < schedule.num_stages:
                raise ValueError(f"{action} on rank {rank}: stage outside [0, {schedule.num_stages})")
            if not 0 <= action.micro_batch < schedule.micro_batches:
                raise ValueError(f"{action} on rank {rank}: micro-batch outside [0, {schedule.micro_batches})")
            if schedule.forward_only and action.kind not in FORWARD_KINDS:
                raise ValueError(f"{action} on rank {rank}: a forward-only schedule has no backward passes or "
                                 "gradient transfers")
            if schedule.stage_rank(action.stage) != rank:
                raise ValueError(
                    f"{action} is on rank {rank}, but stage {action.stage} is held by rank "
                    f"{schedule.stage_rank(action.stage)}"
                )
            if action in positions:
                first_rank, first_index = positions[action]
                raise ValueError(
                    f"{action} appears twice: rank {first_rank} position {first_index} and rank {rank} position {index}"
                )
            positions[action] = (rank, index)

    last_stage = schedule.num_stages - 1
    for stage in range(schedule.num_stages):
        for micro_batch in range(schedule.micro_batches):
            _check_passes(stage, micro_batch, positions, schedule.forward_only)
            # Each compute pass with the transfers that feed it and carry its result on.
            needs = [(Kind.F, Kind.RECV_F, stage > 0), (Kind.F, Kind.SEND_F, stage < last_stage)]
            if not schedule.forward_only:
                backward_kind = Kind.B if Action(Kind.B, stage, micro_batch) in positions else Kind.I
                needs += [(backward_kind, Kind.RECV_B, stage < last_stage), (backward_kind, Kind.SEND_B, stage > 0)]
            for compute_kind, transfer_kind, needed in needs:
                compute = Action(compute_kind, stage, micro_batch)
                transfer = Action(transfer_kind, stage, micro_batch)
                if needed and transfer not in positions:
                    peer = counterpart(transfer)
                    purpose = "to receive" if transfer_kind in (Kind.RECV_F, Kind.RECV_B) else "to feed"
                    raise ValueError(
                        f"{compute} on rank {positions[compute][0]} has no {transfer} {purpose} {peer} "
                        f"on rank {schedule.stage_rank(peer.stage)}"
                    )

    # Every transfer between two existing stages is now paired: both ends are needed by compute
    # passes that exist. What is left are transfers off either end of the pipeline.
    for action, (rank, _) in positions.items():
        if action.is_compute:
            continue
        peer_stage = counterpart(action).stage
        if not 0 <= peer_stage <= last_stage:
            raise ValueError(f"{action} on rank {rank}: stage {action.stage} has no neighbour stage {peer_stage}")

    for action, (rank, index) in positions.items():
        for prerequisite in _local_prerequisites(action):
            if prerequisite in positions and positions[prerequisite][1] > index:
                raise ValueError(
                    f"rank {rank} runs {action} (position {index}) before {prerequisite} "
                    f"(position {positions[prerequisite][1]}), which it depends on"
                )


def _check_passes(stage: int, micro_batch: int, positions: Mapping[Action, tuple[int, int]], forward_only: bool) -> None:
    present = {kind for kind in COMPUTE_KINDS if Action(kind, stage, micro_batch) in positions}
    where = f"stage {stage}, micro-batch {micro_batch}"
    if Kind.F not in present:
        raise ValueError(f"{where} has no forward F{stage}.{micro_batch}")
    if forward_only:
        return
    if Kind.B in present and present & {Kind.I, Kind.W}:
        split = " and ".join(f"{kind}{stage}.{micro_batch}" for kind in (Kind.I, Kind.W) if kind in present)
        raise ValueError(f"{where} mixes a full backward B{stage}.{micro_batch} with {split}")
    if Kind.B not in present and present != {Kind.F, Kind.I, Kind.W}:
        raise ValueError(
            f"{where} has no complete backward: needs B{stage}.{micro_batch}, "
            f"or both I{stage}.{micro_batch} and W{stage}.{micro_batch}"
        )


# The kinds of the same stage and micro-batch that an action of each kind needs before it on its rank.
_LOCAL_PREREQUISITES = {Kind.F: (Kind.RECV_F,), Kind.B: (Kind.F, Kind.RECV_B), Kind.I: (Kind.F, Kind.RECV_B),
                        Kind.W: (Kind.I,), Kind.SEND_F: (Kind.F,), Kind.SEND_B: (Kind.B, Kind.I), Kind.RECV_F: (),
                        Kind.RECV_B: ()}


def _local_prerequisites(action: Action) -> tuple[Action, ...]:
    """Actions of the same rank that must come before ``action`` (those absent from the schedule are skipped)."""
    return tuple(Action(kind, action.stage, action.micro_batch) for kind in _LOCAL_PREREQUISITES[action.kind])
