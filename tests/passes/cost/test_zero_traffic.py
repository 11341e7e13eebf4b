"""ZeRO-3's data-parallel traffic against hand-counted collectives: autopar's per-layer gathers,
and a stack that moves each parameter alone, keeps small ones whole and gathers again for a
recomputed forward (DeepSpeed's stage 3 of early 2021)."""

import dataclasses
import functools

import pytest
from planning import meta_model, plan_example

from autopar.ir import LinkTier, get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.axis_terms import AxisContext
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.evaluate import evaluate_plan
from autopar.passes.cost.zero_traffic import param_sync, zero3_layer_s

GPT = dict(hidden=64, layers=4, heads=4, vocab=256, seq=32)
_A100 = get_profile("a100-80gb")
# every byte of sync exposed, each collective alpha-beta (latency the same at any size, not NCCL's protocols)
FLAT_A100 = dataclasses.replace(
    _A100, kernels=None, overlap=0.0, links=tuple(dataclasses.replace(tier, protocols=()) for tier in _A100.links)
)
PINS = dict(degrees={"dp": 8, "tp": 1}, zero=3, microbatches=1, precision="fp32")
DEEPSPEED = dict(zero3_per_parameter=True)


DP_LINK = dataclasses.replace(FLAT_A100.link((2, 4), 8, 8), sync_s=0.0)  # the 8 ranks' tier


def _cost(hardware, **pins):
    """The step's cost of the GPT on a 2 x 4 mesh, all of it data-parallel ZeRO-3."""
    return evaluate_plan(*_planned(tuple(sorted(pins.items()))), hardware)


@functools.cache
def _planned(pins: tuple):
    """The graph and its plan (made on the flat A100) for ``pins``; each test prices it on its own hardware."""
    plan = plan_example("gpt.py", (2, 4), batch=16, model_kwargs=GPT, hardware=FLAT_A100, **{**PINS, **dict(pins)})
    model = meta_model("gpt.py", **GPT)
    return capture(model, model.example_inputs(16, device="meta")), plan


def _sync(hardware, **pins) -> float:
    return _cost(hardware, **pins).grad_sync_s


def _parameters() -> dict[str, int]:
    return {name: p.numel() for name, p in meta_model("gpt.py", **GPT).named_parameters()}


def _gather_s(elements: int) -> float:
    """One all-gather of an fp32 parameter over the 8 ranks, latency included."""
    return collective_time("all_gather", 4.0 * elements, 8, DP_LINK)


def _latency(kind: str) -> float:
    return collective_time(kind, 1.0, 8, DP_LINK)


def test_zero3_pays_each_collectives_latency_per_layer_or_per_parameter_as_the_stack_moves():
    """autopar's ZeRO-3 gathers a layer's parameters in one collective for forward, again for
    backward, and reduce-scatters their gradients in one: a parameter's own share is bandwidth
    only, and the layer pays the three latencies once. A stack that moves each parameter alone
    pays every gather's and reduce-scatter's latency per parameter."""
    link = LinkTier("test", 1e-5, 1e9)
    ctx = AxisContext("dp", 4, link, {}, None, 0.0, zero=3, hardware=FLAT_A100)
    alone = dataclasses.replace(ctx, hardware=dataclasses.replace(FLAT_A100, **DEEPSPEED))
    gather, scatter = (collective_time(kind, 1e6, 4, link) for kind in ("all_gather", "reduce_scatter"))
    for context in (ctx, alone):
        assert param_sync(1e6, 1e6, context)[0] + zero3_layer_s(context) == pytest.approx(scatter + 2 * gather)
    one = 3 * 1e-5 + 3 / 4 * 1.0 / 1e9  # (p-1)α and one byte
    assert zero3_layer_s(ctx) == pytest.approx(3 * one) and zero3_layer_s(alone) == 0.0

    instant = tuple(dataclasses.replace(tier, alpha_s=0.0) for tier in FLAT_A100.links)
    no_latency = _sync(dataclasses.replace(FLAT_A100, links=instant))
    groups = GPT["layers"] + 1  # the layers and the parameters outside them
    per_layer = _sync(FLAT_A100) - no_latency
    assert per_layer == pytest.approx(groups * (_latency("reduce_scatter") + 2 * _latency("all_gather")), rel=1e-6)
    per_parameter = _sync(dataclasses.replace(FLAT_A100, **DEEPSPEED)) - no_latency
    # every parameter gathered twice, every gradient reduce-scattered but the position embedding's:
    # its slice runs whole on every rank, so its gradient is cut to the rank's chunk
    collectives = 3 * len(_parameters()) - 1
    assert _latency("reduce_scatter") == _latency("all_gather")
    assert per_parameter == pytest.approx(collectives * _latency("all_gather"), rel=1e-6)


def test_a_stack_that_passes_a_tensor_per_rank_pays_a_copy_per_rank_of_every_collective():
    """torch's list all_gather and reduce_scatter (what DeepSpeed's stage 3 of early 2021 called)
    copy each rank's tensor to or from a flat buffer: every collective adds one launch per rank
    of the group, on top of its latency and bytes. Doubling the group doubles it."""
    copies = dict(zero3_copies_per_rank=True)
    for stack, collectives in (
        ({}, 3 * (GPT["layers"] + 1)),  # per layer: two gathers and a reduce-scatter of each group
        (DEEPSPEED, 3 * len(_parameters()) - 1),  # per parameter, as counted above
    ):
        plain = dataclasses.replace(FLAT_A100, **stack)
        added = _sync(dataclasses.replace(plain, **copies)) - _sync(plain)
        assert added == pytest.approx(collectives * 8 * FLAT_A100.op_overhead_s, rel=1e-6)
    link = LinkTier("test", 1e-5, 1e9)
    hardware = dataclasses.replace(FLAT_A100, **DEEPSPEED)
    extra = []
    for ranks in (4, 8):
        ctx = AxisContext("dp", ranks, link, {}, None, 0.0, zero=3, hardware=hardware)
        listed = dataclasses.replace(ctx, hardware=dataclasses.replace(hardware, **copies))
        extra.append(param_sync(1e6, 1e6, listed)[0] - param_sync(1e6, 1e6, ctx)[0])
    assert extra[0] == pytest.approx(3 * 4 * FLAT_A100.op_overhead_s) and extra[1] == pytest.approx(2 * extra[0])


def test_a_stack_keeps_parameters_under_its_persistence_threshold_whole():
    """Parameters of fewer elements than ``zero3_persist_elements`` (the norms' 64) stay whole on
    every rank: their two gathers per microbatch go, their gradients' reduce-scatters stay."""
    small = [n for n, elements in _parameters().items() if elements < 100]
    assert small and all("norm" in name for name in small)
    alone = dataclasses.replace(FLAT_A100, **DEEPSPEED)
    kept = _sync(alone) - _sync(dataclasses.replace(alone, zero3_persist_elements=100))
    assert kept == pytest.approx(sum(2 * _gather_s(_parameters()[n]) for n in small), rel=1e-6)


@pytest.mark.parametrize(
    "reuse, kept",
    [
        (1_000, ("mlp.fc2.weight",)),  # the last weight: its backward follows its recomputed forward
        (40_000, ("mlp.fc1.weight", "mlp.fc2.weight")),  # 2 x fc2's 16384 elements lie between fc1's uses
        (10**12, None),  # everything kept: no gather again
    ],
)
def test_a_stack_that_releases_gathered_weights_gathers_again_for_the_recomputed_forward(reuse, kept):
    """Under full recomputation a stack that releases each gathered parameter after its use
    (``zero3_reuse_elements``: DeepSpeed's reuse distance) gathers a layer's parameters a third
    time, all but those whose next use lies within the distance: between a parameter's
    recomputed forward and its backward run the forward and backward of the layer's parameters
    after it. autopar's runtime gathers once for both: recomputation adds nothing."""
    for hardware in (FLAT_A100, dataclasses.replace(FLAT_A100, **DEEPSPEED)):
        assert _sync(hardware, recompute="full") == pytest.approx(_sync(hardware, recompute="none"), rel=1e-9)
    stack = dataclasses.replace(FLAT_A100, **DEEPSPEED, zero3_reuse_elements=reuse)
    again = _sync(stack, recompute="full") - _sync(stack, recompute="none")
    in_layers = {n: e for n, e in _parameters().items() if n.startswith("layers.")}
    released = [n for n in in_layers if kept is not None and not n.endswith(kept)]
    assert again == pytest.approx(sum(_gather_s(in_layers[n]) for n in released), rel=1e-6, abs=1e-12)


def test_a_stack_that_reduce_scatters_parameters_alone_holds_one_parameters_gradient_in_flight():
    """autopar's ZeRO-3 (as FSDP2) reduce-scatters a layer's gradients at once: two layers' worth
    in flight (one filling while the one before is reduced); a stack that reduce-scatters each
    parameter alone holds two of its largest parameter's gradients (fp32 here)."""
    layer = sum(e for n, e in _parameters().items() if n.startswith("layers.0."))
    largest = max(_parameters().values())
    assert _cost(FLAT_A100).memory["grad_buckets"] == pytest.approx(2 * 4 * layer)
    assert _cost(dataclasses.replace(FLAT_A100, **DEEPSPEED)).memory["grad_buckets"] == pytest.approx(2 * 4 * largest)
