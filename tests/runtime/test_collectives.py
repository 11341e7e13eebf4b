"""autopar:: collectives on real gloo groups: forward and backward against single-process math.

Every rank builds the same full tensors from one seed, feeds its own part to the op, and
compares the op's output and input gradient with what the full tensors say they must be.
One spawn per world size covers every op, dim and group.
"""

import pytest
import torch
import torch.distributed as dist
from op_checks import opcheck_failures
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.runtime import build_device_mesh, group_name
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

ops = torch.ops.autopar
TOLERANCE = 1e-5


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    return (actual - expected).abs().max().item()


def _check(
    errors: dict,
    name: str,
    op,
    x: torch.Tensor,
    upstream: torch.Tensor,
    expected_out: torch.Tensor,
    expected_grad: torch.Tensor,
) -> None:
    """Run ``op(x)``, backprop ``upstream``, record the worst error of output and input grad."""
    x = x.clone().requires_grad_()
    out = op(x)
    (out * upstream).sum().backward()
    errors[f"{name} forward"] = _max_error(out.detach(), expected_out)
    errors[f"{name} backward"] = _max_error(x.grad, expected_grad)


def _check_all_ops(errors: dict, label: str, group: str) -> None:
    """Every op, several dims (negative included) and both reduce ops on one group."""
    p = _resolve_process_group(group).size()
    r = _resolve_process_group(group).rank()
    generator = torch.Generator().manual_seed(p)
    shape = (2 * p, 3 * p, 2)  # dims 0 and 1 split evenly over p

    def full(count=None):
        size = shape if count is None else (count, *shape)
        return torch.randn(size, generator=generator)

    X, G = full(p), full(p)  # one tensor per group rank
    Xr, Gr = full(), full()  # the same on every rank

    def part(t, dim):
        return t.chunk(p, dim)[r]

    for reduce_op, scale in [("sum", 1.0), ("avg", 1.0 / p)]:
        _check(
            errors,
            f"{label} all_reduce {reduce_op}",
            lambda x: ops.all_reduce(x, group, reduce_op),
            X[r],
            Gr,
            X.sum(0) * scale,
            Gr * scale,
        )
    _check(errors, f"{label} grad_all_reduce", lambda x: ops.grad_all_reduce(x, group), Xr, G[r], Xr, G.sum(0))

    for dim in [0, 1, -2, -3]:
        _check(
            errors,
            f"{label} all_gather dim={dim}",
            lambda x: ops.all_gather(x, group, dim, False),
            part(Xr, dim),
            Gr,
            Xr,
            part(Gr, dim),
        )
        _check(
            errors,
            f"{label} all_gather dim={dim} reduce_grad",
            lambda x: ops.all_gather(x, group, dim, True),
            part(Xr, dim),
            G[r],
            Xr,
            part(G.sum(0), dim),
        )
        _check(
            errors, f"{label} chunk dim={dim}", lambda x: ops.chunk(x, group, dim), Xr, part(Gr, dim), part(Xr, dim), Gr
        )
        for reduce_op, scale in [("sum", 1.0), ("avg", 1.0 / p)]:
            _check(
                errors,
                f"{label} reduce_scatter dim={dim} {reduce_op}",
                lambda x: ops.reduce_scatter(x, group, dim, reduce_op),
                X[r],
                part(Gr, dim),
                part(X.sum(0) * scale, dim),
                Gr * scale,
            )

    for split_dim, concat_dim in [(1, 0), (0, 1), (-3, -2)]:
        _check(
            errors,
            f"{label} all_to_all split={split_dim} concat={concat_dim}",
            lambda x: ops.all_to_all(x, group, split_dim, concat_dim),
            part(Xr, concat_dim),
            part(Gr, split_dim),
            part(Xr, split_dim),
            part(Gr, concat_dim),
        )

    _check(
        errors,
        f"{label} keep_on_first",
        lambda x: ops.keep_on_first(x, group),
        Xr,
        Gr,
        Xr if r == 0 else torch.zeros_like(Xr),
        Gr,
    )
    # a non-contiguous input (a transposed view) gathers like its contiguous copy
    _check(
        errors,
        f"{label} all_gather non-contiguous",
        lambda x: ops.all_gather(x.transpose(0, 1), group, 1, False),
        part(Xr, 0),
        Gr.transpose(0, 1),
        Xr.transpose(0, 1),
        part(Gr, 0),
    )


def _fake_shapes(group: str) -> dict:
    """Output shapes under FakeTensorMode: the shape rules, without communication."""
    with FakeTensorMode():
        x = torch.empty(4, 6, 8)
        return {
            "all_reduce": ops.all_reduce(x, group, "avg").shape,
            "grad_all_reduce": ops.grad_all_reduce(x, group).shape,
            "all_gather": ops.all_gather(x, group, -1, True).shape,
            "chunk": ops.chunk(x, group, 1).shape,
            "reduce_scatter": ops.reduce_scatter(x, group, 0, "sum").shape,
            "all_to_all": ops.all_to_all(x, group, 1, 2).shape,
            "keep_on_first": ops.keep_on_first(x, group).shape,
        }


def _opcheck_failures(group: str) -> dict:
    """torch.library.opcheck: schema, autograd registration and fake impl agree with the op."""
    x = torch.randn(4, 6, 8, requires_grad=True)
    calls = {
        "all_reduce": (x, group, "avg"),
        "grad_all_reduce": (x, group),
        "all_gather": (x, group, -1, True),
        "chunk": (x, group, 1),
        "reduce_scatter": (x, group, 0, "sum"),
        "all_to_all": (x, group, 1, 2),
        "keep_on_first": (x, group),
    }
    return opcheck_failures(calls)


def _traced_backward_ops(group: str) -> list[str]:
    """The autopar ops in a fake-traced forward+backward: each collective meets its dual."""

    def loss_grad(x):
        y = ops.reduce_scatter(ops.all_gather(x, group, 0, True), group, 0, "sum")
        z = ops.all_to_all(ops.grad_all_reduce(y, group), group, 1, 0)
        return torch.autograd.grad(ops.all_reduce(z, group, "sum").sum(), x)

    graph = make_fx(loss_grad, tracing_mode="fake")(torch.randn(4, 6, requires_grad=True)).graph
    return [
        node.target.name()
        for node in graph.nodes
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "autopar"
    ]


def _errors_of(fn) -> str:
    try:
        fn()
    except (ValueError, IndexError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _groups_made(fn) -> int:
    before = len(dist.distributed_c10d._world.pg_map)
    fn()
    return len(dist.distributed_c10d._world.pg_map) - before


def _two_ranks(rank, world_size):
    mesh = build_device_mesh({"world": 2}, "cpu")
    world = group_name(mesh, ("world",))
    errors = {}
    _check_all_ops(errors, "world", world)
    return {
        "errors": errors,
        "fake shapes": _fake_shapes(world),
        "opcheck failures": _opcheck_failures(world),
        "traced ops": _traced_backward_ops(world),
        "bad layout": _errors_of(lambda: build_device_mesh({"dp": 3}, "cpu")),
        "uneven chunk": _errors_of(lambda: ops.chunk(torch.ones(3), world, 0)),
        "bad reduce_op": _errors_of(lambda: ops.all_reduce(torch.ones(3), world, "max")),
        "bad dim": _errors_of(lambda: ops.all_gather(torch.ones(3), world, 1, False)),
    }


def _four_ranks(rank, world_size):
    mesh = build_device_mesh({"dp": 2, "tp": 2, "pp": 1}, "cpu")
    groups = {
        "tp": group_name(mesh, ("tp",)),
        "dp": group_name(mesh, ("dp",)),
        "dp+tp": group_name(mesh, ("dp", "tp")),
    }
    errors = {}
    for label, group in groups.items():
        _check_all_ops(errors, label, group)
    return {
        "errors": errors,
        "group ranks": {
            label: dist.get_process_group_ranks(_resolve_process_group(group)) for label, group in groups.items()
        },
        "same name again": group_name(mesh, ("dp", "tp")) == groups["dp+tp"],
        # each parallelize asks for its mesh: the same layout must not make new groups (they are never freed)
        "groups made again": _groups_made(
            lambda: group_name(build_device_mesh({"dp": 2, "tp": 2, "pp": 1}, "cpu"), ("dp", "tp"))
        ),
        "axes out of order": _errors_of(lambda: group_name(mesh, ("tp", "dp"))),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_two_ranks, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return run_local(_four_ranks, 4)


def _failures(results):
    return {
        rank: {name: error for name, error in result["errors"].items() if error > TOLERANCE}
        for rank, result in enumerate(results)
    }


def test_ops_match_single_process_math_on_2_ranks(two_ranks):
    assert _failures(two_ranks) == {0: {}, 1: {}}


def test_ops_match_single_process_math_on_4_ranks_and_sub_groups(four_ranks):
    assert _failures(four_ranks) == {rank: {} for rank in range(4)}


def test_fake_shapes(two_ranks):
    assert two_ranks[0]["fake shapes"] == {
        "all_reduce": (4, 6, 8),
        "grad_all_reduce": (4, 6, 8),
        "all_gather": (4, 6, 16),
        "chunk": (4, 3, 8),
        "reduce_scatter": (2, 6, 8),
        "all_to_all": (4, 3, 16),
        "keep_on_first": (4, 6, 8),
    }


def test_ops_pass_opcheck(two_ranks):
    assert two_ranks[0]["opcheck failures"] == {}


def test_backward_graph_holds_the_dual_collectives(two_ranks):
    forward = ["all_gather", "reduce_scatter", "grad_all_reduce", "all_to_all", "all_reduce"]
    # all_reduce's backward is the identity
    backward = ["all_to_all", "all_reduce", "all_gather", "reduce_scatter"]
    assert two_ranks[0]["traced ops"] == [f"autopar::{name}" for name in forward + backward]


def test_user_errors_name_the_problem(two_ranks):
    result = two_ranks[0]
    assert result["bad layout"].startswith("MeshError")  # a ValueError
    assert "spans 3 ranks but the world has 2" in result["bad layout"]
    assert "ValueError" in result["uneven chunk"] and "size 3" in result["uneven chunk"]
    assert "ValueError" in result["bad reduce_op"] and "'max'" in result["bad reduce_op"]
    assert "IndexError" in result["bad dim"]


def test_group_names_follow_the_mesh(four_ranks):
    # mesh [[0, 1], [2, 3]]: tp groups are rows, dp groups columns, dp+tp everything
    assert [result["group ranks"] for result in four_ranks] == [
        {"tp": [0, 1], "dp": [0, 2], "dp+tp": [0, 1, 2, 3]},
        {"tp": [0, 1], "dp": [1, 3], "dp+tp": [0, 1, 2, 3]},
        {"tp": [2, 3], "dp": [0, 2], "dp+tp": [0, 1, 2, 3]},
        {"tp": [2, 3], "dp": [1, 3], "dp+tp": [0, 1, 2, 3]},
    ]
    assert all(result["same name again"] for result in four_ranks)
    assert [result["groups made again"] for result in four_ranks] == [0] * 4
    assert "mesh order" in four_ranks[0]["axes out of order"]
