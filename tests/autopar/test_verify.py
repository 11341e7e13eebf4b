"""autopar verify: a plan's step on local gloo ranks against one process (autopar/verify.py),
the smaller copy it runs when a model does not fit (autopar/shrink.py), and the command."""

import json

import pytest
import torch
from equivalence import GPT_TP, LLAMA_TP, ROOT

from autopar.cli import main
from autopar.cli.models import Factory
from autopar.ir import KERNEL_DIMS, Plan, PlanOptions, StalePlanError
from autopar.shrink import shrink_degrees, shrink_sizes
from autopar.verify import prepare, run

GPT = Factory(str(ROOT / "examples" / "gpt.py"), "build")
SMALL_GPT = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)
BIG_GPT = dict(hidden=1024, layers=8, heads=16, vocab=4096, seq=256)


def _example(file: str, name: str = "build") -> Factory:
    return Factory(str(ROOT / "examples" / file), name)


@pytest.mark.ranks
def test_verify_is_exact_on_every_example_an_hf_model_a_meta_plan_and_a_shrunk_copy():
    with torch.device("meta"):
        gpt = GPT(**SMALL_GPT)
    meta_plan = _meta_plan(gpt, GPT_TP)
    targets = {
        "mlp dp": prepare(_example("mlp.py"), 2, options=PlanOptions(degrees={"dp": 2})),
        "gpt tp": prepare(GPT, 2, kwargs=SMALL_GPT, options=PlanOptions(degrees={"tp": 2}, constraints=GPT_TP)),
        "long-context gpt cp": prepare(
            _example("long_context_gpt.py"),
            2,
            kwargs=dict(hidden=32, layers=2, heads=4, vocab=64, seq=32),
            options=PlanOptions(degrees={"cp": 2}, constraints={"layers.*.attn": "ring"}),
        ),
        "moe gpt ep": prepare(
            _example("moe_gpt.py"),
            2,
            kwargs=dict(hidden=32, layers=2, heads=4, vocab=64, seq=16),
            options=PlanOptions(degrees={"ep": 2}, constraints={"layers.*.moe": "experts"}),
        ),
        "hf llama tp": prepare(
            _example("hf.py", "build_llama"),
            2,
            kwargs=dict(hidden=64, layers=2, heads=4, kv_heads=2, seq=16),
            options=PlanOptions(degrees={"tp": 2}, constraints=LLAMA_TP),
        ),
        "gpt plan made on meta": prepare(GPT, 2, kwargs=SMALL_GPT, plan=meta_plan),
        "big gpt on 2x4, shrunk": prepare(
            GPT, "2x4", kwargs=BIG_GPT, options=PlanOptions(degrees={"dp": 2, "tp": 4}, constraints=GPT_TP), max_ranks=2
        ),
    }
    made_on_meta = targets["gpt plan made on meta"]  # captured as its CPU twin: it runs as it is
    assert made_on_meta.plan.fingerprint == meta_plan.fingerprint and made_on_meta.notes == ()
    shrunk = targets["big gpt on 2x4, shrunk"]
    assert shrunk.mesh.size == 2 and shrunk.kwargs["hidden"] == 64 and shrunk.kwargs["layers"] == 2
    assert shrunk.options.constraints["layers.0.attn.wq.weight"] == "S(0)"  # the plan's column split, pinned

    reports = dict(zip(targets, run(list(targets.values()), timeout_s=300)))
    failures = {name: r.text() for name, r in reports.items() if not r.exact}
    assert not failures, failures
    split = {name: sum(n for counts in r.split.values() for n in counts.values()) for name, r in reports.items()}
    assert all(split.values()), split  # something is split in every case: no exact-because-replicated
    pinned_split = sum(1 for value in shrunk.options.constraints.values() if value != "R" and value not in KERNEL_DIMS)
    assert reports["big gpt on 2x4, shrunk"].split["tp"]["params"] == pinned_split  # the big plan's pattern


@pytest.mark.ranks
def test_the_command_exits_0_on_a_plan_and_3_on_the_plan_corrupted(tmp_path, capsys):
    """mlp captures alike on meta and CPU, so the plan autopar plan saves runs as it is."""
    plan_file = tmp_path / "plan.json"
    mesh = ["--mesh", "2"]
    pins = ["--degrees", "dp=1,tp=2", "--constraint", "blocks.*.fc1=S(-1)", "--constraint", "blocks.*.fc2=P"]
    assert main(["plan", "mlp", *mesh, "--batch", "4", *pins, "--save", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["verify", "mlp", *mesh, "--plan", str(plan_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exact"] and report["notes"] == [] and report["split"] == {"tp": {"params": 6, "inputs": 0}}

    data = json.loads(plan_file.read_text())
    fc2 = next(name for name, node in data["nodes"].items() if node["module"] == "blocks.0.fc2")
    assert data["nodes"][fc2]["output"] == ["R", "P"]
    data["nodes"][fc2]["output"] = ["R", "R"]  # the row-parallel output's all-reduce dropped
    plan_file.write_text(json.dumps(data))
    assert main(["verify", "mlp", *mesh, "--plan", str(plan_file)]) == 3
    out = capsys.readouterr().out
    assert "NOT exact" in out and "worst: gradient of blocks." in out


def _meta_plan(model, constraints) -> Plan:
    import autopar

    return autopar.plan(
        model, 2, model.example_inputs(4, device="meta"), degrees={"dp": 1, "tp": 2}, constraints=constraints
    )


def test_a_plan_for_another_model_is_refused_before_any_rank_starts():
    with torch.device("meta"):
        mlp = _example("mlp.py")()
    plan = _meta_plan(mlp, {})
    with pytest.raises(StalePlanError, match="another model"):
        prepare(GPT, 2, kwargs=SMALL_GPT, plan=plan)


def test_the_copy_lowers_sizes_and_degrees_keeping_every_split_divisible():
    kwargs, changes = shrink_sizes(GPT, dict(BIG_GPT), layers=2)
    assert kwargs == dict(hidden=64, layers=2, heads=4, vocab=256, seq=32)  # ffn follows hidden in build()
    assert "hidden 1024 -> 64" in changes
    llama = _example("hf.py", "build_llama")
    kwargs, _ = shrink_sizes(llama, dict(hidden=4096, heads=32, kv_heads=32, ffn=11008, layers=32), layers=4)
    assert kwargs["kv_heads"] == kwargs["heads"] == 4 and kwargs["layers"] == 4 and kwargs["ffn"] == 128

    with pytest.raises(ValueError, match="takes none of the sizes verify lowers"):
        shrink_sizes(lambda width=4096: None, {}, layers=2)

    degrees, changes = shrink_degrees({"pp": 4, "dp": 8, "tp": 8}, zero=0, max_ranks=4)
    assert degrees == {"pp": 2, "dp": 1, "tp": 2}  # dp goes first...
    degrees, _ = shrink_degrees({"pp": 4, "dp": 8, "tp": 8}, zero=1, max_ranks=4)
    assert degrees == {"pp": 1, "dp": 2, "tp": 2}  # ...unless ZeRO runs over it
