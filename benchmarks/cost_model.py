"""Cost model against measurement: predicted vs measured step time and peak memory of GPT plans.

Plans of the GPT example (``examples/gpt.py``, three sizes, two batch sizes) with every
strategy autopar has (DP, Megatron TP, TP + sequence-parallel norms, DP x TP, and the
automatic plan; on 2 ranks also each recomputation level) run on 2 and 4 local gloo ranks:
ONE ``run_local`` per world size, looping over its plans inside. Every plan is made
beforehand in this process with the calibrated profile of this machine
(``~/.cache/autopar/profiles/cpu-local-calibrated.json``; ``autopar calibrate`` makes it).

Compared like with like:

- time: ``plan.cost.step_s`` (compute + exposed communication + gradient sync + optimizer)
  against a whole training step: ``train_step`` + ``optimizer.step()`` + ``zero_grad()``,
  a barrier before each step, the slowest rank's time, the median over the timed steps,
  plans interleaved in rounds.
- memory: ``plan.cost.peak_memory`` against the bytes of the live tensors the rank holds
  before the step (parameter shards, AdamW state, buffers, gradient-sync buckets;
  gradients None, as after ``zero_grad()``) plus the highest net allocation during
  ``train_step``, walked from the CPU allocator's events that
  ``torch.profiler.profile(profile_memory=True)`` records. The largest rank counts.

Every plan also runs a no-communication twin (its step with the collectives replaced by
local stand-ins): measured minus twin is what communication costs in the step.

Run from the repository root::

    python benchmarks/cost_model.py            # full run (~5 min), rewrites its section of BENCHMARKS.md
    python benchmarks/cost_model.py --quick    # smoke run: 4 small plans; prints, writes nothing
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.ir import get_profile
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from cost_model_report import render_section  # noqa: E402
from measure import measure_memory, no_communication  # noqa: E402
from publish import publish  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "cost_model"
PROFILE = Path.home() / ".cache" / "autopar" / "profiles" / "cpu-local-calibrated.json"
LR = 1e-3
SEED = 0
MiB = 2**20

MODELS = {
    "S": dict(hidden=128, layers=2, heads=4, vocab=512, seq=64),
    "M": dict(hidden=256, layers=2, heads=8, vocab=1024, seq=128),
    "L": dict(hidden=512, layers=2, heads=8, vocab=2048, seq=128),
}
MEGATRON_TP = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}
SEQUENCE_PARALLEL = {**MEGATRON_TP, "layers.*.attn_norm": "S(1)", "layers.*.mlp_norm": "S(1)"}


@dataclass(frozen=True)
class Case:
    """One plan: a model size, a global batch and a strategy on ``world`` ranks."""

    model: str  # key of MODELS
    batch: int
    strategy: str  # "DP", "ZeRO-1", "ZeRO-2", "TP", "TP+SP", "TP+SP+regather", "DPxTP", "auto"; "+<recompute level>"
    world: int

    @property
    def name(self) -> str:
        return f"{self.model} b{self.batch} {self.strategy}"

    def zero(self) -> int | None:
        """The ZeRO stage pinned (data parallelism with ``zero``), None: the search's choice."""
        return int(self.strategy[-1]) if self.strategy.startswith("ZeRO-") else None

    @property
    def layout(self) -> str:
        """The strategy without its recomputation level."""
        return self.strategy.split("+selective")[0].split("+full")[0]

    def recompute(self) -> str | None:
        """The recomputation level pinned (the strategy's suffix), None: the search's choice."""
        return self.strategy.removeprefix(self.layout).removeprefix("+") or None

    def degrees(self) -> dict[str, int] | None:
        return {
            "DP": {"dp": self.world, "tp": 1},
            "ZeRO-1": {"dp": self.world, "tp": 1},
            "ZeRO-2": {"dp": self.world, "tp": 1},
            "TP": {"dp": 1, "tp": self.world},
            "TP+SP": {"dp": 1, "tp": self.world},
            "TP+SP+regather": {"dp": 1, "tp": self.world},
            "DPxTP": {"dp": 2, "tp": self.world // 2},
            "auto": None,
        }[self.layout]

    def constraints(self) -> dict[str, str] | None:
        return {
            "TP": MEGATRON_TP,
            "TP+SP": SEQUENCE_PARALLEL,
            "TP+SP+regather": SEQUENCE_PARALLEL,
            "DPxTP": MEGATRON_TP,
        }.get(self.layout)

    def regather(self) -> bool | None:
        """Whether the norms' gathered outputs are kept as shards (pinned for TP+SP), None: the search's choice."""
        return {"TP+SP": False, "TP+SP+regather": True}.get(self.layout)


def _cases(world: int, specs: str) -> list[Case]:
    out = []
    for spec in specs.split():
        model, batch, strategy = spec.split(":")
        out.append(Case(model, int(batch), strategy, world))
    return out


FULL_CASES = {
    2: _cases(
        2,
        "M:8:DP M:8:ZeRO-1 M:8:ZeRO-2 M:8:TP M:8:TP+SP M:8:TP+SP+regather M:8:auto S:8:DP S:8:TP L:8:DP L:8:TP "
        "M:16:DP M:16:TP M:16:DP+selective M:16:DP+selective-op M:16:DP+full M:16:TP+selective",
    ),
    4: _cases(
        4,
        "M:8:DP M:8:ZeRO-1 M:8:ZeRO-2 M:8:DPxTP M:8:TP M:8:TP+SP M:8:TP+SP+regather M:8:auto S:8:DP S:8:DPxTP L:8:DP "
        "L:8:DPxTP L:8:auto "
        "M:16:DP M:16:DPxTP",
    ),
}
QUICK_CASES = {2: _cases(2, "S:8:DP S:8:TP"), 4: _cases(4, "S:8:DP S:8:DPxTP")}


@dataclass(frozen=True)
class Settings:
    warmup_steps: int  # untimed train_step + optimizer step per plan before anything is measured
    rounds: int  # timed rounds; each round runs every plan, in alternating order
    steps_per_round: int
    timeout_s: float  # per world size


FULL = Settings(warmup_steps=3, rounds=6, steps_per_round=2, timeout_s=420)
QUICK = Settings(warmup_steps=2, rounds=2, steps_per_round=4, timeout_s=240)


def _load_gpt():
    spec = importlib.util.spec_from_file_location("autopar_examples_gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- one rank


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slowest_rank(seconds: list[float]) -> list[float]:
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def _build(gpt, case: Case, device=None):
    torch.manual_seed(SEED)
    if device is not None:
        with torch.device(device):
            model = gpt.build(**MODELS[case.model])
    else:
        model = gpt.build(**MODELS[case.model])
    return model, model.example_inputs(case.batch)


def bench_rank(rank: int, world: int, planned: list[tuple[Case, object]], settings: Settings) -> dict:
    """Build every plan (made beforehand, in one quiet process), measure its memory, then time
    every plan in rounds.

    A round runs, for every plan in turn (alternating the order between rounds), its
    ``steps_per_round`` steps (train_step + optimizer step + zero_grad) and as many steps of
    its no-communication twin (the same train_step with the collectives replaced by local
    stand-ins): the twin is the step's compute under the same sharing of the cores, so
    real minus twin is what communication costs inside a step.
    """
    gpt = _load_gpt()
    runs = []
    for case, plan in planned:
        model, inputs = _build(gpt, case)
        pmodel = autopar.parallelize(model, world, inputs, plan=plan)
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
        batch = pmodel.shard_batch(*inputs)
        del model
        for _ in range(settings.warmup_steps):
            pmodel.train_step(*batch)
            optimizer.step()
            optimizer.zero_grad()
        with no_communication():  # the twin's first step allocates too: warm it up
            pmodel.train_step(*batch)
        optimizer.zero_grad()
        memory = [None] * world
        dist.all_gather_object(memory, measure_memory(pmodel, optimizer, batch))
        optimizer.zero_grad()
        runs.append(
            {"case": case, "plan": plan, "pmodel": pmodel, "optimizer": optimizer, "batch": batch, "memory": memory}
        )

    times = {key: [[] for _ in runs] for key in ("step_s", "twin_s")}
    for round_index in range(settings.rounds):
        order = range(len(runs)) if round_index % 2 == 0 else reversed(range(len(runs)))
        for index in order:
            pmodel, optimizer, batch = runs[index]["pmodel"], runs[index]["optimizer"], runs[index]["batch"]
            for _ in range(settings.steps_per_round):
                times["step_s"][index].append(
                    _timed(lambda: (pmodel.train_step(*batch), optimizer.step(), optimizer.zero_grad()))
                )
            with no_communication():
                for _ in range(settings.steps_per_round):
                    times["twin_s"][index].append(
                        _timed(lambda: (pmodel.train_step(*batch), optimizer.step(), optimizer.zero_grad()))
                    )
    return [
        {
            "case": run["case"],
            "plan": run["plan"],
            "memory": run["memory"],
            **{key: _slowest_rank(times[key][index]) for key in times},
        }
        for index, run in enumerate(runs)
    ]


def make_plans(cases: list[Case], hardware: str) -> list[tuple[Case, object]]:
    """Every case's plan, made here before the ranks start: the search times ops on this
    machine, which it should do undisturbed (and once, not on every rank)."""
    gpt = _load_gpt()
    planned = []
    for case in cases:
        model, inputs = _build(gpt, case)  # on the CPU, as the ranks build it
        planned.append(
            (
                case,
                autopar.plan(
                    model,
                    case.world,
                    inputs,
                    degrees=case.degrees(),
                    constraints=case.constraints(),
                    zero=case.zero(),
                    regather=case.regather(),
                    recompute=case.recompute(),
                    hardware=hardware,
                ),
            )
        )
    return planned


# --------------------------------------------------------------------------- statistics


# --------------------------------------------------------------------------- rows


def _plan_key(row) -> tuple:
    plan = row["plan"]
    return (
        row["case"].model,
        row["case"].batch,
        plan.mesh.size,
        tuple(plan.degrees.items()),
        plan.zero,
        str(plan.schedule),
        tuple(sorted((k, str(v)) for k, v in plan.params.items())),
        tuple(sorted((k, str(v.output), str(v.inputs)) for k, v in plan.nodes.items())),
    )


def analyse(results: dict[int, list[dict]]) -> list[dict]:
    """One row per plan: its prediction and the medians measured; repeats of a plan marked."""
    rows, seen = [], {}
    for world, runs in results.items():
        for run in runs:
            row = {
                "case": run["case"],
                "world": world,
                "plan": run["plan"],
                "step_s": statistics.median(run["step_s"]),
                "twin_s": statistics.median(run["twin_s"]),
                "memory": max(run["memory"], key=lambda m: m["peak_step"]),
            }
            row["duplicate_of"] = seen.get(_plan_key(row))
            seen.setdefault(_plan_key(row), f"{run['case'].name} ({world} ranks)")
            rows.append(row)
    return rows


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer plans and steps; print, do not write")
    args = parser.parse_args(argv)
    if not PROFILE.exists():
        print(f"[cost_model] {PROFILE} is missing: run `autopar calibrate` first", file=sys.stderr)
        return 1
    settings, cases = (QUICK, QUICK_CASES) if args.quick else (FULL, FULL_CASES)
    command = "python benchmarks/cost_model.py" + (" --quick" if args.quick else "")
    hardware = get_profile(str(PROFILE))
    start = time.monotonic()
    results, loads = {}, {}
    for world, world_cases in cases.items():
        print(f"[cost_model] {world} ranks: planning {len(world_cases)} plans ...", flush=True)
        planned = make_plans(world_cases, str(PROFILE))
        print(f"[cost_model] {world} ranks: measuring ...", flush=True)
        before = _loadavg()
        results[world] = run_local(bench_rank, world, planned, settings, timeout_s=settings.timeout_s)[0]
        loads[world] = f"{before} → {_loadavg()}"
    rows = analyse(results)
    load_text = ", ".join(f"{w} ranks: {load}" for w, load in loads.items())
    section = render_section(rows, settings, command, time.monotonic() - start, load_text, hardware, PROFILE, MODELS)
    publish(SECTION, section, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
