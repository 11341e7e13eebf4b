"""ZeRO in autopar against torch, side by side in one run, on 4 (and 2) local gloo ranks.

Two comparisons on the GPT example (``examples/gpt.py``), fp32, AdamW, data parallel only:

- ZeRO-3: autopar (``degrees={"dp": N, "tp": 1}``, the plan's stage set to 3) against torch
  FSDP2, ``fully_shard`` on every transformer block and on the root;
- ZeRO-1: autopar (stage 1) against ``DistributedDataParallel`` with
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` over AdamW.

Both autopar runs take the data-parallel plan the search makes and set its ``zero`` field, so
they run the same program as plain DP, plus ZeRO. Timing follows ``step_time.py``: the pairs
must agree on the losses of their first two steps and every full gradient of the first; then
rounds alternate the order within a pair, a barrier starts each step, a step's time is the
slowest rank's and the figure is the median. Memory is measured apart, one spawn per
competitor: the peak resident memory (VmHWM, reset after the competitor is built) over 3
steps, minus the resident memory at the reset; and the bytes of parameters,
gradients and optimizer state a rank holds after a step (each storage counted once).

Run from the repository root::

    python benchmarks/zero.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/zero.py --quick    # smoke run on a smaller model; prints, writes nothing
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.ir import get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from measure import model_state_bytes  # noqa: E402
from publish import publish  # noqa: E402
from step_time import (  # noqa: E402
    FULL,
    LR,
    QUICK,
    SEED,
    TARGET_RATIO,
    Competitor,
    _as_is,
    _backward,
    _ddp_local_batch,
    _load_gpt,
    _mean_over_ranks,
    check_equivalence,
    losses_table,
    time_rounds,
)

SECTION = "zero"
WORLD_SIZES = (4, 2)
PAIRS = (("ZeRO-3", "autopar ZeRO-3", "torch FSDP2"), ("ZeRO-1", "autopar ZeRO-1", "torch ZeRO-1"))
MEMORY_STEPS = 3
PLAIN_DP = "autopar ZeRO-0"  # measured for memory only: what ZeRO-3's model state is compared with


def autopar_zero(model, global_inputs, world_size: int, stage: int, precision: str = "fp32", name=None) -> Competitor:
    """autopar's data-parallel plan (searched without ZeRO) given ZeRO ``stage``, at ``precision``."""
    degrees = {"dp": world_size, "tp": 1}
    base = autopar.plan(model, world_size, global_inputs, degrees=degrees, zero=0, precision=precision)
    pmodel = autopar.parallelize(
        copy.deepcopy(model), world_size, global_inputs, plan=dataclasses.replace(base, zero=stage)
    )
    batch = pmodel.shard_batch(*global_inputs)
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
    name = name or f"autopar ZeRO-{stage}"
    return Competitor(name, pmodel, lambda: pmodel.train_step(*batch), optimizer, _as_is)


def torch_fsdp2(model, global_inputs, rank: int, world_size: int, mp_policy=None, name="torch FSDP2") -> Competitor:
    """FSDP2: ``fully_shard`` on every transformer block and on the root (with ``mp_policy`` if given)."""
    sharded = copy.deepcopy(model)
    options = dict(mesh=init_device_mesh("cpu", (world_size,)), **({"mp_policy": mp_policy} if mp_policy else {}))
    for block in sharded.layers:
        fully_shard(block, **options)
    fully_shard(sharded, **options)
    batch = _ddp_local_batch(global_inputs, rank, world_size)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=LR)
    return Competitor(name, sharded, _backward(sharded, batch), optimizer, _mean_over_ranks)


def _ddp_zero1(model, global_inputs, rank: int, world_size: int) -> Competitor:
    ddp = DistributedDataParallel(copy.deepcopy(model))
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    batch = _ddp_local_batch(global_inputs, rank, world_size)
    return Competitor("torch ZeRO-1", ddp, _backward(ddp, batch), optimizer, _mean_over_ranks, "module.")


def build(name: str, model, global_inputs, rank: int, world_size: int) -> Competitor:
    if name.startswith("autopar"):
        return autopar_zero(model, global_inputs, world_size, int(name[-1]))
    return {"torch FSDP2": torch_fsdp2, "torch ZeRO-1": _ddp_zero1}[name](model, global_inputs, rank, world_size)


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_rank(rank: int, world_size: int, settings, name: str) -> dict:
    """Peak resident memory over MEMORY_STEPS steps above that after the build, and the model state."""
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.model)
    global_inputs = model.example_inputs(settings.batch)
    competitor = build(name, model, global_inputs, rank, world_size)  # autopar's planning is not counted
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current resident memory
    start_kib = _resident_kib("VmRSS")
    for _ in range(MEMORY_STEPS):
        competitor.forward_backward()
        competitor.optimizer.step()
    peak = (_resident_kib("VmHWM") - start_kib) * 1024
    state = model_state_bytes(competitor)
    competitor.optimizer.zero_grad()
    return {
        "peak_bytes": max(peak, 0),
        "state_bytes": state,
        "predicted_state_bytes": _predicted_state(competitor, model, global_inputs),
    }


def _predicted_state(competitor: Competitor, model, global_inputs) -> float | None:
    """The cost model's parameters + gradients + optimizer state per rank, for autopar's plan."""
    if not competitor.name.startswith("autopar"):
        return None
    cost = evaluate_plan(capture(model, global_inputs), competitor.module.plan, get_profile("cpu-local"))
    return cost.memory["params"] + cost.memory["grads"] + cost.memory["optimizer"]


def bench_rank(rank: int, world_size: int, settings) -> dict:
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.model)
    global_inputs = model.example_inputs(settings.batch)
    competitors = {name: build(name, model, global_inputs, rank, world_size) for pair in PAIRS for name in pair[1:]}
    losses = check_equivalence(competitors, pairs=PAIRS)
    rounds = time_rounds(competitors, settings, PAIRS)
    return {"losses": losses, "rounds": rounds}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def render_section(results, memory, settings, command: str, elapsed_s: float) -> str:
    model = settings.model
    with torch.device("meta"):
        parameters = sum(p.numel() for p in _load_gpt().build(**model).parameters())
    lines = [
        "## ZeRO: autopar vs torch FSDP2 and ZeroRedundancyOptimizer",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all)",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, CPU, gloo, one torch thread per rank; 4 ranks on 2 cores are "
        "oversubscribed (2 processes per core), so the 4-rank rows measure contention as much as parallelism. "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"- model: examples/gpt.py `build({', '.join(f'{k}={v}' for k, v in model.items())})` "
        f"({parameters / 1e6:.2f} M parameters), fp32, global batch {settings.batch} x seq {model['seq']}, AdamW lr "
        f"{LR}.",
        "- ZeRO-3: autopar data-parallel plan with `zero=3` (one all-gather per layer, next layer prefetched, "
        "regathered per layer for backward, gradients reduce-scattered per layer asynchronously) vs FSDP2 "
        "`fully_shard` per block and root. "
        "ZeRO-1: autopar `zero=1` (`pmodel.optimizer`) vs DDP + `ZeroRedundancyOptimizer(AdamW)`.",
        f"- step: forward + backward + AdamW step + zero_grad; {settings.rounds} rounds of {settings.steps_per_round} "
        "steps per competitor after warm-up, pairs in alternating order, a barrier before each step, slowest rank, "
        "median.",
        f"- memory: one spawn per competitor; step peak = VmHWM over {MEMORY_STEPS} steps minus the resident memory "
        "after the build (what the steps add: gradients, optimizer state, activations, gathered weights; glibc may "
        "reuse freed memory, so it is a floor); state = parameters + gradients + optimizer state held after a step, "
        "counted from the tensors. Largest rank shown.",
        "",
        "| ranks | comparison | autopar ms | torch ms | ratio | target | met? | autopar step peak MiB | torch step "
        "peak MiB "
        "| autopar state MiB (predicted) | torch state MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    shares = []
    for world_size, result in results.items():
        for comparison, ours, theirs in PAIRS:
            ours_s, theirs_s = (statistics.median(t for r in result["rounds"][n] for t in r) for n in (ours, theirs))
            ratio = ours_s / theirs_s
            mem = {n: memory[world_size][n] for n in (ours, theirs)}
            peak = {n: max(m["peak_bytes"] for m in mem[n]) for n in mem}
            state = {n: max(m["state_bytes"] for m in mem[n]) for n in mem}
            predicted = max(m["predicted_state_bytes"] for m in mem[ours])
            lines.append(
                f"| {world_size} | {comparison} | {ours_s * 1e3:.1f} | {theirs_s * 1e3:.1f} | {ratio:.2f} | ≤ "
                f"{TARGET_RATIO:.2f} "
                f"| {'yes' if ratio <= TARGET_RATIO else '**no**'} | {_mib(peak[ours])} | {_mib(peak[theirs])} "
                f"| {_mib(state[ours])} ({_mib(predicted)}, {(predicted / state[ours] - 1) * 100:+.0f}%) | "
                f"{_mib(state[theirs])} |"
            )
            if comparison == "ZeRO-3":
                plain = max(m["state_bytes"] for m in memory[world_size][PLAIN_DP])
                shares.append(
                    f"{world_size} ranks: {_mib(state[ours])} / {_mib(plain)} MiB = "
                    f"**{state[ours] / plain * 100:.0f}%**"
                )
    lines += [
        "",
        "ZeRO-3's parameters + gradients + optimizer state per rank, against plain data parallelism's (autopar, "
        "`zero=0`, measured the same way): " + "; ".join(shares) + " (target ≤ 35% on 4 ranks); the prediction is "
        "`plan.cost.memory` params + grads + optimizer for the same plan (target within 20%).",
    ]
    lines += [
        "",
        "Equivalence check (passed): per pair, global-batch losses of steps 1 and 2, and every full gradient "
        "of step 1 (as in the step-time section).",
        "",
        *losses_table(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer steps; print, do not write")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else dataclasses.replace(FULL, rounds=10)
    command = "python benchmarks/zero.py" + (" --quick" if args.quick else "")
    start = time.monotonic()
    results, memory = {}, {}
    for world_size in WORLD_SIZES:
        print(f"[zero] {world_size} ranks: timing ...", flush=True)
        results[world_size] = run_local(bench_rank, world_size, settings, timeout_s=settings.timeout_s)[0]
        memory[world_size] = {}
        for name in (*(n for pair in PAIRS for n in pair[1:]), PLAIN_DP):
            print(f"[zero] {world_size} ranks: memory of {name} ...", flush=True)
            memory[world_size][name] = run_local(memory_rank, world_size, settings, name, timeout_s=300)
    section = render_section(results, memory, settings, command, time.monotonic() - start)
    publish(SECTION, section, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
