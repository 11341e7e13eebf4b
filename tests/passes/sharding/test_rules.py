import torch

from autopar.ir import Partial, Replicate, Shard
from autopar.passes.capture.graph import capture
from autopar.passes.sharding.rules import node_strategies, view_map
from autopar.passes.sharding.strategies import OpView, Strategy, output_tensors, tensor_inputs

R = Replicate()


def _views(module, *inputs):
    captured = capture(module, inputs)
    for node in captured.graph.nodes:
        if node.op == "call_function" and all(isinstance(s.meta["val"], torch.Tensor) for s in tensor_inputs(node)):
            shapes = tuple(tuple(s.meta["val"].shape) for s in tensor_inputs(node))
            yield node, OpView(node, shapes, tuple(output_tensors(node)[0].shape))


def test_linear_offers_batch_column_and_row_splits():
    ((node, view),) = _views(torch.nn.Linear(8, 4), torch.randn(6, 8))
    strategies, has_rule = node_strategies(view, 2)
    assert has_rule
    assert Strategy((R, Shard(0), Shard(0)), Shard(1)) in strategies  # column: out features
    assert Strategy((Shard(1), Shard(1), Partial()), Partial()) in strategies  # row: contraction
    assert Strategy((Shard(0), R, R), Shard(0)) in strategies  # batch


def test_candidates_that_do_not_divide_are_dropped():
    ((node, view),) = _views(torch.nn.Linear(8, 3), torch.randn(6, 8))
    strategies, _ = node_strategies(view, 2)
    assert all(not isinstance(s.output, Shard) or s.output.dim != 1 for s in strategies)  # 3 outputs


def test_view_maps_leading_dims_of_merged_and_split_groups():
    assert view_map((4, 6, 8), (24, 8)) == {0: 0, 2: 1}
    assert view_map((24, 8), (4, 6, 8)) == {0: 0, 1: 2}
    assert view_map((2, 16, 64), (2, 16, 4, 16)) == {0: 0, 1: 1, 2: 2}
    assert view_map((1, 5), (5,)) == {1: 0}


class Broadcast(torch.nn.Module):
    def forward(self, x, bias):
        return (x + bias).sum()


def test_pointwise_keeps_broadcast_operands_replicated_and_sum_gives_partial():
    (add, add_view), (total, sum_view) = _views(Broadcast(), torch.randn(4, 6), torch.randn(6))
    strategies, _ = node_strategies(add_view, 2)
    assert Strategy((Shard(0), R), Shard(0)) in strategies
    assert Strategy((Shard(1), Shard(0)), Shard(1)) in strategies
    assert Strategy((Shard(0),), Partial("sum")) in node_strategies(sum_view, 2)[0]


class NoRule(torch.nn.Module):
    def forward(self, x):
        return torch.diff(x, dim=0)


def test_an_op_without_a_rule_falls_back_to_replication_and_says_so():
    ((node, view),) = _views(NoRule(), torch.randn(4, 6))
    strategies, has_rule = node_strategies(view, 2)
    assert not has_rule and strategies == [Strategy((R,), R)]


class SoftmaxAndSplit(torch.nn.Module):
    def forward(self, x):
        first, second = x.softmax(dim=-1).split(3, dim=1)
        return first + second


def test_ops_along_a_dim_never_shard_that_dim():
    softmax, split, *_ = (view for _, view in _views(SoftmaxAndSplit(), torch.randn(4, 6)))
    assert [s.output for s in node_strategies(softmax, 2)[0]] == [R, Shard(0)]
    assert Strategy((Shard(0),), Shard(0)) in node_strategies(split, 2)[0]
    assert all(s.output != Shard(1) for s in node_strategies(split, 2)[0])


class AssembledQuery(torch.nn.Module):
    """A query built as DeepSeek-V3's attention builds it: its two parts written into ``new_empty``."""

    def __init__(self):
        super().__init__()
        self.nope, self.rope = torch.nn.Linear(64, 48), torch.nn.Linear(64, 16)

    def forward(self, x):
        query = x.new_empty(*x.shape[:-1], 64)
        query[..., :48] = self.nope(x)
        query[..., 48:] = self.rope(x)
        return query.pow(2).mean()


def test_a_buffer_its_parts_are_written_into_stays_split_with_them():
    """The factory builds each rank's chunk (its size localized by the rewrite), its template lending
    only a dtype: no rank gathers the parts to meet a buffer built whole."""
    import autopar

    plan = autopar.plan(AssembledQuery(), 4, (torch.randn(8, 32, 64),), degrees={"dp": 4})
    (buffer,) = [d for d in plan.nodes.values() if d.op == "aten.new_empty.default"]
    assert buffer.inputs == () and buffer.output[list(plan.degrees).index("dp")] == Shard(0)
