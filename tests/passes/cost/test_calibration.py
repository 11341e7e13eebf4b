"""passes/cost/calibration.py: the α-β fit (synthetic, exact), the measured contention and
rendezvous per rank count, the GPU node profile, and the planner's use of them. No processes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from calibration_data import (
    GPU_LINKS,
    GPU_MATMUL,
    TRUE_CORES,
    TRUE_LINKS,
    TRUE_SLOWDOWN,
    TRUE_SYNC_BY_RANKS,
    synthetic_gpu_measurements,
    synthetic_measurements,
)
from planning import plan_example

import autopar.calibrate
from autopar.ir import HardwareProfile, LinkTier, MemoryLimitError, get_profile
from autopar.passes.cost.calibration import (
    fit_collective,
    fit_contention,
    fit_errors,
    fit_profile,
    fit_sync_by_ranks,
    gemm_errors,
    gpu_preset,
    model_coefficients,
)
from autopar.passes.cost.efficiency import gemm_seconds
from autopar.runtime.measure import KINDS, SIZES_BYTES
from autopar.runtime.measure_gpu import GEMM_GRID, attention_cases, attention_flops


def test_gpu_measurements_make_a_node_profile_on_the_matching_preset(tmp_path):
    profile = fit_profile(synthetic_gpu_measurements())
    preset = get_profile("h100-80gb")
    inside, between = profile.links
    assert profile.name == "gpu-calibrated" and inside.name == preset.links[0].name and between == preset.links[1]
    for kind, (alpha, bandwidth) in GPU_LINKS.items():
        for ranks in (2, 8):
            fitted_alpha, fitted_bandwidth = inside.alpha_beta(kind, ranks)
            assert fitted_alpha == pytest.approx(alpha, rel=0.10) and fitted_bandwidth == pytest.approx(
                bandwidth, rel=0.10
            )
    assert profile.peak_flops == preset.peak_flops and profile.memory_bytes == 85e9
    assert profile.streaming_bandwidth == 3.0e12  # a measured copy: all of it streams
    # the GEMM curve passes through each measured rate at the measured 8192³ shape; tiles stay the preset's
    for dtype, rate in GPU_MATMUL.items():
        seconds = gemm_seconds(8192, 8192, 8192, dtype, 2, profile) - profile.op_overhead_s
        assert 2 * 8192**3 / seconds == pytest.approx(rate, rel=1e-9), dtype
    assert profile.kernels.tiles == preset.kernels.tiles and profile.kernels.attention == preset.kernels.attention
    assert not profile.measure_ops and profile.contention((8,)) == 1.0 and profile.link((8,), 8).sync_s == 0.0
    assert HardwareProfile.load(profile.save(tmp_path / "gpu.json")) == profile
    plan = plan_example("mlp.py", 8, batch=64, hardware=profile)
    assert plan.hardware == "gpu-calibrated" and plan.cost.step_s > 0
    assert (
        fit_profile({**synthetic_gpu_measurements(), "device_name": "NVIDIA A100-SXM4-80GB"}).links[1]
        == get_profile("a100-80gb").links[1]
    )


@pytest.mark.parametrize(
    "device, preset",
    [
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200-141gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"), ("NVIDIA B200", "h100-80gb"),
    ],
)  # fmt: skip
def test_a_gpu_takes_the_preset_its_name_says(device, preset):
    assert gpu_preset(device).name == preset


def test_the_a100_40gb_is_the_80gb_with_its_own_memory():
    small, large = get_profile("a100-40gb"), get_profile("a100-80gb")
    assert (small.memory_bytes, small.memory_bandwidth) == (40 * 2**30, 1.555e12)
    assert dataclasses.replace(small, name=large.name, description=large.description, memory_bytes=large.memory_bytes,
                               memory_bandwidth=large.memory_bandwidth) == large  # fmt: skip
    # 2.6B parameters' mixed-precision training state (18 bytes each, 47 GB): an A100 80GB holds it, a 40GB not
    options = dict(model_kwargs={"hidden": 2560, "layers": 32, "heads": 20, "seq": 1024}, degrees={"dp": 8}, zero=0)
    assert 40 * 2**30 < plan_example("gpt.py", 8, batch=8, hardware=large, **options).cost.peak_memory < 80 * 2**30
    with pytest.raises(MemoryLimitError, match=r"memory limit of 40960\.0 MiB per device"):
        plan_example("gpt.py", 8, batch=8, hardware=small, **options)


def test_one_gpu_fits_its_gemm_grid_and_attention_and_keeps_the_preset_links():
    """A one-GPU machine measures no collectives: its links are the preset's. GEMM times made by
    the cost model with a known fill along k (the best efficiency through the 8192³ rate) are
    fitted back to that fill, exactly; measured attention becomes the kernel table."""
    preset = get_profile("h100-80gb")
    truth = dataclasses.replace(preset, kernels=dataclasses.replace(preset.kernels, k_fill=200))
    rate = 2 * 8192**3 / (gemm_seconds(8192, 8192, 8192, "bfloat16", 2, truth) - truth.op_overhead_s)
    gemms = [
        dict(batch=b, m=m, n=n, k=k, dtype="bfloat16", seconds=gemm_seconds(m, n, k, "bfloat16", 2, truth))
        for b, m, n, k in GEMM_GRID
    ]
    attention = [
        dict(batch=b, heads=h, seq=s, head_dim=d, causal=c, flops_per_s=1e14 * (1 + s / 16384) * (d / 128))
        for b, h, s, d, c in attention_cases()
    ]
    measurements = {
        **synthetic_gpu_measurements(),
        "collectives": [],
        "matmul": {"bfloat16": rate},
        "memory_bandwidth": preset.memory_bandwidth * preset.kernels.memory_efficiency,
        "gemms": gemms,
        "attention": attention,
        "casts": {"narrowing": 3.0e12, "widening": 1.5e12},
    }
    profile = fit_profile(measurements)
    assert profile.links == preset.links and "one GPU" in profile.description
    assert profile.kernels.k_fill == 200 and max(map(abs, gemm_errors(profile, gemms))) < 1e-9
    assert profile.kernels.attention["causal"][128][2048] == pytest.approx(1e14 * (1 + 2048 / 16384))
    assert set(profile.kernels.attention) == {"causal", "full"} and set(profile.kernels.attention["full"]) == {64, 128}
    assert attention_flops(1, 1, 1024, 128, True) == 4 * 1024 * 1024 * 128 * 0.5 * 3.5
    text = autopar.calibrate.calibration_text(profile)
    assert "no collectives measured (one GPU)" in text and "fill along k fitted as 200" in text, text
    assert "attention causal head 128" in text
    assert profile.widening_bandwidth == pytest.approx(1.5e12) and "widening cast        1500 GB/s" in text, text


def test_coefficients_are_read_off_collective_time():
    assert model_coefficients("all_reduce", 4) == (6.0, 1.5)
    assert model_coefficients("all_gather", 4) == (3.0, 0.75)
    assert model_coefficients("all_to_all", 4) == (3.0, 0.1875)
    assert model_coefficients("send_recv", 4) == (1.0, 1.0)  # one message, whatever the group


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_fit_recovers_alpha_and_bandwidth_from_noisy_times(kind, ranks):
    records = synthetic_measurements()["collectives"]
    alpha, bandwidth = fit_collective(records, kind, ranks)
    true_alpha, true_bandwidth = TRUE_LINKS[kind]
    assert alpha == pytest.approx(true_alpha, rel=0.10)
    assert bandwidth == pytest.approx(true_bandwidth, rel=0.10)


def test_fit_keeps_alpha_nonnegative_and_bandwidth_finite():
    flat = [{"kind": "all_gather", "ranks": 2, "nbytes": n, "seconds": 1e-3} for n in SIZES_BYTES]  # no growth
    alpha, bandwidth = fit_collective(flat, "all_gather", 2)
    assert alpha == pytest.approx(1e-3, rel=0.01) and math.isfinite(bandwidth) and bandwidth > 0
    pure_bandwidth = [  # ±3% around n/B with B = 1 GB/s, no latency at all
        {"kind": "all_gather", "ranks": 2, "nbytes": n, "seconds": n / 1e9 * (1 + 0.03 * (-1) ** i)}
        for i, n in enumerate(SIZES_BYTES)
    ]
    alpha, bandwidth = fit_collective(pure_bandwidth, "all_gather", 2)
    assert alpha >= 0 and bandwidth == pytest.approx(0.5e9, rel=0.05)  # share (p-1)/p = 1/2
    with pytest.raises(ValueError, match="two sizes"):
        fit_collective(flat[:1], "all_gather", 2)


def test_fit_profile_round_trips_and_plans(tmp_path):
    profile = fit_profile(synthetic_measurements())
    link = profile.links[0]
    assert profile.name == "cpu-local-calibrated" and profile.compute_efficiency == 1.0
    assert profile.flops_per_s("float32") == 8e10 and profile.memory_bandwidth == 2.5e10
    assert (link.alpha_s, link.bandwidth) == link.fitted["all_reduce"][4]  # the largest group
    assert set(link.fitted) == set(KINDS) and all(set(by_ranks) == {2, 4} for by_ranks in link.fitted.values())
    assert profile.cores_per_host == TRUE_CORES
    assert "autopar calibrate" in profile.description and "achieved" in profile.description
    errors = profile.extra["fit_error"]
    assert set(errors) == set(KINDS) and all(0 <= e < 0.05 for by_ranks in errors.values() for e in by_ranks.values())
    barrier_first = dataclasses.replace(link, sync_s=0.0)  # as measured: every rank waiting, no skew
    assert (
        fit_errors(profile.extra["measurements"]["collectives"], barrier_first)["send_recv"][2]
        == errors["send_recv"]["2"]
    )

    path = profile.save(tmp_path / "calibrated.json")
    assert HardwareProfile.load(path) == profile
    assert get_profile(str(path)) == profile
    plan = plan_example("mlp.py", 2, batch=8, hardware=str(path))
    assert plan.hardware == "cpu-local-calibrated" and plan.cost.step_s > 0


def test_fit_recovers_the_measured_contention_and_rendezvous_per_rank_count():
    measurements = synthetic_measurements()
    assert fit_contention(measurements["contention"]) == pytest.approx(TRUE_SLOWDOWN, rel=0.06)  # ±5% noise on one pass
    assert fit_contention(measurements["contention"][1:]) == {}  # nothing to compare with
    noise_below_alone = [{"ranks": 1, "mix_s": 0.024}, {"ranks": 2, "mix_s": 0.023}]
    assert fit_contention(noise_below_alone) == {2: 1.0}  # sharing never speeds a rank up
    profile = fit_profile(measurements)
    link = profile.links[0]
    assert profile.contention_by_ranks == fit_contention(measurements["contention"])
    assert link.sync_by_ranks == pytest.approx(TRUE_SYNC_BY_RANKS, rel=0.06)
    # per unit of contention, for rank counts not measured: 0.5 ms / 1.15 and 1.9 ms / 2.6, median of 9 records
    assert link.sync_s == pytest.approx(TRUE_SYNC_BY_RANKS[4] / TRUE_SLOWDOWN[4], rel=0.06)


def test_rendezvous_fit_weighs_short_bursts_most():
    link = LinkTier("free", 0.0, 1e15)  # alpha-beta ~0: the excess is the in-step time
    measured = [(0.004, 1.2e-3), (0.017, -0.9e-3), (0.053, -1.3e-3), (0.004, 3.6e-3), (0.018, 0.7e-3), (0.051, 0.2e-3)]
    records = [
        {"job_ranks": 4, "ranks": 4, "nbytes": 4, "burst_s": burst, "in_step_s": seconds} for burst, seconds in measured
    ]
    # 4 ranks on 2 cores (a calibration here): after long bursts the wait hides behind the others'
    # compute and the difference of two long timings is noise; the plain median would say 0.45 ms
    assert fit_sync_by_ranks(records, link) == {4: pytest.approx(1.2e-3, abs=1e-9)}
    assert fit_sync_by_ranks([{**r, "in_step_s": -1e-3} for r in records], link) == {4: 0.0}  # never below 0


def test_contention_uses_the_measured_factor_where_there_is_one():
    preset = dataclasses.replace(get_profile("cpu-local"), cores_per_host=2)
    link = LinkTier("loopback", 1e-4, 1e9, sync_s=1e-3)
    assumed = dataclasses.replace(preset, links=(link,))
    assert [assumed.contention((n,)) for n in (1, 2, 4, 8)] == [1.0, 1.0, 2.0, 4.0]  # no measurement: ranks per core
    assert assumed.link((4,), 4).sync_s == pytest.approx(2e-3)
    measured = dataclasses.replace(
        assumed,
        contention_by_ranks={2: 1.15, 4: 2.6},
        links=(dataclasses.replace(link, sync_by_ranks={2: 0.5e-3, 4: 1.9e-3}),),
    )
    assert [measured.contention((n,)) for n in (1, 2, 4, 8)] == [1.0, 1.15, 2.6, 4.0]  # 8 was not measured
    assert measured.contention((2, 2)) == 2.6  # one host: every rank of the mesh shares it
    assert (
        measured.link((4,), 4).sync_s == 1.9e-3 and measured.link((2, 2), 2, 2).sync_s == 1.9e-3
    )  # the job's, any group
    assert measured.link((2,), 2).sync_s == 0.5e-3 and measured.link((8,), 8).sync_s == pytest.approx(4e-3)
    assert HardwareProfile.from_json(json.loads(json.dumps(measured.to_json()))) == measured  # JSON keys are strings
    old_format = {key: value for key, value in assumed.to_json().items() if key != "contention_by_ranks"}
    old_format["links"] = [
        {key: value for key, value in data.items() if key != "sync_by_ranks"} for data in old_format["links"]
    ]
    assert HardwareProfile.from_json(old_format) == assumed  # profiles written before the fields load as before

    # the planner's every use: op times, the optimizer step and the rendezvous follow the measured factor
    times = {}
    for name, profile in (("assumed", assumed), ("measured", measured)):
        plan = plan_example("mlp.py", 4, batch=8, hardware=profile, degrees={"dp": 4, "tp": 1})
        times[name] = plan.cost
    assert times["measured"].compute_s == pytest.approx(times["assumed"].compute_s * 2.6 / 2.0, rel=1e-6)
    assert times["measured"].optimizer_s == pytest.approx(times["assumed"].optimizer_s * 2.6 / 2.0, rel=1e-6)
