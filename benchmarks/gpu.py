"""One GPU: the cost model's kernel rules and a one-GPU training step against what was measured,
and autopar's runtime on CUDA (NCCL, one rank), eager and compiled.

The record holds measurements only, each part written as soon as it is measured; every prediction
is made when the record is rendered (:func:`price`), by the cost model of the code that renders it:

- ``kernels``: every GEMM (forward and both backward products) and the fused attention of a
  transformer layer of each Megatron-Core r0.8 H100 row (published_runs.json), at its tensor
  parallelism and one sequence per microbatch, timed back to back in bfloat16; priced by
  ``gemm_seconds`` / ``attention_seconds`` on the device's preset (and on the profile
  ``autopar calibrate --backend nccl`` wrote on the same machine, when given);
- ``attention_occupancy``: attention over 1 to 128 heads of one sequence (how the rate falls as
  fewer blocks fill the GPU);
- ``equivalence``: the GPT example in fp32 on CUDA, autopar eager and compiled against the plain
  model: first loss and every full gradient;
- ``optimizer``: one AdamW step over 740 M fp32 parameters, foreach and fused; ``casts``: eager
  float32 <-> bfloat16 casts (priced at the streaming and the widening rate);
- ``hf_families``: unmodified Hugging Face families (small configs, as the coverage benchmark builds
  them) through ``autopar.parallelize(model, 1)`` on CUDA, fp32, eager and (a few) compiled: one
  step's loss, full gradients and parameters after AdamW against the plain model on the same GPU
  (benchmarks/families.one_step); ``other_models``: benchmarks/other_models.py's, likewise;
- ``steps``: the GPT example at Megatron-Core's 1.7B and 7.1B layer shapes (fewer layers, one
  sequence), the 1.7B row's whole model (24 layers, its 4 sequences per GPU as microbatches) and
  Llama 3 8B's layers (4 of them, torchtitan's 2 x 8192 tokens per GPU), bf16 mixed precision:
  autopar's step, eager and compiled, and the plain model under ``torch.autocast``, eager and
  ``torch.compile`` (compile time is the first step's, reported apart), with the eager steps'
  device time per kind of kernel; priced by autopar's plan. Every shape's eager runs come first,
  so a run cut short by its time limit still has them.

Run on a GPU machine, from the repository root (the record and the profile then travel back)::

    autopar calibrate --backend nccl --out gpu-calibrated.json
    python benchmarks/gpu.py --out gpu.json          # measures (~6 minutes on an H100; --parts steps ...)
    python benchmarks/gpu.py --render h200.json h100.json --calibrated h200-cal.json h100-cal.json  # BENCHMARKS.md
    python benchmarks/gpu.py --quick --out /tmp/x.json           # CPU smoke run: tiny shapes, gloo

autopar must be installed there (`pip install --no-deps --no-build-isolation --target DIR .`, then
PYTHONPATH=DIR, run from outside the checkout): the package maps ``passes/`` and ``runtime/`` into
``autopar`` only when installed, so the checkout on ``sys.path`` does not import.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from gpu_report import KINDS, render  # noqa: E402
from publish import write_section  # noqa: E402
from published_models import build as build_model  # noqa: E402
from step_time import _load_gpt  # noqa: E402

import autopar  # noqa: E402
from autopar.ir import HardwareProfile, get_profile  # noqa: E402
from autopar.passes.cost.calibration import gpu_preset  # noqa: E402
from autopar.passes.cost.efficiency import attention_seconds, gemm_list, gemm_seconds  # noqa: E402
from autopar.passes.cost.ops import accumulation_s, optimizer_time  # noqa: E402
from autopar.runtime.measure import timed  # noqa: E402
from autopar.runtime.measure_gpu import CAST_ELEMENTS, measure_attention, measure_casts, measure_gemms  # noqa: E402

SECTION = "gpu"
ROWS = Path(__file__).parent / "data" / "published_runs.json"
GROUP = "Megatron-Core r0.8 H100"
STEPS = {  # name: the model (published_models' kind and shapes) and sequences per step (one microbatch
    # each). Megatron-Core's 1.7B and 7.1B rows with fewer layers; the 1.7B row whole
    # with its 4 sequences per GPU; Llama 3 8B's layers at torchtitan's 2 x 8192 tokens per GPU
    "1.7B layers": dict(kind="gpt", shape=dict(hidden=2048, heads=16, ffn=8192, vocab=131072, seq=4096, layers=4)),
    "7.1B layers": dict(kind="gpt", shape=dict(hidden=4096, heads=32, ffn=16384, vocab=131072, seq=4096, layers=2)),
    "1.7B model": dict(
        kind="gpt", shape=dict(hidden=2048, heads=16, ffn=8192, vocab=131072, seq=4096, layers=24), sequences=4
    ),
    "Llama 3 8B layers": dict(
        kind="llama",
        shape=dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, layers=4),
        sequences=2,
    ),
}
QUICK_STEPS = {
    "tiny": dict(kind="gpt", shape=dict(hidden=64, heads=4, ffn=256, vocab=512, seq=64, layers=2), sequences=2),
    "tiny llama": dict(kind="llama", shape=dict(hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64, layers=2)),
}
HF_FAMILIES = ("llama", "mixtral", "qwen3_moe", "gemma3_text", "deepseek_v3", "gpt2", "falcon", "mamba", "jetmoe")
HF_COMPILED = ("llama", "qwen3_moe")
TIMED_STEPS, WARMUP_STEPS = 10, 3
STEP_PINS = dict(precision="bf16-mixed", recompute="none", zero=0)
RUNS = (  # (label, compiled): the eager runs first, so a run cut short still has them
    ("autopar eager", False),
    ("torch autocast eager", False),
    ("autopar compiled", True),
    ("torch autocast compiled", True),
)


_STARTED = time.monotonic()


def _log(message: str) -> None:
    print(f"[gpu {time.monotonic() - _STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def _rows() -> list[dict]:
    return [row for row in json.loads(ROWS.read_text())["rows"] if row.get("group") == GROUP]


def layer_gemms(model: dict, tp: int, tokens: int) -> dict[str, tuple]:
    """A layer's forward GEMMs (batch, m, n, k) at tensor parallelism ``tp``, and the logits'."""
    h, d = model["hidden"], model["hidden"] // model["heads"]
    qkv = (model["heads"] + 2 * model["kv_heads"]) * d
    return {
        "qkv": (1, tokens, qkv // tp, h),
        "proj": (1, tokens, h, h // tp),
        "fc1": (1, tokens, model["ffn"] // tp, h),
        "fc2": (1, tokens, h, model["ffn"] // tp),
        "logits": (1, tokens, model["vocab"] // tp, h),
    }


def measure_kernels(device: str, quick: bool) -> list[dict]:
    """Per Megatron-Core row: the seconds of its layer's GEMMs (each fwd + 2 bwd), its logits GEMMs
    and its attention (fwd + bwd), measured."""
    results = []
    for row in _rows()[:2] if quick else _rows():
        model, tp = dict(row["model"]), row["config"]["tp"]
        if quick:  # the same structure at a CPU's scale
            model.update(hidden=model["hidden"] // 32, ffn=model["ffn"] // 32, vocab=model["vocab"] // 256, seq=256)
        d = model["hidden"] // model["heads"]
        entry = {"row": row["id"], "tp": tp, "model": model, "gemms": {}}
        for name, forward in layer_gemms(model, tp, model["seq"]).items():
            shapes = gemm_list(forward, needs_grad=True)
            each = [g["seconds"] for g in measure_gemms(shapes, "bfloat16", device)]
            entry["gemms"][name] = {"shapes": shapes, "measured_each_s": each, "measured_s": sum(each)}
        heads = max(1, model["heads"] // tp)
        (record,) = measure_attention([(1, heads, model["seq"], d, True)], "bfloat16", device)
        entry["attention"] = {"measured_s": record["seconds"]}
        results.append(entry)
        _log(f"kernels: {row['id']}")
    return results


OCCUPANCY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch x heads per GPU: how many blocks the kernel runs
OCCUPANCY_SEQS = (1024, 4096, 16384)


def measure_attention_occupancy(device: str, quick: bool) -> list[dict]:
    """Causal attention, head size 128, one sequence of each length over 1 to 128 heads (and the
    full mask and head size 64 at one length): how the rate falls as fewer blocks fill the GPU."""
    heads, seqs = (OCCUPANCY_HEADS[:2], (64,)) if quick else (OCCUPANCY_HEADS, OCCUPANCY_SEQS)
    cases = [(1, h, seq, 128, True) for seq in seqs for h in heads]
    if not quick:
        cases += [(1, h, 4096, 128, False) for h in (1, 4, 16, 64)] + [(1, h, 4096, 64, True) for h in (2, 8, 32, 128)]
    return measure_attention(cases, "bfloat16", device)


def _timed_steps(step, device: str) -> dict:
    """First step (compile, if any) timed apart, then the median of TIMED_STEPS after warm-up."""
    losses = []
    first = timed(lambda: losses.append(step()), device)
    for _ in range(WARMUP_STEPS - 1):
        step()
    times = [timed(step, device) for _ in range(TIMED_STEPS)]
    return {"first_s": first, "median_s": statistics.median(times), "times_s": times, "first_loss": float(losses[0])}


def _autopar_step(pmodel, inputs):
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        loss = pmodel.train_step(*inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _torch_step(model, inputs, device: str, compile: bool, microbatches: int):
    """The plain model's step under autocast: ``microbatches`` forward-backward passes, gradients
    accumulated (each loss scaled by 1 / microbatches: the loss of the whole batch), then AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compile else model
    chunks = list(zip(*(t.chunk(microbatches) for t in inputs)))

    def step():
        total = 0.0
        for chunk in chunks:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = forward(*chunk) / microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def check_equivalence(device: str) -> dict:
    """fp32 on the device: autopar eager and compiled against the plain model, one step."""
    gpt = _load_gpt()
    torch.manual_seed(0)
    model = gpt.build(hidden=64, layers=2, heads=4, vocab=256, seq=32)
    inputs = tuple(t.to(device) for t in model.example_inputs(4))
    reference = copy.deepcopy(model).to(device)
    loss = reference(*inputs)
    loss.backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    results = {}
    for label, compile in (("eager", False), ("compiled", True)):
        pmodel = autopar.parallelize(copy.deepcopy(model), "1", inputs, precision="fp32", compile=compile)
        ploss = pmodel.train_step(*inputs)
        full = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in pmodel.named_parameters()
            if p.grad is not None
        }
        worst = max((float((full[n].to(device) - g).abs().max()) for n, g in grads.items() if n in full), default=None)
        results[label] = {
            "loss": float(ploss),
            "reference_loss": float(loss),
            "loss_diff": abs(float(ploss) - float(loss)),
            "max_grad_diff": worst,
            "grads_compared": sum(n in full for n in grads),
        }
        _log(f"equivalence {label}: {results[label]}")
    return results


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its name: cuBLAS / CUTLASS GEMMs, flash / memory-efficient
    attention, the optimizer's multi-tensor kernels, and the rest (elementwise, reductions, copies)."""
    lowered = name.lower()
    if any(mark in lowered for mark in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "GEMM"
    if any(mark in lowered for mark in ("flash", "fmha", "attention", "mem_eff")):
        return "attention"
    if any(mark in lowered for mark in ("multi_tensor", "adam")):
        return "optimizer"
    return "other ops"


def measured_by_kind(step, device: str, steps: int = 2) -> dict[str, float]:
    """Device seconds per step of each kind of kernel (torch.profiler), and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        wall = timed(lambda: [step() for _ in range(steps)], device) / steps
    totals = dict.fromkeys(KINDS, 0.0)
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device == "cuda" and us:
            totals[kernel_kind(event.key)] += us / 1e6 / steps
            kernels.append((us / 1e6 / steps, event.count // steps, kernel_kind(event.key), event.key[:160]))
    top = [dict(seconds=t, calls=c, kind=k, name=n) for t, c, k, n in sorted(kernels, reverse=True)[:40]]
    return {**totals, "wall (profiled)": wall, "top kernels": top}


def predicted_by_kind(captured, hardware: HardwareProfile, plan, sequences: int = 1) -> dict[str, float]:
    """The cost model's one-GPU seconds per kind: every node's forward + backward for one sequence
    (``captured``), ``sequences`` times, GEMMs and attention by their paced rules; the optimizer's
    update; mixed precision's casts of every parameter and the accumulation of every sequence's
    gradients after the first (copy and add kernels, so among the other ops)."""
    from autopar.passes.cost.efficiency import ATTENTION, GEMMS
    from autopar.passes.cost.facts import analyze

    totals = dict.fromkeys(KINDS, 0.0)
    elements = 0.0
    for fact in analyze(captured, hardware, policy=plan.precision_policy).values():
        if fact.kind == "op":
            target = fact.node.target
            kind = "GEMM" if target in GEMMS else "attention" if target is ATTENTION else "other ops"
            totals[kind] += fact.full_time_s * sequences
        elif fact.kind == "param":
            elements += math.prod(fact.out_shape)
            totals["other ops"] += (sequences - 1) * accumulation_s(math.prod(fact.out_shape), fact, 0, 1, hardware)
    totals["optimizer"] = optimizer_time(elements, hardware)
    totals["other ops"] += optimizer_time(0, hardware, recast=elements if plan.precision_policy.mixed else 0)
    return totals


def _build(spec: dict, device=None) -> torch.nn.Module:
    torch.manual_seed(0)
    if device is None:
        return build_model(spec["kind"], spec["shape"])
    with torch.device(device):
        return build_model(spec["kind"], spec["shape"])


def measure_steps(preset: HardwareProfile, device: str, quick: bool, results: list, save, only=None) -> list[dict]:
    """autopar's one-GPU step, eager and compiled (planned on ``preset``), and the plain model's:
    every shape's eager runs first, so a record cut short by the time limit still has them.
    ``only``: the names of the shapes to measure (all by default)."""
    steps = {name: spec for name, spec in (QUICK_STEPS if quick else STEPS).items() if not only or name in only}
    entries = {name: {"name": name, **spec, "runs": {}} for name, spec in steps.items()}
    results.extend(entries.values())
    for compiled in (False, True):
        for name, spec in steps.items():
            entry, sequences = entries[name], spec.get("sequences", 1)
            model = _build(spec)
            inputs = tuple(t.to(device) for t in model.example_inputs(sequences))
            pins = dict(hardware=preset, microbatches=sequences, **STEP_PINS)
            for label, compile in RUNS:
                if compile != compiled:
                    continue
                try:
                    if label.startswith("autopar"):
                        runner = autopar.parallelize(copy.deepcopy(model), "1", inputs, compile=compile, **pins)
                        step = _autopar_step(runner, inputs)
                    else:
                        runner = copy.deepcopy(model).to(device)
                        step = _torch_step(runner, inputs, device, compile, sequences)
                    entry["runs"][label] = _timed_steps(step, device)
                    if not compile:  # where the eager steps' time goes
                        entry.setdefault("measured_by_kind", {})[label] = measured_by_kind(step, device)
                except Exception as error:  # one run failing leaves the others to run
                    entry["runs"][label] = _failure(error)
                runner = step = None
                gc.collect()  # the next run needs the GPU memory this one held: nothing left to a later collection
                if device == "cuda":
                    torch.cuda.empty_cache()
                save()  # a run cut short still leaves the runs it measured
                _log(f"steps {name}: {label} {entry['runs'][label]}")
    return results


OPTIMIZER_PARAMS = 740_000_000  # the 1.7B layers' shape: 4 layers, two 131072 x 2048 embeddings


def measure_optimizer(device: str, quick: bool) -> list[dict]:
    """One AdamW step over fp32 parameters with gradients, foreach (autopar's and torch's default)
    and fused (one kernel per tensor list, as Megatron's and Transformer Engine's Adam)."""
    elements = 1_000_000 if quick else OPTIMIZER_PARAMS
    sizes = [elements // 64] * 64  # tensors of a few sizes, as a model's are
    params = [torch.zeros(size, device=device, requires_grad=True) for size in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    results = []
    for label, options in (("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        if label == "fused" and device != "cuda":
            continue
        adamw = torch.optim.AdamW(params, lr=1e-4, **options)
        adamw.step()  # warm-up: allocates the moments
        seconds = min(timed(adamw.step, device) for _ in range(TIMED_STEPS))
        results.append({"optimizer": label, "elements": sum(sizes), "seconds": seconds})
        del adamw
    return results


def check_hf_families(device: str, quick: bool) -> list[dict]:
    """Each of HF_FAMILIES (``llama`` alone in a smoke run) through the two-argument form on one
    rank of ``device``, eager and, for HF_COMPILED, compiled: one step against the plain model."""
    from families import one_step  # transformers: imported only by the part that needs it

    results = []
    for family in HF_FAMILIES[:1] if quick else HF_FAMILIES:
        for label, pins in (("eager", {}), ("compiled", {"compile": True})):
            if pins and family not in HF_COMPILED:
                continue
            try:
                started = time.perf_counter()
                result = one_step(family, {"mesh": 1, "precision": "fp32", **pins}, device)
                result["step_s"] = time.perf_counter() - started - result["plan_s"]
            except Exception as error:  # one family failing leaves the others to run
                result = _failure(error)
            results.append({"family": family, "program": label, **result})
            _log(f"hf {family} {label}: {result}")
    return results


def _failure(error: Exception) -> dict:
    """What a failed part or run leaves in the record (and on stderr)."""
    failure = {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    _log(f"failed: {failure['traceback']}")
    return failure


def price(record: dict, calibrated: Path | None) -> dict:
    """``record`` with every prediction made afresh by this code's cost model: on the device's
    preset and, when given, on the profile `autopar calibrate --backend nccl` wrote beside it."""
    profiles = {"preset": get_profile(record["preset"])}
    if calibrated is not None:
        profiles["calibrated"] = HardwareProfile.load(calibrated)
    for entry in record["kernels"] if isinstance(record.get("kernels"), list) else ():
        for part in entry["gemms"].values():
            for label, p in profiles.items():
                part[f"{label}_s"] = sum(gemm_seconds(m, n, k, "bfloat16", 2, p, b) for b, m, n, k in part["shapes"])
        model, heads = entry["model"], max(1, entry["model"]["heads"] // entry["tp"])
        d = model["hidden"] // model["heads"]
        for label, p in profiles.items():
            entry["attention"][f"{label}_s"] = attention_seconds(heads, model["seq"], model["seq"], d, True, p, True)
    for r in record["attention_occupancy"] if isinstance(record.get("attention_occupancy"), list) else ():
        for label, p in profiles.items():
            r[f"{label}_s"] = attention_seconds(r["heads"], r["seq"], r["seq"], r["head_dim"], r["causal"], p, True)
    for r in record["optimizer"] if isinstance(record.get("optimizer"), list) else ():
        r["preset_s"] = optimizer_time(r["elements"], profiles["preset"])
    if isinstance(record.get("casts"), dict) and "error" not in record["casts"]:
        rates = lambda p: dict(narrowing=p.streaming_bandwidth, widening=p.widening_bandwidth)  # noqa: E731
        record["casts_priced"] = {label: rates(p) for label, p in profiles.items()}
    for entry in record["steps"] if isinstance(record.get("steps"), list) else ():
        spec = {"kind": "gpt", **entry}  # a record of before the kinds: examples/gpt.py, one sequence
        sequences = spec.get("sequences", 1)
        model = _build(spec, "meta")
        captured = autopar.capture(model, model.example_inputs(sequences), precision=STEP_PINS["precision"])
        pins = dict(hardware=profiles["preset"], microbatches=sequences, **STEP_PINS)
        plan, compiled = (autopar.plan(captured, "1", compile=compile, **pins) for compile in (False, True))
        one = autopar.capture(model, model.example_inputs(1), precision=STEP_PINS["precision"])
        entry.update(
            predicted_step_s=plan.cost.step_s,
            predicted_compiled_s=compiled.cost.step_s,
            model_flops=plan.cost.model_flops,
            predicted_by_kind=predicted_by_kind(one, profiles["preset"], plan, sequences),
        )
    return record


def measure(out: Path, quick: bool, only: list[str] | None = None, shapes: list[str] | None = None) -> dict:
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run)"
    preset = gpu_preset(name) if device == "cuda" else get_profile("h100-80gb")
    record = {
        "device": name,
        "preset": preset.name,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": quick,
        "backend": "CUDA, NCCL" if device == "cuda" else "CPU, gloo",
    }
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    save = lambda: out.write_text(json.dumps(record, indent=1))  # noqa: E731
    parts = (
        ("kernels", lambda: measure_kernels(device, quick)),
        ("attention_occupancy", lambda: measure_attention_occupancy(device, quick)),
        ("equivalence", lambda: check_equivalence(device)),
        ("optimizer", lambda: measure_optimizer(device, quick)),
        ("hf_families", lambda: check_hf_families(device, quick)),
        ("other_models", lambda: __import__("other_models").check_on(device)),  # imports transformers
        ("casts", lambda: measure_casts(device, CAST_ELEMENTS // 64 if quick else CAST_ELEMENTS)),
        ("steps", lambda: measure_steps(preset, device, quick, record.setdefault("steps", []), save, shapes)),
    )
    for part, run in parts:
        if only and part not in only:
            continue
        try:
            record[part] = run()
        except Exception as error:  # a part that fails is recorded and the next one still runs
            record[part] = _failure(error)
        save()
    dist.destroy_process_group()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to write the measured record (JSON)")
    parser.add_argument(
        "--calibrated", type=Path, nargs="*", default=[], help="the profiles `autopar calibrate --backend nccl` wrote"
    )
    parser.add_argument(
        "--render",
        type=Path,
        nargs="*",
        help="price these records with the current cost model (each with the --calibrated profile at its place) "
        "and write their BENCHMARKS.md section",
    )
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, prints only")
    parser.add_argument("--parts", nargs="*", help="measure only these parts (kernels, steps, hf_families, ...)")
    parser.add_argument("--shapes", nargs="*", help="the steps part's shapes to measure (all by default)")
    args = parser.parse_args(argv)
    if args.render:
        profiles = [*args.calibrated, *[None] * len(args.render)]
        section = render([price(json.loads(r.read_text()), c) for r, c in zip(args.render, profiles)])
        print(section)
        write_section(SECTION, section)
        return 0
    record = measure(args.out or Path("gpu.json"), args.quick, args.parts, args.shapes)
    if args.quick:
        print(render([price(record, None)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
