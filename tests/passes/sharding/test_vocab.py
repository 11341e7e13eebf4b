"""The vocabulary split: its strategies, its pins, its cost, and the search choosing it by itself.

The kernels' own math (per-shard results combining to torch's) is proven on real ranks in
tests/runtime/kernels/test_vocab_parallel.py; training through them in tests/equivalence.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from planning import meta_model

import autopar
from autopar.ir import Kernel, Partial, Replicate, Shard, ShardingRuleError, get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.kernels import vocab_loss_bytes
from autopar.passes.sharding.rules import node_strategies
from autopar.passes.sharding.strategies import OpView, Strategy, output_tensors, tensor_inputs

R = Replicate()
VOCAB_EMBEDDING = Strategy((Shard(0), R), Partial(), Kernel.VOCAB)
VOCAB_LOSS = Strategy((Shard(1), R), R, Kernel.VOCAB)


class Lookup(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.table = torch.nn.Embedding(16, 4, **kwargs)

    def forward(self, ids):
        return self.table(ids)


class Loss(torch.nn.Module):
    def __init__(self, weight=None, **kwargs):
        super().__init__()
        self.register_buffer("weight", weight)
        self.kwargs = kwargs

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, self.weight, **self.kwargs)


def _strategies(module, *inputs, axis_size=2):
    """The strategies of the module's embedding or loss node on an axis of ``axis_size``."""
    node = next(
        n for n in capture(module, inputs).graph.nodes if "embedding" in str(n.target) or "loss" in str(n.target)
    )
    view = OpView(node, tuple(tuple(s.meta["val"].shape) for s in tensor_inputs(node)), output_tensors(node)[0].shape)
    return node_strategies(view, axis_size)[0]


def test_embedding_splits_its_rows_as_the_vocab_kernel_with_partial_sums_out():
    ids = torch.randint(0, 16, (2, 3))
    assert VOCAB_EMBEDDING in _strategies(Lookup(padding_idx=3), ids)
    assert VOCAB_EMBEDDING in _strategies(Lookup(), ids)
    assert VOCAB_EMBEDDING not in _strategies(Lookup(scale_grad_by_freq=True), ids)  # per-rank counts differ
    assert VOCAB_EMBEDDING not in _strategies(Lookup(), ids, axis_size=3)  # 16 rows do not split in 3


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_splits_its_class_dim_as_the_vocab_kernel_with_the_loss_whole(reduction):
    logits, target = torch.randn(6, 8), torch.randint(0, 8, (6,))
    strategies = _strategies(Loss(reduction=reduction, label_smoothing=0.1, ignore_index=2), logits, target)
    assert VOCAB_LOSS in strategies
    batch = {"mean": Partial("avg"), "sum": Partial("sum"), "none": Shard(0)}[reduction]
    assert any(s.inputs == (Shard(0), Shard(0)) and s.output == batch for s in strategies)  # the batch split stays


def test_weighted_or_unflattened_cross_entropy_keeps_its_classes_whole():
    logits, target = torch.randn(6, 8), torch.randint(0, 8, (6,))
    assert all(s.kernel != Kernel.VOCAB for s in _strategies(Loss(weight=torch.rand(8)), logits, target))
    assert all(
        s.kernel != Kernel.VOCAB for s in _strategies(Loss(), logits.view(2, 3, 8).transpose(1, 2), target.view(2, 3))
    )


def test_vocab_loss_bytes_and_time_follow_the_two_all_reduces():
    # the row maxima, then 2 sums per row (3 with label smoothing): 7/8 of 2·4·N·(1+2) bytes at p = 8
    assert vocab_loss_bytes(8192, 8) == 2 * 7 / 8 * 4 * 8192 * 3 == 172032
    assert vocab_loss_bytes(8192, 8, smoothing=True) == 2 * 7 / 8 * 4 * 8192 * 4
    assert vocab_loss_bytes(8192, 1) == 0
    link = get_profile("h100-80gb").link((8,), 8, 8)
    gathered_logits = collective_time("all_gather", 8192 * 128256 * 4, 8, link)
    two_all_reduces = sum(collective_time("all_reduce", 8192 * 4 * width, 8, link) for width in (1, 2))
    assert two_all_reduces * 20 < gathered_logits  # 8192 x 128256 fp32 logits over NVLink: 10 ms against 0.2


LLAMA3_8B_HEAD = dict(hidden=4096, layers=1, heads=32, vocab=128256, seq=8192)  # one layer of Llama-3 8B's shapes


@pytest.fixture(scope="module")
def large_vocabulary():
    model = meta_model("gpt.py", **LLAMA3_8B_HEAD)
    captured = autopar.capture(model, model.example_inputs(1, device="meta"))
    return captured, autopar.plan(captured, 8, degrees={"tp": 8}, hardware="h100-80gb", precision="fp32")


def test_the_search_splits_a_large_vocabulary_by_itself_and_no_rank_holds_full_logits(large_vocabulary):
    captured, plan = large_vocabulary
    kernels = {plan.nodes[n.name].kernel for n in captured.graph.nodes if n.name in plan.nodes}
    assert Kernel.VOCAB in kernels
    loss = next(d for d in plan.nodes.values() if "cross_entropy" in d.op)
    assert loss.kernel == Kernel.VOCAB and loss.inputs[0][-1] == Shard(1)
    # the output projection split by the vocabulary; the embedding by its rows (the vocabulary) or by its
    # columns (the hidden dim), whichever the model prices cheaper (the columns at these shapes, by 0.6%)
    assert isinstance(plan.params["tok_embeddings.weight"][-1], Shard) and plan.params["output.weight"][-1] == Shard(0)
    full_logits = 8192 * 128256 * 4
    for node in captured.graph.nodes:  # every value a rank computes, and every input an op takes, is split
        decision = plan.nodes.get(node.name)
        if decision is None or decision.output is None:
            continue
        val = node.meta["val"]
        for shape, placements in [(val.shape, decision.output)] + [
            (slot.meta["val"].shape, wanted) for slot, wanted in zip(tensor_inputs(node), decision.inputs)
        ]:
            local = math.prod(shape) // math.prod(8 for p in placements if isinstance(p, Shard))
            assert local * 4 < full_logits, (node.name, shape, placements)
    activations = plan.cost.memory["activations"] + plan.cost.memory["temporary"]
    assert activations < full_logits  # all saved activations and the backward's temporaries: less than the logits


def test_a_vocab_pin_that_cannot_hold_names_the_node():
    model = meta_model("gpt.py", hidden=32, layers=1, heads=2, vocab=130, seq=8)  # 130 classes over 4 ranks
    inputs = model.example_inputs(4, device="meta")
    with pytest.raises(ShardingRuleError, match="cross_entropy_loss.*'vocab' kernel on axis 'tp'"):
        autopar.plan(model, 4, inputs, degrees={"tp": 4}, constraints={"<top>": "vocab"})
    with pytest.raises(ShardingRuleError, match="no op of a module matching it has one"):
        autopar.plan(model, 4, inputs, degrees={"tp": 4}, constraints={"norm": "vocab"})


def test_a_batch_of_sequences_still_splits_the_head_by_columns():
    """With batch > 1 the sequence cannot pass the logits' flatten(0, 1), and the virtual axis that
    finds the sequence dims chunks the head's weight instead; that is no sequence split, so tp may
    still split the head by columns (it used to refuse the pin) and run the loss over split classes."""
    model = meta_model("gpt.py", hidden=128, layers=1, heads=4, vocab=32768, seq=256)
    captured = autopar.capture(model, model.example_inputs(8, device="meta"))
    pinned = autopar.plan(
        captured, 4, degrees={"tp": 4}, constraints={"output": "S(-1)"}, hardware="a100-80gb", precision="fp32"
    )
    free = autopar.plan(captured, 4, degrees={"tp": 4}, hardware="a100-80gb", precision="fp32")
    for plan in (pinned, free):
        assert plan.params["output.weight"][-1] == Shard(0)
        assert next(d for d in plan.nodes.values() if "cross_entropy" in d.op).kernel == Kernel.VOCAB
