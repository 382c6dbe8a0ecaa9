"""Pipeline schedules as pure data: the actions of each rank, the named schedules that generate them, and the
structural checks every schedule passes (``validation`` adds channel order and deadlock, ``simulation`` timing)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipecomm.schedules.kinds import COMMUNICATION_KINDS, COMPUTE_KINDS, FORWARD_KINDS, Kind
from pipecomm.schedules.list_scheduling import build_orders, v_first_stage_lead
from pipecomm.schedules.timing import pass_orders_step_time

__all__ = [
    "COMMUNICATION_KINDS",
    "COMPUTE_KINDS",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "built_for_costs",
    "forward_schedule",
    "make_schedule",
]


# Each kind by itself or its string: a dictionary finds it several times sooner than Kind(string) does.
_KINDS = {kind: kind for kind in Kind}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")

# Schedules that run a steady state need every rank to have finished its warm-up before the first
# backward reaches it (MindFormers' micro_batch_num >= stages).
_NEEDS_MICRO_BATCHES_PER_RANK = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
# Built by list scheduling (pipecomm.schedules.list_scheduling) for F, I and W (unit costs unless given): (placement,
# peak activations in 1f1b's units).
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

    kind: Kind  # or its string, made the Kind
    stage: int
    micro_batch: int

    def __post_init__(self) -> None:
        kind = _KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if kind is None:
            raise ValueError(f"Action: kind must be one of {', '.join(Kind)}, not {self.kind!r}")
        if kind is not self.kind:
            object.__setattr__(self, "kind", kind)

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

    def splits_backward(self, rank: int, stage: int | None = None) -> bool:
        """Whether ``rank`` runs I passes (of ``stage``, or of any of its stages): the zero-bubble split backward."""
        return any(action.kind == "I" and stage in (None, action.stage) for action in self.actions[rank])


def looped_placement(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    return tuple(stage % num_ranks for stage in range(num_stages))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank, down the ranks and back: rank r holds stages r and 2 * num_ranks - 1 - r."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


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
    list scheduling (``pipecomm.schedules.list_scheduling``) for ``costs`` (F, I and W of one rank's share, as
    ``simulate`` takes them; default F = I = W): an order built for equal costs can lose much of its
    gain where I costs more than F, so give measured costs where they are known. zb-h2 keeps the fastest of a few
    orders within its memory (``_zb_h2_orders``). Where the V's greedy order would
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


def built_for_costs(name: str) -> bool:
    """Whether ``make_schedule(name, ..., costs=)`` orders the passes for the costs given (zb-h2 and zb-v)."""
    return name in _LIST_SCHEDULED


def _list_scheduled_orders(name: str, placement: tuple[int, ...], micro_batches: int, pass_costs: Mapping[str, float],
                           memory_cap: float) -> list[list[tuple[str, int, int]]]:
    """zb-h2's orders (``_zb_h2_orders``), or the V's greedy orders; where the V's greedy fills a rank's memory with
    first-stage forwards before the far side of the V returns (I well above F + W at p = 2), its first stages held
    back, as little as lets it finish."""
    num_ranks = max(placement) + 1
    jit = len(placement) * micro_batches > _INTERPRETED_BUILD_UP_TO
    if name == "zb-h2":
        return _zb_h2_orders(placement, micro_batches, pass_costs, memory_cap, jit)
    leads = [None] + [v_first_stage_lead(num_ranks, base) for base in range(num_ranks + 1, 0, -1)]
    for lead in leads[:-1]:
        try:
            return build_orders(placement, micro_batches, pass_costs, memory_cap, first_stage_lead=lead, jit=jit)
        except ValueError:
            continue
    return build_orders(placement, micro_batches, pass_costs, memory_cap, first_stage_lead=leads[-1], jit=jit)


def _zb_h2_orders(placement: tuple[int, ...], micro_batches: int, pass_costs: Mapping[str, float],
                  memory_cap: float, jit: bool) -> list[list[tuple[str, int, int]]]:
    """The greedy orders, unless another order within the memory cap simulates faster: the greedy's with its Ws held
    back in the cool-down (``build_orders``' weights_yield_in_cool_down), or zb-h1's.

    No schedule with one stage per rank ends before (p - 1) F + m (F + I + W): its last rank waits p - 1 forwards for
    its first input, then runs m of each pass. At F = I = W the greedy reaches that, a bubble of (p - 1) / (3m + p - 1)
    (0.059 at p = 4, m = 16; 0.068 at p = 8, m = 32), and is kept without building the others. No one-stage schedule
    has a smaller bubble in one step; the paper's ZB-H2 is "zero bubble" across steps, its parallelogram letting
    rank r start the next step as soon as it ends this one, with no all-reduce between steps (it checks the optimizer
    step afterwards instead). Elsewhere the greedy can lose: with I above F and W (the GPU-bound configs measured so
    far) its Ws delay the last micro-batch's Is in the cool-down, about 1% at p = 8, m = 32, which the held-back Ws
    win back (where holding them does not idle ranks instead); at m = p or p + 1, with few micro-batches beyond the
    warm-up's, zb-h1's order (p activations, within the cap) can be up to 6% faster.
    """
    num_ranks = num_stages = len(placement)

    def step_time(orders: list[list[tuple[str, int, int]]]) -> float:
        return round(pass_orders_step_time(orders, num_stages, micro_batches, pass_costs, jit=jit), 9)

    greedy = build_orders(placement, micro_batches, pass_costs, memory_cap, jit=jit)
    bound = (num_stages - 1) * pass_costs["F"] + micro_batches * sum(pass_costs[kind] for kind in ("F", "I", "W"))
    if step_time(greedy) <= bound + 1e-9:
        return greedy
    held_back = build_orders(placement, micro_batches, pass_costs, memory_cap, weights_yield_in_cool_down=True,
                             jit=jit)
    zb_h1 = [[(action.kind, action.stage, action.micro_batch)
              for action in _zb_h1_order(rank, num_ranks, micro_batches, 1)] for rank in range(num_ranks)]
    return min((greedy, held_back, zb_h1), key=step_time)  # the first of equals: the greedy


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
        orders[placement[stage]].append(Action(Kind.F, stage, micro_batch))
    actions = tuple(with_communication(order, num_stages) for order in orders)
    return Schedule("forward", num_ranks, num_stages, micro_batches, actions, tuple(placement), forward_only=True)


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
    forwards = [Action(Kind.F, rank, micro_batch) for micro_batch in range(micro_batches)]
    backwards = [Action(Kind.B, rank, micro_batch) for micro_batch in range(micro_batches)]
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
        lambda micro_batch: Action(Kind.F, rank, micro_batch),
        lambda micro_batch: [Action(Kind.B, rank, micro_batch)],
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
        return Action(Kind.F, chunk * num_ranks + rank, micro_batch_of(virtual))

    def backward(virtual: int) -> list[Action]:
        chunk = virtual_stages - 1 - virtual // num_ranks % virtual_stages
        return [Action(Kind.B, chunk * num_ranks + rank, micro_batch_of(virtual))]

    num_warmup = min((num_ranks - rank - 1) * 2 + (virtual_stages - 1) * num_ranks, num_virtual)
    return _warmup_then_alternate(forward, backward, num_warmup, num_virtual)


def _zb_h1_order(rank: int, num_ranks: int, micro_batches: int, virtual_stages: int) -> list[Action]:
    # 1F1B with B split: I stays on the critical path where B was, and rank r runs each W r
    # micro-batches late. Every rank then holds num_ranks activations at its peak, the most any rank
    # holds in 1F1B (rank 0), and the late Ws fill the cool-down, where later ranks would idle.
    def input_then_late_weight(micro_batch: int) -> list[Action]:
        late = [Action(Kind.W, rank, micro_batch - rank)] if micro_batch >= rank else []
        return [Action(Kind.I, rank, micro_batch)] + late

    order = _warmup_then_alternate(
        lambda micro_batch: Action(Kind.F, rank, micro_batch), input_then_late_weight, num_ranks - rank - 1,
        micro_batches,
    )
    return order + [Action(Kind.W, rank, micro_batch) for micro_batch in range(micro_batches - rank, micro_batches)]


_COMPUTE_ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved-1f1b": _interleaved_order,
    "zb-h1": _zb_h1_order,
}


# The passes that pass data along the pipeline: the transfer that brings what each consumes, the one that takes what it
# produces on, and which way they go (+1: to the next stage, -1: back to the one before).
_TRANSFERS = {Kind.F: (Kind.RECV_F, Kind.SEND_F, 1), Kind.B: (Kind.RECV_B, Kind.SEND_B, -1),
              Kind.I: (Kind.RECV_B, Kind.SEND_B, -1)}


def with_communication(compute_order: list[Action], num_stages: int) -> tuple[Action, ...]:
    """A rank's compute passes with their transfers: each RECV right before its consumer, each SEND right after its producer."""
    actions: list[Action] = []
    for action in compute_order:
        if action.kind not in _TRANSFERS:
            actions.append(action)
            continue
        receive, send, way = _TRANSFERS[action.kind]
        stage, micro_batch = action.stage, action.micro_batch
        if 0 <= stage - way < num_stages:
            actions.append(Action(receive, stage, micro_batch))
        actions.append(action)
        if 0 <= stage + way < num_stages:
            actions.append(Action(send, stage, micro_batch))
    return tuple(actions)


# Each transfer kind's other end: its kind, and its stage less this end's.
_COUNTERPARTS = {Kind.SEND_F: (Kind.RECV_F, 1), Kind.RECV_F: (Kind.SEND_F, -1), Kind.SEND_B: (Kind.RECV_B, -1),
                 Kind.RECV_B: (Kind.SEND_B, 1)}


def counterpart(transfer: Action) -> Action:
    """The other end of a transfer: the RECV that a SEND feeds, or the SEND that a RECV waits for."""
    kind, stage_offset = _COUNTERPARTS[transfer.kind]
    return Action(kind, transfer.stage + stage_offset, transfer.micro_batch)


CHANNEL_NAMES = {"act": "activation", "grad": "gradient"}


def channel_kind(transfer: Action) -> str:
    return "act" if transfer.kind in FORWARD_KINDS else "grad"
