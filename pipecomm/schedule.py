"""Pipeline schedules as pure data: per-rank action lists, their generators, a validator and a simulator."""

from __future__ import annotations

import collections
import heapq
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipecomm.list_scheduling import build_orders, v_first_stage_lead

__all__ = [
    "COMMUNICATION_KINDS",
    "COMPUTE_KINDS",
    "DEFAULT_COSTS",
    "SCHEDULES",
    "Action",
    "Schedule",
    "forward_schedule",
    "SimulationResult",
    "make_schedule",
    "peak_memory",
    "simulate",
    "validate",
]

COMPUTE_KINDS = ("F", "B", "I", "W")
COMMUNICATION_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_FORWARD_KINDS = ("F", "SEND_F", "RECV_F")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
DEFAULT_COSTS: Mapping[str, float] = types.MappingProxyType(
    {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "SEND_F": 0.0, "RECV_F": 0.0, "SEND_B": 0.0, "RECV_B": 0.0}
)

# Schedules that run a steady state need every rank to have finished its warm-up before the first
# backward reaches it (MindFormers' micro_batch_num >= stages).
_NEEDS_MICRO_BATCHES_PER_RANK = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
# Built by list scheduling (pipecomm.list_scheduling) at unit costs: (placement, peak activations in 1f1b's units).
_LIST_SCHEDULED = {
    "zb-h2": (lambda num_ranks: looped_placement(num_ranks, num_ranks), 2.0),
    "zb-v": (lambda num_ranks: v_placement(num_ranks), 1.0),
}
# Up to this many (stage, micro-batch) pairs, one list-scheduled build runs in Python in under 0.3 s (p = 32, m = 128),
# sooner than numba loads its compiled code the first time in a process (about a second, on every rank).
_INTERPRETED_BUILD_UP_TO = 4096


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: a compute pass of one stage on one micro-batch, or one end of a transfer.

    F is the forward, B the full backward; I (grad of the input) and W (grad of the weights) together
    replace B. SEND_F(s) sends stage s's output to stage s + 1 and RECV_F(s) receives stage s's input;
    SEND_B(s) sends the grad of stage s's input to stage s - 1 and RECV_B(s) receives the grad of stage
    s's output.
    """

    kind: str
    stage: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMMUNICATION_KINDS:
            known = ", ".join(COMPUTE_KINDS + COMMUNICATION_KINDS)
            raise ValueError(f"Action: kind must be one of {known}, not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro_batch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass(frozen=True)
class Schedule:
    """What every rank runs, in order, and which rank holds each stage.

    ``placement[s]`` is the rank of stage s; left empty it is looped (stage s on rank s % num_ranks).
    The V placement of ZB-V puts stages r and 2 * num_ranks - 1 - r on rank r. A ``forward_only`` schedule
    (inference) has F passes and their transfers only; any other needs every backward.
    """

    name: str
    num_ranks: int
    num_stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order
    placement: tuple[int, ...] = ()
    forward_only: bool = False

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", looped_placement(self.num_ranks, self.num_stages))
        if len(self.placement) != self.num_stages or not all(0 <= rank < self.num_ranks for rank in self.placement):
            raise ValueError(f"Schedule: placement {self.placement} must give each of {self.num_stages} stages a rank "
                             f"in [0, {self.num_ranks})")

    def stage_rank(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(stage for stage, holder in enumerate(self.placement) if holder == rank)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks


def looped_placement(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    return tuple(stage % num_ranks for stage in range(num_stages))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank, down the ranks and back: rank r holds stages r and 2 * num_ranks - 1 - r."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclass(frozen=True)
class SimulationResult:
    """Timing of one training step. Only compute (F, B, I, W) counts as busy; waiting and transfers are bubble."""

    step_time: float
    bubble_fraction: float  # 1 - total compute time / (num_ranks * step_time)
    busy_time: tuple[float, ...]  # per rank
    # Per rank, the most (stage, micro-batch) pairs whose F has run and whose B (or W) has not.
    peak_activations: tuple[int, ...]
    # The same in units of one rank's share of the model (a 1f1b stage's activations of one micro-batch): a
    # pair counts 1/v on a schedule with v stages per rank. 1f1b's rank 0 peaks at num_ranks.
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]  # per rank: (start, end, action) of compute


def make_schedule(name: str, num_ranks: int, micro_batches: int, virtual_stages: int | None = None, *,
                  costs: Mapping[str, float] | None = None) -> Schedule:
    """Builds the named schedule with its communication actions placed.

    "gpipe": every forward in micro-batch order, then every backward in the same order (as
    torch.distributed.pipelining's ScheduleGPipe). "1f1b": Megatron's non-interleaved schedule
    (PipeDream-flush). "interleaved-1f1b": Megatron's forward_backward_pipelining_with_interleaving,
    ``virtual_stages`` model chunks per rank. "zb-h1": ZB-H1 of Qi et al., "Zero Bubble Pipeline
    Parallelism" (ICLR 2024), the backward split into I and W. "zb-h2": the same split with up to
    twice 1F1B's activations, so that rank r's warm-up covers the wait for its first gradient.
    "zb-v": ZB-V, two stages per rank placed in a V (rank r holds stages r and 2 * num_ranks - 1 - r;
    ``Schedule.stages_of`` tells), at 1F1B's peak activation memory. zb-h2 and zb-v are built by
    list scheduling (``pipecomm.list_scheduling``) for ``costs`` (F, I and W of one rank's share, as
    ``simulate`` takes them; default F = I = W): an order built for equal costs can lose much of its
    gain where I costs more than F, so give measured costs where they are known. Where the V's greedy order would
    fill a rank's memory with its first stage's forwards and wait forever, that stage is held back.

    ``virtual_stages`` (stages per rank) defaults to 2 for zb-v and 1 otherwise; interleaved-1f1b
    needs it given. Every RECV sits immediately before the compute that consumes it and every SEND
    immediately after the compute that produces it.
    """
    if virtual_stages is None:
        virtual_stages = 2 if name == "zb-v" else 1
    _check_schedule_arguments(name, num_ranks, micro_batches, virtual_stages)
    num_stages = num_ranks * virtual_stages
    if name in _LIST_SCHEDULED:
        make_placement, memory = _LIST_SCHEDULED[name]
        placement = make_placement(num_ranks)
        pass_costs = {kind: (1.0 if costs is None else float(costs[kind])) / virtual_stages for kind in ("F", "I", "W")}
        orders = _list_scheduled_orders(name, placement, micro_batches, pass_costs, memory * num_ranks)
        compute_orders = [[Action(*compute) for compute in order] for order in orders]
    else:
        if costs is not None:
            raise ValueError(f"make_schedule: costs shape only the list-scheduled zb-h2 and zb-v, not {name!r}")
        placement = looped_placement(num_ranks, num_stages)
        compute_orders = [_COMPUTE_ORDERS[name](rank, num_ranks, micro_batches, virtual_stages)
                          for rank in range(num_ranks)]
    actions = tuple(with_communication(order, num_stages) for order in compute_orders)
    return Schedule(name, num_ranks, num_stages, micro_batches, actions, placement)


def _list_scheduled_orders(name: str, placement: tuple[int, ...], micro_batches: int, pass_costs: Mapping[str, float],
                           memory_cap: float) -> list[list[tuple[str, int, int]]]:
    """The greedy orders; where the V's greedy fills a rank's memory with first-stage forwards before the far side
    of the V returns (I well above F + W at p = 2), its first stages held back, as little as lets it finish."""
    num_ranks = max(placement) + 1
    jit = len(placement) * micro_batches > _INTERPRETED_BUILD_UP_TO
    leads = [None] if name != "zb-v" else [None] + [v_first_stage_lead(num_ranks, base)
                                                    for base in range(num_ranks + 1, 0, -1)]
    for lead in leads[:-1]:
        try:
            return build_orders(placement, micro_batches, pass_costs, memory_cap, first_stage_lead=lead, jit=jit)
        except ValueError:
            continue
    return build_orders(placement, micro_batches, pass_costs, memory_cap, first_stage_lead=leads[-1], jit=jit)


def forward_schedule(num_ranks: int, micro_batches: int, placement: tuple[int, ...]) -> Schedule:
    """Inference on ``placement``: every F pass with its transfers, each micro-batch moving one stage per slot.

    Micro-batch m runs stage s at slot start(m) + s, where start(m) is the first slot after start(m - 1) at which
    none of its passes meets an earlier micro-batch's on the same rank (a rank runs one pass per slot). So every
    message is received in the slot after it is sent, and one buffer slot per channel suffices: no order deadlocks
    on the runtime's bounded channels. One stage per rank gives GPipe's forward; interleaved stages, Megatron's
    groups of num_ranks micro-batches; the V, a new micro-batch every second slot.
    """
    num_stages = len(placement)
    busy: set[tuple[int, int]] = set()  # (rank, slot)
    passes: list[tuple[int, int, int]] = []  # (slot, stage, micro-batch)
    start = -1
    for micro_batch in range(micro_batches):
        start += 1
        while any((placement[stage], start + stage) in busy for stage in range(num_stages)):
            start += 1
        for stage in range(num_stages):
            busy.add((placement[stage], start + stage))
            passes.append((start + stage, stage, micro_batch))
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    for _, stage, micro_batch in sorted(passes):
        orders[placement[stage]].append(Action("F", stage, micro_batch))
    actions = tuple(with_communication(order, num_stages) for order in orders)
    return Schedule("forward", num_ranks, num_stages, micro_batches, actions, tuple(placement), forward_only=True)


def validate(schedule: Schedule, buffer_slots: int = 4) -> None:
    """Raises ValueError naming the first defect: a missing, duplicated or misplaced action, an
    unmatched transfer, a rank that runs an action before one it depends on, a receive out of its
    channel's order, or a deadlock.

    The deadlock check runs all ranks together: a RECV blocks until its SEND has run on the peer,
    and a SEND blocks while its channel already holds ``buffer_slots`` messages that have not been
    received. As the runtime opens them, a pair of ranks has an activation and a gradient channel,
    each in order and with its own slots each way; a rank's messages to itself never block.
    """
    if buffer_slots < 1:
        raise ValueError(f"validate: buffer_slots must be >= 1, got {buffer_slots}")
    _check_structure(schedule)
    _check_channel_order(schedule)
    _execute(schedule, lambda action: 0.0, 0.0, buffer_slots)


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | Callable[[Action], float] | None = None,
    comm_time: float = 0.0,
    *,
    buffer_slots: int | None = None,
) -> SimulationResult:
    """Runs the schedule event by event, with the blocking rules of ``validate``.

    ``costs`` maps an action kind to its duration (kinds left out keep ``DEFAULT_COSTS``: F=1, B=2,
    I=1, W=1, transfers 0) or is a function of the whole action, called for transfers too. A compute
    cost is that of one rank's share of the model (what a 1f1b stage computes): on a schedule with v
    stages per rank each pass takes 1/v of it, so that every schedule of one model compares. A message
    can be received ``comm_time`` after its SEND completes. ``buffer_slots=None`` never blocks a SEND.
    Raises ValueError for a malformed schedule and for a deadlock, as ``validate`` does.
    """
    if comm_time < 0:
        raise ValueError(f"simulate: comm_time must be >= 0, got {comm_time}")
    if buffer_slots is not None and buffer_slots < 1:
        raise ValueError(f"simulate: buffer_slots must be >= 1 or None, got {buffer_slots}")
    _check_structure(schedule)
    duration = _duration_function(costs)
    share = 1.0 / schedule.stages_per_rank

    def scaled(action: Action) -> float:
        return duration(action) * share if action.is_compute else duration(action)

    timeline, finish_times = _execute(schedule, scaled, comm_time, buffer_slots)
    step_time = max(finish_times)
    busy_time = tuple(sum(end - start for start, end, _ in rank_timeline) for rank_timeline in timeline)
    # A schedule of zero-cost actions takes no time and so wastes none.
    bubble_fraction = 1.0 - sum(busy_time) / (schedule.num_ranks * step_time) if step_time > 0 else 0.0
    peaks = tuple(_peak_activations(program) for program in schedule.actions)
    return SimulationResult(
        step_time=step_time,
        bubble_fraction=bubble_fraction,
        busy_time=busy_time,
        peak_activations=peaks,
        peak_memory=peak_memory(schedule),
        timeline=tuple(tuple(rank_timeline) for rank_timeline in timeline),
    )


def peak_memory(schedule: Schedule) -> tuple[float, ...]:
    """Per rank, the most activations held at once, in units of one rank's share of the model (1f1b's rank 0: num_ranks)."""
    return tuple(_peak_activations(program) / schedule.stages_per_rank for program in schedule.actions)


def _check_schedule_arguments(name: str, num_ranks: int, micro_batches: int, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"make_schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if num_ranks < 1:
        raise ValueError(f"make_schedule: num_ranks must be >= 1, got {num_ranks}")
    if micro_batches < 1:
        raise ValueError(f"make_schedule: micro_batches must be >= 1, got {micro_batches}")
    if name in _NEEDS_MICRO_BATCHES_PER_RANK and micro_batches < num_ranks:
        raise ValueError(
            f"make_schedule: {name!r} needs micro_batches >= num_ranks, "
            f"got micro_batches={micro_batches}, num_ranks={num_ranks}"
        )
    if name == "interleaved-1f1b":
        if virtual_stages < 2:
            raise ValueError(
                f"make_schedule: 'interleaved-1f1b' needs virtual_stages >= 2 (model chunks per rank), "
                f"got {virtual_stages}"
            )
        if micro_batches % num_ranks != 0:
            raise ValueError(
                f"make_schedule: 'interleaved-1f1b' needs micro_batches to be a multiple of num_ranks, "
                f"got micro_batches={micro_batches}, num_ranks={num_ranks}"
            )
    elif name == "zb-v":
        if virtual_stages != 2:
            raise ValueError(f"make_schedule: 'zb-v' runs two stages per rank and needs virtual_stages == 2, "
                             f"got {virtual_stages}")
    elif virtual_stages != 1:
        raise ValueError(
            f"make_schedule: {name!r} runs one stage per rank and needs virtual_stages == 1, got {virtual_stages}"
        )


def _gpipe_order(rank: int, num_ranks: int, micro_batches: int, virtual_stages: int) -> list[Action]:
    forwards = [Action("F", rank, micro_batch) for micro_batch in range(micro_batches)]
    backwards = [Action("B", rank, micro_batch) for micro_batch in range(micro_batches)]
    return forwards + backwards


def _warmup_then_alternate(forward, backward, num_warmup: int, count: int) -> list[Action]:
    """num_warmup forwards, then each further forward paired with the oldest pending backward, then
    the remaining backwards: the 1F1B pattern every non-GPipe schedule here shares."""
    order = [forward(index) for index in range(num_warmup)]
    for index in range(count):
        if num_warmup + index < count:
            order.append(forward(num_warmup + index))
        order.extend(backward(index))
    return order


def _one_f_one_b_order(rank: int, num_ranks: int, micro_batches: int, virtual_stages: int) -> list[Action]:
    # Rank r's p - r - 1 warm-up forwards keep the ranks after it busy until the first backward
    # comes back; the backwards of the last micro-batches drain at the end.
    return _warmup_then_alternate(
        lambda micro_batch: Action("F", rank, micro_batch),
        lambda micro_batch: [Action("B", rank, micro_batch)],
        num_ranks - rank - 1,
        micro_batches,
    )


def _interleaved_order(rank: int, num_ranks: int, micro_batches: int, virtual_stages: int) -> list[Action]:
    # Megatron's order over virtual micro-batches (model chunk, micro-batch): groups of num_ranks
    # micro-batches go through chunk 0, then chunk 1, ..., then the next group; backwards visit the
    # chunks last to first.
    num_virtual = micro_batches * virtual_stages
    group_size = num_ranks * virtual_stages

    def micro_batch_of(virtual: int) -> int:
        return virtual // group_size * num_ranks + virtual % num_ranks

    def forward(virtual: int) -> Action:
        chunk = virtual // num_ranks % virtual_stages
        return Action("F", chunk * num_ranks + rank, micro_batch_of(virtual))

    def backward(virtual: int) -> list[Action]:
        chunk = virtual_stages - 1 - virtual // num_ranks % virtual_stages
        return [Action("B", chunk * num_ranks + rank, micro_batch_of(virtual))]

    num_warmup = min((num_ranks - rank - 1) * 2 + (virtual_stages - 1) * num_ranks, num_virtual)
    return _warmup_then_alternate(forward, backward, num_warmup, num_virtual)


def _zb_h1_order(rank: int, num_ranks: int, micro_batches: int, virtual_stages: int) -> list[Action]:
    # 1F1B with B split: I stays on the critical path where B was, and rank r runs each W r
    # micro-batches late. Every rank then holds num_ranks activations at its peak, the most any rank
    # holds in 1F1B (rank 0), and the late Ws fill the cool-down, where later ranks would idle.
    def input_then_late_weight(micro_batch: int) -> list[Action]:
        late = [Action("W", rank, micro_batch - rank)] if micro_batch >= rank else []
        return [Action("I", rank, micro_batch)] + late

    order = _warmup_then_alternate(
        lambda micro_batch: Action("F", rank, micro_batch), input_then_late_weight, num_ranks - rank - 1,
        micro_batches,
    )
    return order + [Action("W", rank, micro_batch) for micro_batch in range(micro_batches - rank, micro_batches)]


_COMPUTE_ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved-1f1b": _interleaved_order,
    "zb-h1": _zb_h1_order,
}


def with_communication(compute_order: list[Action], num_stages: int) -> tuple[Action, ...]:
    """A rank's compute passes with their transfers: each RECV right before its consumer, each SEND right after its producer."""
    last_stage = num_stages - 1
    actions: list[Action] = []
    for action in compute_order:
        stage, micro_batch = action.stage, action.micro_batch
        is_backward = action.kind in ("B", "I")
        if action.kind == "F" and stage > 0:
            actions.append(Action("RECV_F", stage, micro_batch))
        if is_backward and stage < last_stage:
            actions.append(Action("RECV_B", stage, micro_batch))
        actions.append(action)
        if action.kind == "F" and stage < last_stage:
            actions.append(Action("SEND_F", stage, micro_batch))
        if is_backward and stage > 0:
            actions.append(Action("SEND_B", stage, micro_batch))
    return tuple(actions)


def _counterpart(transfer: Action) -> Action:
    """The other end of a transfer: the RECV that a SEND feeds, or the SEND that a RECV waits for."""
    stage, micro_batch = transfer.stage, transfer.micro_batch
    if transfer.kind == "SEND_F":
        return Action("RECV_F", stage + 1, micro_batch)
    if transfer.kind == "RECV_F":
        return Action("SEND_F", stage - 1, micro_batch)
    if transfer.kind == "SEND_B":
        return Action("RECV_B", stage - 1, micro_batch)
    return Action("SEND_B", stage + 1, micro_batch)


def _check_structure(schedule: Schedule) -> None:
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
            if schedule.forward_only and action.kind not in _FORWARD_KINDS:
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
            needs = [("F", "RECV_F", stage > 0), ("F", "SEND_F", stage < last_stage)]
            if not schedule.forward_only:
                backward_kind = "B" if Action("B", stage, micro_batch) in positions else "I"
                needs += [(backward_kind, "RECV_B", stage < last_stage), (backward_kind, "SEND_B", stage > 0)]
            for compute_kind, transfer_kind, needed in needs:
                compute = Action(compute_kind, stage, micro_batch)
                transfer = Action(transfer_kind, stage, micro_batch)
                if needed and transfer not in positions:
                    peer = _counterpart(transfer)
                    purpose = "to receive" if transfer_kind.startswith("RECV") else "to feed"
                    raise ValueError(
                        f"{compute} on rank {positions[compute][0]} has no {transfer} {purpose} {peer} "
                        f"on rank {schedule.stage_rank(peer.stage)}"
                    )

    # Every transfer between two existing stages is now paired: both ends are needed by compute
    # passes that exist. What is left are transfers off either end of the pipeline.
    for action, (rank, _) in positions.items():
        if action.is_compute:
            continue
        peer_stage = _counterpart(action).stage
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
    if "F" not in present:
        raise ValueError(f"{where} has no forward F{stage}.{micro_batch}")
    if forward_only:
        return
    if "B" in present and present & {"I", "W"}:
        split = " and ".join(f"{kind}{stage}.{micro_batch}" for kind in ("I", "W") if kind in present)
        raise ValueError(f"{where} mixes a full backward B{stage}.{micro_batch} with {split}")
    if "B" not in present and present != {"F", "I", "W"}:
        raise ValueError(
            f"{where} has no complete backward: needs B{stage}.{micro_batch}, "
            f"or both I{stage}.{micro_batch} and W{stage}.{micro_batch}"
        )


def _local_prerequisites(action: Action) -> tuple[Action, ...]:
    """Actions of the same rank that must come before ``action`` (those absent from the schedule are skipped)."""
    stage, micro_batch = action.stage, action.micro_batch
    if action.kind == "F":
        kinds: tuple[str, ...] = ("RECV_F",)
    elif action.kind in ("B", "I"):
        kinds = ("F", "RECV_B")
    elif action.kind == "W":
        kinds = ("I",)
    elif action.kind == "SEND_F":
        kinds = ("F",)
    elif action.kind == "SEND_B":
        kinds = ("B", "I")
    else:
        kinds = ()
    return tuple(Action(kind, stage, micro_batch) for kind in kinds)


def _duration_function(costs: Mapping[str, float] | Callable[[Action], float] | None) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS)
    if costs is not None:
        unknown = sorted(set(costs) - set(table))
        if unknown:
            known = ", ".join(table)
            raise ValueError(f"simulate: unknown action kinds in costs: {', '.join(unknown)}; known: {known}")
        table.update(costs)
    return lambda action: table[action.kind]


def _execute(
    schedule: Schedule,
    duration: Callable[[Action], float],
    comm_time: float,
    buffer_slots: int | None,
) -> tuple[list[list[tuple[float, float, Action]]], list[float]]:
    """Runs every rank's list in order, in global time order; returns the compute timeline and each rank's finish.

    A message occupies a slot of its channel from the start of its SEND until its RECV completes.
    """
    programs = schedule.actions
    num_ranks = schedule.num_ranks

    def peer_rank(transfer: Action) -> int:
        return schedule.stage_rank(_counterpart(transfer).stage)

    next_index = [0] * num_ranks
    running: list[Action | None] = [None] * num_ranks
    finish_times = [0.0] * num_ranks
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(num_ranks)]
    deliveries: dict[Action, float] = {}  # SEND -> when its message can be received
    # (source, target, "act" or "grad"): the runtime opens an activation and a gradient channel per pair of ranks.
    messages_in_channel: collections.Counter[tuple[int, int, str]] = collections.Counter()
    blocked_senders: dict[tuple[int, int, str], int] = {}  # channel -> the rank waiting for a free slot
    blocked_receivers: dict[Action, int] = {}  # SEND not yet run -> the rank waiting for its message

    # Ties in time go to the earlier-scheduled event, so runs are deterministic.
    tie_breaker = itertools.count()
    events = [(0.0, next(tie_breaker), rank) for rank in range(num_ranks)]

    def wake(rank: int, time: float) -> None:
        heapq.heappush(events, (time, next(tie_breaker), rank))

    while events:
        now, _, rank = heapq.heappop(events)
        completed, running[rank] = running[rank], None
        if completed is not None:
            finish_times[rank] = now
            if completed.kind.startswith("RECV"):
                channel = (peer_rank(completed), rank, _channel_kind(completed))
                messages_in_channel[channel] -= 1
                if channel in blocked_senders:
                    wake(blocked_senders.pop(channel), now)
        if next_index[rank] == len(programs[rank]):
            continue
        action = programs[rank][next_index[rank]]
        cost = duration(action)
        if cost < 0:
            raise ValueError(f"simulate: the cost of {action} is negative: {cost}")
        if action.kind.startswith("SEND"):
            channel = (rank, peer_rank(action), _channel_kind(action))
            # A rank's messages to itself (adjacent stages it holds) wait in an unbounded loopback queue.
            if buffer_slots is not None and channel[1] != rank and messages_in_channel[channel] >= buffer_slots:
                blocked_senders[channel] = rank
                continue
            messages_in_channel[channel] += 1
            deliveries[action] = now + cost + comm_time
            if action in blocked_receivers:
                wake(blocked_receivers.pop(action), now)
            end = now + cost
        elif action.kind.startswith("RECV"):
            send = _counterpart(action)
            if send not in deliveries:
                blocked_receivers[send] = rank
                continue
            end = max(now, deliveries[send]) + cost
        else:
            end = now + cost
            timeline[rank].append((now, end, action))
        next_index[rank] += 1
        running[rank] = action
        wake(rank, end)

    stuck = [rank for rank in range(num_ranks) if next_index[rank] < len(programs[rank])]
    if stuck:
        waits = []
        for rank in stuck:
            action = programs[rank][next_index[rank]]
            if action.kind.startswith("RECV"):
                waits.append(f"rank {rank} waits at {action} for {_counterpart(action)} from rank {peer_rank(action)}")
            else:
                kind = _channel_kind(action)
                held = messages_in_channel[(rank, peer_rank(action), kind)]
                waits.append(
                    f"rank {rank} waits at {action}: its {_CHANNEL_NAMES[kind]} channel to rank {peer_rank(action)} "
                    f"holds {held} unreceived message(s)"
                )
        raise ValueError("deadlock: " + ", ".join(waits))
    return timeline, finish_times


_CHANNEL_NAMES = {"act": "activation", "grad": "gradient"}


def _channel_kind(transfer: Action) -> str:
    return "act" if transfer.kind in ("SEND_F", "RECV_F") else "grad"


def _check_channel_order(schedule: Schedule) -> None:
    """Each channel delivers in order: a rank must receive from each of its channels in the order the peer sends."""
    sent: dict[tuple[int, int, str], list[Action]] = collections.defaultdict(list)
    received: dict[tuple[int, int, str], list[Action]] = collections.defaultdict(list)
    for rank, program in enumerate(schedule.actions):
        for action in program:
            if action.kind.startswith("SEND"):
                sent[(rank, schedule.stage_rank(_counterpart(action).stage), _channel_kind(action))].append(action)
            elif action.kind.startswith("RECV"):
                send = _counterpart(action)
                received[(schedule.stage_rank(send.stage), rank, _channel_kind(action))].append(send)
    for (source, target, kind), order in sent.items():
        if received[(source, target, kind)] != order:
            got = next(i for i, (a, b) in enumerate(zip(order, received[(source, target, kind)])) if a != b)
            raise ValueError(
                f"rank {target} receives from its {_CHANNEL_NAMES[kind]} channel with rank {source} out of the order "
                f"rank {source} sends: message {got} is {order[got]}, but rank {target} first receives "
                f"{_counterpart(received[(source, target, kind)][got])}"
            )


def _peak_activations(program: tuple[Action, ...]) -> int:
    # An activation is held from its F until the pass that last reads it: B, or W when B is split.
    live = peak = 0
    for action in program:
        if action.kind == "F":
            live += 1
            peak = max(peak, live)
        elif action.kind in ("B", "W"):
            live -= 1
    return peak
