import dataclasses
import operator

import pytest
import torch
from planning import meta_model, plan_example

import autopar
import autopar.runtime.collectives  # noqa: F401
from autopar.ir import Replicate, Shard, StalePlanError
from autopar.passes.capture.graph import capture
from autopar.passes.rewrite.loss import loss_count, loss_only
from autopar.passes.rewrite.rewrite import rewrite

GPT = dict(hidden=64, layers=1, heads=4, vocab=128, seq=16)
TP = {"layers.*.attn.w[qkv]": "S(-1)", "layers.*.attn.wo": "P", "layers.*.mlp.fc1": "S(-1)", "layers.*.mlp.fc2": "P"}


def _rewritten(plan, batch=8):
    model = meta_model("gpt.py", **GPT)
    captured = capture(model, model.example_inputs(batch, device="meta"))
    return rewrite(captured, plan, groups={"dp": "DP", "tp": "TP"}, device="cpu")


def test_megatron_plan_gets_one_all_reduce_per_row_parallel_layer_and_local_head_views():
    plan = plan_example("gpt.py", 4, batch=8, model_kwargs=GPT, degrees={"tp": 4}, constraints=TP)
    program = _rewritten(plan)
    all_reduces = [n for n in program.graph.nodes if n.target is torch.ops.autopar.all_reduce.default]
    # wo and fc2 produce partial sums; the loss needs no reduction over tp.
    assert len(all_reduces) == 2 and all(n.args[1] == "TP" for n in all_reduces)
    heads = [n for n in program.graph.nodes if n.target is torch.ops.aten.reshape.default and len(n.args[1]) == 4]
    assert heads and all(n.args[1][2] == 1 for n in heads)  # 4 heads over 4 ranks: one each
    assert "torch.ops.autopar.all_reduce.default" in program.code


def test_sequence_parallel_norm_output_is_gathered_once_for_q_k_and_v():
    sp = {**TP, "layers.*.attn_norm": "S(1)", "layers.*.mlp_norm": "S(1)"}
    plan = plan_example("gpt.py", 4, batch=8, model_kwargs=GPT, degrees={"tp": 4}, constraints=sp)
    program = _rewritten(plan)
    gathers = [n for n in program.graph.nodes if n.target is torch.ops.autopar.all_gather.default]
    gathered = [n.args[0].name for n in gathers]
    assert len(gathered) == len(set(gathered))  # each value gathered once, whatever its consumers
    qkv_input = [n for n in gathers if len(n.users) == 3]  # wq, wk, wv share the norm output's gather
    assert len(qkv_input) == 1 and all(u.target is torch.ops.aten.linear.default for u in qkv_input[0].users)
    assert qkv_input[0].args[-1] is True  # backward reduce-scatters the summed partial gradients


def test_data_parallel_plan_only_reduces_the_loss_and_its_target_count():
    # a GPU profile: this machine's profile times ops while planning, and on a busy machine a
    # tiny model's measured times can tip it to replicating a cheap op
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT, degrees={"dp": 2}, hardware="a100-80gb")
    program = _rewritten(plan)
    collectives = [n for n in program.graph.nodes if "autopar" in str(n.target)]
    assert [str(n.target) for n in collectives] == ["autopar.all_reduce.default"] * 2
    count, loss = collectives
    assert count.args[1:] == ("DP", "avg") and loss.args[1:] == ("DP", "avg")
    # the targets not ignored are counted over dp first thing, from the labels; the loss divides its sum by them
    ops = [n for n in program.graph.nodes if n.op == "call_function"]
    assert ops.index(count) < 3 and count.args[0].args[0].args[0].name == "labels"
    divide = loss.args[0]
    assert divide.target is torch.ops.aten.div.Tensor and divide.args[1] is count
    assert divide.args[0].target is torch.ops.aten.cross_entropy_loss.default and divide.args[0].args[3] == 2  # sum
    assert all(p[0] == plan.params[name][0] for name, p in plan.params.items())


def test_over_microbatches_the_mean_loss_counts_the_targets_each_microbatch_weighs_by():
    plan = plan_example("gpt.py", 1, batch=8, model_kwargs=GPT, microbatches=2, hardware="a100-80gb")
    count = loss_count(loss_only(_rewritten(plan)))
    assert count.reads == ("labels",) and not count.reductions  # one rank: nothing to sum over
    padded = torch.zeros(4, GPT["seq"], dtype=torch.long)
    padded[0, :5] = -100  # ignored targets
    shares = count.shares([{"labels": padded}, {"labels": torch.zeros_like(padded)}])
    assert shares == pytest.approx([(4 * GPT["seq"] - 5) / (8 * GPT["seq"] - 5), 4 * GPT["seq"] / (8 * GPT["seq"] - 5)])
    whole = plan_example("gpt.py", 1, batch=8, model_kwargs=GPT, hardware="a100-80gb")
    assert loss_count(loss_only(_rewritten(whole))) is None  # one microbatch: the mean stays one op


def test_a_plan_for_another_graph_is_stale():
    plan = plan_example("gpt.py", 2, batch=8, model_kwargs=GPT)
    with pytest.raises(StalePlanError, match="(?i)re-run autopar.plan"):
        _rewritten(plan, batch=4)


class _Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(16, 32), torch.nn.Linear(16, 16)

    def forward(self, x):
        gate, value = torch.split(self.inp(x), [16, 16], dim=-1)
        return self.out(gate).sum() + value.sum()


def test_a_split_piece_taken_in_another_placement_is_moved_once_taken():
    """No collective moves a tuple: a piece wanted split from a replicated split (as mamba's on TP)
    is taken whole, then chunked, once."""
    captured = capture(_Split(), (torch.randn(8, 16),))
    pins = {"inp": "R"}  # the split's input replicated, so its pieces are too, unless moved
    plan = autopar.plan(captured, 4, degrees={"tp": 4}, constraints=pins, hardware="a100-80gb", precision="fp32")
    split = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default)
    piece = next(u for u in split.users if u.args[1] == 0)
    taken = (Replicate(), Shard(1))
    assert plan.nodes[split.name].output == (Replicate(), Replicate())
    plan = dataclasses.replace(
        plan,
        nodes={**plan.nodes, piece.name: dataclasses.replace(plan.nodes[piece.name], inputs=(taken,), output=taken)},
    )
    program = rewrite(captured, plan, groups={"tp": "TP"}, device="cpu")
    piece = next(n for n in program.graph.nodes if n.target is operator.getitem and n.args[1] == 0)
    assert piece.args[0].target is torch.ops.aten.split_with_sizes.default
    (chunk,) = piece.users
    assert chunk.target is torch.ops.autopar.chunk.default and chunk.args[1:] == ("TP", 1)
    chunks = [n for n in program.graph.nodes if n.target is torch.ops.autopar.chunk.default]
    assert all(c.args[0].target is operator.getitem and c.args[0].args[0] is piece.args[0] for c in chunks)
    assert len({c.args[0] for c in chunks}) == len(chunks)  # each piece (the search splits both) chunked once


class _Positions(torch.nn.Module):
    """Makes positions on its input's device and casts them, as Hugging Face rotary embeddings do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)[None, :, None].float().expand(x.shape[0], -1, 1)
        return (self.proj(x) * positions).sum()


def test_every_device_the_captured_graph_names_becomes_the_runtimes():
    # the two-argument form captures its planning call on the CPU; on CUDA ranks a factory or
    # torch.export's _assert_tensor_metadata naming the CPU fails ("Tensor device mismatch")
    model, x = _Positions(), torch.randn(2, 4, 8)
    captured = capture(model, (x,))
    plan = autopar.plan(model, 1, (x,), hardware="a100-80gb")

    def devices(graph):
        found = []
        torch.fx.node.map_aggregate(
            [(n.args, n.kwargs) for n in graph.nodes], lambda a: found.append(a) if isinstance(a, torch.device) else a
        )
        return found

    assert devices(captured.graph) and set(devices(captured.graph)) == {torch.device("cpu")}
    program = rewrite(captured, plan, groups={"dp": "DP"}, device="meta")
    assert devices(program.graph) and set(devices(program.graph)) == {torch.device("meta")}
