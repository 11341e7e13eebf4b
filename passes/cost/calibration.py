"""Fit measured collective times into the α-β model the planner uses, and the measured
compute contention and in-step rendezvous per rank count; build a hardware profile.

Pure arithmetic on the dict that ``autopar.runtime.measure.calibrate`` returns.

For one collective kind over ``p`` ranks the cost model (:func:`passes.cost.collective_time`)
is linear in the two unknowns α (seconds per step) and β = 1/B (seconds per byte)::

    time(n) = a·α + b·n·β        all_reduce a = 2(p-1), b = 2(p-1)/p; all_gather ... see cost.py

The coefficients a and b are read off ``collective_time`` itself (once with α = 1, B = ∞,
once with α = 0, B = 1), so the fit inverts exactly the formulas the planner evaluates,
whatever they become. The fit minimizes the relative error Σ ((model − t)/t)², so a 4 KiB
message weighs as much as a 16 MiB one, subject to α ≥ 0 and β > 0. It is robust: a few
reweighting rounds move the least-squares fit toward least absolute relative error, so one
measurement slowed by a busy machine does not pull the line.

    profile = fit_profile(measurements)
    profile.links[0].alpha_beta("all_gather", 4)        # (1.9e-4, 8.1e8)
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from autopar.ir import PROFILES, HardwareProfile, LinkTier
from autopar.ir.hardware import COLLECTIVES
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.efficiency import gemm_seconds, shape_factor

_ITEMSIZE = {"float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2}
MAX_BANDWIDTH = 1e15  # bytes/s: keeps 1/B strictly positive when the times do not grow with size
_ROBUST_ROUNDS = 20
_ROBUST_FLOOR = 0.01  # relative errors below 1% count as 1% when reweighting


def model_coefficients(kind: str, ranks: int) -> tuple[float, float]:
    """(a, b) with ``collective_time(kind, n, ranks, link) == a·α + b·n/B``, read off collective_time.

    >>> model_coefficients("all_reduce", 4)
    (6.0, 1.5)
    """
    steps = collective_time(kind, 1.0, ranks, LinkTier("probe", 1.0, float("inf")))
    share = collective_time(kind, 1.0, ranks, LinkTier("probe", 0.0, 1.0))
    return steps, share


def _bounded_least_squares(design: np.ndarray, target: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """min ‖design·x − target‖ subject to x ≥ lower, by solving on every face of the box.

    The problem is convex, so its minimum is the free minimum of one face that is feasible;
    with two unknowns there are four faces.
    """
    scale = np.linalg.norm(design, axis=0)
    scale[scale == 0] = 1.0
    scaled, low = design / scale, lower * scale
    best, best_residual = None, np.inf
    for free in itertools.product((True, False), repeat=design.shape[1]):
        free = np.array(free)
        x = low.copy()
        if free.any():
            rest = target - scaled[:, ~free] @ low[~free]
            x[free] = np.linalg.lstsq(scaled[:, free], rest, rcond=None)[0]
            if (x < low).any():
                continue
        residual = np.linalg.norm(scaled @ x - target)
        if residual < best_residual:
            best, best_residual = x, residual
    return best / scale


def fit_collective(records: list[dict], kind: str, ranks: int) -> tuple[float, float]:
    """(α seconds, bandwidth bytes/s) of ``kind`` over ``ranks``, fitted to measured records.

    ``records`` are ``{"kind", "ranks", "nbytes", "seconds"}`` dicts (``nbytes`` as
    ``collective_time`` defines it); those of other kinds and group sizes are ignored.

    >>> link = LinkTier("x", 1e-4, 1e9)
    >>> records = [{"kind": "all_gather", "ranks": 4, "nbytes": n,
    ...             "seconds": collective_time("all_gather", n, 4, link)} for n in (4096, 2**20, 2**24)]
    >>> [round(v, 6) for v in fit_collective(records, "all_gather", 4)]
    [0.0001, 1000000000.0]
    """
    chosen = [r for r in records if r["kind"] == kind and r["ranks"] == ranks]
    if len({r["nbytes"] for r in chosen}) < 2:
        raise ValueError(
            f"fitting {kind} over {ranks} ranks needs measurements at two sizes or more, got {len(chosen)}"
        )
    steps, share = model_coefficients(kind, ranks)
    seconds = np.array([r["seconds"] for r in chosen], dtype=float)
    nbytes = np.array([r["nbytes"] for r in chosen], dtype=float)
    design = np.stack([np.full_like(nbytes, steps), share * nbytes], axis=1) / seconds[:, None]
    lower = np.array([0.0, 1.0 / MAX_BANDWIDTH])
    weights = np.ones_like(seconds)
    for _ in range(_ROBUST_ROUNDS):  # iteratively reweighted least squares toward the L1 fit
        alpha, beta = _bounded_least_squares(design * weights[:, None], weights, lower)
        relative = np.abs(design @ np.array([alpha, beta]) - 1.0)
        weights = 1.0 / np.sqrt(np.maximum(relative, _ROBUST_FLOOR))
    return float(alpha), float(1.0 / beta)


def fit_errors(records: list[dict], link: LinkTier) -> dict[str, dict[int, float]]:
    """Median relative error |model − measured| / measured per kind and group size.

    The model is ``collective_time`` with ``link``: what the planner will predict.

    >>> fit_errors(records, profile.links[0])            # doctest: +SKIP
    {'all_reduce': {2: 0.04, 4: 0.07}, ...}
    """
    errors: dict[str, dict[int, list[float]]] = {}
    for record in records:
        model = collective_time(record["kind"], record["nbytes"], record["ranks"], link)
        errors.setdefault(record["kind"], {}).setdefault(record["ranks"], []).append(
            abs(model - record["seconds"]) / record["seconds"]
        )
    return {
        kind: {ranks: float(np.median(values)) for ranks, values in sorted(by_ranks.items())}
        for kind, by_ranks in errors.items()
    }


def fit_contention(records: list[dict]) -> dict[int, float]:
    """How much slower each rank computes when this many ranks share the host, per rank count.

    ``records`` come from ``measure_contention``: the op mix's pass with every rank running
    it at once (the slowest rank, median over rounds), divided by its pass on one rank
    alone; at least 1 (sharing never speeds a rank up; a lower ratio is noise). Empty when
    the one-rank pass is missing. :meth:`~autopar.ir.HardwareProfile.contention` reads it.

    >>> fit_contention([{"ranks": 1, "mix_s": 0.024}, {"ranks": 4, "mix_s": 0.060}])
    {4: 2.5}
    """
    alone = [r["mix_s"] for r in records if r["ranks"] == 1]
    if not alone:
        return {}
    return {r["ranks"]: max(1.0, r["mix_s"] / alone[0]) for r in records if r["ranks"] > 1}


def _sync_excess(record: dict, link: LinkTier) -> float:
    """An in-step all-reduce's cost beyond its alpha-beta time."""
    return record["in_step_s"] - collective_time("all_reduce", record["nbytes"], record["ranks"], link)


def _burst_weighted_median(values: list[float], records: list[dict]) -> float:
    """The median of ``values`` weighted by 1 / each record's burst: an excess is the
    difference of two timings of the burst, so its noise grows with the burst; and the
    rendezvous weighs most in steps whose collectives come after short compute."""
    order = np.argsort(values)
    weights = np.array([1.0 / records[i]["burst_s"] for i in order])
    middle = np.searchsorted(np.cumsum(weights), weights.sum() / 2)
    return float(np.array(values)[order][middle])


def fit_sync_by_ranks(records: list[dict], link: LinkTier) -> dict[int, float]:
    """Seconds a blocking collective costs in a step beyond alpha-beta, per job size.

    Over a job's ``measure_sync`` records (every group size and burst it ran), the median
    of (in-step cost − ``collective_time``) weighted by 1 / burst (see
    ``_burst_weighted_median``), never below 0. The profile's
    :meth:`~autopar.ir.HardwareProfile.link` uses it for a mesh of that many ranks.
    """
    fitted = {}
    for job in sorted({r["job_ranks"] for r in records}):
        chosen = [r for r in records if r["job_ranks"] == job]
        fitted[job] = max(0.0, _burst_weighted_median([_sync_excess(r, link) for r in chosen], chosen))
    return fitted


def fit_sync(records: list[dict], link: LinkTier, cores: int, contention: dict[int, float] | None = None) -> float:
    """Seconds a blocking collective costs in a step beyond alpha-beta, per unit of contention:
    what :meth:`~autopar.ir.HardwareProfile.link` scales for a job size not measured.

    Over ``measure_sync`` records, the excess each divided by its job's contention
    (``contention`` where measured, else ranks per core, at least 1), its median weighted
    by 1 / burst, never below 0.
    """
    if not records:
        return 0.0
    contention = contention or {}
    excess = [_sync_excess(r, link) / contention.get(r["job_ranks"], max(1.0, r["job_ranks"] / cores)) for r in records]
    return max(0.0, _burst_weighted_median(excess, records))


def fit_link(records: list[dict], name: str, fallback: LinkTier) -> LinkTier:
    """One link tier with an (α, B) fitted per measured kind and group size; its own (α, B)
    are all-reduce's over the largest group (``fallback``'s without all-reduce records)."""
    order = {kind: index for index, kind in enumerate(COLLECTIVES)}
    groups = sorted(
        {(r["kind"], r["ranks"]) for r in records}, key=lambda group: (order.get(group[0], len(order)), group)
    )
    fitted: dict[str, dict[int, tuple[float, float]]] = {}
    for kind, ranks in groups:
        fitted.setdefault(kind, {})[ranks] = fit_collective(records, kind, ranks)
    all_reduce = fitted.get("all_reduce")
    alpha, bandwidth = all_reduce[max(all_reduce)] if all_reduce else (fallback.alpha_s, fallback.bandwidth)
    return LinkTier(name, alpha, bandwidth, fitted=fitted)


def _fit_extras(base: HardwareProfile, measurements: dict, link: LinkTier) -> dict:
    """The base's extras, the fit's error per kind and group size, the raw measurements."""
    errors = fit_errors(measurements["collectives"], link)
    return {
        **base.extra,
        "fit_error": {
            kind: {str(ranks): error for ranks, error in by_ranks.items()} for kind, by_ranks in errors.items()
        },
        "measurements": measurements,
    }


def fit_profile(
    measurements: dict, name: str = "cpu-local-calibrated", base: HardwareProfile = PROFILES["cpu-local"]
) -> HardwareProfile:
    """The hardware profile ``measurements`` (from ``runtime.measure.calibrate``) describe.

    ``peak_flops`` are the measured achieved matmul rates, so ``compute_efficiency`` is 1.0;
    the one link tier ("loopback") carries an (α, B) per measured kind and group size, and
    its own (α, B) are all-reduce's over the largest group, and the in-step rendezvous per
    job size measured. ``contention_by_ranks`` is the measured compute slowdown per rank
    count. Memory size, op overhead and overlap come from ``base``. ``extra`` keeps the fit
    errors and the raw measurements. GPU measurements (NCCL) go to :func:`fit_gpu_profile`.

    >>> fit_profile(calibrate(quick=True)).save("cpu.json")       # doctest: +SKIP
    """
    if measurements.get("backend") == "nccl":
        return fit_gpu_profile(measurements)
    link = fit_link(measurements["collectives"], "loopback", base.links[0])
    extra = _fit_extras(base, measurements, link)  # the fit's errors: collectives after a barrier, no rendezvous
    cores = measurements.get("cores") or base.cores_per_host
    contention = fit_contention(measurements.get("contention", []))
    sync = measurements.get("sync", [])
    link = replace(link, sync_s=fit_sync(sync, link, cores, contention), sync_by_ranks=fit_sync_by_ranks(sync, link))
    sizes = sorted({r["ranks"] for r in measurements["collectives"]})
    description = (
        f"measured by `autopar calibrate` at {measurements.get('measured_at', '?')} on "
        f"{measurements.get('host', 'this machine')}: "
        f"one thread per rank; peak_flops are the achieved matmul rates measured (so compute_efficiency is 1.0), "
        f"memory_bandwidth one large copy, collectives on gloo over loopback with {', '.join(map(str, sizes))} ranks, "
        "alpha-beta fitted per kind and group size, the compute slowdown and the in-step rendezvous per "
        "blocking collective measured per number of ranks" + (" (quick run)" if measurements.get("quick") else "")
    )
    return replace(
        base,
        name=name,
        description=description,
        peak_flops={dtype: float(rate) for dtype, rate in measurements["matmul"].items()},
        compute_efficiency=1.0,
        memory_bandwidth=float(measurements["memory_bandwidth"]),
        links=(link,),
        cores_per_host=cores,
        measure_ops=True,
        contention_by_ranks=contention,
        extra=extra,
    )


# what a device's name holds (NVIDIA A100-SXM4-40GB, ...) -> its preset; the first whose words all appear
GPU_PRESETS = {
    ("H200",): "h200-141gb", ("H100",): "h100-80gb", ("A100", "40GB"): "a100-40gb", ("A100",): "a100-80gb",
    ("V100",): "v100-16gb",
}  # fmt: skip


def gpu_preset(device_name: str) -> HardwareProfile:
    """The preset of the GPU named ``device_name`` (``torch.cuda.get_device_name``): its
    inter-node tier, overlap and op overhead are what a one-node calibration cannot measure.
    An unknown GPU takes the H100's."""
    name = device_name.upper()
    matches = (preset for words, preset in GPU_PRESETS.items() if all(word in name for word in words))
    return PROFILES[next(matches, "h100-80gb")]


MEASURED_MATMUL_SIZE = 8192  # the square matmul `calibrate --backend nccl` times: its sweep's last size, < 50 ms


def fit_gpu_profile(measurements: dict, name: str = "gpu-calibrated") -> HardwareProfile:
    """The profile of a GPU node from ``calibrate(backend="nccl")`` measurements.

    The measured link replaces the preset's tier inside a node (between nodes stays the
    preset's; a one-GPU machine keeps both); memory size and the streaming bandwidth are the
    device's (a measured copy: its streaming share is 1). Peak FLOP/s stay the datasheet's: each
    measured large-matmul rate sets that dtype's best GEMM efficiency, so the shape-derived curve
    (:func:`autopar.passes.cost.efficiency.gemm_efficiency`) passes through the measurement at
    the measured shape, and the tile's fill along k is fitted to the measured GEMM grid
    (:func:`fit_k_fill`); measured attention replaces the preset's table. Other dtypes and the
    tiles keep the preset's figures.
    """
    base = gpu_preset(measurements.get("device_name", ""))
    collectives = measurements["collectives"]
    link = fit_link(collectives, base.links[0].name, base.links[0]) if collectives else base.links[0]
    size = measurements.get("matmul_size", MEASURED_MATMUL_SIZE)
    measured = {dtype: float(rate) for dtype, rate in measurements["matmul"].items()}
    profile = replace(
        _compute_through(base, measured, size),
        memory_bytes=float(measurements.get("memory_bytes", base.memory_bytes)),
        memory_bandwidth=float(measurements["memory_bandwidth"]),
    )
    if measurements.get("gemms"):
        k_fill, _ = fit_k_fill(profile, measured, size, measurements["gemms"])
        profile = _compute_through(replace(profile, kernels=replace(profile.kernels, k_fill=k_fill)), measured, size)
    if measurements.get("attention"):
        attention = attention_table(measurements["attention"])
        profile = replace(profile, kernels=replace(profile.kernels, attention=attention))
    if measurements.get("casts"):  # streaming kernels reach the measured copy's rate (memory efficiency 1)
        widening = measurements["casts"]["widening"] / profile.memory_bandwidth
        profile = replace(profile, kernels=replace(profile.kernels, widening_efficiency=widening))
    ranks = sorted({r["ranks"] for r in collectives})
    links = f"collectives on NCCL over {', '.join(map(str, ranks))} GPUs, alpha-beta fitted per kind and group size"
    gemms = len(measurements.get("gemms", ()))
    return replace(
        profile,
        name=name,
        description=(
            f"measured by `autopar calibrate --backend nccl` at {measurements.get('measured_at', '?')} on "
            f"{measurements.get('host', 'this machine')}: GEMM efficiency through the achieved {size}^3 matmul "
            + (f"rates with the fill along k fitted to {gemms} bfloat16 GEMM shapes" if gemms else "rates")
            + (", attention measured" if measurements.get("attention") else "")
            + (", eager widening casts measured" if measurements.get("casts") else "")
            + f", memory bandwidth one device copy, {links if collectives else 'one GPU: every link'} "
            f"from {base.name}; between nodes, overlap, op overhead and tiles from {base.name}"
        ),
        links=(link, *base.links[1:]),
        extra={**_fit_extras(base, measurements, link), "matmul": measured},
    )


K_FILL_CANDIDATES = tuple(range(0, 1025, 8))


def gemm_errors(profile: HardwareProfile, gemms: list[dict]) -> list[float]:
    """Relative error of :func:`~autopar.passes.cost.efficiency.gemm_seconds` on each measured GEMM."""
    return [
        gemm_seconds(g["m"], g["n"], g["k"], g["dtype"], _ITEMSIZE[g["dtype"]], profile, g["batch"]) / g["seconds"] - 1
        for g in gemms
    ]


def fit_k_fill(profile: HardwareProfile, measured: dict[str, float], size: int, gemms: list[dict]) -> tuple[int, float]:
    """The tile's fill along k (and the median absolute relative error it leaves) that best
    predicts the measured GEMMs, the best efficiency moved with it through the ``size``³ rates."""

    def error(k_fill: int) -> float:
        candidate = _compute_through(replace(profile, kernels=replace(profile.kernels, k_fill=k_fill)), measured, size)
        return float(np.median(np.abs(gemm_errors(candidate, gemms))))

    k_fill = min(K_FILL_CANDIDATES, key=error)
    return k_fill, error(k_fill)


def attention_table(records: list[dict]) -> dict[str, dict[int, dict[int, float]]]:
    """Measured attention records as KernelFigures.attention: mask → head size → sequence → FLOP/s."""
    table: dict[str, dict[int, dict[int, float]]] = {}
    for r in records:
        table.setdefault("causal" if r["causal"] else "full", {}).setdefault(r["head_dim"], {})[r["seq"]] = float(
            r["flops_per_s"]
        )
    return table


def _compute_through(base: HardwareProfile, measured: dict[str, float], size: int) -> HardwareProfile:
    """``base`` with its compute figures moved through the matmul rates measured at ``size``³.

    With kernel figures: each measured dtype's best GEMM efficiency, at the datasheet peak.
    Without (V100): the measured rates become the peaks, and the one efficiency keeps the
    preset's factor against its datasheet bfloat16 (or float32) rate.
    """
    if base.kernels is None:
        reference = "bfloat16" if "bfloat16" in measured and "bfloat16" in base.peak_flops else "float32"
        factor = min(1.0, base.compute_efficiency * base.peak_flops[reference] / measured[reference])
        return replace(base, peak_flops=measured, compute_efficiency=factor)
    best = dict(base.kernels.gemm_best)
    for dtype, rate in measured.items():
        if dtype in base.peak_flops:
            best[dtype] = rate / (base.peak_flops[dtype] * shape_factor(size, size, size, base.kernels))
    return replace(base, kernels=replace(base.kernels, gemm_best=best, memory_efficiency=1.0))
