"""An error on one rank is an error on every rank, and nothing hangs silently.

One spawn of 2 ranks (a 2-stage pipeline) checks, in order: a stage split that fails on
stage 1's rank only is raised, the same ConfigError, on both ranks within seconds (before the
fix, stage 0 waited forever in the schedule's first receive); ``check_finite`` names the one
parameter whose gradient is infinite on one rank, on both ranks; an exception inside one
rank's step reaches the other, which fails with a CollectiveError naming that rank and its
error. Then, under ``autopar run``, a rank that stalls in backward makes its peer fail at the
collective timeout, naming the stalled rank and the gradient bucket (or node) it waited for, and
the job exits non-zero. In one process: a failed collective names its program node, in forward
from the traceback, in backward from what the op recorded in forward.
"""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from equivalence import load_example
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
import autopar.passes.program
from autopar.ir import wait_name
from autopar.runtime.faults import collective, compiled_wait, program_node
from autopar.runtime.spawn import run_local

ROOT = Path(__file__).resolve().parents[2]
GPT = dict(hidden=32, layers=2, heads=4, vocab=16, seq=8)
PIPELINE = dict(degrees={"pp": 2}, microbatches=2, pipeline="1f1b")
INFINITE = "norm.weight"  # in the last stage: rank 1's


def _one_rank_fails(rank: int, world: int) -> dict:
    gpt = load_example("gpt.py")
    torch.manual_seed(0)
    model = gpt.build(**GPT)
    inputs = model.example_inputs(4)
    outcomes = {}

    split = autopar.passes.program.split_stages

    def split_failing_on_stage_1(*args):
        stages = split(*args)
        if rank == 1:
            outcomes["failed_at"] = time.time()
            raise autopar.ConfigError("stage 1 cannot be split (injected on rank 1)")
        return stages

    autopar.passes.program.split_stages = split_failing_on_stage_1
    try:
        autopar.parallelize(model, world, inputs, **PIPELINE)
    except autopar.ConfigError as error:
        outcomes["split"] = (type(error).__name__, str(error), time.time())
    autopar.passes.program.split_stages = split

    pmodel = autopar.parallelize(model, world, inputs, check_finite=True, **PIPELINE)
    batch = pmodel.shard_batch(*inputs)
    if rank == 1:
        hook = pmodel._locals[INFINITE].register_hook(lambda grad: grad * float("inf"))
    try:
        pmodel.train_step(*batch)
    except autopar.NonFiniteError as error:
        outcomes["finite"] = str(error)
    if rank == 1:
        hook.remove()
        pmodel._locals[INFINITE].register_hook(lambda grad: (_ for _ in ()).throw(ValueError("injected in backward")))
    try:
        pmodel.train_step(*batch)
    except Exception as error:  # noqa: BLE001  (each rank reports what it raised)
        outcomes["step"] = (type(error).__name__, str(error))
    return outcomes


@pytest.mark.ranks
def test_an_error_on_one_rank_is_raised_on_every_rank():
    stage_0, stage_1 = run_local(_one_rank_fails, 2, timeout_s=120)
    injected = ("ConfigError", "stage 1 cannot be split (injected on rank 1)")
    assert stage_0["split"][:2] == stage_1["split"][:2] == injected
    assert stage_0["split"][2] - stage_1["failed_at"] < 5, "stage 0 learned of stage 1's failure late"

    for outcome in (stage_0, stage_1):
        assert "the loss is finite" in outcome["finite"], outcome["finite"]
        assert f"1 parameter(s): {INFINITE}." in outcome["finite"], outcome["finite"]

    kind, text = stage_0["step"]
    assert kind == "CollectiveError", stage_0["step"]
    assert "rank 0 of 2" in text and "rank 1: train_step raised" in text, text
    assert "ValueError: injected in backward" in text, text  # the root cause, under torch's schedule error


# rank 1 stalls as its backward starts; rank 0 times out in a backward collective (the gradient
# sync on a dp plan, a tensor-parallel op's dual on another), which autograd ran with no frame of
# the program: the error names its bucket or node all the same
IN_BACKWARD = (
    r"over the world \(ranks \[0, 1\]\) "
    r"(in the gradient sync of bucket \d+ \(\w|in the backward of node \w+ \(.*\) in module [\w.]+)"
)
# on a 2-stage pipeline rank 1 stalls before a step; rank 0 times out in a send or receive that
# torch's schedule waits for: the error names the stage, the values and the microbatch
BETWEEN_STAGES = (
    r"a transfer over (mesh axis pp|the world) \(ranks \[0, 1\]\) between pipeline stages \(the last this rank posted: "
    r"(receive|send) of stage 0's \w+( \w+)? \([\w ,]+\) for microbatch \d+ (to|from) rank 1"
)


@pytest.mark.parametrize(
    "fault, pins, place",
    [
        ("stall-in-backward", ["--degrees", "dp=2"], IN_BACKWARD),
        ("stall", ["--degrees", "pp=2"], BETWEEN_STAGES),
    ],
    ids=["dp", "pipeline"],
)
@pytest.mark.ranks
def test_a_stalled_rank_fails_its_peers_at_the_collective_timeout(fault, pins, place):
    timeout_s = 6
    job = subprocess.Popen(
        [sys.executable, "-m", "autopar.cli", "run", "tests/helpers/faulty_train.py", "--nproc", "2"]
        + ["--collective-timeout", str(timeout_s), "--timeout", "120", "--"]
        + ["--fault", f"0:1:2:{fault}", "--steps", "4", "--hidden", "32", "--seq", "16", "--batch", "32"]
        + ["--vocab", "16", *pins],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, stalled_at = [], None
    for line in job.stdout:  # the job's own --timeout ends it by 120 s whatever happens
        lines.append(line)
        if "[fault] rank 1 stalls" in line and "step 2" in line:
            stalled_at = time.monotonic()
    code = job.wait()
    output = "".join(lines)
    assert stalled_at is not None, output[-3000:]
    assert time.monotonic() - stalled_at < timeout_s + 30, output[-3000:]
    assert code != 0 and "rank 0 exited with code 1; terminating ranks [1]" in output, output[-3000:]
    error = next(line for line in lines if "CollectiveError: rank 0 of 2" in line)
    assert re.search(rf"{place}.* timed out \(process-group timeout {timeout_s} s\)", error), error
    assert "Ranks [1] reported nothing" in error, error


class _Block(nn.Module):
    def forward(self, x):
        return torch.ops.autopar.all_reduce(x * 2, "no-such-group", "sum")


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _Block()

    def forward(self, x):
        return self.mlp(x) + 1


def test_a_failed_collective_names_its_program_node_and_module():
    program = fx.symbolic_trace(_Model())
    try:
        program(torch.ones(2))
    except RuntimeError as error:  # the group cannot be resolved: a failure inside the collective's call
        named = program_node(error)
    assert named == "all_reduce (all_reduce = torch.ops.autopar.all_reduce(mul, 'no-such-group', 'sum')) in module mlp"


class _Sharded(nn.Module):
    def forward(self, x):  # Megatron's f: identity in forward, the gradient all-reduced in backward
        return torch.ops.autopar.grad_all_reduce(x * 2, dist.group.WORLD.group_name)


class _ShardedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Sharded()

    def forward(self, x):
        return self.attn(x).sum()


def _peer_gone(*args, **kwargs):
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")


def test_a_collective_failing_in_backward_names_the_node_it_is_the_backward_of(monkeypatch):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group_name = dist.group.WORLD.group_name
        program = fx.symbolic_trace(_ShardedModel())
        loss = program(torch.ones(3, requires_grad=True))
        with monkeypatch.context() as patched, pytest.raises(autopar.CollectiveError) as in_backward:
            patched.setattr(dist, "all_reduce", _peer_gone)
            loss.backward()  # autograd runs the all-reduce, with no frame of the program on the stack
        with pytest.raises(autopar.CollectiveError) as in_sync:  # a place given by the caller (a gradient bucket)
            with collective("gradient all-reduce", where="in the gradient sync of bucket 0 (attn.weight)"):
                _peer_gone()
    finally:
        dist.destroy_process_group()
    node = f"grad_all_reduce (grad_all_reduce = torch.ops.autopar.grad_all_reduce(mul, '{group_name}')) in module attn"
    peer_gone = "failed: a peer closed its connection (it died or exited)"
    assert program_node(in_backward.value) == "", "the traceback shows no program node: the op recorded it in forward"
    assert (
        str(in_backward.value)
        == f"rank 0: all_reduce over the world (ranks [0, 1]) in the backward of node {node} {peer_gone}"
    )
    assert str(in_sync.value) == (
        "rank 0: gradient all-reduce over the world (ranks [0, 1]) in the gradient sync of bucket 0 (attn.weight) "
        + peer_gone
    )


_GENERATED = """
def call(args):
    # Topologically Sorted Source Nodes: [{wait}], Original ATen: []
    raise RuntimeError("timed out")
"""


@pytest.mark.parametrize("moved", [False, True])
def test_a_compiled_wait_is_read_from_generated_code_wherever_the_cache_is(monkeypatch, tmp_path, moved):
    """Inductor's generated code is found by its cache folder, not by a name in its path."""
    if moved:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = Path(cache_dir()) / "written_by_test_faults"
    source = folder / "generated.py"
    folder.mkdir(parents=True, exist_ok=True)
    source.write_text(_GENERATED.format(wait=wait_name(["all_gather_3"], backward=False)))
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    try:
        with pytest.raises(RuntimeError) as raised:
            namespace["call"]([])
        waited = compiled_wait(raised.value)  # reads the generated lines: before they are removed
    finally:
        shutil.rmtree(folder)
    assert waited == "waiting for node all_gather_3"
