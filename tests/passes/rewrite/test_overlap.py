"""The scheduling pass on fake-traced graphs (a "fake" process group of 2 ranks, no data):
collectives lowered to torch's functional collectives, each issued right after its input and
waited for right before its first use, small all-reduces bucketed, parameter gathers prefetched
one ahead. Numerics are the equivalence suite's (tests/equivalence/test_compiled.py)."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar.runtime  # noqa: F401  (registers torch.ops.autopar)
from autopar.passes.rewrite.overlap import COLLECTIVES, WAIT, schedule_communication
from autopar.runtime.functional import FUNCTIONAL_FORMS

ops = torch.ops.autopar
functional = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _scheduled(function, *shapes):
    graph = make_fx(function, tracing_mode="fake")(*(torch.randn(shape) for shape in shapes)).graph
    schedule_communication(graph, FUNCTIONAL_FORMS)
    return graph, list(graph.nodes)


def _find(nodes, target):
    return [node for node in nodes if node.target is target]


def test_a_collective_is_issued_at_its_input_and_waited_for_at_its_first_use(group):
    def step(a, b, w):
        partial = a @ w
        busy = torch.tanh(b @ w @ w.T @ w)  # independent of the collective
        summed = ops.all_reduce(partial, group, "sum")
        return summed + busy

    graph, nodes = _scheduled(step, (8, 8), (8, 8), (8, 8))
    assert not _find(nodes, ops.all_reduce.default)  # lowered
    (start,), (wait,) = _find(nodes, functional.all_reduce.default), _find(nodes, WAIT)
    matmuls = _find(nodes, torch.ops.aten.mm.default)
    first, busy = matmuls[0], matmuls[1:]
    assert nodes.index(start) < nodes.index(busy[0])  # issued before the independent work ...
    assert nodes.index(start) == nodes.index(first) + 1  # ... right after its input
    assert all(nodes.index(wait) > nodes.index(m) for m in busy)  # waited for after it
    (add,) = _find(nodes, torch.ops.aten.add.Tensor)
    assert nodes.index(wait) < nodes.index(add) and add in _users_through_views(wait)


def _users_through_views(node):
    users = set()
    for user in node.users:
        users.add(user)
        if user.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
            users |= _users_through_views(user)
    return users


def test_gathers_keep_the_chunk_layout_of_their_op(group):
    def step(x):
        gathered, scattered = ops.all_gather(x, group, 1, False), ops.reduce_scatter(x, group, 2, "sum")
        return gathered, scattered, ops.all_to_all(x, group, 2, 1)

    graph, nodes = _scheduled(step, (2, 3, 4))
    outputs = next(n for n in nodes if n.op == "output").args[0]
    assert [tuple(out.meta["val"].shape) for out in outputs] == [(2, 6, 4), (2, 3, 2), (2, 6, 2)]
    kinds = {node.target for node in nodes if node.target in COLLECTIVES}
    assert kinds == {
        functional.all_gather_into_tensor.default,
        functional.reduce_scatter_tensor.default,
        functional.all_to_all_single.default,
    }
    assert len(_find(nodes, WAIT)) == 3


def test_all_reduces_ready_together_share_one_bucket(group):
    def backward(g1, g2, g3):  # three gradients, all needed only at the end of the step
        return [ops.all_reduce(g, group, "sum") for g in (g1 * 2, g2 * 3, g3 * 4)]

    _, nodes = _scheduled(backward, (16,), (4, 4), (8,))
    (bucket,) = _find(nodes, functional.all_reduce.default)
    assert bucket.args[0].meta["val"].shape == (16 + 16 + 8,)


def test_dependent_all_reduces_are_not_bucketed(group):
    def forward(x):
        first = ops.all_reduce(x, group, "sum")
        return ops.all_reduce(first * 2, group, "sum")

    _, nodes = _scheduled(forward, (8,))
    assert len(_find(nodes, functional.all_reduce.default)) == 2


def test_parameter_gathers_prefetch_one_layer_ahead(group):
    def forward(w0, w1, w2, x):
        for weight in (w0, w1, w2):
            (whole,) = ops.zero_gather_layer([weight], group, [0], [True], None)
            x = torch.tanh(x @ whole)
        return x

    _, nodes = _scheduled(forward, (4, 8), (4, 8), (4, 8), (8, 8))
    starts = _find(nodes, functional.all_gather_into_tensor.default)
    waits = [next(iter(start.users)) for start in starts]
    matmuls = _find(nodes, torch.ops.aten.mm.default)
    assert len(starts) == 3
    for layer in range(2):  # as FSDP2: once layer k's weights are in, layer k + 1's gather starts ...
        assert nodes.index(waits[layer]) < nodes.index(starts[layer + 1]) < nodes.index(matmuls[layer])
    assert nodes.index(starts[2]) > nodes.index(matmuls[0])  # ... and no earlier: one layer ahead only
    assert all(nodes.index(w) < nodes.index(m) for w, m in zip(waits, matmuls))


def test_grad_all_reduce_costs_nothing_in_forward(group):
    def forward(w, x):
        return x @ ops.grad_all_reduce(w, group)

    _, nodes = _scheduled(forward, (8, 8), (8, 8))
    assert not _find(nodes, ops.grad_all_reduce.default) and not _find(nodes, WAIT)
