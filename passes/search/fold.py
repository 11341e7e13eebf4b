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
  groups of layers (a group: one layer, or a period of layers that differ, such as alternating
  sliding-window and global attention, or dense and expert MLPs) it keeps the first, the second,
  the third standing for the n − 3 inner ones after the second (:attr:`NodeFacts.weight`), and
  the last, which takes its inputs from the third. Group i + 1 reads group i's outputs as the
  third reads the second's, and inner strategies are alike, so every cost, memory and stage-cut
  sum over the reduced graph equals the sum over the whole one (stage cuts see the layers in
  execution order, :func:`layer_order`), and every per-node loop of the search stays the same
  size at any depth. A run whose inner groups read anything but the previous group and nodes
  outside layers, or feed anything but the next group, is kept whole (its inner layers still
  share variables).

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
    class_of = {layer: index for index, layers in enumerate(classes.values()) for layer in layers}
    variable = {name: name for name in facts}
    twin = {}  # identical nodes have the same candidates and costs where their local shapes agree
    for layers in classes.values():
        for layer in layers[1:]:
            twin.update(zip(members[layer], members[layers[0]]))
        for layer in layers[2:-1]:  # the first and the last keep their own (module docstring)
            for name, second in zip(members[layer], members[layers[1]]):
                variable[name] = second
    reduced, stands_for = dict(facts), {name: name for name in facts}
    in_layers = {name for nodes in members.values() for name in nodes}

    def reducible(run: list[tuple[str, ...]]) -> bool:
        return _reducible([_group(members, group) for group in run], in_layers, facts, users)

    for run in _runs(list(members), class_of, reducible):
        _reduce([_group(members, group) for group in run], facts, reduced, stands_for)
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


def _runs(order: list[str], class_of: dict[str, int], reducible) -> list[list[tuple[str, ...]]]:
    """Runs of at least :data:`REDUCED_RUN` identical groups of p consecutive layers (p = 1: a run
    of identical layers; p = 6: five sliding-window layers and a global one, repeated), found
    from the first layer on: at each layer, of the periods whose run ``reducible`` accepts, the
    one covering the most layers (the shortest of equals); none: the next layer."""
    kinds = [class_of[layer] for layer in order]
    runs, start = [], 0
    while start < len(order):
        found = []
        for period in range(1, (len(order) - start) // REDUCED_RUN + 1):
            pattern, count = kinds[start : start + period], 1
            while kinds[start + count * period : start + (count + 1) * period] == pattern:
                count += 1
            if count >= REDUCED_RUN:
                found.append((-count * period, period, count))
        for _, period, count in sorted(found):
            run = [tuple(order[start + i * period : start + (i + 1) * period]) for i in range(count)]
            if reducible(run):
                runs.append(run)
                start += count * period
                break
        else:
            start += 1
    return runs


def _group(members: dict[str, list[str]], layers: tuple[str, ...]) -> list[str]:
    return [name for layer in layers for name in members[layer]]


def _reducible(groups: list[list[str]], in_layers: set[str], facts, users) -> bool:
    """Whether the middle groups of a run read only the previous group and nodes outside
    layers, the same way in every group, and feed only themselves and the next group."""
    first = None
    for index in range(1, len(groups)):
        own, previous = groups[index], groups[index - 1]
        where = {name: ("self", k) for k, name in enumerate(own)} | {
            name: ("previous", k) for k, name in enumerate(previous)
        }
        refs = []
        for name in own:
            for slot in facts[name].slots:
                if slot.name in where:
                    refs.append(where[slot.name])
                elif slot.name in in_layers:
                    return False  # reads a layer further back
                else:
                    refs.append(("outside", slot.name))
        if first is None:
            first = refs
        elif refs != first:
            return False
        if index < len(groups) - 1:
            allowed = set(own) | set(groups[index + 1])
            if any(user not in allowed for name in own for user in users[name]):
                return False
    return True


def _reduce(groups: list[list[str]], facts, reduced: dict, stands_for: dict) -> None:
    """Keep the first, second, third and last group of the run; the third stands for the inner
    groups after the second, each of its layers for the same layer of every inner group."""
    third, before_last, last = groups[2], groups[-2], groups[-1]
    inner = groups[2:-1]
    for k, name in enumerate(third):
        fact = facts[name]
        layers = tuple(facts[group[k]].layer for group in inner) if fact.kind == "op" else ()
        reduced[name] = dataclasses.replace(fact, weight=len(inner), folded_layers=layers)
    for group in groups[3:-1]:
        stands_for.update(zip(group, third))
    counterpart = dict(zip(before_last, third))
    for name in last:
        fact = facts[name]
        if any(slot.name in counterpart for slot in fact.slots):
            slots = [facts[counterpart[slot.name]].node if slot.name in counterpart else slot for slot in fact.slots]
            reduced[name] = dataclasses.replace(fact, slots=slots)


def layer_order(facts: dict[str, NodeFacts]) -> list[tuple[str, str]]:
    """Every layer of the whole graph in execution order, each with the layer of ``facts`` (a
    reduced graph's) that stands for it: a folded group's layers stand for the inner groups,
    which run one after another, so their rows interleave (stage cuts need execution order)."""
    layers: dict[str, tuple[str, ...]] = {}
    for fact in facts.values():
        if fact.kind == "op" and fact.layer is not None and fact.layer not in layers:
            layers[fact.layer] = fact.folded_layers
    out, group = [], []
    for layer in [*layers, None]:
        if layer is not None and layers[layer]:
            group.append(layer)
            continue
        if group:  # the inner groups, one after another
            out += [
                pair
                for copies in zip(*([(whole, kept) for whole in layers[kept]] for kept in group))
                for pair in copies
            ]
            group = []
        if layer is not None:
            out.append((layer, layer))
    return out
