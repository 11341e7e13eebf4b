"""The parallel kernels' cost formulas against hand-computed values."""

import torch

from autopar.passes.cost.kernels import (
    dispatch_bytes,
    expert_imbalance,
    expert_load,
    ring_bytes,
    ring_hideable_block,
    ulysses_bytes,
)


def test_cost_hooks_follow_their_formulas():
    mib = 2**20
    # 32 heads × 1024 local tokens × 128 × 2 bytes = 8 MiB shard, 7/8 of it leaves
    assert ulysses_bytes(1, 32, 8192, 128, 8, 2) == 7 * mib
    assert ulysses_bytes(1, 32, 8192, 128, 1, 2) == 0
    # K/V block: 2 × 8 heads × 1024 × 128 × 2 bytes = 4 MiB; 7 sends forward
    assert ring_bytes(1, 8, 8192, 128, 8, 2) == 28 * mib
    # backward: 7 K/V blocks again and 8 fp32 dK/dV blocks (8 MiB each); a ring of one sends nothing
    assert ring_bytes(1, 8, 8192, 128, 8, 2, backward=True) == 28 * mib + 64 * mib
    assert ring_bytes(1, 8, 8192, 128, 1, 2, backward=True) == 0
    # s ≥ H_kv·itemsize·F / (2·H·W) = 8·2·400e12 / (2·32·50e9) = 2000; zigzag causal halves compute
    assert ring_hideable_block(32, 8, 2, 400e12, 50e9, causal=False) == 2000
    assert ring_hideable_block(32, 8, 2, 400e12, 50e9, causal=True) == 4000


def test_expert_load_and_dispatch_bytes():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [3.0, 0.0, 2.0, -1.0], [0.0, 3.0, 2.0, -1.0]])
    # top-2 slots: {0,1}, {0,2}, {1,2}: experts 0, 1, 2 get 2 of 6 slots each, expert 3 none
    torch.testing.assert_close(expert_load(logits, 2), torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    # forward: dispatch + combine, 2·T·k·H elements, 3/4 of them leave the rank at P = 4
    assert dispatch_bytes(10, 8, 2, 4, 4) == 2 * 10 * 2 * 8 * 4 * 3 / 4
    assert dispatch_bytes(10, 8, 2, 4, 4, backward=True) == 10 * 2 * (3 * 8 + 2) * 4 * 3 / 4
    assert dispatch_bytes(10, 8, 2, 1, 4) == 0


def test_expert_imbalance_is_the_busiest_ranks_share_over_the_even_share():
    assert expert_imbalance([0.25, 0.25, 0.25, 0.25], 2) == 1.0
    assert expert_imbalance([0.5, 0.25, 0.125, 0.125], 2) == 1.5  # rank 0 routes 3/4 of the slots
    assert expert_imbalance(None, 4) == 1.0  # not measured: assume balanced
