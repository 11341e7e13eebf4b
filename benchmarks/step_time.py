"""Step time of autopar against torch, side by side in one run, on 2 and 4 local gloo ranks.

Two comparisons on the GPT example (``examples/gpt.py``), fp32, AdamW:

- data parallel: ``autopar.parallelize(..., degrees={"dp": N, "tp": 1})`` against
  ``torch.nn.parallel.DistributedDataParallel``, each rank on the same slice of the batch;
- tensor parallel: autopar with the Megatron constraints below, ``degrees={"dp": 1, "tp": N}``,
  against ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` on
  wq/wk/wv/fc1 and ``RowwiseParallel`` on wo/fc2, the full batch on every rank.

A step is forward + backward + ``AdamW.step()`` + ``zero_grad()``. Every competitor starts
from the same weights and sees the same data, so the two of a pair must agree on the losses
of their first two steps and on every full gradient of the first; the script fails loudly
otherwise (timing two programs that compute different things is worthless). After warm-up,
rounds alternate the order of the two competitors of a pair, so drift on a shared machine
hits both alike. Each step starts after a barrier; its time is the slowest rank's. The
figure is the median over all timed steps.

Run from the repository root::

    python benchmarks/step_time.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/step_time.py --quick    # smoke run on a smaller model; prints, writes nothing
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from publish import publish  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "step_time"  # its part of BENCHMARKS.md, between <!-- step_time:begin/end --> markers

WORLD_SIZES = (2, 4)
TARGET_RATIO = 1.10  # autopar may be at most 10 % slower than torch
LOSS_RTOL = 1e-4
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7  # of a gradient's largest entry (fp32 sums in another order)
EQUIVALENCE_STEPS = 2  # the first steps of every competitor, checked pairwise
LR = 1e-3
SEED = 0

MEGATRON_TP = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}


@dataclass(frozen=True)
class Settings:
    """What one run measures: the model, the batch and how many steps."""

    model: dict  # keyword arguments of examples/gpt.py:build
    batch: int  # global batch size
    warmup_steps: int  # untimed steps per competitor, the EQUIVALENCE_STEPS checked ones included
    rounds: int
    steps_per_round: int
    timeout_s: float  # for all world sizes together


FULL = Settings(
    model=dict(hidden=256, layers=2, heads=8, vocab=1024, seq=128),
    batch=8,
    warmup_steps=3,
    rounds=20,
    steps_per_round=2,
    timeout_s=900,
)
QUICK = Settings(
    model=dict(hidden=64, layers=1, heads=4, vocab=256, seq=32),
    batch=4,
    warmup_steps=2,
    rounds=2,
    steps_per_round=2,
    timeout_s=300,
)

# (comparison, autopar competitor, torch competitor)
PAIRS = (("data parallel", "autopar DP", "torch DDP"), ("tensor parallel", "autopar TP", "torch TP"))


# --------------------------------------------------------------------------- competitors


def _load_gpt():
    spec = importlib.util.spec_from_file_location("autopar_examples_gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Competitor:
    """One way to train the model on this rank.

    ``forward_backward()`` returns the loss as this rank computed it; ``global_loss`` turns
    that into the loss of the global batch, ``full_grads`` gives every parameter's complete
    gradient by the model's own parameter name (collective: all ranks call it together).
    """

    name: str
    module: nn.Module
    forward_backward: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    global_loss: Callable[[torch.Tensor], float]
    name_prefix: str = ""  # DDP registers the model's parameters under "module."

    def step(self) -> torch.Tensor:
        """forward + backward + optimizer step + zero_grad: what is timed."""
        loss = self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def full_grads(self) -> dict[str, torch.Tensor]:
        grads = {}
        for name, param in self.module.named_parameters():
            grad = param.grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            grads[name.removeprefix(self.name_prefix)] = grad
        return grads


def _backward(module: nn.Module, inputs) -> Callable[[], torch.Tensor]:
    def forward_backward() -> torch.Tensor:
        loss = module(*inputs)
        loss.backward()
        return loss.detach()

    return forward_backward


def _as_is(loss: torch.Tensor) -> float:
    return loss.item()


def _mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def _ddp_local_batch(global_inputs, rank: int, world_size: int):
    return tuple(value.chunk(world_size, dim=0)[rank].contiguous() for value in global_inputs)


def _adamw(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW as each library's users build it: autopar's over its local shards."""
    if hasattr(module, "optimizer") and callable(module.optimizer):
        return module.optimizer(torch.optim.AdamW, lr=LR)
    return torch.optim.AdamW(module.parameters(), lr=LR)


def build_competitors(model, global_inputs, rank: int, world_size: int) -> dict[str, Competitor]:
    """The four competitors, each on its own copy of ``model`` (so all start from its weights)."""
    dp = autopar.parallelize(copy.deepcopy(model), world_size, global_inputs, degrees={"dp": world_size, "tp": 1})
    dp_batch = dp.shard_batch(*global_inputs)
    ddp_batch = _ddp_local_batch(global_inputs, rank, world_size)
    if not all(torch.equal(a, b) for a, b in zip(dp_batch, ddp_batch)):
        raise AssertionError("autopar's data-parallel slice of the batch differs from DDP's on this rank")
    ddp = DistributedDataParallel(copy.deepcopy(model))

    tp = autopar.parallelize(
        copy.deepcopy(model), world_size, global_inputs, degrees={"dp": 1, "tp": world_size}, constraints=MEGATRON_TP
    )
    tp_batch = tp.shard_batch(*global_inputs)
    if not all(torch.equal(a, b) for a, b in zip(tp_batch, global_inputs)):
        raise AssertionError("autopar's tensor-parallel plan does not give every rank the full batch")
    torch_tp = copy.deepcopy(model)
    plan = {}
    for index in range(len(torch_tp.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            plan[f"layers.{index}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.fc2"):
            plan[f"layers.{index}.{name}"] = RowwiseParallel()
    parallelize_module(torch_tp, init_device_mesh("cpu", (world_size,)), plan)

    competitors = [
        Competitor("autopar DP", dp, lambda: dp.train_step(*dp_batch), _adamw(dp), _as_is),
        Competitor("torch DDP", ddp, _backward(ddp, ddp_batch), _adamw(ddp), _mean_over_ranks, "module."),
        Competitor("autopar TP", tp, lambda: tp.train_step(*tp_batch), _adamw(tp), _as_is),
        Competitor("torch TP", torch_tp, _backward(torch_tp, global_inputs), _adamw(torch_tp), _as_is),
    ]
    return {competitor.name: competitor for competitor in competitors}


# --------------------------------------------------------------------------- one rank


def _timed_step(competitor: Competitor) -> float:
    dist.barrier()
    start = time.perf_counter()
    competitor.step()
    return time.perf_counter() - start


def _slowest_rank(seconds: list[float]) -> list[float]:
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def check_equivalence(
    competitors: dict[str, Competitor],
    steps: int = EQUIVALENCE_STEPS,
    pairs=PAIRS,
    loss_rtol: float = LOSS_RTOL,
    grad_rtol: float = GRAD_RTOL,
) -> dict[str, list[float]]:
    """Run the first ``steps`` steps of every competitor; each pair must agree on every loss and,
    after the first backward, on every full gradient (a gradient off by a constant factor barely
    moves AdamW's next loss, so the losses alone would not catch it), within ``loss_rtol`` and
    ``grad_rtol`` of the largest entry. Returns the losses."""
    losses = {name: [] for name in competitors}
    first_grads = {}
    for step in range(steps):
        for name, competitor in competitors.items():
            losses[name].append(competitor.global_loss(competitor.forward_backward()))
            if step == 0:
                first_grads[name] = competitor.full_grads()
            competitor.optimizer.step()
            competitor.optimizer.zero_grad()
    for comparison, ours, theirs in pairs:
        for step, (a, b) in enumerate(zip(losses[ours], losses[theirs]), start=1):
            if abs(a - b) > loss_rtol * abs(b):
                _not_equivalent(comparison, f"step {step} loss: {ours} {a:.8f} vs {theirs} {b:.8f}")
        if first_grads[ours].keys() != first_grads[theirs].keys():
            _not_equivalent(
                comparison, f"parameters differ: {sorted(first_grads[ours].keys() ^ first_grads[theirs].keys())}"
            )
        for name, expected in first_grads[theirs].items():
            actual = first_grads[ours][name]
            if (actual is None) != (expected is None):
                _not_equivalent(comparison, f"{name}.grad is None in one of {ours}, {theirs} only")
            if expected is None:
                continue
            error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
            if error > grad_rtol * scale + GRAD_ATOL:
                _not_equivalent(
                    comparison,
                    f"step 1 gradient of {name}: max |{ours} - {theirs}| = {error:.3e}, max |{theirs}| = {scale:.3e}",
                )
    return losses


def _not_equivalent(comparison: str, what: str) -> None:
    raise AssertionError(f"{comparison}: {what}; the programs are not equivalent, so their timings cannot be compared")


def bench_rank(rank: int, world_size: int, settings: Settings) -> dict:
    """Everything one rank does; every rank returns the same (slowest-rank) timings."""
    gpt = _load_gpt()
    torch.manual_seed(SEED)
    model = gpt.build(**settings.model)
    global_inputs = model.example_inputs(settings.batch)
    competitors = build_competitors(model, global_inputs, rank, world_size)

    losses = check_equivalence(competitors)
    return {"losses": losses, "rounds": time_rounds(competitors, settings)}


def time_rounds(competitors: dict[str, Competitor], settings: Settings, pairs=PAIRS) -> dict[str, list[list[float]]]:
    """Warm up (beyond the checked steps), then time ``settings.rounds`` rounds, each pair's
    order alternating: per competitor, a list of rounds, each the slowest rank's step seconds."""
    for _ in range(settings.warmup_steps - EQUIVALENCE_STEPS):
        for competitor in competitors.values():
            _timed_step(competitor)
    rounds: dict[str, list[list[float]]] = {name: [] for name in competitors}
    for round_index in range(settings.rounds):
        for _, ours, theirs in pairs:
            order = (ours, theirs) if round_index % 2 == 0 else (theirs, ours)
            for name in order:
                seconds = [_timed_step(competitors[name]) for _ in range(settings.steps_per_round)]
                rounds[name].append(_slowest_rank(seconds))
    return rounds


# --------------------------------------------------------------------------- spawning


# --------------------------------------------------------------------------- report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def losses_table(results: dict[int, dict]) -> list[str]:
    """The losses ``check_equivalence`` returned, per world size and competitor, as table lines."""
    lines = ["| ranks | competitor | loss step 1 | loss step 2 |", "| ---: | --- | ---: | ---: |"]
    for world_size, result in results.items():
        for name, losses in result["losses"].items():
            lines.append(f"| {world_size} | {name} | {losses[0]:.6f} | {losses[1]:.6f} |")
    return lines


def render_section(results: dict[int, dict], settings: Settings, command: str, elapsed_s: float) -> str:
    """The body of this script's BENCHMARKS.md section for ``results[world_size]``."""
    model = settings.model
    gpt = _load_gpt()
    with torch.device("meta"):
        parameters = sum(p.numel() for p in gpt.build(**model).parameters())
    lines = [
        "## Step time: autopar vs torch DDP and torch tensor parallel",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all)",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, shared with other jobs and noisy; CPU, gloo, one torch thread per rank; "
        "4 ranks on 2 cores are oversubscribed (2 processes per core), so the 4-rank rows measure contention "
        f"as much as parallelism. torch {torch.__version__}, Python {platform.python_version()}.",
        f"- model: examples/gpt.py `build({', '.join(f'{k}={v}' for k, v in model.items())})` "
        f"(ffn {4 * model['hidden']}, {parameters / 1e6:.2f} M parameters), fp32, global batch {settings.batch} "
        f"x seq {model['seq']}; AdamW lr {LR} (autopar: `pmodel.optimizer(torch.optim.AdamW)`, stepping its "
        "local shards as plain tensors; torch: `torch.optim.AdamW(model.parameters())`; both torch's default foreach).",
        f"- step: forward + backward + AdamW step + zero_grad. After {settings.warmup_steps} warm-up steps, "
        f"{settings.rounds} rounds of {settings.steps_per_round} steps per competitor, the two of a pair in "
        "alternating order; a barrier before each step; a step's time is the slowest rank's; "
        f"the figure is the median of the {settings.rounds * settings.steps_per_round} timed steps.",
        "- DP: autopar `degrees={dp: N, tp: 1}` vs `DistributedDataParallel`, each rank on the same 1/N of the batch. "
        "TP: autopar `degrees={dp: 1, tp: N}` with the Megatron constraints "
        "(`w[qkv]`, `fc1`: S(-1); `wo`, `fc2`: P) vs `parallelize_module` with ColwiseParallel on wq/wk/wv/fc1 "
        "and RowwiseParallel on wo/fc2; full batch on every rank.",
        "",
        "| ranks | comparison | autopar median ms | torch median ms | ratio autopar/torch | target | met? |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for world_size, result in results.items():
        for comparison, ours, theirs in PAIRS:
            ours_ms = statistics.median(t for r in result["rounds"][ours] for t in r)
            theirs_ms = statistics.median(t for r in result["rounds"][theirs] for t in r)
            ratio = ours_ms / theirs_ms
            met = "yes" if ratio <= TARGET_RATIO else "**no**"
            lines.append(
                f"| {world_size} | {comparison} | {_ms(ours_ms)} | {_ms(theirs_ms)} | {ratio:.2f} | "
                f"≤ {TARGET_RATIO:.2f} | {met} |"
            )
    lines += [
        "",
        f"Equivalence check (passed): per pair, the loss of the global batch at steps 1 and 2 within rtol {LOSS_RTOL}, "
        f"and every full gradient after step 1 within {GRAD_RTOL} of that gradient's largest entry.",
        "",
        *losses_table(results),
    ]
    lines += [
        "",
        "Raw per-round medians, ms (slowest rank per step); the last column is the median over rounds of "
        "the ratio autopar/torch within a round, less sensitive to drift than the ratio of medians:",
        "",
        "| ranks | competitor | per-round medians | median per-round ratio |",
        "| ---: | --- | --- | ---: |",
    ]
    for world_size, result in results.items():
        for _, ours, theirs in PAIRS:
            medians = {name: [statistics.median(r) for r in result["rounds"][name]] for name in (ours, theirs)}
            paired = statistics.median(a / b for a, b in zip(medians[ours], medians[theirs]))
            for name in (ours, theirs):
                ratio = f"{paired:.2f}" if name == ours else ""
                lines.append(f"| {world_size} | {name} | {' '.join(_ms(m) for m in medians[name])} | {ratio} |")
    return "\n".join(lines)


def main_per_world_size(script: str, doc: str, bench_rank, render_section, section: str, argv, quick, full) -> int:
    """The ``main`` of a benchmark that runs ``bench_rank(rank, world, settings)`` once per world
    size (one spawn each, within the settings' timeout) and writes ``section`` from
    ``render_section(results, settings, command, seconds)``; ``--quick``: ``quick``, printed only."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer steps; print, do not write")
    args = parser.parse_args(argv)
    settings = quick if args.quick else full
    command = f"python benchmarks/{script}.py" + (" --quick" if args.quick else "")
    start = time.monotonic()
    results = {}
    for world_size in WORLD_SIZES:
        print(f"[{script}] {world_size} ranks ...", flush=True)
        results[world_size] = run_local(bench_rank, world_size, settings, timeout_s=settings.timeout_s)[0]
    publish(section, render_section(results, settings, command, time.monotonic() - start), args.quick)
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_per_world_size("step_time", __doc__, bench_rank, render_section, SECTION, argv, QUICK, FULL)


if __name__ == "__main__":
    sys.exit(main())
