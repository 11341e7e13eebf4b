"""Pipeline planning: balanced cut points, the schedule choice, the memory ladder, models whose layers
cannot be cut."""

import pytest
import torch
from planning import plan_example, slow_network

import autopar
from autopar.ir import ConfigError, MemoryLimitError
from autopar.passes.search.partition import BalancedStarts
from autopar.passes.search.ranking import within_reach

LADDER_GPT = dict(hidden=1024, layers=8, heads=16, vocab=8192, seq=256)


def test_the_dynamic_program_balances_the_slowest_stage_and_prefers_small_boundaries():
    # a heavy last layer (the head rides on it): 4 light layers go to the first stage
    assert BalancedStarts([1, 1, 1, 1, 4], [0] * 5, [1] * 5)(2) == [0, 4]
    eight = BalancedStarts([1] * 8, [0] * 8, [1] * 8)
    assert eight(4) == [0, 2, 4, 6] and eight(2) == [0, 4] and eight(8) == list(range(8))  # any count, one program
    assert eight(4) == BalancedStarts([1] * 8, [0] * 8, [1] * 8)(4)  # asked for after more modules: the same
    # equal times either way: cut where the boundary activation is smaller
    assert BalancedStarts([1, 1, 1, 1], [0] * 4, [9, 9, 1, 9])(2) == [0, 2]


def test_pinned_pipeline_plans_carry_cuts_kind_and_a_bubble():
    plan = plan_example(
        "gpt.py",
        4,
        batch=8,
        model_kwargs=dict(hidden=512, layers=8, heads=8, vocab=1024, seq=128),
        hardware="a100-80gb",
        precision="fp32",  # the figures below are fp32's (the preset's own choice is bf16-mixed)
        degrees={"pp": 4, "dp": 1, "tp": 1},
        pipeline="interleaved-1f1b",
        microbatches=8,
    )
    assert plan.schedule.kind == "interleaved-1f1b" and plan.schedule.virtual == 2 and len(plan.schedule.cuts) == 7
    one = plan_example(
        "gpt.py",
        4,
        batch=8,
        model_kwargs=dict(hidden=512, layers=8, heads=8, vocab=1024, seq=128),
        hardware="a100-80gb",
        precision="fp32",  # the figures below are fp32's (the preset's own choice is bf16-mixed)
        degrees={"pp": 4, "dp": 1, "tp": 1},
        pipeline="1f1b",
        microbatches=8,
    )
    assert plan.cost.pipeline_s < one.cost.pipeline_s  # (p - 1)/(v m) against (p - 1)/m
    assert plan.cost.memory["activations"] > one.cost.memory["activations"]  # more in flight


def test_a_falling_memory_limit_walks_from_dp_to_zero_to_pipeline_stages():
    """The issue's ladder on 4 devices (recomputation pinned off): each step is what the
    previous plan's 80 % no longer fits. (ZeRO comes first: it also shortens the optimizer step.)
    16 sequences per device: GEMMs that fill an A100 (with fewer rows, splitting the rows over dp
    saves no waves and tp wins)."""
    limit, steps = None, []
    for _ in range(12):
        try:
            plan = plan_example(
                "gpt.py",
                4,
                batch=64,
                model_kwargs=LADDER_GPT,
                hardware="a100-80gb",
                precision="fp32",  # the ladder below is fp32's (the preset's own choice is bf16-mixed)
                recompute="none",
                memory_limit=limit,
            )
        except MemoryLimitError:
            break
        assert limit is None or plan.cost.peak_memory <= limit
        steps.append(plan)
        limit = plan.cost.peak_memory * 0.8
    first, *rest = steps
    assert first.degrees == {"dp": 4, "tp": 1} and first.zero == 0 and first.schedule.stages == 1
    zero = next(i for i, p in enumerate(rest) if p.zero)
    accumulated = next(i for i, p in enumerate(rest) if p.schedule.stages == 1 and p.schedule.microbatches > 1)
    split = next(i for i, p in enumerate(rest) if p.degrees["tp"] > 1)
    piped = next(i for i, p in enumerate(rest) if p.schedule.stages > 1)
    # ZeRO first, then gradient accumulation, then weights split over tp, and stages when nothing else fits
    assert zero < accumulated < split < piped == len(rest) - 1


def test_interleaved_schedules_weigh_their_stage_modules_per_device():
    """Few microbatches on two stages: the bubble shrinks with every module a device interleaves,
    and the search weighs each count (Megatron's virtual stages) as the cost model prices it."""
    options = dict(
        batch=4,
        model_kwargs=dict(hidden=1024, layers=8, heads=8, vocab=4096, seq=512),
        hardware="h100-80gb",
        degrees={"pp": 2},
        microbatches=2,
        pipeline="interleaved-1f1b",
    )
    pinned = {v: plan_example("gpt.py", 2, virtual=v, **options) for v in (2, 3, 4)}
    free = plan_example("gpt.py", 2, **options)
    fastest = min(pinned[v].cost.step_s for v in pinned)
    chosen = min(v for v in pinned if within_reach(pinned[v].cost.step_s, fastest))  # the tie rule: fewest modules
    assert chosen > 2 and free.schedule.virtual == chosen and len(free.schedule.cuts) == 2 * chosen - 1
    assert free.cost.step_s == pinned[chosen].cost.step_s
    assert pinned[4].cost.pipeline_s < pinned[2].cost.pipeline_s
    with pytest.raises(ConfigError, match="cannot run 3 stage modules per device"):
        plan_example("gpt.py", 2, **{**options, "pipeline": "zbv"}, virtual=3)
    with pytest.raises(ConfigError, match=r"virtual=0: pass a positive integer"):
        plan_example("gpt.py", 2, **options, virtual=0)
    with pytest.raises(ConfigError, match="2 stages of 5 stage modules each on 8 layers .* or stage modules"):
        plan_example("gpt.py", 2, **options, virtual=5)  # more modules than layers


def test_a_pipeline_is_chosen_without_memory_pressure_where_it_is_faster():
    """Nodes joined by a slow network: every layout fits without stages, but tensor and data
    parallelism across nodes move more bytes than a pipeline's stage boundaries."""
    hardware = slow_network()
    plan = plan_example("gpt.py", (4, 2), batch=32, model_kwargs=LADDER_GPT, hardware=hardware)
    flat = [entry for entry in plan.search if entry["stages"] == 1 and entry.get("feasible")]
    assert flat, "layouts without stages fit"
    assert plan.schedule.stages > 1
    assert plan.cost.step_s < min(entry["step_s"] for entry in flat)
    assert plan.cost.peak_memory < hardware.memory_bytes / 10  # no memory pressure


def test_without_stages_a_batch_that_does_not_fit_is_accumulated():
    """One device, recomputation pinned off: the whole batch at once needs more than the limit;
    gradient accumulation over microbatches (summed once, as one step) fits, as an expert would run it."""
    options = dict(model_kwargs=LADDER_GPT, hardware="a100-80gb", precision="fp32", recompute="none")
    whole = plan_example("gpt.py", 1, batch=16, **options)
    assert whole.schedule.microbatches == 1
    plan = plan_example("gpt.py", 1, batch=16, memory_limit=0.8 * whole.cost.peak_memory, **options)
    assert plan.schedule.stages == 1 and plan.schedule.microbatches > 1
    assert plan.cost.peak_memory <= 0.8 * whole.cost.peak_memory
    assert plan.cost.step_s >= whole.cost.step_s  # smaller GEMMs: never faster


class _Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Cycles(torch.nn.Module):
    """Its layers run ``cycles`` times over, in order each time (as HRM's reasoning cycles do)."""

    def __init__(self, layers: int, cycles: int, hidden: int = 1024):
        super().__init__()
        self.layers, self.cycles = torch.nn.ModuleList(_Block(hidden) for _ in range(layers)), cycles

    def forward(self, x):
        for _ in range(self.cycles):
            for layer in self.layers:
                x = layer(x)
        return x.pow(2).mean()


def test_layers_that_run_in_cycles_are_never_cut_into_stages():
    """Where stages pay (nodes joined by a slow network), 8 layers in order get them; 4 layers run
    twice cannot be cut by layer: the search keeps to one stage, and stages pinned are refused at
    once, naming the op that reads a later layer's value."""
    x = torch.empty(64, 512, 1024, device="meta")
    plans = {}
    for layers, cycles in ((8, 1), (4, 2)):
        with torch.device("meta"):
            model = _Cycles(layers, cycles)
        plans[cycles] = autopar.plan(model, (2, 8), (x,), hardware=slow_network(), precision="bf16-mixed")
    assert plans[1].schedule.stages == 2 and plans[2].schedule.stages == 1
    with pytest.raises(ConfigError, match=r"of layers\.0 reads a value a later layer computes.*'pp': 1"):
        autopar.plan(model, (2, 8), (x,), hardware=slow_network(), degrees={"pp": 2})
