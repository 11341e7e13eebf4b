"""What each ``autopar`` command does, given its parsed arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

from autopar.api import capture
from autopar.api import plan as make_plan
from autopar.cli.arguments import BATCH_PER_DEVICE, VERIFY_MISMATCH, UsageError, VerifyFailed, default_profile_path
from autopar.cli.models import load_model, model_call, model_factory
from autopar.cli.progress import ProgressLine
from autopar.ir import InvalidPlanError, Plan, PlanOptions, get_profile
from autopar.passes.cost.symbolic import symbolic_cost
from autopar.passes.rewrite.export import graph_dot, plan_json, program_code, schedule_lines
from autopar.passes.rewrite.rewrite import rewrite
from autopar.passes.rewrite.stages import split_stages
from autopar.report import (
    decisions_text,
    degrees_text,
    module_rows,
    modules_text,
    search_text,
    stage_rows,
    stages_text,
    summary,
    summary_text,
)
from autopar.timeline import timeline_svg, timeline_text

TIMELINE_WIDTH = 240  # characters: a longer schedule is summarized (--timeline draws it)


def _make_plan(args):
    """MODEL on meta → (captured graph, plan, this rank's program with axis-named groups, and with
    --at its cost symbolic in batch and seq)."""
    hardware_name = args.hardware
    if hardware_name is None and default_profile_path().is_file():
        hardware_name = str(default_profile_path())
        print(
            f"hardware: {hardware_name} (calibrated)", file=sys.stderr if getattr(args, "json", False) else sys.stdout
        )
    hardware = get_profile(hardware_name)  # fail on a typo before the model is built
    model = load_model(args.model)
    batch = args.batch or args.mesh.size * BATCH_PER_DEVICE
    call = model_call(model, batch, args.seq)
    options = _options(args, hardware)
    live = sys.stderr.isatty() and not getattr(args, "json", False)  # progress lines: a terminal, no --json
    if live:  # tracing a deep model takes tens of seconds before the search's line starts
        print(f"capture: tracing {type(model).__name__} with torch.export ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    captured = capture(model, (), call, precision=options.precision_policy.precision)
    if live:
        nodes = len(captured.graph_module.graph.nodes)
        print(f"capture: {nodes:,} graph nodes in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    with ProgressLine(sys.stderr) if live else contextlib.nullcontext() as line:
        plan = make_plan(captured, args.mesh, options=options, progress=line)
    program = rewrite(captured, plan, groups={axis: axis for axis in plan.degrees}, device="cpu")
    at = getattr(args, "at", None)  # only `plan` has it
    symbolic = at and symbolic_cost(
        captured, plan, hardware, model=model, example_inputs=call, seq_dim=1 if "seq" in at else None
    )
    return captured, plan, program, symbolic


def _options(args, hardware) -> PlanOptions:
    return PlanOptions(
        degrees=args.degrees,
        constraints=dict(args.constraint) or None,
        hardware=hardware,
        memory_limit=args.memory_limit,
        zero=args.zero,
        recompute=args.recompute,
        microbatches=args.microbatches,
        pipeline=args.pipeline,
        virtual=args.virtual,
        stage_cuts=tuple(args.stage_cuts or ()),
        precision=args.precision,
        compile=args.compile,
        async_tp=args.async_tp,
        regather=None if args.regather is None else args.regather == "on",
    )


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
            report["at"] = {
                **args.at,
                "step_s": cost.step_s,
                "peak_memory": cost.peak_memory,
                **dataclasses.asdict(cost),
            }
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
            print(timeline_text(plan.schedule, max_width=TIMELINE_WIDTH))
    if getattr(args, "timeline", None):
        Path(args.timeline).write_text(timeline_svg(plan.schedule))
        print(f"wrote the schedule's timeline to {args.timeline}", file=sys.stderr if args.json else sys.stdout)
    if args.save:
        print(f"saved plan to {args.save}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _load_plan(file: str) -> Plan:
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"PLAN.json: no file {path}")
    try:
        return Plan.load(path)
    except InvalidPlanError as error:
        raise UsageError(f"PLAN.json: {error}") from None


def _cmd_explain(args) -> int:
    plan = _load_plan(args.plan_file)
    print(plan)
    print()
    print(search_text(plan))
    print("ops run replicated (no sharding rule): " + (", ".join(plan.replicated_ops) or "none"))
    print()
    print(decisions_text(plan))
    return 0


def _cmd_export(args) -> int:
    captured, plan, program, _ = _make_plan(args)
    schedule = plan.schedule
    stages = (
        split_stages(program, set(captured.params), set(captured.buffers), schedule) if schedule.stages > 1 else None
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"rank{rank}.py" for rank in range(plan.mesh.size)]
    notes = schedule_lines(program, plan)  # what the runtime adds: the same for every rank
    for rank, path in enumerate(paths):
        path.write_text(program_code(program, plan, rank, stages, notes))
    paths += [out / "plan.json", out / "graph.dot"]
    paths[-2].write_text(plan_json(plan))
    paths[-1].write_text(graph_dot(program, plan))
    print(f"plan: {degrees_text(plan.degrees)}, predicted step {plan.cost.step_s * 1e3:.2f} ms")
    for path in paths:
        print(path)
    return 0


def _cmd_verify(args) -> int:
    from autopar.verify import prepare, run

    if args.seq is not None:
        raise UsageError("--seq: verify runs the model on its own example_inputs; drop --seq")
    factory, model_args, kwargs = model_factory(args.model)
    pinned = _options(args, args.hardware)
    if args.plan and pinned != PlanOptions():
        raise UsageError("--plan fixes every planning option: drop --degrees, --constraint, --zero, ...")
    plan = _load_plan(args.plan) if args.plan else None
    target = prepare(
        factory,
        args.mesh,
        args=tuple(model_args),
        kwargs=kwargs,
        plan=plan,
        options=None if plan else pinned,
        batch=args.batch,
        max_ranks=args.max_ranks,
        shrink_model=args.shrink,
    )
    print(f"verify: {args.model} on {target.mesh.size} local rank(s) ...", file=sys.stderr, flush=True)
    try:
        (report,) = run([target], timeout_s=args.timeout)
    except TimeoutError as error:
        raise VerifyFailed(f"{error}: the plan hangs or the run needs more than --timeout {args.timeout:g}") from None
    except RuntimeError as error:  # a rank died before it could report
        raise VerifyFailed(str(error)) from None
    print(json.dumps(report.to_json(), indent=1) if args.json else report.text())
    if report.error:
        return 1
    return 0 if report.exact else VERIFY_MISMATCH


def _cmd_run(args) -> int:
    from autopar.runtime.launch import launch_local

    if not Path(args.script).is_file():
        raise UsageError(f"SCRIPT: no file {args.script}")
    return launch_local(
        args.script,
        args.script_args,
        nproc=args.nproc,
        timeout_s=args.timeout,
        max_restarts=args.max_restarts,
        collective_timeout_s=args.collective_timeout,
    )


def _cmd_calibrate(args) -> int:
    from autopar.calibrate import run_calibrate

    run_calibrate(
        ranks=args.ranks, quick=args.quick, out=args.out or default_profile_path(args.backend), backend=args.backend
    )
    return 0


COMMANDS = {
    "plan": _cmd_plan,
    "explain": _cmd_explain,
    "export": _cmd_export,
    "verify": _cmd_verify,
    "run": _cmd_run,
    "calibrate": _cmd_calibrate,
}
