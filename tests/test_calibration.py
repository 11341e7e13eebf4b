"""``autopar calibrate``: the α-β fit (synthetic, exact), the measured contention and rendezvous
per rank count and the planner's use of them, the profile it writes, one real quick run.

The fitting tests need no processes. One quick calibration on real gloo ranks (~15 s) is
shared by the end-to-end test and the CLI test; nothing reads the calibrated profile in the
home directory (every path is explicit, XDG_CACHE_HOME points into tmp where it matters).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from contextlib import redirect_stdout

import numpy as np
import pytest

import autopar.calibrate_cmd
from autopar.cli import default_profile_path, main
from autopar.ir import ConfigError, HardwareProfile, LinkTier, get_profile
from autopar.passes.calibration import (
    fit_collective,
    fit_contention,
    fit_errors,
    fit_profile,
    fit_sync_by_ranks,
    model_coefficients,
)
from autopar.passes.cost import collective_time
from autopar.runtime.calibrate import GPU_SIZES_BYTES, KINDS, SIZES_BYTES, calibrate
from planning import plan_example

TRUE_LINKS = {  # (alpha seconds, bandwidth bytes/s) per kind, different so a mix-up shows
    "all_reduce": (150e-6, 1.2e9),
    "all_gather": (300e-6, 0.8e9),
    "reduce_scatter": (400e-6, 0.5e9),
    "all_to_all": (250e-6, 1.5e9),
    "send_recv": (100e-6, 2.0e9),
}


TRUE_CORES = 2
TRUE_SLOWDOWN = {2: 1.15, 4: 2.6}  # per-rank compute slowdown with this many ranks on the host
TRUE_SYNC_BY_RANKS = {2: 0.5e-3, 4: 1.9e-3}  # in-step rendezvous per blocking collective, per job size


def synthetic_measurements(noise: float = 0.05, seed: int = 0) -> dict:
    """What calibrate() would return on a machine that follows collective_time, with ±noise."""
    rng = np.random.default_rng(seed)
    records = []
    for ranks in (2, 4):
        link = LinkTier("truth", 0.0, 1.0, fitted={kind: {ranks: ab} for kind, ab in TRUE_LINKS.items()})
        for kind in KINDS:
            for nbytes in SIZES_BYTES:
                seconds = collective_time(kind, nbytes, ranks, link) * rng.uniform(1 - noise, 1 + noise)
                records.append({"kind": kind, "ranks": ranks, "nbytes": nbytes, "seconds": seconds})
    sync = []  # in-step all-reduces: alpha-beta + the job's rendezvous
    for job_ranks, ranks in ((2, 2), (4, 4), (4, 2)):
        link = LinkTier("truth", 0.0, 1.0, fitted={"all_reduce": {ranks: TRUE_LINKS["all_reduce"]}})
        for burst_s in (0.002, 0.008, 0.024):
            in_step = collective_time("all_reduce", 2**18, ranks, link) + TRUE_SYNC_BY_RANKS[job_ranks]
            sync.append({"job_ranks": job_ranks, "ranks": ranks, "nbytes": 2**18, "burst_s": burst_s,
                         "in_step_s": in_step * rng.uniform(1 - noise, 1 + noise)})
    alone = {"matmul_s": 0.012, "elementwise_s": 0.012}  # one pass of the op mix on one rank
    contention = [{"ranks": 1, **alone, "mix_s": 0.024}] + [  # every rank slowed by the same factor, ±noise
        {"ranks": ranks, **{key: seconds * factor * rng.uniform(1 - noise, 1 + noise) for key, seconds in alone.items()}}
        for ranks, factor in TRUE_SLOWDOWN.items()
    ]
    for record in contention[1:]:
        record["mix_s"] = record["matmul_s"] + record["elementwise_s"]
    return {
        "matmul": {"float32": 8e10, "bfloat16": 2e11},
        "memory_bandwidth": 2.5e10,
        "contention": contention,
        "collectives": records,
        "sync": sync,
        "cores": TRUE_CORES,
        "measured_at": "2026-01-01T00:00:00+00:00",
        "host": "test",
        "threads_per_rank": 1,
        "quick": False,
        "seconds": 1.0,
    }


GPU_LINKS = {kind: (alpha / 20, bandwidth * 250) for kind, (alpha, bandwidth) in TRUE_LINKS.items()}  # NVLink-like
GPU_MATMUL = {"float32": 50e12, "tf32": 380e12, "bfloat16": 700e12, "float16": 720e12}


def synthetic_gpu_measurements(noise: float = 0.05, seed: int = 0) -> dict:
    """What calibrate(backend="nccl") would return on an 8-GPU H100 node following collective_time."""
    rng = np.random.default_rng(seed)
    records = []
    for ranks in (2, 8):
        link = LinkTier("truth", 0.0, 1.0, fitted={kind: {ranks: ab} for kind, ab in GPU_LINKS.items()})
        records += [
            {"kind": kind, "ranks": ranks, "nbytes": nbytes,
             "seconds": collective_time(kind, nbytes, ranks, link) * rng.uniform(1 - noise, 1 + noise)}
            for kind in KINDS for nbytes in GPU_SIZES_BYTES
        ]
    return {
        "backend": "nccl", "matmul": GPU_MATMUL, "memory_bandwidth": 3.0e12, "contention": [], "collectives": records,
        "sync": [], "cores": 0, "device_name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85e9,
        "measured_at": "2026-01-01T00:00:00+00:00", "host": "test", "threads_per_rank": 1, "quick": False, "seconds": 1.0,
    }


def test_gpu_measurements_make_a_node_profile_on_the_matching_preset(tmp_path):
    profile = fit_profile(synthetic_gpu_measurements())
    preset = get_profile("h100-80gb")
    inside, between = profile.links
    assert profile.name == "gpu-calibrated" and inside.name == preset.links[0].name and between == preset.links[1]
    for kind, (alpha, bandwidth) in GPU_LINKS.items():
        for ranks in (2, 8):
            fitted_alpha, fitted_bandwidth = inside.alpha_beta(kind, ranks)
            assert fitted_alpha == pytest.approx(alpha, rel=0.10) and fitted_bandwidth == pytest.approx(bandwidth, rel=0.10)
    assert profile.peak_flops == GPU_MATMUL and profile.memory_bytes == 85e9 and profile.memory_bandwidth == 3.0e12
    # the preset's whole-model factor against its datasheet: the same bfloat16 rate as the preset plans with
    assert profile.flops_per_s("bfloat16") == pytest.approx(preset.flops_per_s("bfloat16"))
    assert not profile.measure_ops and profile.contention((8,)) == 1.0 and profile.link((8,), 8).sync_s == 0.0
    assert HardwareProfile.load(profile.save(tmp_path / "gpu.json")) == profile
    plan = plan_example("mlp.py", 8, batch=64, hardware=profile)
    assert plan.hardware == "gpu-calibrated" and plan.cost.step_s > 0
    assert fit_profile({**synthetic_gpu_measurements(), "device_name": "NVIDIA A100-SXM4-80GB"}).links[1] == get_profile("a100-80gb").links[1]


def test_calibrating_nccl_without_enough_gpus_says_what_to_do(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="needs 4 GPUs, this machine has 0: pass --ranks"):
        calibrate(ranks=(2, 4), backend="nccl", progress=lambda line: None)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        calibrate(backend="mpi", progress=lambda line: None)


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
        {"kind": "all_gather", "ranks": 2, "nbytes": n, "seconds": n / 1e9 * (1 + 0.03 * (-1) ** i)} for i, n in enumerate(SIZES_BYTES)
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
    assert fit_errors(profile.extra["measurements"]["collectives"], barrier_first)["send_recv"][2] == errors["send_recv"]["2"]

    path = profile.save(tmp_path / "calibrated.json")
    assert HardwareProfile.load(path) == profile
    assert get_profile(str(path)) == profile
    plan = plan_example("mlp.py", 2, batch=8, hardware=str(path))
    assert plan.hardware == "cpu-local-calibrated" and plan.cost.step_s > 0


def test_plan_cli_uses_the_calibrated_profile_when_it_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_profile_path()
    assert path == tmp_path / "autopar" / "profiles" / "cpu-local-calibrated.json"
    assert main(["plan", "mlp", "--mesh", "2", "--batch", "8"]) == 0
    assert "(calibrated)" not in capsys.readouterr().out  # no file: the preset, silently
    fit_profile(synthetic_measurements()).save(path)
    assert main(["plan", "mlp", "--mesh", "2", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hardware: {path} (calibrated)\n")
    assert main(["plan", "mlp", "--mesh", "2", "--batch", "8", "--hardware", "cpu-local"]) == 0
    assert "(calibrated)" not in capsys.readouterr().out  # an explicit --hardware wins


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
    records = [{"job_ranks": 4, "ranks": 4, "nbytes": 4, "burst_s": burst, "in_step_s": seconds} for burst, seconds in measured]
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
        assumed, contention_by_ranks={2: 1.15, 4: 2.6}, links=(dataclasses.replace(link, sync_by_ranks={2: 0.5e-3, 4: 1.9e-3}),)
    )
    assert [measured.contention((n,)) for n in (1, 2, 4, 8)] == [1.0, 1.15, 2.6, 4.0]  # 8 was not measured
    assert measured.contention((2, 2)) == 2.6  # one host: every rank of the mesh shares it
    assert measured.link((4,), 4).sync_s == 1.9e-3 and measured.link((2, 2), 2, 2).sync_s == 1.9e-3  # the job's, any group
    assert measured.link((2,), 2).sync_s == 0.5e-3 and measured.link((8,), 8).sync_s == pytest.approx(4e-3)
    assert HardwareProfile.from_json(json.loads(json.dumps(measured.to_json()))) == measured  # JSON keys are strings
    old_format = {key: value for key, value in assumed.to_json().items() if key != "contention_by_ranks"}
    old_format["links"] = [{key: value for key, value in data.items() if key != "sync_by_ranks"} for data in old_format["links"]]
    assert HardwareProfile.from_json(old_format) == assumed  # profiles written before the fields load as before

    # the planner's every use: op times, the optimizer step and the rendezvous follow the measured factor
    times = {}
    for name, profile in (("assumed", assumed), ("measured", measured)):
        plan = plan_example("mlp.py", 4, batch=8, hardware=profile, degrees={"dp": 4, "tp": 1})
        times[name] = plan.cost
    assert times["measured"].compute_s == pytest.approx(times["assumed"].compute_s * 2.6 / 2.0, rel=1e-6)
    assert times["measured"].optimizer_s == pytest.approx(times["assumed"].optimizer_s * 2.6 / 2.0, rel=1e-6)


@pytest.fixture(scope="module")
def quick_run():
    lines = []
    return calibrate(quick=True, progress=lines.append), lines


def test_quick_calibration_measures_sane_positive_numbers(quick_run):
    measurements, lines = quick_run
    assert any("collectives over 2 gloo ranks" in line for line in lines)
    rates = [*measurements["matmul"].values(), measurements["memory_bandwidth"]]
    assert set(measurements["matmul"]) == {"float32", "bfloat16"}
    records = measurements["collectives"]
    assert {(r["kind"], r["ranks"]) for r in records} == {(kind, 2) for kind in KINDS}
    assert all(r["nbytes"] > 0 for r in records)
    assert all(math.isfinite(x) and x > 0 for x in rates + [r["seconds"] for r in records])
    assert [r["ranks"] for r in measurements["contention"]] == [1, 2]
    assert all(r[key] > 0 for r in measurements["contention"] for key in ("mix_s", "matmul_s", "elementwise_s"))
    profile = fit_profile(measurements)
    assert set(profile.contention_by_ranks) == {2} and 1.0 <= profile.contention((2,)) < 10  # 2 ranks at once, measured
    assert set(profile.links[0].sync_by_ranks) == {2}
    link = profile.links[0]
    for kind in KINDS:
        alpha, bandwidth = link.alpha_beta(kind, 2)
        assert math.isfinite(alpha) and alpha >= 0 and math.isfinite(bandwidth) and bandwidth > 0


def test_calibrate_cli_prints_table_and_writes_a_loadable_profile(quick_run, tmp_path, monkeypatch):
    measurements, _ = quick_run
    asked = {}

    def measured(ranks, quick, progress, backend):  # reuse the quick run: the CLI's job is fit, print, save
        asked.update(ranks=ranks, quick=quick, backend=backend)
        progress("measuring (reused)")
        return measurements

    monkeypatch.setattr(autopar.calibrate_cmd, "calibrate", measured)
    out_path = tmp_path / "profiles" / "mine.json"
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out_path)]) == 0
    text = printed.getvalue()
    assert asked == {"ranks": (2,), "quick": True, "backend": "gloo"}
    assert "fit error %" in text and "GFLOP/s" in text and "memory copy" in text and str(out_path) in text
    assert "compute slowdown" in text and "rendezvous ms" in text
    assert all(f"{kind} " in text for kind in KINDS)
    profile = get_profile(str(out_path))
    assert profile.name == "cpu-local-calibrated" and profile.links[0].fitted["all_reduce"][2][1] > 0
    assert main(["calibrate", "--ranks", "1,2", "--out", str(out_path)]) == 2  # a group of 1 has no collective
