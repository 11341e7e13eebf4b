"""Coverage of the sharding rules on real model graphs, and planning at cluster scale.

    python benchmarks/coverage.py

For each model built from config (on the meta device), the aten ops that have no sharding
rule and so run replicated, how many graph nodes that is, and the planning time. Then a
Llama with 70B-sized layers planned for 64 simulated A100s: time and the planning
process's peak resident memory. Writes the "coverage" section of BENCHMARKS.md.
"""

import importlib.util
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
from publish import write_section  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = [
    ("gpt.py", "build", {}),
    ("hf.py", "build_gpt2", {}),
    ("hf.py", "build_llama", {}),
    ("hf.py", "build_mixtral", {}),
]


HEADERS = ["model", "tensor ops", "replicated", "ops without a rule", "plan s", "chosen degrees"]


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


if __name__ == "__main__":
    main()
