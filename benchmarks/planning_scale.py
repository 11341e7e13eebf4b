"""Planning at scale: the search's wall time and memory on published clusters, and its free plan
against the published expert configuration, both priced by the same cost model.

    python benchmarks/planning_scale.py           # writes BENCHMARKS.md (run it alone: it times the search)
    python benchmarks/planning_scale.py --quick                         # three rows, printed only
    python benchmarks/planning_scale.py --families     # Hugging Face families at their default configurations

Each row runs in a fresh subprocess (so peak RSS, ``resource.getrusage`` maxrss, is the row's
own): the model is built on the meta device in bfloat16 and captured (timed apart: tracing is
not the search), then planned twice with ``precision="bf16-mixed"``: free (no pins) and with the
published configuration pinned — its degrees and what the publication fixes (recomputation,
ZeRO; without stages, the fewest microbatches that fit: gradient accumulation); the rest
searched. TFLOP/s per GPU = the model's forward + backward FLOPs per step (the cost model's
own count, no recomputation) / GPUs / predicted step, so free / expert is the inverse ratio of
the predicted steps. Writes the "planning-scale" section of BENCHMARKS.md; ``--families`` the
"planning-families" section: every Hugging Face family's default configuration (BLOOM's, a toy,
replaced by BLOOM-7b1's shapes) unmodified, planned free on 64 simulated H100s.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from measure import python_loop_s  # noqa: E402
from publish import publish  # noqa: E402

REFERENCE = ROOT.parent / "shared" / "reference" / "published-megatron-a100.json"
MEGATRON = "Narayanan et al., SC'21, Table 1"
ROW_TIMEOUT_S = 1800
REPEATS, REPEATED_UNDER_S = 3, 10  # search targets this tight are timed as a median of fresh processes
SCALING_LAYERS = (12, 24, 48, 96)
SCALING_DEVICES = (8, 64, 512, 4096)
# The Hugging Face families of benchmarks/families.py are planned at their default configurations, but:
FAMILIES_LEFT_OUT = {  # family: why the table cannot plan it at its default configuration (said under it)
    "jetmoe": "its experts split the tokens by counts only the data decides, which a model on the meta device "
    "cannot compute (autopar plans it with real weights)",
}
FAMILY_SEQ, FAMILY_BATCH, FAMILY_GPUS = 4096, 256, 64
# DeepSeek-V3's default is its 671B model, whose training state does not fit 64 GPUs: planned on its own
# cluster's size and final batch (DeepSeek-V3 technical report, arXiv 2412.19437: 2048 H800s, §3.1;
# 15360 sequences of 4096 tokens, §4.2), H800s priced as H100s (the same compute, slower NVLink)
FAMILY_CLUSTERS = {"deepseek_v3": dict(gpus=2048, batch=15360)}
# A family whose training state fits no plan on its cluster is planned on 4x the GPUs and sequences, up to:
FAMILY_GROWTH, FAMILY_MAX_GPUS = 4, 4096
LEARNED_POSITIONS = ("gpt2", "opt", "gpt_bigcode", "gpt_neo")  # fewer positions: planned at their length
# Defaults that are no released model, replaced by one's shapes: BLOOM's (2 layers of hidden 64) by BLOOM-7b1's
# (BigScience, arXiv 2211.05100, Table 3); DBRX's (hidden 2048, 4 experts; no model builds in transformers 5.24:
# its attention config lacks rope_theta) by its released configuration (databricks/dbrx-base config.json).
FAMILY_OVERRIDES = {
    "bloom": dict(hidden_size=4096, n_layer=30, n_head=32),
    "dbrx": dict(
        d_model=6144, n_heads=48, n_layers=40, vocab_size=100352, max_seq_len=32768,
        attn_config=dict(kv_n_heads=8, rope_theta=500000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4),
    ),
    "deepseek_v2": dict(num_experts_per_tok=6),  # unset by default; DeepSeek-V2's (arXiv 2405.04434 §3.1)
    "dots1": dict(n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=2),  # None by default; arXiv 2506.05767
    "hunyuan_v1_moe": dict(head_dim=128),  # None by default (no model builds): its hidden size over its heads
}  # fmt: skip


def _gpt(hidden: int, layers: int, heads: int) -> dict:
    return {"builder": "gpt", "kwargs": dict(hidden=hidden, layers=layers, heads=heads, vocab=51200, seq=2048)}


def rows() -> list[dict]:
    """The benchmark's rows: model, cluster, batch, the published configuration and its source."""
    out = [
        {
            "name": f"GPT {row['params_b']}B",
            "model": _gpt(row["hidden"], row["layers"], row["heads"]),
            "gpus": row["gpus"],
            "batch": row["global_batch"],
            "hardware": "a100-80gb",
            "expert": {"degrees": {"pp": row["pp"], "dp": row["dp"], "tp": row["tp"]}, "recompute": "full", "zero": 0},
            "source": MEGATRON,
            "targets": {"search_s": 60, "rss_gib": 2, "ratio": 0.98},
        }
        for row in json.loads(REFERENCE.read_text())["rows"]
    ]
    out += [
        {
            "name": "GPT-3 175B",
            "model": _gpt(12288, 96, 96),
            "gpus": 1024,
            "batch": 1536,
            "hardware": "a100-80gb",
            "expert": {"degrees": {"pp": 16, "dp": 8, "tp": 8}},
            "source": "Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (tp 8, pp 16)",
            "targets": {"search_s": 60},
        },
        {
            "name": "Llama-3 8B",
            "model": {"builder": "llama3", "kwargs": {"size": "8b"}},
            "gpus": 64,
            "batch": 64,
            "hardware": "h100-80gb",
            "expert": {"degrees": {"pp": 1, "dp": 64, "tp": 1}, "zero": 3, "recompute": "selective"},
            "source": "torchtitan llama3_8b.toml (FSDP over 64, selective recomputation, batch 1 x 8192 per GPU)",
            "targets": {"search_s": 5},
        },
        {
            "name": "Llama-3 405B",
            "model": {"builder": "llama3", "kwargs": {"size": "405b"}},
            "gpus": 16384,
            "batch": 2048,
            "hardware": "h100-80gb",
            "expert": {"degrees": {"pp": 16, "dp": 128, "tp": 8}},
            "source": "Llama 3 paper, Table 4 (tp 8, cp 1, pp 16, dp 128)",
            "targets": {"search_s": 120},
        },
        {  # experts at scale: 256 routed experts per layer, the router the model's own (grouped top-k)
            "name": "DeepSeek-V3 671B",
            "model": {"builder": "default_config", "kwargs": {"family": "deepseek_v3", "seq": 4096}},
            "gpus": 256,
            "batch": 512,
            "hardware": "h100-80gb",
            "source": "none pinned (its published layout, pp 16 x ep 64 with ZeRO-1, ran on 2048 H800s)",
            "targets": {"search_s": 120},
        },
    ]
    return out


def scaling_rows() -> list[dict]:
    """Search time against depth (GPT, hidden 4096, on 64 A100) and against devices (GPT 1.7B,
    16 sequences per device as Megatron's 1.7B row: a fixed batch of 1024 does not fit on 8 devices
    without gradient accumulation, which the free search weighs only inside pipelines)."""
    a100 = dict(hardware="a100-80gb")
    by_layers = [dict(name=f"layers {n}", model=_gpt(4096, n, 32), gpus=64, batch=512, **a100) for n in SCALING_LAYERS]
    gpt = _gpt(2304, 24, 24)
    return by_layers + [dict(name=f"devices {n}", model=gpt, gpus=n, batch=16 * n, **a100) for n in SCALING_DEVICES]


def family_rows() -> list[dict]:
    """Each family at its default configuration (:data:`FAMILY_OVERRIDES` replaced), sequences of
    4096 tokens (fewer where its learned positions hold fewer), 256 of them on 64 H100s, nothing pinned."""
    from families import FAMILIES
    from transformers import AutoConfig

    out = []
    for family in (f for f in FAMILIES if f not in FAMILIES_LEFT_OUT):
        seq = FAMILY_SEQ
        if family in LEARNED_POSITIONS:
            seq = min(seq, AutoConfig.for_model(family).max_position_embeddings)
        model = {
            "builder": "default_config",
            "kwargs": {"family": family, "seq": seq, **FAMILY_OVERRIDES.get(family, {})},
        }
        cluster = FAMILY_CLUSTERS.get(family, dict(gpus=FAMILY_GPUS, batch=FAMILY_BATCH))
        out.append({"name": family, "model": model, **cluster, "hardware": "h100-80gb"})
    return out


# -- one row, in its own process --------------------------------------------------------------------


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(model: dict):
    import torch

    if model["builder"] == "gpt":
        with torch.device("meta"):
            return _example("gpt").build(**model["kwargs"]).to(torch.bfloat16)
    return getattr(_example("hf"), f"build_{model['builder']}")(**model["kwargs"]).to(torch.bfloat16)


def measure(row: dict) -> dict:
    """Capture, the free plan and (where the row has one) the pinned expert plan, with their times."""
    import autopar
    from autopar.passes.cost.facts import analyze

    model = build(row["model"])
    started = time.perf_counter()
    captured = autopar.capture(model, model.example_inputs(row["batch"], device="meta"))
    capture_s = time.perf_counter() - started
    mesh = (row["gpus"] // 8, 8) if row["gpus"] >= 8 else (row["gpus"],)
    options = dict(hardware=row["hardware"], precision="bf16-mixed")
    started = time.perf_counter()
    free = autopar.plan(captured, mesh, **options)
    search_s = time.perf_counter() - started
    hardware = autopar.ir.get_profile(row["hardware"])
    flops = sum(
        f.profile.forward_flops + (f.profile.backward_flops if f.needs_grad else 0.0)
        for f in analyze(captured, hardware).values()
    )
    result = {
        "capture_s": capture_s,
        "search_s": search_s,
        "nodes": len(captured.graph.nodes),
        "params": sum(p.numel() for p in model.parameters()),
        "free": _summary(free, flops, row["gpus"]),
    }
    if "expert" in row:
        result["expert"] = _expert(captured, mesh, options, row, flops)
    result["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def _expert(captured, mesh, options: dict, row: dict, flops: float) -> dict:
    """The published configuration pinned; without stages, with the fewest microbatches
    (gradient accumulation, as Megatron's runs use) that fit."""
    import autopar

    pins = row["expert"]
    local_batch = row["batch"] // pins["degrees"]["dp"]
    counts = (
        [None] if pins["degrees"].get("pp", 1) > 1 else [m for m in range(1, local_batch + 1) if local_batch % m == 0]
    )
    for microbatches in counts:
        try:
            plan = autopar.plan(captured, mesh, **options, **pins, microbatches=microbatches)
            return _summary(plan, flops, row["gpus"])
        except autopar.MemoryLimitError as error:
            refusal = str(error).split(". ")[0]
    return {"error": refusal}


def _summary(plan, flops: float, gpus: int) -> dict:
    schedule = plan.schedule
    cost = plan.cost
    return {
        "degrees": ({"pp": schedule.stages} if schedule.stages > 1 else {}) | dict(plan.degrees),
        "zero": plan.zero,
        "schedule": str(schedule),
        "step_s": cost.step_s,
        "terms": {
            "compute": cost.compute_s,
            "communication": cost.comm_s,
            "gradient sync": cost.grad_sync_s,
            "optimizer": cost.optimizer_s,
            "pipeline": cost.pipeline_s,
        },
        "peak_gib": cost.peak_memory / 2**30,
        "tflops": flops / gpus / cost.step_s / 1e12,
        "tried": sum("pruned" not in e for e in plan.search),
        "pruned": sum("pruned" in e for e in plan.search),
    }


# -- the section ----------------------------------------------------------------------------------------


def run_row(row: dict) -> dict:
    """:func:`measure` in a fresh interpreter (its peak RSS its own); a row whose search target is
    a few seconds in :data:`REPEATS` fresh ones, its times their medians (the host is shared)."""
    if row.get("targets", {}).get("search_s", math.inf) > REPEATED_UNDER_S:
        return _run_once(row)
    runs = [_run_once(row) for _ in range(REPEATS)]
    times = {key: statistics.median(run[key] for run in runs) for key in ("capture_s", "search_s")}
    rss = max(run["rss_gib"] for run in runs)
    return {**runs[0], **times, "rss_gib": rss, "search_runs_s": [run["search_s"] for run in runs]}


def _run_once(row: dict) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--row", json.dumps(row)],
        capture_output=True,
        text=True,
        timeout=ROW_TIMEOUT_S,
        cwd=ROOT,
    )
    if done.returncode:
        raise RuntimeError(f"row {row['name']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_family(row: dict) -> tuple[dict, dict]:
    """(the row as planned, its result): on a cluster :data:`FAMILY_GROWTH` times larger while its
    training state fits no plan (:class:`autopar.ir.MemoryLimitError`), as far as :data:`FAMILY_MAX_GPUS`."""
    while True:
        try:
            return row, run_row(row)
        except RuntimeError as error:  # the row says what failed; the other families still run
            failure = str(error).strip().splitlines()[-1][:300]
        larger = row["gpus"] * FAMILY_GROWTH
        if "MemoryLimitError" not in failure or row["name"] in FAMILY_CLUSTERS or larger > FAMILY_MAX_GPUS:
            return row, {"error": failure}
        print(f"[planning-families] {row['name']}: fits no plan on {row['gpus']} GPUs", file=sys.stderr, flush=True)
        row = {**row, "gpus": larger, "batch": row["batch"] * FAMILY_GROWTH}


def _plan_text(summary: dict) -> str:
    if not summary:  # no expert configuration pinned
        return "-"
    if "error" in summary:
        return summary["error"]
    degrees = " ".join(f"{k}{v}" for k, v in summary["degrees"].items() if v > 1) or "dp1"
    zero = f" ZeRO-{summary['zero']}" if summary["zero"] else ""
    return f"{degrees}{zero}; {summary['schedule']}"


def _why(free: dict, expert: dict) -> str:
    """The cost terms that differ most between the two plans (free minus expert)."""
    deltas = sorted(((free["terms"][k] - expert["terms"][k], k) for k in free["terms"]), key=lambda d: -abs(d[0]))
    return ", ".join(f"{k} {d:+.2f} s" for d, k in deltas[:3] if abs(d) > 0.005 * expert["step_s"]) or "same"


def speed_note(probes: list[float]) -> str:
    return (
        f"machine speed: a pure-Python loop of 10^7 additions took {probes[0]:.2f} s before the rows and "
        f"{probes[-1]:.2f} s after (median of 3 each; compare search times within one run)"
    )


def render(
    results: list[tuple[dict, dict]], scaling: list[tuple[dict, dict]], elapsed: float, probes: list[float]
) -> str:
    lines = [
        "## Planning at scale",
        "",
        f"- command: `python benchmarks/planning_scale.py` ({elapsed:.0f} s); date "
        f"{datetime.date.today()}; this machine: 2 shared CPU cores (other work may run beside it; "
        f"{speed_note(probes)}); planning only "
        '(meta-device models in bfloat16, `precision="bf16-mixed"`, simulated meshes (GPUs/8)x8)',
        "- search s: `autopar.plan` on the captured graph (capture s: tracing it, apart; a row whose target is "
        f"at most {REPEATED_UNDER_S} s: the median of {REPEATS} fresh processes); peak RSS: the row's own "
        "process (a fresh one per row: capture and both plans). TFLOP/s per GPU: the model's forward + backward "
        "FLOPs (the cost model's count, no recomputation) / GPUs / predicted step. Expert: the published "
        "configuration's degrees pinned, with what the publication fixes; everything else searched.",
        "",
        "| model | cluster | capture s | search s | peak RSS GiB | tried / pruned | free plan | TFLOP/s | "
        "expert (pinned) | TFLOP/s | free / expert | where they differ (free − expert) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | --- |",
    ]
    verdicts = []
    for row, result in results:
        free, expert = result["free"], result.get("expert", {})
        ratio = free["tflops"] / expert["tflops"] if "tflops" in expert else float("nan")
        compared = f"{expert['tflops']:.0f} | {ratio:.3f} | {_why(free, expert)}" if "tflops" in expert else "- | - | -"
        lines.append(
            f"| {row['name']} | {row['gpus']} x {row['hardware']}, batch {row['batch']} | {result['capture_s']:.1f} | "
            f"{result['search_s']:.1f} | {result['rss_gib']:.2f} | {free['tried']} / {free['pruned']} | "
            f"{_plan_text(free)} | {free['tflops']:.0f} | {_plan_text(expert)} | {compared} |"
        )
        targets = row.get("targets", {})
        checks = []
        if "search_s" in targets:
            runs = result.get("search_runs_s")
            each = ", ".join(f"{t:.1f}" for t in runs or ())
            median = f" (median of {len(runs)} fresh processes: {each} s)" if runs else ""
            checks.append((f"search ≤ {targets['search_s']} s{median}", result["search_s"] <= targets["search_s"]))
        if "rss_gib" in targets:
            checks.append((f"RSS ≤ {targets['rss_gib']} GiB", result["rss_gib"] <= targets["rss_gib"]))
        if "ratio" in targets:
            checks.append((f"free ≥ {targets['ratio']} x expert", ratio >= targets["ratio"]))
        verdicts.append(
            f"- {row['name']}: "
            + ", ".join(f"{what} **{'met' if ok else 'missed'}**" for what, ok in checks)
            + f" (expert: {row['source']})"
        )
    lines += ["", "Targets:", "", *verdicts, ""]
    lines += [
        "Scaling (free search only): against depth, GPT hidden 4096 / 32 heads on 64 A100, batch 512; against "
        "devices, GPT 1.7B (hidden 2304, 24 layers) with 16 sequences per device.",
        "",
        "| row | graph nodes | capture s | search s | peak RSS GiB | tried / pruned | free plan |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row, result in scaling:
        free = result["free"]
        lines.append(
            f"| {row['name']} ({row['gpus']} GPUs) | {result['nodes']} | {result['capture_s']:.1f} | "
            f"{result['search_s']:.1f} | {result['rss_gib']:.2f} | {free['tried']} / {free['pruned']} | "
            f"{_plan_text(free)} |"
        )
    depth = [r for row, r in scaling if row["name"].startswith("layers")]
    if len(depth) > 1:
        growth = depth[-1]["search_s"] / depth[0]["search_s"]
        layers = SCALING_LAYERS[len(depth) - 1] / SCALING_LAYERS[0]
        lines += [
            "",
            f"Search time from {SCALING_LAYERS[0]} to {SCALING_LAYERS[len(depth) - 1]} layers: x{growth:.2f} for "
            f"x{layers:.0f} the layers (identical layers are solved once; what grows is the stage cuts' "
            "dynamic program and the final pricing of the whole graph).",
        ]
    return "\n".join(lines)


def _count(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def render_families(results: list[tuple[dict, dict]], elapsed: float, probes: list[float]) -> str:
    lines = [
        "## Planning at scale: Hugging Face families at their default configurations",
        "",
        f"- command: `python benchmarks/planning_scale.py --families` ({elapsed:.0f} s); date "
        f"{datetime.date.today().isoformat()}; this machine: 2 shared CPU cores ({speed_note(probes)}); "
        "planning only",
        f"- each family: `AutoModelForCausalLM.from_config(AutoConfig.for_model(family))`, Hugging Face's default "
        f"configuration (most are a released checkpoint's shapes; BLOOM's, 2 layers of hidden 64, is replaced by "
        f"BLOOM-7b1's: {FAMILY_OVERRIDES['bloom']}; DBRX's builds no model in transformers 5.24, replaced by DBRX's "
        f"released configuration: {FAMILY_OVERRIDES['dbrx']}; DeepSeek-V2's leaves its experts per token unset, set "
        f"as DeepSeek-V2 routes: {FAMILY_OVERRIDES['deepseek_v2']}; dots1's leaves its experts unset, set as "
        f"dots.llm1's: {FAMILY_OVERRIDES['dots1']}; Hunyuan-V1-MoE's leaves its head size unset, set to its hidden "
        f"size over its heads: {FAMILY_OVERRIDES['hunyuan_v1_moe']}), unmodified, on the meta device in bfloat16; "
        f"{FAMILY_BATCH} sequences of {FAMILY_SEQ} tokens "
        f"({', '.join(LEARNED_POSITIONS)}: as many as their learned positions) on "
        f'{FAMILY_GPUS} simulated H100s (mesh {FAMILY_GPUS // 8}x8), `precision="bf16-mixed"`, nothing pinned; '
        "a fresh process per family. TFLOP/s per GPU as above (the cost model's FLOPs, no recomputation).",
        "- "
        + "; ".join(f"{family}: {c['batch']} sequences on {c['gpus']} H100s" for family, c in FAMILY_CLUSTERS.items())
        + " (its training state does not fit 64 GPUs; its own cluster's size and final batch).",
        *(
            f"- {row['name']}: {row['batch']} sequences on {row['gpus']} H100s (its training state fits no plan on "
            f"fewer: planned on {FAMILY_GROWTH}x the GPUs and sequences until it fits)."
            for row, _ in results
            if row["name"] not in FAMILY_CLUSTERS and row["gpus"] != FAMILY_GPUS
        ),
        "- not planned here: " + "; ".join(f"{family}: {why}" for family, why in FAMILIES_LEFT_OUT.items()) + ".",
        "",
        "| family | parameters | sequence | capture s | search s | peak RSS GiB | plan | step s | TFLOP/s | peak GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for row, result in results:
        if "error" in result:
            lines.append(
                f"| {row['name']} | | {row['model']['kwargs']['seq']} | | | | failed: {result['error']} | | | |"
            )
            continue
        free = result["free"]
        lines.append(
            f"| {row['name']} | {_count(result['params'])} | {row['model']['kwargs']['seq']} | "
            f"{result['capture_s']:.1f} | {result['search_s']:.1f} | {result['rss_gib']:.2f} | {_plan_text(free)} | "
            f"{free['step_s']:.3f} | {free['tflops']:.0f} | {free['peak_gib']:.0f} |"
        )
    planned = [(row, result) for row, result in results if "error" not in result]
    slowest = max(planned, key=lambda r: r[1]["search_s"])
    lines += [
        "",
        f"Planned: {len(planned)} of {len(results)}; slowest search: {slowest[0]['name']}, "
        f"{slowest[1]['search_s']:.1f} s; plans with pipeline stages: "
        f"{sum(r['free']['degrees'].get('pp', 1) > 1 for _, r in planned)} of {len(planned)}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three rows, printed, BENCHMARKS.md untouched")
    parser.add_argument("--families", action="store_true", help="Hugging Face families at their default configurations")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row (JSON) and print the result
    args = parser.parse_args()
    if args.row:
        print(json.dumps(measure(json.loads(args.row))))
        return 0
    probes, started = [python_loop_s()], time.perf_counter()
    if args.families:
        results = []
        for row in family_rows()[: 3 if args.quick else None]:
            results.append(run_family(row))
            done = results[-1][1].get("error") or f"{results[-1][1]['search_s']:.1f} s"
            print(f"[planning-families] {row['name']}: {done}", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
        publish("planning-families", render_families(results, elapsed, probes + [python_loop_s()]), args.quick)
        return 0
    table, scaling = rows(), scaling_rows()
    if args.quick:
        table, scaling = table[:1] + table[-2:-1], scaling[:1]
    results = []
    for row in table:
        results.append((row, run_row(row)))
        print(f"[planning-scale] {row['name']}: {results[-1][1]['search_s']:.1f} s", file=sys.stderr, flush=True)
    measured = []
    for row in scaling:
        measured.append((row, run_row(row)))
        print(f"[planning-scale] {row['name']}: {measured[-1][1]['search_s']:.1f} s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    publish("planning-scale", render(results, measured, elapsed, probes + [python_loop_s()]), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
