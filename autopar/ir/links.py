"""Interconnect tiers: per-step latency and bus bandwidth, and NCCL's ring protocols where a
tier runs NCCL (:class:`LinkTier`, :class:`Protocol`); the cost model's collectives read them
(``passes/cost/collectives.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Protocol:
    """One of NCCL's ring protocols on a link tier, as NCCL's tuning model prices it: a ring
    collective of ``hops`` steps waits ``base_s + hops * hop_s`` and moves its bytes at the tier's
    bus bandwidth times ``share``, at most ``cap`` bytes/s (0: no cap)."""

    name: str
    base_s: float
    hop_s: float
    share: float = 1.0
    cap: float = 0.0

    def bandwidth(self, bus: float) -> float:
        return min(bus * self.share, self.cap) if self.cap else bus * self.share


def nccl_ring_protocols(tier: str, ll_cap: float) -> tuple[Protocol, ...]:
    """NCCL's ring protocols on NVLink (``tier="nvlink"``) or a network (``"net"``), by its tuning
    model's defaults (NVIDIA/nccl src/graph/tuning.cc): base latencies LL 6.6, LL128 14.0, Simple
    8.4 us; per step on NVLink 0.6, 1.9, 3.4 us, over a network 2.7, 4.0, 14.0 us; LL at half
    the bus bandwidth up to the architecture's LL ceiling (``ll_cap``: Volta 39, Ampere 87.7,
    Hopper 141 GB/s), LL128 at 0.92 of it. NCCL picks per call the protocol that finishes first:
    LL's flags make small messages cheap (an 8-GPU all-reduce of a few bytes: 15 us, not
    14 steps of a large message's latency)."""
    hops = {"nvlink": (0.6e-6, 1.9e-6, 3.4e-6), "net": (2.7e-6, 4.0e-6, 14.0e-6)}[tier]
    return (
        Protocol("LL", 6.6e-6, hops[0], 0.5, ll_cap),
        Protocol("LL128", 14.0e-6, hops[1], 0.92),
        Protocol("Simple", 8.4e-6, hops[2]),
    )


@dataclass(frozen=True)
class LinkTier:
    """One tier of interconnect: per-step latency ``alpha_s`` and bus bandwidth in bytes/s.

    ``fitted`` overrides both per collective kind and group size where they were measured
    (``{"all_gather": {4: (alpha_s, bandwidth)}}``); the nearest measured size is used. A tier
    with ``protocols`` (NCCL's) prices its ring collectives (all-reduce, all-gather,
    reduce-scatter) by the fastest of them where nothing was measured.
    """

    name: str
    alpha_s: float
    bandwidth: float
    fitted: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    sync_s: float = 0.0  # fixed cost of each blocking collective in a step: waiting for the slowest rank
    sync_by_ranks: dict[int, float] = field(default_factory=dict)  # sync_s measured per number of ranks on the host
    inner: LinkTier | None = None  # the tier inside a node, when a group spans nodes with several members in each
    local_ranks: int = 1  # members of the group inside one node
    protocols: tuple[Protocol, ...] = ()

    def alpha_beta(self, kind: str, ranks: int) -> tuple[float, float]:
        """(alpha seconds per step, bus bandwidth bytes/s) of one collective kind over ``ranks``."""
        by_size = self.fitted.get(kind)
        if not by_size:
            return self.alpha_s, self.bandwidth
        nearest = min(by_size, key=lambda size: (abs(size - ranks), size))
        return by_size[nearest]


VOLTA_NVLINK, VOLTA_NET = nccl_ring_protocols("nvlink", 39.0 * GB), nccl_ring_protocols("net", 39.0 * GB)
AMPERE_NVLINK, AMPERE_NET = nccl_ring_protocols("nvlink", 87.7 * GB), nccl_ring_protocols("net", 87.7 * GB)
HOPPER_NVLINK, HOPPER_NET = nccl_ring_protocols("nvlink", 141.0 * GB), nccl_ring_protocols("net", 141.0 * GB)
