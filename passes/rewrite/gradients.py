"""Where gradients are partial sums over a mesh axis, and where they must be completed.

On one axis, a gradient flowing into a tensor is *partial* (each rank holds a share of
the sum) when it comes from an op that splits its work over the axis while taking the
tensor replicated (Megatron's f), or from a replicated op whose own gradient is partial:
backprop is linear, so partial sums stay partial through a replicated region. A tensor
whose gradient contributions are all partial passes that on upstream; its parameters are
summed by the runtime's bucketed gradient sync. A tensor with mixed contributions needs
its partial ones all-reduced where they arise, on the edge. Edges that redistribute the
tensor on the axis complete the gradient there (the rewrite fuses it into the collective).

Pre: a plan's placements for every node and parameter. Post: :class:`GradientPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.ir import Plan, Replicate
from autopar.passes.sharding.strategies import tensor_inputs

R = Replicate()


@dataclass(frozen=True)
class GradientPlan:
    synced_params: dict[str, tuple[str, ...]]  # parameter placeholder → axes the runtime sums over
    completed_edges: frozenset[tuple[str, int, str]]  # (consumer node, input slot, axis) to all-reduce


def plan_gradients(graph: fx.Graph, plan: Plan, params: dict[str, str], user_inputs: tuple[str, ...]) -> GradientPlan:
    """Classify every gradient on every axis (see the module docstring)."""
    axes = [axis for axis in plan.degrees if plan.degrees[axis] > 1]
    placement = _placements(graph, plan, params, user_inputs)
    needs_grad = _needs_grad(graph, params)
    synced: dict[str, list[str]] = {}
    completed: set[tuple[str, int, str]] = set()
    for index, axis in enumerate(plan.degrees):
        if axis not in axes:
            continue
        partial: dict[str, bool] = {}
        for node in reversed(graph.nodes):
            if node.name not in needs_grad:
                continue
            contributions = []  # (consumer, slot, whether the gradient it sends back is partial)
            for user in node.users:
                decision = plan.nodes.get(user.name)
                if decision is None or decision.output is None:
                    continue
                for slot, (source, wanted) in enumerate(zip(tensor_inputs(user), decision.inputs)):
                    if source is not node:
                        continue
                    is_partial = wanted[index] == R and (decision.output[index] != R or partial.get(user.name, False))
                    if placement[node.name][index] != R or wanted[index] != R:
                        # Redistributed on this edge: its collective's dual completes the gradient.
                        if is_partial:
                            completed.add((user.name, slot, axis))
                        contributions.append((user.name, slot, False))
                    else:
                        contributions.append((user.name, slot, is_partial))
            flags = [c[2] for c in contributions]
            partial[node.name] = bool(flags) and all(flags)
            if any(flags) and not all(flags):
                completed.update((user, slot, axis) for user, slot, is_partial in contributions if is_partial)
            if partial[node.name] and node.name in params:
                synced.setdefault(node.name, []).append(axis)
    return GradientPlan({name: tuple(a) for name, a in synced.items()}, frozenset(completed))


def _placements(graph, plan: Plan, params, user_inputs) -> dict[str, tuple]:
    replicated = tuple(R for _ in plan.degrees)
    result = {}
    for node in graph.nodes:
        if node.name in params:
            result[node.name] = plan.params[params[node.name]]
        elif node.name in user_inputs:
            result[node.name] = plan.inputs[node.name]
        elif node.name in plan.nodes and plan.nodes[node.name].output is not None:
            result[node.name] = plan.nodes[node.name].output
        else:
            result[node.name] = replicated
    return result


def _needs_grad(graph: fx.Graph, params) -> set[str]:
    """Nodes a gradient flows through: downstream of a parameter, with a floating output."""
    names = set(params)
    for node in graph.nodes:
        if node.op == "call_function" and any(s.name in names for s in tensor_inputs(node)):
            val = node.meta.get("val")
            values = val if isinstance(val, (tuple, list)) else [val]
            if any(getattr(v, "dtype", None) is not None and v.dtype.is_floating_point for v in values):
                names.add(node.name)
    return names
