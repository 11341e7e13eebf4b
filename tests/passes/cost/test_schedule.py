"""The whole-step terms of the cost model against hand-computed values: memory liveness,
the optimizer step, in-step rendezvous, recomputation, microbatches and pipeline stages."""

import dataclasses

import pytest
from equivalence import GPT_SP
from planning import meta_model, plan_example

from autopar.ir import ConfigError, Cost, LinkTier, MemoryLimitError, PlanOptions, Precision, Schedule, get_profile
from autopar.ir.buckets import BUCKET_BYTES
from autopar.passes.capture.graph import capture
from autopar.passes.cost.collectives import collective_time, grad_sync_time
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.passes.cost.facts import analyze
from autopar.passes.cost.ops import OPTIMIZER_BYTES_PER_PARAM, RECAST_BYTES_PER_PARAM, optimizer_time, zero_copy_bytes
from autopar.passes.cost.schedule import kept_share
from autopar.passes.search import ilp
from autopar.passes.search.ilp import PRESOLVE_UP_TO
from autopar.passes.search.ranking import within_reach
from autopar.passes.search.schedule import levels

GPT = dict(hidden=64, layers=4, heads=4, vocab=256, seq=32)


def test_gradients_replace_activations_in_the_peak():
    cost = Cost(
        0, 0, 0, {"params": 10, "grads": 10, "optimizer": 20, "grad_buckets": 10, "activations": 30, "temporary": 4}
    )
    assert cost.peak_memory == 10 + 20 + 10 + max(30 + 4, 10)
    assert dataclasses.replace(cost, memory={**cost.memory, "grads": 50}).peak_memory == 10 + 20 + 10 + 50


def test_optimizer_step_is_memory_bound_and_slowed_by_contention():
    hardware = get_profile("a100-80gb")  # streams at 0.8 of HBM, as elementwise kernels do
    streaming = 0.8 * hardware.memory_bandwidth
    assert optimizer_time(1e9, hardware) == pytest.approx(1e9 * OPTIMIZER_BYTES_PER_PARAM / streaming)
    assert optimizer_time(1e9, hardware, contention=2.0) == pytest.approx(2 * optimizer_time(1e9, hardware))
    # mixed precision recasts what a rank holds: 16-bit copies of the masters, fp32 gradients
    assert optimizer_time(1e9, hardware, recast=2e9) - optimizer_time(1e9, hardware) == pytest.approx(
        2e9 * RECAST_BYTES_PER_PARAM / streaming
    )
    cpu = get_profile("cpu-local")  # a measured copy rate: all of it
    assert optimizer_time(1e9, cpu) == pytest.approx(1e9 * OPTIMIZER_BYTES_PER_PARAM / cpu.memory_bandwidth)


def test_plans_price_mixed_precision_casts_of_what_each_rank_holds():
    """bf16-mixed recasts every parameter a rank holds each step, besides the AdamW step over the
    ones it updates: ZeRO-1 updates half of them over dp 2 but holds (and recasts) them all, ZeRO-3
    holds half."""

    def ratio(zero: int, dp: int) -> float:
        def optimizer_s(precision):
            plan = plan_example(
                "mlp.py", dp, batch=64, hardware="a100-80gb", precision=precision, zero=zero, degrees={"dp": dp}
            )
            return plan.cost.optimizer_s

        return optimizer_s("bf16-mixed") / optimizer_s("fp32")

    steps, casts = OPTIMIZER_BYTES_PER_PARAM, RECAST_BYTES_PER_PARAM
    assert ratio(0, 1) == pytest.approx((steps + casts) / steps)
    copies = zero_copy_bytes(1, 2, 4, get_profile("a100-80gb"))  # the same fp32 masters gathered either way
    assert ratio(1, 2) == pytest.approx((steps / 2 + casts + copies) / (steps / 2 + copies))
    assert ratio(3, 2) == pytest.approx((steps + casts) / steps)


def test_blocking_collectives_pay_the_rendezvous_scaled_by_contention():
    link = LinkTier("test", 1e-5, 1e9, sync_s=1e-3)
    assert collective_time("all_gather", 4e6, 4, link) == pytest.approx(3 * 1e-5 + 3 / 4 * 4e6 / 1e9 + 1e-3)
    cpu = dataclasses.replace(get_profile("cpu-local"), links=(link,), cores_per_host=2)
    assert cpu.contention((4,)) == 2 and cpu.contention((2,)) == 1
    assert cpu.link((4,), 4).sync_s == pytest.approx(2e-3)
    assert get_profile("a100-80gb").contention((8, 8)) == 1  # GPUs do not share their compute


# The A100 at one efficiency for every op: compute linear in each rank's work, so the schedule's
# arithmetic shows exactly (with kernel figures, a microbatch's smaller GEMMs run at their own
# efficiency: test_microbatches_run_smaller_gemms_at_their_own_efficiency).
FLAT_A100 = dataclasses.replace(get_profile("a100-80gb"), kernels=None)


def _plan(**options):
    options = {"model_kwargs": GPT, "hardware": FLAT_A100, **options}
    return plan_example("gpt.py", (2, 4), batch=16, **options)


def test_recomputation_trades_activations_for_forward_compute():
    # 8 layers: full recomputation holds one whole layer's activations while it recomputes
    # it, which only pays once there are more layers than a handful
    deep = dict(model_kwargs={**GPT, "layers": 8})
    none = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="none", **deep)
    selective = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="selective", **deep)
    every_second = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="selective-op", **deep)
    full = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="full", **deep)
    activations = [plan.cost.memory["activations"] for plan in (full, every_second, selective, none)]
    assert activations == sorted(activations) and len(set(activations)) == 4
    assert none.cost.compute_s < selective.cost.compute_s < every_second.cost.compute_s < full.cost.compute_s
    assert full.cost.compute_s < 1.5 * none.cost.compute_s  # one more forward: about a third more
    assert full.schedule == Schedule(1, 1, "full") and full.cost.model_flops == none.cost.model_flops


def test_a_layer_recomputing_in_backward_holds_its_activations_beside_its_own_transients_only():
    """The loss's transients (the logits and their gradient) are gone before the layers' backward
    recomputes them: the priced peak holds the larger of the two, not both."""
    pins = dict(degrees={"dp": 8, "tp": 1}, zero=0)
    for vocab, loss_larger in ((64, False), (8192, True)):
        none, full = (_plan(**pins, recompute=r, model_kwargs={**GPT, "vocab": vocab}) for r in ("none", "full"))
        assert (full.cost.memory["temporary"] == none.cost.memory["temporary"]) == loss_larger
        assert full.cost.memory["temporary"] >= none.cost.memory["temporary"]


def test_selective_recomputation_holds_what_its_recompute_reads_and_no_partial_sum():
    """Under Megatron's sequence parallelism on tp 4, selective recomputation holds per layer what
    the runtime keeps for the recompute (recompute._KeptOutputs): the two all-gathered norm
    outputs, q, k, v and attention's output with its log-sum-exp, fc1's output and the two
    reduce-scattered outputs the residual adds read; not the row-parallel linears' partial sums,
    which only their reductions read."""
    pins = dict(degrees={"dp": 2, "tp": 4}, constraints=GPT_SP, zero=0)
    selective, full = (_plan(**pins, recompute=level) for level in ("selective", "full"))
    assert selective.precision == Precision.BF16_MIXED
    batch, seq, hidden = 16 // 2, GPT["seq"], GPT["hidden"]  # a dp rank's
    gathered, column, scattered = batch * seq * hidden, batch * seq * hidden // 4, batch * seq // 4 * hidden
    per_layer = (2 * gathered + 4 * column + 4 * column + 2 * scattered) * 2  # bf16: q, k, v, attention; fc1 (4h/4)
    statistics = batch * GPT["heads"] // 4 * seq * 4  # fp32, per head and position
    held = selective.cost.memory["activations"] - full.cost.memory["activations"]  # both hold the layers' inputs
    assert held == GPT["layers"] * (per_layer + statistics)


def test_microbatches_divide_activations_and_pipeline_stages_pay_the_bubble():
    whole = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="none")
    micro = _plan(degrees={"dp": 8, "tp": 1}, zero=0, recompute="none", microbatches=2)
    assert micro.cost.memory["activations"] == pytest.approx(whole.cost.memory["activations"] / 2)
    assert micro.cost.compute_s == pytest.approx(whole.cost.compute_s) and micro.cost.pipeline_s == 0

    piped = _plan(degrees={"pp": 2, "dp": 4, "tp": 1}, zero=0, recompute="none", microbatches=4)
    flat = plan_example(  # one stage's devices, the whole model
        "gpt.py",
        4,
        batch=16,
        model_kwargs=GPT,
        hardware=FLAT_A100,
        degrees={"dp": 4, "tp": 1},
        zero=0,
        recompute="none",
    )
    assert piped.schedule == Schedule(2, 4, "none", cuts=("layers.2",)) and piped.degrees == {"dp": 4, "tp": 1}
    stage_work = piped.cost.compute_s + piped.cost.comm_s
    boundary_transfers = piped.cost.pipeline_s - stage_work * (2 - 1) / 4
    assert boundary_transfers > 0  # 2·(m + p − 2) boundary messages
    # the busiest stage sets the pace: half the layers, plus the embeddings or the head and loss
    assert flat.cost.compute_s / 2 < piped.cost.compute_s < 0.6 * flat.cost.compute_s
    assert flat.cost.memory["params"] / 2 < piped.cost.memory["params"] < 0.6 * flat.cost.memory["params"]
    assert piped.cost.model_flops / piped.cost.compute_s == pytest.approx(
        flat.cost.model_flops / flat.cost.compute_s, rel=1e-6
    )


def test_a_pipeline_holds_the_head_and_loss_of_one_microbatch_and_the_embeddings_of_those_in_flight():
    model = meta_model("gpt.py", **GPT)
    facts = analyze(capture(model, model.example_inputs(8, device="meta")), FLAT_A100)
    after = {f.node.name for f in facts.values() if f.after_layers}
    assert any("cross_entropy" in name for name in after) and not any("embedding" in name for name in after), after
    embedding = next(f for f in facts.values() if f.kind == "op" and "embedding" in f.node.name)
    loss = next(f for f in facts.values() if f.kind == "op" and "cross_entropy" in f.node.name)
    one_f_one_b, gpipe = Schedule(4, 8, "none", "1f1b"), Schedule(4, 8, "none", "gpipe")
    assert (kept_share(embedding, one_f_one_b), kept_share(loss, one_f_one_b)) == (4 / 8, 1 / 8)
    assert kept_share(embedding, gpipe) == kept_share(loss, gpipe) == 1.0
    # 2 stages, 2 microbatches: both in flight on the first stage under either schedule, but under 1F1B
    # the head and loss of one only
    one_f_one_b, gpipe = (
        _plan(degrees={"pp": 2, "dp": 4, "tp": 1}, zero=0, recompute="none", microbatches=2, pipeline=kind)
        for kind in ("1f1b", "gpipe")
    )
    assert one_f_one_b.cost.memory["activations"] < gpipe.cost.memory["activations"]


def test_microbatches_run_smaller_gemms_at_their_own_efficiency():
    def compute(hidden: int, seq: int, microbatches: int) -> float:
        model = {**GPT, "hidden": hidden, "heads": hidden // 64, "seq": seq, "layers": 2}
        return plan_example(
            "gpt.py", 8, batch=64, model_kwargs=model, hardware="a100-80gb", degrees={"dp": 8, "tp": 1},
            zero=0, recompute="none", microbatches=microbatches,
        ).cost.compute_s  # fmt: skip

    # hidden 64, 2048 rows per rank: GEMMs are launch- and wave-bound, 8 pieces cost far more than one
    assert compute(64, 256, 8) > 3 * compute(64, 256, 1)
    # hidden 8192, one 2048-token sequence per piece: each still fills the 108 SMs in several waves
    assert compute(8192, 2048, 1) < compute(8192, 2048, 8) < 1.1 * compute(8192, 2048, 1)


def test_a_pipeline_must_split_the_outer_mesh_dimension_and_does_not_run_yet():
    with pytest.raises(ConfigError, match="pipeline stages must divide the outermost dimension"):
        _plan(degrees={"pp": 4, "dp": 2, "tp": 1})
    with pytest.raises(ConfigError, match="recompute='sometimes'"):
        _plan(recompute="sometimes")


def test_a_tight_memory_limit_turns_recomputation_on():
    pins = dict(degrees={"dp": 8, "tp": 1}, zero=3)
    free = _plan(**pins)
    assert free.schedule.recompute == "none"
    limit = free.cost.peak_memory
    while True:  # down to where no layout fits without recomputation
        limit *= 0.9
        try:
            _plan(**pins, recompute="none", memory_limit=limit)
        except MemoryLimitError:
            break
    tight = _plan(**pins, memory_limit=limit)
    assert tight.schedule.recompute != "none" and tight.cost.peak_memory <= limit


def test_zero1_gathers_the_stepped_parameters_after_the_optimizer_or_behind_the_next_forward():
    """autopar's ZeRO-1 (as DeepSpeed's bf16 pipeline) all-reduces the gradients and, once the
    optimizer has stepped this rank's chunks, all-gathers the parameters in buckets: ZeRO-0's sync
    plus that gather, which no overlap hides. A stack that reduce-scatters instead (Megatron's
    distributed optimizer) gathers the stepped compute copies (bf16 under bf16-mixed), behind the
    next step's first forward where it overlaps them (``param_gather_overlap``)."""
    mlp = dict(hidden=64, ffn=256, layers=2)
    model = meta_model("mlp.py", **mlp)
    graph = capture(model, model.example_inputs(16, device="meta"))
    pins = dict(degrees={"dp": 8}, zero=0, microbatches=1, precision="fp32", hardware=FLAT_A100)
    plan = plan_example("mlp.py", (2, 4), batch=16, model_kwargs=mlp, **pins)

    def sync(zero: int, precision: str = "fp32", **profile) -> float:
        pinned = dataclasses.replace(plan, zero=zero, precision=Precision(precision))
        return evaluate_plan(graph, pinned, dataclasses.replace(FLAT_A100, **profile))

    hidden, bare = (sync(1, overlap=o).grad_sync_s - sync(0, overlap=o).grad_sync_s for o in (1.0, 0.0))
    link = dataclasses.replace(FLAT_A100.link((2, 4), 8, 8), sync_s=0.0)
    expected = sum(grad_sync_time(4.0 * p.numel(), 8, link, BUCKET_BYTES, "all_gather") for p in model.parameters())
    assert hidden == pytest.approx(bare) and bare == pytest.approx(expected, rel=1e-6)
    # bf16-mixed steps fp32 masters: the gather still moves 4 bytes per element
    mixed = sync(1, "bf16-mixed").grad_sync_s - sync(0, "bf16-mixed").grad_sync_s
    assert mixed == pytest.approx(expected, rel=1e-6)

    def moved(per_element: float, kind: str, over=link) -> float:  # one collective of every parameter
        return sum(grad_sync_time(per_element * p.numel(), 8, over, BUCKET_BYTES, kind) for p in model.parameters())

    for precision, weight_bytes in (("fp32", 4.0), ("bf16-mixed", 2.0)):  # fp32 gradients either way
        scattered = sync(1, precision, zero1_reduce_scatter=True, overlap=0.0).grad_sync_s
        difference = moved(4.0, "reduce_scatter") + moved(weight_bytes, "all_gather") - moved(4.0, "all_reduce")
        assert scattered - sync(0, precision, overlap=0.0).grad_sync_s == pytest.approx(difference, rel=1e-6)
    # overlapped with the next forward, the gather hides as far as that forward lasts: all of it
    # on this link, part of it on one 10^6 times slower
    for slower in (1.0, 1e6):
        links = tuple(dataclasses.replace(tier, bandwidth=tier.bandwidth / slower) for tier in FLAT_A100.links)
        profile = dict(zero1_reduce_scatter=True, overlap_slowdown=0.0, links=links)
        slow = dataclasses.replace(dataclasses.replace(FLAT_A100, links=links).link((2, 4), 8, 8), sync_s=0.0)
        gather = moved(2.0, "all_gather", slow)
        after = sync(1, "bf16-mixed", **profile).grad_sync_s
        hidden = after - sync(1, "bf16-mixed", param_gather_overlap=True, **profile).grad_sync_s
        assert hidden == pytest.approx(gather, rel=1e-6) if slower == 1.0 else 0 < hidden < 0.5 * gather


def test_communication_hidden_on_a_gpu_still_slows_the_compute_beside_it():
    """A gradient sync the backward hides entirely costs nothing with no slowdown; where compute
    beside a collective runs ``1 + s`` slower (the GPU presets' ``overlap_slowdown``), the step pays
    ``s / (1 + s)`` of the collective's time."""
    plan = _plan(degrees={"dp": 8}, zero=0, microbatches=1, precision="fp32")
    model = meta_model("gpt.py", **GPT)
    graph = capture(model, model.example_inputs(16, device="meta"))

    def sync(**profile) -> float:
        return evaluate_plan(graph, plan, dataclasses.replace(FLAT_A100, **profile)).grad_sync_s

    whole, hidden = sync(overlap=0.0), sync(overlap=1.0, overlap_slowdown=0.0)
    assert whole > 0 and hidden == pytest.approx(0.0, abs=1e-12)  # the backward outlasts the sync
    assert sync(overlap=1.0, overlap_slowdown=0.25) == pytest.approx(whole * 0.25 / 1.25, rel=1e-6)
    assert get_profile("h100-80gb").overlap_slowdown > 0 and get_profile("cpu-local").overlap_slowdown == 0


def test_zero1_and_2_pay_the_copies_around_the_gather_of_the_stepped_weights():
    """autopar's ZeRO-1/2 step copies: the gradient's chunk made contiguous (ZeRO-1), the stepped
    chunks packed for the all-gather, the gathered weights unpacked into the whole parameters
    (ZeroOptimizer.step); a stack whose parameters are views of the buffer it gathers into
    (Megatron-Core, DeepSpeed) copies nothing. Streamed at the preset's elementwise bandwidth."""
    mlp = dict(hidden=64, ffn=256, layers=2)
    model = meta_model("mlp.py", **mlp)
    graph = capture(model, model.example_inputs(16, device="meta"))
    pins = dict(degrees={"dp": 8}, zero=0, microbatches=1, precision="fp32", hardware=FLAT_A100)
    plan = plan_example("mlp.py", (2, 4), batch=16, model_kwargs=mlp, **pins)
    elements = sum(p.numel() for p in model.parameters())

    def update_s(zero: int, **profile) -> float:
        hardware = dataclasses.replace(FLAT_A100, **profile)
        return evaluate_plan(graph, dataclasses.replace(plan, zero=zero), hardware).optimizer_s

    in_place = dict(zero_gathers_in_place=True)
    for zero, per_element in ((1, 2 * 4 * (1 + 1 / 8) + 2 * 4 / 8), (2, 2 * 4 * (1 + 1 / 8))):
        copies = update_s(zero) - update_s(zero, **in_place)
        assert copies == pytest.approx(elements * per_element / FLAT_A100.streaming_bandwidth, rel=1e-6)
    assert update_s(0) == pytest.approx(update_s(0, **in_place)) and update_s(3) == pytest.approx(
        update_s(3, **in_place)
    )


def test_regathering_keeps_each_gathered_input_at_its_shard_and_gathers_it_again_in_backward():
    # Megatron's sequence parallelism on tp 4: each layer's two norm outputs are gathered for linears,
    # and the last norm's for the head (the search splits it along the sequence too); on hardware
    # where communication does not run beside compute, so the second gathers are all exposed
    pins = dict(degrees={"dp": 2, "tp": 4}, constraints=GPT_SP, zero=0, recompute="none")
    serial = dataclasses.replace(FLAT_A100, overlap=0.0)
    saved, regathered = (_plan(**pins, regather=flag, hardware=serial) for flag in (False, True))
    assert regathered.schedule.regather and not saved.schedule.regather
    elem = 2 if regathered.precision == Precision.BF16_MIXED else 4
    gathered = 16 // 2 * GPT["seq"] * GPT["hidden"] * elem  # a dp rank's batch, the whole sequence
    values = 2 * GPT["layers"] + 1
    less = saved.cost.memory["activations"] - regathered.cost.memory["activations"]
    assert less == pytest.approx(values * (gathered - gathered / 4))  # the gathered copy out, the shard in
    link = FLAT_A100.link((2, 4), 4, 4)
    again = regathered.cost.comm_s - saved.cost.comm_s
    assert again == pytest.approx(values * collective_time("all_gather", gathered, 4, link))
    assert regathered.cost.compute_s == saved.cost.compute_s
    # beside compute, each gather hides behind its linears' input-gradient matmuls, which it precedes
    beside = [_plan(**pins, regather=flag).cost.comm_s for flag in (False, True)]
    assert 0 < beside[1] - beside[0] < again


# without presolve HiGHS picks another of the equal optima: the one the budget's row must see over it
@pytest.mark.parametrize("presolve_up_to", [0, PRESOLVE_UP_TO])
def test_the_search_weighs_regathering_against_selective_recomputation_under_a_memory_limit(
    monkeypatch, presolve_up_to
):
    """Under a limit the layout that saves nothing no longer fits as it is: the search weighs each
    level of saving (on the layout solved under the limit, too) and takes the fastest that fits."""
    monkeypatch.setattr(ilp, "PRESOLVE_UP_TO", presolve_up_to)
    pins = dict(degrees={"dp": 2, "tp": 4}, constraints=GPT_SP, zero=0, microbatches=1)
    levels_ = (("none", False), ("none", True), ("selective", False), ("selective", True), ("selective-op", False))
    free = {level: _plan(**pins, recompute=level[0], regather=level[1]) for level in levels_}
    everything = free[("none", False)].cost.peak_memory
    limit = max(p.cost.peak_memory for p in free.values() if p.cost.peak_memory < everything)
    assert sum(p.cost.peak_memory <= limit for p in free.values()) >= 2  # at least two ways to fit
    under = {level: _plan(**pins, recompute=level[0], regather=level[1], memory_limit=limit) for level in levels_}
    chosen = _plan(**pins, memory_limit=limit)
    fastest = min(plan.cost.step_s for plan in under.values())
    assert chosen.cost.peak_memory <= limit and within_reach(chosen.cost.step_s, fastest)
    level = (chosen.schedule.recompute, chosen.schedule.regather)
    assert level in under and chosen.cost.step_s == pytest.approx(under[level].cost.step_s)
    with pytest.raises(ConfigError, match="no gathered input to regather"):
        _plan(**pins, recompute="full", regather=True)


def test_the_memory_ladder_regathers_beside_selective_recomputation_and_never_with_async_tp():
    ladder = levels(PlanOptions())
    assert ladder == [
        [("none", False)],
        [("none", True), ("selective", False)],
        [("selective", True), ("selective-op", False)],
        [("full", False)],
    ]
    assert all(not regather for rung in levels(PlanOptions(compile=True, async_tp=True)) for _, regather in rung)
    assert levels(PlanOptions(recompute="selective")) == [[("selective", False)], [("selective", True)]]
    assert levels(PlanOptions(recompute="selective-op")) == [[("selective-op", False)]]
    with pytest.raises(ConfigError, match="recompute='selective-op' recomputes every second matmul"):
        PlanOptions(recompute="selective-op", regather=True)
