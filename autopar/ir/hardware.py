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
from autopar.ir.links import (
    AMPERE_NET,
    AMPERE_NVLINK,
    GB,
    HOPPER_NET,
    HOPPER_NVLINK,
    VOLTA_NET,
    VOLTA_NVLINK,
    LinkTier,
    Protocol,
)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class KernelFigures:
    """What a GPU's kernel libraries achieve, read by the shape-derived efficiency rules
    (``passes/cost/efficiency.py``): GEMMs by tiles and waves, attention by sequence and head size.

    >>> get_profile("h100-80gb").kernels.sms
    132
    """

    sms: int  # streaming multiprocessors: each runs one output tile of a GEMM per wave
    tiles: tuple[tuple[int, int], ...]  # output tiles (rows, columns) the GEMM library picks among
    gemm_best: dict[str, float]  # dtype → fraction of ``peak_flops`` a well-shaped GEMM reaches (MAMF)
    k_fill: int  # k a tile's prologue and epilogue cost, in main-loop steps along k
    memory_efficiency: float  # fraction of ``memory_bandwidth`` streaming (elementwise) kernels reach
    attention: dict[str, dict[int, dict[int, float]]]  # "causal"/"full" → head dim → sequence → FLOP/s fwd+bwd
    sources: str = ""
    # fraction of ``memory_bandwidth`` an eager widening cast (16-bit floats to float32: a gradient's
    # way back to its fp32 master, a model's fp32 logits) reaches: torch runs it as an unrolled loop
    # with a cast per element, not the vectorized kernel of the narrowing cast; None: as streaming kernels
    widening_efficiency: float | None = None

    def to_json(self) -> dict:
        data = asdict(self)
        data["attention"] = {
            mask: {str(d): {str(s): rate for s, rate in by_seq.items()} for d, by_seq in by_dim.items()}
            for mask, by_dim in self.attention.items()
        }
        return data

    @classmethod
    def from_json(cls, data: dict) -> KernelFigures:
        attention = {
            mask: {int(d): {int(s): rate for s, rate in by_seq.items()} for d, by_seq in by_dim.items()}
            for mask, by_dim in data["attention"].items()
        }
        return cls(**{**data, "tiles": tuple(tuple(tile) for tile in data["tiles"]), "attention": attention})


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: dict[str, float]  # dtype name → FLOP/s of one device
    compute_efficiency: float  # fraction of peak ops reach (with ``kernels``: ops other than GEMMs and attention)
    memory_bytes: float
    memory_bandwidth: float  # bytes/s, for memory-bound ops
    links: tuple[LinkTier, ...]  # innermost tier first
    description: str = ""
    # share of gradient sync that runs behind backward (at most the last microbatch's); in a compiled
    # step's replay, the share of what its schedule puts behind compute that really hides there
    overlap: float = 0.0
    op_overhead_s: float = 0.0  # fixed cost of launching one op
    cores_per_host: int = 0  # CPU processes share this many cores; 0: every device computes on its own
    measure_ops: bool = False  # this profile is the planning machine: time ops on it instead of the roofline
    contention_by_ranks: dict[int, float] = field(
        default_factory=dict
    )  # measured compute slowdown per ranks on the host
    extra: dict = field(default_factory=dict)
    precision: str = "fp32"  # what training on this device naturally runs in (an autopar.ir.Precision)
    kernels: KernelFigures | None = None  # GEMM and attention figures; None: one efficiency for every op
    tp_overlap: float = 0.0  # share of tensor-parallel collectives the stack hides behind GEMMs (overlap.py)
    p2p_overlap: bool = False  # pipeline sends of the steady state run behind compute (only fill and drain wait)
    grad_bucket_bytes: float = 0.0  # the stack's gradient-sync bucket; 0: autopar's runtime's (autopar.ir.buckets)
    zero3_per_parameter: bool = False  # ZeRO-3 gathers each parameter on its own, not a layer's at once
    # each ZeRO-3 collective takes or returns one tensor per rank (torch's list all_gather and reduce_scatter,
    # before all_gather_into_tensor), which torch's NCCL process group copies to or from a flat buffer one
    # launch (``op_overhead_s``) per rank: a cost that grows with the group (passes/cost/zero_traffic.py)
    zero3_copies_per_rank: bool = False
    zero3_persist_elements: float = 0  # ZeRO-3 keeps parameters of fewer elements whole on every rank
    # ZeRO-3 releases a gathered parameter after each use unless the parameters used before its next
    # use number fewer than this (DeepSpeed's stage3_max_reuse_distance): a fully recomputed forward
    # then gathers again (passes/cost/zero_traffic.py); 0: autopar's runtime, which as FSDP gathers
    # a layer once for its recomputed forward and backward
    zero3_reuse_elements: float = 0
    zero1_reduce_scatter: bool = False  # ZeRO-1 reduce-scatters gradients; autopar's all-reduces them whole
    # ZeRO-1/2's gather of the stepped weights runs behind the next step's first forward (Megatron's
    # --overlap-param-gather); autopar's runtime gathers right after the optimizer, nothing to hide behind
    param_gather_overlap: bool = False
    # ZeRO-1/2's gathered weights land in the parameters' own storage (flat buffers the parameters
    # are views of: Megatron-Core, DeepSpeed); autopar's runtime copies them in
    zero_gathers_in_place: bool = False
    # bytes per gradient element each microbatch after a step's first moves to add its weight
    # gradients into the step's; None: autopar's runtime's (passes/cost/ops.py accumulation_s);
    # 0 where the weight-gradient GEMM accumulates in place (Megatron's gradient-accumulation fusion)
    grad_accumulation_bytes: float | None = None
    # how much slower compute runs while a collective runs beside it (0.189: 18.9% slower): on a GPU
    # the collective's kernels take SMs and memory bandwidth from the compute they hide behind
    overlap_slowdown: float = 0.0

    def hidden(self, share: float) -> float:
        """Of communication a stack runs behind compute (``share`` of it: ``overlap``,
        ``tp_overlap``), the share that leaves the step: compute beside a collective of ``c``
        seconds runs ``1 + overlap_slowdown`` slower, so the step still pays
        ``c · overlap_slowdown / (1 + overlap_slowdown)`` of it.

        >>> round(HardwareProfile("gpu", {}, 1.0, 0, 0, (), overlap_slowdown=0.25).hidden(1.0), 3)
        0.8
        """
        return share / (1.0 + self.overlap_slowdown)

    def flops_per_s(self, dtype: str = "float32") -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) * self.compute_efficiency

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s an elementwise (memory-bound) kernel moves: the share of ``memory_bandwidth``
        the kernel figures give, all of it without them (a measured CPU copy rate)."""
        return self.memory_bandwidth * (self.kernels.memory_efficiency if self.kernels else 1.0)

    @property
    def widening_bandwidth(self) -> float:
        """Bytes/s an eager widening cast moves (:attr:`KernelFigures.widening_efficiency`)."""
        widening = self.kernels.widening_efficiency if self.kernels else None
        return self.streaming_bandwidth if widening is None else self.memory_bandwidth * widening

    def running(self, compiled: bool) -> HardwareProfile:
        """The profile as a program runs on it: a compiled program's casts are inductor's kernels,
        vectorized (and mostly fused into their neighbours), so its widening casts stream as the rest."""
        if not compiled or self.kernels is None or self.kernels.widening_efficiency is None:
            return self
        return dataclasses.replace(self, kernels=dataclasses.replace(self.kernels, widening_efficiency=None))

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

        A group across nodes with several members in each carries the inner tier and how many
        members share a node (``passes/cost/ops.py`` prices an all-reduce inside the node, then
        across, then inside again; an all-gather or reduce-scatter as one ring over every rank).
        Ranks that share cores arrive at a collective with more skew: the wait is the one
        measured for this many ranks on the host (``sync_by_ranks``), else ``sync_s`` per unit
        of contention."""
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
        data["kernels"] = self.kernels.to_json() if self.kernels else None
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
                protocols=tuple(Protocol(**protocol) for protocol in link.get("protocols", ())),
            )
            for link in data["links"]
        )
        contention = {
            int(n): factor for n, factor in data.get("contention_by_ranks", {}).items()
        }  # JSON keys are strings
        kernels = KernelFigures.from_json(data["kernels"]) if data.get("kernels") else None
        return cls(**{**data, "links": links, "contention_by_ranks": contention, "kernels": kernels})

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


GIB = 1024**3
T = 1e12

# FlashAttention-2 forward + backward, bf16/fp16, FLOP/s in FlashAttention's convention (4·b·s²·h·d
# forward, halved when causal; backward 2.5x): the Dao-AILab/flash-attention README figures
# flash2_a100_fwd_bwd_benchmark.png (batch 16k/s, hidden 2048;
# labels the figures hide are left out).
FA2_A100 = {
    "full": {64: {512: 132 * T, 2048: 162 * T, 4096: 171 * T, 8192: 175 * T, 16384: 176 * T},
             128: {2048: 187 * T, 4096: 196 * T, 8192: 201 * T, 16384: 203 * T}},
    "causal": {64: {512: 88 * T, 1024: 119 * T, 2048: 140 * T, 4096: 156 * T, 8192: 165 * T, 16384: 171 * T},
               128: {512: 99 * T, 1024: 133 * T, 2048: 155 * T, 4096: 173 * T, 8192: 182 * T, 16384: 189 * T}},
}  # fmt: skip
# cuDNN's fused flash attention, forward + backward, bf16, in the same convention and configuration,
# measured by `autopar calibrate --backend nccl` on one H200 (torch 2.11 SDPA picked cuDNN there;
# benchmarks/data/gpu/h200-2026-11-26-calibrated.json). Transformer Engine's default on Hopper, which
# Megatron-Core runs; about 1.5x FlashAttention-2's published H100 rates. The H100 SXM has the H200's
# SMs and clocks, and the kernel is compute-bound at these sizes: its table too.
CUDNN_HOPPER = {
    "full": {64: {512: 303 * T, 1024: 385 * T, 2048: 436 * T, 4096: 458 * T, 8192: 472 * T, 16384: 485 * T},
             128: {512: 378 * T, 1024: 480 * T, 2048: 558 * T, 4096: 594 * T, 8192: 611 * T, 16384: 629 * T}},
    "causal": {64: {512: 189 * T, 1024: 272 * T, 2048: 346 * T, 4096: 399 * T, 8192: 433 * T, 16384: 459 * T},
               128: {512: 241 * T, 1024: 346 * T, 2048: 442 * T, 4096: 512 * T, 8192: 559 * T, 16384: 600 * T}},
}  # fmt: skip
_GEMM_SOURCES = (
    "GEMMs: best fraction of peak from the Maximum Achievable Matmul FLOPS table (stas00/ml-engineering, "
    "compute/accelerator/README.md: A100 SXM bf16 271.2 of 312 TFLOP/s at 1024x10240x5120, H100 SXM 794.5 of "
    "989 at 2048x2048x13312, 'H200 is the same'), divided by the tile, wave and k terms of "
    "passes/cost/efficiency.py at that shape so that the curve passes through the measurement (no fp32 or tf32 "
    "figure is published: the 16-bit one serves); SM counts from NVIDIA's A100 and H100 whitepapers (108, 132); "
    "the 256x128 / 128x256 tiles NVIDIA's Matrix Multiplication Background guide works with (smaller tiles "
    "reuse less of each load: no published figure gives their efficiency, so they are left out); "
    "k_fill 128: two 64-deep k-blocks of prologue and epilogue per tile. Streaming kernels at 0.8 of HBM "
    "bandwidth (DeepGEMM's memory-bound rows reach 2.4-2.7 of 3.35 TB/s on H800). Attention: FlashAttention-2's "
    "published forward + backward figures on A100 (FA2_A100), cuDNN's measured on an H200 for Hopper (CUDNN_HOPPER)."
)
A100_KERNELS = KernelFigures(
    sms=108,
    tiles=((128, 256), (256, 128)),
    gemm_best={"bfloat16": 0.902, "float16": 0.902, "float32": 0.902, "tf32": 0.902},
    k_fill=128,
    memory_efficiency=0.8,
    attention=FA2_A100,
    sources=_GEMM_SOURCES,
)
# Eager widening casts (bfloat16 to float32) on Hopper: 2.11 TB/s measured on an H200 (2^28 elements,
# `autopar calibrate --backend nccl`, 2026-11-30; the narrowing cast 4.37), 0.44 of its 4.8 TB/s. The
# unrolled loop is bound by its per-element work more than by memory: on an H100 the same step's widening
# kernels took 2.44 ms against the H200's 2.25 (benchmarks/data/gpu h100-2026-11-27, h200-2026-11-26),
# where the vectorized cast took 1.53 against 1.09, as their memory bandwidths: 1.94 TB/s, 0.58 of 3.35.
H100_KERNELS = KernelFigures(
    sms=132,
    tiles=((128, 256), (256, 128)),
    gemm_best={"bfloat16": 0.836, "float16": 0.836, "float32": 0.836, "tf32": 0.836},
    k_fill=128,
    memory_efficiency=0.8,
    attention=CUDNN_HOPPER,
    sources=_GEMM_SOURCES + " Eager widening casts: measured (the H200's) and derived (the H100's).",
    widening_efficiency=0.58,
)
H200_KERNELS = dataclasses.replace(H100_KERNELS, widening_efficiency=0.44)

# gloo over loopback on this machine, (alpha s, bus bandwidth B/s) by collective, 2 ranks: `autopar calibrate`,
# 2026-11-25 (one thread per rank, 2 cores). More ranks than cores slow every collective alike: the profile's
# contention rule, not these figures (its 4-rank run measured them oversubscribed).
GLOO_LOOPBACK = {
    "all_reduce": {2: (220e-6, 1.42 * GB)},
    "all_gather": {2: (301e-6, 1.02 * GB)},
    "reduce_scatter": {2: (457e-6, 0.58 * GB)},
    "all_to_all": {2: (234e-6, 1.60 * GB)},
    "send_recv": {2: (120e-6, 3.84 * GB)},
}

# Compute beside a collective on a GPU runs 18.9% slower on average (at most 40%): GPT and LLaMA
# training steps on A100, H100, MI250 and MI210, compute timed alone and beside the collectives it
# hides (Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning: Performance and Power Implications", arXiv 2507.03114, 2025). The collective's kernels
# occupy SMs (NCCL runs one thread block per channel) and draw on the same memory bandwidth.
GPU_OVERLAP_SLOWDOWN = 0.189

PROFILES: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in [
        HardwareProfile(
            name="cpu-local",
            description=(
                "this machine: one CPU process (one thread) per rank, gloo over loopback; rates from "
                "`autopar calibrate` on 2026-11-22 (fp32 matmul 92 GFLOP/s, copy 25 GB/s, 2-rank "
                "all-reduce alpha 197 us, 1.4 GB/s, 0.75 ms rendezvous per blocking collective; each "
                "collective's alpha-beta on 2 ranks from its run of 2026-11-25: gloo's reduce-scatter "
                "moves half as fast as its all-reduce); ops are timed on this machine when planning; run it "
                "again for this machine's current figures"
            ),
            peak_flops={"float32": 92e9, "bfloat16": 200e9},
            compute_efficiency=0.8,
            memory_bytes=4 * GIB,
            memory_bandwidth=25 * GB,
            links=(LinkTier("loopback", 200e-6, 1.4 * GB, fitted=GLOO_LOOPBACK, sync_s=0.75e-3),),
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
            links=(
                LinkTier("nvlink2", 10e-6, 130 * GB, protocols=VOLTA_NVLINK),
                LinkTier("ethernet-25g", 50e-6, 3.1 * GB, protocols=VOLTA_NET),
            ),
            overlap=0.5,
            overlap_slowdown=GPU_OVERLAP_SLOWDOWN,
            op_overhead_s=6e-6,
        ),
        HardwareProfile(
            name="a100-80gb",
            precision="bf16-mixed",
            description=(
                "DGX A100 80GB SXM: NVSwitch inside a node (all-reduce bus bandwidth 230 GB/s), one 200 Gb/s HDR "
                "InfiniBand adapter per GPU between nodes (25 GB/s); GEMM and attention efficiency from their shapes "
                "(kernels), other ops at 0.87 of peak"
            ),
            peak_flops={"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
            compute_efficiency=0.87,
            memory_bytes=80 * GIB,
            memory_bandwidth=2.0e12,
            links=(
                LinkTier("nvswitch", 10e-6, 230 * GB, protocols=AMPERE_NVLINK),
                LinkTier("hdr-ib", 20e-6, 25 * GB, protocols=AMPERE_NET),
            ),
            overlap=1.0,
            overlap_slowdown=GPU_OVERLAP_SLOWDOWN,
            op_overhead_s=5e-6,
            kernels=A100_KERNELS,
        ),
        HardwareProfile(
            name="h100-80gb",
            precision="bf16-mixed",
            description=(
                "DGX H100 SXM: NVLink4 inside a node (all-reduce bus bandwidth 370 GB/s), one 400 Gb/s NDR "
                "InfiniBand adapter per GPU between nodes (50 GB/s); GEMM and attention efficiency from their "
                "shapes (kernels), other ops at 0.80 of peak"
            ),
            peak_flops={"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12},
            compute_efficiency=0.80,
            memory_bytes=80 * GIB,
            memory_bandwidth=3.35e12,
            links=(
                LinkTier("nvlink4", 8e-6, 370 * GB, protocols=HOPPER_NVLINK),
                LinkTier("ndr-ib", 15e-6, 50 * GB, protocols=HOPPER_NET),
            ),
            overlap=1.0,
            overlap_slowdown=GPU_OVERLAP_SLOWDOWN,
            op_overhead_s=4e-6,
            kernels=H100_KERNELS,
        ),
        HardwareProfile(
            name="h200-141gb",
            precision="bf16-mixed",
            description=(
                "8x H200 SXM: NVLink4 inside a node (NVLS all-reduce bus bandwidth 475 GB/s), one 400 Gb/s NDR "
                "InfiniBand adapter per GPU between nodes (50 GB/s); the H100's compute and kernel figures "
                "but its own eager widening casts"
            ),
            peak_flops={"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12},
            compute_efficiency=0.80,
            memory_bytes=141e9,
            memory_bandwidth=4.8e12,
            links=(
                LinkTier("nvlink4", 8e-6, 475 * GB, protocols=HOPPER_NVLINK),
                LinkTier("ndr-ib", 15e-6, 50 * GB, protocols=HOPPER_NET),
            ),
            overlap=1.0,
            overlap_slowdown=GPU_OVERLAP_SLOWDOWN,
            op_overhead_s=4e-6,
            kernels=H200_KERNELS,
        ),
    ]
}
# Jean Zay's A100 partition, where BLOOM trained (Le Scao et al. 2022, §3.4.1; bigscience tr11 README):
# the DGX A100's GPUs inside a node, four 100 Gb/s Omni-Path links per node of eight between nodes
PROFILES["a100-80gb-opa"] = dataclasses.replace(
    PROFILES["a100-80gb"],
    name="a100-80gb-opa",
    description=(
        "8x A100 80GB SXM per node (Jean Zay): NVLink inside a node as the DGX A100's, four 100 Gb/s Omni-Path "
        "links per node between nodes (6.25 GB/s per GPU); the A100's compute and kernel figures"
    ),
    links=(PROFILES["a100-80gb"].links[0], LinkTier("omni-path", 20e-6, 6.25 * GB, protocols=AMPERE_NET)),
)

# DGX A100 40GB: the 80GB's chip, node and network (NVIDIA A100 datasheet: the same 312 TFLOP/s bf16,
# NVLink 600 GB/s; DGX A100 user guide: eight 200 Gb/s HDR adapters), HBM2 of 40 GB at 1,555 GB/s
PROFILES["a100-40gb"] = dataclasses.replace(
    PROFILES["a100-80gb"],
    name="a100-40gb",
    description=(
        "DGX A100 40GB SXM: the A100 80GB's compute, kernel figures, NVSwitch and 200 Gb/s HDR InfiniBand per GPU, "
        "with 40 GB of HBM2 at 1,555 GB/s"
    ),
    memory_bytes=40 * GIB,
    memory_bandwidth=1.555e12,
)

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
