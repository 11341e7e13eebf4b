"""Costs symbolic in batch size and sequence length: one plan, re-evaluated at any batch and
sequence without capturing or solving again.

Pre: the captured graph a plan was made for, and the model and example inputs it was
captured from (batch along dim 0 of every input, sequence along ``seq_dim``).
Post: a :class:`SymbolicCost` holding the plan's predicted step time by component and its
memory by category as sympy expressions in ``b`` (global batch) and ``s`` (sequence length);
``.at(batch=b₀, seq=s₀)`` at the captured sizes equals :func:`evaluate.evaluate_plan` up to
floating-point rounding.

How. The model is captured again on a grid around the example's (b₀, s₀): two batch sizes
by three sequence lengths, plus one check point off the grid. Each graph must be the same
ops under the same names, else the graph changes with shape and no one plan covers both
(:func:`sample_facts`). Every size the cost model reads from a node (each dim of its
outputs and inputs, its forward and backward FLOPs, the bytes it reads and writes, the bytes
it saves for backward) is the polynomial of degree ≤ 1 in b and ≤ 2 in s through the grid,
found exactly in rationals (a weight's dims come out constant, a matmul's FLOPs b·s,
attention's b·s²); the check point must agree, or the node is named in an error. These
symbolic node facts then go through the cost model's own functions (:func:`evaluate.evaluate`
and all it calls), so the expressions are that cost model, not a copy of it: where it takes
a ``max`` or ``min`` (a roofline, the largest activation) ``cost.maximum``/``minimum`` keep
the choice open as ``sympy.Max``/``Min``. Sizes are written b = D·β, s = D·σ (D: the devices
of one stage) while the cost model splits dims, so that the shards of a plan that divides
evenly have no floors; the results are given in b and s again.

What stays fixed: every placement, the ZeRO stage, the schedule and the pipeline's cut points
(the plan's, or the balanced split at (b₀, s₀)). What is approximate: op times MEASURED on
this machine (a profile with ``measure_ops``, cpu-local) become the roofline scaled by each
op's measured/roofline ratio at (b₀, s₀), exact there; elsewhere the op is taken to stay as
far from its roofline. Against the cost model re-run with the ops measured at the new sizes
(cpu-local, GPT hidden 128, 2 layers, dp2 x tp2, planned at batch 8, seq 64): step time within
4% at 2x and 4x the batch and at 2x the sequence, 11% at 4x the sequence; memory exact
(one run on an idle machine: timings under load scatter more, the re-measured ones too).
Analytic profiles (a100-80gb, h100-80gb, ...) have no such term: their expressions equal the
cost model on a graph captured at the other sizes, up to rounding.

Why static captures and not torch.export's dynamic dims (``Dim``): those trace the example
GPT too, but into another graph (``sym_size`` nodes; views whose sizes are symbols, which op
profiling skips), so its costs would not be those of the graph that was planned.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

import sympy
import torch

from autopar.ir import (
    ConfigError,
    Cost,
    HardwareProfile,
    Plan,
    PlanOptions,
    PrecisionPolicy,
    Schedule,
    Shard,
    StalePlanError,
    TraceError,
    batch_split,
    get_profile,
)
from autopar.passes.capture.graph import CapturedGraph, capture
from autopar.passes.cost.evaluate import evaluate, stage_mesh, strategies_from_plan
from autopar.passes.cost.facts import NodeFacts, ShardedShapes, analyze
from autopar.passes.cost.ops import compute_time, moves_no_data
from autopar.passes.search.partition import partition

BATCH, SEQ = sympy.Symbol("b", positive=True), sympy.Symbol("s", positive=True)
_BATCH_BLOCK, _SEQ_BLOCK = (
    sympy.Symbol("beta", positive=True, integer=True),
    sympy.Symbol("sigma", positive=True, integer=True),
)
TIME_TERMS = ("compute_s", "comm_s", "grad_sync_s", "optimizer_s", "pipeline_s", "model_flops")
TERM_NAMES = ("compute", "communication", "gradient sync", "optimizer", "pipeline")


@dataclass(frozen=True)
class SymbolicCost:
    """A plan's cost as expressions in ``BATCH`` (b) and ``SEQ`` (s): ``expressions`` maps
    each :class:`Cost` term (``compute_s``, ..., ``step_s``, ``memory.activations``, ...) to one.

    >>> symbolic = symbolic_cost(captured, plan, "a100-80gb", model=model, example_inputs=inputs)  # doctest: +SKIP
    >>> symbolic.at(batch=2048, seq=4096).step_s                                                   # doctest: +SKIP
    """

    expressions: dict[str, sympy.Expr]
    batch: int  # the captured graph's
    seq: int | None  # None: the inputs have no sequence dimension
    batch_multiple: int  # a runnable global batch is a multiple of this (batch-splitting ranks x microbatches)
    splits: tuple[tuple[str, sympy.Expr, int], ...]  # (what, size in b and s, ranks it is split over)

    def at(self, *, batch: int | None = None, seq: int | None = None) -> Cost:
        """The plan's cost at another global batch and sequence length (default: the captured ones)."""
        point = self._point(batch, seq)
        value = {name: float(expression.xreplace(point)) for name, expression in self.expressions.items()}
        memory = {name.removeprefix("memory."): v for name, v in value.items() if name.startswith("memory.")}
        return Cost(**{term: value[term] for term in TIME_TERMS}, memory=memory)

    def compare(self, *, batch: int | None = None, seq: int | None = None) -> str:
        """Two lines: the prediction at the captured sizes, and at ``batch``/``seq``."""
        lines = []
        for label, b, s in (
            ("planned at", self.batch, self.seq),
            ("re-evaluated at", batch or self.batch, seq or self.seq),
        ):
            cost = self.at(batch=b, seq=s)
            parts = ", ".join(f"{name} {getattr(cost, term) * 1e3:.3f}" for term, name in zip(TIME_TERMS, TERM_NAMES))
            size = f"batch {b}" + (f", seq {s}" if s is not None else "")
            lines.append(
                f"{label} {size}: step {cost.step_s * 1e3:.3f} ms ({parts}); peak memory "
                f"{cost.peak_memory / 2**20:.1f} MiB"
            )
        return "\n".join(lines)

    def _point(self, batch, seq) -> dict:
        batch = self.batch if batch is None else batch
        if not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"batch={batch!r}: give a positive integer global batch size")
        if seq is not None and self.seq is None:
            raise ConfigError(
                f"seq={seq}: this symbolic cost was made without a sequence dimension (seq_dim=None); make it with "
                "seq_dim"
            )
        seq = self.seq if seq is None else seq
        if self.seq is not None and (not isinstance(seq, int) or seq < 1):
            raise ConfigError(f"seq={seq!r}: give a positive integer sequence length")
        if batch % self.batch_multiple:
            raise ConfigError(
                f"batch={batch}: the plan splits the batch over ranks and microbatches: pick a multiple of "
                f"{self.batch_multiple}"
            )
        point = {BATCH: sympy.Integer(batch), SEQ: sympy.Integer(seq or 1)}
        for what, size, ranks in self.splits:
            value = size.xreplace(point)
            if value % ranks:
                raise ConfigError(
                    f"batch={batch}, seq={seq}: {what} (size {value}) does not split evenly over {ranks} ranks: pick "
                    "sizes it divides"
                )
        return point


def symbolic_cost(
    captured: CapturedGraph,
    plan: Plan,
    hardware: str | HardwareProfile,
    *,
    model: torch.nn.Module,
    example_inputs: tuple | dict,
    seq_dim: int | None = 1,
) -> SymbolicCost:
    """``plan``'s predicted cost as expressions in the global batch ``b`` and sequence length ``s``
    (see the module docstring). ``model``/``example_inputs`` (a tuple, or a call by name) are what
    ``captured`` came from; ``seq_dim=None`` for inputs without a sequence dimension (then only ``b``).

    >>> symbolic = symbolic_cost(captured, plan, "a100-80gb", model=model, example_inputs=inputs)  # doctest: +SKIP
    >>> symbolic.expressions["compute_s"]                                                          # doctest: +SKIP
    1.2e-13*b*s**2 + 3.4e-11*b*s + ...
    """
    hardware = get_profile(hardware)
    if plan.fingerprint != captured.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, not this captured graph {captured.fingerprint}: pass the "
            "graph it was planned on"
        )
    contention = hardware.contention(plan.mesh.shape)
    policy = plan.precision_policy
    facts = analyze(captured, hardware, contention, policy)  # what evaluate_plan sees, measured op times included
    grid, samples = sample_facts(captured, model, example_inputs, seq_dim, policy)
    symbolic = _symbolic_facts(facts, samples, grid, hardware, contention)
    return SymbolicCost(
        expressions=_cost_expressions(symbolic, facts, plan, hardware),
        batch=grid.batches[0],
        seq=grid.seqs[0],
        batch_multiple=batch_split(plan.degrees) * plan.schedule.microbatches,
        splits=_splits(plan, symbolic),
    )


def _cost_expressions(symbolic, facts, plan: Plan, hardware: HardwareProfile) -> dict[str, sympy.Expr]:
    """What :func:`evaluate.evaluate_plan` does, on the symbolic facts: each Cost term, then ``step_s``."""
    devices = math.prod(plan.degrees.values())  # shards of b = D·β, s = D·σ divide without floors
    blocks = {
        name: _replaced(fact, {BATCH: devices * _BATCH_BLOCK, SEQ: devices * _SEQ_BLOCK})
        for name, fact in symbolic.items()
    }
    mesh = stage_mesh(plan.mesh, plan.schedule.stages)
    schedule = _pinned_cuts(plan, facts, mesh, hardware)
    try:
        cost = evaluate(blocks, plan.degrees, strategies_from_plan(plan, blocks), mesh, hardware, plan.zero, schedule)
    except TypeError as error:  # a plain comparison met an expression whose sign depends on b and s
        raise ConfigError(
            f"this plan's cost cannot be kept symbolic in batch and sequence ({error}): a cost term compares sizes "
            "whose order "
            "depends on them outside cost.maximum/minimum; evaluate it per size with evaluate_plan instead"
        ) from error
    sizes = {_BATCH_BLOCK: BATCH / devices, _SEQ_BLOCK: SEQ / devices}
    terms = {term: getattr(cost, term) for term in TIME_TERMS} | {f"memory.{k}": v for k, v in cost.memory.items()}
    expressions = {name: sympy.sympify(value).xreplace(sizes) for name, value in terms.items()}
    expressions["step_s"] = sum(expressions[term] for term in TIME_TERMS[:-1])
    return expressions


def symbolic_facts(
    captured: CapturedGraph,
    hardware: str | HardwareProfile,
    *,
    model: torch.nn.Module,
    example_inputs: tuple | dict,
    seq_dim: int | None = 1,
    contention: float = 1.0,
    precision: str | None = None,
) -> dict[str, NodeFacts]:
    """:func:`autopar.passes.cost.facts.analyze`'s per-node facts with every size, FLOP count and op time an
    expression in ``BATCH`` and ``SEQ`` (sizes that do not change stay plain numbers), priced in
    ``precision`` (default: the hardware's, as :attr:`autopar.ir.PlanOptions.precision_policy` takes it).

    >>> facts = symbolic_facts(captured, "a100-80gb", model=model, example_inputs=inputs)  # doctest: +SKIP
    >>> facts["scaled_dot_product_attention"].profile.forward_flops                          # doctest: +SKIP
    256*b*s**2
    """
    hardware = get_profile(hardware)
    policy = PlanOptions(hardware=hardware, precision=precision).precision_policy
    grid, samples = sample_facts(captured, model, example_inputs, seq_dim, policy)
    return _symbolic_facts(analyze(captured, hardware, contention, policy), samples, grid, hardware, contention)


@dataclass(frozen=True)
class Grid:
    """The sizes the model is captured at: every (batch, seq) pair, and one check point off the grid."""

    batches: tuple[int, ...]  # the captured batch first
    seqs: tuple[int | None, ...]  # the captured seq first; (None,) without a sequence dimension
    check: tuple[int, int | None]

    @property
    def points(self) -> list[tuple[int, int | None]]:
        return [(b, s) for b in self.batches for s in self.seqs]

    def monomials(self, b, s) -> list:
        """b^i·s^j for i < len(batches), j < len(seqs): the polynomials the grid pins down."""
        return [b**i * (s**j if j else 1) for i in range(len(self.batches)) for j in range(len(self.seqs))]


def sample_facts(
    captured: CapturedGraph, model, example_inputs: tuple | dict, seq_dim: int | None, policy: PrecisionPolicy
) -> tuple[Grid, list[dict[str, NodeFacts]]]:
    """The grid around the example inputs' sizes and the facts of the graph captured at each
    point (``captured`` itself first) under ``policy``, the check point's last. Op times are
    not measured here."""
    grid = _grid(*_sizes(captured, example_inputs, seq_dim))
    roofline = get_profile("a100-80gb")  # any profile that measures nothing: only shapes and op profiles are read
    expected = [(n.name, n.op, str(n.target)) for n in captured.graph.nodes]
    samples = []
    for batch, seq in [*grid.points, grid.check]:
        if (batch, seq) == grid.points[0]:
            samples.append(analyze(captured, roofline, policy=policy))
            continue
        where = f"batch={batch}" + (f", seq={seq}" if seq is not None else "")
        try:
            # captured as ``captured`` was (mixed precision: in its 16-bit param_dtype)
            at = _inputs_at(example_inputs, batch, seq, seq_dim)
            args, kwargs = ((), at) if isinstance(at, dict) else (at, None)
            graph = capture(model, args, kwargs, param_dtype=captured.param_dtype)
        except TraceError as error:
            raise ConfigError(
                f"symbolic costs capture the model at {where} too, and it failed: {str(error).splitlines()[0]}\n"
                f"they take dim 0 of the inputs as the batch and dim {seq_dim} as the sequence: pass inputs whose "
                "sizes can be "
                "halved (or doubled), or seq_dim=None (`--at batch=N` alone) for inputs without a sequence"
            ) from error
        nodes = [(n.name, n.op, str(n.target)) for n in graph.graph.nodes]
        if nodes != expected:
            index = next((k for k, (a, b) in enumerate(zip(expected, nodes)) if a != b), min(len(nodes), len(expected)))
            theirs, ours = (n[index][0] if index < len(n) else "the end" for n in (nodes, expected))
            raise ConfigError(
                f"the model's graph changes with shape: at {where} node #{index} is {theirs}, in the captured graph "
                f"{ours}; "
                "costs are symbolic only for a graph whose ops do not depend on batch and sequence: capture and plan "
                "per size instead"
            )
        samples.append(analyze(graph, roofline, policy=policy))
    return grid, samples


def _sizes(captured: CapturedGraph, example_inputs, seq_dim: int | None) -> tuple[int, int | None]:
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    tensors = [x for x in values if isinstance(x, torch.Tensor)]
    given = [tuple(t.shape) for t in tensors]
    shapes = [tuple(n.meta["val"].shape) for n in captured.graph.nodes if n.name in captured.user_inputs]
    if given != shapes:
        raise ConfigError(
            f"example inputs of shapes {given} are not those captured ({shapes}): pass the inputs the graph came from"
        )
    batches = {t.shape[0] for t in tensors if t.dim() > 0}
    seqs = {t.shape[seq_dim] for t in tensors if seq_dim is not None and t.dim() > seq_dim}
    if len(batches) != 1 or len(seqs) > 1:
        raise ConfigError(
            f"inputs of shapes {shapes} disagree on the batch (dim 0) or sequence (dim {seq_dim}) size: pass inputs "
            "that share them"
        )
    return batches.pop(), seqs.pop() if seqs else None


def _grid(batch: int, seq: int | None) -> Grid:
    """Halve where the sizes allow (models cap their sequence length), else double."""
    other = batch // 2 if batch % 2 == 0 and batch >= 4 else 2 * batch
    if seq is None:
        return Grid((batch, other), (None,), (batch + other, None))
    seqs, check = (
        ((seq, seq // 2, seq // 4), 3 * seq // 4) if seq % 4 == 0 and seq >= 8 else ((seq, 2 * seq, 3 * seq), 4 * seq)
    )
    return Grid((batch, other), seqs, (batch + other, check))


def _inputs_at(example_inputs, batch: int, seq: int | None, seq_dim: int | None) -> tuple | dict:
    """The inputs (a tuple, or a call by name) at another batch and sequence size."""

    def at(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            x = _resized(x, 0, batch)
            x = _resized(x, seq_dim, seq) if seq_dim is not None and x.dim() > seq_dim else x
        return x

    if isinstance(example_inputs, dict):
        return {name: at(x) for name, x in example_inputs.items()}
    return tuple(at(x) for x in example_inputs)


def _resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` cut or repeated to ``size`` along ``dim``, contiguous (a strided input captures other ops)."""
    repeats = -(-size // tensor.shape[dim])
    return torch.cat([tensor] * repeats, dim).narrow(dim, 0, size).contiguous()


def _numbers(fact: NodeFacts) -> list:
    """Every size the cost model reads from a node: its output and input dims, then its op profile."""
    p = fact.profile
    return [d for shape in fact.out_shapes + fact.slot_shapes for d in shape] + [
        p.forward_flops,
        p.backward_flops,
        p.io_bytes,
        p.saved_extra_bytes,
        p.backward_io_bytes,
    ]


def _labels(fact: NodeFacts) -> list[str]:
    """What each of :func:`_numbers` is, for errors."""
    shapes = [(f"output {k}", s) for k, s in enumerate(fact.out_shapes)] + [
        (f"input {k}", s) for k, s in enumerate(fact.slot_shapes)
    ]
    dims = [f"{what}'s dim {d}" for what, shape in shapes for d in range(len(shape))]
    return dims + [
        "forward FLOPs",
        "backward FLOPs",
        "bytes read and written",
        "bytes saved for backward",
        "bytes the backward reads and writes",
    ]


def _with_numbers(fact: NodeFacts, numbers: list) -> NodeFacts:
    values = iter(numbers)
    out = [tuple(next(values) for _ in shape) for shape in fact.out_shapes]
    slots = [tuple(next(values) for _ in shape) for shape in fact.slot_shapes]
    profile = dataclasses.replace(
        fact.profile,
        forward_flops=next(values),
        backward_flops=next(values),
        io_bytes=next(values),
        saved_extra_bytes=next(values),
        backward_io_bytes=next(values),
    )
    return dataclasses.replace(fact, out_shapes=out, slot_shapes=slots, profile=profile)


def _structure(fact: NodeFacts) -> tuple:
    p = fact.profile
    return (
        fact.kind,
        fact.needs_grad,
        fact.saved,
        [len(s) for s in fact.out_shapes + fact.slot_shapes],
        p.saved_inputs,
        p.saves_output,
    )


def _symbolic_facts(facts, samples, grid: Grid, hardware: HardwareProfile, contention: float) -> dict[str, NodeFacts]:
    """``facts`` with each number the polynomial through the samples, op times rebuilt from them."""
    inverse = [
        [Fraction(int(x.p), int(x.q)) for x in row]
        for row in sympy.Matrix([grid.monomials(*p) for p in grid.points]).inv().tolist()
    ]
    symbolic = {}
    for name, fact in facts.items():
        if any(_structure(sample[name]) != _structure(fact) for sample in samples):
            raise ConfigError(
                f"node {fact.node.format_node()} changes kind, gradient or saved tensors with the batch or sequence "
                "size: plan per size"
            )
        columns = list(zip(*(_numbers(sample[name]) for sample in samples)))
        numbers = [
            _polynomial(values, grid, inverse, f"node {name}: {label}") for label, values in zip(_labels(fact), columns)
        ]
        sized = _with_numbers(fact, numbers)
        symbolic[name] = dataclasses.replace(sized, full_time_s=_op_time(fact, sized, hardware, contention))
    return symbolic


def _polynomial(values: tuple, grid: Grid, inverse, what: str):
    """The polynomial in ``BATCH`` and ``SEQ`` through ``values`` at the grid points (the check
    point's value last); the base value itself where it does not change."""
    *on_grid, at_check = values
    if all(v == on_grid[0] for v in values):
        return on_grid[0]
    coefficients = [sum(row[k] * Fraction(v) for k, v in enumerate(on_grid)) for row in inverse]
    predicted = sum(c * m for c, m in zip(coefficients, grid.monomials(*map(Fraction, _or_one(grid.check)))))
    if abs(predicted - Fraction(at_check)) > 1e-9 * max(1, abs(at_check)):
        raise ConfigError(
            f"{what} is {on_grid} at (batch, seq) = {grid.points} but {at_check} at {grid.check}, not a polynomial of "
            "degree "
            "1 in the batch and 2 in the sequence: its cost cannot be kept symbolic; plan per size"
        )
    monomials = grid.monomials(BATCH, SEQ)
    return sum(sympy.Rational(c.numerator, c.denominator) * m for c, m in zip(coefficients, monomials))


def _or_one(point):
    return tuple(1 if v is None else v for v in point)


def _op_time(fact: NodeFacts, sized: NodeFacts, hardware: HardwareProfile, contention: float):
    """The op's time in b and s: a paced GEMM or attention at its symbolic shapes (exact), a
    view nothing, any other op its roofline scaled to its time at the captured sizes (measured
    or not)."""
    if fact.kind != "op" or sized.profile == fact.profile:
        return fact.full_time_s
    if fact.pacing is not None:
        return fact.pacing.seconds(sized.slot_shapes) * contention
    if not hardware.measure_ops and moves_no_data(fact.node.target):
        return 0.0
    at_capture = compute_time(fact.profile, hardware, fact.needs_grad, fact.dtype) * contention
    scale = fact.full_time_s / at_capture if at_capture and hardware.measure_ops else 1.0
    return compute_time(sized.profile, hardware, fact.needs_grad, fact.dtype) * contention * scale


def _replaced(fact: NodeFacts, sizes: dict) -> NodeFacts:
    """``fact`` with ``sizes`` substituted into every expression in it."""

    def sub(value):
        return value.xreplace(sizes) if isinstance(value, sympy.Basic) else value

    numbers = [sub(v) for v in _numbers(fact)]
    return dataclasses.replace(_with_numbers(fact, numbers), full_time_s=sub(fact.full_time_s))


def _pinned_cuts(plan: Plan, facts, mesh, hardware: HardwareProfile) -> Schedule:
    """The plan's schedule with its pipeline cut where it is cut at the captured sizes."""
    schedule = plan.schedule
    if schedule.stages == 1 or schedule.cuts:
        return schedule
    strategies = strategies_from_plan(plan, facts)
    local = ShardedShapes.unsharded(facts)
    for axis, chosen in strategies.items():
        local = local.after(chosen, plan.degrees[axis])
    return dataclasses.replace(
        schedule, cuts=partition(facts, local, schedule, hardware.link(mesh.shape, mesh.size)).cuts
    )


def _splits(plan: Plan, facts) -> tuple[tuple[str, sympy.Expr, int], ...]:
    """Every dim that grows with b or s and that the plan shards, with the ranks it is split over."""
    axes = list(plan.degrees)
    found = {}
    placed = [(name, facts[name].out_shape, decision.output) for name, decision in plan.nodes.items() if name in facts]
    placed += [(name, facts[name].out_shape, placements) for name, placements in plan.inputs.items() if name in facts]
    for name, shape, placements in placed:
        for dim, size in enumerate(shape):
            ranks = math.prod(
                plan.degrees[a]
                for a, p in zip(axes, placements or ())
                if isinstance(p, Shard) and p.dim % len(shape) == dim
            )
            if ranks > 1 and isinstance(size, sympy.Basic):
                found.setdefault((size, ranks), f"{name}'s dim {dim}")
    return tuple((what, size, ranks) for (size, ranks), what in found.items())
