"""The compiled schedule's overlap: hand-computed replays of a step, gradient buckets, and what
the cost model predicts for compiled plans against eager ones."""

import dataclasses

import pytest
from equivalence import GPT_TP as MEGATRON
from planning import meta_model, plan_example

import autopar
from autopar.ir import get_profile
from autopar.ir.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.passes.cost.replay import SYNC, StepOrder, Transfer, _in_pieces, bucketed, exposed_time

GPT = dict(hidden=64, layers=4, heads=4, vocab=256, seq=32)


def test_a_transfer_hides_behind_the_compute_between_its_issue_and_its_wait():
    compute = [1.0, 2.0, 3.0]
    assert exposed_time(compute, [Transfer(0, 2, 1.5, label="x")]).exposed == 0.0  # 2.0 of compute hides 1.5
    assert exposed_time(compute, [Transfer(0, 2, 2.5, label="x")]).stalls == {"x": pytest.approx(0.5)}
    assert exposed_time(compute, [Transfer(1, 2, 1.0)]).exposed == 1.0  # needed right after: all exposed
    assert exposed_time(compute, [Transfer(-1, 3, 7.0)]).exposed == 1.0  # issued at the start, waited at the end


def test_one_rank_runs_its_collectives_one_at_a_time_in_issue_order():
    # both issued after item 0; the second waits for the first: 1 + 1 = 2 of transfer behind 3 of compute
    transfers = [Transfer(0, 3, 1.0, label="a"), Transfer(0, 3, 1.0, label="b")]
    assert exposed_time([1.0, 1.5, 1.5], transfers).exposed == 0.0
    assert exposed_time([1.0, 0.5, 0.5], transfers).exposed == pytest.approx(1.0)


def test_gradients_fill_a_small_first_bucket_then_large_ones_in_order_of_readiness():
    syncs = [Transfer(ready, 10, 1.0, FIRST_BUCKET_BYTES / 2, SYNC) for ready in (3, 1, 2, 4)]
    buckets = bucketed(syncs)
    assert [(b.ready, b.seconds) for b in buckets] == [(2, 2.0), (4, 2.0)]  # closed at 1 MiB, then the rest
    big = [Transfer(i, 10, 1.0, BUCKET_BYTES, SYNC) for i in range(3)]
    assert len(bucketed(big)) == 3
    per_layer = bucketed(syncs, layers={0: "layers.0", 1: "layers.1", 2: "layers.1", 3: "layers.0"})
    assert sorted((b.ready, b.seconds) for b in per_layer) == [(2, 2.0), (4, 2.0)]


def test_a_move_in_pieces_moves_its_seconds_both_ways_around_the_linears_pieces():
    # items: producer 0, linear 1-2 (two pieces), consumer 3; backward: consumer 4, linear 5-6, producer 7
    order = StepOrder([1.0] * 8, {"p": 0, "lin": 1, "c": 3}, {"c": 4, "lin": 5, "p": 7}, {"lin": 2})
    gather = _in_pieces(order, "p", "lin", 2.0, 4.0, "lin", "x")  # into the linear: a gather, its reduce-scatter
    assert [(t.ready, t.needed, t.seconds) for t in gather] == [(0, 1, 1.0), (0, 2, 1.0), (5, 7, 2.0), (6, 7, 2.0)]
    scatter = _in_pieces(order, "lin", "c", 2.0, 4.0, "lin", "x")  # out of it: a reduce-scatter, its all-gather
    assert [(t.ready, t.needed, t.seconds) for t in scatter] == [(1, 3, 1.0), (2, 3, 1.0), (4, 5, 2.0), (4, 6, 2.0)]


def _plan(compile: bool, **options):
    return plan_example("gpt.py", 4, batch=16, model_kwargs=GPT, hardware="a100-80gb", compile=compile, **options)


def test_compiled_data_parallel_hides_gradient_sync_behind_the_rest_of_backward():
    # wide enough that the gradients fill more than the first bucket: the earlier buckets go out
    # while backward still runs (with one bucket, ready with the last gradient, nothing can hide)
    wide = dict(GPT, hidden=128)
    pins = dict(degrees={"dp": 4, "tp": 1}, zero=0, model_kwargs=wide)
    eager = plan_example("gpt.py", 4, batch=16, hardware="a100-80gb", compile=False, **pins)
    compiled = plan_example("gpt.py", 4, batch=16, hardware="a100-80gb", compile=True, **pins)
    assert compiled.schedule.compiled and not eager.schedule.compiled
    assert compiled.cost.compute_s == pytest.approx(eager.cost.compute_s)
    # the schedule hides what the buckets' windows hold. (Eager hides up to the profile's share, now
    # 1.0 and capped by the last backward (overlap.py): no longer a fixed 0.5 to divide out, so the
    # whole sync is read off the same plan on a profile that hides nothing.)
    bare = dataclasses.replace(get_profile("a100-80gb"), overlap=0.0)
    whole = plan_example("gpt.py", 4, batch=16, hardware=bare, compile=False, **pins).cost.grad_sync_s
    assert 0 < compiled.cost.grad_sync_s < 0.8 * whole
    # where nothing runs beside compute (overlap 0: this CPU, whose cores the compute fills), the
    # schedule's windows hide nothing either
    unhidden = plan_example("gpt.py", 4, batch=16, hardware=bare, compile=True, **pins).cost.grad_sync_s
    assert unhidden == pytest.approx(whole)


def test_compiled_accumulation_hides_its_sync_behind_the_last_microbatch_alone():
    # over 4 microbatches the last one's program sums the step's gradients (what the others
    # accumulated with its own): its backward, a quarter of the step's, is all there is to hide
    # behind; a runtime sync after backward would hide nothing (as where nothing runs beside compute).
    # One layout (the data-parallel plan of one microbatch) priced three ways: the search could
    # choose another layout for each (with microbatches it moves activations rather than gradients)
    model = meta_model("gpt.py", **dict(GPT, hidden=1024))
    captured = autopar.capture(model, model.example_inputs(64, device="meta"))
    a100 = get_profile("a100-80gb")
    single = autopar.plan(captured, 2, degrees={"dp": 2, "tp": 1}, zero=0, compile=True, hardware=a100)
    assert not any(d.comm_bytes > 8 for d in single.nodes.values())  # data parallel: only the loss's scalars move
    accumulated = dataclasses.replace(single, schedule=dataclasses.replace(single.schedule, microbatches=4))
    bare = dataclasses.replace(a100, overlap=0.0)
    single_s, accumulated_s, whole_s = (
        evaluate_plan(captured, plan, hardware).grad_sync_s
        for plan, hardware in ((single, a100), (accumulated, a100), (accumulated, bare))
    )
    assert 0 < single_s < accumulated_s < 0.8 * whole_s


@pytest.mark.parametrize("zero", [2, 3])
def test_compiled_zero_reduces_each_layer_behind_the_backward_of_the_layers_before_it(zero):
    # one reduce-scatter per layer (ZeRO's groups by parameter name; ZeRO-2's too, in a compiled
    # program): the last layer's, first ready, hides behind the backward of the layers below it;
    # one bucket for all would be ready only when backward ends and hide nothing
    pins = dict(degrees={"dp": 4, "tp": 1}, zero=zero)
    compiled = plan_example("gpt.py", 4, batch=16, model_kwargs=GPT, hardware="a100-80gb", compile=True, **pins)
    bare = dataclasses.replace(get_profile("a100-80gb"), overlap=0.0)
    whole = plan_example("gpt.py", 4, batch=16, model_kwargs=GPT, hardware=bare, compile=False, **pins)
    assert 0 < compiled.cost.grad_sync_s < 0.8 * whole.cost.grad_sync_s


def test_compiled_megatron_tensor_parallelism_hides_its_all_reduces_only_with_async_tp():
    eager = _plan(False, degrees={"dp": 1, "tp": 4}, constraints=MEGATRON)
    compiled = _plan(True, degrees={"dp": 1, "tp": 4}, constraints=MEGATRON)
    pieced = _plan(True, degrees={"dp": 1, "tp": 4}, constraints=MEGATRON, async_tp=True)
    assert pieced.schedule.async_tp and not compiled.schedule.async_tp
    # each row-parallel output is all-reduced and read at once by the next norm and residual add:
    # nothing to hide it behind, unless the linear runs in two pieces (the first piece's
    # all-reduce behind the second piece's matmul; the second's stays exposed)
    assert compiled.cost.comm_s == pytest.approx(eager.cost.comm_s, rel=0.05)
    assert 0.5 * compiled.cost.comm_s < pieced.cost.comm_s < compiled.cost.comm_s
    assert pieced.cost.compute_s == pytest.approx(compiled.cost.compute_s)
