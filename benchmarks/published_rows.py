"""One published training run, predicted: its model on the meta device, its configuration pinned.

A row of ``benchmarks/data/published_runs.json`` names a model (kind and shapes), a cluster (GPU
preset, count), the parallel configuration as published (tp, pp, dp, virtual stages, microbatch,
global batch, recomputation, ZeRO stage, precision) and the training stack's overlaps (one of the
file's ``stacks``). :func:`predict` builds the model, plans it with every published choice pinned
(what the source leaves out, the planner chooses: the virtual stages of an interleaved schedule
too), and turns the predicted step time into the row's published metric with the row's own FLOPs
definition.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from published_models import build

import autopar
from autopar.ir import HardwareProfile, MemoryLimitError, get_profile

DATA = Path(__file__).parent / "data" / "published_runs.json"

# Megatron's tensor-parallel layout, pinned by module (column-parallel: output split; row-parallel: partial sums)
COLUMN, ROW = "S(-1)", "P"
MEGATRON_TP = {
    "megatron-gpt": {
        "layers.*.attn.qkv": COLUMN, "layers.*.attn.proj": ROW, "layers.*.fc1": COLUMN, "layers.*.fc2": ROW,
    },
    "gpt": {
        "layers.*.attn.w[qkv]": COLUMN, "layers.*.attn.wo": ROW, "layers.*.mlp.fc1": COLUMN, "layers.*.mlp.fc2": ROW,
    },
    "llama": {
        "layers.*.attn.w[qkv]": COLUMN, "layers.*.attn.wo": ROW, "layers.*.gate": COLUMN, "layers.*.up": COLUMN,
        "layers.*.down": ROW,
    },
}  # fmt: skip
# Korthikanti et al.'s sequence parallelism: the norms split along the sequence, and their outputs
# kept as shards for backward, gathered again there (regather: Megatron-LM's
# megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication saves the
# sequence-parallel input and all-gathers it again in backward, behind the input-gradient GEMM)
NORMS = ("layers.*.attn_norm", "layers.*.mlp_norm")
# the residual stream's adds (and dropouts) too, where the model has them as modules (published_models.Residual)
RESIDUALS = {"megatron-gpt": "layers.*.*_residual", "llama": "layers.*.*_residual"}
ONE_F_ONE_B_ONLY = {"deepspeed-pipeline"}  # stacks whose pipeline cannot interleave stage modules
# Megatron's interleaving splits each stage's layers evenly into its modules (arguments.py: the
# layers per stage a multiple of --num-layers-per-virtual-pipeline-stage): where a row leaves its
# virtual stages out, the planner chooses among the counts these stacks can run, one (1F1B) included
EVEN_MODULES = {"megatron-2021", "megatron-2022", "megatron-core-2024"}


def load(path: Path = DATA) -> dict:
    return json.loads(Path(path).read_text())


def hardware_for(row: dict, stacks: dict) -> HardwareProfile:
    """The row's GPU preset with its training stack's overlaps (``tp_overlap``, ``p2p_overlap``,
    and the data-parallel share ``overlap``), how its ZeRO moves data and its microbatches'
    gradients accumulate, where the source states it, gradient buckets, and the attention kernel's
    rates where the stack runs another kernel than the preset's."""
    stack = stacks[row["stack"]]
    fixed, per_rank = stack.get("grad_bucket_params", (0, 0))  # parameters per bucket: fixed, or per dp rank
    preset = get_profile(row["hardware"])
    if "attention" in stack:
        tflops = stack["attention"]["tflops"].get(row["hardware"])
        if tflops is None:
            raise ValueError(
                f"{DATA.name}: stack {row['stack']!r} gives no attention rates for {row['hardware']!r} "
                f"(row {row['id']!r}): add them under stacks.{row['stack']}.attention.tflops"
            )
        rates = {m: {int(d): {int(s): t * 1e12 for s, t in by_s.items()} for d, by_s in by_d.items()}
                 for m, by_d in tflops.items()}  # fmt: skip
        preset = dataclasses.replace(preset, kernels=dataclasses.replace(preset.kernels, attention=rates))
    return dataclasses.replace(
        preset,
        tp_overlap=stack["tp_overlap"],
        p2p_overlap=stack["p2p_overlap"],
        overlap=stack["dp_overlap"],
        grad_bucket_bytes=4.0 * max(fixed, per_rank * row["config"]["dp"]),  # fp32 gradients; 0: autopar's
        zero3_per_parameter=stack.get("zero3_per_parameter", False),
        zero3_copies_per_rank=stack.get("zero3_copies_per_rank", False),
        zero3_persist_elements=stack.get("zero3_persist_elements", 0),
        zero3_reuse_elements=stack.get("zero3_reuse_elements", 0),
        zero1_reduce_scatter=stack.get("zero1_reduce_scatter", False),
        param_gather_overlap=stack.get("param_gather_overlap", False),
        zero_gathers_in_place=stack.get("zero_gathers_in_place", False),
        grad_accumulation_bytes=stack.get("grad_accumulation_bytes"),
    )


def options_for(row: dict, stack: dict) -> dict:
    """The planning options that pin the row's published configuration (a microbatch size the row
    leaves out: its stack's recipe's, where the stack states one)."""
    config = row["config"]
    constraints = dict(MEGATRON_TP[row["model_kind"]]) if config["tp"] > 1 else {}
    sequence_parallel = row.get("sequence_parallel") and config["tp"] > 1
    if config["tp"] > 1:  # without sequence parallelism (Megatron-LM before 2022) every rank runs them whole
        split = "S(1)" if sequence_parallel else "R"
        constraints.update(dict.fromkeys(NORMS, split))
        if row["model_kind"] in RESIDUALS:
            constraints[RESIDUALS[row["model_kind"]]] = split
    options = {
        "degrees": {"pp": config["pp"], "dp": config["dp"], "tp": config["tp"]},
        "zero": row["zero"],
        "precision": row["precision"],
        "constraints": constraints or None,
        "regather": True if sequence_parallel else None,
        "reduce_dtype": stack.get("reduce_dtype"),  # None: fp32, autopar's default
    }
    if row["recompute"] is not None:
        options["recompute"] = row["recompute"]
    microbatch = config["microbatch"] or stack.get("microbatch")
    if microbatch:
        options["microbatches"] = config["global_batch"] // config["dp"] // microbatch
    if config["pp"] > 1:  # interleaved as published; where the source does not say, as the stack runs
        unstated = "virtual stages" in row["missing"]
        interleaved = (config["virtual"] or 1) > 1 or unstated and row["stack"] not in ONE_F_ONE_B_ONLY
        options["pipeline"] = "interleaved-1f1b" if interleaved else "1f1b"
        if interleaved and not unstated:
            options["virtual"] = config["virtual"]
    return options


def flops(row: dict, params: float) -> float:
    """The row's FLOPs per iteration by its source's own definition (the data file's ``flops``)."""
    m, c = row["model"], row["config"]
    b, s, l, h, v = c["global_batch"], m["seq"], m["layers"], m["hidden"], m["vocab"]  # noqa: E741
    if row["flops"] == "narayanan":
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if row["flops"] == "megatron_model":
        return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    if row["flops"] == "palm":
        return (6 * params + 12 * l * h * s) * b * s
    if row["flops"] == "bigscience":
        return 8 * params * s * b
    if row["flops"] == "tokens":
        return b * s
    raise ValueError(f"unknown FLOPs definition {row['flops']!r}")


def flops_ratio(row: dict, model_flops: float, params: float) -> float:
    """The busiest device's FLOPs per step as autopar counts them (forward and backward, no
    recomputation) against the source's FLOPs per GPU counted alike (definitions with full
    recomputation's extra forward taken at 3/4; tokens rows by Megatron's model FLOPs): about 1
    where the stages are even, above where one holds more (the head). A check that the plan
    splits the work the published layout splits."""
    definition = {"narayanan": "megatron_model", "tokens": "megatron_model"}.get(row["flops"], row["flops"])
    counted = flops({**row, "flops": definition}, params) * (0.75 if definition == "bigscience" else 1.0)
    return model_flops / (counted / row["config"]["gpus"])


def metric(row: dict, step_s: float, params: float) -> float:
    """The row's published metric (TFLOP/s per GPU, MFU or tokens/s per GPU) at ``step_s``."""
    per_gpu = flops(row, params) / row["config"]["gpus"] / step_s
    if row["metric"] == "tflops":
        return per_gpu / 1e12
    if row["metric"] == "mfu":
        return per_gpu / get_profile(row["hardware"]).peak_flops["bfloat16"]  # MFU: of the dense 16-bit peak
    return per_gpu  # tokens


class Captures:
    """Captured graphs by model and global batch: rows that differ only in the cluster share one."""

    def __init__(self):
        self._graphs = {}

    def get(self, row: dict):
        key = (
            row["model_kind"],
            json.dumps(row["model"], sort_keys=True),
            row["config"]["global_batch"],
            row["precision"],
        )
        if key not in self._graphs:
            with torch.device("meta"):
                model = build(row["model_kind"], row["model"])
            params = sum(p.numel() for p in model.parameters())
            inputs = model.example_inputs(key[2], device="meta")
            self._graphs[key] = (autopar.capture(model, inputs, precision=row["precision"]), params)
        return self._graphs[key]


def predict(row: dict, stacks: dict, captures: Captures) -> dict:
    """Plan the row with its configuration pinned and predict its published metric.

    A configuration autopar's memory model does not fit in the GPU's memory is planned without a
    limit and flagged (``fits`` False): the run did fit, so the memory model is off there.
    """
    started = time.perf_counter()
    captured, params = captures.get(row)
    captured_s = time.perf_counter() - started
    hardware = hardware_for(row, stacks)
    mesh = (row["config"]["gpus"] // 8, 8)
    plan, fits = min(
        (_plan(captured, mesh, hardware, options) for options in _choices(row, options_for(row, stacks[row["stack"]]))),
        key=lambda planned: (not planned[1], planned[0].cost.step_s),
    )
    cost = plan.cost
    predicted = metric(row, cost.step_s, params)
    return {
        "row": row,
        "plan": plan,
        "cost": cost,
        "fits": fits and cost.peak_memory <= hardware.memory_bytes,
        "params": params,
        "predicted": predicted,
        "error": predicted / row["value"] - 1,
        "flops_ratio": flops_ratio(row, cost.model_flops, params),
        "capture_s": captured_s,
        "plan_s": time.perf_counter() - started - captured_s,
    }


def _plan(captured, mesh: tuple, hardware: HardwareProfile, options: dict) -> tuple:
    """(plan, whether it fits the GPU's memory): planned without a limit where it does not."""
    try:
        return autopar.plan(captured, mesh, hardware=hardware, **options), True
    except MemoryLimitError:
        return autopar.plan(captured, mesh, hardware=hardware, memory_limit=1e18, **options), False


def _choices(row: dict, options: dict) -> list[dict]:
    """The row's options, one per count of virtual stages its stack could run where the row leaves
    the count out and the stack splits each stage's layers evenly (``EVEN_MODULES``); else as they are."""
    layers, stages = row["model"]["layers"], row["config"]["pp"]
    if options.get("pipeline") != "interleaved-1f1b" or "virtual" in options or row["stack"] not in EVEN_MODULES:
        return [options]
    per_stage = layers // stages if layers % stages == 0 else 1
    counts = [v for v in range(1, per_stage + 1) if per_stage % v == 0]
    return [{**options, "pipeline": "1f1b"} if v == 1 else {**options, "virtual": v} for v in counts]


def size_band(params: float) -> str:
    """The size band of a model of ``params`` parameters, for the trend check."""
    for limit, name in ((10e9, "< 10B"), (100e9, "10-100B"), (300e9, "100-300B")):
        if params < limit:
            return name
    return ">= 300B"


def trend(results: list[dict]) -> tuple[float, float]:
    """(slope, its standard error) of the signed error against log10(parameters), least squares."""
    xs = [math.log10(r["params"]) for r in results]
    ys = [r["error"] for r in results]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(residual / max(1, n - 2) / sxx)
