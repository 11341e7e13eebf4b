"""GradSync on 2 gloo ranks: after backward, every gradient is the sum over ranks.

Each rank computes the reference itself: the local gradients every rank would get (same
initial model, each rank's own batches), summed. Buckets are made smaller than the model,
so several are used, and one parameter is synced over a group of size 1 (stays local).
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autopar.runtime import GradSync, build_device_mesh, group_name
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

TOLERANCE = 1e-5
BUCKET_SIZE_BYTES = 256  # the model holds ~2.4 KB of fp32 gradients


class _Model(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.sometimes = nn.Linear(8, 4)  # used on some ranks in some steps only
        self.never = nn.Linear(4, 4)
        self.dtensor_weight = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]))

    def forward(self, x, use_sometimes: bool):
        y = self.layers(x)
        if use_sometimes:
            y = y + self.sometimes(x)
        x_d = DTensor.from_local(x, self.dtensor_weight.device_mesh, [Replicate()], run_check=False)
        y = y + (x_d @ self.dtensor_weight).to_local()
        return y.square().sum()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _grads(model) -> dict:
    def local(grad):
        return grad._local_tensor if isinstance(grad, DTensor) else grad

    return {name: None if param.grad is None else local(param.grad).clone() for name, param in model.named_parameters()}


def _expected(reference, world_size, micro_batches, synced, set_to_none=True) -> dict:
    """Gradients a rank must hold: ``micro_batches(rank)`` run on every rank, summed over ranks
    for the parameters in ``synced``."""
    per_rank = []
    for rank in range(world_size):
        reference.zero_grad(set_to_none=set_to_none)
        for step, use_sometimes in micro_batches(rank):
            reference(_batch(rank, step), use_sometimes).backward()
        per_rank.append(_grads(reference))
    expected = {}
    for name, grad in per_rank[torch.distributed.get_rank()].items():
        contributions = [grads[name] for grads in per_rank if grads[name] is not None]
        if name not in synced:
            expected[name] = grad
        else:  # None only where no rank produced a gradient
            expected[name] = sum(contributions) if contributions else None
    return expected


def _errors(actual: dict, expected: dict) -> dict:
    def error(a, e):
        if a is None or e is None:
            return 0.0 if a is e else float("inf")
        return (a - e).abs().max().item()

    return {name: error(actual[name], expected[name]) for name in expected}


def _grad_sync_scenarios(rank, world_size):
    mesh = build_device_mesh({"dp": world_size, "tp": 1}, "cpu")
    dp, tp = group_name(mesh, ("dp",)), group_name(mesh, ("tp",))
    torch.manual_seed(0)
    model = _Model(mesh["dp"])
    reference = copy.deepcopy(model)
    local_only = {"layers.4.bias"}  # synced over tp, a group of one rank
    synced = {name for name, _ in model.named_parameters()} - local_only
    sync = GradSync(
        [(param, tp if name in local_only else dp) for name, param in model.named_parameters()],
        bucket_size_bytes=BUCKET_SIZE_BYTES,
    )
    results = {"buckets": sync.num_buckets}

    def step(label, micro_batches, set_to_none=True):
        model.zero_grad(set_to_none=set_to_none)
        *accumulated, last = micro_batches(rank)
        with sync.no_sync():
            for micro_step, use_sometimes in accumulated:
                model(_batch(rank, micro_step), use_sometimes).backward()
        model(_batch(rank, last[0]), last[1]).backward()
        expected = _expected(reference, world_size, micro_batches, synced, set_to_none)
        results[label] = _errors(_grads(model), expected)

    # "sometimes" is used on rank 0 only: rank 1 must still receive rank 0's gradient
    step("first step", lambda r: [(1, r == 0)])
    step("second step", lambda r: [(2, True)])
    step("grads zeroed, not freed", lambda r: [(3, r == 1)], set_to_none=False)
    # accumulation: the no_sync micro-step is the only one that uses "sometimes"
    step("accumulated", lambda r: [(4, True), (5, False), (6, False)])

    model.zero_grad(set_to_none=True)
    with sync.no_sync():
        model(_batch(rank, 7), True).backward()
    results["inside no_sync"] = _errors(_grads(model), _expected(reference, world_size, lambda r: [(7, True)], set()))

    def accumulated_then(label, step, syncing, last_backward):
        """Two micro-steps inside no_sync, the second (``last_backward(loss)``) inside ``syncing()``."""
        model.zero_grad(set_to_none=True)
        with sync.no_sync():
            model(_batch(rank, step), True).backward()
            with syncing():
                last_backward(model(_batch(rank, step + 1), True))
        both = _expected(reference, world_size, lambda r: [(step, True), (step + 1, True)], synced)
        results[label] = _errors(_grads(model), both)

    def assigned(loss):  # as a zero-bubble weight pass does: gradients set where no hook sees them
        params = list(model.parameters())
        for param, grad in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            if grad is not None:
                param.grad += grad

    # a pipeline's last backward: syncing_now sums the accumulated gradients behind it; a stage
    # module's (summing_now): autograd's behind it, once, and those assigned as it returns
    accumulated_then("syncing_now inside no_sync", 8, sync.syncing_now, torch.Tensor.backward)
    accumulated_then("summing_now, autograd's gradients", 10, sync.summing_now, torch.Tensor.backward)
    accumulated_then("summing_now, gradients assigned", 12, sync.summing_now, assigned)
    sync.remove()
    return results


@pytest.fixture(scope="module")
def results():
    return run_local(_grad_sync_scenarios, 2)


def test_several_buckets_are_used(results):
    assert results[0]["buckets"] >= 4


@pytest.mark.parametrize(
    "scenario",
    [
        "first step",
        "second step",
        "grads zeroed, not freed",
        "accumulated",
        "inside no_sync",
        "syncing_now inside no_sync",
        "summing_now, autograd's gradients",
        "summing_now, gradients assigned",
    ],
)
def test_grads_are_the_sum_over_ranks(results, scenario):
    failures = {
        rank: {name: error for name, error in result[scenario].items() if error > TOLERANCE}
        for rank, result in enumerate(results)
    }
    assert failures == {0: {}, 1: {}}
