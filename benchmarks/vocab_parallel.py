"""The vocabulary split against gathered logits: memory and step time, on 4 local gloo ranks.

The GPT example (``examples/gpt.py``) with a large vocabulary, Megatron's tensor parallelism
over 4 ranks, the embedding split by rows and the output projection by columns in both programs:

- **vocab split**: the loss runs over the split class dim (``"<top>": "vocab"``, the
  ``autopar::vocab_cross_entropy`` kernel): no rank holds the full logits;
- **logits gathered**: the logits are all-gathered before a plain cross-entropy (``"<top>": "R"``),
  what a tensor-parallel plan without ``loss_parallel`` does.

Memory is ``measure.measure_memory`` (the allocator's peak during one step on top of the named
tensors, and the bytes autograd saves), largest rank; timing follows ``step_time.py`` (the pair
checked equivalent first, alternating order, a barrier per step, slowest rank, median). Plans are
made once in the parent; their ``cost`` gives the predictions.

Run from the repository root::

    python benchmarks/vocab_parallel.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/vocab_parallel.py --quick    # smoke run on a smaller model; prints, writes nothing
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

import autopar
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from cost_model import _loadavg  # noqa: E402
from measure import measure_memory  # noqa: E402
from parallel_kernels import _profile  # noqa: E402
from publish import publish  # noqa: E402
from step_time import (  # noqa: E402
    FULL,
    LR,
    MEGATRON_TP,
    QUICK,
    SEED,
    Competitor,
    _as_is,
    _load_gpt,
    check_equivalence,
    time_rounds,
)

SECTION = "vocab_parallel"
WORLD = 4
MiB = 2**20
SETTINGS = {
    False: dataclasses.replace(FULL, model=dict(hidden=128, layers=2, heads=4, vocab=32768, seq=256), rounds=8),
    True: dataclasses.replace(QUICK, model=dict(hidden=64, layers=1, heads=4, vocab=4096, seq=64)),
}
SPLIT, GATHERED = "vocab split", "logits gathered"
LAYOUT = {**MEGATRON_TP, "tok_embeddings": "vocab", "output": "S(-1)"}
CONSTRAINTS = {SPLIT: {**LAYOUT, "<top>": "vocab"}, GATHERED: {**LAYOUT, "<top>": "R"}}
LOSS_OP = {SPLIT: "autopar.vocab_cross_entropy.default", GATHERED: "aten.cross_entropy_loss.default"}
PAIRS = (("vocabulary", SPLIT, GATHERED),)


def _model(settings):
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.model)
    return model, model.example_inputs(settings.batch)


def make_plans(settings) -> dict:
    model, inputs = _model(settings)
    return {
        name: autopar.plan(model, WORLD, inputs, degrees={"tp": WORLD}, constraints=constraints, hardware=_profile())
        for name, constraints in CONSTRAINTS.items()
    }


def rank(rank: int, world: int, settings, plans: dict) -> dict:
    """Both programs: the loss op each runs, equivalence, memory of one step, timing."""
    model, inputs = _model(settings)
    competitors, batches = {}, {}
    for name, plan in plans.items():
        pmodel = autopar.parallelize(copy.deepcopy(model), WORLD, inputs, plan=plan)
        if LOSS_OP[name] not in {str(node.target) for node in pmodel.program.graph.nodes}:
            raise AssertionError(f"{name}: the program does not run {LOSS_OP[name]}")
        batches[name] = pmodel.shard_batch(*inputs)
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
        step = (lambda p, b: lambda: p.train_step(*b))(pmodel, batches[name])
        competitors[name] = Competitor(name, pmodel, step, optimizer, _as_is)
    losses = check_equivalence(competitors, pairs=PAIRS)
    memory = {}
    for name, competitor in competitors.items():
        measured = [None] * world
        dist.all_gather_object(measured, measure_memory(competitor.module, competitor.optimizer, batches[name]))
        memory[name] = measured
    return {"losses": losses, "memory": memory, "rounds": time_rounds(competitors, settings, PAIRS)}


def _median_s(result: dict, name: str) -> float:
    return statistics.median(t for r in result["rounds"][name] for t in r)


def render(settings, result: dict, plans: dict, command: str, elapsed_s: float, loads: str) -> str:
    rows = []
    worst = {
        name: {k: max(r[k] for r in result["memory"][name]) for k in ("peak_step", "saved_activations")}
        for name in plans
    }
    for name, plan in plans.items():
        peak, step_s = worst[name]["peak_step"], _median_s(result, name)
        rows.append(
            f"| {name} | {peak / MiB:.0f} | {peak / worst[GATHERED]['peak_step']:.2f} "
            f"| {worst[name]['saved_activations'] / MiB:.0f} | {plan.cost.peak_memory / MiB:.0f} "
            f"| {step_s * 1e3:.0f} | {step_s / _median_s(result, GATHERED):.2f} "
            f"| {plan.cost.step_s * 1e3:.0f} | {result['losses'][name][0]:.6f} |"
        )
    model, batch = settings.model, settings.batch
    logits = batch * model["seq"] * model["vocab"] * 4
    return "\n".join(
        [
            "## Vocabulary parallelism: the loss over split classes vs gathered logits",
            "",
            f"- command: `{command}` ({elapsed_s:.0f} s in all); date "
            f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"- machine: {os.cpu_count()} cores, shared (load average {loads}); CPU, gloo, one torch thread per rank; "
            f"{WORLD} ranks on {os.cpu_count()} cores are oversubscribed. torch {torch.__version__}, "
            f"Python {platform.python_version()}.",
            f"- model: examples/gpt.py `build({', '.join(f'{k}={v}' for k, v in model.items())})`, global batch "
            f"{batch}, fp32: the full logits are {logits / MiB:.0f} MiB. Both programs: `degrees={{'tp': {WORLD}}}`, "
            "Megatron's layer pins, `tok_embeddings` as the vocab kernel, `output` split by columns; **vocab split** "
            "adds `'<top>': 'vocab'`, **logits gathered** `'<top>': 'R'`.",
            "- peak = the allocator's peak during one `train_step` + AdamW step on top of the named tensors "
            "(`measure.measure_memory`), saved = bytes autograd saves for backward; largest rank. Predicted = "
            f"`plan.cost.peak_memory` / `step_s` (profile `{_profile()}`). Step: median of the slowest rank over "
            f"{settings.rounds} rounds of {settings.steps_per_round} steps, after the pair agreed on two steps' "
            "losses and the first step's full gradients.",
            "",
            "| program | peak MiB | ratio | saved MiB | predicted peak MiB | step ms | ratio | predicted step ms | "
            "first loss |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps; print, do not write")
    args = parser.parse_args(argv)
    settings = SETTINGS[args.quick]
    command = "python benchmarks/vocab_parallel.py" + (" --quick" if args.quick else "")
    start, load_start = time.monotonic(), _loadavg()
    plans = make_plans(settings)
    result = run_local(rank, WORLD, settings, plans, timeout_s=settings.timeout_s)[0]
    loads = f"{load_start} → {_loadavg()}"
    publish(SECTION, render(settings, result, plans, command, time.monotonic() - start, loads), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
