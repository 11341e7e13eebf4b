"""The cost model at cluster scale, against published figures.

    python benchmarks/published.py

1. Megatron-LM's GPT weak-scaling runs (``shared/reference/published-megatron-a100.json``:
   Narayanan et al., SC'21, Table 1): each row's model is built from ``examples/gpt.py`` on
   the meta device in bfloat16, planned with its published degrees pinned (tp, pp, dp),
   full recomputation, no ZeRO, on the ``a100-80gb`` preset, and its predicted step time
   turned into TFLOP/s per GPU with the paper's own FLOP count. One set of efficiency
   factors (the preset's) for every row.
2. The ZeRO paper's worked example (Rajbhandari et al., 2020, Figure 1): 7.5B parameters,
   mixed-precision Adam, 64 data-parallel ranks, model state per device for stages 0-3.
3. The planning process's peak resident memory, for all of the above.

Writes the "published" section of BENCHMARKS.md.
"""

import datetime
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import torch

import autopar
from autopar.ir.precision import ZERO_PAPER_LAYOUT, model_state_bytes

sys.path.insert(0, str(Path(__file__).parent))
from publish import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "published-megatron-a100.json"
VOCAB, SEQ = 51200, 2048
TARGET_ERROR = 0.15
ZERO_PAPER_GB = (120, 31.4, 16.6, 1.88)  # stages 0..3, 7.5B parameters, 64 ranks
TARGET_ZERO_ERROR = 0.02


def load_gpt():
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_flops(row: dict) -> float:
    """The paper's FLOPs per iteration (counts the recomputed forward)."""
    b, layers, h = row["global_batch"], row["layers"], row["hidden"]
    return 96 * b * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))


def predict(gpt, row: dict) -> dict:
    started = time.perf_counter()
    with torch.device("meta"):
        model = gpt.build(hidden=row["hidden"], layers=row["layers"], heads=row["heads"], vocab=VOCAB, seq=SEQ).to(
            torch.bfloat16
        )
    local_batch = row["global_batch"] // row["dp"]
    # pipelined: the search picks the microbatches; else the fewest that fit (gradient
    # accumulation, which Megatron's runs without pipelines use for these batches too)
    counts = [None] if row["pp"] > 1 else [m for m in range(1, local_batch + 1) if local_batch % m == 0]
    for microbatches in counts:
        try:
            plan = autopar.plan(
                model,
                (row["gpus"] // 8, 8),
                model.example_inputs(row["global_batch"], device="meta"),
                degrees={"pp": row["pp"], "dp": row["dp"], "tp": row["tp"]},
                zero=0,
                recompute="full",
                microbatches=microbatches,
                hardware="a100-80gb",
            )
            break
        except autopar.MemoryLimitError:
            if microbatches == counts[-1]:
                raise
    tflops = megatron_flops(row) / row["gpus"] / plan.cost.step_s / 1e12
    return {
        "row": row,
        "plan": plan,
        "tflops": tflops,
        "error": tflops / row["tflops_per_gpu"] - 1,
        "seconds": time.perf_counter() - started,
    }


def render(results: list[dict], zero: list[tuple[int, float, float]], peak_rss_gib: float, elapsed: float) -> str:
    lines = [
        "## Cost model at cluster scale: published runs",
        "",
        f"- command: `python benchmarks/published.py` ({elapsed:.0f} s); date {datetime.date.today()}; "
        "planning only (meta-device models, simulated meshes), nothing is run",
        "- Megatron-LM GPT weak scaling (Narayanan et al., SC'21, Table 1; Selene, DGX A100 80GB). Each row: "
        "`examples/gpt.py` built on the meta device in bfloat16 with the row's shapes (vocabulary 51200, "
        "sequence 2048), planned on mesh (gpus/8)x8 with `degrees` {pp, dp, tp} as published, `zero=0`, "
        '`recompute="full"`, `hardware="a100-80gb"` (one compute efficiency, 0.5, for every row); microbatches: '
        "the search's when pipelined, else the fewest that fit in 80 GB (gradient accumulation). TFLOP/s per GPU = the "
        "paper's FLOPs per iteration "
        "96·B·s·l·h²·(1 + s/6h + V/16lh) / GPUs / predicted step time.",
        "",
        "| params | layers | hidden | GPUs | tp | pp | dp | batch | microbatches | predicted step s | compute / comm / "
        "sync / bubble s | predicted TFLOP/s | published | error % | plan s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        row, cost = r["row"], r["plan"].cost
        lines.append(
            f"| {row['params_b']}B | {row['layers']} | {row['hidden']} | {row['gpus']} | {row['tp']} | {row['pp']} | "
            f"{row['dp']} | "
            f"{row['global_batch']} | {r['plan'].schedule.microbatches} | {cost.step_s:.2f} | {cost.compute_s:.2f} / "
            f"{cost.comm_s:.2f} / {cost.grad_sync_s:.2f} / "
            f"{cost.pipeline_s:.2f} | {r['tflops']:.0f} | {row['tflops_per_gpu']} | {r['error'] * 100:+.1f} | "
            f"{r['seconds']:.0f} |"
        )
    worst = max(abs(r["error"]) for r in results)
    lines += [
        "",
        f"Worst row: {worst * 100:.1f}% (target: every row within ±{TARGET_ERROR * 100:.0f}%): "
        + ("**met**" if worst <= TARGET_ERROR else "**missed**"),
        "",
        "ZeRO paper worked example (7.5B parameters, mixed-precision Adam: 2 + 2 + 12 bytes per parameter, "
        "64 data-parallel ranks), model state per device from `autopar.ir.model_state_bytes` with the paper's layout "
        "(`ZERO_PAPER_LAYOUT`; autopar's own mixed precision keeps FSDP2's: fp32 gradients and masters beside "
        "16-bit compute copies, 18 bytes per parameter before ZeRO):",
        "",
        "| ZeRO stage | predicted GB | paper GB | error % |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {stage} | {gb:.2f} | {paper} | {(gb / paper - 1) * 100:+.1f} |" for stage, gb, paper in zero]
    zero_worst = max(abs(gb / paper - 1) for _, gb, paper in zero)
    lines += [
        "",
        f"Worst stage: {zero_worst * 100:.1f}% (target within {TARGET_ZERO_ERROR * 100:.0f}%): "
        + ("**met**" if zero_worst <= TARGET_ZERO_ERROR else "**missed**"),
        "",
        f"Peak resident memory of the planning process (all five rows planned in it): {peak_rss_gib:.2f} GiB "
        "(target under 2 GB: the weights are never allocated).",
    ]
    return "\n".join(lines)


def main() -> int:
    started = time.perf_counter()
    gpt = load_gpt()
    results = []
    for row in json.loads(REFERENCE.read_text())["rows"]:
        results.append(predict(gpt, row))
        print(
            f"[published] {row['params_b']}B: {results[-1]['tflops']:.0f} TFLOP/s predicted, {row['tflops_per_gpu']} "
            "published",
            flush=True,
        )
    zero = [
        (
            stage,
            sum(model_state_bytes(7.5e9, data_parallel=64, zero_stage=stage, layout=ZERO_PAPER_LAYOUT).values()) / 1e9,
            paper,
        )
        for stage, paper in enumerate(ZERO_PAPER_GB)
    ]
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    section = render(results, zero, peak_rss_gib, time.perf_counter() - started)
    print(section)
    write_section("published", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
