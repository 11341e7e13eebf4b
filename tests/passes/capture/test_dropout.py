"""Dropout's mask is drawn whole (on ones of its input's shape): the captured graph draws the masks
the module draws, and data parallelism splits the product instead of gathering the input."""

import torch

import autopar
from autopar.ir import Replicate, Shard
from autopar.passes.capture.graph import capture

aten = torch.ops.aten


class _Dropped(torch.nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.dropout = torch.nn.Dropout(0.25)

    def forward(self, x, target):
        return ((self.dropout(x @ self.weight).relu() - target) ** 2).mean()


def _run(captured, model, inputs):
    """The captured graph on the model's parameters: its loss and the weight's gradient."""
    by_placeholder = {**captured.params, **dict.fromkeys(captured.user_inputs)}
    values = iter(inputs)
    args = [model.get_parameter(by_placeholder[n.name]) if by_placeholder[n.name] else next(values)
            for n in captured.graph.nodes if n.op == "placeholder"]  # fmt: skip
    (loss,) = captured.graph_module(*args)
    (grad,) = torch.autograd.grad(loss, model.weight)
    return loss, grad


def test_the_captured_graph_draws_the_masks_the_module_draws():
    model, inputs = _Dropped(), (torch.randn(16, 8, 64), torch.randn(16, 8, 64))
    captured = capture(model, inputs)
    dropouts = list(captured.graph.find_nodes(op="call_function", target=aten.native_dropout.default))
    assert dropouts and all(d.args[0].target is aten.ones.default for d in dropouts)  # the mask reads no input
    torch.manual_seed(3)
    loss, grad = _run(captured, model, inputs)
    torch.manual_seed(3)
    expected = model(*inputs)
    (expected_grad,) = torch.autograd.grad(expected, model.weight)
    assert torch.equal(loss, expected) and torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-7)


class _DroppedTransposed(_Dropped):
    """Dropout of a transposed value (as nn.MultiheadAttention's batch-first output): its mask is
    drawn in the value's memory order, another mask than a contiguous value of its shape draws."""

    def forward(self, x, target):
        return ((self.dropout((x @ self.weight).transpose(0, 1)).relu() - target) ** 2).mean()


def test_a_transposed_value_draws_the_mask_the_module_draws():
    model, inputs = _DroppedTransposed(), (torch.randn(16, 8, 64), torch.randn(8, 16, 64))
    captured = capture(model, inputs)
    (dropout,) = captured.graph.find_nodes(op="call_function", target=aten.native_dropout.default)
    assert dropout.args[0].target is aten.permute.default  # ones laid out as the value is
    torch.manual_seed(3)
    loss, grad = _run(captured, model, inputs)
    torch.manual_seed(3)
    expected = model(*inputs)
    (expected_grad,) = torch.autograd.grad(expected, model.weight)
    assert torch.equal(loss, expected) and torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_data_parallelism_splits_the_dropped_values_and_draws_the_mask_whole():
    """Dropout had no strategy but the whole tensor: data parallelism gathered its input over the batch."""
    model, inputs = _Dropped(), (torch.randn(64, 32, 64), torch.randn(64, 32, 64))
    plan = autopar.plan(model, 4, inputs, degrees={"dp": 4}, hardware="h100-80gb")
    dropped = next(n for n in capture(model, inputs).graph.nodes if n.target is aten.matmul.default)
    for user in dropped.users:  # each reads its rank's rows: nothing gathers them
        assert plan.nodes[user.name].inputs[user.args.index(dropped)] == (Shard(0), Replicate()), user
    dropout = next(d for d in plan.nodes.values() if d.op == "aten.native_dropout.default")
    assert dropout.output == (Replicate(), Replicate())  # the mask, drawn whole on every rank
