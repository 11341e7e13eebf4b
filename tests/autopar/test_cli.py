"""The ``autopar`` command, run in-process on the meta device (no process groups).

Each planning call traces the example GPT and searches (~2 s); the other checks fail before
any model is built.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from equivalence import ROOT

from autopar.cli import main, parse_bytes
from autopar.ir import Plan

MESH = ["--mesh", "2x2", "--batch", "8"]
PINNED_TP = ["--degrees", "dp=1,tp=4", "--constraint", "layers.*.mlp.fc1=S(-1)", "--constraint", "layers.*.mlp.fc2=P"]


def test_plan_prints_module_table_and_predicted_step(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person watching: progress on stderr
    assert main(["plan", "gpt", *MESH]) == 0
    out, err = capsys.readouterr()
    assert "capture: tracing GPT with torch.export" in err and " graph nodes in " in err
    assert re.search(r"search: (\d+)/\1 configurations", err)
    assert "layers.0-1 x2" in out and "layers.0-1.attn.wq" in out and "weight (" in out  # identical layers once
    assert "layers.1.attn" not in out
    assert "layers.0-1 x2: 2 identical layers" in out  # the footnote names this model's run
    assert "predicted step time:" in out and " ms" in out
    assert "peak memory per device:" in out and "<- chosen" in out


def test_plan_for_compiled_programs(capsys, tmp_path):
    """--compile plans what parallelize(..., compile=True) runs (priced from the compiled schedule)
    and the saved plan says so; --async-tp needs it."""
    saved = tmp_path / "plan.json"
    assert main(["plan", "gpt", *MESH, "--compile", "--save", str(saved)]) == 0
    assert ", compiled" in capsys.readouterr().out
    assert Plan.load(saved).schedule.compiled
    assert main(["plan", "gpt", *MESH, "--async-tp"]) == 1
    assert "pass compile=True" in capsys.readouterr().err


def test_plan_pins_regather_and_shows_it(capsys, tmp_path):
    """--regather on keeps the sequence-parallel norms' gathered outputs as shards (the saved plan
    says so, explain too); with full recomputation there is nothing to regather."""
    saved = tmp_path / "plan.json"
    sequence_parallel = ["--constraint", "layers.*.attn_norm=S(1)", "--constraint", "layers.*.mlp_norm=S(1)"]
    pins = ["--degrees", "dp=2,tp=2", *sequence_parallel, "--recompute", "none", "--regather", "on"]
    assert main(["plan", "gpt", *MESH, *pins, "--save", str(saved)]) == 0
    assert "gathered inputs kept as shards and gathered again in backward" in capsys.readouterr().out
    assert Plan.load(saved).schedule.regather
    assert main(["explain", str(saved)]) == 0
    assert "m=1, none, regather" in capsys.readouterr().out  # the search's table, its one configuration
    assert main(["plan", "gpt", *MESH, "--recompute", "full", "--regather", "on"]) == 1
    assert "no gathered input to regather" in capsys.readouterr().err


def test_export_says_what_the_runtime_does_beyond_the_program(capsys, tmp_path):
    """The exported program is the rewrite; its header names what the runtime adds: microbatches,
    checkpointed layers, and each all-gather it fuses with its linears (every one that only linears
    read: the two sequence-parallel norms of each of the 2 layers)."""
    sequence_parallel = ["--constraint", "layers.*.attn_norm=S(1)", "--constraint", "layers.*.mlp_norm=S(1)"]
    pins = ["--degrees", "dp=2,tp=2", *sequence_parallel, "--recompute", "selective", "--regather", "on"]
    assert main(["export", "gpt", *MESH, *pins, "--microbatches", "2", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    rank0 = (tmp_path / "rank0.py").read_text()
    assert "on 1/2 of the batch at a time" in rank0 and "recompute selective: each layer's span" in rank0
    fused = re.search(r"regather: (\d+) all-gather\(s\).*: (.*)", rank0)
    names = fused.group(2).split(", ")
    assert int(fused.group(1)) == len(names) == 4
    assert all(re.search(rf"{name} = torch\.ops\.autopar\.all_gather\.default\(", rank0) for name in names)


def test_export_of_a_pipeline_writes_each_rank_its_stage_modules(capsys, tmp_path):
    """With pipeline stages (the outermost mesh dimension), each rank's file holds the stage
    modules its pipeline device runs: the first stage's ranks the layer that sends, the last's the
    one that receives it and returns the loss."""
    assert main(["export", "gpt", "--mesh", "4", "--batch", "8", "--degrees", "pp=2,dp=2", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    files = [(tmp_path / f"rank{rank}.py").read_text() for rank in range(4)]
    for rank, text in enumerate(files):
        compile(text, f"rank{rank}.py", "exec")
        assert f"this rank's coordinates: pp={rank // 2}, dp={rank % 2}" in text
        assert f"'pp': ranks [{rank % 2}, {rank % 2 + 2}]" in text
    first, last = files[0], files[3]
    assert "def stage0(" in first and "def stage1(" not in first and "# stage module 0: layers.0; sends" in first
    assert "def stage1(" in last and "def stage0(" not in last and "receives" in last and "returns the loss" in last
    assert re.search(r"received_\w+,  # received \(S\(0\), R\) \[8, 64, 128\] -> local \[4, 64, 128\]", last)


def test_plan_makes_the_inputs_of_an_unmodified_hugging_face_model(capsys):
    """A model without example_inputs (``from_config``'s Qwen2ForCausalLM): autopar makes random
    input_ids as labels, ``--seq`` tokens long, and ``--at`` re-captures the same call by name."""
    model = "hf:from_config('qwen2', layers=1, seq=64)"
    assert main(["plan", model, "--mesh", "2", "--seq", "16", "--at", "batch=8,seq=32"]) == 0
    out = capsys.readouterr().out
    assert "planned at batch 4, seq 16: step" in out and "re-evaluated at batch 8, seq 32: step" in out
    assert "predicted step time:" in out
    assert main(["plan", "gpt", "--mesh", "2", "--seq", "16"]) == 2  # gpt makes its own inputs
    assert "--seq" in capsys.readouterr().err
    assert main(["verify", model, "--mesh", "2"]) == 1  # verify needs example_inputs: said before any rank starts
    assert "example_inputs" in capsys.readouterr().err


def test_plan_pins_a_parallel_kernel_and_shows_its_traffic(capsys):
    pins = ["--degrees", "dp=1,cp=4,tp=1", "--constraint", "layers.*.attn=ring", "--json"]
    model = f"{ROOT / 'examples' / 'long_context_gpt.py'}:build(seq=256)"
    assert main(["plan", model, "--mesh", "4", "--batch", "1", *pins]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["degrees"] == {"dp": 1, "cp": 4, "tp": 1}
    attention = [n for n in report["plan"]["nodes"].values() if "scaled_dot_product_attention" in n["op"]]
    assert attention and all(n["kernel"] == "ring" for n in attention)
    rows = [row for row in report["modules"] if row["module"].endswith(".attn")]
    assert rows and all(
        row["collectives"].get("ring_attention/cp") == 1 and row["collective_bytes"] > 0 for row in rows
    )


def test_plan_json_honours_degrees_and_save_explain_round_trips(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    assert main(["plan", "gpt", *MESH, "--degrees", "dp=1,tp=4", "--json", "--save", str(saved)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"degrees", "modules", "summary", "search", "replicated_ops", "plan"}
    assert report["degrees"] == {"dp": 1, "tp": 4}
    assert [entry["degrees"] for entry in report["search"]] == [{"dp": 1, "tp": 4}]
    assert report["summary"]["step_s"] > 0 and report["summary"]["peak_memory"] > 0
    wq = next(row for row in report["modules"] if row["module"] == "layers.0.attn.wq")
    assert set(wq["params"]) == {"weight"} and wq["param_bytes"] > 0

    loaded = Plan.load(saved)
    assert loaded.degrees == {"dp": 1, "tp": 4}
    assert json.loads(json.dumps(loaded.to_json())) == report["plan"]
    assert main(["explain", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(loaded).splitlines()[0])
    assert "search: 1 configuration in" in out
    assert "node decisions by module" in out and "layers.0-1.attn.wq" in out  # identical layers once


def test_every_choice_can_be_pinned_to_evaluate_one_configuration(capsys):
    gpt = "examples/gpt.py:build(hidden=256, layers=4, heads=8, vocab=1024, seq=128)"
    pins = [
        "--degrees",
        "pp=2,dp=2,tp=2",
        "--zero",
        "1",
        "--recompute",
        "full",
        "--microbatches",
        "4",
        "--pipeline",
        "interleaved-1f1b",
        "--virtual",
        "2",
    ]
    assert main(["plan", gpt, "--mesh", "4x2", "--batch", "16", "--hardware", "a100-80gb", *pins, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["zero"] == 1 and summary["schedule"] == {
        "stages": 2,
        "microbatches": 4,
        "recompute": "full",
        "kind": "interleaved-1f1b",
        "virtual": 2,
        "cuts": ["layers.1", "layers.2", "layers.3"],
        "compiled": False,
        "async_tp": False,
        "regather": False,
    }
    assert summary["pipeline_s"] > 0 and summary["model_tflops_per_device"] > 0
    assert set(summary["memory"]) == {"params", "grads", "optimizer", "grad_buckets", "activations", "temporary"}
    assert main(["plan", gpt, "--mesh", "4x2", "--batch", "16", "--hardware", "a100-80gb", *pins]) == 0
    out = capsys.readouterr().out
    assert "pipeline bubble" in out and "2 pipeline stage(s), 4 microbatch(es), recompute full" in out


def test_precision_is_planned_recorded_and_shown(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    gpu = [*MESH, "--hardware", "a100-80gb", "--degrees", "dp=4,tp=1"]
    assert main(["plan", "gpt", *gpu, "--json"]) == 0  # the preset's natural choice
    assert json.loads(capsys.readouterr().out)["summary"]["precision"] == "bf16-mixed"
    assert main(["plan", "gpt", *gpu, "--precision", "fp32", "--save", str(saved)]) == 0
    assert "precision: fp32 (weights, gradients and optimizer state in float32)" in capsys.readouterr().out
    assert Plan.load(saved).precision == "fp32"
    assert main(["explain", str(saved)]) == 0
    assert "(dp=4 x tp=1, fp32)" in capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "gpt", *gpu, "--precision", "fp8"]) == 2
    assert "--precision: invalid choice" in capsys.readouterr().err


def test_export_writes_per_rank_programs_plan_and_dot(capsys, tmp_path):
    out_dir = tmp_path / "exported"
    assert main(["export", "gpt", *MESH, *PINNED_TP, "--out", str(out_dir)]) == 0
    names = ["rank0.py", "rank1.py", "rank2.py", "rank3.py", "plan.json", "graph.dot"]
    printed = capsys.readouterr().out
    assert all(str(out_dir / name) in printed for name in names)

    rank0, rank3 = (out_dir / "rank0.py").read_text(), (out_dir / "rank3.py").read_text()
    compile(rank0, "rank0.py", "exec")
    assert re.search(r"torch\.ops\.autopar\.\w+\.default\(\w+, 'tp'", rank0)
    assert "coordinates: dp=0, tp=0" in rank0 and "coordinates: dp=0, tp=3" in rank3
    assert "layers.0.mlp.fc1.weight (R, S(0)) [512, 128] -> local [128, 128]" in rank0
    body = lambda text: text[text.index("def forward(") :]  # noqa: E731
    assert body(rank0) == body(rank3)  # SPMD: one program, per-rank headers

    assert Plan.load(out_dir / "plan.json").degrees == {"dp": 1, "tp": 4}
    dot = (out_dir / "graph.dot").read_text()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert 'fillcolor="orange"' in dot and "subgraph cluster_" in dot and " -> " in dot


@pytest.mark.parametrize(
    "model, message",
    [
        ("gpt:build(hidden=", "cannot read"),
        ("no_such_example", "no file"),
        ("examples/gpt.py:no_such_factory", "has no function"),
        ("gpt:build(hidden=a)", "literals"),
    ],
)
def test_bad_model_exits_2_naming_model(capsys, model, message):
    assert main(["plan", model, "--mesh", "2x2"]) == 2
    err = capsys.readouterr().err
    assert "MODEL" in err and message in err


def test_bad_option_exits_2(capsys):
    assert main(["plan", "gpt", "--mesh", "2y2"]) == 2
    assert "--mesh" in capsys.readouterr().err


def test_unknown_hardware_exits_1_with_profiles(capsys):
    assert main(["plan", "gpt", "--mesh", "2x2", "--hardware", "tpu-v9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tpu-v9" in err
    assert "cpu-local" in err and "h100-80gb" in err and "Traceback" not in err


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e9") == 1e9
    with pytest.raises(Exception, match="cannot read"):
        parse_bytes("8 parsecs")


@pytest.mark.ranks
def test_run_passes_script_args_and_exit_code(capsys, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint('args', sys.argv[1:])\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    assert main(["run", str(script), "--nproc", "2", "--timeout", "60", "--", "--steps", "10"]) == 3
    assert "[rank 0] args ['--steps', '10']" in capsys.readouterr().out


@pytest.mark.ranks
def test_run_restarts_failed_ranks_and_passes_the_collective_timeout(capsys, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\nprint('timeout', os.environ['AUTOPAR_COLLECTIVE_TIMEOUT'])\n"
        "sys.exit(3 if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"
    )
    assert main(["run", str(script), "--nproc", "2", "--max-restarts", "1", "--collective-timeout", "7"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("timeout 7.0") == 4 and "restart 1 of 1" in captured.err
