"""Exposed communication, predicted vs measured, before and after scheduling: the cost model's
``comm_s + grad_sync_s`` for a plan run eagerly (the profile's overlap constant) and compiled
(the replayed schedule, :mod:`autopar.passes.cost.replay`), against what communication costs
inside a measured step: the step minus its no-communication twin.

The cases are some of ``benchmarks/cost_model.py``'s (GPT example M: DP and TP + sequence
parallelism on 2 ranks, DP and DP x TP on 4) plus ZeRO-3 (the DP plan with ``zero=3``) on both,
each planned once with the calibrated profile; the compiled plan is the same plan with ``schedule.compiled`` set and its
cost evaluated again, so the two differ only in the schedule; a plan with tensor parallelism also
runs compiled with ``schedule.async_tp`` (its matmuls in pieces with their collectives). On the
ranks each plan runs eagerly and compiled, each with its twin:

- eager twin: the same step with ``torch.distributed``'s collectives replaced by local
  stand-ins (``measure.no_communication``);
- compiled twin: the program compiled again with every collective lowered to a local stand-in
  of its shapes (``measure.schedule_without_communication``), the runtime's own collectives
  replaced as in the eager twin.

Rounds alternate the plans' order; a barrier before each step; the slowest rank; medians. The
criterion: the median absolute error of the compiled predictions must not exceed the eager ones'.

Run from the repository root, under the shared CPU lock (``autopar calibrate`` first)::

    python benchmarks/overlap.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/overlap.py --quick    # 2 small plans on 2 ranks; prints, writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import autopar
from autopar.ir import get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.runtime.compile import Compiler
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from cost_model import LR, PROFILE, Case, _build, _load_gpt, _loadavg, _slowest_rank, _timed  # noqa: E402
from measure import no_communication, schedule_without_communication  # noqa: E402
from publish import publish  # noqa: E402

SECTION = "overlap"
FULL_CASES = {
    2: [Case("M", 8, s, 2) for s in ("DP", "TP+SP", "ZeRO-3")],
    4: [Case("M", 8, s, 4) for s in ("DP", "DPxTP", "ZeRO-3")],
}
QUICK_CASES = {2: [Case("S", 8, "DP", 2), Case("S", 8, "TP", 2)]}


@dataclasses.dataclass(frozen=True)
class Settings:
    warmup_steps: int
    rounds: int
    steps_per_round: int
    timeout_s: float


FULL = Settings(warmup_steps=1, rounds=4, steps_per_round=2, timeout_s=1200)
QUICK = Settings(warmup_steps=1, rounds=2, steps_per_round=2, timeout_s=1200)


MODES = ("eager", "compiled", "async TP")


def make_plans(cases: list[Case], hardware: str) -> list[tuple[Case, dict]]:
    """(case, mode → plan): one search, re-priced compiled and, where it has tensor parallelism,
    compiled with async TP (:attr:`Schedule.async_tp`)."""
    gpt, profile = _load_gpt(), get_profile(hardware)
    planned = []
    for case in cases:
        model, inputs = _build(gpt, case)
        strategy = "DP" if case.strategy == "ZeRO-3" else case.strategy
        options = dict(degrees=dataclasses.replace(case, strategy=strategy).degrees())
        options["constraints"] = dataclasses.replace(case, strategy=strategy).constraints()
        plan = autopar.plan(model, case.world, inputs, **options, hardware=hardware, zero=0)
        if case.strategy == "ZeRO-3":
            plan = dataclasses.replace(plan, zero=3)
            plan = dataclasses.replace(plan, cost=evaluate_plan(capture(model, inputs), plan, profile))
        modes = {"eager": plan}
        for mode, async_tp in (("compiled", False), ("async TP", True)):
            if async_tp and plan.degrees.get("tp", 1) == 1:
                continue
            schedule = dataclasses.replace(plan.schedule, compiled=True, async_tp=async_tp)
            scheduled = dataclasses.replace(plan, schedule=schedule)
            modes[mode] = dataclasses.replace(scheduled, cost=evaluate_plan(capture(model, inputs), scheduled, profile))
        planned.append((case, modes))
    return planned


def _runner(pmodel, optimizer, batch):
    def step():
        pmodel.train_step(*batch)
        optimizer.step()
        optimizer.zero_grad()

    return step


def bench_rank(rank: int, world: int, planned: list, settings: Settings) -> list[dict]:
    gpt = _load_gpt()
    runs = []  # per plan and mode: (step, twin step)
    for case, modes in planned:
        for plan in modes.values():
            model, inputs = _build(gpt, case)
            pmodel = autopar.parallelize(model, world, inputs, plan=plan)
            optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
            step = _runner(pmodel, optimizer, pmodel.shard_batch(*inputs))
            real, twin = pmodel._compiler, None
            if real is not None:
                twin = Compiler(  # the same program (async TP's pieces too), its communication local
                    schedule=schedule_without_communication,
                    prepare=real.prepare,
                    synced_in_program=real.synced_in_program,
                )

            def twin_step(pmodel=pmodel, step=step, real=real, twin=twin):
                pmodel._compiler = twin  # None for an eager plan: unchanged
                try:
                    with no_communication():
                        step()
                finally:
                    pmodel._compiler = real

            for _ in range(settings.warmup_steps):  # the first compiles, twice for a compiled plan
                step()
                twin_step()
            runs.append((step, twin_step))
    times = [([], []) for _ in runs]
    for round_index in range(settings.rounds):
        order = range(len(runs)) if round_index % 2 == 0 else reversed(range(len(runs)))
        for index in order:
            for which in (0, 1):
                for _ in range(settings.steps_per_round):
                    times[index][which].append(_timed(runs[index][which]))
    return [{"step_s": _slowest_rank(step), "twin_s": _slowest_rank(twin)} for step, twin in times]


def render_section(rows: list[dict], settings: Settings, command: str, elapsed_s: float, loads: str) -> str:
    lines = [
        "## Cost model: exposed communication before and after scheduling",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all, compiles included); date "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, shared with other jobs (load average {loads}); 4 ranks oversubscribe "
        "them (2 processes per core), so communication hides behind compute only when a core is free for gloo; "
        f"CPU, gloo, one torch thread per rank; torch {torch.__version__}, Python {platform.python_version()}; "
        f"hardware profile `{PROFILE}`.",
        f"- steps: forward + backward + AdamW; {settings.warmup_steps} warm-up step(s) per plan and mode (the first "
        f"compiles, twins included), then {settings.rounds} rounds of {settings.steps_per_round} steps of each "
        "step and each twin, the plans' order alternating.",
        "- predicted exposed = `plan.cost.comm_s + plan.cost.grad_sync_s`; eager: the plan as searched "
        "(gradient sync hidden by the profile's overlap share); compiled: the same plan with `schedule.compiled` "
        "(each collective's window in the replayed schedule). Measured exposed = step − no-communication twin "
        "(medians, slowest rank). Models as in the cost-model section; ZeRO-3 = the DP plan with `zero=3`.",
        "- async TP: the compiled plan with `schedule.async_tp` (plans with tensor parallelism): each "
        "tensor-parallel matmul runs in two pieces with its collective, priced piece by piece; its twin runs the "
        "same pieces with the communication local.",
        "",
        "| plan | ranks | "
        + " | ".join(f"{mode} {what}" for mode in MODES for what in ("predicted ms", "measured ms", "error ms"))
        + " | compiled step ms | async TP step ms |",
        "| --- | ---: |" + " ---: |" * (3 * len(MODES) + 2),
    ]
    errors = {mode: [] for mode in MODES}
    for row in rows:
        cells = []
        for mode in MODES:
            if mode not in row:
                cells += ["—"] * 3
                continue
            cost, measured = row[mode]["plan"].cost, row[mode]["measured"]
            predicted = cost.comm_s + cost.grad_sync_s
            errors[mode].append(abs(predicted - measured))
            cells += [f"{predicted * 1e3:.1f}", f"{measured * 1e3:.1f}", f"{(predicted - measured) * 1e3:+.1f}"]
        steps = [f"{row[mode]['step'] * 1e3:.1f}" if mode in row else "—" for mode in MODES[1:]]
        lines.append(f"| {row['case'].name} | {row['case'].world} | {' | '.join(cells + steps)} |")
    median = {mode: statistics.median(errors[mode]) * 1e3 for mode in MODES if errors[mode]}
    lines += [
        "",
        f"Median absolute error of the exposed-communication prediction: eager **{median['eager']:.1f} ms**, "
        f"compiled **{median['compiled']:.1f} ms** (target: compiled ≤ eager): "
        + ("**met**" if median["compiled"] <= median["eager"] else "**missed**"),
    ]
    if "async TP" in median:
        tp_rows = [row for row in rows if "async TP" in row]
        compiled_tp = statistics.median(
            abs(
                row["compiled"]["plan"].cost.comm_s
                + row["compiled"]["plan"].cost.grad_sync_s
                - row["compiled"]["measured"]
            )
            for row in tp_rows
        )
        lines.append(
            f"On the plans with tensor parallelism: compiled **{compiled_tp * 1e3:.1f} ms**, with async TP "
            f"**{median['async TP']:.1f} ms**; async TP's step / compiled step: "
            + ", ".join(
                f"{row['case'].name} {row['case'].world} ranks {row['async TP']['step'] / row['compiled']['step']:.2f}"
                for row in tp_rows
            )
            + "."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 small plans on 2 ranks; print, do not write")
    args = parser.parse_args(argv)
    if not PROFILE.exists():
        print(f"[overlap] {PROFILE} is missing: run `autopar calibrate` first", file=sys.stderr)
        return 1
    settings, cases = (QUICK, QUICK_CASES) if args.quick else (FULL, FULL_CASES)
    command = "python benchmarks/overlap.py" + (" --quick" if args.quick else "")
    start, rows, loads = time.monotonic(), [], {}
    for world, world_cases in cases.items():
        print(f"[overlap] {world} ranks: planning {len(world_cases)} plans ...", flush=True)
        planned = make_plans(world_cases, str(PROFILE))
        before = _loadavg()
        results = run_local(bench_rank, world, planned, settings, timeout_s=settings.timeout_s)[0]
        loads[world] = f"{before} → {_loadavg()}"
        measured_runs = iter(results)  # one per plan and mode, in order
        for case, modes in planned:
            measured = {}
            for mode, plan in modes.items():
                result = next(measured_runs)
                step, twin = statistics.median(result["step_s"]), statistics.median(result["twin_s"])
                measured[mode] = {"plan": plan, "measured": step - twin, "step": step, "twin": twin}
            rows.append({"case": case, **measured})
        # written after each world size: a run cut short still leaves the rows it measured
        load_text = ", ".join(f"{w} ranks: {load}" for w, load in loads.items())
        publish(SECTION, render_section(rows, settings, command, time.monotonic() - start, load_text), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
