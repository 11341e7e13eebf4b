"""BatchNorm in training, captured as its means (synchronized batch norm under data parallelism),
its running statistics updated in place by the program, and no plan that would split its batch."""

import copy

import pytest
import torch
from planning import meta_model

import autopar
from autopar.ir import ConfigError, Partial, Shard
from autopar.passes.capture.graph import capture

aten = torch.ops.aten


def _model(track_running_stats: bool = True):
    """In float64: the decomposition is the same math, rounded otherwise (fp32 runs agree to ~1e-4)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8, track_running_stats=track_running_stats), torch.nn.ReLU()
    ).double()


def _run(captured, model, x):
    """The captured program on the model's own parameters and buffers (updated in place)."""
    state = {**{p: model.get_parameter(n) for p, n in captured.params.items()},
             **{b: model.get_buffer(n) for b, n in captured.buffers.items()}}  # fmt: skip
    args = [state.get(n.name, x) for n in captured.graph.nodes if n.op == "placeholder"]
    (out,) = captured.graph_module(*args)
    return out


@pytest.mark.parametrize("track_running_stats", [True, False])
def test_batch_norm_as_its_means_equals_the_module_and_updates_its_running_statistics(track_running_stats):
    model, x = _model(track_running_stats), torch.randn(6, 3, 10, 10, dtype=torch.float64, requires_grad=True)
    reference = copy.deepcopy(model)
    captured = capture(model, (x,))
    targets = {str(n.target) for n in captured.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in t for t in targets) and "aten.mean.dim" in targets
    assert torch.equal(model[1].weight, reference[1].weight)  # capture left the model as it was
    if track_running_stats:
        assert captured.buffer_updates == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
        assert model[1].num_batches_tracked.item() == 0 and not model[1].running_mean.any()
    out, expected = _run(captured, model, x), reference(x)
    torch.testing.assert_close(out, expected)
    weights = (model[0].weight, model[1].weight, x)
    grads = torch.autograd.grad(out.square().sum(), weights)
    expected_grads = torch.autograd.grad(expected.square().sum(), (reference[0].weight, reference[1].weight, x))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer)  # running statistics, the count of batches


def test_data_parallel_batch_norm_splits_its_statistics_instead_of_gathering_the_batch():
    """Each norm's means run on split inputs: the batch (partial averages, summed over the ranks) or
    the channels (each rank the whole batch's statistics of its channels), never the gathered batch."""
    model = meta_model("cnn.py", width=64, blocks=1, stages=2, image=112)
    plan = autopar.plan(model, 8, model.example_inputs(256, device="meta"), degrees={"dp": 8}, hardware="a100-80gb")
    means = [d for d in plan.nodes.values() if d.op == "aten.mean.dim"]
    assert len(means) == 2 * 6  # two per norm
    assert all(d.inputs[0][0] in (Shard(0), Shard(1)) for d in means), [d.inputs for d in means]
    assert any(d.output[0] == Partial("avg") for d in means)
    assert plan.schedule.stages == 1 and plan.schedule.microbatches == 1


@pytest.mark.parametrize("pins", [{"degrees": {"pp": 2}}, {"microbatches": 2}])
def test_a_plan_splitting_the_batch_of_a_batch_norm_is_refused_naming_it(pins):
    model = meta_model("cnn.py", width=16, blocks=1, stages=2)
    with pytest.raises(ConfigError, match=r"stem\.1 .*takes statistics over the batch.*microbatches=1"):
        autopar.plan(model, 2, model.example_inputs(8, device="meta"), **pins)


def test_eval_batch_norm_is_per_example_and_leaves_its_buffers_alone():
    model = _model().eval()
    captured = capture(model, (torch.randn(4, 3, 10, 10, dtype=torch.float64),))
    assert captured.buffer_updates == ()
    assert not any(n.target is aten.copy_.default for n in captured.graph.nodes)
