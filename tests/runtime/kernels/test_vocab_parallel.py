"""Vocabulary-parallel embedding and cross-entropy on real gloo groups against single-process torch.

Every rank builds the same full table / logits, targets and upstream gradient from one seed,
feeds its vocabulary shard to the op, and compares the (completed) output and its shard of the
gradient with ``F.embedding`` / ``F.cross_entropy`` on the full tensors. One spawn of 2 ranks
covers padding rows on either rank, ignored targets (outside and inside the vocabulary), every
reduction and label smoothing; the 4-rank split runs in the equivalence suites.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from op_checks import error_of, opcheck_failures
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime import build_device_mesh, group_name
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

ops = torch.ops.autopar
TOLERANCE = 1e-5
VOCAB, HIDDEN, TOKENS = 12, 5, 10


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    return (actual.float() - expected.float()).abs().max().item()


def _shard(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    pg = _resolve_process_group(group)
    return x.chunk(pg.size(), dim)[pg.rank()].clone()


def _embedding_errors(group: str) -> dict:
    errors = {}
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=generator)
    ids = torch.randint(0, VOCAB, (3, 7), generator=generator)
    ids[0, :3] = torch.tensor([2, 9, 0])  # both padding rows below are looked up
    upstream = torch.randn(3, 7, HIDDEN, generator=generator)
    for padding_idx in (-1, 2, 9):  # none, a row of rank 0, a row of rank 1
        whole = table.clone().requires_grad_()
        expected = F.embedding(ids, whole, padding_idx=None if padding_idx < 0 else padding_idx)
        (expected * upstream).sum().backward()
        local = _shard(table, 0, group).requires_grad_()
        partial = ops.vocab_embedding(local, ids, group, padding_idx)
        (partial * upstream).sum().backward()  # the gradient of a partial sum is the whole one
        completed = partial.detach().clone()
        dist.all_reduce(completed, group=_resolve_process_group(group))
        errors[f"embedding padding={padding_idx} out"] = _error(completed, expected.detach())
        errors[f"embedding padding={padding_idx} grad"] = _error(local.grad, _shard(whole.grad, 0, group))
    return errors


def _cross_entropy_errors(group: str) -> dict:
    errors = {}
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(TOKENS, VOCAB, generator=generator) * 3
    classes = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    classes[6] = 3
    for ignore_index in (-100, 3):  # outside the vocabulary; a class of rank 0 (row 6 is then ignored too)
        target = classes.clone()
        target[[1, 4]] = ignore_index
        for smoothing in (0.0, 0.1):
            for reduction, name in enumerate(("none", "mean", "sum")):
                whole = logits.clone().requires_grad_()
                expected = F.cross_entropy(
                    whole, target, reduction=name, ignore_index=ignore_index, label_smoothing=smoothing
                )
                upstream = torch.randn(expected.shape, generator=generator)
                (expected * upstream).sum().backward()
                local = _shard(logits, 1, group).requires_grad_()
                loss = ops.vocab_cross_entropy(local, target, None, reduction, ignore_index, smoothing, group)
                (loss * upstream).sum().backward()
                label = f"cross_entropy {name} ignore={ignore_index} smoothing={smoothing}"
                errors[f"{label} loss"] = _error(loss.detach(), expected.detach())
                errors[f"{label} grad"] = _error(local.grad, _shard(whole.grad, 1, group))
    return errors


def _two_ranks(rank, world_size):
    group = group_name(build_device_mesh({"tp": 2}, "cpu"), ("tp",))
    logits, target = torch.randn(4, VOCAB // 2, requires_grad=True), torch.tensor([0, 7, -100, 11])
    return {
        "errors": {**_embedding_errors(group), **_cross_entropy_errors(group)},
        "opcheck failures": opcheck_failures(
            {
                "vocab_embedding": (torch.randn(6, 3, requires_grad=True), torch.tensor([[1, 8], [11, 0]]), group, 1),
                "_vocab_cross_entropy": (logits, target, group, -100, 0.1),
            }
        ),
        "weighted": error_of(lambda: ops.vocab_cross_entropy(logits, target, torch.ones(12), 1, -100, 0.0, group)),
        "unflattened": error_of(
            lambda: ops.vocab_cross_entropy(logits.unsqueeze(0), target[None], None, 1, -100, 0.0, group)
        ),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_two_ranks, 2, timeout_s=90)


def test_both_ops_match_torch_on_the_whole_vocabulary(two_ranks):
    assert len(two_ranks[0]["errors"]) == 3 * 2 + 2 * 2 * 3 * 2  # every case was checked
    failures = {r: {k: e for k, e in result["errors"].items() if e > TOLERANCE} for r, result in enumerate(two_ranks)}
    assert failures == {0: {}, 1: {}}


def test_ops_pass_opcheck(two_ranks):
    assert two_ranks[0]["opcheck failures"] == {}


def test_unsupported_arguments_are_refused_by_name(two_ranks):
    assert two_ranks[0]["weighted"].startswith("ShardingRuleError") and "class weights" in two_ranks[0]["weighted"]
    assert "flatten the batch and sequence" in two_ranks[0]["unflattened"]
