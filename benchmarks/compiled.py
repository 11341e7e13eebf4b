"""Compiled step time: autopar compiled against torch compiled and against autopar eager, side by
side in one run, on 2 and 4 local gloo ranks, at two sizes of the GPT example.

Three comparisons, fp32, AdamW, each with three competitors:

- DP: autopar ``compile=True`` (``degrees={"dp": N, "tp": 1}``) vs ``torch.compile(DistributedDataParallel(model))``
  (Dynamo's DDPOptimizer splits the graph at DDP's buckets) vs autopar eager;
- ZeRO-3: autopar ``compile=True`` (the data-parallel plan with ``zero=3``) vs FSDP2 with every
  transformer block compiled before ``fully_shard`` (as torchtitan does) vs autopar eager;
- TP: autopar ``compile=True`` with the Megatron constraints vs ``torch.compile`` of the model
  ``parallelize_module`` made (ColwiseParallel wq/wk/wv/fc1, RowwiseParallel wo/fc2) vs autopar eager.

DP also times two diagnostics: a twin (``TWIN``), DDP compiled making the two scalar collectives
autopar's data-parallel step makes and DDP's does not, to show what separates the two; and a floor
(``FLOOR``), the compiled model stepping its rank's share of the batch with no communication at all,
the fastest any data-parallel step of the same compiled ops can be on these cores. Every timed step
also counts the CPU time each rank's process spends (gloo's threads included): DP's CPU bound, the
shortest step that much CPU work allows on these cores, however its communication is scheduled.

A compiled competitor's first step compiles (or loads from inductor's cache): it is timed on its
own (barrier, slowest rank) and reported as compile time, never counted in step time. The pairs
(autopar compiled, torch compiled) and (autopar compiled, autopar eager) must agree on the losses
of their first two steps and on every full gradient of the first (as in ``step_time.py``); then,
after warm-up, rounds time every competitor of a comparison in an order that rotates each round,
a barrier before each step, a step's time the slowest rank's, the figure the median.

Run from the repository root, under the shared CPU lock::

    python benchmarks/compiled.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/compiled.py --quick    # smoke run: the small size only, 2 ranks; prints, writes nothing
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from publish import publish  # noqa: E402
from step_time import (  # noqa: E402
    LR,
    MEGATRON_TP,
    SEED,
    Competitor,
    _adamw,
    _as_is,
    _backward,
    _ddp_local_batch,
    _load_gpt,
    _mean_over_ranks,
    _ms,
    _slowest_rank,
    _timed_step,
    check_equivalence,
)

SECTION = "compiled"
TARGET_RATIO = 0.90  # autopar compiled must take at most 90 % of the torch compiled step
COMPARISONS = {  # comparison: (autopar compiled, torch compiled, autopar eager)
    "DP": ("autopar DP compiled", "torch DDP compiled", "autopar DP eager"),
    "ZeRO-3": ("autopar ZeRO-3 compiled", "torch FSDP2 compiled", "autopar ZeRO-3 eager"),
    "TP": ("autopar TP compiled", "torch TP compiled", "autopar TP eager"),
}
# DP's diagnostic twin: DDP compiled making the two scalar collectives autopar's data-parallel step makes and
# DDP's does not (the global count of targets, which autopar's forward waits for, so that ranks counting
# different numbers of ignored targets still average to the global mean; the global loss train_step
# returns, all-reduced during backward): what separates the DP row's two columns when nothing else does
TWIN = "torch DDP compiled + autopar's collectives"
# DP's floor: each rank's share stepped by the compiled model alone, no communication (ranks still run side by
# side, so they contend for the cores as the others do): no scheduling of communication goes below it
FLOOR = "compiled model alone, no communication"
DIAGNOSTICS = (TWIN, FLOOR)
PAIRS = tuple(
    pair
    for comparison, (ours, torch_compiled, eager) in COMPARISONS.items()
    for pair in ((comparison, ours, torch_compiled), (f"{comparison} vs eager", ours, eager))
)


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: dict[str, dict]  # size name → examples/gpt.py:build keyword arguments
    world_sizes: tuple[int, ...]
    batch: int
    warmup_steps: int  # untimed steps after the checked ones (the first of which compiles)
    rounds: int
    steps_per_round: int
    timeout_s: float  # per spawn


FULL = Settings(
    sizes={
        "S": dict(hidden=128, layers=2, heads=4, vocab=512, seq=64),
        "M": dict(hidden=256, layers=2, heads=8, vocab=1024, seq=128),
    },
    world_sizes=(2, 4),
    batch=8,
    warmup_steps=1,
    rounds=5,
    steps_per_round=2,
    timeout_s=1200,
)
QUICK = dataclasses.replace(
    FULL, sizes={"S": FULL.sizes["S"]}, world_sizes=(2,), warmup_steps=1, rounds=2, timeout_s=1200
)


def _autopar(model, global_inputs, world_size: int, comparison: str, compile: bool) -> Competitor:
    if comparison == "TP":
        options = dict(degrees={"dp": 1, "tp": world_size}, constraints=MEGATRON_TP)
    else:
        options = dict(degrees={"dp": world_size, "tp": 1})
    plan = autopar.plan(model, world_size, global_inputs, **options, zero=0)
    if comparison == "ZeRO-3":
        plan = dataclasses.replace(plan, zero=3)
    pmodel = autopar.parallelize(copy.deepcopy(model), world_size, global_inputs, plan=plan, compile=compile)
    batch = pmodel.shard_batch(*global_inputs)
    name = COMPARISONS[comparison][0 if compile else 2]
    return Competitor(name, pmodel, lambda: pmodel.train_step(*batch), _adamw(pmodel), _as_is)


def _ddp_compiled(model, global_inputs, rank: int, world_size: int) -> Competitor:
    ddp = DistributedDataParallel(copy.deepcopy(model))
    compiled = torch.compile(ddp)
    batch = _ddp_local_batch(global_inputs, rank, world_size)
    return Competitor("torch DDP compiled", ddp, _backward(compiled, batch), _adamw(ddp), _mean_over_ranks, "module.")


def _fsdp2_compiled(model, global_inputs, rank: int, world_size: int) -> Competitor:
    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in sharded.layers:
        block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    batch = _ddp_local_batch(global_inputs, rank, world_size)
    return Competitor("torch FSDP2 compiled", sharded, _backward(sharded, batch), _adamw(sharded), _mean_over_ranks)


def _tp_compiled(model, global_inputs, rank: int, world_size: int) -> Competitor:
    tp = copy.deepcopy(model)
    plan = {}
    for index in range(len(tp.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            plan[f"layers.{index}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.fc2"):
            plan[f"layers.{index}.{name}"] = RowwiseParallel()
    parallelize_module(tp, init_device_mesh("cpu", (world_size,)), plan)
    compiled = torch.compile(tp)
    return Competitor("torch TP compiled", tp, _backward(compiled, global_inputs), _adamw(tp), _as_is)


def _ddp_compiled_twin(model, global_inputs, rank: int, world_size: int) -> Competitor:
    """DDP compiled with autopar's two scalar collectives added (see ``TWIN``); its loss is DDP's."""
    ddp = DistributedDataParallel(copy.deepcopy(model))
    compiled = torch.compile(ddp)
    batch = _ddp_local_batch(global_inputs, rank, world_size)

    def forward_backward():
        count = (batch[-1] != -100).sum(dtype=torch.float32)
        dist.all_reduce(count)
        loss = compiled(*batch)
        total = loss.detach().clone()
        work = dist.all_reduce(total, async_op=True)
        loss.backward()
        work.wait()
        return loss.detach()

    return Competitor(TWIN, ddp, forward_backward, _adamw(ddp), _mean_over_ranks, "module.")


def _compiled_alone(model, global_inputs, rank: int, world_size: int) -> Competitor:
    """The DP floor (see ``FLOOR``): the compiled model on this rank's share, nothing synced."""
    alone = copy.deepcopy(model)
    batch = _ddp_local_batch(global_inputs, rank, world_size)
    return Competitor(FLOOR, alone, _backward(torch.compile(alone), batch), _adamw(alone), _mean_over_ranks)


TORCH = {"DP": _ddp_compiled, "ZeRO-3": _fsdp2_compiled, "TP": _tp_compiled}


def _first_step_timed(competitor: Competitor, seconds: dict[str, float]) -> Competitor:
    """The competitor with its first forward + backward (the compile) timed into ``seconds``."""
    inner = competitor.forward_backward

    def forward_backward():
        if competitor.name in seconds:
            return inner()
        dist.barrier()
        start = time.perf_counter()
        loss = inner()
        seconds[competitor.name] = time.perf_counter() - start
        return loss

    return dataclasses.replace(competitor, forward_backward=forward_backward)


def bench_rank(rank: int, world_size: int, settings: Settings, size: str) -> dict:
    """Everything one rank does for one size; every rank returns the same (slowest-rank) figures."""
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.sizes[size])
    global_inputs = model.example_inputs(settings.batch)
    first_step: dict[str, float] = {}
    competitors = {}
    for comparison in COMPARISONS:
        for built in (
            _autopar(model, global_inputs, world_size, comparison, compile=True),
            TORCH[comparison](model, global_inputs, rank, world_size),
            _autopar(model, global_inputs, world_size, comparison, compile=False),
        ):
            competitors[built.name] = _first_step_timed(built, first_step)
    for diagnostic in (_ddp_compiled_twin, _compiled_alone):
        built = diagnostic(model, global_inputs, rank, world_size)
        competitors[built.name] = _first_step_timed(built, first_step)
    losses = check_equivalence(competitors, pairs=PAIRS)
    names = list(first_step)
    compile_s = dict(zip(names, _slowest_rank([first_step[name] for name in names])))
    for _ in range(settings.warmup_steps):
        for competitor in competitors.values():
            _timed_step(competitor)
    rounds = {name: [] for name in competitors}
    cpu_bounds = {name: [] for name in competitors}
    for round_index in range(settings.rounds):
        for comparison, group in COMPARISONS.items():
            group = group + (DIAGNOSTICS if comparison == "DP" else ())
            shift = round_index % len(group)
            for name in group[shift:] + group[:shift]:
                timed = [_timed_step_and_cpu(competitors[name]) for _ in range(settings.steps_per_round)]
                rounds[name].append(_slowest_rank([wall for wall, _ in timed]))
                cpu_bounds[name].append(_cpu_bound([cpu for _, cpu in timed]))
    return {"losses": losses, "rounds": rounds, "cpu_bounds": cpu_bounds, "compile_s": compile_s}


def _timed_step_and_cpu(competitor: Competitor) -> tuple[float, float]:
    """A step's wall seconds (as ``_timed_step``) and the CPU seconds this rank's process spent
    in it, every thread counted (gloo's communication threads too)."""
    cpu = time.process_time()
    wall = _timed_step(competitor)
    return wall, time.process_time() - cpu


def _cpu_bound(cpu_seconds: list[float]) -> list[float]:
    """Per step, the shortest wall time the ranks' CPU work allows: no rank runs faster than one
    core, and all of them together on no more than this machine's cores."""
    mine = torch.tensor(cpu_seconds, dtype=torch.float64)
    busiest, total = mine.clone(), mine.clone()
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    return torch.maximum(busiest, total / os.cpu_count()).tolist()


def _medians(rounds_by_name: dict[str, list[list[float]]]) -> dict[str, float]:
    """Each competitor's median over every step of every round."""
    return {name: statistics.median(t for r in rounds for t in r) for name, rounds in rounds_by_name.items()}


def render_section(results: dict, settings: Settings, command: str, elapsed_s: float) -> str:
    """``results[(size, world_size)]`` as this script's BENCHMARKS.md section."""
    lines = [
        "## Compiled: autopar compiled vs torch compiled (DDP, FSDP2, tensor parallel) and vs autopar eager",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all, compiles included)",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores shared with other jobs; CPU, gloo, one torch thread per rank, inductor's "
        "C++ backend; 4 ranks on 2 cores are oversubscribed (2 processes per core): the 4-rank rows measure "
        "contention as much as parallelism, and communication can only hide behind compute when a core is free "
        f"for gloo's threads. torch {torch.__version__}, Python {platform.python_version()}.",
        "- models: examples/gpt.py "
        + "; ".join(
            f"{name} = `build({', '.join(f'{k}={v}' for k, v in kw.items())})`" for name, kw in settings.sizes.items()
        )
        + f"; fp32, global batch {settings.batch}; AdamW lr {LR}.",
        "- competitors: DP: autopar `compile=True` vs `torch.compile(DistributedDataParallel(model))` vs autopar "
        "eager; ZeRO-3: autopar `compile=True` (data-parallel plan, `zero=3`) vs FSDP2 with each block compiled "
        "before `fully_shard` vs autopar eager; TP: autopar `compile=True` (Megatron constraints) vs "
        "`torch.compile` of `parallelize_module`'s model vs autopar eager.",
        f"- step: forward + backward + AdamW step + zero_grad; after the 2 checked steps and {settings.warmup_steps} "
        f"warm-up steps, {settings.rounds} rounds of {settings.steps_per_round} steps per competitor, the competitors "
        "of a comparison in an order rotating each round; a barrier before each step; slowest rank; median. The first "
        "step of each compiled competitor is the compile time column (inductor's cache may hold graphs from "
        "earlier runs: it is what a rerun costs), never part of step time.",
        "",
        f"| size | ranks | comparison | autopar compiled ms | torch compiled ms | ratio | target ≤ {TARGET_RATIO:.2f} "
        "| autopar eager ms | compiled / eager | compile s: autopar | compile s: torch |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for (size, world_size), result in results.items():
        medians = _medians(result["rounds"])
        for comparison, (ours, theirs, eager) in COMPARISONS.items():
            ratio = medians[ours] / medians[theirs]
            met = "yes" if ratio <= TARGET_RATIO else f"**no** (+{(ratio / TARGET_RATIO - 1) * 100:.0f}%)"
            lines.append(
                f"| {size} | {world_size} | {comparison} | {_ms(medians[ours])} | {_ms(medians[theirs])} | "
                f"{ratio:.2f} | {met} | "
                f"{_ms(medians[eager])} | {medians[ours] / medians[eager]:.2f} | "
                f"{result['compile_s'][ours]:.1f} | {result['compile_s'][theirs]:.1f} |"
            )
    lines += [
        "",
        f"DP's diagnostic twin: `{TWIN}` is DDP compiled making the two scalar collectives autopar's "
        "data-parallel step makes and DDP's does not: the global count of targets before forward (autopar's "
        "forward waits for it, so that ranks counting different numbers of ignored targets still average to the "
        "global mean) and the global loss, all-reduced during backward (what `train_step` returns).",
        "",
        f"DP's floor: `{FLOOR}` is the compiled model stepping this rank's share of the batch (forward, "
        "backward, AdamW) with nothing synced, the ranks side by side as in the other rows: a data-parallel step "
        "runs these same compiled ops and adds communication, so no scheduling of it goes below the floor. Where "
        f"floor / DDP is above {TARGET_RATIO:.2f}, the target is out of reach of any data-parallel step made of "
        "these ops on these cores: what DDP leaves exposed is less than a tenth of its step. Both diagnostics "
        "are rotated with the DP comparison's three.",
        "",
        "DP's CPU bound: in the same timed steps, the CPU time each rank's process spent (every thread: "
        "gloo moves and sums the gradients on threads of its own, on the same cores), as a wall time no step can "
        f"beat: the busiest rank's, or all ranks' over the {os.cpu_count()} cores, whichever is longer. A "
        "step made of the same work cannot be shorter however its communication is scheduled; where "
        f"autopar's bound / DDP is above {TARGET_RATIO:.2f}, only less CPU work (fewer bytes or cheaper "
        "collectives) could meet the target on these cores.",
        "",
        "| size | ranks | autopar DP compiled ms | torch DDP compiled ms | twin ms | autopar / twin | floor ms | "
        "floor / DDP | autopar / floor | autopar CPU bound ms | DDP CPU bound ms | floor CPU bound ms | "
        "autopar CPU bound / DDP |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (size, world_size), result in results.items():
        medians = _medians(result["rounds"])
        bounds = _medians(result["cpu_bounds"])
        ours, theirs, _ = COMPARISONS["DP"]
        lines.append(
            f"| {size} | {world_size} | {_ms(medians[ours])} | {_ms(medians[theirs])} | {_ms(medians[TWIN])} | "
            f"{medians[ours] / medians[TWIN]:.2f} | {_ms(medians[FLOOR])} | {medians[FLOOR] / medians[theirs]:.2f} | "
            f"{medians[ours] / medians[FLOOR]:.2f} | {_ms(bounds[ours])} | {_ms(bounds[theirs])} | "
            f"{_ms(bounds[FLOOR])} | {bounds[ours] / medians[theirs]:.2f} |"
        )
    lines += [
        "",
        "Equivalence check (passed): autopar compiled against torch compiled and against autopar eager, the "
        "global-batch losses of steps 1 and 2 and every full gradient of step 1 (as in the step-time section).",
        "",
        "| size | ranks | competitor | loss step 1 | loss step 2 |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for (size, world_size), result in results.items():
        for name, losses in result["losses"].items():
            lines.append(f"| {size} | {world_size} | {name} | {losses[0]:.6f} | {losses[1]:.6f} |")
    lines += [
        "",
        "Per-round medians, ms (slowest rank per step):",
        "",
        "| size | ranks | competitor | per-round medians |",
        "| --- | ---: | --- | --- |",
    ]
    for (size, world_size), result in results.items():
        for name, rounds in result["rounds"].items():
            lines.append(f"| {size} | {world_size} | {name} | {' '.join(_ms(statistics.median(r)) for r in rounds)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small size on 2 ranks, few rounds; print only")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    command = "python benchmarks/compiled.py" + (" --quick" if args.quick else "")
    start = time.monotonic()
    results = {}
    for world_size in settings.world_sizes:
        for size in settings.sizes:
            print(f"[compiled] {size} on {world_size} ranks ...", flush=True)
            results[(size, world_size)] = run_local(
                bench_rank, world_size, settings, size, timeout_s=settings.timeout_s
            )[0]
            # written after each spawn: a run cut short still leaves the rows it measured
            publish(SECTION, render_section(results, settings, command, time.monotonic() - start), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
