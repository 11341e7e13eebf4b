"""Hardware profiles: what one device computes and how fast its links move bytes.

A mesh's innermost axis runs over the fastest tier (inside a node); every outer axis
crosses the next tier. The cost model reads nothing else about the machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autopar.ir.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class LinkTier:
    """One tier of interconnect: per-step latency ``alpha_s`` and bus bandwidth in bytes/s.

    ``fitted`` overrides both per collective kind and group size where they were measured
    (``{"all_gather": {4: (alpha_s, bandwidth)}}``); the nearest measured size is used.
    """

    name: str
    alpha_s: float
    bandwidth: float
    fitted: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    sync_s: float = 0.0  # fixed cost of each blocking collective in a step: waiting for the slowest rank
    sync_by_ranks: dict[int, float] = field(default_factory=dict)  # sync_s measured per number of ranks on the host
    inner: LinkTier | None = None  # the tier inside a node, when a group spans nodes with several members in each
    local_ranks: int = 1  # members of the group inside one node

    def alpha_beta(self, kind: str, ranks: int) -> tuple[float, float]:
        """(alpha seconds per step, bus bandwidth bytes/s) of one collective kind over ``ranks``."""
        by_size = self.fitted.get(kind)
        if not by_size:
            return self.alpha_s, self.bandwidth
        nearest = min(by_size, key=lambda size: (abs(size - ranks), size))
        return by_size[nearest]


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: dict[str, float]  # dtype name → FLOP/s of one device
    compute_efficiency: float  # achieved fraction of peak on large matmuls
    memory_bytes: float
    memory_bandwidth: float  # bytes/s, for memory-bound ops
    links: tuple[LinkTier, ...]  # innermost tier first
    description: str = ""
    overlap: float = 0.0  # fraction of gradient all-reduce hidden behind backward
    op_overhead_s: float = 0.0  # fixed cost of launching one op
    cores_per_host: int = 0  # CPU processes share this many cores; 0: every device computes on its own
    measure_ops: bool = False  # this profile is the planning machine: time ops on it instead of the roofline
    contention_by_ranks: dict[int, float] = field(
        default_factory=dict
    )  # measured compute slowdown per ranks on the host
    extra: dict = field(default_factory=dict)
    precision: str = "fp32"  # what training on this device naturally runs in (an autopar.ir.Precision)

    def flops_per_s(self, dtype: str = "float32") -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) * self.compute_efficiency

    def ranks_per_host(self, mesh_shape: tuple[int, ...]) -> int:
        """Ranks that share one host: the whole mesh on a one-tier machine, else a node."""
        return math.prod(mesh_shape) if len(self.links) == 1 else mesh_shape[-1]

    def contention(self, mesh_shape: tuple[int, ...]) -> float:
        """How much slower each rank computes because ranks on one host share its cores.

        The slowdown ``autopar calibrate`` measured for this many ranks where it did
        (``contention_by_ranks``), else ranks per core, at least 1.

        >>> profile = dataclasses.replace(get_profile("cpu-local"), cores_per_host=2)
        >>> profile.contention((4,)), dataclasses.replace(profile, contention_by_ranks={4: 2.6}).contention((4,))
        (2.0, 2.6)
        """
        ranks = self.ranks_per_host(mesh_shape)
        if ranks in self.contention_by_ranks:
            return self.contention_by_ranks[ranks]
        if not self.cores_per_host:
            return 1.0
        return max(1.0, ranks / self.cores_per_host)

    def link(self, mesh_shape: tuple[int, ...], axis_span: int, group_size: int = 1) -> LinkTier:
        """The tier a collective over ``group_size`` ranks spread evenly over the
        ``axis_span`` innermost devices crosses (a node is the mesh's innermost dimension).

        A group across nodes with several members in each runs hierarchically: it carries
        the inner tier and how many members share a node. Ranks that share cores arrive at
        a collective with more skew: the wait is the one measured for this many ranks on the
        host (``sync_by_ranks``), else ``sync_s`` per unit of contention."""
        node = mesh_shape[-1]
        inside_node = axis_span <= node
        link = self.links[0] if inside_node or len(self.links) == 1 else self.links[1]
        if not inside_node and len(self.links) > 1:
            stride = max(1, axis_span // max(1, group_size))
            link = dataclasses.replace(link, inner=self.links[0], local_ranks=max(1, node // stride))
        measured = link.sync_by_ranks.get(self.ranks_per_host(mesh_shape))
        return dataclasses.replace(
            link, sync_s=measured if measured is not None else link.sync_s * self.contention(mesh_shape)
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["links"] = [
            {
                **asdict(link),
                "fitted": {kind: {str(n): list(ab) for n, ab in sizes.items()} for kind, sizes in link.fitted.items()},
                "sync_by_ranks": {str(n): seconds for n, seconds in link.sync_by_ranks.items()},
            }
            for link in self.links
        ]
        data["contention_by_ranks"] = {str(n): factor for n, factor in self.contention_by_ranks.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        links = tuple(
            LinkTier(
                name=link["name"],
                alpha_s=link["alpha_s"],
                bandwidth=link["bandwidth"],
                fitted={
                    kind: {int(n): tuple(ab) for n, ab in sizes.items()}
                    for kind, sizes in link.get("fitted", {}).items()
                },
                sync_s=link.get("sync_s", 0.0),
                sync_by_ranks={int(n): seconds for n, seconds in link.get("sync_by_ranks", {}).items()},
            )
            for link in data["links"]
        )
        contention = {
            int(n): factor for n, factor in data.get("contention_by_ranks", {}).items()
        }  # JSON keys are strings
        return cls(**{**data, "links": links, "contention_by_ranks": contention})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"cannot read hardware profile {path}: {error}; re-run `autopar calibrate`") from error


GB = 1e9
GIB = 1024**3

PROFILES: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in [
        HardwareProfile(
            name="cpu-local",
            description=(
                "this machine: one CPU process (one thread) per rank, gloo over loopback; rates from "
                "`autopar calibrate` on 2026-11-22 (fp32 matmul 92 GFLOP/s, copy 25 GB/s, 2-rank "
                "all-reduce alpha 197 us, 1.4 GB/s, 0.75 ms rendezvous per blocking collective); ops are timed "
                "on this machine when planning; run it again for this machine's current figures"
            ),
            peak_flops={"float32": 92e9, "bfloat16": 200e9},
            compute_efficiency=0.8,
            memory_bytes=4 * GIB,
            memory_bandwidth=25 * GB,
            links=(LinkTier("loopback", 200e-6, 1.4 * GB, sync_s=0.75e-3),),
            op_overhead_s=15e-6,
            cores_per_host=os.cpu_count() or 1,
            measure_ops=True,
        ),
        HardwareProfile(
            name="v100-16gb",
            precision="fp16-mixed",
            description="AWS p3.16xlarge: 8x V100 16GB SXM2 on NVLink (hybrid cube mesh), "
            "25 Gb/s Ethernet between nodes",
            peak_flops={"float32": 15.7e12, "float16": 125e12, "bfloat16": 15.7e12},
            compute_efficiency=0.5,
            memory_bytes=16 * GIB,
            memory_bandwidth=0.9e12,
            links=(LinkTier("nvlink2", 10e-6, 130 * GB), LinkTier("ethernet-25g", 50e-6, 3.1 * GB)),
            overlap=0.5,
            op_overhead_s=6e-6,
        ),
        HardwareProfile(
            name="a100-80gb",
            precision="bf16-mixed",
            description=(
                "DGX A100 80GB SXM: NVSwitch inside a node, 8x200 Gb/s HDR InfiniBand between nodes; compute "
                "efficiency 0.5, one factor for every op, set once against Megatron-LM's published GPT runs "
                "(benchmarks/published.py)"
            ),
            peak_flops={"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
            compute_efficiency=0.5,
            memory_bytes=80 * GIB,
            memory_bandwidth=2.0e12,
            links=(LinkTier("nvswitch", 10e-6, 230 * GB), LinkTier("hdr-ib", 20e-6, 192 * GB)),
            overlap=0.5,
            op_overhead_s=5e-6,
        ),
        HardwareProfile(
            name="h100-80gb",
            precision="bf16-mixed",
            description="DGX H100 SXM: NVLink4 inside a node, 8x400 Gb/s NDR InfiniBand between nodes",
            peak_flops={"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12},
            compute_efficiency=0.55,
            memory_bytes=80 * GIB,
            memory_bandwidth=3.35e12,
            links=(LinkTier("nvlink4", 8e-6, 370 * GB), LinkTier("ndr-ib", 15e-6, 380 * GB)),
            overlap=0.5,
            op_overhead_s=4e-6,
        ),
        HardwareProfile(
            name="h200-141gb",
            precision="bf16-mixed",
            description="8x H200 SXM: NVLink4 inside a node, 8x400 Gb/s NDR InfiniBand between nodes",
            peak_flops={"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12},
            compute_efficiency=0.55,
            memory_bytes=141e9,
            memory_bandwidth=4.8e12,
            links=(LinkTier("nvlink4", 8e-6, 475 * GB), LinkTier("ndr-ib", 15e-6, 380 * GB)),
            overlap=0.5,
            op_overhead_s=4e-6,
        ),
    ]
}

DEFAULT_PROFILE = "cpu-local"


def get_profile(name: str | HardwareProfile | None) -> HardwareProfile:
    """Look a profile up by name or JSON file path (``None`` → this machine's preset)."""
    if isinstance(name, HardwareProfile):
        return name
    if name and name.endswith(".json"):
        return HardwareProfile.load(name)
    name = name or DEFAULT_PROFILE
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware profile {name!r}: choose one of {sorted(PROFILES)}") from None
