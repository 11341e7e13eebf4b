"""``autopar calibrate`` and its profile: one real quick run on gloo ranks (~15 s) shared by
the measurement and CLI tests, the no-GPU error, and ``autopar plan`` picking the profile up.
Nothing reads the calibrated profile in the home directory (every path is explicit,
XDG_CACHE_HOME points into tmp where it matters)."""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest
from calibration_data import synthetic_measurements

import autopar.calibrate
from autopar.cli import default_profile_path, main
from autopar.ir import ConfigError, get_profile
from autopar.passes.cost.calibration import fit_profile
from autopar.runtime.measure import KINDS, calibrate
from autopar.runtime.measure_gpu import attention_flops, measure_attention, measure_gemms


def test_calibrating_nccl_without_enough_gpus_says_what_to_do(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="GPUs and it has none: calibrate gloo"):
        calibrate(ranks=(2, 4), backend="nccl", progress=lambda line: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="needs 4 GPUs, this machine has 2: pass --ranks"):
        calibrate(ranks=(2, 4), backend="nccl", progress=lambda line: None)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        calibrate(backend="mpi", progress=lambda line: None)


def test_gemm_and_attention_timers_return_per_call_seconds():
    """The GPU sweep's kernel timers, on this CPU with tiny shapes: one record per case, positive
    times, attention's rate its FlashAttention-convention FLOPs over the time."""
    gemms = measure_gemms([(1, 64, 32, 16), (2, 16, 16, 16)], "float32", device="cpu")
    assert [(g["batch"], g["m"], g["n"], g["k"]) for g in gemms] == [(1, 64, 32, 16), (2, 16, 16, 16)]
    attention = measure_attention([(2, 2, 32, 16, True)], "float32", device="cpu")
    (record,) = attention
    assert all(g["seconds"] > 0 for g in gemms) and record["seconds"] > 0
    assert record["flops_per_s"] == pytest.approx(attention_flops(2, 2, 32, 16, True) / record["seconds"])


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

    monkeypatch.setattr(autopar.calibrate, "calibrate", measured)
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
