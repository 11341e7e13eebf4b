"""Coverage of the sharding rules on real model graphs, and planning at cluster scale; and
Hugging Face families trained unmodified.

    python benchmarks/coverage.py
    python benchmarks/coverage.py families [--only llama,qwen2] [--quick] [--compiled]

For each model built from config (on the meta device), the aten ops that have no sharding
rule and so run replicated, how many graph nodes that is, and the planning time. Then a
Llama with 70B-sized layers planned for 64 simulated A100s: time and the planning
process's peak resident memory. Writes the "coverage" section of BENCHMARKS.md.

``families``: every family of :mod:`families` on 4 gloo ranks, DP, TP, PP, CP and the automatic plan,
one training step against one process; writes the "hf-families" section (``--only`` and
``--quick`` print without writing). ``--compiled``: the same step with ``compile=True`` on 2 ranks
(DP, TP, PP and, for the families with experts, EP); writes the "hf-families-compiled" section.
"""

import argparse
import importlib.util
import re
import resource
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path

import torch
from tabulate import tabulate

import autopar
from autopar.passes.capture.graph import capture
from autopar.passes.sharding.rules import rule_for
from autopar.passes.sharding.strategies import output_tensors

sys.path.insert(0, str(Path(__file__).parent))
from families import COMPILED_PLANS, FAMILIES, MOE_ONLY, PLANS, run_families  # noqa: E402
from publish import publish, write_section  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = [
    ("gpt.py", "build", {}),
    ("hf.py", "build_gpt2", {}),
    ("hf.py", "build_llama", {}),
    ("hf.py", "build_mixtral", {}),
]


HEADERS = ["model", "tensor ops", "replicated", "ops without a rule", "plan s", "chosen degrees"]
FAMILIES_PER_SPAWN = 6  # families per spawn of ranks, each spawn from fresh memory (falcon_h1 peaks at 5.8 GB a rank)


def load(file: str):
    spec = importlib.util.spec_from_file_location(Path(file).stem, EXAMPLES / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coverage_row(file: str, builder: str, kwargs: dict) -> list:
    with torch.device("meta"):
        model = getattr(load(file), builder)(**kwargs)
    inputs = model.example_inputs(8, device="meta")
    captured = capture(model, inputs)
    ops = [n for n in captured.graph.nodes if n.op == "call_function" and output_tensors(n)]
    missing = Counter(str(n.target) for n in ops if rule_for(n.target) is None)
    started = time.perf_counter()
    plan = autopar.plan(model, "2x2", inputs)
    elapsed = time.perf_counter() - started
    fallback = ", ".join(f"{op} x{count}" for op, count in sorted(missing.items())) or "none"
    return [f"{file}:{builder}", len(ops), sum(missing.values()), fallback, f"{elapsed:.1f}", str(plan.degrees)]


def main() -> None:
    rows = [coverage_row(*model) for model in MODELS]
    with torch.device("meta"):
        llama = load("hf.py").build_llama70b_shaped(layers=2)
    started = time.perf_counter()
    plan = autopar.plan(llama, "8x8", llama.example_inputs(64, device="meta"), hardware="a100-80gb")
    elapsed = time.perf_counter() - started
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
    body = f"""## Sharding-rule coverage and planning at scale

`python benchmarks/coverage.py` ({date.today()}, this machine: 2 cores). Models built from
config on the meta device, global batch 8, planned for a 2x2 mesh. "Replicated" counts the
graph nodes whose op has no sharding rule: they run replicated, their inputs all-gathered.

{tabulate(rows, headers=HEADERS, tablefmt="github")}

Llama with 70B-sized layers (hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256;
2 layers, sequence 4096, global batch 64) on the meta device, planned for 64 simulated
A100-80GB (mesh 8x8): {elapsed:.1f} s, {len(plan.search)} configurations searched, chose
{plan.degrees}; predicted peak memory {plan.cost.peak_memory / 2**30:.1f} GiB per device.
Peak resident memory of the whole process (models above included): {peak_rss:.2f} GiB.
"""
    write_section("coverage", body)
    print(body)


def _worst_over_ranks(by_rank: list[list[dict]], plans: dict) -> list[dict]:
    """Rank 0's rows, each case's error the largest over the ranks; a case passes only when every
    rank passed it and every parameter was checked on some rank (pipeline ranks hold their stages')."""
    rows = by_rank[0]
    for index, row in enumerate(rows):
        for label in plans:
            if row[label] is None:  # not applicable (EP on a dense family)
                continue
            cases = [rank_rows[index][label] for rank_rows in by_rank]
            failed = next((case for case in cases if "error" in case), None)
            if failed is not None:
                row[label] = failed
                continue
            unchecked = set.intersection(*(set(case["missing"]) for case in cases))
            worst = max(case["worst"] for case in cases)
            row[label] = {
                **cases[0],
                "worst": worst,
                "ok": worst <= 1 and not unchecked,
                "step_s": max(case["step_s"] for case in cases),
            }
    return rows


def families(selected: list[str], quick: bool, compiled: bool) -> None:
    from autopar.runtime.spawn import run_local

    plans, world = (COMPILED_PLANS, 2) if compiled else (PLANS, 4)
    started = time.perf_counter()
    rows = []
    for start in range(0, len(selected), FAMILIES_PER_SPAWN):  # fresh ranks for each few families
        chunk = selected[start : start + FAMILIES_PER_SPAWN]
        done = f"{start} of {len(selected)} families done ({time.perf_counter() - started:.0f} s)"
        print(f"[coverage] {done}; now {', '.join(chunk)}", file=sys.stderr)
        rows += _worst_over_ranks(run_local(run_families, world, chunk, plans, timeout_s=3600), plans)
    elapsed = time.perf_counter() - started
    table = [[row["family"], *(_cell(row[label], compiled) for label in plans), _why(row, plans)] for row in rows]
    passing = sum(all(row[label] is None or row[label]["ok"] for label in plans) for row in rows)
    moe = sum(any(row[label] is not None for label in MOE_ONLY & set(plans)) for row in rows)
    dense = len(plans) - len(MOE_ONLY & set(plans))
    if compiled:
        body = f"""## Hugging Face families, unmodified, compiled, on 2 ranks

`python benchmarks/coverage.py families --compiled` ({date.today()}, this machine: 2 shared cores, 2 gloo
ranks, {elapsed / 60:.0f} min). The families and the step of the section above, with
`autopar.parallelize(model, 2, compile=True)`: every program (each pipeline stage's too) runs through
`torch.compile` (inductor, one graph each: a graph break is an error naming the node), its collectives
scheduled for overlap; pinned to dp=2 (DP2), tp=2 (TP2), pp=2 (PP2), and the {moe} families with experts to
ep=2 (EP2, each layer's experts op pinned to the expert-parallel kernel). ✓: loss, every full gradient and
every parameter after the step allclose to one process's (rtol 1e-4, atol 1e-6); the seconds are planning's
and the first step's (which compiles; inductor's cache may hold graphs of earlier runs), the slowest rank's.
**{passing} of {len(rows)} families pass every plan that applies** (the {dense} dense plans, and EP2 for the
{moe} with experts).

{tabulate(table, headers=["family", *plans, "why not"], tablefmt="github")}
"""
        publish("hf-families-compiled", body, quick)
        return
    body = f"""## Hugging Face families, unmodified, on 4 ranks

`python benchmarks/coverage.py families` ({date.today()}, this machine: 2 shared cores, 4 gloo ranks,
{elapsed / 60:.0f} min). Each family is `AutoModelForCausalLM.from_config` on a small config
(`benchmarks/hf_configs.py`: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128; MoE 4 experts
top-2), unmodified. `autopar.parallelize(model, 4)` plans it with no example inputs, pinned to
dp=4 (DP), tp=4 (TP), pp=2 x dp=2 or cp=2 x dp=2 on a 2x2 mesh, or free (auto: the degrees it
chose), and the {moe} families with mixture-of-experts layers to ep=4, their experts split over the ranks (EP4:
each layer's experts op pinned to the expert-parallel kernel, tokens travelling to their experts); one
step as a script takes it (`pmodel(input_ids=..., labels=...).loss.backward()`, AdamW) against the same step in one
process; the labels right-padded with -100, another length per row (so ranks and microbatches
count different numbers of targets). ✓: loss, every full gradient and every parameter after the
step allclose (rtol 1e-4, atol 1e-6). **{passing} of {len(rows)} families pass every plan that applies**
(the {dense} above, and EP4 for the {moe} with experts; anchor: Meta's autoparallel passes
14 of 20).

{tabulate(table, headers=["family", *plans, "why not"], tablefmt="github")}
"""
    publish("hf-families", body, quick)


def _cell(result: dict | None, compiled: bool) -> str:
    if result is None:
        return "—"
    if "error" in result:
        return "✗ error"
    mark = "✓" if result["ok"] else f"✗ ({result['worst']:.0f}x tolerance)"
    chosen = " x ".join(f"{axis}{size}" for axis, size in result["degrees"].items())
    seconds = f"{result['plan_s']:.0f} + {result['step_s']:.0f} s" if compiled else f"{result['plan_s']:.0f} s"
    return f"{mark} {chosen} ({seconds})"


def _why(row: dict, plans: dict) -> str:
    errors = dict.fromkeys(row[label]["error"] for label in plans if row[label] and "error" in row[label])
    text = re.sub(r"\S*site-packages/", "", "; ".join(errors))  # a library's file, not where it is installed
    return text.replace("|", "/")[:300]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["rules", "families"], default="rules")
    parser.add_argument("--only", default="", help="families, comma-separated (default: all of families.py)")
    parser.add_argument("--quick", action="store_true", help="print, do not write BENCHMARKS.md")
    parser.add_argument("--compiled", action="store_true", help="families: compile=True on 2 ranks")
    args = parser.parse_args()
    if args.what == "families":
        families(args.only.split(",") if args.only else FAMILIES, args.quick or bool(args.only), args.compiled)
    else:
        main()
