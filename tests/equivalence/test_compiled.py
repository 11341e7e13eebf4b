"""``compile=True`` against the unparallelized model: same loss, full gradients and parameters
after AdamW (fp32), for DP (also over 2 microbatches, and on a selective scan whose decay rates
come from a parameter through exp, as Mamba's), TP+SP (also with its gathered inputs
regathered in backward), ZeRO-1, 2 and 3, PP2 (1F1B, and the zero-bubble V schedule, whose
compiled stages split their backward into input and weight passes: autopar.runtime.weight_pass),
CP2 (ring attention) and EP2 on 2 gloo ranks, in one spawn. Each case also shows that its
programs really ran compiled (one graph each: ``fullgraph=True`` raises on a break), that a
program sums its own gradients where
:func:`autopar.ir.zero.syncs_whole_in_program` says so (over microbatches, the last one's
program sums what the earlier ones accumulated), that TP+SP's matmuls ran in pieces with their
collectives (async tensor parallelism) and that the V stages ran every weight pass they split
off. Under bf16-mixed (DP, ZeRO-3) the programs cast their fp32 masters themselves, and sum
gradients in the reduce dtype asked for; these match the single-process bf16 reference within
mixed precision's tolerance (tests/equivalence/test_mixed_precision.py). Last, a rank stalls:
the other's compiled step fails at the collective timeout naming the program node its generated
code waited for.

First compiles take tens of seconds here; inductor's cache (shared by the ranks, and by
later runs) makes the models tiny and the compiles few.
"""

import copy
import dataclasses
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from equivalence import GPT_SP, assert_matches, check_every_case, compare_one_step, load_example, run_case
from mixed_precision import reference_step
from shared_captures import build
from torch.distributed.distributed_c10d import _set_pg_timeout

import autopar
from autopar.ir import EARLIER_GRAD, EXTRA_INPUTS, GRAD_CHUNK
from autopar.runtime.faults import PEER_REPORT_GRACE_S, from_rank_zero
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

GPT = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)
GPT4 = dict(GPT, layers=4)  # a V schedule runs 4 stage modules on 2 ranks
LONG = dict(hidden=32, layers=2, heads=4, vocab=64, seq=32)
MOE = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)
BATCH = 4
STALL_TIMEOUT_S = 3
IGNORING = dict(ignore_targets=True)  # another count of targets per row: the microbatches weigh by theirs


class _Decaying(torch.nn.Module):
    """A selective scan as Mamba's: its decay rates ``A = -exp(A_log)`` from a parameter. In a
    compiled data-parallel program what autograd saves for backward's recomputation of A is the
    parameter itself (its forward-identity ``grad_all_reduce`` lowered away): backward must not
    take that memory for A (Mamba's A_log came out of the step as exp(A_log))."""

    def __init__(self, width: int = 16, states: int = 8, steps: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.log_rate = torch.nn.Parameter(torch.arange(1.0, states + 1).log().repeat(width, 1))
        self.steps = steps

    def forward(self, x, target):
        rate = -torch.exp(self.log_rate)
        decay = torch.exp(rate * torch.nn.functional.softplus(self.proj(x))[..., None])  # [batch, steps, width, states]
        state, outputs = torch.zeros_like(decay[:, 0]), []
        for step in range(self.steps):
            state = decay[:, step] * state + x[:, step, :, None]
            outputs.append(state.sum(-1))
        return ((torch.stack(outputs, 1) - target) ** 2).mean()

    def example_inputs(self, batch: int):
        return tuple(torch.randn(batch, self.steps, self.proj.in_features) for _ in range(2))


CASES = [
    ("DP", "gpt", GPT, dict(degrees={"dp": 2})),
    ("DP, a parameter through exp", _Decaying, {}, dict(degrees={"dp": 2})),
    ("TP+SP", "gpt", GPT, dict(degrees={"tp": 2}, constraints=GPT_SP, async_tp=True)),
    ("TP+SP regather", "gpt", GPT, dict(degrees={"tp": 2}, constraints=GPT_SP, regather=True)),
    ("DP 2 microbatches", "gpt", GPT, dict(degrees={"dp": 2}, microbatches=2, **IGNORING)),
    ("ZeRO-1", "gpt", GPT, dict(degrees={"dp": 2, "tp": 1}, zero=1)),
    ("ZeRO-2", "gpt", GPT, dict(degrees={"dp": 2, "tp": 1}, zero=2, optimizer="shards")),
    ("ZeRO-3", "gpt", GPT, dict(degrees={"dp": 2, "tp": 1}, zero=3)),
    ("PP2", "gpt", GPT, dict(degrees={"pp": 2, "dp": 1, "tp": 1}, microbatches=2, pipeline="1f1b", **IGNORING)),
    ("PP2 zbv", "gpt", GPT4, dict(degrees={"pp": 2, "dp": 1, "tp": 1}, microbatches=2, pipeline="zbv", **IGNORING)),
    ("CP2", "long_context_gpt", LONG, dict(degrees={"cp": 2}, constraints={"layers.*.attn": "ring"})),
    ("EP2", "moe_gpt", MOE, dict(degrees={"ep": 2}, constraints={"layers.*.moe": "experts"})),
]


SYNCED_IN_PROGRAM = {"DP", "DP, a parameter through exp", "DP 2 microbatches", "ZeRO-1", "ZeRO-2", "ZeRO-3"}
MIXED_CASES = [  # (name, reduce dtype, ZeRO stage): bf16-mixed, compiled, data parallel
    ("DP bf16, reduced in fp32", "float32", 0),
    ("ZeRO-3 bf16, reduced in fp32", "float32", 3),
]
UNIT_ROUNDING_BF16 = 2.0**-8


def _compiled_case(rank: int, world: int, name: str, file: str, kwargs: dict, options: dict) -> dict:
    builder = file if callable(file) else load_example(f"{file}.py").build
    if options.get("zero"):  # data parallel's own plan, ZeRO on top (the search may otherwise replicate the batch)
        planning = {key: value for key, value in options.items() if key != "optimizer"}
        options = dict(
            plan=_data_parallel_plan(builder(**kwargs), world, planning), optimizer=options.get("optimizer", "dtensor")
        )
    return compare_one_step(builder, kwargs, BATCH, world, {**options, "compile": True}, inspect=_compiled)


def _data_parallel_plan(model, world: int, options: dict):
    """The plan searched for ``options`` without ZeRO, given their ZeRO stage."""
    base = from_rank_zero(
        lambda: autopar.plan(model, world, model.example_inputs(BATCH), **{**options, "zero": 0}), "planning"
    )
    return dataclasses.replace(base, zero=options["zero"])


def _mixed_case(world: int, reduce_dtype: str, zero: int) -> dict:
    """One bf16-mixed compiled step against the single-process bf16 reference (relative L2 error
    of the loss and of each full gradient), and the dtypes the program's gradient sums ran in."""
    torch.manual_seed(0)
    model = build(load_example("gpt.py").build, **GPT)
    inputs = model.example_inputs(BATCH)
    options = dict(degrees={"dp": 2}, precision="bf16-mixed", reduce_dtype=reduce_dtype, zero=zero)
    pmodel = autopar.parallelize(model, world, inputs, plan=_data_parallel_plan(model, world, options), compile=True)
    reference = copy.deepcopy(model)
    ref_loss, ref_grads = reference_step(reference, inputs, torch.bfloat16, torch.optim.SGD(reference.parameters()))
    loss = pmodel.train_step(*pmodel.shard_batch(*inputs))
    grads = {name: param.grad.full_tensor() for name, param in pmodel.named_parameters()}
    graph = pmodel.program.graph
    ops = torch.ops.autopar
    return {
        "loss": ((loss.float() - ref_loss.float()).abs() / ref_loss.float().abs()).item(),
        "grad": max((((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item(), n) for n in ref_grads),
        "grad_dtypes": {grad.dtype for grad in grads.values()},
        "all_reduced": {
            node.args[0].meta["val"].dtype
            for node in graph.find_nodes(op="call_function", target=ops.grad_all_reduce.default)
        },
        "gathered": {
            (node.args[0][0].meta["val"].dtype, node.args[4])
            for node in graph.find_nodes(op="call_function", target=ops.zero_gather_layer.default)
        },
        **_compiled(pmodel),
    }


def _compiled(module) -> dict:
    """Whether each program ran compiled, and who sums the gradients."""
    compiler = module._compiler
    return {
        "compiled": [program.compile_s is not None for program in compiler._compiled.values()],
        "pieced": sum(program.prepared for program in compiler._compiled.values()),  # async TP's collectives
        "weight_passes": [  # a zero-bubble stage's split backward: whether a weight pass is left untaken
            program.weight_passes.last is not None for program in compiler._compiled.values() if program.weight_passes
        ],
        "synced_in_program": len(compiler.synced_in_program),
        "synced_by_runtime": module._grad_sync.num_buckets,
        "extra_inputs": {
            kind for program in compiler._compiled.values() for kind, _ in program.program.meta.get(EXTRA_INPUTS, ())
        },
    }


def _run(rank: int, world: int) -> tuple[list[dict], list[dict], str]:
    return (
        [run_case(lambda case=case: _compiled_case(rank, world, *case)) for case in CASES],
        [run_case(lambda case=case: _mixed_case(world, *case[1:])) for case in MIXED_CASES],
        _stalled(rank),
    )


def _stalled(rank: int) -> str:
    """Rank 1 stalls past a short collective timeout; what rank 0's compiled step raises (inductor's
    generated code waits for the collectives: the error must still name the program node)."""
    torch.manual_seed(0)
    model = build(load_example("gpt.py").build, **GPT)
    pmodel = autopar.parallelize(
        model, 2, model.example_inputs(BATCH), degrees={"tp": 2}, constraints=GPT_SP, compile=True
    )
    batch = pmodel.shard_batch(*model.example_inputs(BATCH))
    pmodel.train_step(*batch)  # compiled (and timed) with the usual timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        _set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S), group)
    dist.barrier()
    if rank == 1:
        time.sleep(2 * STALL_TIMEOUT_S + PEER_REPORT_GRACE_S)
        return ""
    try:
        pmodel.train_step(*batch)
    except autopar.CollectiveError as error:
        return str(error)
    return "no error"


def _check(case, result):
    name = case[0]
    assert_matches(name, result)
    assert result["schedule"].compiled, result
    assert result["compiled"] and all(result["compiled"]), result  # every program ran compiled
    if name == "TP+SP":  # its gathers before linears (and the all-reduces after) ran in pieces
        assert result["pieced"] > 0, result
    if name == "TP+SP regather":  # each layer's two norm outputs gathered for linears kept as shards
        assert result["kernels"].count("regather") == 4, result
    if name in SYNCED_IN_PROGRAM:  # the programs sum: the runtime, nothing
        assert result["synced_in_program"] > 0 and result["synced_by_runtime"] == 0, result
    if name == "DP 2 microbatches":  # the first microbatch's program sums nothing; the last sums both
        assert len(result["compiled"]) == 2 and result["extra_inputs"] == {EARLIER_GRAD}, result
    if name == "ZeRO-2":  # reduce-scattered into the chunk leaves the program takes
        assert result["extra_inputs"] == {GRAD_CHUNK}, result
    # V stages split their compiled backward, and the schedule ran every weight pass; no other program splits
    assert result["weight_passes"] == ([False, False] if name == "PP2 zbv" else []), result


def _check_mixed(case, result):
    name, reduce_dtype, zero = case
    tolerance = 16 * UNIT_ROUNDING_BF16  # as tests/equivalence/test_mixed_precision.py argues
    assert result["loss"] <= tolerance and result["grad"][0] <= tolerance, result
    assert result["grad_dtypes"] == {torch.float32}, result  # on the fp32 masters
    assert all(result["compiled"]) and result["synced_by_runtime"] == 0, result
    if zero == 3:  # fp32 shards in, gathered in bf16; so backward reduce-scatters the shards' fp32
        assert result["gathered"] == {(torch.float32, torch.bfloat16)}, result
    else:  # summed on the fp32 masters, then cast to bf16 (which sum runs in which order: tests/passes/rewrite)
        assert result["all_reduced"] == {getattr(torch, reduce_dtype)}, result


def test_compiled_training_step_matches_single_process():
    results, mixed, stalled = run_local(_run, 2, timeout_s=900)[0]
    check_every_case(CASES, results, _check)
    check_every_case(MIXED_CASES, mixed, _check_mixed)
    # a collective of the compiled forward (TP+SP's first all-gather) waits for rank 1 in vain
    named = (
        r"rank 0 of 2: a collective in a compiled program waiting for node all_gather\w* "
        rf"timed out \(process-group timeout {STALL_TIMEOUT_S} s\)"
    )
    assert re.search(named, stalled) and "Ranks [1] reported nothing" in stalled, stalled
