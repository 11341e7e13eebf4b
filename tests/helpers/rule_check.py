"""Every strategy of a sharding rule, checked on concrete tensors in one process.

As DTensor's strategy validation does: for one op call (a :class:`Sample`) on an axis of ``p``
ranks, every candidate :func:`node_strategies` offers is simulated — the inputs split as its
placements say (``S(d)``: equal chunks; ``R``: the whole on every rank; ``P`` / ``P(avg)``: random
summands whose sum / mean is the input), the op run on each rank's pieces with the arguments the
rewrite gives it (:func:`localize_arguments`), the outputs combined as the output placement says
(concatenate; all equal; sum; mean) — and compared with the op on the whole inputs.

Backward uses the duals the rewrite relies on (passes/rewrite/gradients.py, runtime/collectives.py):
the output's gradient reaches each rank as its chunk (``S``), whole (``R``, ``P``) or divided by p
(``P(avg)``: the all-reduce's dual). Input gradients are concatenated (``S``); summed over ranks for
an ``R`` input of an op that splits its work (output not ``R``: Megatron's f), else equal on every
rank; a partial input's gradient is the whole one on every rank (divided by p for ``P(avg)``).

Strategies run by a parallel kernel (ring/Ulysses attention, expert dispatch) are no local op:
they are tallied apart and checked by tests/runtime/kernels.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.ir import Partial, Replicate, Shard
from autopar.passes.rewrite.rewrite import localize_arguments
from autopar.passes.sharding.strategies import OpView, Strategy, output_tensors, tensor_inputs

R = Replicate()
AXIS_SIZES = (2, 3, 4)
TOLERANCE = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}  # (rtol, atol relative to the largest value)


@dataclass(frozen=True)
class Sample:
    """One op call on whole tensors: ``target(*args, **kwargs)``. A ``Group`` in ``args`` is one
    input holding several tensors (what ``getitem`` takes). ``values_defined`` is False for ops whose
    output values are arbitrary (``empty_like``): then only shapes and dtypes compare.
    ``constant_inputs``: tensor inputs (by position among them) that take no gradient (class weights)."""

    target: object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    values_defined: bool = True
    constant_inputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Group:
    """Several tensors passed as one graph value (a multi-output op's result)."""

    tensors: tuple[torch.Tensor, ...]


@dataclass
class Tally:
    """What was checked, by op: strategies checked forward, backward, and kernel strategies set aside."""

    forward: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    backward: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    kernels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def summary(self) -> str:
        strategies = sum(len(s) for s in self.forward.values())
        splitting = sum(1 for s in self.forward.values() for text in s if not _replicated(text))
        backward = sum(len(s) for s in self.backward.values())
        kernels = sum(len(s) for s in self.kernels.values())
        return (
            f"{len(self.forward)} ops x {strategies} strategies checked forward ({splitting} that split or "
            f"partial, the rest all-replicated fallbacks; {backward} also backward); {kernels} kernel strategies "
            "left to tests/runtime/kernels"
        )


def _replicated(strategy_text: str) -> bool:
    """Whether a strategy (as ``str(Strategy)``) keeps every tensor whole: the fallback."""
    return set(strategy_text.replace("->", ",").replace(" ", "").split(",")) <= {"R", ""}


TALLY = Tally()


def op_name(target) -> str:
    """The rule table's name for an op: its overload packet (``aten.linear``), or ``getitem``."""
    if target is operator.getitem:
        return "getitem"
    return str(getattr(target, "overloadpacket", target))


def validate(draw_sample, max_examples: int = 12, tally: Tally = TALLY) -> None:
    """Check every strategy on ``max_examples`` samples from ``draw_sample(draw, p)``; raise on
    the first sample with a wrong strategy (hypothesis then shrinks it to a small one)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same examples on every run: a CI failure reproduces
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(data=st.data(), p=st.sampled_from(AXIS_SIZES))
    def run(data, p):
        sample = draw_sample(data.draw, p)
        failures = check_sample(sample, p, tally)
        assert not failures, "\n".join(failures)

    run()


def check_sample(sample: Sample, p: int, tally: Tally = TALLY) -> list[str]:
    """Every candidate strategy of ``sample`` on an axis of ``p`` ranks, forward and backward;
    the failures, each naming the op, strategy, shapes and what differed."""
    from autopar.passes.sharding.rules import node_strategies  # the table under test, as merged

    node, _ = _node(sample)
    strategies, has_rule = node_strategies(_view(node), p)
    name = op_name(sample.target)
    failures = [] if has_rule else [f"{name}: no sharding rule (a sample exists only for ops with a rule)"]
    for strategy in strategies:
        if strategy.kernel:
            tally.kernels[name].add(str(strategy))
            continue
        where = f"{name} {strategy} on {p} ranks, inputs {_shapes(node)}"
        try:
            backward_checked = _check(sample, strategy, p)
        except _Mismatch as mismatch:
            failures.append(f"{where}: {mismatch}")
            continue
        tally.forward[name].add(str(strategy))
        if backward_checked:
            tally.backward[name].add(str(strategy))
    return failures


class _Mismatch(Exception):
    pass


def _node(sample: Sample) -> tuple[fx.Node, dict[fx.Node, object]]:
    """A one-op graph: a placeholder per tensor input (meta["val"] its whole value) and the call."""
    graph = fx.Graph()
    values: dict[fx.Node, object] = {}

    def placeholder(value):
        if isinstance(value, Group):
            value = value.tensors
        elif not isinstance(value, torch.Tensor):
            return value
        node = graph.placeholder(f"in{len(values)}")
        node.meta["val"] = value
        values[node] = value
        return node

    args = tuple(_map_inputs(placeholder, a) for a in sample.args)
    kwargs = {k: _map_inputs(placeholder, v) for k, v in sample.kwargs.items()}
    node = graph.call_function(sample.target, args, kwargs)
    node.meta["val"] = _call(node, values)
    return node, values


def _map_inputs(fn, value):
    if isinstance(value, (list, tuple)) and not isinstance(value, Group):
        return type(value)(_map_inputs(fn, v) for v in value)
    return fn(value)


def _view(node: fx.Node) -> OpView:
    """What a rule sees (as passes/cost/facts.py builds it): a getitem's slot is the element taken."""
    shapes = []
    for slot in tensor_inputs(node):
        val = slot.meta["val"]
        if isinstance(val, (tuple, list)):
            val = val[node.args[1] if node.target is operator.getitem else 0]
        shapes.append(tuple(val.shape))
    outputs = output_tensors(node)
    return OpView(node, tuple(shapes), tuple(outputs[0].shape) if outputs else ())


def _shapes(node: fx.Node) -> list:
    return [
        tuple(s.meta["val"].shape) if isinstance(s.meta["val"], torch.Tensor) else "tuple" for s in tensor_inputs(node)
    ]


def _call(node: fx.Node, values: dict[fx.Node, object]):
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    return node.target(*args, **kwargs)


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)]


def _check(sample: Sample, strategy: Strategy, p: int) -> bool:
    """Raise :class:`_Mismatch` if the strategy is wrong; return whether backward was checked."""
    node, whole = _node(sample)  # a fresh node: localizing rewrites its arguments
    localize_arguments(node, (strategy.output,), {"axis": p}, "cpu")
    slots = tensor_inputs(node)
    if len(slots) != len(strategy.inputs):
        raise _Mismatch(f"{len(strategy.inputs)} input placements for {len(slots)} tensor inputs")
    generator = torch.Generator().manual_seed(0)
    pieces = {slot: _split(whole[slot], placement, p, generator) for slot, placement in zip(slots, strategy.inputs)}
    # an input that is no slot (a new_* factory's template, lending its dtype) stays whole
    local = [{**whole, **{s: pieces[s][rank] for s in slots}} for rank in range(p)]
    local_outputs = [_flat(_run_rank(node, local[rank], rank)) for rank in range(p)]
    reference = _flat(node.meta["val"])
    for index, expected in enumerate(reference):
        ranks = [outputs[index] for outputs in local_outputs]
        combined = _combine(ranks, strategy.output, f"output {index}", sample.values_defined)
        _compare(combined, expected, f"output {index}", sample.values_defined)
    return _check_backward(sample, strategy, p, node, slots, pieces, reference)


def _run_rank(node: fx.Node, local: dict, rank: int):
    try:
        return _call(node, local)
    except Exception as error:  # a rank that cannot run the op with its pieces: the strategy is wrong
        raise _Mismatch(f"rank {rank} cannot run the op on its pieces: {type(error).__name__}: {error}") from None


def _split(value, placement, p: int, generator) -> list:
    """Each rank's piece of ``value`` (a tensor or a group of them) under ``placement``."""
    if isinstance(value, tuple):
        per_tensor = [_split(v, placement, p, generator) for v in value]
        return [tuple(pieces[rank] for pieces in per_tensor) for rank in range(p)]
    if isinstance(placement, Shard):
        return [chunk.contiguous() for chunk in value.chunk(p, placement.dim)]
    if isinstance(placement, Partial):
        if not (value.is_floating_point() or value.is_complex()):
            raise _Mismatch(f"{placement} asked of a {value.dtype} input: partial values need a floating dtype")
        summands = [torch.randn(value.shape, generator=generator, dtype=value.dtype) for _ in range(p - 1)]
        total = value if placement.reduce_op == "sum" else value * p
        return [*summands, total - sum(summands)]
    return [value] * p


def _combine(pieces: list[torch.Tensor], placement, what: str, values: bool = True) -> torch.Tensor:
    """The whole tensor the ranks' ``pieces`` stand for under ``placement``."""
    if isinstance(placement, Shard):
        try:
            return torch.cat(pieces, dim=placement.dim)
        except (RuntimeError, IndexError) as error:
            raise _Mismatch(
                f"{what}: the ranks' pieces do not concatenate along dim {placement.dim}: {error}"
            ) from None
    if isinstance(placement, Partial):
        if not pieces[0].is_floating_point():
            raise _Mismatch(f"{what} is {placement} but of dtype {pieces[0].dtype}")
        total = torch.stack(pieces).sum(0)
        return total / len(pieces) if placement.reduce_op == "avg" else total
    for rank, piece in enumerate(pieces[1:], 1):
        _compare(piece, pieces[0], f"{what} (R) on rank {rank} vs rank 0", values)
    return pieces[0]


def _compare(actual: torch.Tensor, expected: torch.Tensor, what: str, values: bool) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise _Mismatch(
            f"{what}: got {tuple(actual.shape)} {actual.dtype}, the op gives {tuple(expected.shape)} {expected.dtype}"
        )
    if not values:
        return
    if not expected.is_floating_point():
        if not torch.equal(actual, expected):
            raise _Mismatch(f"{what}: {int((actual != expected).sum())} of {expected.numel()} elements differ")
        return
    rtol, atol = TOLERANCE.get(expected.dtype, TOLERANCE[torch.float32])
    scale = expected.abs().max().item() if expected.numel() else 0.0
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True):
        error = (actual - expected).abs().max().item()
        raise _Mismatch(f"{what}: differs by up to {error:.3g} (largest value {scale:.3g})")


def _check_backward(sample, strategy, p, node, slots, pieces, reference) -> bool:
    """Per-rank vector-Jacobian products with the duals (module docstring) against autograd of
    the whole op; False when the op has no gradient to check (integer inputs or outputs)."""
    floating = [
        s
        for k, s in enumerate(slots)
        if k not in sample.constant_inputs
        and isinstance(s.meta["val"], torch.Tensor)
        and s.meta["val"].is_floating_point()
    ]
    outputs = [i for i, t in enumerate(reference) if t.is_floating_point()]
    if not floating or not outputs or not sample.values_defined:
        return False
    whole_node, whole = _node(sample)
    leaves = {s: whole[s].detach().requires_grad_() for s in tensor_inputs(whole_node) if s.name in _names(floating)}
    expected = _flat(_call(whole_node, {**whole, **leaves}))
    outputs = [i for i in outputs if expected[i].requires_grad]
    if not outputs:
        return False
    generator = torch.Generator().manual_seed(1)
    grad_out = {i: torch.randn(expected[i].shape, generator=generator, dtype=expected[i].dtype) for i in outputs}
    expected_grads = _grads([expected[i] for i in outputs], list(leaves.values()), [grad_out[i] for i in outputs])
    splits_work = strategy.output != R
    per_rank = []
    for rank in range(p):
        local = {s: pieces[s][rank] for s in slots}
        local_leaves = {s: local[s].detach().requires_grad_() for s in floating}
        result = _flat(_run_rank(node, {**local, **local_leaves}, rank))
        grads = [_grad_piece(grad_out[i], strategy.output, p, rank) for i in outputs]
        per_rank.append(_grads([result[i] for i in outputs], list(local_leaves.values()), grads))
    for k, slot in enumerate(floating):
        placement = strategy.inputs[slots.index(slot)]
        what = f"gradient of input {slots.index(slot)} ({placement})"
        ranks = [grads[k] for grads in per_rank]
        if isinstance(placement, Shard) or (placement == R and splits_work):
            _compare(
                _combine(ranks, placement if isinstance(placement, Shard) else Partial(), what),
                expected_grads[k],
                what,
                True,
            )
            continue
        factor = p if placement == Partial("avg") else 1
        for rank, grad in enumerate(ranks):
            _compare(grad * factor, expected_grads[k], f"{what} on rank {rank}", True)
    return True


def _names(nodes) -> set[str]:
    return {n.name for n in nodes}


def _grads(outputs, inputs, grad_outputs) -> list[torch.Tensor]:
    if not any(o.requires_grad for o in outputs):
        return [torch.zeros_like(i) for i in inputs]
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


def _grad_piece(grad: torch.Tensor, placement, p: int, rank: int) -> torch.Tensor:
    """The output gradient rank ``rank`` receives (the duals in the module docstring)."""
    if isinstance(placement, Shard):
        return grad.chunk(p, placement.dim)[rank].contiguous()
    if placement == Partial("avg"):
        return grad / p
    return grad
