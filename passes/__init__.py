"""The graph passes, installed as ``autopar.passes``, one folder per stage of the pipeline:

``capture`` (torch.export → aten graph) → ``sharding`` (per-op strategies on one mesh axis) →
``cost`` (node facts, op/collective/kernel/schedule costs, a plan's evaluation) → ``search``
(degrees, ZeRO and schedule outside; one ILP per mesh axis inside; pipeline stage cuts) →
``rewrite`` (gradients, the per-rank program with collectives, recomputation, pipeline stages,
export). ``runner`` runs and times them. Each module states its pre- and post-conditions.
"""
