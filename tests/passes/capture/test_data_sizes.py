"""Sizes only the data decides (passes/capture/data_sizes.py): a model splitting rows by counts it
computes captures with the example's sizes recorded, the nodes they concern marked and planned
whole on every rank; the graph still computes each call's sizes. Runs on 4 ranks: JetMoE in
tests/equivalence/test_unmodified_models.py."""

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import autopar
from autopar.ir import DATA_SIZED, Replicate


class SplitByCounts(torch.nn.Module):
    """Rows sorted by a choice made from the data and split into the chosen and the rest, each
    group through a linear of its own (two experts, one chosen per row)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(4, 1)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        chosen = self.router(x)[:, 0] > 0
        counts = torch.stack([chosen.sum(), (~chosen).sum()]).tolist()
        order = chosen.int().argsort(descending=True, stable=True)
        groups = x[order].split(counts)
        out = torch.cat([expert(group) for expert, group in zip(self.experts, groups)])
        return out.square().mean()


def test_the_example_sizes_are_recorded_and_the_graph_still_computes_each_calls():
    model = SplitByCounts()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    captured = autopar.capture(model, (x,))
    nodes = list(captured.graph.nodes)
    assert not any(free_unbacked_symbols(n.meta.get("val")) for n in nodes)  # every size a number
    chosen = int((model.router(x)[:, 0] > 0).sum())
    split = next(n for n in nodes if "split" in str(n.target))
    assert [tuple(t.shape) for t in split.meta["val"]] == [(chosen, 4), (8 - chosen, 4)]
    assert split.meta[DATA_SIZED] and all(u.meta.get(DATA_SIZED) for u in split.users)
    reads = [n for n in nodes if n.target is torch.ops.aten.item.default]  # the two counts
    assert len(reads) == 2 and all(n.meta[DATA_SIZED] and type(n.meta["val"]) is int for n in reads)

    other = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))  # other counts, the same graph
    recaptured = autopar.capture(model, (other,))
    assert recaptured.fingerprint == captured.fingerprint
    for inputs in ((x,), (other,)):
        torch.testing.assert_close(_run(captured, model, *inputs), model(*inputs))


def _run(captured, model, *inputs):
    """The captured graph on the model's parameters and ``inputs``."""
    state, values = dict(model.named_parameters()), iter(inputs)
    args = [
        state[captured.params[n.name]] if n.name in captured.params else next(values)
        for n in captured.graph.find_nodes(op="placeholder")
    ]
    return captured.graph_module(*args)[0]


def test_the_nodes_they_concern_run_whole_on_every_rank():
    """On 2 data-parallel ranks the rows are gathered before the choice is counted and split: each
    rank counts all of them, so every rank's sizes agree (and their collectives)."""
    model = SplitByCounts()
    plan = autopar.plan(model, 2, (torch.randn(8, 4),), degrees={"dp": 2})
    captured = autopar.capture(model, (torch.randn(8, 4),))
    marked = [n.name for n in captured.graph.nodes if n.meta.get(DATA_SIZED)]
    assert marked and all(n in plan.nodes for n in marked)
    for name in marked:
        decision = plan.nodes[name]
        assert all(p == Replicate() for slot in decision.inputs for p in slot), name
        assert decision.output is None or all(p == Replicate() for p in decision.output), name
