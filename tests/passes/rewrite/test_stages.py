"""The stage split on a Hugging Face model: what the loss reads of the labels is computed in the
last stage (a metadata check does not pull it earlier), and the last stage returns the loss alone."""

import torch
from equivalence import load_example

from autopar.ir import Schedule
from autopar.passes.capture.graph import capture
from autopar.passes.rewrite.stages import split_stages


def test_labels_are_read_where_the_loss_is_and_only_the_loss_comes_out():
    model = load_example("hf.py").from_config("llama", hidden=32, layers=2, vocab=64, seq=16)
    tokens = torch.randint(0, 64, (4, 16))
    captured = capture(model, (), {"input_ids": tokens, "labels": tokens})
    stages = split_stages(captured.graph_module, set(captured.params), set(captured.buffers), Schedule(stages=2))
    first, last = stages
    assert "labels" in last.inputs and "labels" not in first.inputs
    received = {n.name: n.meta["val"] for n in last.graph_module.graph.nodes if n.name.startswith("received_")}
    assert received and all(value.is_floating_point() for value in received.values()), received
    (loss,) = next(n for n in last.graph_module.graph.nodes if n.op == "output").args[0]
    assert loss.meta["val"].dim() == 0
    assert not any(
        n.meta.get("val") is not None and n.meta["val"].dim() == 3 and n.meta["val"].shape[-1] == 64
        for n in last.graph_module.graph.nodes
        if n.op == "output"
    )  # the logits are not returned
