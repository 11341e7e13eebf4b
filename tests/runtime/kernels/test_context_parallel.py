"""Context-parallel attention on real gloo groups against single-process SDPA on the full sequence.

Every rank builds the same full q, k, v and upstream gradient from one seed, feeds its zigzag
shard to the op, and compares the output and the q, k, v gradients with its shard of what
single-process ``F.scaled_dot_product_attention`` gives on the full tensors. One spawn per world
size covers both ops, causal and not, grouped-query attention and an explicit scale.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from op_checks import error_of, opcheck_failures
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.ir.errors import ShardingRuleError
from autopar.runtime import build_device_mesh, group_name
from autopar.runtime.kernels import context_parallel
from autopar.runtime.kernels.zigzag import inverse_order, zigzag_order, zigzag_positions
from autopar.runtime.spawn import run_local

ops = torch.ops.autopar
TOLERANCE = 1e-5
OPS = ("ulysses_attention", "ring_attention")
# (heads, kv_heads, scale): plain; grouped-query attention with an explicit scale. On 4 ranks
# Ulysses cannot split 2 k/v heads and repeats them before its all-to-all; on 2 ranks it need not.
SHAPES = ((4, 4, None), (4, 2, 0.3))


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    return (actual - expected).abs().max().item()


def _check_attention(
    errors: dict, group: str, op: str, causal: bool, heads: int, kv_heads: int, scale: float | None
) -> None:
    """Record the worst error of the op's output and q, k, v gradients on this rank's shard."""
    world, rank = _resolve_process_group(group).size(), _resolve_process_group(group).rank()
    generator = torch.Generator().manual_seed(heads + kv_heads + world)
    batch, seq, head_dim = 2, 16 * world, 8

    def randn(count):
        return torch.randn(batch, count, seq, head_dim, generator=generator)

    full = [randn(heads), randn(kv_heads), randn(kv_heads)]
    upstream = randn(heads)
    leaves = [x.clone().requires_grad_() for x in full]
    repeats = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        leaves[0], *(x.repeat_interleave(repeats, 1) for x in leaves[1:]), is_causal=causal, scale=scale
    )
    (expected * upstream).sum().backward()

    positions = zigzag_positions(seq, world, rank)
    shard = [x.index_select(2, positions).requires_grad_() for x in full]
    out = getattr(ops, op)(*shard, group, causal, scale)
    (out * upstream.index_select(2, positions)).sum().backward()
    label = f"{op} causal={causal} heads={heads}/{kv_heads} scale={scale}"
    errors[f"{label} out"] = _max_error(out.detach(), expected.detach().index_select(2, positions))
    for name, local, whole in zip("qkv", shard, leaves):
        errors[f"{label} d{name}"] = _max_error(local.grad, whole.grad.index_select(2, positions))


def _attention_errors(group: str) -> dict:
    errors = {}
    for op in OPS:
        for causal in (True, False):
            for heads, kv_heads, scale in SHAPES:
                _check_attention(errors, group, op, causal, heads, kv_heads, scale)
    return errors


class _Attention(torch.nn.Module):
    def __init__(self, op: str, group: str):
        super().__init__()
        self.op, self.group = op, group

    def forward(self, q, k, v):
        return getattr(ops, self.op)(q, k, v, self.group, True, None)


def _autopar_ops(graph) -> list[str]:
    return [
        node.target.name()
        for node in graph.nodes
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "autopar"
    ]


def _loss_grad(op: str, group: str, q, k, v):
    return torch.autograd.grad(getattr(ops, op)(q, k, v, group, True, None).sum(), (q, k, v))


def _traces(group: str) -> dict:
    """torch.export keeps each public op as one node; a fake forward+backward trace (make_fx)
    shows the private op and its backward, which also run on fake tensors without communication."""
    q = torch.randn(2, 4, 16, 8)
    traces = {}
    for op in OPS:
        exported = torch.export.export(_Attention(op, group), (q, q, q), strict=False)
        traces[f"export {op}"] = _autopar_ops(exported.graph)

        with FakeTensorMode():
            fake = [torch.empty(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
            traced = make_fx(functools.partial(_loss_grad, op, group))(*fake)
        traces[f"make_fx {op}"] = _autopar_ops(traced.graph)
    return traces


def _opcheck_failures(group: str) -> dict:
    """torch.library.opcheck: schema, autograd registration and fake impls agree with the ops."""
    q, k, v = (torch.randn(1, 4, 8, 8, requires_grad=True) for _ in range(3))
    out, lse = ops._ring_attention(q, k, v, group, True, None)
    calls = {
        "_ulysses_attention": (q, k, v, group, True, 0.5),
        "_ring_attention": (q, k, v, group, True, 0.5),
        "_ring_attention_backward": (
            torch.randn(1, 4, 8, 8),
            q.detach(),
            k.detach(),
            v.detach(),
            out.detach(),
            lse,
            group,
            True,
            None,
        ),
    }
    return opcheck_failures(calls)


def _two_ranks(rank, world_size):
    group = group_name(build_device_mesh({"cp": 2}, "cpu"), ("cp",))
    errors = _attention_errors(group)
    # 3 heads do not split over 2 ranks: Ulysses refuses, the ring does not care
    _check_attention(errors, group, "ring_attention", True, 3, 3, None)
    three_heads, odd_seq = torch.randn(1, 3, 8, 8), torch.randn(1, 4, 7, 8)
    return {
        "errors": errors,
        "traces": _traces(group),
        "opcheck failures": _opcheck_failures(group),
        "uneven heads": error_of(lambda: ops.ulysses_attention(*[three_heads] * 3, group, True, None)),
        "odd local seq": error_of(lambda: ops.ring_attention(*[odd_seq] * 3, group, False, None)),
    }


def _four_ranks(rank, world_size):
    return {"errors": _attention_errors(group_name(build_device_mesh({"cp": 4}, "cpu"), ("cp",)))}


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_two_ranks, 2, timeout_s=90)


@pytest.fixture(scope="module")
def four_ranks():
    return run_local(_four_ranks, 4, timeout_s=90)


def _failures(results):
    return {
        rank: {name: error for name, error in result["errors"].items() if error > TOLERANCE}
        for rank, result in enumerate(results)
    }


@pytest.mark.ranks
def test_both_ops_match_full_sdpa_on_2_ranks(two_ranks):
    assert len(two_ranks[0]["errors"]) == 2 * 2 * 2 * 4 + 4  # every case was checked
    assert _failures(two_ranks) == {0: {}, 1: {}}


@pytest.mark.ranks
def test_both_ops_match_full_sdpa_on_4_ranks(four_ranks):
    assert len(four_ranks[0]["errors"]) == 2 * 2 * 2 * 4
    assert _failures(four_ranks) == {rank: {} for rank in range(4)}


@pytest.mark.ranks
def test_each_op_is_one_graph_node(two_ranks):
    traces = two_ranks[0]["traces"]
    assert traces["export ulysses_attention"] == ["autopar::ulysses_attention"]
    assert traces["export ring_attention"] == ["autopar::ring_attention"]
    # Ulysses' backward: the gradient in, dq, dk, dv back — 4 all-to-alls around SDPA's backward
    assert traces["make_fx ulysses_attention"] == (["autopar::_ulysses_attention"] + ["autopar::all_to_all"] * 4)
    assert traces["make_fx ring_attention"] == ["autopar::_ring_attention", "autopar::_ring_attention_backward"]


@pytest.mark.ranks
def test_private_ops_pass_opcheck(two_ranks):
    assert two_ranks[0]["opcheck failures"] == {}


@pytest.mark.ranks
def test_user_errors_name_the_problem(two_ranks):
    uneven, odd = two_ranks[0]["uneven heads"], two_ranks[0]["odd local seq"]
    assert uneven.startswith("ShardingRuleError") and "3 heads over 2 cp ranks" in uneven
    assert odd.startswith("ShardingRuleError") and "local seq is 7" in odd


BLOCK_KERNELS = {
    "fused": (context_parallel._fused_forward, context_parallel._fused_backward),
    "explicit": (context_parallel._explicit_forward, context_parallel._explicit_backward),
}


@pytest.mark.parametrize("kernels", BLOCK_KERNELS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_ring_block_math_merges_to_sdpa_and_its_gradient(kernels, heads, kv_heads):
    """One query chunk on two key chunks, the one before whole and its own one causal: the merged
    block outputs are SDPA's, and each block's backward, given the merged out and lse, returns a
    share of dq, dk, dv; the shares add up to SDPA's gradients."""
    block_forward, block_backward = BLOCK_KERNELS[kernels]
    generator = torch.Generator().manual_seed(heads + kv_heads)
    chunk, scale = 8, 0.3
    q, upstream = (torch.randn(2, heads, chunk, 8, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, 2 * chunk, 8, generator=generator) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    repeats = heads // kv_heads
    visible = torch.ones(chunk, 2 * chunk, dtype=torch.bool).tril(chunk)  # query i sees keys ≤ chunk + i
    expected = F.scaled_dot_product_attention(
        leaves[0], *(x.repeat_interleave(repeats, 1) for x in leaves[1:]), attn_mask=visible, scale=scale
    )
    (expected * upstream).sum().backward()

    pairs = [
        (key, value, diagonal) for key, value, diagonal in zip(k.chunk(2, dim=-2), v.chunk(2, dim=-2), (False, True))
    ]
    out = lse = None
    for key, value, diagonal in pairs:
        out, lse = context_parallel._merge(out, lse, *block_forward(q, key, value, scale, diagonal))
    shares = [block_backward(upstream, q, key, value, out, lse, scale, diagonal) for key, value, diagonal in pairs]
    grad_q = shares[0][0] + shares[1][0]
    grad_k, grad_v = (torch.cat([share[n] for share in shares], dim=-2) for n in (1, 2))
    for actual, leaf in zip((grad_q, grad_k, grad_v), leaves):
        assert _max_error(actual, leaf.grad) < TOLERANCE
    assert _max_error(out, expected.detach()) < TOLERANCE


def test_ring_block_math_is_fused_on_cpu_only():
    assert context_parallel._block_kernels(torch.device("cpu")) == BLOCK_KERNELS["fused"]
    assert context_parallel._block_kernels(torch.device("cuda")) == BLOCK_KERNELS["explicit"]


@pytest.mark.parametrize("seq_len, world", [(8, 1), (8, 2), (24, 3), (64, 4)])
def test_layout_round_trips(seq_len, world):
    full = torch.arange(seq_len) * 10
    ranked = full.index_select(0, zigzag_order(seq_len, world))
    assert torch.equal(ranked.index_select(0, inverse_order(seq_len, world)), full)
    shards = ranked.chunk(world)
    for rank in range(world):
        positions = zigzag_positions(seq_len, world, rank)
        assert torch.equal(shards[rank], full[positions])
        chunk = seq_len // (2 * world)  # the head chunk c_rank, then the tail chunk c_(2p-1-rank)
        assert positions[0] == rank * chunk and positions[chunk] == (2 * world - 1 - rank) * chunk


def test_layout_examples_and_errors():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_order(8, 2).dtype == torch.int64
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ShardingRuleError, match="seq_len=10 is not divisible by 4"):
        zigzag_order(10, 2)
    with pytest.raises(ShardingRuleError, match="rank 2 is not in a cp group of 2"):
        zigzag_positions(8, 2, 2)
