import re

import pytest
from planning import plan_example

from autopar.ir import (
    ConfigError,
    Mesh,
    MeshError,
    Partial,
    Plan,
    PlanOptions,
    PrecisionPolicy,
    Replicate,
    Schedule,
    Shard,
    StalePlanError,
    check_degrees,
    get_profile,
    parse_placement,
    wait_name,
    waited_for,
)


@pytest.mark.parametrize("placement", [Shard(0), Shard(-1), Replicate(), Partial(), Partial("avg")])
def test_placements_read_back_from_their_compact_form(placement):
    assert parse_placement(str(placement)) == placement


def test_bad_placement_mesh_and_degrees_are_clear_errors():
    with pytest.raises(ConfigError, match="S\\(dim\\)"):
        parse_placement("Shard")
    with pytest.raises(MeshError, match="2x4"):
        Mesh.parse("two by four")
    with pytest.raises(ConfigError, match="supports"):
        check_degrees({"xp": 2}, 4)
    with pytest.raises(ConfigError, match="does not divide"):
        check_degrees({"tp": 3}, 4)
    assert check_degrees({"tp": 2}, 8) == {"dp": 4, "tp": 2}


def test_unknown_hardware_profile_lists_the_known_ones():
    with pytest.raises(ConfigError, match="a100-80gb"):
        get_profile("tpu-v9")


def test_plan_round_trips_through_json_and_prints_a_table(tmp_path):
    plan = plan_example("gpt.py", "2x2", batch=8, model_kwargs=dict(hidden=32, layers=1, heads=2, vocab=64, seq=8))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    text = str(plan)
    assert "layers.0.attn.wq.weight" in text and "predicted step" in text
    line = text.split("predicted step ")[1].split(";")[0]  # "61.82 ms (compute 43.84, ..., pipeline bubble 12.38)"
    step, parts = float(line.split(" ms")[0]), [float(v) for v in re.findall(r" ([\d.]+)[,)]", line)]
    # what the step is made of, all of it (six figures printed to 0.01 ms: at most 6 x 0.005 apart)
    assert len(parts) == 5 and sum(parts) == pytest.approx(step, abs=0.03)


def test_a_plan_records_its_precision_and_the_hardware_picks_the_default(tmp_path):
    plan = plan_example("mlp.py", 2, batch=8, precision="fp16-mixed", reduce_dtype="float16")
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan and loaded.precision_policy == PrecisionPolicy.of("fp16-mixed", "float16")
    assert loaded.precision_policy.loss_scaling
    assert PlanOptions().precision_policy.precision == "fp32"  # this CPU's preset
    assert PlanOptions(hardware="a100-80gb").precision_policy == PrecisionPolicy.of("bf16-mixed")


def test_async_tp_is_recorded_in_the_plan_and_asks_for_compiled_programs(tmp_path):
    tiny = dict(hidden=32, layers=1, heads=2, vocab=64, seq=8)
    plan = plan_example("gpt.py", 2, batch=4, model_kwargs=tiny, degrees={"tp": 2}, compile=True, async_tp=True)
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.schedule == Schedule(compiled=True, async_tp=True) and "async TP" in str(loaded.schedule)
    with pytest.raises(ConfigError, match="compile=True"):
        PlanOptions(async_tp=True)
    with pytest.raises(ConfigError, match="compile=True"):
        Schedule(async_tp=True)


def test_a_plan_file_of_another_format_is_stale(tmp_path):
    plan = plan_example("mlp.py", 2, batch=8)
    data = plan.to_json()
    data["format"] = 0
    with pytest.raises(StalePlanError, match="re-run"):
        Plan.from_json(data)


def test_hardware_profiles_round_trip_with_fitted_collectives(tmp_path):
    from dataclasses import replace

    from autopar.ir import LinkTier

    base = get_profile("a100-80gb")
    link = LinkTier("nvswitch", 1e-5, 2e11, fitted={"all_gather": {8: (2e-5, 1.5e11)}})
    profile = replace(base, links=(link, base.links[1]))
    loaded = type(profile).load(profile.save(tmp_path / "a100.json"))
    assert loaded == profile
    assert get_profile(str(tmp_path / "a100.json")) == profile
    assert loaded.links[0].alpha_beta("all_gather", 4) == (2e-5, 1.5e11)  # nearest fitted size
    assert loaded.links[0].alpha_beta("all_reduce", 4) == (1e-5, 2e11)  # not fitted: the tier's own


def test_a_compiled_wait_name_reads_back_as_the_program_nodes_it_waits_for():
    assert waited_for(wait_name(["all_gather_3"], backward=False)) == "node all_gather_3"
    named = wait_name(["a_1", "b", "c", "d", "e"], backward=True)
    assert waited_for(named) == "the backward of nodes a_1, b, c and 2 more"
    assert waited_for("wait_tensor_7") == ""  # a wait overlap did not name
