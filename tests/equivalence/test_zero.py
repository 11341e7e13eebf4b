"""ZeRO-1/2/3 against the unparallelized model (same loss, full gradients and parameters after
AdamW, fp32), on DP4 and DP2×TP2 gloo meshes of 4 ranks and with 2 microbatches on DP2; when
ZeRO syncs accumulated gradients; and what ZeRO saves per rank, on DP4 and inside the stages
of PP2×DP2 (whose training steps are test_pipeline_parallel's).

ZeRO cases take the plan the search makes without ZeRO and set its stage, so every stage
runs the same data-parallel program (the search may otherwise pick another plan per stage);
one case goes through ``parallelize(..., zero=3)`` as users call it.
"""

import dataclasses
import weakref

import pytest
import torch
import torch.distributed as dist
from equivalence import GPT_TP, _rel, compare_one_step, load_example
from mixed_precision import state_bytes
from shared_captures import build

import autopar
from autopar.ir import get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.runtime.faults import from_rank_zero
from autopar.runtime.spawn import run_local
from autopar.runtime.zero import gather as zero_gathers

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

GPT = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
BATCH = 8
MESHES = {  # name: mesh, degrees, constraints, schedule
    "DP4": (4, {"dp": 4, "tp": 1}, None, {}),
    "DP2xTP2": ("2x2", {"dp": 2, "tp": 2}, GPT_TP, {}),
    "PP2xDP2": ("2x2", {"pp": 2, "dp": 2}, None, dict(microbatches=2, pipeline="1f1b")),
}
# ZeRO inside pipeline stages steps in test_pipeline_parallel (ZERO_CASES); here its memory
CASES = [("DP4", stage, "pinned plan") for stage in (1, 3)] + [("DP2xTP2", stage, "pinned plan") for stage in (2, 3)]
CASES.append(("DP4", 3, "zero=N"))
# DP2, 2 microbatches. The MLP's fc1.bias (9) has no dim dp=2 divides: ZeRO leaves it whole.
MLP_MIXED = dict(hidden=6, ffn=9, layers=2)
MICRO_CASES = [("gpt", stage) for stage in (2, 3)] + [("mlp", stage) for stage in (2, 3)]


def _plan(gpt, mesh_name: str, stage: int):
    mesh, degrees, constraints, schedule = MESHES[mesh_name]
    model = build(gpt.build, **GPT)
    base = from_rank_zero(
        lambda: autopar.plan(
            model, mesh, model.example_inputs(BATCH), degrees=degrees, constraints=constraints, zero=0, **schedule
        ),
        "planning",
    )
    return dataclasses.replace(base, zero=stage)


def _zero3_frees_gathered_weights(gpt) -> dict:
    """After a ZeRO-3 forward, no gathered weight's memory is alive (autograd keeps the shards):
    weak references to the gathered storages (storages die with their last tensor or view).
    Also counts the forward's all-gathers (one per layer group)."""
    model = build(gpt.build, **GPT)
    pmodel = autopar.parallelize(model, 4, model.example_inputs(BATCH), plan=_plan(gpt, "DP4", 3))
    gathered, collectives, unflatten = [], [], zero_gathers.unflatten_gathered

    def recording_unflatten(*args):
        wholes = unflatten(*args)
        gathered.extend(weakref.ref(whole.untyped_storage()) for whole in wholes)
        collectives.append(len(wholes))
        return wholes

    zero_gathers.unflatten_gathered = recording_unflatten
    try:
        loss = pmodel(*model.example_inputs(BATCH))
    finally:
        zero_gathers.unflatten_gathered = unflatten
    alive = sum(ref() is not None for ref in gathered)
    loss.backward()
    return {"gathered": len(gathered), "alive_after_forward": alive, "collectives": len(collectives)}


def _zero3_accumulates_under_no_sync(gpt) -> dict:
    """Two ZeRO-3 micro-steps, the first under ``no_sync``: no gradient reaches the shards
    until the second, whose gradients equal the single-process sum of both."""
    torch.manual_seed(0)
    model = build(gpt.build, **GPT)
    first = model.example_inputs(BATCH)
    second = tuple(tensor.flip(0) for tensor in first)
    pmodel = autopar.parallelize(model, 4, first, plan=_plan(gpt, "DP4", 3))
    model(*first).backward()
    model(*second).backward()
    with pmodel.no_sync():
        pmodel.train_step(*pmodel.shard_batch(*first))
    unsynced = sum(param.grad is not None for param in pmodel.parameters())
    pmodel.train_step(*pmodel.shard_batch(*second))
    reference = dict(model.named_parameters())
    errors = [_rel(param.grad.full_tensor(), reference[name].grad) for name, param in pmodel.named_parameters()]
    return {"grads_inside_no_sync": unsynced, "grad": max(errors)}


def _memory(gpt, mesh_name: str) -> dict:
    """Per stage: measured bytes of parameters, gradients and optimizer state on this rank,
    and the cost model's prediction of the same for the plan (for the busiest pipeline stage)."""
    bytes_by_stage = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = build(gpt.build, **GPT)
        plan = _plan(gpt, mesh_name, stage)
        cost = evaluate_plan(capture(model, model.example_inputs(BATCH)), plan, get_profile("cpu-local"))
        pmodel = autopar.parallelize(model, MESHES[mesh_name][0], model.example_inputs(BATCH), plan=plan)
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-4)
        pmodel.train_step(*pmodel.shard_batch(*model.example_inputs(BATCH)))
        optimizer.step()
        predicted = cost.memory["params"] + cost.memory["grads"] + cost.memory["optimizer"]
        bytes_by_stage[stage] = (state_bytes(pmodel, optimizer), predicted)
    return bytes_by_stage


def _micro_plan(builder, kwargs: dict, stage: int):
    """DP2 with 2 microbatches, summing gradients over dp (pinned as ``_plan`` does)."""
    model = build(builder, **kwargs)
    base = from_rank_zero(
        lambda: autopar.plan(model, 2, model.example_inputs(BATCH), degrees={"dp": 2}, microbatches=2, zero=0),
        "planning",
    )
    assert (
        base.schedule.microbatches == 2 and base.grad_sync and all(axes == ("dp",) for axes in base.grad_sync.values())
    ), base
    return dataclasses.replace(base, zero=stage)


def _grad_collectives_by_microbatch(gpt, stage: int) -> list[int]:
    """DP2, 2 microbatches: the gradient collectives (reduce-scatters, and all-reduces of more
    than the scalar loss or the microbatches' counts of targets) issued before the first
    microbatch's forward, before the second's, and by the end of the step."""
    model = build(gpt.build, **GPT)
    inputs = model.example_inputs(BATCH)
    pmodel = autopar.parallelize(model, 2, inputs, plan=_micro_plan(gpt.build, GPT, stage))
    issued, marks = [0], []
    reduce_scatter, all_reduce, run = dist.reduce_scatter_single, dist.all_reduce, pmodel._run

    def counted(collective, tensor, *args, **kwargs):
        issued[0] += collective is reduce_scatter or tensor.numel() > pmodel.plan.schedule.microbatches
        return collective(tensor, *args, **kwargs)

    dist.reduce_scatter_single = lambda *args, **kwargs: counted(reduce_scatter, *args, **kwargs)
    dist.all_reduce = lambda *args, **kwargs: counted(all_reduce, *args, **kwargs)
    pmodel._run = lambda program, pieces: marks.append(issued[0]) or run(program, pieces)
    try:
        pmodel.train_step(*pmodel.shard_batch(*inputs))
    finally:
        dist.reduce_scatter_single, dist.all_reduce = reduce_scatter, all_reduce
    return marks + issued


def _two_ranks(rank, world):
    gpt, mlp = load_example("gpt.py"), load_example("mlp.py")
    results = {}
    for name, stage in MICRO_CASES:
        builder, kwargs = (gpt.build, GPT) if name == "gpt" else (mlp.build, MLP_MIXED)
        options = dict(mesh=2, plan=_micro_plan(builder, kwargs, stage), optimizer="shards", check_forward=True)
        results[(name, stage)] = compare_one_step(builder, kwargs, BATCH, world, options)
    results["collectives"] = {stage: _grad_collectives_by_microbatch(gpt, stage) for stage in (1, 2, 3)}
    return results


def _four_ranks(rank, world):
    gpt = load_example("gpt.py")
    results = {}
    for mesh_name, stage, how in CASES:
        mesh, degrees, constraints, _ = MESHES[mesh_name]
        if how == "zero=N":
            options = dict(mesh=mesh, degrees=degrees, zero=stage, optimizer="shards")
        else:
            options = dict(mesh=mesh, plan=_plan(gpt, mesh_name, stage), optimizer="shards")
        results[(mesh_name, stage, how)] = compare_one_step(gpt.build, GPT, BATCH, world, options)
    results["frees"] = _zero3_frees_gathered_weights(gpt)
    results["no_sync"] = _zero3_accumulates_under_no_sync(gpt)
    results["memory"] = _memory(gpt, "DP4")
    results["pipelined_memory"] = _memory(gpt, "PP2xDP2")
    return results


@pytest.fixture(scope="module")
def four_ranks():
    return run_local(_four_ranks, 4, timeout_s=600)


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_two_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-zero{s}-{how.replace(' ', '_')}" for m, s, how in CASES])
def test_zero_step_matches_single_process(four_ranks, case):
    for rank, results in enumerate(four_ranks):
        result = results[case]
        # each figure is the worst |x - ref| / (1e-6 + 1e-4·|ref|): allclose holds when <= 1
        assert result["loss"] <= 1, (rank, case, result)
        assert result["grad"][0] <= 1, (rank, case, result)
        assert result["param"][0] <= 1, (rank, case, result)


def test_zero3_drops_gathered_weights_after_use(four_ranks):
    for results in four_ranks:
        assert results["frees"]["gathered"] >= 20, results["frees"]  # 25 parameters, gathered once each
        assert results["frees"]["alive_after_forward"] == 0, results["frees"]
        assert results["frees"]["collectives"] == GPT["layers"] + 1, results["frees"]  # per layer, and the root


def test_zero3_no_sync_accumulates_locally(four_ranks):
    for results in four_ranks:
        assert results["no_sync"]["grads_inside_no_sync"] == 0, results["no_sync"]  # nothing reduce-scattered yet
        assert results["no_sync"]["grad"] <= 1, results["no_sync"]


def test_zero3_model_state_at_most_35_percent_of_dp_and_as_predicted(four_ranks):
    for results in four_ranks:
        measured = {stage: pair[0] for stage, pair in results["memory"].items()}
        assert measured[3] <= 0.35 * measured[0], measured
        assert measured[2] < measured[1] < measured[0], measured  # each stage saves more
        for stage, (bytes_held, predicted) in results["memory"].items():
            assert abs(predicted - bytes_held) <= 0.2 * bytes_held, (stage, bytes_held, predicted)


@pytest.mark.parametrize("case", MICRO_CASES, ids=[f"{name}-zero{stage}" for name, stage in MICRO_CASES])
def test_zero_with_microbatches_matches_single_process(two_ranks, case):
    for rank, results in enumerate(two_ranks):
        result = results[case]
        assert result["schedule"].microbatches == 2, result["schedule"]
        assert max(result["loss"], result["grad"][0], result["param"][0], result["forward"]) <= 1, (rank, case, result)


def test_zero2_and_3_reduce_scatter_each_microbatch_zero1_syncs_once(two_ranks):
    """DeepSpeed's rule (``ZeroLayout.syncs_each_microbatch``): ZeRO-1 all-reduces the
    accumulated gradients once; ZeRO-2/3 reduce-scatter the first microbatch's gradients
    before the second runs, and as many again for the second."""
    for results in two_ranks:
        before_first, before_second, total = results["collectives"][1]
        assert before_first == before_second == 0 < total, results["collectives"]
        for stage in (2, 3):
            before_first, before_second, total = results["collectives"][stage]
            assert before_first == 0 < before_second and total == 2 * before_second, results["collectives"]


def test_zero_inside_pipeline_stages_shards_model_state_as_predicted(four_ranks):
    """PP2xDP2: each rank holds its stage's parameters, split over the stage's dp=2 ranks."""
    for results in four_ranks:
        measured = {stage: pair[0] for stage, pair in results["pipelined_memory"].items()}
        assert measured[3] <= 0.55 * measured[0], measured
        assert measured[3] < measured[2] < measured[1] < measured[0], measured
        for stage, (bytes_held, predicted) in results["pipelined_memory"].items():
            assert abs(predicted - bytes_held) <= 0.2 * bytes_held, (stage, bytes_held, predicted)
