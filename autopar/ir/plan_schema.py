"""The schema of a plan file: what ``Plan.from_json`` accepts, checked field by field.

A plan file edited by hand into nonsense must fail with the field at fault, not as a
``KeyError`` deep inside the rewrite. :func:`check_plan_json` checks types, ranges and the
plan's own consistency (degrees times stages make the mesh; one placement per degree; gradient
sums over planned dimensions). What needs the model (a placement's dim against a parameter's
shape) is checked where the model is known, by ``autopar.passes.rewrite.rewrite.check_plan``.
"""

from __future__ import annotations

import math
from numbers import Real

from autopar.ir.errors import AutoparError, InvalidPlanError
from autopar.ir.names import Axis, Kernel, PipelineKind, Precision, Recompute
from autopar.ir.placement import Partial, parse_placement

LIST = (list, tuple)  # JSON arrays; tuples where a plan's to_json() is read back without a file
FIELDS = {
    "mesh": dict,
    "degrees": dict,
    "nodes": dict,
    "params": dict,
    "grad_sync": dict,
    "inputs": dict,
    "cost": dict,
    "fingerprint": str,
    "hardware": str,
    "batch_size": int,
    "search": LIST,
    "search_time_s": Real,
    "replicated_ops": LIST,
    "zero": int,
    "schedule": dict,
    "precision": str,
    "reduce_dtype": str,
    "format": int,
}
NODE_FIELDS = {
    "op": str,
    "module": str,
    "inputs": LIST,
    "output": (*LIST, type(None)),
    "comm_bytes": Real,
    "kernel": str,
}
COST_FIELDS = {
    "compute_s": Real,
    "comm_s": Real,
    "grad_sync_s": Real,
    "memory": dict,
    "optimizer_s": Real,
    "pipeline_s": Real,
    "model_flops": Real,
}
SCHEDULE_FIELDS = {
    "stages": int,
    "microbatches": int,
    "recompute": str,
    "kind": str,
    "virtual": int,
    "cuts": LIST,
    "compiled": bool,
    "async_tp": bool,
    "regather": bool,
}


def check_plan_json(data) -> None:
    """Raise :class:`InvalidPlanError` naming the first field of ``data`` (a plan's JSON) that no
    plan could hold; return None when every field is well formed.

    >>> check_plan_json({**plan.to_json(), "zero": 7})   # doctest: +SKIP
    InvalidPlanError: field 'zero': 7 is not a ZeRO stage (0, 1, 2 or 3)
    """
    _fields({"reduce_dtype": "float32", **data} if isinstance(data, dict) else data, FIELDS, "")  # older: fp32
    mesh = data["mesh"]
    _fields(mesh, {"shape": LIST, "device_type": str}, "mesh")
    for i, size in enumerate(mesh["shape"]):
        _expect(_positive(size), f"mesh.shape[{i}]", size, "a positive integer")
    degrees = data["degrees"]
    for axis, size in degrees.items():
        _expect(axis in set(Axis) - {Axis.PP}, f"degrees.{axis}", axis, f"a parallel dimension {_words(Axis)}")
        _expect(_positive(size), f"degrees.{axis}", size, "a positive integer")
    schedule = data["schedule"]
    _fields({"async_tp": False, "regather": False, **schedule}, SCHEDULE_FIELDS, "schedule")  # older files
    for name in ("stages", "microbatches", "virtual"):
        _expect(_positive(schedule[name]), f"schedule.{name}", schedule[name], "a positive integer")
    _expect(schedule["recompute"] in set(Recompute), "schedule.recompute", schedule["recompute"], _words(Recompute))
    _expect(schedule["kind"] in set(PipelineKind), "schedule.kind", schedule["kind"], _words(PipelineKind))
    devices = math.prod(degrees.values()) * schedule["stages"]
    _expect(
        devices == math.prod(mesh["shape"]),
        "degrees",
        degrees,
        f"sizes whose product times {schedule['stages']} stage(s) is the mesh's {math.prod(mesh['shape'])} devices",
    )
    axes = len(degrees)
    for name, node in data["nodes"].items():
        where = f"nodes.{name}"
        _fields(node, NODE_FIELDS, where)
        for i, placements in enumerate(node["inputs"]):
            if placements is not None:
                _placements(placements, axes, f"{where}.inputs[{i}]")
        if node["output"] is not None:
            _placements(node["output"], axes, f"{where}.output")
        _expect(node["kernel"] in {"", *Kernel}, f"{where}.kernel", node["kernel"], f'"" or {_words(Kernel)}')
    for name, placements in data["params"].items():
        parsed = _placements(placements, axes, f"params.{name}")
        for i, placement in enumerate(parsed):
            _expect(not isinstance(placement, Partial), f"params.{name}[{i}]", str(placement), "S(d) or R")
    for name, summed in data["grad_sync"].items():
        _expect(name in data["params"], f"grad_sync.{name}", name, "a parameter listed under params")
        _expect(isinstance(summed, LIST) and set(summed) <= set(degrees), f"grad_sync.{name}", summed, "planned dims")
    for name, placements in data["inputs"].items():
        _placements(placements, axes, f"inputs.{name}")
    _fields(data["cost"], COST_FIELDS, "cost")
    _expect(_positive(data["batch_size"]), "batch_size", data["batch_size"], "a positive integer")
    _expect(data["zero"] in (0, 1, 2, 3), "zero", data["zero"], "a ZeRO stage (0, 1, 2 or 3)")
    _expect(data["precision"] in set(Precision), "precision", data["precision"], _words(Precision))


def _fields(value, fields: dict, where: str) -> None:
    _expect(isinstance(value, dict), where or "the file", type(value).__name__, "a JSON object")
    prefix = f"{where}." if where else ""
    missing = [name for name in fields if name not in value]
    unknown = [name for name in value if name not in fields]
    if missing or unknown:
        raise InvalidPlanError(
            f"field {where or 'the plan'!r}: "
            + "; ".join(
                part
                for part in (
                    missing and f"missing {', '.join(prefix + m for m in missing)}",
                    unknown and f"unknown {', '.join(prefix + u for u in unknown)}",
                )
                if part
            )
            + ". Restore the field names autopar wrote, or re-run autopar.plan"
        )
    for name, kind in fields.items():
        ok = isinstance(value[name], kind) and not (kind in (int, Real) and isinstance(value[name], bool))
        _expect(ok, prefix + name, value[name], _kind_name(kind))


def _placements(value, axes: int, where: str):
    _expect(
        isinstance(value, LIST) and len(value) == axes, where, value, f"a list of {axes} placements, one per degree"
    )
    parsed = []
    for i, text in enumerate(value):
        try:
            parsed.append(parse_placement(text))
        except (AutoparError, AttributeError):  # not a placement's text, or no text at all
            _expect(False, f"{where}[{i}]", text, "a placement: S(dim), R, P or P(avg)")
    return parsed


def _expect(condition: bool, field: str, value, wanted: str) -> None:
    if not condition:
        raise InvalidPlanError(
            f"field {field!r} is {value!r}, which is not {wanted}: fix it (or re-run autopar.plan and save again)"
        )


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _words(enum) -> str:
    return "one of " + ", ".join(str(member) for member in enum)


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        dict: "a JSON object",
        list: "a list",
        tuple: "a list",
        str: "a string",
        int: "an integer",
        Real: "a number",
    }
    return " or ".join(dict.fromkeys(names.get(k, "null") for k in kinds))
