"""``autopar verify`` on every example, a Hugging Face model, a model too big for here, and a
deliberately corrupted plan.

    python benchmarks/verify_examples.py            # writes the "verify" section of BENCHMARKS.md
    python benchmarks/verify_examples.py --quick    # the first two commands only; prints only

Each row is one ``autopar verify`` command as a user types it (run in-process, ``--json``): the
degrees it ran, what it split, the worst relative error of loss, gradients and updated
parameters, and the exit code (0 exact, 3 not).
"""

import argparse
import contextlib
import io
import json
import shlex
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

from autopar.cli import main as autopar

sys.path.insert(0, str(Path(__file__).parent))
from publish import publish  # noqa: E402

SECTION = "verify"
GPT_TP = "--constraint 'layers.*.attn.w[qkv]=S(-1)' --constraint 'layers.*.attn.wo=P' " + (
    "--constraint 'layers.*.mlp.fc1=S(-1)' --constraint 'layers.*.mlp.fc2=P'"
)
SMALL = "hidden=32, layers=2, heads=4, vocab=64, seq=32"
COMMANDS = [
    "verify mlp --mesh 2 --degrees dp=2",
    f"verify 'gpt:build({SMALL})' --mesh 2 --degrees tp=2 {GPT_TP}",
    f"verify 'gpt:build({SMALL})' --mesh 2x2 --degrees dp=2,tp=2 --zero 1 {GPT_TP}",
    f"verify 'gpt:build({SMALL})' --mesh 2 --degrees pp=2,dp=1,tp=1 --microbatches 2",
    f"verify 'long_context_gpt:build({SMALL})' --mesh 2 --degrees cp=2 --constraint 'layers.*.attn=ring'",
    f"verify 'moe_gpt:build({SMALL})' --mesh 2 --degrees ep=2 --constraint 'layers.*.moe=experts'",
    "verify 'hf:build_llama(layers=2)' --mesh 2 --degrees tp=2 --constraint 'model.layers.*.mlp.down_proj=P' "
    "--constraint 'model.layers.*.mlp.[gu][ap]*_proj=S(-1)'",
    "verify 'hf:build_gpt2(layers=2)' --mesh 2 --degrees dp=2",
    "verify 'hf:build_llama(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=11008, vocab=32000, seq=2048)' "
    "--mesh 8x8 --degrees dp=8,tp=8 --batch 64 --hardware a100-80gb --constraint 'model.layers.*.mlp.down_proj=P' "
    "--constraint 'model.layers.*.mlp.[gu][ap]*_proj=S(-1)'",
]


def verify(command: str) -> tuple[int, dict | None]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = autopar(shlex.split(command) + ["--json"])
    text = out.getvalue()
    return code, json.loads(text[text.index("{") :]) if "{" in text else None


def corrupted_plan_row(folder: Path) -> list:
    """mlp's tensor-parallel plan with fc2's partial output marked replicated (its all-reduce dropped)."""
    plan = folder / "plan.json"
    pins = "--degrees dp=1,tp=2 --constraint 'blocks.*.fc1=S(-1)' --constraint 'blocks.*.fc2=P'"
    with contextlib.redirect_stdout(io.StringIO()):
        autopar(shlex.split(f"plan mlp --mesh 2 --batch 4 {pins} --save {plan}"))
    data = json.loads(plan.read_text())
    fc2 = next(name for name, node in data["nodes"].items() if node["module"] == "blocks.0.fc2")
    data["nodes"][fc2]["output"] = ["R", "R"]
    plan.write_text(json.dumps(data))
    code, report = verify(f"verify mlp --mesh 2 --plan {plan}")
    return row("verify mlp --mesh 2 --plan plan.json (fc2's output edited from P to R)", code, report)


def row(command: str, code: int, report: dict | None) -> list:
    if report is None or report["error"]:
        return [command, "-", "-", (report or {}).get("error", "no report"), code]
    split = "; ".join(f"{a}: {n['params']} params, {n['inputs']} inputs" for a, n in report["split"].items())
    degrees = " x ".join(f"{a}={s}" for a, s in report["degrees"].items())
    notes = " (a smaller copy: " + report["notes"][0].split("(", 1)[1].split(")")[0] + ")" if report["notes"] else ""
    worst = f"{report['worst']['relative_error']:.1e} ({report['worst']['what']})"
    return [f"`autopar {command}`", degrees + notes, split, worst, code]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first two commands; print, do not write")
    args = parser.parse_args()
    rows = [row(command, *verify(command)) for command in COMMANDS[: 2 if args.quick else None]]
    with tempfile.TemporaryDirectory() as folder:
        rows.append(corrupted_plan_row(Path(folder)))
    table = tabulate(rows, headers=["command", "ran", "split", "worst relative error", "exit"], tablefmt="github")
    section = "\n".join(
        [
            "## autopar verify",
            "",
            "`python benchmarks/verify_examples.py`: one training step (forward, backward, AdamW) of each plan on "
            "local gloo ranks against one process, on this machine's 2 shared cores. Exact means every relative "
            "error (|x - ref| / (|ref| + 0.01), worst element) of the loss, each gradient and each updated parameter "
            "is at most 1e-4 (fp32); exit 0 then, 3 otherwise. The 8x8 Llama does not fit here: verify runs a "
            "smaller copy with the plan's parameter placements pinned (autopar/shrink.py). The last row is a plan "
            "corrupted by hand.",
            "",
            table,
        ]
    )
    publish(SECTION, section, args.quick)


if __name__ == "__main__":
    main()
