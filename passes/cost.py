"""Cost model, first version: roofline compute, alpha-beta collectives, memory by category.

Every function returns seconds or bytes for ONE device. Backward work is taken as twice the
forward for matrix products and once for memory-bound ops (a calibrated per-op backward
comes with the cost-model issue).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_map

from autopar.ir import HardwareProfile, LinkTier, Partial, Placement, Replicate, Shard

# Bytes per parameter element for Adam(W): weight, gradient, optimizer state. fp32 keeps two
# moments; mixed precision (ZeRO paper's K=12) keeps an fp32 master copy and two moments.
STATE_BYTES = {
    "fp32": {"params": 4, "grads": 4, "optimizer": 8},
    "mixed": {"params": 2, "grads": 2, "optimizer": 12},
}
PARAM_STATE_BYTES = STATE_BYTES["fp32"]


def model_state_bytes(params: float, *, data_parallel: int = 1, zero_stage: int = 0, precision: str = "fp32") -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state (ZeRO paper, Rajbhandari et al.).

    Stage 1 shards the optimizer state over the data-parallel ranks, stage 2 the gradients
    too, stage 3 the weights too. Mixed precision, 7.5e9 parameters, 64 ranks:
    120 / 31.4 / 16.6 / 1.88 GB for stages 0-3.
    """
    per = STATE_BYTES[precision]
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}[zero_stage]
    return {kind: params * nbytes / (data_parallel if kind in sharded else 1) for kind, nbytes in per.items()}


def collective_time(kind: str, nbytes: float, ranks: int, link: LinkTier) -> float:
    """Ring/pairwise alpha-beta time of one collective over ``ranks`` (``nbytes`` = full tensor).

    ``send_recv`` is one point-to-point message of ``nbytes`` (a pipeline boundary).
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    alpha, bandwidth = link.alpha_beta(kind, ranks)
    steps = ranks - 1
    share = steps / ranks * nbytes / bandwidth
    if kind == "all_reduce":
        return 2 * steps * alpha + 2 * share
    if kind in ("all_gather", "reduce_scatter"):
        return steps * alpha + share
    if kind == "all_to_all":  # each rank holds nbytes/ranks and keeps 1/ranks of it
        return steps * alpha + share / ranks
    if kind == "send_recv":  # one message of nbytes between two ranks
        return alpha + nbytes / bandwidth
    raise ValueError(f"unknown collective {kind}")


GRAD_BUCKET_BYTES = 25 * 2**20


def grad_sync_time(nbytes: float, ranks: int, link: LinkTier, bucket_bytes: float = GRAD_BUCKET_BYTES) -> float:
    """Share of a bucketed gradient all-reduce one tensor of ``nbytes`` costs: latency is paid per bucket."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    alpha, bandwidth = link.alpha_beta("all_reduce", ranks)
    latency = 2 * (ranks - 1) * alpha * min(1.0, nbytes / bucket_bytes)
    return latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def reshard_time(src: Placement, dst: Placement, nbytes: float, ranks: int, link: LinkTier, needs_grad: bool) -> float:
    """Forward plus (when a gradient flows back) backward time of one redistribution.

    ``nbytes`` is the size of the tensor on this axis before sharding by it.
    """
    if src == dst or ranks <= 1:
        return 0.0
    gather = collective_time("all_gather", nbytes, ranks, link)
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):  # take a chunk; backward all-gathers
            return gather if needs_grad else 0.0
        if isinstance(dst, Partial) and dst.reduce_op == "sum":
            return 0.0  # R → P keeps the value on one rank; backward is identity
        return float("inf")
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return gather  # backward takes a chunk
        if isinstance(dst, Shard):
            return collective_time("all_to_all", nbytes, ranks, link) * (2 if needs_grad else 1)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return collective_time("all_reduce", nbytes, ranks, link)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return collective_time("reduce_scatter", nbytes, ranks, link) + (gather if needs_grad else 0.0)
    return float("inf")  # S → P, P(sum) ↔ P(avg): never chosen


def can_reshard(src: Placement, dst: Placement) -> bool:
    return reshard_time(src, dst, 1.0, 2, LinkTier("x", 0, 1), True) != float("inf")


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of one node, counted by running it on its fake inputs."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    args, kwargs = tree_map(_fake_value, (node.args, node.kwargs))
    fake_mode = detect_fake_mode(tuple(a for a in tree_map_flat(args) if isinstance(a, torch.Tensor)))
    if fake_mode is None:
        return 0.0
    counter = FlopCounterMode(display=False)
    with fake_mode, counter:
        node.target(*args, **kwargs)
    return float(counter.get_total_flops())


def tree_map_flat(tree):
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def _fake_value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_bytes(node: fx.Node) -> float:
    """Bytes the node reads and writes (what a memory-bound op costs)."""
    total = 0
    for value in tree_map_flat((tree_map(_fake_value, (node.args, node.kwargs)), node.meta.get("val"))):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return float(total)


def compute_time(flops: float, nbytes: float, hardware: HardwareProfile, dtype: str = "float32") -> float:
    """Forward + backward roofline time of one op on one device, with launch overhead."""
    matmul_time = 3 * flops / hardware.flops_per_s(dtype)
    memory_time = 2 * nbytes / hardware.memory_bandwidth
    return max(matmul_time, memory_time) + 2 * hardware.op_overhead_s
