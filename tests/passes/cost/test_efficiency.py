"""GEMM, attention and mixture of experts efficiency from shapes, and the overlap rules: their textbook properties.

The figures are the presets' (autopar/ir/hardware.py): the curve must pass through the published
measurement it was derived from, grow with size, step at tile and wave boundaries, and order
dtypes as their peaks do; attention grows with sequence and head size and flattens past the table.
"""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch

import autopar
from autopar.ir import HardwareProfile, get_profile
from autopar.ir.precision import PrecisionPolicy
from autopar.passes.cost.efficiency import (
    attention_fill,
    attention_rate,
    attention_seconds,
    gemm_efficiency,
    gemm_list,
    gemm_seconds,
    shaped_seconds,
    streaming_seconds,
    work_units,
)
from autopar.passes.cost.facts import analyze
from autopar.passes.cost.ops import moves_no_data
from autopar.passes.cost.overlap import boundary_seconds, exposed_grad_sync, exposed_tp_comm, pipeline_messages

A100, H100 = get_profile("a100-80gb"), get_profile("h100-80gb")


@pytest.mark.parametrize(
    "profile, shape, published",
    [(A100, (1024, 10240, 5120), 271.2e12 / 312e12), (H100, (2048, 2048, 13312), 794.5e12 / 989e12)],
    ids=["a100", "h100"],
)
def test_the_curve_passes_through_the_published_best_gemm(profile, shape, published):
    # stas00/ml-engineering's Maximum Achievable Matmul FLOPS table, at its best shape
    assert gemm_efficiency(*shape, "bfloat16", profile.kernels) == pytest.approx(published, abs=0.002)


def test_gemm_efficiency_grows_with_size_and_saturates_below_the_best():
    sizes = [256, 512, 1024, 2048, 4096, 8192, 16384]
    efficiency = [gemm_efficiency(n, n, n, "bfloat16", A100.kernels) for n in sizes]
    assert efficiency == sorted(efficiency) and efficiency[0] < 0.1
    assert efficiency[-1] < A100.kernels.gemm_best["bfloat16"]
    assert efficiency[-1] == pytest.approx(efficiency[-2], rel=0.02)  # flat once every wave is full
    # measured cuBLAS on H100 (pranjalssh/fast.cu): 8192³ 80.4% of peak, 4096³ 72.4%
    assert gemm_efficiency(8192, 8192, 8192, "bfloat16", H100.kernels) == pytest.approx(0.804, abs=0.01)
    assert gemm_efficiency(4096, 4096, 4096, "bfloat16", H100.kernels) == pytest.approx(0.724, abs=0.07)


def test_tile_and_wave_quantization_make_steps():
    # 1792² fills 98 of 108 SMs with 128x256 tiles in one wave; one more row and column needs a
    # partial second wave (Horace He's example): the same work and a bit more takes far longer
    fits, spills = (gemm_seconds(n, n, 4096, "bfloat16", 2, A100) for n in (1792, 1793))
    assert spills > 1.3 * fits
    # a partial tile costs a whole one: 129 rows cost what 256 do
    assert gemm_seconds(129, 8192, 8192, "bfloat16", 2, A100) == pytest.approx(
        gemm_seconds(256, 8192, 8192, "bfloat16", 2, A100), rel=0.02
    )


def test_dtypes_order_as_their_peaks():
    seconds = {dtype: gemm_seconds(8192, 8192, 8192, dtype, 2, A100) for dtype in ("bfloat16", "tf32", "float32")}
    assert seconds["bfloat16"] < seconds["tf32"] < seconds["float32"]
    assert seconds["float32"] / seconds["bfloat16"] == pytest.approx(312 / 19.5, rel=0.01)


def test_thin_gemms_are_bound_by_memory():
    # 64 rows: ~60 FLOPs per byte, far below the A100's ~190 at 0.8 of its bandwidth; 32 tiles keep
    # only 32 of the 108 SMs streaming
    m, n, k = 64, 8192, 8192
    streamed = 2 * (m * k + k * n + m * n) / (A100.streaming_bandwidth * 32 / 108)
    assert gemm_seconds(m, n, k, "bfloat16", 2, A100) == pytest.approx(streamed + A100.op_overhead_s, rel=1e-6)


def test_attention_grows_with_sequence_and_head_size_and_causal_is_slower():
    figures = A100.kernels
    rates = [attention_rate(seq, 128, True, figures) for seq in (512, 1024, 2048, 4096, 8192, 16384)]
    assert rates == sorted(rates) and rates[0] == 99e12 and rates[-1] == 189e12  # FlashAttention-2's figures
    assert attention_rate(65536, 128, True, figures) == rates[-1]  # flat past the table
    assert attention_rate(4096, 64, True, figures) < attention_rate(4096, 128, True, figures)
    assert attention_rate(4096, 128, True, figures) < attention_rate(4096, 128, False, figures)
    # between measured points: log-linear in the sequence, linear in the head size
    assert attention_rate(2896, 128, True, figures) == pytest.approx((155e12 + 173e12) / 2, rel=0.01)
    assert attention_rate(4096, 96, True, figures) == pytest.approx((156e12 + 173e12) / 2)


def test_attention_time_is_quadratic_in_sequence_at_a_rising_rate():
    def seconds(seq):
        return attention_seconds(32, seq, seq, 128, True, A100, needs_grad=True)

    assert 2 < seconds(2048) / seconds(1024) < 4  # the kernel gets more efficient as the sequence grows

    # past the table the rate is flat: quadratic FLOPs, at the blocks' fill against the table's (16 heads)
    def fill(seq):
        return attention_fill(32, seq, True, 108) / attention_fill(16, seq, True, 108)

    launches = 2 * A100.op_overhead_s
    ratio = (seconds(65536) - launches) / (seconds(32768) - launches)
    assert ratio == pytest.approx(4 * fill(32768) / fill(65536), rel=1e-9)
    assert 1 < fill(32768) / fill(65536) < 1.01
    # FlashAttention's convention: forward 4·b·h·s²·d, halved when causal; backward 2.5x the forward
    flops = 4 * 32 * 8192**2 * 128 * 0.5 * 3.5
    assert seconds(8192) == pytest.approx(flops / 182e12 + 2 * A100.op_overhead_s)


def test_attention_slows_as_fewer_blocks_fill_the_gpu():
    """At the tables' own configuration (16k tokens, hidden 2048) the rate is the table's; one
    sequence over a tensor-parallel rank's few heads keeps a fraction of it, the less the fewer."""
    h100 = get_profile("h100-80gb")

    def rate(heads, seq, causal=True):
        forward = 4 * heads * seq * seq * 128 * (0.5 if causal else 1.0)
        return forward * 3.5 / (attention_seconds(heads, seq, seq, 128, causal, h100, True) - 2 * h100.op_overhead_s)

    assert rate(4 * 16, 4096) == pytest.approx(attention_rate(4096, 128, True, h100.kernels))
    rates = [rate(heads, 4096) for heads in (1, 2, 4, 8, 16, 32, 64)]
    assert rates == sorted(rates) and rates[0] < 0.2 * rates[-1]
    assert 0.55 < attention_fill(8, 4096, True, 132) / attention_fill(64, 4096, True, 132) < 0.7
    assert attention_fill(8, 4096, False, 132) > attention_fill(8, 4096, True, 132)  # no short blocks


def test_attention_fill_reproduces_the_h200_measurements():
    """The rule against what one H200 measured (benchmarks/gpu.py's record): 1 to 128 heads of one
    sequence of 1k to 16k tokens, full and causal, head sizes 64 and 128, on the table that
    `autopar calibrate` measured in the same run."""
    data = Path(__file__).parents[3] / "benchmarks" / "data" / "gpu"
    measured = json.loads((data / "h200-2026-11-26.json").read_text())["attention_occupancy"]
    profile = HardwareProfile.load(data / "h200-2026-11-26-calibrated.json")
    errors = [
        attention_seconds(r["heads"], r["seq"], r["seq"], r["head_dim"], r["causal"], profile, True) / r["seconds"] - 1
        for r in measured
    ]
    assert len(errors) == 32 and statistics.median(map(abs, errors)) < 0.1
    assert sum(abs(e) < 0.25 for e in errors) >= 24, sorted(errors)


def test_views_launch_nothing():
    aten = torch.ops.aten
    assert all(moves_no_data(op) for op in (aten.view.default, aten.transpose.int, aten._unsafe_view.default))
    assert not any(moves_no_data(op) for op in (aten.clone.default, aten.add.Tensor, aten.mm.default))


def test_tensor_parallel_overlap_hides_a_share_up_to_the_gemms():
    assert exposed_tp_comm(1.0, 5.0, 0.0) == 1.0
    assert exposed_tp_comm(1.0, 5.0, 0.875) == pytest.approx(0.125)
    assert exposed_tp_comm(1.0, 0.25, 0.875) == pytest.approx(0.75)  # the GEMMs are too short to hide it


def test_gradient_sync_hides_behind_backward_only():
    assert exposed_grad_sync(2.0, 5.0, 1.0) == 0.0
    assert exposed_grad_sync(2.0, 0.5, 1.0) == 1.5
    assert exposed_grad_sync(2.0, 5.0, 0.0) == 2.0


def test_pipeline_sends_wait_only_in_fill_and_drain_when_overlapped():
    assert pipeline_messages(8, 64, 1, overlapped=False) == 2 * (64 + 8 - 2)
    assert pipeline_messages(8, 64, 1, overlapped=True) == 2 * (8 - 1)
    assert pipeline_messages(8, 64, 3, overlapped=True) == 2 * (24 - 1)  # through every stage module
    assert pipeline_messages(1, 64, 1, overlapped=False) == 0
    # Megatron's scatter/gather: 8 tensor-parallel ranks each send 1/8 over InfiniBand, then all-gather
    ib, nvlink = A100.links[1], A100.links[0]
    whole, scattered = boundary_seconds(50e6, ib), boundary_seconds(50e6, ib, 8, nvlink)
    assert scattered < whole / 3


def test_a_gpu_profile_without_kernel_figures_keeps_one_efficiency():
    flat = dataclasses.replace(A100, kernels=None)
    assert flat.streaming_bandwidth == flat.memory_bandwidth
    assert A100.streaming_bandwidth == pytest.approx(0.8 * A100.memory_bandwidth)


def test_a_gemm_computes_the_gradients_of_its_inputs_that_need_one():
    """Autograd runs a linear's weight-gradient GEMM only for a trainable weight and its
    input-gradient GEMM only for an input that needs one: the first layer on the model's input
    runs the weight's alone, a frozen layer (fine-tuning) the input's alone."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048))
    model[2].requires_grad_(False)
    captured = autopar.capture(model, (torch.empty(4096, 1024, device="meta"),), precision="bf16-mixed")
    h100 = get_profile("h100-80gb")
    facts = analyze(captured, h100, policy=PrecisionPolicy.of("bf16-mixed"))
    first, frozen = [f for f in facts.values() if f.kind == "op" and f.node.target is torch.ops.aten.linear.default]

    def seconds(dims, grads):
        return sum(gemm_seconds(m, n, k, "bfloat16", 2, h100, b) for b, m, n, k in gemm_list(dims, True, grads))

    assert first.full_time_s == pytest.approx(seconds((1, 4096, 4096, 1024), (False, True)))
    assert frozen.full_time_s == pytest.approx(seconds((1, 4096, 2048, 4096), (True, False)))
    assert len(gemm_list((1, 4096, 2048, 4096), True)) == 3  # both gradients by default


EXPERTS_OP = torch.ops.autopar.moe_experts.default


def experts_shapes(tokens, hidden, ffn, experts, top_k):
    """moe_experts' input shapes: x, the combine weights and expert ids, gate_up [E, 2F, H], down [E, H, F]."""
    return [(tokens, hidden), (tokens, top_k), (tokens, top_k), (experts, 2 * ffn, hidden), (experts, hidden, ffn)]


def test_an_experts_op_is_priced_as_its_grouped_gemms_and_its_routed_copies():
    """Its forward: a grouped GEMM per projection over the T·k/E rows each expert gets, and the
    routed rows' copies and gated activation streamed; never above the best dense GEMM's rate."""
    tokens, hidden, ffn, experts, top_k = 16384, 2048, 1408, 64, 6
    shapes = experts_shapes(tokens, hidden, ffn, experts, top_k)
    forward = shaped_seconds(EXPERTS_OP, shapes, H100, "bfloat16", 2, False, top_k=top_k)
    rows = tokens * top_k / experts
    gemms = gemm_seconds(rows, 2 * ffn, hidden, "bfloat16", 2, H100, experts) + gemm_seconds(
        rows, hidden, ffn, "bfloat16", 2, H100, experts
    )
    streamed = streaming_seconds(2 * tokens * top_k * (2 * hidden + 3 * ffn), H100)
    assert forward == pytest.approx(gemms + streamed)
    flops = 2 * tokens * top_k * 3 * hidden * ffn
    assert flops / forward < H100.kernels.gemm_best["bfloat16"] * H100.peak_flops["bfloat16"]
    # backward runs the forward again (the op keeps no routed rows) and both gradients of each GEMM
    both = shaped_seconds(EXPERTS_OP, shapes, H100, "bfloat16", 2, True, top_k=top_k)
    assert 3.5 * forward < both < 4.5 * forward


def test_experts_slow_as_they_get_fewer_rows_and_keep_their_rows_when_split():
    """The same FLOPs over more, smaller experts (fewer rows each) run at a lower rate; expert
    parallelism over p ranks (tokens and experts split) leaves each expert its T·k/E rows: 1/p
    of the work, its GEMMs a batch of E/p."""

    def seconds(shapes, top_k, needs_grad=True):
        return shaped_seconds(EXPERTS_OP, shapes, H100, "bfloat16", 2, needs_grad, top_k=top_k)

    coarse, fine = experts_shapes(8192, 4096, 4096, 8, 2), experts_shapes(8192, 4096, 512, 256, 16)
    assert work_units(EXPERTS_OP, coarse, 2) == work_units(EXPERTS_OP, fine, 16)  # the same FLOPs
    assert seconds(fine, 16) > 1.2 * seconds(coarse, 2)
    tokens, hidden, ffn, experts, top_k, p = 16384, 2048, 1408, 64, 6, 8
    whole, split = (
        experts_shapes(tokens, hidden, ffn, experts, top_k),
        experts_shapes(tokens // p, hidden, ffn, experts // p, top_k),
    )
    assert work_units(EXPERTS_OP, split, top_k) / work_units(EXPERTS_OP, whole, top_k) == pytest.approx(1 / p)
    rows = tokens * top_k / experts
    gemms = gemm_seconds(rows, 2 * ffn, hidden, "bfloat16", 2, H100, experts // p) + gemm_seconds(
        rows, hidden, ffn, "bfloat16", 2, H100, experts // p
    )
    streamed = streaming_seconds(2 * tokens // p * top_k * (2 * hidden + 3 * ffn), H100)
    assert seconds(split, top_k, needs_grad=False) == pytest.approx(gemms + streamed)


def test_a_captured_mixture_of_experts_is_paced_by_its_experts_and_their_routing():
    """The moe node of a captured Mixtral-style model: its time on a GPU preset is the experts
    op's shaped time at its own top_k (the router included), not one flat FLOP rate."""
    from tests.helpers.equivalence import load_example

    with torch.device("meta"):
        model = load_example("moe_gpt.py").build(hidden=1024, layers=1, heads=8, seq=1024, experts=16, top_k=4)
    captured = autopar.capture(model, model.example_inputs(8, device="meta"), precision="bf16-mixed")
    facts = analyze(captured, H100, policy=PrecisionPolicy.of("bf16-mixed"))
    (moe,) = [f for f in facts.values() if f.kind == "op" and f.node.target is torch.ops.autopar.moe.default]
    assert moe.pacing is not None and moe.pacing.top_k == 4
    shaped = shaped_seconds(moe.node.target, moe.slot_shapes, H100, "bfloat16", 2, True, top_k=4)
    assert moe.full_time_s == pytest.approx(shaped)
    tokens = moe.slot_shapes[0][0]
    experts_alone = [moe.slot_shapes[0], (tokens, 4), (tokens, 4), *moe.slot_shapes[2:4]]
    assert shaped > shaped_seconds(EXPERTS_OP, experts_alone, H100, "bfloat16", 2, True, top_k=4)  # and its router


RULE_OP = torch.ops.autopar.gated_delta_rule.default


def rule_shapes(batch, steps, key_heads, heads, head_dim=128):
    """Input shapes of autopar::gated_delta_rule: q, k, v, g, beta."""
    qk, v, gates = (batch, steps, key_heads, head_dim), (batch, steps, heads, head_dim), (batch, steps, heads)
    return [qk, qk, v, gates, gates]


def test_gated_delta_rule_is_linear_in_time_split_by_heads_and_below_a_large_gemms_rate():
    """The chunked rule's products are chunk-sized: twice the steps is twice the work and the time
    (attention's would be four times); a head split over p ranks leaves 1/p of the work; its rate
    stays under a large GEMM's, as small products' do."""

    def seconds(shapes, chunk=64):
        return shaped_seconds(RULE_OP, shapes, H100, "bfloat16", 2, True, chunk=chunk)

    whole = rule_shapes(2, 4096, 16, 32)
    assert work_units(RULE_OP, rule_shapes(2, 8192, 16, 32)) == 2 * work_units(RULE_OP, whole)
    assert seconds(rule_shapes(2, 8192, 16, 32)) == pytest.approx(2 * seconds(whole), rel=0.05)
    assert work_units(RULE_OP, rule_shapes(2, 4096, 4, 8)) == work_units(RULE_OP, whole) / 4
    assert work_units(RULE_OP, whole, chunk=32) < work_units(RULE_OP, whole)  # smaller chunks: smaller products
    rate = 2 * 4 * work_units(RULE_OP, whole) / seconds(whole)  # forward, again, and two gradients each
    assert rate < gemm_efficiency(8192, 8192, 8192, "bfloat16", H100.kernels) * H100.peak_flops["bfloat16"]
