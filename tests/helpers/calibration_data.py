"""Synthetic calibration measurements: what ``autopar calibrate`` would record on machines that
follow the cost model's own formulas exactly (with noise), for the fitting tests."""

from __future__ import annotations

import numpy as np

from autopar.ir import LinkTier
from autopar.passes.cost.collectives import collective_time
from autopar.runtime.measure import KINDS, SIZES_BYTES
from autopar.runtime.measure_gpu import GPU_SIZES_BYTES

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
            sync.append(
                {
                    "job_ranks": job_ranks,
                    "ranks": ranks,
                    "nbytes": 2**18,
                    "burst_s": burst_s,
                    "in_step_s": in_step * rng.uniform(1 - noise, 1 + noise),
                }
            )
    alone = {"matmul_s": 0.012, "elementwise_s": 0.012}  # one pass of the op mix on one rank
    contention = [{"ranks": 1, **alone, "mix_s": 0.024}] + [  # every rank slowed by the same factor, ±noise
        {
            "ranks": ranks,
            **{key: seconds * factor * rng.uniform(1 - noise, 1 + noise) for key, seconds in alone.items()},
        }
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
            {
                "kind": kind,
                "ranks": ranks,
                "nbytes": nbytes,
                "seconds": collective_time(kind, nbytes, ranks, link) * rng.uniform(1 - noise, 1 + noise),
            }
            for kind in KINDS
            for nbytes in GPU_SIZES_BYTES
        ]
    return {
        "backend": "nccl",
        "matmul": GPU_MATMUL,
        "memory_bandwidth": 3.0e12,
        "contention": [],
        "collectives": records,
        "sync": [],
        "cores": 0,
        "device_name": "NVIDIA H100 80GB HBM3",
        "memory_bytes": 85e9,
        "measured_at": "2026-01-01T00:00:00+00:00",
        "host": "test",
        "threads_per_rank": 1,
        "quick": False,
        "seconds": 1.0,
    }
