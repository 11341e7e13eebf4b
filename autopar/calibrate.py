"""``autopar calibrate``: measure this machine, fit the cost model, print it, save the profile.

The CLI wires the arguments; this module runs the measurement (``runtime.measure``), the
fit (``passes.calibration``) and prints what a user checks before trusting the profile:
α and bandwidth per collective with the fit's error, the compute slowdown and rendezvous
per rank count, matmul and memory rates.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from autopar.ir import HardwareProfile
from autopar.passes.cost.calibration import fit_errors, fit_profile, gemm_errors
from autopar.runtime.measure import calibrate


def run_calibrate(
    *, ranks=(2, 4), quick: bool = False, out: Path, progress=None, backend: str = "gloo"
) -> HardwareProfile:
    """Measure, fit, print the table and write the profile to ``out``; return the profile.

    >>> run_calibrate(quick=True, out=Path("cpu.json"))     # doctest: +SKIP
    """
    progress = progress or (lambda line: print(line, flush=True))
    measurements = calibrate(ranks=ranks, quick=quick, progress=progress, backend=backend)
    profile = fit_profile(measurements)
    print()
    print(calibration_text(profile))
    path = profile.save(out)
    print(
        f"\nwrote {path} ({measurements['seconds']:.0f} s of measuring); plan with it: autopar plan MODEL --mesh N "
        f"--hardware {path}"
    )
    return profile


def calibration_text(profile: HardwareProfile) -> str:
    """The fitted collectives as a table, then compute and memory rates."""
    link = profile.links[0]
    measurements = profile.extra["measurements"]
    if not measurements["collectives"]:  # one GPU: nothing to link
        return "\n".join(
            [f"no collectives measured (one GPU): the links are the preset's ({link.name})", *_device_lines(profile)]
        )
    # measured after a barrier, every rank waiting: compare without the in-step rendezvous
    errors = fit_errors(measurements["collectives"], dataclasses.replace(link, sync_s=0.0))
    header = f"{'collective':<15}{'ranks':>6}{'alpha us':>11}{'bandwidth GB/s':>16}{'fit error %':>13}"
    lines = [header, "-" * len(header)]
    for kind, by_ranks in link.fitted.items():
        for ranks, (alpha, bandwidth) in sorted(by_ranks.items()):
            error = errors.get(kind, {}).get(ranks, float("nan"))
            lines.append(f"{kind:<15}{ranks:>6}{alpha * 1e6:>11.1f}{bandwidth / 1e9:>16.3f}{error * 100:>13.1f}")
    if profile.cores_per_host:  # CPU ranks share cores; GPU ranks each have a device
        lines += ["", *contention_lines(profile), ""]
        lines += [
            f"matmul {dtype:<9} {rate / 1e9:8.1f} GFLOP/s (one thread)" for dtype, rate in profile.peak_flops.items()
        ]
        lines.append(f"memory copy      {profile.memory_bandwidth / 1e9:8.1f} GB/s (one thread, read + write)")
    else:
        lines += _device_lines(profile)
    return "\n".join(lines)


def _device_lines(profile: HardwareProfile) -> list[str]:
    """A GPU's measured rates: matmul per dtype, memory, casts, the GEMM grid's fit and attention."""
    measured = profile.extra.get("matmul", {})
    lines = [""] + [
        f"matmul {dtype:<9} {rate / 1e12:8.1f} TFLOP/s measured (datasheet {profile.peak_flops[dtype] / 1e12:.0f})"
        for dtype, rate in measured.items()
        if dtype in profile.peak_flops
    ]
    lines.append(f"memory copy      {profile.memory_bandwidth / 1e9:8.0f} GB/s (read + write)")
    if profile.kernels and profile.kernels.widening_efficiency is not None:
        lines.append(f"widening cast    {profile.widening_bandwidth / 1e9:8.0f} GB/s (eager bfloat16 to float32)")
    lines.append(
        f"compute efficiency {profile.compute_efficiency:.2f} of the datasheet (ops other than GEMMs and attention)"
    )
    gemms = profile.extra["measurements"].get("gemms")
    if gemms:
        errors = [abs(error) for error in gemm_errors(profile, gemms)]
        lines.append(
            f"GEMMs: {len(gemms)} bfloat16 shapes, the tile's fill along k fitted as {profile.kernels.k_fill}: "
            f"model error median {statistics.median(errors) * 100:.0f}%, worst {max(errors) * 100:.0f}%"
        )
    for mask, by_dim in (profile.kernels.attention if profile.extra["measurements"].get("attention") else {}).items():
        for dim, by_seq in sorted(by_dim.items()):
            rates = ", ".join(f"{seq} {rate / 1e12:.0f}" for seq, rate in sorted(by_seq.items()))
            lines.append(f"attention {mask} head {dim}, TFLOP/s by sequence: {rates}")
    return lines


def contention_lines(profile: HardwareProfile) -> list[str]:
    """Per rank count: how much slower a rank computes with the others running (the op mix,
    and its matmul and elementwise parts) and the in-step rendezvous per blocking collective."""
    link = profile.links[0]
    measured = {r["ranks"]: r for r in profile.extra.get("measurements", {}).get("contention", [])}
    header = f"{'ranks':>5}{'compute slowdown':>18}{'matmul':>8}{'elementwise':>13}{'rendezvous ms':>15}"
    lines = [f"ranks sharing {profile.cores_per_host} cores: compute slowdown of the op mix vs one rank alone", header]
    for ranks in sorted(set(measured) | set(profile.contention_by_ranks) | set(link.sync_by_ranks)):
        parts = [
            f"{measured[ranks][f'{part}_s'] / measured[1][f'{part}_s']:.2f}x"
            if 1 in measured and ranks in measured
            else "-"
            for part in ("matmul", "elementwise")
        ]
        sync = f"{profile.link((ranks,), ranks).sync_s * 1e3:.2f}" if ranks > 1 else "-"  # one rank waits for nobody
        lines.append(f"{ranks:>5}{profile.contention((ranks,)):>17.2f}x{parts[0]:>8}{parts[1]:>13}{sync:>15}")
    lines.append(
        f"other rank counts: max(1, ranks / {profile.cores_per_host} cores); rendezvous {link.sync_s * 1e3:.2f} ms x "
        "that"
    )
    return lines
