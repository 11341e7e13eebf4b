"""What the search knows about each node of a captured graph, and its local shapes as axes are solved.

Pre: a :class:`CapturedGraph` and the hardware it is planned for. Post: one
:class:`NodeFacts` per node (kind, input slots and shapes, the op's profile and its
unsharded forward + backward time, whether autograd keeps its output), computed once per
graph; :class:`ShardedShapes` follows every node's local shapes through the solved axes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.ir import HardwareProfile, PrecisionPolicy, Shard, layer_of
from autopar.passes.capture.graph import CapturedGraph, node_layer
from autopar.passes.capture.recurrences import recurrence_op
from autopar.passes.cost.efficiency import ATTENTION, GEMMS, experts_op, shaped_seconds, work_units
from autopar.passes.cost.kernels import experts_top_k
from autopar.passes.cost.ops import (
    OpProfile,
    compute_dtype,
    compute_time,
    maximum,
    measured_time,
    moves_no_data,
    op_profile,
)
from autopar.passes.rewrite.recompute import is_matmul
from autopar.passes.sharding.strategies import (
    Strategy,
    local_shape,
    numel,
    output_tensors,
    tensor_inputs,
    work_fraction,
)


@dataclass
class NodeFacts:
    """What the search needs to know about one node, computed once per graph."""

    node: fx.Node
    kind: str  # "param", "buffer", "input", "op", "output"
    slots: list[fx.Node]
    slot_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    elem_bytes: int
    full_time_s: float  # forward + backward on one device, unsharded
    needs_grad: bool
    name: str = ""  # parameter / buffer name
    profile: OpProfile = OpProfile(0.0, 0.0, 0.0)
    saved: bool = False  # autograd keeps this node's output for some backward
    consumers: int = 0  # ops that take this node's output
    layer: str | None = None  # the numbered module it belongs to (``layers.3``), None outside layers
    matmuls_before: int = 0  # its layer's matmuls before it in forward (recompute.kept_at: "selective-op")
    # How many nodes of the captured graph this one stands for: the search folds a run of identical
    # layers into one that counts for the middle ones (:mod:`autopar.passes.search.fold`); every sum
    # over nodes weighs a node, and every sum over edges an edge's consumer, by it.
    weight: int = 1
    folded_layers: tuple[str, ...] = ()  # with a weight, the layers this node's layer stands for, in order
    dtype: str = "float32"  # what its output computes in under the precision policy ("bfloat16", ...)
    precision: str = "fp32"  # the policy training keeps a parameter's state under (autopar.ir.precision)
    grad_bytes: int = 4  # bytes per gradient element as gradients are reduced (the policy's reduce_dtype)
    pacing: Pacing | None = None  # a GEMM, attention, experts or recurrence op: efficiency by local shapes
    # outside layers, after the last one (final norm, head, loss): a pipeline's last stage module holds
    # what these save for one microbatch at a time (its backward follows its forward at once)
    after_layers: bool = False

    @property
    def gather_group(self) -> str:
        """A parameter's ZeRO group, gathered (ZeRO-3) and reduce-scattered (a compiled ZeRO-2
        program too) at once: its layer, "" for the parameters outside layers
        (:func:`autopar.runtime.zero.gather.gather_groups`)."""
        return layer_of(self.name) or ""

    @property
    def master_bytes(self) -> int:
        """Bytes per element of the weight the optimizer steps: an fp32 master under mixed
        precision (what ZeRO-1/2 gather after the step), else the parameter itself."""
        return 4 if self.precision != "fp32" else self.elem_bytes

    @functools.cached_property
    def scope(self) -> str:
        """Its :func:`move_scope` as a consumer (asked for every edge of every layout priced)."""
        return move_scope(self.node)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out_shapes[0] if self.out_shapes else ()

    def seconds(self, work: float, slot_shapes=None, microbatches: int = 1) -> float:
        """Forward + backward seconds of this node on one rank doing ``work`` of it, its inputs of
        local shapes ``slot_shapes``, its batch run in ``microbatches`` pieces.

        The unsharded time times ``work``; a paced node (a GEMM, attention, experts or recurrence op
        on a profile with kernel figures) also at the efficiency of the local shapes rather than of
        the unsharded ones, and doing at least the work its local shapes hold (a GEMM on a
        partial-sum input multiplies the whole input on every rank). ``work`` keeps what the shapes
        do not say (a ring kernel's p blocks of local size).
        """
        if self.pacing is None or slot_shapes is None:
            return self.full_time_s * work
        paced = self.pacing.against(tuple(map(tuple, slot_shapes)), tuple(map(tuple, self.slot_shapes)), microbatches)
        if paced is None:
            return self.full_time_s * work
        held, slower = paced
        return self.full_time_s * maximum(work, held) * slower


@dataclass(frozen=True)
class Pacing:
    """Seconds per unit of work of one GEMM, attention, experts or recurrence op at any input
    shapes, on a GPU profile with kernel figures (:mod:`autopar.passes.cost.efficiency`): what
    makes a node's time follow its local (sharded, microbatched) shapes."""

    target: object
    hardware: HardwareProfile
    dtype: str
    itemsize: int
    needs_grad: bool
    causal: bool = False
    grads: tuple[bool, bool] = (True, True)  # a GEMM's inputs that get a gradient (left, right)
    top_k: int = 1  # an experts op's experts per token
    chunk: int = 64  # a gated delta rule's steps per chunk
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def seconds(self, slot_shapes, microbatches: int = 1):
        """Forward + backward seconds at ``slot_shapes``, run in ``microbatches`` pieces."""
        return shaped_seconds(
            self.target,
            slot_shapes,
            self.hardware,
            self.dtype,
            self.itemsize,
            self.needs_grad,
            self.causal,
            microbatches,
            self.grads,
            self.top_k,
            self.chunk,
        )

    def against(self, local: tuple, whole: tuple, microbatches: int = 1):
        """(share of the work at ``whole`` shapes the ``local`` ones hold, time per unit at ``local``
        over that at ``whole``), or None without work; once per local shapes."""
        key = ("against", local, whole, microbatches)
        if key not in self._memo:
            here, there = self.per_unit(local, microbatches), self.per_unit(whole, 1)
            if here is None or there is None:
                self._memo[key] = None
            else:
                units = work_units(self.target, local, self.top_k, self.chunk) / work_units(
                    self.target, whole, self.top_k, self.chunk
                )
                self._memo[key] = (units, here / there)
        return self._memo[key]

    def per_unit(self, slot_shapes: tuple, microbatches: int = 1):
        """:meth:`seconds` per unit of the op's work at those shapes; None without work."""
        key = (slot_shapes, microbatches)
        if key not in self._memo:
            units = work_units(self.target, slot_shapes, self.top_k, self.chunk)
            self._memo[key] = self.seconds(slot_shapes, microbatches) / units if units else None
        return self._memo[key]


@dataclass
class ShardedShapes:
    """Local shapes of every node's output and inputs, as axes are solved one after another."""

    shapes: dict[str, list[tuple[int, ...]]]  # node → local output shapes
    slot_shapes: dict[str, list[tuple[int, ...]]]  # node → local shape of each tensor input
    work: dict[str, float]  # node → fraction of its work one rank still does
    producers: dict[str, list[str]] = field(default_factory=dict)  # node → the node behind each tensor input
    moved: frozenset[tuple[str, int]] = frozenset()  # (node, input slot) a collective brings: a new tensor

    @classmethod
    def unsharded(cls, facts: dict[str, NodeFacts]) -> ShardedShapes:
        return cls(
            {n: list(f.out_shapes) for n, f in facts.items()},
            {n: list(f.slot_shapes) for n, f in facts.items()},
            {n: 1.0 for n in facts},
            {n: [slot.name for slot in f.slots] for n, f in facts.items()},
        )

    def after(self, chosen: dict[str, Strategy], size: int) -> ShardedShapes:
        """The shapes once every node in ``chosen`` is placed on an axis of ``size``."""
        if size == 1:  # nothing is split, nothing moves
            return self
        shapes, slot_shapes, work = dict(self.shapes), dict(self.slot_shapes), dict(self.work)
        moved = set()
        for n, s in chosen.items():
            placements = (s.output, *s.inputs)
            if any(isinstance(p, Shard) for p in placements):
                shapes[n] = [local_shape(x, s.output, size) for x in shapes[n]]
                slot_shapes[n] = [local_shape(x, p, size) for x, p in zip(slot_shapes[n], s.inputs)]
            work[n] *= work_fraction(s, size)
            # the rewrite redistributes an input whose placement differs from its producer's
            for index, (producer, wanted) in enumerate(zip(self.producers.get(n, ()), s.inputs)):
                if wanted is not None and producer in chosen and wanted != chosen[producer].output:
                    moved.add((n, index))
        return ShardedShapes(shapes, slot_shapes, work, self.producers, self.moved | moved)


def analyze(
    captured: CapturedGraph,
    hardware: HardwareProfile,
    contention: float = 1.0,
    policy: PrecisionPolicy | None = None,
) -> dict[str, NodeFacts]:
    """Per-node facts: slots, shapes, unsharded cost, whether a gradient flows through it.

    Priced as ``policy`` (default fp32) runs the graph: floating tensors in the policy's compute dtype (FLOP
    rates, bytes moved and saved) where the graph was captured in another (in fp32), each in its own where it
    was captured in the policy's (as ``plan`` captures a model), parameters' state kept and
    gradients reduced as the policy says. An op's time is measured on this machine when
    ``hardware`` is this machine (``measure_ops``), else GEMMs and attention at the efficiency
    their shapes reach (with kernel figures) and other ops at the roofline of their kernels; views are free;
    ``contention`` (ranks per core) slows all of them.

    >>> facts = analyze(captured, get_profile("a100-80gb"), policy=PrecisionPolicy.of("bf16-mixed"))  # doctest: +SKIP
    """
    facts: dict[str, NodeFacts] = {}
    params, buffers = captured.params, captured.buffers
    policy = policy or PrecisionPolicy()
    cast = getattr(torch, policy.param_dtype)
    if captured.param_dtype == cast:
        cast = None  # captured as the policy computes: the model's own upcasts (fp32 logits) priced as they run
    grad_bytes = getattr(torch, policy.reduce_dtype).itemsize
    matmuls: dict[str | None, int] = {}  # by layer, in graph (forward) order
    for node in captured.graph.nodes:
        outputs = output_tensors(node)
        slots = tensor_inputs(node) if node.op in ("call_function", "output") else []
        slot_shapes = [_slot_shape(node, slot) for slot in slots]
        if node.op == "placeholder":
            kind = "param" if node.name in params else "buffer" if node.name in buffers else "input"
            # a frozen parameter (requires_grad off) gets no gradient: no backward, state or sync of its own
            needs_grad = kind == "param" and bool(getattr(node.meta.get("val"), "requires_grad", True))
        elif node.op == "output":
            kind, needs_grad = "output", False
        else:
            kind = "op"
            needs_grad = any(facts[s.name].needs_grad for s in slots if s.name in facts) and any(
                t.dtype.is_floating_point for t in outputs
            )
        # backward computes the gradients of the inputs that need one (not a mask's, a frozen weight's)
        wants = frozenset(s.name for s in slots if s.name in facts and facts[s.name].needs_grad)
        profile = op_profile(node, needs_grad, cast, wants) if kind == "op" else OpProfile(0.0, 0.0, 0.0)
        dtype = compute_dtype(outputs[0].dtype, cast) if outputs else torch.float32
        pacing = _pacing(node, hardware, dtype, needs_grad, wants) if kind == "op" else None
        layer = node_layer(node) if kind == "op" else None
        before = matmuls.get(layer, 0)
        matmuls[layer] = before + (kind == "op" and is_matmul(node.target))
        facts[node.name] = NodeFacts(
            node=node,
            kind=kind,
            slots=slots,
            slot_shapes=slot_shapes,
            out_shapes=[tuple(t.shape) for t in outputs],
            elem_bytes=dtype.itemsize,
            dtype=dtype_name(dtype),
            full_time_s=_op_time(node, profile, hardware, needs_grad, cast, pacing, slot_shapes, wants) * contention
            if kind == "op"
            else 0.0,
            needs_grad=needs_grad,
            name=params.get(node.name) or buffers.get(node.name) or node.name,
            profile=profile,
            layer=layer,
            matmuls_before=before,
            precision=policy.precision,
            grad_bytes=grad_bytes,
            pacing=pacing,
        )
    in_layers = (i for i, fact in enumerate(facts.values()) if fact.kind == "op" and fact.layer is not None)
    last = max(in_layers, default=None)
    for index, fact in enumerate(facts.values()):
        fact.after_layers = last is not None and index > last and fact.kind == "op" and fact.layer is None
    for fact in facts.values():  # mark what autograd keeps (activation memory); count consumers
        for slot in fact.slots:
            if fact.kind == "op" and slot.name in facts:
                facts[slot.name].consumers += 1
        if fact.kind == "op" and fact.needs_grad:
            fact.saved = fact.saved or fact.profile.saves_output
            for slot in fact.profile.saved_inputs:
                facts[fact.slots[slot].name].saved = True
    return facts


def move_scope(node: fx.Node) -> str:
    """Consumers of one value in one scope share its move to a placement (the rewrite emits
    one collective for q, k and v): its layer; outside layers every consumer is its own scope,
    so no move crosses a stage cut or a recomputed layer."""
    return node_layer(node) or node.name


def _op_time(
    node: fx.Node, profile: OpProfile, hardware: HardwareProfile, needs_grad: bool, cast, pacing, shapes, wants=None
):
    measured = measured_time(node, needs_grad, profile, cast=cast, wants=wants) if hardware.measure_ops else None
    if measured is not None:
        return measured
    if moves_no_data(node.target):
        return 0.0
    if pacing is not None:
        return pacing.seconds(shapes)
    outputs = output_tensors(node)
    dtype = dtype_name(compute_dtype(outputs[0].dtype, cast)) if outputs else "float32"
    return compute_time(profile, hardware, needs_grad, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: how hardware profiles name dtypes."""
    return str(dtype).removeprefix("torch.")


def _pacing(node: fx.Node, hardware: HardwareProfile, dtype: torch.dtype, needs_grad: bool, wants) -> Pacing | None:
    """The pacing of a GEMM, attention, experts or recurrence node on a profile with kernel figures
    that does not time ops on this machine (a GEMM's backward computes the gradients of the inputs
    named in ``wants``); None for every other node."""
    if hardware.kernels is None or hardware.measure_ops:
        return None
    slots = tensor_inputs(node)
    shapes = [_slot_shape(node, slot) for slot in slots]
    causal = node.target is ATTENTION and bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else 0))
    sides = GEMMS[node.target][:2] if node.target in GEMMS and len(slots) > max(GEMMS[node.target][:2]) else ()
    grads = tuple(slots[i].name in wants for i in sides) or (True, True)
    top_k = experts_top_k(node) if experts_op(node.target) else 1
    chunk = node.args[5] if recurrence_op(node.target) else Pacing.chunk
    pacing = Pacing(node.target, hardware, dtype_name(dtype), dtype.itemsize, needs_grad, causal, grads, top_k, chunk)
    return pacing if work_units(node.target, shapes, top_k, chunk) else None


def _slot_shape(node: fx.Node, slot: fx.Node) -> tuple[int, ...]:
    val = slot.meta.get("val")
    if isinstance(val, (tuple, list)):
        index = node.args[1] if node.target.__name__ == "getitem" else 0
        val = val[index]
    return tuple(val.shape)


def activation_bytes(
    fact: NodeFacts, local_shapes, work: float, output_fraction: float = 1.0, saved: bool | None = None
) -> float:
    """Bytes autograd keeps for this node: its output if saved (``saved`` overrides the
    node's own flag), plus what the op saves itself."""
    if fact.kind not in ("op", "input"):
        return 0.0
    saved = fact.saved if saved is None else saved
    output = sum(numel(sh) for sh in local_shapes) * fact.elem_bytes * output_fraction if saved else 0.0
    return output + fact.profile.saved_extra_bytes * work


def transient_bytes(fact: NodeFacts, local_shapes) -> float:
    """Bytes the peak holds for this node while it runs beside what is saved: its output and
    that output's gradient, for an op autograd differentiates (the priced peak counts the largest)."""
    if fact.kind != "op" or not fact.needs_grad:
        return 0.0
    return 2 * sum(numel(sh) for sh in local_shapes) * fact.elem_bytes


def saved_bytes(
    facts: dict[str, NodeFacts], local: ShardedShapes, regathered: frozenset[tuple[str, int]] = frozenset()
) -> dict[str, float]:
    """Bytes autograd keeps for each node once every axis is solved (``local``).

    An op that saves an input a collective brings (``local.moved``: an all-gathered
    sequence-parallel norm output, a chunk) saves the collective's output, a new tensor at
    its own input placement, once per value, destination and :func:`move_scope` however many
    ops there save it (q, k and v save one gathered input); the producer's output is kept
    only where the op saves it or a consumer saves it as it is. An input in ``regathered``
    (``Schedule.regather``) is kept as its producer's output, the shard, and gathered again in
    backward. Without moved inputs this is :func:`activation_bytes` of every node.
    """
    kept = {n for n, f in facts.items() if f.kind == "op" and f.needs_grad and f.profile.saves_output}
    copies = dict.fromkeys(facts, 0.0)
    counted = set()  # (value, its local shape there, scope): one shared move
    for name, fact in facts.items():
        if fact.kind != "op" or not fact.needs_grad:
            continue
        for slot in fact.profile.saved_inputs:
            producer = fact.slots[slot].name
            if (name, slot) not in local.moved or (name, slot) in regathered:
                kept.add(producer)
                continue
            move = (producer, tuple(local.slot_shapes[name][slot]), fact.scope)
            if move not in counted:
                counted.add(move)
                copies[name] += numel(local.slot_shapes[name][slot]) * facts[producer].elem_bytes
    return {
        name: activation_bytes(fact, local.shapes[name], local.work[name], saved=name in kept) + copies[name]
        for name, fact in facts.items()
    }
