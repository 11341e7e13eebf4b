"""Pipeline parallelism: autopar's pipelined plan against a hand split with torch.distributed.pipelining.

    python benchmarks/pipeline.py            # 2 and 4 ranks, rewrites its section of BENCHMARKS.md
    python benchmarks/pipeline.py --quick    # smoke run; prints, writes nothing

The GPT example (8 layers) runs in one stage per rank, 1F1B, 4 microbatches, both ways:
autopar ``parallelize(degrees={"pp": N, "dp": 1, "tp": 1}, pipeline="1f1b", microbatches=4)``
with the cuts pinned to an even split, and the same split written by hand (embeddings with
the first layers, norm and head with the last, the loss as the schedule's ``loss_fn``) on
``PipelineStage`` + ``Schedule1F1B``. Both must agree on the first two losses and on every
gradient of the first step before anything is timed. Then rounds alternate the two, a barrier
before each step (forward + backward + AdamW step + zero_grad), slowest rank, median.
Memory: the parameters, gradients and AdamW state each rank holds.
"""

from __future__ import annotations

import copy
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import autopar

sys.path.insert(0, str(Path(__file__).parent))
from measure import model_state_bytes  # noqa: E402
from step_time import (  # noqa: E402
    LR,
    SEED,
    TARGET_RATIO,
    Competitor,
    Settings,
    _as_is,
    _load_gpt,
    check_equivalence,
    main_per_world_size,
    time_rounds,
)

SECTION = "pipeline"
MICROBATCHES = 4
PAIRS = (("pipeline 1F1B", "autopar PP", "torch PP"),)
FULL = Settings(
    model=dict(hidden=256, layers=8, heads=8, vocab=1024, seq=128),
    batch=8,
    warmup_steps=3,
    rounds=10,
    steps_per_round=2,
    timeout_s=900,
)
QUICK = Settings(
    model=dict(hidden=64, layers=4, heads=4, vocab=256, seq=32),
    batch=4,
    warmup_steps=2,
    rounds=2,
    steps_per_round=2,
    timeout_s=300,
)


class HandStage(nn.Module):
    """One rank's share of the GPT, as a pipelining user writes it: layers keep their global
    names (``layers.5``), so gradients compare by the model's own parameter names."""

    def __init__(self, model, stage: int, stages: int):
        super().__init__()
        per = len(model.layers) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok_embeddings, self.pos_embeddings = model.tok_embeddings, model.pos_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(stage * per, (stage + 1) * per)})
        if self.last:
            self.norm, self.output = model.norm, model.output

    def forward(self, h):
        if self.first:
            h = self.tok_embeddings(h) + self.pos_embeddings(torch.arange(h.shape[1]))
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.last else h


def _cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _hand_split(model, global_inputs, rank: int, world_size: int) -> Competitor:
    stage = HandStage(copy.deepcopy(model), rank, world_size)
    schedule = Schedule1F1B(
        PipelineStage(stage, rank, world_size, torch.device("cpu")), MICROBATCHES, loss_fn=_cross_entropy
    )
    tokens, labels = global_inputs

    def forward_backward():
        losses = []
        if stage.first:
            schedule.step(tokens)
        elif stage.last:
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # only the last stage has it: share it
        return loss

    return Competitor("torch PP", stage, forward_backward, torch.optim.AdamW(stage.parameters(), lr=LR), _as_is)


def _autopar(model, global_inputs, world_size: int) -> Competitor:
    per = len(model.layers) // world_size
    pmodel = autopar.parallelize(
        copy.deepcopy(model),
        world_size,
        global_inputs,
        degrees={"pp": world_size, "dp": 1, "tp": 1},
        pipeline="1f1b",
        microbatches=MICROBATCHES,
        stage_cuts=[f"layers.{per * k}" for k in range(1, world_size)],
    )
    batch = pmodel.shard_batch(*global_inputs)
    return Competitor(
        "autopar PP", pmodel, lambda: pmodel.train_step(*batch), pmodel.optimizer(torch.optim.AdamW, lr=LR), _as_is
    )


def _state_bytes(competitor: Competitor) -> int:
    """Parameters, gradients and optimizer state this rank holds after a step."""
    competitor.forward_backward()
    competitor.optimizer.step()
    held = model_state_bytes(competitor)
    competitor.optimizer.zero_grad()
    return held


def bench_rank(rank: int, world_size: int, settings: Settings) -> dict:
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.model)
    global_inputs = model.example_inputs(settings.batch)
    competitors = {
        "autopar PP": _autopar(model, global_inputs, world_size),
        "torch PP": _hand_split(model, global_inputs, rank, world_size),
    }
    losses = check_equivalence(competitors, pairs=PAIRS)
    rounds = time_rounds(competitors, settings, PAIRS)
    peaks = {name: _state_bytes(competitor) for name, competitor in competitors.items()}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, peaks)
    return {"losses": losses, "rounds": rounds, "peaks": gathered}


def render_section(results, settings: Settings, command: str, elapsed_s: float) -> str:
    model = settings.model
    lines = [
        "## Pipeline parallelism: autopar vs a hand split with torch.distributed.pipelining",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all); date "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, CPU, gloo, one torch thread per rank; 4 ranks on 2 cores are "
        "oversubscribed. "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"- model: examples/gpt.py `build({', '.join(f'{k}={v}' for k, v in model.items())})`, fp32, global batch "
        f"{settings.batch}, AdamW lr {LR}; one stage per rank, 1F1B, {MICROBATCHES} microbatches; autopar with "
        "`degrees={'pp': N, 'dp': 1, 'tp': 1}, pipeline='1f1b'` and the cuts pinned to the hand split's (even).",
        f"- step: forward + backward + AdamW step + zero_grad; {settings.rounds} rounds of {settings.steps_per_round} "
        "steps "
        "per competitor after warm-up, alternating order, a barrier before each step, slowest rank, median. Losses of "
        "the first two steps and every gradient of the first checked equal before timing.",
        "- memory: parameters + gradients + AdamW state a rank holds after a step (each storage once); the largest "
        "rank.",
        "",
        "| ranks | autopar ms | torch ms | ratio | target | met? | autopar state MiB | torch state MiB | loss step 1 "
        "(autopar / torch) |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for world_size, result in results.items():
        ours, theirs = (
            statistics.median(t for r in result["rounds"][n] for t in r) for n in ("autopar PP", "torch PP")
        )
        peak = {n: max(p[n] for p in result["peaks"]) / 2**20 for n in ("autopar PP", "torch PP")}
        ratio = ours / theirs
        losses = result["losses"]
        lines.append(
            f"| {world_size} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ratio:.2f} | ≤ {TARGET_RATIO:.2f} | "
            f"{'yes' if ratio <= TARGET_RATIO else '**no**'} | {peak['autopar PP']:.1f} | {peak['torch PP']:.1f} | "
            f"{losses['autopar PP'][0]:.6f} / {losses['torch PP'][0]:.6f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return main_per_world_size("pipeline", __doc__, bench_rank, render_section, SECTION, argv, QUICK, FULL)


if __name__ == "__main__":
    sys.exit(main())
