"""The public API's user errors, in one process (a "fake" process group stands in for ranks)."""

import pytest
import torch
import torch.distributed as dist
from equivalence import load_example
from planning import meta_model
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import ConfigError, MeshError, StalePlanError


@pytest.fixture
def fake_world_of_two():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model():
    return load_example("mlp.py").build()


def test_parallelize_without_a_process_group_says_how_to_launch():
    model = _model()
    with pytest.raises(MeshError, match="autopar run"):
        autopar.parallelize(model, 2, model.example_inputs(4))


def test_a_mesh_that_does_not_match_the_world_names_both_sizes(fake_world_of_two):
    model = _model()
    with pytest.raises(MeshError, match="mesh 2x2 has 4 devices but the world has 2 ranks"):
        autopar.parallelize(model, "2x2", model.example_inputs(4))


def test_a_stale_plan_file_is_refused(fake_world_of_two, tmp_path):
    model = _model()
    path = autopar.plan(meta_model("mlp.py"), 2, model.example_inputs(8, device="meta")).save(tmp_path / "plan.json")
    with pytest.raises(StalePlanError, match="re-run autopar.plan"):
        autopar.parallelize(model, 2, model.example_inputs(4), plan=str(path))


def test_a_graph_is_planned_in_the_precision_asked_whatever_it_was_captured_in():
    """The cost model prices the policy's dtypes (the runtime captures in them again): a graph
    captured in fp32 and one captured in bf16 give the same bf16-mixed plan at the same cost."""
    model = meta_model("mlp.py")
    inputs = model.example_inputs(8, device="meta")
    options = dict(hardware="a100-80gb", precision="bf16-mixed")
    fp32 = autopar.plan(autopar.capture(model, inputs), 2, **options)
    bf16 = autopar.plan(autopar.capture(model, inputs, precision="bf16-mixed"), 2, **options)
    assert fp32.precision == bf16.precision == "bf16-mixed" and fp32.reduce_dtype == "float32"
    assert fp32.nodes == bf16.nodes and fp32.cost.step_s == bf16.cost.step_s
    assert fp32.cost.memory == bf16.cost.memory


def test_a_plan_is_not_run_in_another_precision(fake_world_of_two):
    model = _model()
    plan = autopar.plan(meta_model("mlp.py"), 2, model.example_inputs(8, device="meta"))
    with pytest.raises(ConfigError, match="dataclasses.replace"):
        autopar.parallelize(model, 2, model.example_inputs(8), plan=plan, precision="bf16-mixed")


class OneSequenceOtherwise(torch.nn.Module):
    """A model that computes otherwise for a batch of one sequence (torch.export specializes it)."""

    def __init__(self, branches: bool):
        super().__init__()
        self.branches, self.proj = branches, torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return (y.squeeze(0) if self.branches and x.shape[0] == 1 else y).pow(2).mean()


@pytest.mark.parametrize("branches, runs_in", [(True, 2), (False, 4)])
def test_a_searched_plan_runs_in_microbatches_that_capture_as_the_whole_batch(monkeypatch, branches, runs_in):
    """The search here takes 4 microbatches: of one sequence each, a model computing otherwise for
    one sequence would not run them (the runtime compares the graphs); 2 of two sequences it does."""
    from autopar import api
    from autopar.ir import Mesh, PlanOptions
    from autopar.passes.runner import PassLog

    search = api._search
    monkeypatch.setattr(
        api,
        "_search",
        lambda c, m, o, log: search(c, m, o if o.microbatches else PlanOptions.of(o, microbatches=4), log),
    )
    model, example = OneSequenceOtherwise(branches), {"x": torch.randn(4, 8)}
    options = PlanOptions.of(None, degrees={"dp": 1})
    captured = api._capture(model, (), options.precision_policy, None, example)
    plan = api._runnable_search(model, example, captured, Mesh.of(1), options, PassLog())
    assert plan.schedule.microbatches == runs_in
