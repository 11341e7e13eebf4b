"""Cost model against measurement: predicted vs measured step time and peak memory of GPT plans.

Plans of the GPT example (``examples/gpt.py``, three sizes, two batch sizes) with every
strategy autopar has (DP, Megatron TP, TP + sequence-parallel norms, DP x TP, and the
automatic plan) run on 2 and 4 local gloo ranks: ONE ``run_local`` per world size, looping
over its plans inside. Every plan is made with the calibrated profile of this machine
(``~/.cache/autopar/profiles/cpu-local-calibrated.json``; ``autopar calibrate`` makes it).

What is compared, like with like:

- time: ``plan.cost.step_s`` = compute (forward + backward roofline) + communication
  (redistributions forward + backward, the loss reduction) + gradient sync. It has no
  optimizer term, so the measured figure is ``ParallelModule.train_step`` (forward +
  backward + gradient sync), a barrier before each step, the slowest rank's time, the
  median over the timed steps. ``optimizer.step() + zero_grad()`` is timed separately
  (also after a barrier) and reported on its own.
- memory: ``plan.cost.peak_memory`` = params + grads + AdamW state + activations, per rank.
  Measured: the bytes of the live tensors the rank holds before the step (its parameter
  shards, AdamW state — the optimizer has run, so its state exists — buffers, gradient-sync
  buckets; gradients are None, as after ``zero_grad()``) plus the highest net allocation
  during ``train_step``, walked from the CPU allocator's events that
  ``torch.profiler.profile(profile_memory=True)`` records (every allocation and free of a
  block made while profiling, in order). The largest rank counts.

After the measurement the same plans are re-costed with proposed corrections (monkeypatched
here, the package untouched), so the section shows the model before and after.

Run from the repository root::

    python benchmarks/cost_model.py            # full run (~4 min), rewrites its section of BENCHMARKS.md
    python benchmarks/cost_model.py --quick    # smoke run: fewer plans and steps; prints, writes nothing
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import autopar
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from report import BENCHMARKS, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "cost_model"
PROFILE = Path.home() / ".cache" / "autopar" / "profiles" / "cpu-local-calibrated.json"
LR = 1e-3
SEED = 0
MiB = 2**20

MODELS = {
    "S": dict(hidden=128, layers=2, heads=4, vocab=512, seq=64),
    "M": dict(hidden=256, layers=2, heads=8, vocab=1024, seq=128),
    "L": dict(hidden=512, layers=2, heads=8, vocab=2048, seq=128),
}
MEGATRON_TP = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}
SEQUENCE_PARALLEL = {**MEGATRON_TP, "layers.*.attn_norm": "S(1)", "layers.*.mlp_norm": "S(1)"}

TARGET_SPEARMAN = 0.9
TARGET_MEDIAN_ERROR = 0.20
TARGET_MEMORY_ERROR = 0.20


@dataclass(frozen=True)
class Case:
    """One plan: a model size, a global batch and a strategy on ``world`` ranks."""

    model: str  # key of MODELS
    batch: int
    strategy: str  # "DP", "TP", "TP+SP", "DPxTP", "auto"
    world: int

    @property
    def name(self) -> str:
        return f"{self.model} b{self.batch} {self.strategy}"

    def degrees(self) -> dict[str, int] | None:
        return {
            "DP": {"dp": self.world, "tp": 1},
            "TP": {"dp": 1, "tp": self.world},
            "TP+SP": {"dp": 1, "tp": self.world},
            "DPxTP": {"dp": 2, "tp": self.world // 2},
            "auto": None,
        }[self.strategy]

    def constraints(self) -> dict[str, str] | None:
        return {"TP": MEGATRON_TP, "TP+SP": SEQUENCE_PARALLEL, "DPxTP": MEGATRON_TP}.get(self.strategy)


def _cases(world: int, specs: str) -> list[Case]:
    out = []
    for spec in specs.split():
        model, batch, strategy = spec.split(":")
        out.append(Case(model, int(batch), strategy, world))
    return out


FULL_CASES = {
    2: _cases(2, "M:8:DP M:8:TP M:8:TP+SP M:8:auto S:8:DP S:8:TP L:8:DP L:8:TP M:16:DP M:16:TP"),
    4: _cases(4, "M:8:DP M:8:DPxTP M:8:TP M:8:TP+SP M:8:auto S:8:DP S:8:DPxTP L:8:DP L:8:DPxTP L:8:auto M:16:DP M:16:DPxTP"),
}
QUICK_CASES = {2: _cases(2, "S:8:DP S:8:TP"), 4: _cases(4, "S:8:DP S:8:DPxTP")}


@dataclass(frozen=True)
class Settings:
    warmup_steps: int  # untimed train_step + optimizer step per plan before anything is measured
    rounds: int  # timed rounds; each round runs every plan, in alternating order
    steps_per_round: int
    timeout_s: float  # per world size


FULL = Settings(warmup_steps=3, rounds=4, steps_per_round=3, timeout_s=420)
QUICK = Settings(warmup_steps=2, rounds=2, steps_per_round=4, timeout_s=240)


def _load_gpt():
    spec = importlib.util.spec_from_file_location("autopar_examples_gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- memory


def _storages(tensors) -> dict[int, int]:
    """data_ptr → bytes of every distinct storage behind ``tensors`` (views count once)."""
    found = {}
    for tensor in tensors:
        if isinstance(tensor, torch.distributed.tensor.DTensor):
            tensor = tensor._local_tensor
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def persistent_tensors(pmodel, optimizer) -> dict[str, dict[int, int]]:
    """The storages a rank keeps between steps, by category."""
    params = list(pmodel.parameters())
    return {
        "params": _storages(params),
        "grads": _storages(p.grad for p in params if p.grad is not None),
        "optimizer": _storages(v for state in optimizer.state.values() for v in state.values()),
        "buffers": _storages(pmodel.buffers()),
        # GradSync's flat buckets (private: no public accessor), one per synced gradient byte
        "grad_buckets": _storages(bucket.buffer for bucket in pmodel._grad_sync._buckets),
    }


def _live_bytes(categories: dict[str, dict[int, int]]) -> int:
    merged = {}
    for storages in categories.values():
        merged.update(storages)
    return sum(merged.values())


def measure_memory(pmodel, optimizer, batch) -> dict:
    """Peak bytes this rank holds during one ``train_step``, and what makes them up.

    Gradients are set to None first (on the plain leaves and on the DTensor parameters that
    share their storage), so the old ones are freed before profiling: a block allocated
    before the profiler started is freed without an event, which would hide that free.
    """
    optimizer.zero_grad(set_to_none=True)
    for param in pmodel.parameters():
        param.grad = None
    gc.collect()
    before = persistent_tensors(pmodel, optimizer)
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.update(_storages([tensor]))
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            pmodel.train_step(*batch)
        with record_function("cost_model.optimizer_step"):
            optimizer.step()
    events = prof.profiler.kineto_results.events()
    split = min((e.start_ns() for e in events if e.name() == "cost_model.optimizer_step"), default=math.inf)
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    net = peak_step = peak_optimizer = 0
    net_at_split = None
    for start, nbytes in allocations:
        if start >= split and net_at_split is None:
            net_at_split = net
        net += nbytes
        if start < split:
            peak_step = max(peak_step, net)
        else:
            peak_optimizer = max(peak_optimizer, net)
    after = persistent_tensors(pmodel, optimizer)
    persistent_ids = set().union(*(set(s) for s in before.values()), *(set(s) for s in after.values()))
    baseline = _live_bytes(before)
    return {
        "baseline": baseline,
        "by_category": {k: sum(v.values()) for k, v in before.items()},
        "grads_after": sum(after["grads"].values()),
        "peak_step": baseline + peak_step,
        "peak_optimizer": baseline + peak_optimizer,
        "saved_activations": sum(n for ptr, n in saved.items() if ptr not in persistent_ids),
        # live bytes the allocator walk says remain after train_step, minus what the tensors
        # we can name hold: ~0 when the walk misses no free (a check of the method)
        "walk_residual": baseline + (net_at_split if net_at_split is not None else net) - _live_bytes(after),
    }


# --------------------------------------------------------------------------- one rank


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slowest_rank(seconds: list[float]) -> list[float]:
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def _build(gpt, case: Case):
    torch.manual_seed(SEED)
    model = gpt.build(**MODELS[case.model])
    return model, model.example_inputs(case.batch)


def bench_rank(rank: int, world: int, cases: list[Case], settings: Settings, hardware: str) -> dict:
    """Plan, build, measure memory, then time every plan in rounds; all ranks return the same."""
    gpt = _load_gpt()
    runs = []
    for case in cases:
        model, inputs = _build(gpt, case)
        plan = [None]
        if rank == 0:  # one search, shared: every rank runs the same plan
            plan[0] = autopar.plan(model, world, inputs, degrees=case.degrees(), constraints=case.constraints(), hardware=hardware)
        dist.broadcast_object_list(plan, src=0)
        pmodel = autopar.parallelize(model, world, inputs, plan=plan[0])
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
        batch = pmodel.shard_batch(*inputs)
        del model
        for _ in range(settings.warmup_steps):
            pmodel.train_step(*batch)
            optimizer.step()
            optimizer.zero_grad()
        memory = [None] * world
        dist.all_gather_object(memory, measure_memory(pmodel, optimizer, batch))
        optimizer.zero_grad()
        runs.append({"case": case, "plan": plan[0], "pmodel": pmodel, "optimizer": optimizer, "batch": batch, "memory": memory})

    step_s = {index: [] for index in range(len(runs))}
    optimizer_s = {index: [] for index in range(len(runs))}
    for round_index in range(settings.rounds):
        order = range(len(runs)) if round_index % 2 == 0 else reversed(range(len(runs)))
        for index in order:
            run = runs[index]
            for _ in range(settings.steps_per_round):
                step_s[index].append(_timed(lambda: run["pmodel"].train_step(*run["batch"])))
                optimizer_s[index].append(_timed(lambda: (run["optimizer"].step(), run["optimizer"].zero_grad())))

    # No-communication probe: the plain model's forward + backward on a data-parallel slice of
    # the batch, all ranks at once: the DP plans' compute under the same core sharing.
    probes = {}
    for key in sorted({(c.model, c.batch // world) for c in cases if c.strategy == "DP"}):
        model, inputs = _build(gpt, Case(key[0], key[1], "DP", world))

        def forward_backward():
            model(*inputs).backward()
            model.zero_grad()

        for _ in range(2):
            forward_backward()
        probes[key] = _slowest_rank([_timed(forward_backward) for _ in range(settings.rounds * settings.steps_per_round)])

    return {
        "runs": [
            {
                "case": run["case"],
                "plan": run["plan"],
                "memory": run["memory"],
                "step_s": _slowest_rank(step_s[index]),
                "optimizer_s": _slowest_rank(optimizer_s[index]),
            }
            for index, run in enumerate(runs)
        ],
        "probes": probes,
    }


def single_thread_reference(keys, repeats: int = 8) -> dict:
    """Forward + backward of the plain model in this process, one thread, nothing else running."""
    gpt = _load_gpt()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for key in keys:
            model, inputs = _build(gpt, Case(key[0], key[1], "DP", 1))
            times = []
            for index in range(repeats + 2):
                start = time.perf_counter()
                model(*inputs).backward()
                model.zero_grad()
                if index >= 2:
                    times.append(time.perf_counter() - start)
            out[key] = times
    finally:
        torch.set_num_threads(threads)
    return out
