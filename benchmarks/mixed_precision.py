"""Mixed precision in autopar against torch FSDP2, side by side in one run, on 2 and 4 local gloo ranks.

The GPT example (``examples/gpt.py``), AdamW, data parallel with ZeRO-3 both ways:

- bf16-mixed: autopar (``precision="bf16-mixed"``, ``degrees={"dp": N, "tp": 1}``, the plan's
  stage set to 3) against FSDP2, ``fully_shard(..., mp_policy=MixedPrecisionPolicy(
  param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`` on every transformer block and on
  the root: fp32 masters sharded, bf16 all-gathers and compute, fp32 reduce-scatters;
- fp32, the same two without mixed precision, timed in the same rounds: what bf16 itself
  costs or saves on this machine.

Timing follows ``step_time.py``: the two of a pair must agree on the losses of their first two
steps and on every full gradient of the first (bf16 pair: within 16 units of bf16's rounding,
2^-4 of the largest entry, as tests/equivalence/test_mixed_precision.py argues; fp32 pair: rtol
1e-4); then rounds alternate the order within a pair, a barrier starts each step, a step's time
is the slowest rank's and the figure is the median (also shown: the median over rounds of the
ratio within a round, less sensitive to drift on this shared machine).

Run from the repository root::

    python benchmarks/mixed_precision.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/mixed_precision.py --quick    # smoke run on a smaller model; prints, writes nothing
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).parent))
from parallel_kernels import _median_s, _round_ratio  # noqa: E402
from step_time import (  # noqa: E402
    FULL,
    LOSS_RTOL,
    LR,
    QUICK,
    SEED,
    _load_gpt,
    check_equivalence,
    losses_table,
    main_per_world_size,
    time_rounds,
)
from zero import autopar_zero, torch_fsdp2  # noqa: E402

SECTION = "mixed_precision"
TARGET_RATIO = 1.05  # autopar bf16-mixed at most 5% slower than FSDP2 with the same policy
BF16_RTOL = 16 * 2.0**-8  # 16 units of bf16's rounding
PAIRS = (
    ("bf16-mixed, ZeRO-3", "autopar bf16-mixed", "torch FSDP2 bf16-mixed"),
    ("fp32, ZeRO-3", "autopar fp32", "torch FSDP2 fp32"),
)


def bench_rank(rank: int, world_size: int, settings) -> dict:
    torch.manual_seed(SEED)
    model = _load_gpt().build(**settings.model)
    global_inputs = model.example_inputs(settings.batch)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    competitors = {}
    for precision, policy in (("bf16-mixed", bf16), ("fp32", None)):
        ours, theirs = f"autopar {precision}", f"torch FSDP2 {precision}"
        competitors[ours] = autopar_zero(model, global_inputs, world_size, 3, precision, name=ours)
        competitors[theirs] = torch_fsdp2(model, global_inputs, rank, world_size, policy, name=theirs)
    mixed, plain = PAIRS[:1], PAIRS[1:]
    losses = check_equivalence(
        {name: competitors[name] for name in mixed[0][1:]}, pairs=mixed, loss_rtol=BF16_RTOL, grad_rtol=BF16_RTOL
    )
    losses |= check_equivalence({name: competitors[name] for name in plain[0][1:]}, pairs=plain)
    return {"losses": losses, "rounds": time_rounds(competitors, settings, PAIRS)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def render_section(results: dict[int, dict], settings, command: str, elapsed_s: float) -> str:
    model = settings.model
    with torch.device("meta"):
        parameters = sum(p.numel() for p in _load_gpt().build(**model).parameters())
    lines = [
        "## Mixed precision: autopar bf16-mixed vs torch FSDP2 with MixedPrecisionPolicy(bf16, fp32)",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all)",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} shared cores, CPU, gloo, one torch thread per rank; 4 ranks on 2 cores are "
        "oversubscribed (2 processes per core), so the 4-rank rows measure contention as much as parallelism. "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"- model: examples/gpt.py `build({', '.join(f'{k}={v}' for k, v in model.items())})` "
        f"({parameters / 1e6:.2f} M parameters), global batch {settings.batch} x seq {model['seq']}, AdamW lr {LR}.",
        '- autopar: the data-parallel plan with `zero=3` and `precision="bf16-mixed"` (fp32 masters sharded over '
        "dp, their bf16 copies cast once per step, all-gathered per layer in bf16, gradients reduce-scattered in "
        "fp32), `pmodel.optimizer(AdamW)`. FSDP2: `fully_shard` per block and root with "
        "`MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`, "
        "`torch.optim.AdamW(model.parameters())`. The fp32 rows: the same two without a policy.",
        f"- step: forward + backward + AdamW step + zero_grad; {settings.rounds} rounds of {settings.steps_per_round} "
        "steps per competitor after warm-up, pairs in alternating order, a barrier before each step, slowest rank, "
        "median.",
        "",
        "| ranks | comparison | autopar ms | FSDP2 ms | ratio autopar/FSDP2 | median per-round ratio | target | met? |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    medians = {}
    for world_size, result in results.items():
        for comparison, ours, theirs in PAIRS:
            ours_s, theirs_s = _median_s(result, ours), _median_s(result, theirs)
            medians[world_size, ours], medians[world_size, theirs] = ours_s, theirs_s
            ratio = ours_s / theirs_s
            target = f"≤ {TARGET_RATIO:.2f}" if comparison.startswith("bf16") else "-"
            met = ("yes" if ratio <= TARGET_RATIO else "**no**") if comparison.startswith("bf16") else "-"
            lines.append(
                f"| {world_size} | {comparison} | {_ms(ours_s)} | {_ms(theirs_s)} | {ratio:.2f} | "
                f"{_round_ratio(result, ours, theirs):.2f} | {target} | {met} |"
            )
    lines += [
        "",
        "bf16-mixed against fp32 on this CPU, same run (step time ratio bf16-mixed / fp32): "
        + "; ".join(
            f"{world_size} ranks: autopar {medians[world_size, PAIRS[0][1]] / medians[world_size, PAIRS[1][1]]:.2f}, "
            f"FSDP2 {medians[world_size, PAIRS[0][2]] / medians[world_size, PAIRS[1][2]]:.2f}"
            for world_size in results
        )
        + ".",
        "",
        f"Equivalence check (passed): per pair, the global-batch losses of steps 1 and 2 and every full gradient of "
        f"step 1, within {BF16_RTOL:.4f} (16 units of bf16's rounding) of the largest entry for the bf16-mixed pair "
        f"and {LOSS_RTOL} for the fp32 pair.",
        "",
        *losses_table(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return main_per_world_size("mixed_precision", __doc__, bench_rank, render_section, SECTION, argv, QUICK, FULL)


if __name__ == "__main__":
    sys.exit(main())
