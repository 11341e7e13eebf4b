"""Cost-model formulas against values computed by hand."""

import dataclasses

import pytest
import torch

import autopar
from autopar.ir import LinkTier, Partial, Replicate, Shard, get_profile, model_state_bytes
from autopar.ir.buckets import BUCKET_BYTES
from autopar.ir.precision import ZERO_PAPER_LAYOUT
from autopar.passes.capture.graph import capture
from autopar.passes.cost import ops
from autopar.passes.cost.axis_terms import AxisContext
from autopar.passes.cost.collectives import collective_time, grad_sync_time, reshard_time
from autopar.passes.cost.facts import analyze
from autopar.passes.cost.ops import (
    MEASURE_LIMIT_BYTES,
    OpProfile,
    compute_time,
    measured_time,
    op_profile,
    optimizer_time,
)
from autopar.passes.cost.zero_traffic import param_sync
from autopar.passes.sharding.strategies import Strategy, work_fraction

LINK = LinkTier("test", alpha_s=1e-5, bandwidth=1e9)
MB = 1e6


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("all_reduce", 2 * 3 * 1e-5 + 2 * 3 / 4 * 8 * MB / 1e9),  # 2(p-1)α + 2(p-1)/p·n/B
        ("all_gather", 3 * 1e-5 + 3 / 4 * 8 * MB / 1e9),  # (p-1)α + (p-1)/p·n/B
        ("reduce_scatter", 3 * 1e-5 + 3 / 4 * 8 * MB / 1e9),
        ("all_to_all", 3 * 1e-5 + 3 / 4 * 2 * MB / 1e9),  # each rank moves (p-1)/p of its n/p
        ("send_recv", 1e-5 + 8 * MB / 1e9),
    ],
)
def test_alpha_beta_collectives_over_four_ranks(kind, expected):
    assert collective_time(kind, 8 * MB, 4, LINK) == pytest.approx(expected)
    assert collective_time(kind, 8 * MB, 1, LINK) == 0


def test_fitted_collectives_override_the_tier():
    link = LinkTier("test", 1e-5, 1e9, fitted={"all_gather": {4: (1e-4, 5e8)}})
    assert collective_time("all_gather", 8 * MB, 4, link) == pytest.approx(3 * 1e-4 + 3 / 4 * 8 * MB / 5e8)


def test_bucketed_gradient_sync_pays_latency_per_bucket():
    small = grad_sync_time(1 * MB, 4, LINK, bucket_bytes=25 * MB)
    assert small == pytest.approx(2 * 3 * 1e-5 / 25 + 2 * 3 / 4 * MB / 1e9)
    assert grad_sync_time(50 * MB, 4, LINK, bucket_bytes=25 * MB) == pytest.approx(
        collective_time("all_reduce", 50 * MB, 4, LINK)
    )


def test_gradients_sync_in_the_buckets_of_the_stack_the_profile_names():
    # autopar's runtime fills 25 MiB buckets; a published stack's (Megatron-Core: 40M parameters and
    # up) pays a collective's latency once per bucket of its own size
    profile = get_profile("a100-80gb")
    ctx = AxisContext("dp", 4, LINK, {}, None, 0.0, hardware=profile)
    assert param_sync(1 * MB, 1 * MB, ctx)[0] == pytest.approx(grad_sync_time(1 * MB, 4, LINK, BUCKET_BYTES))
    stack = dataclasses.replace(ctx, hardware=dataclasses.replace(profile, grad_bucket_bytes=160 * MB))
    assert param_sync(1 * MB, 1 * MB, stack)[0] == pytest.approx(grad_sync_time(1 * MB, 4, LINK, bucket_bytes=160 * MB))
    assert param_sync(1 * MB, 1 * MB, stack)[0] < param_sync(1 * MB, 1 * MB, ctx)[0]


def test_redistributions_cost_their_collective_and_its_dual():
    n, p = 8 * MB, 4
    gather = collective_time("all_gather", n, p, LINK)
    assert reshard_time(Shard(0), Replicate(), n, p, LINK, needs_grad=True) == pytest.approx(gather)
    assert reshard_time(Replicate(), Shard(0), n, p, LINK, needs_grad=True) == pytest.approx(gather)
    assert reshard_time(Replicate(), Shard(0), n, p, LINK, needs_grad=False) == 0
    assert reshard_time(Partial(), Replicate(), n, p, LINK, True) == pytest.approx(
        collective_time("all_reduce", n, p, LINK)
    )
    assert reshard_time(Partial(), Shard(1), n, p, LINK, True) == pytest.approx(
        collective_time("reduce_scatter", n, p, LINK) + gather
    )
    assert reshard_time(Replicate(), Partial(), n, p, LINK, True) == 0
    assert reshard_time(Replicate(), Partial("avg"), n, p, LINK, True) == float("inf")
    assert reshard_time(Shard(0), Partial(), n, p, LINK, True) == float("inf")


def test_roofline_takes_the_slower_of_flops_and_bytes():
    profile = get_profile("a100-80gb")
    matmul = compute_time(OpProfile(2e12, 4e12, 1e6), profile, needs_grad=True)
    assert matmul == pytest.approx(6e12 / profile.flops_per_s() + 2 * profile.op_overhead_s)
    assert compute_time(OpProfile(2e12, 4e12, 1e6), profile, needs_grad=False) == pytest.approx(
        2e12 / profile.flops_per_s() + profile.op_overhead_s
    )
    copy = compute_time(OpProfile(0, 0, 1e9), profile, needs_grad=True)  # memory bound, backward alike
    assert copy == pytest.approx(2 * 1e9 / profile.streaming_bandwidth + 2 * profile.op_overhead_s)


def _only_op(module, *inputs):
    captured = capture(module, inputs)
    (node,) = [n for n in captured.graph.nodes if n.op == "call_function"]
    return node


def test_ops_are_profiled_forward_and_backward_with_what_autograd_saves():
    linear = op_profile(_only_op(torch.nn.Linear(64, 32), torch.randn(16, 64)), needs_grad=True)
    assert linear.forward_flops == 2 * 16 * 64 * 32
    assert linear.backward_flops == 2 * linear.forward_flops  # grad input and grad weight
    assert linear.saved_inputs == (0, 1) and not linear.saves_output  # x and W
    assert op_profile(_only_op(torch.nn.Linear(64, 32), torch.randn(16, 64)), needs_grad=False).backward_flops == 0


class Loss(torch.nn.Module):
    def forward(self, logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels)


def test_memory_bound_ops_move_what_their_kernels_read_and_write():
    """A one-kernel op moves its inputs and outputs; cross-entropy runs a log-softmax and a
    negative log-likelihood, so its log-probabilities are written and read again, and its
    backward writes the dense gradient of the loss before log-softmax's backward reads it."""
    gelu = op_profile(_only_op(torch.nn.GELU(), torch.randn(64, 512)), needs_grad=True)
    whole = 64 * 512 * 4
    assert gelu.io_bytes == 2 * whole and gelu.backward_io_bytes == 3 * whole  # gelu_backward(grad, x) -> grad x
    logits = torch.randn(64, 512, requires_grad=True)
    loss = op_profile(_only_op(Loss(), logits, torch.randint(0, 512, (64,))), needs_grad=True)
    assert 3 * whole <= loss.io_bytes < 3.1 * whole  # logits read, log-probabilities written and read
    # nll's dense gradient filled and scattered into, then read with the log-probabilities by log-softmax's
    # backward, which writes the logits' gradient: 4 to 5 logits' worth (an H200 moved about 8 logits' worth
    # forward and backward for a 131072-class loss: benchmarks/gpu.py)
    assert 4 * whole <= loss.backward_io_bytes < 5.1 * whole


def test_ops_are_timed_on_this_machine_when_it_is_the_target():
    node = _only_op(torch.nn.Linear(256, 256), torch.randn(64, 256))
    profile = op_profile(node, needs_grad=True)
    seconds = measured_time(node, True, profile)
    assert 0 < seconds < 1.0 and measured_time(node, True, profile) == seconds  # cached per signature
    too_big = OpProfile(profile.forward_flops, profile.backward_flops, MEASURE_LIMIT_BYTES + 1)
    assert measured_time(node, True, too_big) is None  # left to the roofline


def test_timing_ops_leaves_the_random_stream_as_it_was():
    """Planning runs on one rank: a random stream it advanced there would give that rank other
    dropout masks than its peers draw for what they compute alike."""
    captured = capture(torch.nn.Dropout(0.5), (torch.randn(37, 251),))  # a shape no other test times: not cached
    node = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.native_dropout.default)
    state = torch.get_rng_state()
    assert measured_time(node, True, op_profile(node, needs_grad=True)) is not None  # dropout drew, inputs too
    assert torch.equal(torch.get_rng_state(), state)


class TokenLoop(torch.nn.Module):
    """A recurrence over the tokens, as RWKV's and Mamba's run without their kernels: export unrolls it."""

    def forward(self, x):
        state, outputs = x[:, 0] * 0, []
        for t in range(x.shape[1]):
            state = state * 0.5 + x[:, t]
            outputs.append(state)
        stacked = torch.stack(outputs, 1)
        return stacked[:, 2:5] * stacked[:, 6:9], stacked[:, 1:3]


def test_indexing_at_another_position_is_the_same_op_to_time():
    captured = capture(TokenLoop(), (torch.randn(4, 9, 16),))
    nodes = [n for n in captured.graph.nodes if n.target is torch.ops.aten.select.int]
    signatures = {ops._signature(n, True)[0] for n in nodes}
    assert len(nodes) == 10 and len(signatures) == 1  # one to time, not one per token
    slices = [n for n in captured.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    early, late, shorter = (ops._signature(n, True)[0] for n in slices)
    assert [n.args[2:] for n in slices] == [(2, 5), (6, 9), (1, 3)]
    assert early == late and shorter != early  # where a slice starts does not count, what it keeps does


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_flops_come_from_the_formula_where_the_counter_has_none():
    q = torch.randn(2, 4, 16, 8)
    profile = op_profile(_only_op(Attention(), q, q, q), needs_grad=True)
    assert profile.forward_flops == 4 * 2 * 4 * 16 * 16 * 8
    assert profile.saves_output and profile.saved_extra_bytes > 0  # output and softmax statistics


def test_zero_paper_worked_example_within_two_percent():
    # Rajbhandari et al.: 7.5B parameters, 64 data-parallel ranks, mixed-precision Adam.
    published = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    for stage, expected in published.items():
        total = sum(model_state_bytes(7.5e9, data_parallel=64, zero_stage=stage, layout=ZERO_PAPER_LAYOUT).values())
        assert total == pytest.approx(expected, rel=0.02)


def test_fp32_adam_states_by_category():
    assert model_state_bytes(1000) == {"params": 4000, "grads": 4000, "optimizer": 8000}


def test_mixed_precision_state_is_what_the_runtime_holds():
    # fp32 master + 16-bit copy, fp32 gradient, two moments; ZeRO-1/2 also keep the fp32 chunk they step
    assert model_state_bytes(1000, precision="bf16-mixed") == {"params": 6000, "grads": 4000, "optimizer": 8000}
    by_stage = [model_state_bytes(1000, precision="fp16-mixed", zero_stage=s, data_parallel=4) for s in (1, 2, 3)]
    assert by_stage == [
        {"params": 6000, "grads": 4000, "optimizer": 3000},
        {"params": 6000, "grads": 1000, "optimizer": 3000},
        {"params": 1500, "grads": 1000, "optimizer": 2000},
    ]
    assert model_state_bytes(1000, precision="bf16-mixed", zero_stage=3, data_parallel=1)["params"] == 6000


def test_groups_across_nodes_reduce_hierarchically_gather_in_one_ring_and_all_to_all_pays_for_crossing():
    inner, outer = LinkTier("nvlink", 1e-6, 200e9), LinkTier("ib", 1e-5, 25e9)
    a100 = dataclasses.replace(get_profile("a100-80gb"), links=(inner, outer))
    link = a100.link((4, 8), 32, 16)  # 16 ranks every other device of 4 nodes: 4 per node
    assert link.inner == inner and link.local_ranks == 4
    n = 64 * MB
    assert collective_time("all_reduce", n, 16, link) == pytest.approx(
        collective_time("reduce_scatter", n, 4, inner)
        + collective_time("all_reduce", n / 4, 4, outer)
        + collective_time("all_gather", n, 4, inner)
    )
    more_inside = (12 - 3) * 1e-6  # one ring over all 16 takes 15 steps: 3 across nodes, 12 inside (not 3)
    assert collective_time("all_gather", n, 16, link) == pytest.approx(
        collective_time("all_gather", n / 4, 4, outer) + collective_time("all_gather", n, 4, inner) + more_inside
    )
    assert collective_time("reduce_scatter", n, 16, link) == collective_time("all_gather", n, 16, link)
    flat = dataclasses.replace(link, inner=None, local_ranks=1)
    assert collective_time("all_reduce", n, 16, link) < collective_time("all_reduce", n, 16, flat)
    crossing = n / 16 * 3 / 4 / 25e9  # 3/4 of each rank's data leaves its node, through the rank's own adapter
    assert collective_time("all_to_all", n, 16, link) == pytest.approx(
        15 * 1e-5 + crossing + collective_time("all_to_all", n / 4, 4, inner)
    )
    assert a100.link((4, 8), 32, 4).local_ranks == 1  # one member per node: a plain ring over the nodes
    assert a100.link((4, 8), 8, 8).inner is None  # inside one node


class _Normed(torch.nn.Module):
    """Linear, then RMSNorm as Hugging Face writes it, upcast first: on fp32 input the cast is a
    no-op that torch.export keeps as a check of the tensor's metadata."""

    def __init__(self, cast: bool):
        super().__init__()
        self.linear, self.cast = torch.nn.Linear(64, 64), cast

    def forward(self, x):
        y = self.linear(x)
        y = y.to(torch.float32) if self.cast else y
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).sum()


def test_a_metadata_check_costs_nothing_and_does_not_pin_the_batch():
    """The check launches no kernel: data parallelism predicts the same step with it as without
    (it was priced as a pass over the whole batch on every rank, which made pipelines look faster)."""
    x = torch.empty(1024, 512, 64, device="meta")
    costs = []
    for cast in (True, False):
        with torch.device("meta"):
            model = _Normed(cast)
        captured = capture(model, (x,))
        checks = captured.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default)
        assert bool(checks) == cast
        costs.append(autopar.plan(captured, 8, hardware="h100-80gb", degrees={"dp": 8}).cost.compute_s)
    assert costs[0] == pytest.approx(costs[1], rel=1e-9)


def _two_linears() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


@pytest.mark.parametrize("precision, per_element", [("bf16-mixed", 18), ("fp32", 12)])
def test_each_microbatch_after_the_first_adds_its_gradients(precision, per_element):
    """Gradient accumulation is a pass over the gradients per microbatch: on one H100, 4 sequences
    of a 1.7B model spent about 40 ms of 420 in these casts and adds (benchmarks/gpu.py). A stack
    whose weight-gradient GEMM accumulates in place (Megatron's fusion) gives 0 bytes."""
    model = _two_linears()
    captured = autopar.capture(model, (torch.empty(64, 256, device="meta"),), precision=precision)
    elements = sum(p.numel() for p in model.parameters())
    h100 = get_profile("h100-80gb")

    def optimizer_s(hardware, microbatches):
        options = dict(degrees={"dp": 1}, zero=0, recompute="none", precision=precision, microbatches=microbatches)
        return autopar.plan(captured, 1, hardware=hardware, **options).cost.optimizer_s

    added = optimizer_s(h100, 4) - optimizer_s(h100, 1)
    widened = per_element - 12  # mixed precision's cast of each gradient to fp32 first
    expected = 3 * elements * (12 / h100.streaming_bandwidth + widened / h100.widening_bandwidth)
    assert added == pytest.approx(expected, rel=1e-6)
    fused = dataclasses.replace(h100, grad_accumulation_bytes=0)
    assert optimizer_s(fused, 4) == pytest.approx(optimizer_s(fused, 1), rel=1e-9)


def test_a_frozen_parameter_holds_its_weights_alone():
    """No gradient, no optimizer state, no update, no accumulation for a parameter with
    requires_grad off (fine-tuning): the runtime gives it none (they were priced as trainable)."""
    model = _two_linears()
    model[0].requires_grad_(False)
    captured = autopar.capture(model, (torch.empty(64, 256, device="meta"),), precision="bf16-mixed")
    options = dict(degrees={"dp": 1}, zero=0, recompute="none", precision="bf16-mixed", microbatches=4)
    cost = autopar.plan(captured, 1, hardware="h100-80gb", **options).cost
    every = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert cost.memory["params"] == pytest.approx(every * 6)  # fp32 masters and their 16-bit copies
    assert cost.memory["grads"] == pytest.approx(trainable * 4)
    assert cost.memory["optimizer"] == pytest.approx(trainable * 8)
    h100 = get_profile("h100-80gb")
    accumulated = 3 * trainable * (12 / h100.streaming_bandwidth + 6 / h100.widening_bandwidth)  # cast, add
    update = optimizer_time(trainable, h100, recast=trainable) + accumulated
    assert cost.optimizer_s == pytest.approx(update, rel=1e-6)


def test_zero3_gathers_a_frozen_parameter_for_forward_alone():
    """Under ZeRO-3 a frozen weight is sharded and gathered for forward like any other, but has
    no gradient to reduce-scatter and is saved whole for backward (no second gather): its
    traffic was left out."""
    h100 = dataclasses.replace(get_profile("h100-80gb"), overlap=0.0)  # every byte of the sync exposed
    options = dict(degrees={"dp": 2}, zero=3, recompute="none", precision="fp32")

    def sync_s(freeze: bool) -> float:
        model = _two_linears()
        model[0].requires_grad_(not freeze)
        captured = autopar.capture(model, (torch.empty(8192, 256, device="meta"),))
        return autopar.plan(captured, 2, hardware=h100, **options).cost.grad_sync_s

    link = h100.link((2,), 2, 2)
    nbytes = 1024 * 256 * 4  # the first weight in fp32 (its bias is counted apart)
    gather = grad_sync_time(nbytes, 2, link, float("inf"), kind="all_gather")
    scatter = grad_sync_time(nbytes, 2, link, float("inf"), kind="reduce_scatter")
    bias = 1024 * 4
    bias_gather = grad_sync_time(bias, 2, link, float("inf"), kind="all_gather")
    bias_scatter = grad_sync_time(bias, 2, link, float("inf"), kind="reduce_scatter")
    # freezing the first layer drops its reduce-scatters and second gathers, and only those
    dropped = scatter + gather + bias_scatter + bias_gather
    assert sync_s(False) - sync_s(True) == pytest.approx(dropped, rel=1e-6)


def test_backward_is_profiled_for_the_inputs_that_need_a_gradient():
    """A mask (a buffer) gets no gradient: backward computes the input's alone, and autograd
    saves the mask for it, not the input (profiled with every input requiring grad before)."""

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1024))
            self.register_buffer("mask", torch.ones(64, 1024))

        def forward(self, x):
            return (x * self.scale) * self.mask

    captured = autopar.capture(Masked(), (torch.randn(64, 1024),))
    facts = analyze(captured, get_profile("a100-80gb"))
    masked = next(f for f in facts.values() if f.kind == "op" and f.slots[-1].name == "b_mask")
    every = op_profile(masked.node, needs_grad=True)  # as if the mask needed a gradient too
    assert masked.profile.backward_io_bytes < every.backward_io_bytes
    assert masked.profile.saved_inputs == (1,)  # the mask, for the input's gradient
    assert set(every.saved_inputs) == {0, 1}


class Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _cast(dtype: torch.dtype, x: torch.Tensor) -> OpProfile:
    node = next(n for n in capture(Cast(dtype), (x,)).graph.nodes if n.target is torch.ops.aten._to_copy.default)
    return op_profile(node, needs_grad=True)


def test_a_widening_cast_streams_at_its_own_rate_in_eager_programs_and_as_the_rest_compiled():
    """Eager torch widens bfloat16 to float32 in an unrolled loop (on an H200 at 2.1 TB/s, half the
    narrowing cast's 4.4: `autopar calibrate --backend nccl`): a widening cast's bytes are priced at
    that rate, forward or backward, the narrowing ones stream; in a compiled program inductor writes
    the casts, and they stream too. Without kernel figures (the CPU) every cast streams."""
    whole = 64 * 1024 * (2 + 4)
    x = torch.randn(64, 1024, dtype=torch.bfloat16, requires_grad=True)
    widen = _cast(torch.float32, x)
    assert widen.widened_bytes == widen.io_bytes == whole and widen.backward_widened_bytes == 0
    narrow = _cast(torch.bfloat16, x.detach().float().requires_grad_())
    assert narrow.widened_bytes == 0 and narrow.backward_widened_bytes == narrow.backward_io_bytes == whole
    h200 = get_profile("h200-141gb")
    assert h200.widening_bandwidth == pytest.approx(0.44 * h200.memory_bandwidth)
    assert h200.widening_bandwidth < h200.streaming_bandwidth
    each_way = whole / h200.widening_bandwidth + whole / h200.streaming_bandwidth + 2 * h200.op_overhead_s
    assert compute_time(widen, h200, True) == pytest.approx(each_way) == compute_time(narrow, h200, True)
    compiled = h200.running(compiled=True)
    streamed = 2 * whole / h200.streaming_bandwidth + 2 * h200.op_overhead_s
    assert compute_time(widen, compiled, True) == pytest.approx(streamed)
    cpu = get_profile("cpu-local")
    assert cpu.widening_bandwidth == cpu.streaming_bandwidth and cpu.running(compiled=True) is cpu


def test_mixed_precision_recasts_price_their_widening_half_as_the_program_runs():
    """Each step casts every fp32 master to 16 bits (narrowing) and every 16-bit gradient back to
    fp32 (widening): an eager step pays the widening half at the widening rate, a compiled one not."""
    model = _two_linears()
    captured = autopar.capture(model, (torch.empty(64, 256, device="meta"),), precision="bf16-mixed")
    elements = sum(p.numel() for p in model.parameters())
    h100 = get_profile("h100-80gb")

    def optimizer_s(compile):
        options = dict(degrees={"dp": 1}, zero=0, recompute="none", precision="bf16-mixed", compile=compile)
        return autopar.plan(captured, 1, hardware=h100, **options).cost.optimizer_s

    slower = elements * 6 * (1 / h100.widening_bandwidth - 1 / h100.streaming_bandwidth)
    assert optimizer_s(False) - optimizer_s(True) == pytest.approx(slower, rel=1e-6)


def test_a_like_factory_writes_its_output_and_reads_nothing():
    """ones_like takes only its argument's shape: one byte written per bool element (it was
    priced as reading its bf16 argument too)."""

    class Keep(torch.nn.Module):
        def forward(self, x):
            return x * torch.ones_like(x, dtype=torch.bool)

    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    ones = next(n for n in capture(Keep(), (x,)).graph.nodes if n.target is torch.ops.aten.ones_like.default)
    assert op_profile(ones, needs_grad=False).io_bytes == 64 * 1024


def test_nccl_tiers_price_a_ring_collective_by_its_fastest_protocol():
    """NCCL's tuning model (src/graph/tuning.cc): an 8-GPU all-reduce over NVLink of a few bytes
    takes LL's latency, 6.6 + 14 steps x 0.6 us (it was 14 steps of 10 us), a large one Simple's
    8.4 + 14 x 3.4 us and the bus bandwidth; a kind measured on the tier keeps its alpha-beta."""
    nvswitch = get_profile("a100-80gb").links[0]
    assert collective_time("all_reduce", 8, 8, nvswitch) == pytest.approx(15.0e-6, rel=1e-3)
    large = 256 * MB
    simple = 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * large / nvswitch.bandwidth
    assert collective_time("all_reduce", large, 8, nvswitch) == pytest.approx(simple)
    assert collective_time("all_gather", 8, 8, nvswitch) == pytest.approx((6.6 + 7 * 0.6) * 1e-6, rel=1e-3)
    measured = dataclasses.replace(nvswitch, fitted={"all_reduce": {8: (1e-6, 1e11)}})
    assert collective_time("all_reduce", 8, 8, measured) == pytest.approx(14e-6, rel=1e-3)
    assert collective_time("all_to_all", 8, 8, nvswitch) == pytest.approx(7 * nvswitch.alpha_s, rel=1e-3)


def test_an_op_on_partial_sums_does_its_whole_work_on_every_rank():
    """add(P, P) -> P adds whole-size tensors on every rank; a matmul of split inputs into a
    partial sum does its share (the first was priced at a share, which kept values partial)."""
    partial = Partial("sum")
    assert work_fraction(Strategy((partial, partial), partial), 4) == 1.0
    assert work_fraction(Strategy((Shard(1), Shard(0)), partial), 4) == 0.25
    assert work_fraction(Strategy((Replicate(),), Shard(0)), 4) == 0.25
