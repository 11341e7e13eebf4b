"""Overlap: how much of each collective a compiled program's schedule hides behind compute.

A compiled program issues each collective as soon as its input is ready and waits for it
right before its first use (:mod:`autopar.passes.rewrite.overlap`); what runs in between hides
it. :func:`exposed_time` replays one step of that schedule on a rank:

- the step's compute is a list of items in the order they run: every op's forward in graph
  order, then every op's backward in reverse order (:func:`step_order`);
- a :class:`Transfer` is issued once item ``ready`` is done (``-1``: at the start) and waited
  for right before item ``needed`` runs (``len(items)``: at the end of the step);
- a rank runs its collectives one at a time, in the order it issues them (one communication
  stream), while it computes;
- an item starts when the item before it is done and every transfer it waits for has arrived.

The step then takes ``sum(compute) + exposed``; each transfer's ``hidden`` share is its time
minus the stall its wait caused. This replaces the hardware profile's single overlap fraction
for compiled plans (:attr:`autopar.ir.Schedule.compiled`): the cost model builds the transfers from
the planned graph (:func:`scheduled_communication`) with the same rules the scheduling pass applies.

>>> exposed_time([1.0, 1.0], [Transfer(ready=-1, needed=1, seconds=1.5)]).exposed
0.5
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir.buckets import bucket_cap
from autopar.passes.cost.schedule import forward_share
from autopar.passes.rewrite.async_tp import PIECES


@dataclass(frozen=True)
class Transfer:
    """One collective of a step: issued after item ``ready``, waited for before item ``needed``."""

    ready: int
    needed: int
    seconds: float
    nbytes: float = 0.0
    label: str = ""


@dataclass(frozen=True)
class Exposure:
    """The replayed step: communication time not hidden (``exposed``), and per transfer label
    the seconds it stalled the step."""

    exposed: float
    stalls: dict[str, float] = field(default_factory=dict)


def exposed_time(compute: list[float], transfers: list[Transfer]) -> Exposure:
    """Replay a step (see the module docstring)."""
    issued: dict[int, list[Transfer]] = {}
    waited: dict[int, list[Transfer]] = {}
    for transfer in transfers:
        issued.setdefault(transfer.ready, []).append(transfer)
        waited.setdefault(min(transfer.needed, len(compute)), []).append(transfer)
    now, stream_free, arrival, stalls = 0.0, 0.0, {}, {}

    def issue(index: int) -> None:
        nonlocal stream_free
        for transfer in issued.get(index, ()):
            stream_free = max(now, stream_free) + transfer.seconds
            arrival[id(transfer)] = stream_free

    def wait(index: int) -> None:
        nonlocal now
        for transfer in waited.get(index, ()):
            stall = max(0.0, arrival[id(transfer)] - now)
            stalls[transfer.label] = stalls.get(transfer.label, 0.0) + stall
            now += stall

    issue(-1)
    for index, seconds in enumerate(compute):
        wait(index)
        now += seconds
        issue(index)
    wait(len(compute))
    return Exposure(now - sum(compute), stalls)


@dataclass(frozen=True)
class StepOrder:
    """Where each node's forward and backward run among a step's compute items; a node run in
    pieces (async tensor parallelism) has one item per piece, its first at ``forward[node]``."""

    compute: list[float]
    forward: dict[str, int]  # node → index of its (first) forward item
    backward: dict[str, int]  # node → index of its (first) backward item (nodes a gradient flows through)
    pieces: dict[str, int] = field(default_factory=dict)  # node → items it runs in, where more than one

    @property
    def end(self) -> int:
        return len(self.compute)

    def forward_done(self, name: str) -> int:
        """The item after which ``name``'s forward is done (-1: not an op, ready at the start)."""
        return self.forward[name] + self.pieces.get(name, 1) - 1 if name in self.forward else -1

    def backward_done(self, name: str) -> int:
        """The item after which ``name``'s backward is done."""
        return self.backward[name] + self.pieces.get(name, 1) - 1


def step_order(facts: dict, work: dict[str, float], pieces: dict[str, int] | None = None) -> StepOrder:
    """The compute items of one step: each op's forward in graph order, then each op's backward
    in reverse order, each its share (:func:`forward_share`) of the op's time (``full_time_s``,
    the share ``work`` of it this rank does), times the layers it stands for
    (:attr:`NodeFacts.weight`: a folded graph's inner layer runs as often as it stands for);
    a node of ``pieces`` as that many equal items."""
    pieces = pieces or {}
    ops = [(name, fact) for name, fact in facts.items() if fact.kind == "op"]
    compute, forward, backward = [], {}, {}
    for name, fact in ops:
        forward[name] = len(compute)
        n = pieces.get(name, 1)
        compute += [fact.full_time_s * work[name] * fact.weight * forward_share(fact) / n] * n
    for name, fact in reversed(ops):
        if fact.needs_grad:
            backward[name] = len(compute)
            n = pieces.get(name, 1)
            compute += [fact.full_time_s * work[name] * fact.weight * (1 - forward_share(fact)) / n] * n
    return StepOrder(compute, forward, backward, pieces)


def bucketed(transfers: list[Transfer], layers: dict[int, str] | None = None) -> list[Transfer]:
    """Gradient transfers merged as the compiled program merges them: by layer where ``layers``
    names one per transfer (ZeRO-3's reduce-scatter per layer), else in order of readiness, a
    bucket closing at DDP's sizes (the scheduling pass's all-reduce buckets); each issued when
    its last member is ready."""
    groups: dict[str, list[list[Transfer]]] = {}
    for index, transfer in sorted(enumerate(transfers), key=lambda item: item[1].ready):
        key = layers.get(index, "") if layers is not None else ""
        buckets = groups.setdefault(key, [[]])
        buckets[-1].append(transfer)
        if layers is None and sum(t.nbytes for t in buckets[-1]) >= bucket_cap(len(buckets) - 1):
            buckets.append([])
    return [
        Transfer(
            max(t.ready for t in bucket),
            min(t.needed for t in bucket),
            sum(t.seconds for t in bucket),
            sum(t.nbytes for t in bucket),
            SYNC,
        )
        for buckets in groups.values()
        for bucket in buckets
        if bucket
    ]


SYNC = "gradient sync"


@dataclass
class CompiledStep:
    """The collectives of a compiled step, noted while :func:`autopar.passes.cost.evaluate.traffic`
    sums a layout's terms: value moves (forward seconds at the move, backward seconds at its dual),
    partial gradients of activations, and gradient syncs of parameters."""

    # producer, first consumer, fwd, bwd, the linear run in pieces with it (async TP; "": none)
    moves: list[tuple[str, str, float, float, str]] = field(default_factory=list)
    partials: list[tuple[str, float]] = field(default_factory=list)  # activation, backward all-reduce seconds
    syncs: list[tuple[str, float, float]] = field(default_factory=list)  # parameter, seconds, bytes
    kernel_s: float = 0.0  # parallel kernels (ring attention, experts...): their own overlap is in their time

    def note_gradient(self, slot: str, seconds: float, nbytes: float, fact) -> None:
        """A partial gradient: a parameter's is synced, an activation's all-reduced in backward
        (times the layers the node stands for, as every note)."""
        if fact.kind == "param":
            self.syncs.append((slot, seconds * fact.weight, nbytes * fact.weight))
        else:
            self.partials.append((slot, seconds * fact.weight))

    def exposed(
        self,
        facts: dict,
        work: dict[str, float],
        syncs_in_program: bool,
        per_layer: bool = False,
        async_tp: bool = False,
        concurrency: float = 1.0,
        sync_window: float = 1.0,
    ) -> tuple[float, float]:
        """(exposed communication, exposed gradient sync) seconds of the scheduled step.

        A gradient synced in the program is bucketed (``per_layer``: ZeRO's one reduce-scatter per
        layer, and ZeRO-3's regather) and waited for at the end of backward; otherwise the runtime
        syncs after the compiled backward returns, with nothing to hide behind. ``sync_window``:
        the share of the step's compute that runs in the program that syncs (1/microbatches where
        only the last microbatch's program sums the step's gradients). ``async_tp``: the
        linears noted with a move run in pieces with it (:func:`_in_pieces`). ``concurrency``: the
        share of what the schedule puts behind compute that really hides there (the profile's
        ``overlap``: 1 where collectives run on engines of their own, as on GPUs; 0 on a CPU whose
        cores the compute already fills, where gloo's copies take turns with it).
        """
        pieced = {linear: PIECES for *_, linear in self.moves if linear} if async_tp else {}
        order = step_order(facts, work, pieced)
        consumers: dict[str, list[str]] = {}
        for name, fact in facts.items():
            for slot in fact.slots:
                consumers.setdefault(slot.name, []).append(name)

        def gradient_ready(name: str) -> int:  # the last backward item adding to ``name``'s gradient
            return max((order.backward_done(c) for c in consumers.get(name, ()) if c in order.backward), default=-1)

        transfers = []
        for producer, consumer, forward, backward, linear in self.moves:
            label = f"{producer} -> {consumer}"
            if linear in pieced:
                transfers += _in_pieces(order, producer, consumer, forward, backward, linear, label)
                continue
            needed = order.forward.get(consumer, order.end)
            transfers.append(Transfer(order.forward_done(producer), needed, forward, label=label))
            if backward and consumer in order.backward:
                dual_needed = order.backward.get(producer, order.end)
                transfers.append(Transfer(order.backward_done(consumer), dual_needed, backward, label=label))
        for activation, seconds in self.partials:
            needed = order.backward.get(activation, order.end)
            transfers.append(Transfer(gradient_ready(activation), needed, seconds, label=f"{activation} gradient"))
        syncs = [Transfer(gradient_ready(p), order.end, seconds, nbytes, SYNC) for p, seconds, nbytes in self.syncs]
        layers = {i: facts[p].gather_group for i, (p, _, _) in enumerate(self.syncs)} if per_layer else None
        if syncs_in_program and sync_window < 1:  # the sync replays against the last microbatch alone
            exposure = exposed_time(order.compute, transfers)
            stall = exposed_time([c * sync_window for c in order.compute], bucketed(syncs, layers)).stalls.get(
                SYNC, 0.0
            )
        else:
            exposure = exposed_time(order.compute, transfers + (bucketed(syncs, layers) if syncs_in_program else []))
            stall = exposure.stalls.get(SYNC, 0.0)
        sync = stall + (0.0 if syncs_in_program else sum(t.seconds for t in syncs))
        comm = exposure.exposed - exposure.stalls.get(SYNC, 0.0)
        hidden_comm = sum(t.seconds for t in transfers) - comm
        hidden_sync = sum(t.seconds for t in syncs) - sync
        return comm + (1 - concurrency) * hidden_comm, sync + (1 - concurrency) * hidden_sync


def _in_pieces(
    order: StepOrder, producer: str, consumer: str, forward: float, backward: float, linear: str, label: str
) -> list[Transfer]:
    """A move run in pieces with ``linear`` (:mod:`autopar.passes.rewrite.async_tp`): a gather
    into the linear (``linear == consumer``) moves piece j before the linear's piece j, and its
    dual (a reduce-scatter) after the linear's backward piece j; a reduction out of the linear
    moves piece j after the linear's piece j, and its dual (a reduce-scatter's all-gather; an
    all-reduce's moves nothing) before the linear's backward piece j."""
    share, first = 1 / PIECES, order.forward[linear]
    if linear == consumer:
        moves = [Transfer(order.forward_done(producer), first + j, forward * share, label=label) for j in range(PIECES)]
        if backward and consumer in order.backward:
            needed = order.backward.get(producer, order.end)
            moves += [
                Transfer(order.backward[consumer] + j, needed, backward * share, label=label) for j in range(PIECES)
            ]
        return moves
    needed = order.forward.get(consumer, order.end)
    moves = [Transfer(first + j, needed, forward * share, label=label) for j in range(PIECES)]
    if backward and linear in order.backward:
        ready = order.backward_done(consumer) if consumer in order.backward else -1
        moves += [Transfer(ready, order.backward[linear] + j, backward * share, label=label) for j in range(PIECES)]
    return moves
