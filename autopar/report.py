"""What ``autopar plan`` and ``autopar explain`` print: per-module decisions and the summary.

Rows are plain dicts (the ``--json`` output); the ``*_text`` functions render them as tables.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from tabulate import tabulate

from autopar.ir import KERNEL_DIMS, Plan, PrecisionPolicy, Shard, module_label
from autopar.ir.names import fold_rows, folded_note
from autopar.passes.capture.graph import module_path
from autopar.passes.rewrite.export import collective_calls, placeholders


def module_rows(captured, plan: Plan, program) -> list[dict]:
    """Per module path (graph order): its weights' placements, its output's placement, the
    collectives the rewrite put there, their bytes, its parameters' bytes per device."""
    rows: dict[str, dict] = {}
    user_index = {node: index for index, node in enumerate(captured.graph.nodes)}

    def row(path: str) -> dict:
        return rows.setdefault(
            path,
            {
                "module": path,
                "params": {},
                "output": None,
                "collectives": Counter(),
                "collective_bytes": 0,
                "param_bytes": 0,
                "grad_sum": set(),
            },
        )

    local = {p.label: p for p in placeholders(program, plan) if p.kind == "param"}
    first_seen: dict[str, int] = {}  # module path → index of its first op (params count at their first use)
    for index, node in enumerate(captured.graph.nodes):
        path = module_path(node) if node.name in plan.nodes else None
        if node.name in captured.params:
            path = captured.params[node.name].rpartition(".")[0]
            index = min((user_index[u] for u in node.users), default=index)
        if path is not None:
            parts = path.split(".") if path else []
            for depth in range(len(parts) + 1):
                prefix = ".".join(parts[:depth])
                first_seen[prefix] = min(first_seen.get(prefix, index), index)
    for node in captured.graph.nodes:
        if node.name in captured.params:
            fqn = captured.params[node.name]
            path, _, short = fqn.rpartition(".")
            entry = row(path)
            entry["params"][short] = _placement(plan.params[fqn])
            val = node.meta.get("val")
            if fqn in local and isinstance(val, torch.Tensor):
                entry["param_bytes"] += _numel(local[fqn].local_shape) * val.element_size()
            entry["grad_sum"].update(plan.grad_sync.get(fqn, ()))
        elif node.name in plan.nodes:
            decision = plan.nodes[node.name]
            entry = row(module_path(node))
            if decision.output is not None:
                entry["output"] = _placement(decision.output)
    for call in collective_calls(program, plan):
        entry = row(call.module)
        entry["collectives"][f"{call.op}/{call.axis}"] += 1
        entry["collective_bytes"] += call.nbytes

    def order(path: str) -> tuple:  # a parent before its children, siblings in execution order
        parts = path.split(".") if path else []
        return tuple(first_seen.get(".".join(parts[: depth + 1]), len(user_index)) for depth in range(len(parts)))

    return [
        {
            **entry,
            "collectives": dict(entry["collectives"]),
            "grad_sum": sorted(entry["grad_sum"], key=list(plan.degrees).index),
        }
        for entry in sorted(rows.values(), key=lambda entry: order(entry["module"]))
    ]


def _numel(shape) -> int:
    result = 1
    for size in shape or ():
        result *= size
    return result


def _placement(placements) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def degrees_text(degrees: dict) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in degrees.items())


def summary(plan: Plan) -> dict:
    """The plan's headline numbers as plain data (the ``summary`` of ``plan --json``)."""
    cost = plan.cost
    return {
        "mesh": str(plan.mesh),
        "hardware": plan.hardware,
        "precision": str(plan.precision),
        "batch_size": plan.batch_size,
        "step_s": cost.step_s,
        "compute_s": cost.compute_s,
        "comm_s": cost.comm_s,
        "grad_sync_s": cost.grad_sync_s,
        "optimizer_s": cost.optimizer_s,
        "pipeline_s": cost.pipeline_s,
        "model_tflops_per_device": cost.model_flops_per_s / 1e12,
        "zero": plan.zero,
        "schedule": {**dataclasses.asdict(plan.schedule), "cuts": list(plan.schedule.cuts)},
        "peak_memory": cost.peak_memory,
        "memory": dict(cost.memory),
        "search_time_s": plan.search_time_s,
    }


def summary_text(plan: Plan) -> str:
    cost = plan.cost
    memory = ", ".join(f"{category} {_size(value)}" for category, value in cost.memory.items())
    zero = f", ZeRO-{plan.zero}" if plan.zero else ""
    return "\n".join(
        [
            f"degrees: {degrees_text(plan.degrees)}{zero} on mesh {plan.mesh} ({plan.hardware}), global batch "
            f"{plan.batch_size}",
            f"precision: {precision_text(plan.precision)}",
            f"predicted step time: {cost.step_s * 1e3:.2f} ms = compute {cost.compute_s * 1e3:.2f} ms"
            f" + exposed communication {cost.comm_s * 1e3:.2f} ms + exposed gradient sync {cost.grad_sync_s * 1e3:.2f} "
            "ms"
            f" + optimizer {cost.optimizer_s * 1e3:.2f} ms + pipeline bubble {cost.pipeline_s * 1e3:.2f} ms"
            f"; model {cost.model_flops_per_s / 1e12:.2f} TFLOP/s per device",
            f"schedule: {plan.schedule.stages} pipeline stage(s), {plan.schedule.microbatches} microbatch(es), "
            f"recompute {plan.schedule.recompute}"
            + (f", {plan.schedule.kind} x {plan.schedule.virtual} virtual" if plan.schedule.stages > 1 else "")
            + (", compiled" if plan.schedule.compiled else "")
            + (" with async tensor parallelism" if plan.schedule.async_tp else "")
            + (", gathered inputs kept as shards and gathered again in backward" if plan.schedule.regather else ""),
            f"peak memory per device: {_size(cost.peak_memory)} (gradients replace activations during backward: "
            f"the larger of the two counts); by category: {memory}",
            search_text(plan),
            "ops run replicated (no sharding rule): " + (", ".join(plan.replicated_ops) or "none"),
        ]
    )


SEARCH_ROWS = 12  # configurations the search table shows: the chosen one and the fastest others


def precision_text(precision: str) -> str:
    """``bf16-mixed`` → what it means for the step: compute copies, gradient reduction, state."""
    policy = PrecisionPolicy.of(precision)
    if not policy.mixed:
        return f"{policy.precision} (weights, gradients and optimizer state in float32)"
    scaling = ", dynamic loss scaling" if policy.loss_scaling else ""
    return (
        f"{policy.precision} ({policy.param_dtype} compute copies, gradients reduced in {policy.reduce_dtype}, "
        f"float32 master weights and optimizer state{scaling})"
    )


def search_text(plan: Plan) -> str:
    """How many configurations the search weighed, tried and pruned (by rule), and the fastest tried."""
    tried = [entry for entry in plan.search if "pruned" not in entry]
    pruned = Counter(entry["pruned"] for entry in plan.search if "pruned" in entry)

    def chosen(entry: dict) -> bool:
        same = (entry["degrees"], entry.get("zero", 0), entry.get("stages", 1))
        return same == (plan.degrees, plan.zero, plan.schedule.stages)

    shown = sorted(tried, key=lambda e: (not chosen(e), not e["feasible"], e["step_s"]))[:SEARCH_ROWS]
    rows = [
        [
            entry.get("stages", 1),
            degrees_text(entry["degrees"]),
            entry.get("zero", 0),
            _schedule_text(entry["schedule"]),
            f"{entry['step_s'] * 1e3:.2f} ms",
            _size(entry["peak_memory"]),
            "yes" if entry["feasible"] else "no",
            "<- chosen" if chosen(entry) else "",
        ]
        for entry in sorted(shown, key=lambda e: (not e["feasible"], e["step_s"]))
    ]
    table = tabulate(rows, headers=["pp", "degrees", "ZeRO", "schedule", "predicted step", "peak memory", "fits", ""])
    plural = "s" if len(plan.search) != 1 else ""
    head = f"search: {len(plan.search)} configuration{plural} in {plan.search_time_s:.2f} s"
    if pruned:
        rules = ", ".join(f"{count} by {rule}" for rule, count in sorted(pruned.items()))
        head += f": {len(tried)} tried, {sum(pruned.values())} pruned ({rules})"
    if len(tried) > len(shown):
        head += f"; the {len(shown)} fastest tried"
    return f"{head}\n{table}"


def _schedule_text(schedule: dict) -> str:
    saving = schedule["recompute"] + (", regather" if schedule.get("regather") else "")
    if schedule["stages"] == 1:
        return f"m={schedule['microbatches']}, {saving}"
    virtual = f" x{schedule['virtual']}" if schedule["virtual"] > 1 else ""
    return f"{schedule['kind']}{virtual}, m={schedule['microbatches']}, {saving}"


def modules_text(rows: list[dict]) -> str:
    """The module table; identical layers are shown once (:func:`fold_rows`)."""
    rows = fold_rows(rows)
    table = [
        [
            module_label(row["module"]),
            "; ".join(f"{name} {placement}" for name, placement in row["params"].items()) or "-",
            row["output"] or "-",
            ", ".join(f"{name} x{count}" for name, count in row["collectives"].items()) or "-",
            _size(row["collective_bytes"]) if row["collective_bytes"] else "-",
            _size(row["param_bytes"]) if row["param_bytes"] else "-",
            "+".join(row["grad_sum"]) or "-",
        ]
        for row in rows
    ]
    headers = ["module", "weights", "output", "collectives (op/axis)", "collective bytes", "params/device", "grad sum"]
    note = (
        "collective bytes: the local size of each collective's input tensor on one rank, summed over the forward\n"
        "graph (backward runs each collective's dual on a gradient of the same size); grad sum: axes the runtime\n"
        "all-reduces the module's parameter gradients over after backward (not counted in collective bytes)."
    )
    folded = folded_note([row["module"] for row in rows], "--json lists")
    note += f"\n{folded}" if folded else ""
    return tabulate(table, headers=headers) + "\n" + note


# -- commands ----------------------------------------------------------------------------


def decisions_text(plan: Plan) -> str:
    """Each node's op and placements, by module; identical layers once (the plan file lists every node)."""
    groups: dict[str, list] = {}  # by module, in the order modules first appear
    for name, decision in plan.nodes.items():
        groups.setdefault(decision.module, []).append((name, decision))
    rows = [
        {
            "module": module,
            "node": name,
            "op": f"{decision.op} [{decision.kernel} over {KERNEL_DIMS[decision.kernel]}]"
            if decision.kernel
            else decision.op,
            "inputs": ", ".join(_placement(p) if p is not None else "-" for p in decision.inputs),
            "output": _placement(decision.output) if decision.output is not None else "-",
            "comm": _size(decision.comm_bytes) if decision.comm_bytes else "",
        }
        for module, members in groups.items()
        for name, decision in members
    ]
    rows = fold_rows(rows, ignore=("node",))
    table = []
    for k, row in enumerate(rows):
        first = k == 0 or row["module"] != rows[k - 1]["module"]  # a module's name on its first row alone
        table.append([module_label(row["module"]) if first else "", *list(row.values())[1:]])
    folded = folded_note([row["module"] for row in rows], "the plan file lists")
    axes = ", ".join(plan.degrees)
    return (
        f"node decisions by module (placements over {axes}):\n"
        + tabulate(table, headers=["module", "node", "op", "inputs", "output", "comm"])
        + (f"\n{folded} Node names are the first layer's." if folded else "")
    )


def stage_rows(captured, plan: Plan) -> list[dict]:
    """Per pipeline stage module: its layers, the device (pipeline rank) and mesh ranks that run
    it, and its parameters' bytes per device (ops outside layers go with the first or last)."""
    from autopar.passes.capture.graph import node_layer
    from autopar.passes.rewrite.stages import layer_stages

    schedule = plan.schedule
    layers = list(
        dict.fromkeys(layer for n in captured.graph.nodes if n.op == "call_function" and (layer := node_layer(n)))
    )
    by_layer = layer_stages(layers, schedule)
    param_bytes = [0.0] * schedule.modules
    for placeholder, name in captured.params.items():
        node = next(n for n in captured.graph.nodes if n.name == placeholder)
        users = [node_layer(u) for u in node.users]
        layer = next((u for u in users if u is not None), None)
        first_layer_op = next(i for i, n in enumerate(captured.graph.nodes) if node_layer(n) is not None)
        before = min((list(captured.graph.nodes).index(u) for u in node.users), default=0) < first_layer_op
        module = by_layer[layer] if layer else (0 if before else schedule.modules - 1)
        shards = 1
        for placement, size in zip(plan.params[name], plan.degrees.values()):
            shards *= size if isinstance(placement, Shard) else 1
        param_bytes[module] += _numel(node.meta["val"].shape) * node.meta["val"].element_size() / shards
    per_stage = plan.mesh.size // schedule.stages
    rows = []
    for module in range(schedule.modules):
        own = [layer for layer, k in by_layer.items() if k == module]
        device = schedule.device_of(module)
        rows.append(
            {
                "module": module,
                "layers": f"{own[0]}..{own[-1]}" if len(own) > 1 else own[0],
                "layer_count": len(own),
                "device": device,
                "ranks": f"{device * per_stage}-{(device + 1) * per_stage - 1}",
                "param_bytes": param_bytes[module],
            }
        )
    return rows


def stages_text(rows: list[dict], plan: Plan) -> str:
    table = [
        [r["module"], r["layers"], r["layer_count"], r["device"], r["ranks"], _size(r["param_bytes"])] for r in rows
    ]
    headers = ["stage module", "layers", "#", "pipeline device", "mesh ranks", "params/device"]
    return f"pipeline: {plan.schedule}; peak memory of the busiest device {_size(plan.cost.peak_memory)}\n" + tabulate(
        table, headers=headers
    )
