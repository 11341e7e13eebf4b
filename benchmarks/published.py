"""The cost model at cluster scale, against published training runs.

    python benchmarks/published.py              # every row (tens of minutes: 96-128-layer models); writes BENCHMARKS.md
    python benchmarks/published.py --quick      # the first row of each source; prints, writes nothing
    python benchmarks/published.py --only "MT-NLG"

1. Every row of ``benchmarks/data/published_runs.json`` (Megatron-LM SC'21 Tables 1 and 2,
   Korthikanti et al., Llama 3, MegaScale's Megatron-LM baseline, MT-NLG, Megatron-Core
   on H100; see :mod:`published_rows`): its model built on the meta device, planned with the
   published configuration pinned, the predicted step turned into the source's own metric with
   the source's own FLOPs definition; the error per row, grouped by source; the trend of the
   error with model size (least-squares slope against log10 parameters, median per size band).
   One set of hardware figures for every row; the training stack's overlaps as each source
   describes its stack (the file's ``stacks``). Megatron-LM's Table 1 rows kept in
   ``shared/reference/published-megatron-a100.json`` are checked against ±15%.
2. The ZeRO paper's worked example (Rajbhandari et al., 2020, Figure 1): 7.5B parameters,
   mixed-precision Adam, 64 data-parallel ranks, model state per device for stages 0-3.
3. The file's ``scaling`` entries: one stack's throughput per GPU at more GPUs over that at fewer,
   published and predicted (a check that needs no GPU peak: the ratio cancels it).
4. The planning process's peak resident memory and each row's planning time.

Writes the "published" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import published_rows as rows_  # noqa: E402
from publish import publish  # noqa: E402

from autopar.ir.precision import ZERO_PAPER_LAYOUT, model_state_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "published-megatron-a100.json"
TARGET_ERROR = 0.20  # every fully known row (the brief: ±15-20%)
TARGET_REFERENCE = 0.15  # the Table 1 rows in shared/reference
SLOW_PLAN_S = 10.0
ZERO_PAPER_GB = (120, 31.4, 16.6, 1.88)  # stages 0..3, 7.5B parameters, 64 ranks
TARGET_ZERO_ERROR = 0.02
UNITS = {"tflops": "TFLOP/s per GPU", "mfu": "MFU", "tokens": "tokens/s per GPU"}


def _value(metric: str, value: float) -> str:
    return f"{value * 100:.1f}%" if metric == "mfu" else f"{value:.1f}"


def row_table(results: list[dict]) -> list[str]:
    lines = [
        "| source | model | GPUs | tp | pp | dp | v | micro | batch | recompute | metric | predicted | published | "
        "error % | compute / comm / sync / optimizer / pipeline s | FLOPs / source | peak GiB | plan s |",
        "| --- | --- | " + "---: | " * 7 + "--- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        row, config, cost, schedule = r["row"], r["row"]["config"], r["cost"], r["plan"].schedule
        partly = " *" if row["missing"] else ""
        memory = f"{cost.peak_memory / 2**30:.0f}" + ("" if r["fits"] else " (over)")
        lines.append(
            f"| {row['group']} | {row['id'].split(' | ')[1]}{partly} | {config['gpus']} | {config['tp']} | "
            f"{config['pp']} | {config['dp']} | {schedule.virtual if config['pp'] > 1 else '-'} | "
            f"{schedule.microbatches} | {config['global_batch']} | {schedule.recompute}"
            f"{' + regather' if schedule.regather else ''} | {UNITS[row['metric']]} | "
            f"{_value(row['metric'], r['predicted'])} | {_value(row['metric'], row['value'])} | "
            f"{r['error'] * 100:+.1f} | {cost.compute_s:.2f} / {cost.comm_s:.2f} / {cost.grad_sync_s:.2f} / "
            f"{cost.optimizer_s:.2f} / {cost.pipeline_s:.2f} | {r['flops_ratio']:.2f} | {memory} | {r['plan_s']:.0f} |"
        )
    return lines


def source_table(results: list[dict]) -> list[str]:
    lines = [
        "| source | rows | fully known | median abs error % | worst % | mean signed % | within ±20% |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for group in dict.fromkeys(r["row"]["group"] for r in results):
        errors = [r["error"] for r in results if r["row"]["group"] == group]
        known = sum(not r["row"]["missing"] for r in results if r["row"]["group"] == group)
        worst = max(errors, key=abs)
        lines.append(
            f"| {group} | {len(errors)} | {known} | {statistics.median(map(abs, errors)) * 100:.1f} | "
            f"{worst * 100:+.1f} | {statistics.mean(errors) * 100:+.1f} | "
            f"{sum(abs(e) <= TARGET_ERROR for e in errors)} of {len(errors)} |"
        )
    return lines


def trend_lines(results: list[dict]) -> list[str]:
    if len({r["params"] for r in results}) < 3:  # a slope needs sizes to fit (--only, --quick)
        return [f"Trend with size: {len(results)} row(s), too few sizes to fit one."]
    slope, error = rows_.trend(results)
    lines = [
        f"Trend with size: signed error = a + b·log10(parameters), least squares over all {len(results)} rows: "
        f"b = **{slope * 100:+.1f}% per decade** (standard error {error * 100:.1f}%; |b| within 2 standard errors "
        f"of 0: {'yes' if abs(slope) <= 2 * error else 'no'}).",
        "",
        "| size band | rows | median abs error % | mean signed error % |",
        "| --- | ---: | ---: | ---: |",
    ]
    for band in ("< 10B", "10-100B", "100-300B", ">= 300B"):
        errors = [r["error"] for r in results if rows_.size_band(r["params"]) == band]
        if errors:
            lines.append(
                f"| {band} | {len(errors)} | {statistics.median(map(abs, errors)) * 100:.1f} | "
                f"{statistics.mean(errors) * 100:+.1f} |"
            )
    return lines


def reference_lines(results: list[dict]) -> list[str]:
    """The Table 1 rows kept in shared/reference: each within ±15%."""
    reference = json.loads(REFERENCE.read_text())["rows"] if REFERENCE.exists() else []
    checked = []
    for ref in reference:
        match = next(
            (
                r
                for r in results
                if r["row"]["group"] == "Megatron-LM SC'21 Table 1" and r["row"]["config"]["gpus"] == ref["gpus"]
            ),
            None,
        )
        if match:
            checked.append((ref, match))
    if not checked:
        return []
    worst = max(abs(m["error"]) for _, m in checked)
    cells = ", ".join(f"{ref['params_b']}B {m['error'] * 100:+.1f}%" for ref, m in checked)
    verdict = "**met**" if worst <= TARGET_REFERENCE else "**missed**"
    return [f"Megatron-LM Table 1 rows of `shared/reference` (target ±15%): {cells}; worst {worst:.1%}: {verdict}"]


def predict_scaling(data: dict, captures) -> list[tuple[dict, list[dict]]]:
    """Each of the file's ``scaling`` entries: one stack and local batch measured at fewer GPUs and
    at more, each configuration predicted as a row is."""
    return [
        (
            entry,
            [
                rows_.predict({**entry, "config": config, "value": value}, data["stacks"], captures)
                for config, value in zip(entry["configs"], entry["values"])
            ],
        )
        for entry in data.get("scaling", [])
    ]


def scaling_lines(scaled: list[tuple[dict, list[dict]]]) -> list[str]:
    """Throughput per GPU at more GPUs over that at fewer, published and predicted: a check of how
    the data-parallel traffic grows with the group that needs no GPU peak (it cancels)."""
    lines = [
        "### Scaling at one stack: throughput per GPU at more GPUs over that at fewer",
        "",
        "The runs below are on a GPU no preset describes (dropped as rows): the ratio of two of its throughputs "
        "cancels its peak, so it checks how the predicted data-parallel traffic grows with the group (priced "
        "on the `h100-80gb` preset).",
        "",
        "| source | model | GPUs | published tokens/s per GPU | predicted tokens/s per GPU | published ratio "
        "| predicted ratio | difference (points) |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for entry, (few, more) in scaled:
        published, predicted = more["row"]["value"] / few["row"]["value"], more["predicted"] / few["predicted"]
        lines.append(
            f"| {entry['group']} | {entry['id'].split(' | ')[1]} "
            f"| {few['row']['config']['gpus']} -> {more['row']['config']['gpus']} "
            f"| {few['row']['value']:.0f} -> {more['row']['value']:.0f} "
            f"| {few['predicted']:.0f} -> {more['predicted']:.0f} "
            f"| {published:.3f} | {predicted:.3f} | {(predicted - published) * 100:+.1f} |"
        )
    lines.append("")
    for entry, _ in scaled:
        lines.append(f"- {entry['id'].replace(' | ', ', ')}: {entry['citation']}. {entry['published_notes']}.")
    return lines


def render(
    data: dict, results: list[dict], scaled: list, zero, peak_rss_gib: float, elapsed: float, command: str
) -> str:
    known = [r for r in results if not r["row"]["missing"]]
    worst_known = max((abs(r["error"]) for r in known), default=0.0)
    slow = [r for r in results if r["plan_s"] > SLOW_PLAN_S]
    lines = [
        "## Cost model at cluster scale: published runs",
        "",
        f"- command: `{command}` ({elapsed / 60:.0f} min); date {datetime.date.today()}; machine: 2 shared CPU "
        "cores; planning only (meta-device models, simulated meshes), nothing is run",
        f"- rows: `benchmarks/data/published_runs.json`, {len(data['rows'])} rows curated from the collected "
        f"published runs (each with its citation, what it printed and what was derived); {len(data['dropped'])} "
        "rows dropped, reasons below. A row marked * is partly known: the source leaves out "
        "the microbatch size, recomputation or virtual stages, which the planner then chose (a microbatch size: "
        "the stack's recipe's where the stack states one, below; virtual stages: on Megatron's stacks a count "
        "splitting each stage's layers evenly, one included, as Megatron requires), or the cluster's network "
        "(priced as its hardware preset's).",
        "- each row: its model on the meta device (`benchmarks/published_models.py`: Megatron-LM's GPT of "
        "2021-22 with unfused attention; a GPT with fused attention for Megatron-Core, both taking their loss over "
        "fp32 logits as Megatron does; Llama 3's shapes), captured and priced in the published precision; "
        "planned on mesh (GPUs/8)x8 with tp, pp, dp, ZeRO stage, recomputation, "
        "microbatches (global batch / dp / microbatch size) and pipeline schedule pinned and Megatron's "
        "tensor-parallel layout pinned by module; the published virtual stages pinned. "
        "Hardware: the `a100-80gb` and `h100-80gb` presets, one set of figures for every row (GEMM efficiency "
        "from shapes through the published MAMF, attention tables (FlashAttention-2's on the A100, cuDNN's "
        "measured on an H200 for Hopper), per-GPU InfiniBand; BLOOM's Jean Zay: `a100-80gb-opa`, the A100's "
        "figures with four 100 Gb/s Omni-Path links per node), with each "
        "source's training-stack overlaps and, where its stack runs another attention kernel, that kernel's "
        "published rates (below). Predicted metric = the source's FLOPs per iteration "
        "/ GPUs / predicted step time (or tokens). FLOPs / source: the busiest GPU's FLOPs per step as "
        "autopar counts them over the source's per GPU, both without recomputation (`published_rows.flops_ratio`): "
        "about 1 where the stages are even, above where one stage holds more; it showed attention run whole on "
        "every tensor-parallel rank (1.3-1.6 at tp 4-8) until the search split its heads.",
        "",
        "### Error by source",
        "",
        *source_table(results),
        "",
        f"Fully known rows: {len(known)}, worst {worst_known * 100:.1f}% (target every one within "
        f"±{TARGET_ERROR * 100:.0f}%): " + ("**met**" if worst_known <= TARGET_ERROR else "**missed**"),
        "",
        *reference_lines(results),
        "",
        *trend_lines(results),
        "",
        *scaling_lines(scaled),
        "",
        "### Every row",
        "",
        *row_table(results),
        "",
        "### Training stacks (overlaps as each source describes them)",
        "",
        "| stack | tp_overlap | pipeline sends overlapped | data-parallel overlap | gradient buckets | "
        "ZeRO-1 sync; ZeRO-3 gathers | bytes per gradient element a microbatch adds | attention kernel | "
        "what and where from |",
        "| --- | ---: | --- | ---: | --- | --- | --- | --- | --- |",
    ]
    for name, stack in data["stacks"].items():
        fixed, per_rank = stack.get("grad_bucket_params", (0, 0))
        buckets = f"max({fixed:,}, {per_rank:,} x dp) parameters" if fixed else "autopar's (25 MiB)"
        buckets += f"; reduced in {stack.get('reduce_dtype', 'float32')}"
        cite = f"; {stack['grad_bucket_cite']}" if fixed else ""
        accumulation = stack.get("grad_accumulation_bytes")
        cite += f"; {stack['grad_accumulation_cite']}" if accumulation is not None else ""
        accumulation = "autopar runtime's (18 mixed, 12 fp32)" if accumulation is None else accumulation
        cite += (
            f"; microbatch size {stack['microbatch']} where a row leaves it out: {stack['microbatch_cite']}"
            if "microbatch" in stack
            else ""
        )
        cite += f"; {stack['param_gather_overlap_cite']}" if stack.get("param_gather_overlap") else ""
        gather = "gather behind the next forward" if stack.get("param_gather_overlap") else "gather"
        zero3 = "per parameter" if stack.get("zero3_per_parameter") else "per layer"
        if stack.get("zero3_reuse_elements"):
            zero3 += (
                f", under {stack['zero3_persist_elements']:,} elements kept whole, released after each use"
                f" unless reused within {stack['zero3_reuse_elements']:,} elements"
            )
            cite += f"; {stack['zero3_reuse_cite']}"
        cite += f"; {stack['zero3_per_parameter_cite']}" if "zero3_per_parameter_cite" in stack else ""
        if stack.get("zero3_copies_per_rank"):
            zero3 += ", a copy per rank of each (a list of one tensor per rank)"
            cite += f"; {stack['zero3_copies_per_rank_cite']}"
        cite += f"; {stack['reduce_dtype_cite']}" if "reduce_dtype_cite" in stack else ""
        attention = stack.get("attention", {"kernel": "the preset's"})
        cite += f"; {attention['cite']}" if "cite" in attention else ""
        lines.append(
            f"| {name} | {stack['tp_overlap']} | {'yes' if stack['p2p_overlap'] else 'no'} | {stack['dp_overlap']} "
            f"| {buckets} | {'reduce-scatter' if stack.get('zero1_reduce_scatter') else 'all-reduce'} + {gather}; "
            f"{zero3} "
            f"| {accumulation} | {attention['kernel']} "
            f"| {stack['description']}; {stack['cite']}{cite} |"
        )
    lines += ["", "### FLOPs definitions", ""]
    lines += [f"- `{key}`: {text}" for key, text in data["flops"].items()]
    lines += ["", "### Rows dropped", "", "| reason | rows |", "| --- | ---: |"]
    reasons: dict[str, list[str]] = {}
    for dropped in data["dropped"]:
        reasons.setdefault(dropped["reason"], []).append(dropped["model"])
    lines += [f"| {reason} | {len(models)} |" for reason, models in reasons.items()]
    lines += [
        "",
        f"Planning time: {len(slow)} of {len(results)} rows took over {SLOW_PLAN_S:.0f} s to plan "
        f"(slowest {max((r['plan_s'] for r in results), default=0):.0f} s; repeated layers share one set of ILP "
        "variables; a row on Megatron's stacks without its virtual stages is planned once per count it could run).",
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
        f"Peak resident memory of the planning process (every row planned in it): {peak_rss_gib:.2f} GiB "
        "(the weights are never allocated).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first row of each source; print, do not write")
    parser.add_argument("--only", help="rows whose id contains this text; print, do not write")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    data = rows_.load()
    chosen = [r for r in data["rows"] if args.only is None or args.only in r["id"]]
    if args.quick:
        chosen = list({r["group"]: r for r in reversed(chosen)}.values())[::-1]
    captures, results = rows_.Captures(), []
    for row in chosen:
        results.append(rows_.predict(row, data["stacks"], captures))
        r = results[-1]
        print(
            f"[published] {row['id']}: {_value(row['metric'], r['predicted'])} predicted, "
            f"{_value(row['metric'], row['value'])} published ({r['error']:+.1%}), planned in {r['plan_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    scaled = predict_scaling(data, captures) if args.only is None and not args.quick else []
    zero = [
        (
            stage,
            sum(model_state_bytes(7.5e9, data_parallel=64, zero_stage=stage, layout=ZERO_PAPER_LAYOUT).values()) / 1e9,
            paper,
        )
        for stage, paper in enumerate(ZERO_PAPER_GB)
    ]
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    command = "python benchmarks/published.py" + (" --quick" if args.quick else "")
    section = render(data, results, scaled, zero, peak_rss_gib, time.perf_counter() - started, command)
    publish("published", section, quick=args.quick or args.only is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
