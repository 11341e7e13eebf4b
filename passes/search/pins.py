"""What the axes and the user fix before a layout is solved: the data-like axes split the
inputs' batch (or sequence) dim and keep parameters whole; constraints pin placements and
parallel kernels by parameter or module name pattern (``{"layers.*.attn.wq": "S(-1)"}``,
``{"layers.*.attn": "ring"}``); the experts' weights are ep's to split.

Pre: the graph's node facts. Post: node → placement (or kernel) pins, which
:mod:`autopar.passes.search.axes` turns into each axis's candidates; a pattern matching nothing,
or a dim a tensor does not have, raises ShardingRuleError naming it. A module pattern pins the
module's ops that can take the split (not its scalars, nor its buffers' updates); on a tensor-parallel
axis of one device every pin holds as it is.
"""

from __future__ import annotations

import fnmatch

import torch

from autopar.ir import KERNEL_DIMS, Axis, Placement, Replicate, Shard, ShardingRuleError, module_label, parse_placement
from autopar.passes.capture.graph import module_path
from autopar.passes.capture.moe import EXPERTS_OP
from autopar.passes.cost.facts import NodeFacts
from autopar.passes.sharding.rules import KERNEL_RULES, rule_for
from autopar.runtime.kernels.expert_parallel import first_expert_slot

R = Replicate()
# the tensor dim each data-like axis splits in user inputs (and keeps parameters whole over)
SPLIT_DIM = {Axis.DP: 0, Axis.EP: 0, Axis.CP: 1}


def chunks_per_rank(axis: str) -> int:
    """cp holds a head and a tail chunk of the sequence per rank (which balances causal attention)."""
    return 2 if axis == Axis.CP else 1


def axis_pins(facts, axis: str, size: int, constraints, experts: frozenset[str] = frozenset()) -> dict[str, Placement]:
    """What an axis fixes: dp and ep split the inputs' batch dim, cp their sequence dim; all
    three keep parameters whole (but ep the experts' weights, which its kernel may split)."""
    split_dim = SPLIT_DIM.get(axis)
    multiple = chunks_per_rank(axis) * size
    pins = {}
    for name, fact in facts.items():
        if fact.kind == "buffer":
            pins[name] = R
        elif split_dim is not None and fact.kind == "param" and not (axis == Axis.EP and name in experts):
            pins[name] = R
        elif fact.kind == "input":
            shape = fact.out_shape
            splits = split_dim is not None and len(shape) > split_dim and shape[split_dim] % multiple == 0
            pins[name] = Shard(split_dim) if splits and size > 1 else R
    if axis == Axis.TP:
        placements = _constraint_pins(facts, constraints, size)  # checked on any mesh: a typo is a typo
        if size > 1:  # on one device every placement is the whole tensor: a pin holds as it is
            pins.update(placements)
    return pins


def user_pins(facts, constraints) -> dict[str, tuple]:
    """Node → (placement pinned on the tensor-parallel axis, kernel pinned), for every node a
    constraint names (:func:`axis_pins`, :func:`kernel_pins`; a constraint matching nothing is an error)."""
    placements, kernels = _constraint_pins(facts, constraints), kernel_pins(facts, constraints)
    return {name: (placements.get(name), kernels.get(name)) for name in {*placements, *kernels}}


def kernel_pins(facts, constraints) -> dict[str, str]:
    """Nodes pinned to a parallel kernel: ``{"layers.*.attn": "ring"}`` (by :func:`module_name`)."""
    pins = {}
    for pattern, value in constraints.items():
        if value in KERNEL_DIMS:
            matched = [
                n for n, f in facts.items() if f.kind == "op" and fnmatch.fnmatchcase(module_name(f.node), pattern)
            ]
            pins.update({name: value for name in matched if _has_kernel(facts[name], value)})
            if not any(_has_kernel(facts[name], value) for name in matched):
                raise ShardingRuleError(
                    f"constraint {pattern!r}: {value!r} pins a kernel, but no op of a module matching it has one"
                )
    return pins


def module_name(node) -> str:
    """The module a constraint pattern matches a node by: its module path, or ``"<top>"`` for
    the model's own forward (where a loss is usually computed), as plans print it."""
    return module_label(module_path(node))


def _has_kernel(fact: NodeFacts, kernel: str) -> bool:
    return rule_for(fact.node.target) in KERNEL_RULES[kernel]


def _constraint_pins(facts, constraints, size: int = 1) -> dict[str, Placement]:
    pins = {}
    for pattern, value in constraints.items():
        if value in KERNEL_DIMS:
            continue
        placement = parse_placement(value) if isinstance(value, str) else value
        matched = [name for name, fact in facts.items() if _named_by(fact, pattern)]
        if not matched:
            raise ShardingRuleError(f"constraint {pattern!r} matches no parameter and no module: check the name")
        # a module's ops the split cannot reach (a scalar such as a BatchNorm's count of batches, its
        # statistics of size 1 along the batch) are left to the search; where no op can, the errors name them
        holding = [name for name in matched if facts[name].kind != "op" or _holds(facts[name], placement, size)]
        for name in holding or matched:
            pins[name] = _pinned(facts[name], pattern, placement)
    return pins


def _named_by(fact: NodeFacts, pattern: str) -> bool:
    """A parameter by its name, an op by its module's; not a buffer's update (capture.graph's in-place
    copy before the output: the module's state, not its work)."""
    if fact.kind == "param":
        return fnmatch.fnmatchcase(fact.name, pattern)
    if fact.kind != "op" or not fact.out_shapes or fact.node.target is torch.ops.aten.copy_.default:
        return False
    return fnmatch.fnmatchcase(module_name(fact.node), pattern)


def _holds(fact: NodeFacts, placement: Placement, size: int) -> bool:
    """Whether an op's output can take ``placement`` over ``size`` devices: a dim it has, split evenly."""
    if not isinstance(placement, Shard):
        return True
    shape = fact.out_shape
    return -len(shape) <= placement.dim < len(shape) and shape[placement.dim] % size == 0


def _pinned(fact: NodeFacts, pattern: str, placement: Placement) -> Placement:
    """The pin with a negative dim counted from the end; a dim the tensor does not have is the user's mistake."""
    if not isinstance(placement, Shard):
        return placement
    shape = fact.out_shape
    if not -len(shape) <= placement.dim < len(shape):
        raise ShardingRuleError(
            f"constraint {pattern!r}={placement}: {_named(fact)} has {len(shape)} dims (shape {list(shape)}), so "
            f"S(d) needs {-len(shape)} <= d < {len(shape)}: pin a dim it has, e.g. S(-1) for its last"
        )
    return Shard(placement.dim % len(shape))


def expert_params(facts) -> frozenset[str]:
    """Parameters an experts op's expert tensors (:func:`first_expert_slot` on: weights and biases)
    are made of: the tensors themselves, or the parameters they are viewed and joined from (DBRX's,
    Aria's and GPT-OSS's transposed weights)."""
    todo = [
        s.name
        for f in facts.values()
        if f.kind == "op" and str(f.node.target).startswith(EXPERTS_OP)
        for s in f.slots[first_expert_slot(f.node.target) :]
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in facts and name not in seen:
            seen.add(name)
            todo.extend(slot.name for slot in facts[name].slots if facts[name].kind == "op")
    return frozenset(name for name in seen if facts[name].kind == "param")


def _named(fact: NodeFacts) -> str:
    """A node as a user knows it: a parameter by name, an op by its node and module."""
    if fact.kind == "param":
        return f"parameter {fact.name!r}"
    return f"node {fact.node.format_node()} (module {module_name(fact.node)!r})"
