"""Repeated layers, solved once: which layers of a captured graph are identical, and the
smaller graph the search works on.

A layer is a numbered module (``layers.3``, :func:`autopar.ir.layer_of`): its ops, and the
parameters and buffers only its ops use. Two layers are *identical* when their nodes match
position by position: op, arguments, shapes and dtypes, what the cost model knows of each node
(time, FLOPs, what autograd saves, measured expert load), what it knows of every input from
outside the layer (kind, dtype, whether a gradient flows, consumers), and the user's pins. A
wider layer, or a pin on one layer only, makes a layer differ. The search then

- gives the layers of a class between its first and its last one set of ILP variables
  (:attr:`LayerFolding.variable`: every node takes the strategy of its counterpart in the
  class's second layer), so the ILP does not grow with depth. The first and the last layer keep
  their own: they meet other neighbours (the embedding, the head), where another layout can be
  cheaper. This is exactly the unfolded ILP with every inner layer of a class alike;
- runs on a reduced graph (:attr:`LayerFolding.facts`): of a run of n ≥ 5 consecutive identical
  layers it keeps the first, the second, the third standing for the n − 3 inner ones after the
  second (:attr:`NodeFacts.weight`), and the last, which takes its inputs from the third. Layer
  i + 1 reads layer i's outputs as the third reads the second's, and inner strategies are alike,
  so every cost, memory and stage-cut sum over the reduced graph equals the sum over the whole
  one, and every per-node loop of the search stays the same size at any depth. A run whose inner
  layers read anything but the previous layer and nodes outside layers, or feed anything but the
  next layer, is kept whole (its inner layers still share variables).

Pre: :func:`autopar.passes.cost.facts.analyze` of the whole graph; the pins (node → what is
pinned). Post: a :class:`LayerFolding`; :meth:`LayerFolding.expand` turns strategies of the
reduced graph into strategies of every node.

>>> folding = fold_layers(facts, pins={})              # doctest: +SKIP
>>> len(folding.facts) < len(facts), folding.classes   # doctest: +SKIP
(True, (('layers.0', 'layers.1', ...),))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from autopar.passes.cost.facts import NodeFacts

REDUCED_RUN = 5  # a run this long keeps 4 layers; shorter runs gain nothing


@dataclass(frozen=True)
class LayerFolding:
    facts: dict[str, NodeFacts]  # the reduced graph the search runs on
    variable: dict[str, str]  # reduced node → the node whose ILP variable it shares (itself if none)
    stands_for: dict[str, str]  # node of the whole graph → the reduced node whose strategy it takes
    classes: tuple[tuple[str, ...], ...] = ()  # the layers of each class of 2+ identical layers
    twin: dict[str, str] = dataclasses.field(default_factory=dict)  # node → its counterpart in its class's first layer

    @classmethod
    def unfolded(cls, facts: dict[str, NodeFacts]) -> LayerFolding:
        """Every node its own variable (the search without folding, for comparison)."""
        names = {name: name for name in facts}
        return cls(facts, names, names)

    def expand(self, strategies: dict[str, dict]) -> dict[str, dict]:
        """Per-axis strategies of the reduced graph → of every node of the whole graph."""
        return {
            axis: {name: chosen[kept] for name, kept in self.stands_for.items() if kept in chosen}
            for axis, chosen in strategies.items()
        }


def fold_layers(facts: dict[str, NodeFacts], pins: dict[str, object]) -> LayerFolding:
    """Find the classes of identical layers and reduce their runs (see the module docstring)."""
    members = layer_members(facts)
    position = {name: index for nodes in members.values() for index, name in enumerate(nodes)}
    users = _users(facts)
    classes: dict[tuple, list[str]] = {}
    for layer, nodes in members.items():
        classes.setdefault(_signature(nodes, facts, position, users, pins), []).append(layer)
    class_of = {layer: key for key, layers in classes.items() for layer in layers}
    variable = {name: name for name in facts}
    twin = {}  # identical nodes have the same candidates and costs where their local shapes agree
    for layers in classes.values():
        for layer in layers[1:]:
            twin.update(zip(members[layer], members[layers[0]]))
        for layer in layers[2:-1]:  # the first and the last keep their own (module docstring)
            for name, second in zip(members[layer], members[layers[1]]):
                variable[name] = second
    reduced, stands_for = dict(facts), {name: name for name in facts}
    order = list(members)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and class_of[order[end + 1]] == class_of[order[start]]:
            end += 1
        run = order[start : end + 1]
        if len(run) >= REDUCED_RUN and _reducible(run, members, facts, users):
            _reduce(run, members, facts, reduced, stands_for)
        start = end + 1
    kept = set(stands_for.values())
    return LayerFolding(
        {name: fact for name, fact in reduced.items() if name in kept},
        {name: variable[name] for name in reduced if name in kept},
        stands_for,
        tuple(tuple(layers) for layers in classes.values() if len(layers) > 1),
        twin,
    )


def layer_members(facts: dict[str, NodeFacts]) -> dict[str, list[str]]:
    """Per layer in execution order: its parameters and buffers (used by its ops only), then its ops."""
    owners: dict[str, set] = {}
    for fact in facts.values():
        for slot in fact.slots:
            owners.setdefault(slot.name, set()).add(fact.layer if fact.kind == "op" else None)
    ops = {name: fact.layer for name, fact in facts.items() if fact.kind == "op" and fact.layer is not None}
    state = {
        name: next(iter(owners[name]))
        for name, fact in facts.items()
        if fact.kind in ("param", "buffer") and len(owners.get(name, ())) == 1 and None not in owners[name]
    }
    members: dict[str, list[str]] = {layer: [] for layer in dict.fromkeys(ops.values())}
    for name in facts:
        layer = ops.get(name) or state.get(name)
        if layer is not None:
            members[layer].append(name)
    return members


def _users(facts: dict[str, NodeFacts]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {name: [] for name in facts}
    for name, fact in facts.items():
        for slot in fact.slots:
            users[slot.name].append(name)
    return users


def _signature(nodes: list[str], facts, position, users, pins) -> tuple:
    """What must match, position by position, for two layers to be identical."""
    inside = set(nodes)

    def ref(node: fx.Node):
        if node.name in inside:
            return ("self", position[node.name])
        producer = facts[node.name]
        return ("from", producer.kind, producer.needs_grad, producer.consumers, producer.elem_bytes)

    rows = []
    for name in nodes:
        fact = facts[name]
        node = fact.node
        # a producer's consumer count divides its consumers' costs: it matters where they are inside
        consumers = fact.consumers if any(user in inside for user in users[name]) else None
        rows.append(
            (
                fact.kind,
                str(node.target) if node.op == "call_function" else "",
                repr(fx.node.map_arg((node.args, node.kwargs), ref)),
                tuple(fact.out_shapes),
                tuple(fact.slot_shapes),
                fact.elem_bytes,
                fact.needs_grad,
                fact.saved,
                consumers,
                fact.full_time_s,
                fact.profile,
                repr(node.meta.get("expert_load")),
                repr(pins.get(name)),
            )
        )
    return tuple(rows)


def _reducible(run: list[str], members, facts, users) -> bool:
    """Whether the middle layers of a run read only the previous layer and nodes outside
    layers, the same way in every layer, and feed only themselves and the next layer."""
    in_layer = {name: layer for layer, nodes in members.items() for name in nodes}
    reads = set()
    for index in range(1, len(run)):
        own, previous = members[run[index]], members[run[index - 1]]
        where = {name: ("self", k) for k, name in enumerate(own)} | {
            name: ("previous", k) for k, name in enumerate(previous)
        }
        refs = []
        for name in own:
            for slot in facts[name].slots:
                if slot.name in where:
                    refs.append(where[slot.name])
                elif slot.name in in_layer:
                    return False  # reads a layer further back
                else:
                    refs.append(("outside", slot.name))
        reads.add(tuple(refs))
        if index < len(run) - 1:
            allowed = set(own) | set(members[run[index + 1]])
            if any(user not in allowed for name in own for user in users[name]):
                return False
    return len(reads) == 1


def _reduce(run: list[str], members, facts, reduced: dict, stands_for: dict) -> None:
    """Keep the first, second, third and last layer of the run; the third stands for the inner
    layers after the second."""
    third, before_last, last = run[2], run[-2], run[-1]
    inner = run[2:-1]
    for name in members[third]:
        fact = facts[name]
        reduced[name] = dataclasses.replace(
            fact, weight=len(inner), folded_layers=tuple(inner) if fact.kind == "op" else ()
        )
    for layer in run[3:-1]:
        for name, kept in zip(members[layer], members[third]):
            stands_for[name] = kept
    counterpart = dict(zip(members[before_last], members[third]))
    for name in members[last]:
        fact = facts[name]
        if any(slot.name in counterpart for slot in fact.slots):
            slots = [facts[counterpart[slot.name]].node if slot.name in counterpart else slot for slot in fact.slots]
            reduced[name] = dataclasses.replace(fact, slots=slots)
