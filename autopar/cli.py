"""The ``autopar`` command: plan, explain, export and run from a shell.

The only module that reads argv (and, through ``launch_local``, hands the environment on).
Exit codes: 0 done; 1 autopar refused (an :class:`AutoparError`, printed as ``error: ...``);
2 the command line was wrong (bad option, MODEL or file).

    autopar plan gpt --mesh 2x2 --batch 8
    autopar plan 'examples/gpt.py:build(hidden=4096, layers=32)' --mesh 2x4 --hardware h100-80gb --json
    autopar explain plan.json
    autopar export gpt --mesh 2x2 --degrees tp=4 --out exported/
    autopar run train.py --nproc 4 -- --steps 10
    autopar calibrate --quick      # measure this machine; plan/export then use the profile
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from autopar.api import _capture, _plan_captured
from autopar.ir import KERNEL_DIMS, PIPELINES, RECOMPUTE, AutoparError, Mesh, MeshError, Plan, get_profile, parse_placement
from autopar.passes.export import write_export
from autopar.passes.symbolic import symbolic_cost
from autopar.report import (
    decisions_text, degrees_text, module_rows, modules_text, search_text, stage_rows, stages_text, summary, summary_text,
)
from autopar.timeline import timeline_svg, timeline_text
from autopar.passes.rewrite import rewrite

REPO_ROOT = Path(__file__).resolve().parents[1]  # where examples/ lives in a source checkout
DEFAULT_FACTORY = "build"
BATCH_PER_DEVICE = 2
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
USAGE_ERROR = 2


class UsageError(Exception):
    """The command line is wrong: exit 2 with this message."""


def main(argv: list[str] | None = None) -> int:
    """Run the ``autopar`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    >>> main(["plan", "gpt", "--mesh", "2x2", "--batch", "8"])   # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if argv[:1] == ["run"] and "--" in argv:  # everything after "--" belongs to the script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse has printed usage and the error (or --help)
        return stop.code if isinstance(stop.code, int) else USAGE_ERROR
    args.script_args = script_args
    try:
        with warnings.catch_warnings():
            # torch.export's own deprecation noise, not something a user can act on
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            return args.handler(args)
    except UsageError as error:
        print(f"autopar {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except AutoparError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


# -- argument parsing ------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="plan MODEL on a mesh and print the decisions")
    _planning_options(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--save", metavar="PLAN.json", help="also save the plan (for `explain`, `parallelize(plan=...)`)")
    plan.add_argument("--timeline", metavar="FILE.svg", help="also draw the pipeline schedule's timeline as an SVG file")
    plan.add_argument("--at", type=_sizes, metavar="batch=N,seq=N", help="also predict the plan at another global batch and/or sequence (no new search)")
    plan.set_defaults(handler=_cmd_plan)

    explain = commands.add_parser("explain", help="print a saved plan; needs no model")
    explain.add_argument("plan_file", metavar="PLAN.json")
    explain.set_defaults(handler=_cmd_explain)

    export = commands.add_parser("export", help="plan MODEL and write each rank's program, plan.json, graph.dot")
    _planning_options(export)
    export.add_argument("--out", required=True, metavar="DIR", help="folder to write into (created)")
    export.set_defaults(handler=_cmd_export)

    run = commands.add_parser(
        "run",
        help="run SCRIPT as N local ranks, as torchrun would",
        usage="autopar run SCRIPT --nproc N [--timeout S] [-- SCRIPT_ARGS ...]",
    )
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("--nproc", type=_positive_int, required=True, metavar="N")
    run.add_argument("--timeout", type=float, default=None, metavar="S", help="terminate all ranks after S seconds (exit 124)")
    run.set_defaults(handler=_cmd_run)

    calibrate = commands.add_parser("calibrate", help="measure this machine and write a hardware profile that plan/export use")
    calibrate.add_argument("--quick", action="store_true", help="fewer sizes and repeats, 2 ranks only (~10 s instead of ~30 s)")
    calibrate.add_argument("--ranks", type=_ranks, default=(2, 4), metavar="2,4", help="group sizes to measure collectives over")
    calibrate.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo",
        help="gloo: this machine's CPU processes (default); nccl: its GPUs, one per rank (pass the profile to plan with --hardware)",
    )
    calibrate.add_argument(
        "--out", type=Path, metavar="PATH",
        help=f"where to write the profile (default {_tilde(default_profile_path())}; with nccl {_tilde(default_profile_path('nccl'))})",
    )
    calibrate.set_defaults(handler=_cmd_calibrate)
    return parser


def _planning_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="FILE.py[:FACTORY(k=v, ...)] or an example name (gpt, mlp, hf:build_llama(layers=2)); "
        f"the factory defaults to {DEFAULT_FACTORY}()",
    )
    parser.add_argument("--mesh", type=_mesh, required=True, help="device mesh, outermost first, e.g. 2x4")
    parser.add_argument("--batch", type=_positive_int, help=f"global batch size (default: {BATCH_PER_DEVICE} per device)")
    parser.add_argument("--degrees", type=_degrees, help="pin parallel sizes, e.g. dp=2,tp=4")
    parser.add_argument(
        "--constraint",
        type=_constraint,
        action="append",
        default=[],
        metavar="PATTERN=PLACEMENT",
        help="pin a parameter or module (fnmatch pattern) on the tp axis, e.g. 'layers.*.mlp.fc1=S(-1)', or a "
        f"module's parallel kernel ({', '.join(KERNEL_DIMS)}), e.g. 'layers.*.attn=ring'; repeatable",
    )
    parser.add_argument(
        "--hardware",
        help=f"hardware profile name or .json file (default: {_tilde(default_profile_path())} "
        "if `autopar calibrate` wrote it, else cpu-local)",
    )
    parser.add_argument("--memory-limit", type=parse_bytes, metavar="BYTES", help="per-device memory, e.g. 8GiB, 512MiB, 1e9")
    parser.add_argument(
        "--zero", type=int, choices=(0, 1, 2, 3), help="pin the ZeRO stage over the dp axis (default: the lowest that fits)"
    )
    parser.add_argument("--recompute", choices=RECOMPUTE, help="pin activation recomputation (default: the least that fits)")
    parser.add_argument("--microbatches", type=_positive_int, help="pieces each rank's batch runs in (default: searched with pipelines)")
    parser.add_argument("--pipeline", choices=PIPELINES, help="pin the pipeline schedule (default: searched)")
    parser.add_argument(
        "--stage-cuts", type=lambda text: [cut.strip() for cut in text.split(",")], metavar="LAYER,...",
        help="pin the layers that start each pipeline stage module after the first, e.g. layers.6 (default: balanced)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _ranks(text: str) -> tuple[int, ...]:
    sizes = tuple(_positive_int(item) for item in text.split(","))
    if min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a collective needs groups of at least 2 ranks, e.g. 2,4")
    return sizes


def _sizes(text: str) -> dict[str, int]:
    pairs = [item.partition("=") for item in text.split(",")]
    if not all(key.strip() in ("batch", "seq") and value.strip().isdigit() and int(value) > 0 for key, _, value in pairs):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: write batch=N and/or seq=N joined by a comma, e.g. batch=2048,seq=4096")
    return {key.strip(): int(value) for key, _, value in pairs}


def _mesh(text: str) -> Mesh:
    try:
        return Mesh.parse(text)
    except MeshError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _degrees(text: str) -> dict[str, int]:
    degrees = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"cannot read {item!r}: write dim=size pairs joined by commas, e.g. dp=2,tp=4")
        degrees[name.strip()] = int(size)
    return degrees


def _constraint(text: str) -> tuple[str, str]:
    pattern, _, placement = text.partition("=")
    if not pattern or not placement:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: write PATTERN=PLACEMENT, e.g. 'layers.*.mlp.fc1=S(-1)'")
    if placement.strip() in KERNEL_DIMS:  # a parallel kernel, e.g. 'layers.*.attn=ring'
        return pattern.strip(), placement.strip()
    try:
        parse_placement(placement)
    except AutoparError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return pattern.strip(), placement.strip()


def parse_bytes(text: str) -> float:
    """Read a byte count: ``"8GiB"``, ``"512MiB"``, ``"1e9"``, ``"80GB"``.

    >>> parse_bytes("512MiB")
    536870912.0
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as bytes: write e.g. 8GiB, 512MiB, 80GB or 1e9")
    return float(match.group(1)) * UNITS[unit]


def default_profile_path(backend: str = "gloo") -> Path:
    """Where ``autopar calibrate`` writes and plan/export look for this machine's profile
    (a GPU profile is only written there: plan takes it with ``--hardware``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "autopar" / "profiles" / ("gpu-calibrated.json" if backend == "nccl" else "cpu-local-calibrated.json")


def _tilde(path: Path) -> str:
    home = str(Path.home())
    return "~" + str(path)[len(home) :] if str(path).startswith(home + os.sep) else str(path)


# -- MODEL -----------------------------------------------------------------------------


def load_model(spec: str) -> torch.nn.Module:
    """Build MODEL on the meta device: ``FILE.py[:FACTORY(k=v, ...)]`` or an example name.

    >>> load_model("examples/gpt.py:build(hidden=64, layers=1)")   # doctest: +SKIP
    GPT(...)
    """
    location, factory_name, args, kwargs = _parse_model(spec)
    path = _resolve_model_file(location, spec)
    module_name = "autopar_model_" + re.sub(r"\W", "_", path.stem)
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # the user's file: any failure is a bad MODEL
        raise UsageError(f"MODEL {spec!r}: importing {path} failed: {type(error).__name__}: {error}") from error
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        available = sorted(name for name, value in vars(module).items() if callable(value) and name.startswith("build"))
        raise UsageError(f"MODEL {spec!r}: {path} has no function {factory_name!r}; it has {available or 'no build*'}")
    try:
        with torch.device("meta"):
            model = factory(*args, **kwargs)
    except Exception as error:  # the user's factory: any failure is a bad MODEL
        raise UsageError(f"MODEL {spec!r}: {factory_name}(...) raised {type(error).__name__}: {error}") from error
    if not callable(getattr(model, "example_inputs", None)):
        raise UsageError(
            f"MODEL {spec!r}: {factory_name}() returned a {type(model).__name__} without "
            "example_inputs(batch_size, device=None), which autopar needs to trace it"
        )
    return model


def _parse_model(spec: str) -> tuple[str, str, list, dict]:
    paren = spec.find("(")
    colon = spec.rfind(":", 0, paren if paren >= 0 else len(spec))
    location, call = (spec[:colon], spec[colon + 1 :]) if colon >= 0 else (spec, DEFAULT_FACTORY)
    if not location.strip() or "(" in location:
        raise UsageError(f"MODEL {spec!r}: write FILE.py[:FACTORY(k=v, ...)] or an example name such as gpt")
    try:
        tree = ast.parse(call.strip(), mode="eval").body
    except SyntaxError:
        raise UsageError(f"MODEL {spec!r}: cannot read the factory call {call!r}; write e.g. build(hidden=64, layers=2)") from None
    if isinstance(tree, ast.Name):
        return location.strip(), tree.id, [], {}
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise UsageError(f"MODEL {spec!r}: the factory must be a function name or a call such as build(layers=2)")
    try:
        args = [ast.literal_eval(arg) for arg in tree.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords if kw.arg is not None}
    except ValueError:
        raise UsageError(f"MODEL {spec!r}: factory arguments must be Python literals (numbers, strings, ...)") from None
    if any(kw.arg is None for kw in tree.keywords):
        raise UsageError(f"MODEL {spec!r}: **kwargs is not supported; name each argument")
    return location.strip(), tree.func.id, args, kwargs


def _resolve_model_file(location: str, spec: str) -> Path:
    is_path = location.endswith(".py") or "/" in location or "\\" in location
    relative = Path(location) if is_path else Path("examples") / f"{location}.py"
    candidates = [Path.cwd() / relative] if Path(location).is_absolute() else [Path.cwd() / relative, REPO_ROOT / relative]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UsageError(f"MODEL {spec!r}: no file {relative} (looked in {', '.join(str(c.parent) for c in candidates)})")


# -- planning ----------------------------------------------------------------------------


def _make_plan(args):
    """MODEL on meta → (captured graph, plan, this rank's program with axis-named groups, with --at its cost in batch and seq)."""
    hardware_name = args.hardware
    if hardware_name is None and default_profile_path().is_file():
        hardware_name = str(default_profile_path())
        print(f"hardware: {hardware_name} (calibrated)", file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    hardware = get_profile(hardware_name)  # fail on a typo before the model is built
    model = load_model(args.model)
    batch = args.batch or args.mesh.size * BATCH_PER_DEVICE
    inputs = model.example_inputs(batch, device="meta")
    captured = _capture(model, inputs)
    constraints = dict(args.constraint) or None
    pins = dict(zero=args.zero, recompute=args.recompute, microbatches=args.microbatches, pipeline=args.pipeline, stage_cuts=args.stage_cuts)
    plan = _plan_captured(captured, args.mesh, args.degrees, constraints, hardware, args.memory_limit, pins)
    program = rewrite(captured, plan, groups={axis: axis for axis in plan.degrees}, device="cpu")
    at = getattr(args, "at", None)  # only `plan` has it
    symbolic = at and symbolic_cost(captured, plan, hardware, model=model, example_inputs=inputs, seq_dim=1 if "seq" in at else None)
    return captured, plan, program, symbolic


def _cmd_plan(args) -> int:
    captured, plan, program, symbolic = _make_plan(args)
    rows = module_rows(captured, plan, program)
    if args.save:
        plan.save(args.save)
    if args.json:
        report = {
            "degrees": plan.degrees,
            "modules": rows,
            "summary": summary(plan),
            "search": list(plan.search),
            "replicated_ops": list(plan.replicated_ops),
            "plan": plan.to_json(),
        }
        if symbolic:
            cost = symbolic.at(**args.at)
            report["at"] = {**args.at, "step_s": cost.step_s, "peak_memory": cost.peak_memory, **dataclasses.asdict(cost)}
        print(json.dumps(report, indent=1))
    else:
        print(modules_text(rows))
        print()
        print(summary_text(plan))
        if symbolic:
            print(symbolic.compare(**args.at))
        if plan.schedule.stages > 1:
            print()
            print(stages_text(stage_rows(captured, plan), plan))
            print(timeline_text(plan.schedule))
    if getattr(args, "timeline", None):
        Path(args.timeline).write_text(timeline_svg(plan.schedule))
        print(f"wrote the schedule's timeline to {args.timeline}", file=sys.stderr if args.json else sys.stdout)
    if args.save:
        print(f"saved plan to {args.save}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_explain(args) -> int:
    path = Path(args.plan_file)
    if not path.is_file():
        raise UsageError(f"PLAN.json: no file {path}")
    try:
        plan = Plan.load(path)
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise UsageError(f"PLAN.json: {path} is not an autopar plan ({type(error).__name__}: {error})") from None
    print(plan)
    print()
    print(search_text(plan))
    print("ops run replicated (no sharding rule): " + (", ".join(plan.replicated_ops) or "none"))
    print()
    print(decisions_text(plan))
    return 0


def _cmd_export(args) -> int:
    _, plan, program, _ = _make_plan(args)
    world = args.mesh.size
    paths = write_export(args.out, {rank: program for rank in range(world)}, plan)
    print(f"plan: {degrees_text(plan.degrees)}, predicted step {plan.cost.step_s * 1e3:.2f} ms")
    for path in paths:
        print(path)
    return 0


def _cmd_run(args) -> int:
    from autopar.runtime.launch import launch_local

    if not Path(args.script).is_file():
        raise UsageError(f"SCRIPT: no file {args.script}")
    return launch_local(args.script, args.script_args, nproc=args.nproc, timeout_s=args.timeout)


def _cmd_calibrate(args) -> int:
    from autopar.calibrate_cmd import run_calibrate

    run_calibrate(ranks=args.ranks, quick=args.quick, out=args.out or default_profile_path(args.backend), backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
