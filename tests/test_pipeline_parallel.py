"""Pipeline stages and microbatches against the unparallelized model: same loss, full
gradients and parameters after AdamW (fp32), for every torch pipelining schedule on PP2 and
PP4, and with data and tensor parallelism inside the stages (PP2xDP2, PP2xTP2)."""

import pytest

from autopar.ir import PIPELINES
from autopar.runtime.spawn import run_local
from equivalence import GPT_TP, compare_one_step, load_example

GPT = dict(hidden=32, layers=8, heads=4, vocab=64, seq=8)  # 8 layers: 4 stages x 2 virtual

TWO_RANKS = [dict(degrees={"pp": 2}, microbatches=4, pipeline=kind) for kind in PIPELINES] + [
    dict(degrees={"pp": 2}, microbatches=2, pipeline="1f1b", stage_cuts=["layers.6"], check_forward=True),
    dict(degrees={"dp": 2}, microbatches=2, check_forward=True),  # gradient accumulation, synced once
    dict(degrees={"tp": 2}, constraints=GPT_TP, microbatches=4),
]
FOUR_RANKS = [dict(degrees={"pp": 4}, microbatches=4, pipeline=kind) for kind in PIPELINES] + [
    dict(mesh="2x2", degrees={"pp": 2, "dp": 2}, microbatches=2, pipeline="1f1b", check_forward=True),
    dict(mesh="2x2", degrees={"pp": 2, "tp": 2}, constraints=GPT_TP, microbatches=2, pipeline="interleaved-zb"),
]


def _run_cases(rank, world, cases):
    gpt = load_example("gpt.py")
    return [compare_one_step(gpt.build, GPT, 8, world, dict(options)) for options in cases]


def _check(cases, results_by_rank):
    everything = set(load_example("gpt.py").build(**GPT).state_dict())
    for index, options in enumerate(cases):
        results = [rank_results[index] for rank_results in results_by_rank]
        for result in results:  # each figure is the worst |x - ref| / (1e-6 + 1e-4·|ref|): allclose holds when <= 1
            assert result["loss"] <= 1 and result["grad"][0] <= 1 and result["param"][0] <= 1, (options, result)
            assert result["forward"] is None or result["forward"] <= 1, (options, result)
            schedule = result["schedule"]
            assert schedule.stages == options["degrees"].get("pp", 1) and schedule.microbatches == options["microbatches"]
            assert schedule.kind == options.get("pipeline", schedule.kind), (options, schedule)
        assert set().union(*(r["held"] for r in results)) == everything, options  # every parameter lives somewhere
        if options["degrees"].get("pp", 1) > 1 and "dp" not in options["degrees"] and "tp" not in options["degrees"]:
            assert all(len(r["held"]) < len(everything) for r in results), options  # a stage holds its own only


@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_pipelined_training_step_matches_single_process(world, cases):
    _check(cases, run_local(_run_cases, world, cases, timeout_s=900))
