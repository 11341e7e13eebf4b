"""Mean cross-entropy becomes a sum over a count: the same loss, and one that splits exactly."""

import torch
import torch.nn.functional as F
from torch import nn

from autopar.passes.capture.graph import capture

aten = torch.ops.aten


class Classifier(nn.Module):
    def __init__(self, weighted: bool = False, **loss_options):
        super().__init__()
        self.head, self.loss_options = nn.Linear(8, 5), loss_options
        self.register_buffer("weight", torch.ones(5) if weighted else None)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target, weight=self.weight, **self.loss_options)


def _run(captured, model, *inputs):
    state = {p: model.get_parameter(n) for p, n in captured.params.items()}
    state.update({b: model.get_buffer(n) for b, n in captured.buffers.items()})
    values = iter(inputs)
    placeholders = [n.name for n in captured.graph.nodes if n.op == "placeholder"]
    return captured.graph_module(*[state[name] if name in state else next(values) for name in placeholders])


def test_mean_with_ignored_targets_is_a_sum_over_a_count():
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(6, 8)
    target = torch.tensor([1, -100, -100, 4, 0, -100])  # the first half counts 1 target, the second 2
    captured = capture(model, (x, target))
    losses = [n for n in captured.graph.nodes if n.target is aten.cross_entropy_loss.default]
    assert [n.args[3] for n in losses] == [2]  # reduction="sum"
    assert {aten.ne.Scalar, aten.sum.default, aten.div.Tensor} <= {n.target for n in captured.graph.nodes}
    (loss,) = _run(captured, model, x, target)
    torch.testing.assert_close(loss, model(x, target))
    halves = [F.cross_entropy(model.head(x[i : i + 3]), target[i : i + 3], reduction="sum") for i in (0, 3)]
    torch.testing.assert_close(loss, sum(halves) / (target != -100).sum())  # what a split batch sums
    assert not torch.allclose(loss, sum(model(x[i : i + 3], target[i : i + 3]) for i in (0, 3)) / 2)


def test_weighted_or_smoothed_losses_stay_as_they_are():
    x, target = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    for options in (dict(weighted=True), dict(label_smoothing=0.1), dict(reduction="sum")):
        captured = capture(Classifier(**options), (x, target))
        assert aten.div.Tensor not in {n.target for n in captured.graph.nodes}, options
