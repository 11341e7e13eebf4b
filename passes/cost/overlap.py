"""How much communication a step hides behind compute: one rule per kind of traffic.

- Tensor parallelism (:func:`exposed_tp_comm`): the stack hides a share ``tp_overlap`` of the
  tensor-parallel collectives behind the layer's GEMMs, never more than the GEMMs' own time.
  Megatron-LM overlaps each backward all-reduce of an input gradient with the weight-gradient
  GEMM (Korthikanti et al. 2022, §6.2: half the collectives, the backward ones); Megatron-Core's
  ``tp_comm_overlap`` (Transformer Engine userbuffers) splits every all-gather and reduce-scatter
  into chunks pipelined with their GEMM, exposing about one chunk of the four of each pipelined
  reduce-scatter (NVIDIA Megatron-Bridge performance guide, "Communication Overlaps and Tuning").
  The stack's share is a profile field (``HardwareProfile.tp_overlap``), 0 for autopar's runtime.
- Data parallelism (:func:`exposed_grad_sync`): buckets of gradients are reduced as backward
  produces them (torch DDP; Megatron's ``--overlap-grad-reduce``), during the last microbatch's
  backward (during every microbatch's for ZeRO-2/3, which reduce-scatter per microbatch): a share
  ``overlap`` of the sync hides, at most that backward's time.
- Pipeline boundaries (:func:`pipeline_messages`, :func:`boundary_seconds`): each microbatch's
  activation goes forward and its gradient back over every stage boundary. Megatron-Core overlaps
  the steady state's sends with compute, leaving those of the fill and the drain exposed
  (Megatron-Bridge guide: "PP send/recv in steady 1F1B states are overlapped with computes by
  default; warmup and flush are exposed"; ``HardwareProfile.p2p_overlap``). An activation every
  tensor-parallel rank holds whole crosses nodes as 1/t per rank and is all-gathered inside the
  node (Narayanan et al., SC'21, §4.1, "scatter/gather").
"""

from __future__ import annotations

from autopar.ir import LinkTier
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.ops import minimum


def exposed_tp_comm(comm_s, gemm_s, tp_overlap: float):
    """Seconds of tensor-parallel communication left on the critical path: ``tp_overlap`` of it
    hides behind the GEMMs, at most ``gemm_s``.

    >>> exposed_tp_comm(1.0, 10.0, 0.5), exposed_tp_comm(1.0, 0.2, 0.5)
    (0.5, 0.8)
    """
    return comm_s - minimum(comm_s * tp_overlap, gemm_s)


def exposed_grad_sync(sync_s, backward_s, overlap: float):
    """Seconds of gradient synchronization left after backward: ``overlap`` of it hides behind
    ``backward_s`` (the backward it runs during), at most that long.

    >>> exposed_grad_sync(1.0, 0.3, 1.0)
    0.7
    """
    return sync_s - minimum(sync_s * overlap, backward_s)


def pipeline_messages(stages: int, microbatches: int, virtual: int, overlapped: bool) -> int:
    """Boundary transfers on one device's critical path in a step: its own sends for every
    microbatch and stage module, plus the fill and drain (``2 (v·m + p − 2)``); with the steady
    state overlapped, only the first microbatch's way forward through the ``p·v`` modules and the
    last one's way back (``2 (p·v − 1)``).

    >>> pipeline_messages(4, 8, 1, False), pipeline_messages(4, 8, 1, True)
    (20, 6)
    """
    if stages <= 1:
        return 0
    return 2 * (stages * virtual - 1) if overlapped else 2 * (virtual * microbatches + stages - 2)


def boundary_seconds(nbytes, link: LinkTier, scatter: int = 1, inner: LinkTier | None = None):
    """One boundary transfer of ``nbytes`` over ``link``; with ``scatter`` tensor-parallel ranks
    holding it whole, each sends 1/scatter of it and the pieces are all-gathered over ``inner``."""
    if scatter <= 1 or inner is None:
        return collective_time("send_recv", nbytes, 2, link)
    return collective_time("send_recv", nbytes / scatter, 2, link) + collective_time(
        "all_gather", nbytes, scatter, inner
    )
