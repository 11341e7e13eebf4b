"""Pipeline stages and microbatches against the unparallelized model: same loss, full
gradients and parameters after AdamW (fp32), for every torch pipelining schedule on PP2 and
PP4, and with data and tensor parallelism inside the stages (PP2xDP2, PP2xTP2, also with sequence
parallelism's gathered inputs regathered); ZeRO-1/2/3
over the data-parallel axis inside the stages, and its checkpoints read under other plans. Some
cases ignore targets (another count per row): each microbatch's mean then weighs by its count.
A model whose stages hand on transposed values checks that p2p moves only contiguous tensors."""

import dataclasses
import weakref

import pytest
import torch
import torch.distributed as dist
from equivalence import (
    ADAM_EPS,
    GPT_SP,
    GPT_TP,
    LEARNING_RATE,
    check_every_case,
    close,
    compare_one_step,
    load_and_compare,
    load_example,
    reference_after_one_step,
    run_case,
)
from shared_captures import build

import autopar
from autopar.ir import PIPELINES
from autopar.runtime.checkpoint import save_checkpoint
from autopar.runtime.faults import from_rank_zero
from autopar.runtime.spawn import run_local
from autopar.runtime.zero import gather as zero_gathers

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

GPT = dict(hidden=32, layers=8, heads=4, vocab=64, seq=8)  # 8 layers: 4 stages x 2 virtual


class _Transposed(torch.nn.Module):
    """Reads its input transposed and hands its output on transposed: a stage boundary after it
    sends a non-contiguous value (as Inkling-2's first stage does), and the stage after it sends
    back a non-contiguous gradient (as Zamba2's Mamba layers give); gloo moves contiguous ones only."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.proj(h.transpose(1, 2))).transpose(1, 2)


class Transposing(torch.nn.Module):
    def __init__(self, width: int = 8, seq: int = 4, layers: int = 2):
        super().__init__()
        self.width, self.seq = width, seq
        self.layers = torch.nn.ModuleList(_Transposed(width) for _ in range(layers))

    def forward(self, x, target):
        h = x.transpose(1, 2)
        for layer in self.layers:
            h = layer(h)
        return (h.transpose(1, 2) - target).square().mean()

    def example_inputs(self, batch: int):
        return tuple(torch.randn(batch, self.seq, self.width) for _ in range(2))


MODELS = {"gpt": (load_example("gpt.py").build, GPT), "transposing": (Transposing, {})}
IGNORING = dict(check_forward=True, ignore_targets=True)

TWO_RANKS = [dict(degrees={"pp": 2}, microbatches=4, pipeline=kind, check_forward=True) for kind in PIPELINES] + [
    # four stage modules per device (Megatron's virtual stages), a layer each
    dict(degrees={"pp": 2}, microbatches=4, pipeline="interleaved-1f1b", virtual=4),
    # ignored targets: a microbatch that counts fewer weighs less, as in one step on the whole batch
    dict(degrees={"pp": 2}, microbatches=2, pipeline="1f1b", stage_cuts=["layers.6"], **IGNORING),
    dict(degrees={"dp": 2}, microbatches=2, **IGNORING),  # gradient accumulation, synced once
    dict(degrees={"tp": 2}, constraints=GPT_TP, microbatches=4),
    # a plan made on the meta device, as `autopar plan` makes it (attention's strides differ there)
    dict(degrees={"pp": 2}, microbatches=4, pipeline="interleaved-1f1b", virtual=2, made_on_meta=True),
    dict(model="transposing", degrees={"pp": 2}, microbatches=2, pipeline="1f1b", stage_cuts=["layers.1"]),
]
# every schedule on 2 stages; on 4, 1F1B and ZBV (the interleaved ones: interleaved-zb on pp2 x tp2 below)
ON_FOUR = ("1f1b", "zbv")
FOUR_RANKS = [dict(degrees={"pp": 4}, microbatches=4, pipeline=kind, check_forward=True) for kind in ON_FOUR] + [
    dict(mesh="2x2", degrees={"pp": 2, "dp": 2}, microbatches=2, pipeline="1f1b", **IGNORING),
    # dp sums behind each stage module's last backward: autograd's (interleaved) or a weight pass's (zbv)
    dict(mesh="2x2", degrees={"pp": 2, "dp": 2}, microbatches=4, pipeline="interleaved-1f1b"),
    dict(mesh="2x2", degrees={"pp": 2, "dp": 2}, microbatches=2, pipeline="zbv"),
    dict(mesh="2x2", degrees={"pp": 2, "tp": 2}, constraints=GPT_TP, microbatches=2, pipeline="interleaved-zb"),
    # sequence-parallel inputs regathered inside interleaved stage modules
    dict(
        mesh="2x2",
        degrees={"pp": 2, "tp": 2},
        constraints=GPT_SP,
        microbatches=2,
        pipeline="interleaved-1f1b",
        regather=True,
    ),
]


def _run_cases(rank, world, cases):
    def one(options):
        builder, kwargs = MODELS[options.pop("model", "gpt")]
        return compare_one_step(builder, kwargs, 8, world, options)

    return [run_case(lambda: one(dict(options))) for options in cases]


def _check(options, results):
    """``results``: the case's result on every rank."""
    builder, kwargs = MODELS[options.get("model", "gpt")]
    everything = set(builder(**kwargs).state_dict())
    for result in results:  # each figure is the worst |x - ref| / (1e-6 + 1e-4·|ref|): allclose holds when <= 1
        assert "error" not in result, result["error"]
        assert result["loss"] <= 1 and result["grad"][0] <= 1 and result["param"][0] <= 1, (options, result)
        assert result["forward"] is None or result["forward"] <= 1, (options, result)
        schedule = result["schedule"]
        assert schedule.stages == options["degrees"].get("pp", 1) and schedule.microbatches == options["microbatches"]
        assert schedule.kind == options.get("pipeline", schedule.kind), (options, schedule)
        assert schedule.virtual == options.get("virtual", schedule.virtual), (options, schedule)
    assert set().union(*(r["held"] for r in results)) == everything, options  # every parameter lives somewhere
    if options["degrees"].get("pp", 1) > 1 and "dp" not in options["degrees"] and "tp" not in options["degrees"]:
        assert all(len(r["held"]) < len(everything) for r in results), options  # a stage holds its own only


@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_pipelined_training_step_matches_single_process(world, cases):
    results_by_rank = run_local(_run_cases, world, cases, timeout_s=900)
    check_every_case(
        cases, [{"ranks": list(results)} for results in zip(*results_by_rank)], lambda c, r: _check(c, r["ranks"])
    )


# ZeRO over the dp axis of each stage's sub-mesh (PP2xDP2), on plans made without ZeRO and
# given a stage (as in test_zero), so that every case sums gradients over dp; one case as users
# call it (zero=2: the search may then run a tiny model's ops on the whole batch on every dp
# rank). The zero-bubble schedules set weight gradients outside autograd's hooks (ZeRO-2:
# synced after their weight pass; ZeRO-3: reduce-scattered per parameter). The MLP
# has a leaf ZeRO leaves whole (fc1.bias: 9 elements).
ZERO_CASES = [  # ZeRO-1 in stages: the tied-embedding Qwen2 of test_unmodified_models
    ("gpt", 3, dict(pipeline="1f1b", microbatches=2), dict(check_forward=True)),
    ("gpt", 3, dict(pipeline="interleaved-zb", microbatches=4), dict(check_forward=True)),
    ("gpt", 2, dict(pipeline="zbv", microbatches=2), dict(check_forward=True)),
    ("mlp", 2, dict(pipeline="1f1b", microbatches=2), dict(how="zero=N", check_forward=True)),
]
PP2xDP2 = dict(mesh="2x2", degrees={"pp": 2, "dp": 2})
MLP_MIXED = dict(hidden=6, ffn=9, layers=2)
BATCH = 8


def _zero_pipelined(rank, world, path):
    builders = {"gpt": (load_example("gpt.py").build, GPT), "mlp": (load_example("mlp.py").build, MLP_MIXED)}
    results = []
    for name, zero, schedule, extra in ZERO_CASES:
        builder, kwargs = builders[name]
        options = dict(extra, optimizer="shards")
        if options.pop("how", "pinned plan") == "zero=N":
            options.update(PP2xDP2, zero=zero, **schedule)
        else:
            options.update(mesh=PP2xDP2["mesh"], plan=_pinned_plan(builder, kwargs, zero=zero, **PP2xDP2, **schedule))
        results.append(compare_one_step(builder, kwargs, BATCH, world, options))
    return results, _zero3_checkpoint_round_trip(load_example("gpt.py"), path)


def _pinned_plan(builder, kwargs: dict, *, mesh, degrees: dict, zero: int, **schedule):
    """The plan made without ZeRO, given ``zero``: the same data-parallel program for every stage."""
    model = build(builder, **kwargs)
    base = from_rank_zero(
        lambda: autopar.plan(model, mesh, model.example_inputs(BATCH), degrees=degrees, zero=0, **schedule),
        "planning",
    )
    assert base.grad_sync and all("dp" in axes for axes in base.grad_sync.values()), base
    return dataclasses.replace(base, zero=zero)


def _pinned(gpt, seed: int, mesh, degrees: dict, zero: int, lr: float, **schedule):
    torch.manual_seed(seed)
    model = build(gpt.build, **GPT)
    inputs = model.example_inputs(BATCH)
    pmodel = autopar.parallelize(
        model, mesh, inputs, plan=_pinned_plan(gpt.build, GPT, mesh=mesh, degrees=degrees, zero=zero, **schedule)
    )
    return pmodel, pmodel.optimizer(torch.optim.AdamW, lr=lr, eps=ADAM_EPS)


def _zero3_checkpoint_round_trip(gpt, path: str) -> dict:
    """A PP2xDP2 ZeRO-3 step (its weights gathered per layer, freed after use), saved; read
    under PP2xDP2 ZeRO-2 and DP4 ZeRO-1: the single-process parameters and AdamW moments,
    and a second step taken both ways agrees."""
    model, inputs, reference = reference_after_one_step(gpt.build, GPT, BATCH)
    pipelined = dict(degrees={"pp": 2, "dp": 2}, microbatches=2, pipeline="1f1b")
    writer, writer_optimizer = _pinned(gpt, 0, "2x2", zero=3, lr=LEARNING_RATE, **pipelined)
    gathered, unflatten = [], zero_gathers.unflatten_gathered

    def recording_unflatten(*args):
        wholes = unflatten(*args)
        gathered.append([weakref.ref(whole.untyped_storage()) for whole in wholes])
        return wholes

    zero_gathers.unflatten_gathered = recording_unflatten
    try:
        writer.train_step(*writer.shard_batch(*inputs))
    finally:
        zero_gathers.unflatten_gathered = unflatten
    writer_optimizer.step()
    save_checkpoint(writer, writer_optimizer, path)
    facts = {
        "gathers": len(gathered),
        "largest_gather": max(map(len, gathered), default=0),
        "alive_after_step": sum(ref() is not None for refs in gathered for ref in refs),
        "chunks": all(
            p.to_local().numel() * 2 == p.numel() for p in writer.parameters()
        ),  # every GPT weight splits over dp=2
    }
    readers = {
        "PP2xDP2 ZeRO-2": dict(mesh="2x2", zero=2, **pipelined),
        "DP4 ZeRO-1": dict(mesh=4, zero=1, degrees={"dp": 4}),
    }
    for name, reader in readers.items():
        facts[name] = _resume(gpt, model, reference, inputs, path, **reader)
    return facts


def _resume(gpt, model, reference, inputs, path, *, mesh, zero, degrees, **schedule) -> dict:
    """Load under another plan (other weights and learning rate: the checkpoint decides them);
    compare the parameters this rank holds with the reference, then after a second step."""
    reader, optimizer = _pinned(gpt, 1, mesh, degrees, zero, 10 * LEARNING_RATE, **schedule)
    state, loaded = load_and_compare(reader, optimizer, path, model, reference)
    loaded["held"] = sorted(state["model"])
    params = dict(model.named_parameters())
    saved = (
        {n: p.detach().clone() for n, p in params.items()},
        {p: {k: v.clone() for k, v in s.items()} for p, s in reference.state.items()},
    )
    model(*inputs).backward()  # a second step, both ways
    reference.step()
    reference.zero_grad()
    reduce_scatter, issued = dist.reduce_scatter_single, []
    dist.reduce_scatter_single = lambda *args, **kwargs: issued.append(1) or reduce_scatter(*args, **kwargs)
    try:
        reader.train_step(*reader.shard_batch(*inputs))
    finally:
        dist.reduce_scatter_single = reduce_scatter
    loaded["reduce_scatters"], loaded["buckets"] = len(issued), reader._grad_sync.num_buckets
    optimizer.step()
    loaded["second_step"] = all(close(p.full_tensor(), params[name]) for name, p in reader.named_parameters())
    with torch.no_grad():  # back to the first step for the next reader
        for name, p in params.items():
            p.copy_(saved[0][name])
        for p, s in saved[1].items():
            reference.state[p] = s
    return loaded


def test_zero_inside_pipeline_stages_matches_single_process_and_checkpoints(tmp_path):
    by_rank = run_local(_zero_pipelined, 4, str(tmp_path / "ckpt"), timeout_s=600)
    everything = {
        name: set(load_example(f"{name}.py").build(**kwargs).state_dict())
        for name, kwargs in (("gpt", GPT), ("mlp", MLP_MIXED))
    }
    for index, (name, zero, schedule, _) in enumerate(ZERO_CASES):
        results = [rank_results[0][index] for rank_results in by_rank]
        for result in results:  # each figure is the worst |x - ref| / (1e-6 + 1e-4·|ref|): allclose holds when <= 1
            assert result["loss"] <= 1 and result["grad"][0] <= 1 and result["param"][0] <= 1, (name, zero, result)
            assert result["forward"] is None or result["forward"] <= 1, (name, zero, result)
            assert (result["schedule"].stages, result["schedule"].kind) == (2, schedule["pipeline"]), result["schedule"]
        assert set().union(*(r["held"] for r in results)) == everything[name], (name, zero)
        assert all(len(r["held"]) < len(everything[name]) for r in results), (name, zero)  # a stage holds its own only
    for _, facts in by_rank:
        # a stage's 4 layers, each gathered in one collective (10 weights) per microbatch for
        # forward and again for backward (the first step also infers the stages' shapes)
        assert facts["gathers"] >= 2 * 2 * 4 and facts["largest_gather"] == 10, facts
        assert facts["alive_after_step"] == 0 and facts["chunks"], facts
        for reader in ("PP2xDP2 ZeRO-2", "DP4 ZeRO-1"):
            loaded = facts[reader]
            assert loaded["params"] and loaded["moments"] and loaded["second_step"], (reader, loaded)
            assert loaded["lr"] == LEARNING_RATE, (reader, loaded)
        # ZeRO-2 reduce-scatters each of the 2 microbatches' gradients (ZeroLayout.syncs_each_microbatch)
        assert facts["PP2xDP2 ZeRO-2"]["reduce_scatters"] == 2 * facts["PP2xDP2 ZeRO-2"]["buckets"] > 0, facts
        assert facts["DP4 ZeRO-1"]["reduce_scatters"] == 0, facts
    held = [set(facts["PP2xDP2 ZeRO-2"]["held"]) for _, facts in by_rank]
    assert held[0] == held[1] != held[2] == held[3] and set().union(*held) == everything["gpt"], (
        held
    )  # a stage's own, read
