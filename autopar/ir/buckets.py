"""Gradient bucket sizes, DDP's: one rule for the runtime's bucketed gradient sync
(:mod:`autopar.runtime.grad_sync`), the buckets of a compiled program's schedule
(:mod:`autopar.passes.rewrite.overlap`) and the cost model's overlap (:mod:`autopar.passes.cost.replay`).

A small first bucket starts communication early in backward; later ones are larger, so
each collective's fixed cost is paid rarely.

>>> [bucket_cap(i) for i in range(3)] == [FIRST_BUCKET_BYTES, BUCKET_BYTES, BUCKET_BYTES]
True
"""

BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20


def bucket_cap(index: int) -> int:
    """The byte size at which bucket ``index`` (0 = the first one filled) closes."""
    return FIRST_BUCKET_BYTES if index == 0 else BUCKET_BYTES
