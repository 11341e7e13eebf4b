"""Context and expert parallelism: activation memory, ring vs Ulysses, experts sharded vs replicated.

On 4 local gloo ranks, every program made by autopar with its kernel pinned (and checked to run):

- activation memory of the long-context GPT (``examples/long_context_gpt.py``, batch 1) at the
  longest sequence, ``degrees={"cp": 4}`` with attention ``"ring"`` or ``"ulysses"``, against the
  plain model in one process: the distinct storages autograd saves for backward in one step,
  parameters left out, cross-checked by what the forward alone allocates and leaves live
  (``measure.activation_memory``);
- ring vs Ulysses step time at two sequence lengths;
- the MoE GPT (``examples/moe_gpt.py``) with experts split, ``degrees={"ep": 4}`` and the
  ``"experts"`` kernel, against replicated experts, ``degrees={"dp": 4}``: step time and the
  parameter bytes each rank holds.

Plans are made here, before the ranks start (the search times ops on this machine), with the
calibrated profile if ``autopar calibrate`` wrote one, else the default; their ``cost`` gives
the predictions. Timing follows ``step_time.py`` (pairs checked equivalent first, alternating
order, a barrier per step, slowest rank, median); every first loss must also equal one
process's within 1e-5 relative.

Run from the repository root::

    python benchmarks/parallel_kernels.py            # full run, rewrites its section of BENCHMARKS.md
    python benchmarks/parallel_kernels.py --quick    # smoke run on smaller sizes; prints, writes nothing
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.cli import default_profile_path
from autopar.runtime.spawn import run_local

sys.path.insert(0, str(Path(__file__).parent))
from cost_model import _loadavg  # noqa: E402
from measure import _storages, activation_memory  # noqa: E402
from pipeline import _state_bytes  # noqa: E402
from publish import publish  # noqa: E402
from step_time import LR, SEED, Competitor, _as_is, check_equivalence, time_rounds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "parallel_kernels"
WORLD = 4
METHODS = ("ring", "ulysses")
TARGET_ACTIVATION_SHARE = 0.35  # of one process's activations, per CP4 rank
FIRST_LOSS_RTOL = 1e-5
MiB = 2**20


@dataclass(frozen=True)
class Settings:
    """Sizes and step counts of one run (``warmup_steps``, ``rounds``, ``steps_per_round`` as
    ``step_time.time_rounds`` reads them)."""

    long_model: dict  # examples/long_context_gpt.py:build keywords, seq left out
    seqs: tuple[int, ...]  # ring vs Ulysses timed at each; the last one's activations measured
    moe_model: dict  # examples/moe_gpt.py:build keywords
    moe_batch: int
    warmup_steps: int
    rounds: int
    steps_per_round: int
    timeout_s: float  # per spawn


FULL = Settings(
    long_model=dict(hidden=128, layers=2, heads=8, vocab=256),
    seqs=(2048, 8192),
    moe_model=dict(hidden=256, layers=2, heads=8, vocab=1024, seq=64, ffn=1024, experts=8, top_k=2),
    moe_batch=8,
    warmup_steps=3,
    rounds=8,
    steps_per_round=2,
    timeout_s=480,
)
QUICK = Settings(
    long_model=dict(hidden=64, layers=1, heads=8, vocab=128),
    seqs=(256, 512),
    moe_model=dict(hidden=64, layers=1, heads=4, vocab=128, seq=16, ffn=128, experts=8, top_k=2),
    moe_batch=8,
    warmup_steps=2,
    rounds=2,
    steps_per_round=2,
    timeout_s=240,
)
MOE_PAIRS = (("experts", "EP4 experts", "DP4 replicated"),)
MOE_OPTIONS = {
    "EP4 experts": dict(degrees={"ep": WORLD}, constraints={"layers.*.moe": "experts"}),
    "DP4 replicated": dict(degrees={"dp": WORLD}),
}
MOE_KERNELS = {"EP4 experts": "experts", "DP4 replicated": "moe"}  # what each program must run


def _cp_pairs(settings: Settings) -> tuple:
    return tuple((f"seq {seq}", f"ring {seq}", f"ulysses {seq}") for seq in settings.seqs)


def _load_example(file: str):
    spec = importlib.util.spec_from_file_location(f"autopar_examples_{Path(file).stem}", ROOT / "examples" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _long_context(settings: Settings, seq: int):
    torch.manual_seed(SEED)
    model = _load_example("long_context_gpt.py").build(**settings.long_model, seq=seq)
    return model, model.example_inputs(1)


def _moe(settings: Settings):
    torch.manual_seed(SEED)
    model = _load_example("moe_gpt.py").build(**settings.moe_model)
    return model, model.example_inputs(settings.moe_batch)


# --------------------------------------------------------------------------- one process


def one_process(settings: Settings) -> dict:
    """The long-context model at the longest sequence in this process, plain torch, one
    thread: its activation memory and the cost model's activations for one device."""
    model, inputs = _long_context(settings, settings.seqs[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        memory = activation_memory(model, torch.optim.AdamW(model.parameters(), lr=LR), inputs)
    finally:
        torch.set_num_threads(threads)
    predicted = autopar.plan(model, 1, inputs, hardware=_profile()).cost.memory["activations"]
    return {"memory": memory, "predicted_activations": predicted}


def first_losses(settings: Settings) -> dict[str, float]:
    """One process's loss on each benchmark's batch: what every first loss must equal."""
    built = {f"seq {seq}": _long_context(settings, seq) for seq in settings.seqs}
    built["moe"] = _moe(settings)
    return {key: model(*inputs).item() for key, (model, inputs) in built.items()}


# --------------------------------------------------------------------------- ranks


def _kernels(pmodel) -> set[str]:
    """The parallel kernels this rank's program runs ("moe" for experts all held locally)."""
    found = set()
    for node in pmodel.program.graph.nodes:
        target = str(node.target)
        if target == "autopar.moe.default":
            found.add("experts" if node.args[-1] else "moe")
        elif target in ("autopar.ring_attention.default", "autopar.ulysses_attention.default"):
            found.add(target.split(".")[1].removesuffix("_attention"))
    return found


def _competitor(name: str, model, inputs, plan, kernel: str) -> tuple[Competitor, tuple]:
    pmodel = autopar.parallelize(copy.deepcopy(model), WORLD, inputs, plan=plan)
    if _kernels(pmodel) != {kernel}:  # the pinned kernel, and no other, runs
        raise AssertionError(f"{name}: the program runs kernels {sorted(_kernels(pmodel))}, expected only {kernel!r}")
    batch = pmodel.shard_batch(*inputs)
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LR)
    return Competitor(name, pmodel, lambda: pmodel.train_step(*batch), optimizer, _as_is), batch


def _gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def context_rank(rank: int, world: int, settings: Settings, plans: dict) -> dict:
    """Ring and Ulysses at every sequence length: equivalence, activations at the longest, timing."""
    competitors, batches, global_inputs = {}, {}, {}
    for seq in settings.seqs:
        model, inputs = _long_context(settings, seq)
        for method in METHODS:
            name = f"{method} {seq}"
            competitors[name], batches[name] = _competitor(name, model, inputs, plans[name], method)
            global_inputs[name] = inputs
    pairs = _cp_pairs(settings)
    losses = check_equivalence(competitors, pairs=pairs)
    memory = {}
    for method in METHODS:
        name = f"{method} {settings.seqs[-1]}"
        competitor = competitors[name]
        memory[name] = _gathered(
            activation_memory(competitor.module, competitor.optimizer, batches[name], global_inputs[name])
        )
    return {"losses": losses, "memory": memory, "rounds": time_rounds(competitors, settings, pairs)}


def _parameter_bytes(pmodel) -> dict:
    """Bytes of this rank's parameters, all and the experts' alone, each storage once."""
    named = dict(pmodel.named_parameters())
    return {
        "all": sum(_storages(named.values()).values()),
        "experts": sum(_storages(p for n, p in named.items() if ".experts." in n).values()),
    }


def experts_rank(rank: int, world: int, settings: Settings, plans: dict) -> dict:
    """Experts split (EP) against replicated (DP): equivalence, parameter bytes, timing."""
    model, inputs = _moe(settings)
    competitors = {
        name: _competitor(name, model, inputs, plans[name], kernel)[0] for name, kernel in MOE_KERNELS.items()
    }
    losses = check_equivalence(competitors, pairs=MOE_PAIRS)
    params = {name: _gathered(_parameter_bytes(c.module)) for name, c in competitors.items()}
    rounds = time_rounds(competitors, settings, MOE_PAIRS)
    state = {name: _gathered(_state_bytes(competitor)) for name, competitor in competitors.items()}
    return {"losses": losses, "params": params, "state": state, "rounds": rounds}


# --------------------------------------------------------------------------- planning


def _profile() -> str:
    """This machine's calibrated profile if ``autopar calibrate`` wrote one, else the default."""
    path = default_profile_path()
    return str(path) if path.exists() else "cpu-local"


def make_plans(settings: Settings) -> dict:
    plans = {}
    for seq in settings.seqs:
        model, inputs = _long_context(settings, seq)
        for method in METHODS:
            plans[f"{method} {seq}"] = autopar.plan(
                model, WORLD, inputs, degrees={"cp": WORLD}, constraints={"layers.*.attn": method}, hardware=_profile()
            )
    model, inputs = _moe(settings)
    for name, options in MOE_OPTIONS.items():
        plans[name] = autopar.plan(model, WORLD, inputs, hardware=_profile(), **options)
    return plans


# --------------------------------------------------------------------------- report


def _median_s(result: dict, name: str) -> float:
    return statistics.median(t for r in result["rounds"][name] for t in r)


def _round_ratio(result: dict, ours: str, theirs: str) -> float:
    """Median over rounds of the ratio of the two round medians: less sensitive to drift."""
    medians = [[statistics.median(r) for r in result["rounds"][name]] for name in (ours, theirs)]
    return statistics.median(a / b for a, b in zip(*medians))


def _check_first_losses(losses: dict[str, list[float]], pairs, reference: float) -> None:
    """Every competitor's first loss within FIRST_LOSS_RTOL of one process's."""
    for comparison, *names in pairs:
        for name in names:
            if abs(losses[name][0] - reference) > FIRST_LOSS_RTOL * abs(reference):
                raise AssertionError(
                    f"{comparison}: {name}'s first loss {losses[name][0]:.8f} differs from one "
                    f"process's {reference:.8f} by more than {FIRST_LOSS_RTOL} relative"
                )


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _build_text(keywords: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in keywords.items())


def _memory_rows(settings: Settings, single: dict, context: dict, plans: dict) -> list[str]:
    base, rows = single["memory"], []
    rows.append(
        f"| one process | {_mib(base['saved'])} | 100% | | | {_mib(base['held_after_forward'])} | "
        f"{_mib(base['forward_peak'])} | {_mib(single['predicted_activations'])} | "
        f"{(single['predicted_activations'] / base['saved'] - 1) * 100:+.0f}% |"
    )
    for method in METHODS:
        name = f"{method} {settings.seqs[-1]}"
        worst = {key: max(r[key] for r in context["memory"][name]) for key in base}
        share, predicted = worst["saved"] / base["saved"], plans[name].cost.memory["activations"]
        rows.append(
            f"| CP{WORLD} {method} | {_mib(worst['saved'])} | {share * 100:.0f}% | ≤ "
            f"{TARGET_ACTIVATION_SHARE * 100:.0f}% | "
            f"{'yes' if share <= TARGET_ACTIVATION_SHARE else '**no**'} | {_mib(worst['held_after_forward'])} | "
            f"{_mib(worst['forward_peak'])} | {_mib(predicted)} | {(predicted / worst['saved'] - 1) * 100:+.0f}% |"
        )
    return rows


def _ring_note(settings: Settings, single: dict, context: dict, plans: dict) -> str:
    """What the forward's peak and the step times show beyond the saved activations, and why."""
    seq, heads = settings.seqs[-1], settings.long_model["heads"]
    chunk = seq // (2 * WORLD)
    peaks = {m: max(r["forward_peak"] for r in context["memory"][f"{m} {seq}"]) for m in METHODS}
    share = {m: peaks[m] / single["memory"]["forward_peak"] * 100 for m in METHODS}
    note = (
        f"The forward's transient peak on a rank is {_mib(peaks['ring'])} MiB with ring, {share['ring']:.0f}% of one "
        f"process's forward peak (Ulysses: {_mib(peaks['ulysses'])} MiB, {share['ulysses']:.0f}%)."
    )
    if peaks["ring"] > 1.5 * peaks["ulysses"]:
        note += (
            f" Each ring block pair materializes its fp32 scores, {heads} heads x c x c with c = seq / 2p = {chunk} "
            f"({_mib(heads * chunk * chunk * 4)} MiB a tensor, and the softmax makes more of that size; "
            "`runtime/kernels/context_parallel.py` `_block_forward`), where Ulysses calls torch's fused CPU attention."
        )
    ring, ulysses = (_median_s(context, f"{m} {seq}") for m in METHODS)
    if ulysses / ring < 2 / 3:
        predicted = plans[f"ulysses {seq}"].cost.step_s / plans[f"ring {seq}"].cost.step_s
        note += (
            f" Unfused block math makes ring slower than Ulysses (below: {ulysses / ring:.2f}); the cost model "
            "charges a ring block's compute as its share of fused attention (`passes/cost/kernels.py`: compute as "
            f"for any split op) and predicts {predicted:.2f}."
        )
    return note


def _attention_rows(settings: Settings, context: dict, plans: dict, references: dict) -> list[str]:
    rows = []
    for seq in settings.seqs:
        ring, ulysses = (_median_s(context, f"{m} {seq}") for m in METHODS)
        predicted = [plans[f"{m} {seq}"].cost.step_s for m in METHODS]
        first = [context["losses"][f"{m} {seq}"][0] for m in METHODS] + [references[f"seq {seq}"]]
        rows.append(
            f"| {seq} | {_ms(ring)} | {_ms(ulysses)} | {ulysses / ring:.2f} | "
            f"{_round_ratio(context, f'ulysses {seq}', f'ring {seq}'):.2f} | {_ms(predicted[0])} | {_ms(predicted[1])} "
            "| "
            f"{predicted[1] / predicted[0]:.2f} | {' / '.join(f'{x:.6f}' for x in first)} |"
        )
    return rows


def _experts_rows(experts: dict, plans: dict) -> list[str]:
    rows, (_, dp) = [], MOE_OPTIONS
    for name in MOE_OPTIONS:
        biggest = max(experts["params"][name], key=lambda p: p["all"])
        cost = plans[name].cost
        rows.append(
            f"| {name} | {_ms(_median_s(experts, name))} | {_median_s(experts, name) / _median_s(experts, dp):.2f} | "
            f"{_round_ratio(experts, name, dp):.2f} | {_ms(cost.step_s)} | {cost.step_s / plans[dp].cost.step_s:.2f} | "
            f"{_mib(biggest['all'])} ({_mib(biggest['experts'])}) | {_mib(cost.memory['params'])} | "
            f"{_mib(max(experts['state'][name]))} | {experts['losses'][name][0]:.6f} |"
        )
    return rows


def render_section(settings, single, context, experts, plans, references, command, elapsed_s, loads) -> str:
    long_seq, profile = settings.seqs[-1], _profile()
    return "\n".join(
        [
            "## Context and expert parallelism",
            "",
            f"- command: `{command}` ({elapsed_s:.0f} s in all); date "
            f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"- machine: {os.cpu_count()} cores, shared (load average {loads}); CPU, gloo, one torch thread per rank; "
            f"{WORLD} ranks on {os.cpu_count()} cores are oversubscribed, so times measure contention as much as "
            f"parallelism. torch {torch.__version__}, Python {platform.python_version()}.",
            f"- predictions: `autopar.plan(...).cost` with the hardware profile `{profile}`"
            + (
                " (calibrated by `autopar calibrate`)"
                if profile.endswith(".json")
                else f" (the default: no calibrated profile at `{default_profile_path()}`; "
                "ops are timed on this machine while planning)"
            )
            + "; plans made once in the parent process, before the ranks start.",
            f"- step: `train_step` + AdamW step (`pmodel.optimizer`, lr {LR}) + zero_grad; {settings.warmup_steps} "
            "warm-up "
            f"steps, then {settings.rounds} rounds of {settings.steps_per_round} steps per competitor, the two of a "
            "pair in "
            "alternating order, a barrier before each step, the slowest rank's time, median ('per round': the median "
            "over "
            "rounds of the ratio of the two round medians, less sensitive to drift). Before timing, each pair agrees "
            "on the losses of its first two steps and every full gradient of the first (as in the step-time section), "
            "and "
            f"every first loss equals one process's within {FIRST_LOSS_RTOL} relative. Each program is checked to run "
            "its "
            "pinned kernel (`autopar::ring_attention`, `autopar::ulysses_attention`, `autopar::moe` with or without a "
            "group).",
            "",
            f"### Activation memory at sequence {long_seq}: context parallelism over {WORLD} ranks vs one process",
            "",
            f"examples/long_context_gpt.py `build({_build_text(settings.long_model)}, seq={long_seq})`, batch 1, fp32; "
            f"CP{WORLD}: `degrees={{'cp': {WORLD}}}, constraints={{'layers.*.attn': METHOD}}`; one process: the plain "
            "model in torch, one thread. **Saved** = the bytes of the distinct storages autograd saves for backward in "
            "one "
            "step (`torch.autograd.graph.saved_tensors_hooks`, each storage once, parameters left out): the activation "
            "memory. Cross-checks from the CPU allocator's events (`torch.profiler`, `profile_memory=True`) over a "
            "forward "
            "alone, gradients freed: **held** = bytes allocated in the forward and still live when it returns (saved "
            "tensors + the loss), **peak** = the forward's highest net allocation (held + transients). Predicted = "
            "`plan.cost.memory['activations']`. Largest rank shown.",
            "",
            "| program | saved MiB | share of one process | target | met? | held MiB | forward peak MiB | predicted "
            "MiB | prediction error |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
            *_memory_rows(settings, single, context, plans),
            "",
            _ring_note(settings, single, context, plans),
            "",
            f"### Ulysses vs ring attention, CP{WORLD}",
            "",
            "The same model at each sequence length (`seq=S`), batch 1. Predicted = `plan.cost.step_s`.",
            "",
            "| seq | ring ms | Ulysses ms | ratio Ulysses/ring | per round | predicted ring ms | predicted Ulysses ms "
            "| predicted ratio | first loss (ring / Ulysses / one process) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
            *_attention_rows(settings, context, plans, references),
            "",
            f"### Experts split over {WORLD} ranks vs replicated",
            "",
            f"examples/moe_gpt.py `build({_build_text(settings.moe_model)})`, global batch {settings.moe_batch}, fp32. "
            f"EP{WORLD}: `degrees={{'ep': {WORLD}}}, constraints={{'layers.*.moe': 'experts'}}` (each rank holds "
            f"1/{WORLD} of the experts and its 1/{WORLD} of the batch; tokens travel to their experts by all-to-all). "
            f"Replicated: `degrees={{'dp': {WORLD}}}` (every rank holds all experts, the batch split, gradients "
            "all-reduced). "
            "Both run the routed `autopar::moe` op. Parameters / state = the bytes a rank holds (each storage once; "
            "state = "
            "parameters + gradients + AdamW state after a step); largest rank.",
            "",
            "| program | median ms | ratio to replicated | per round | predicted ms | predicted ratio | parameters MiB "
            "(experts) "
            "| predicted parameters MiB | state MiB | first loss |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
            *_experts_rows(experts, plans),
            "",
            f"One process's first loss on the same batch: {references['moe']:.6f}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps; print, do not write")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    command = "python benchmarks/parallel_kernels.py" + (" --quick" if args.quick else "")
    start, load_start = time.monotonic(), _loadavg()
    print(f"[parallel_kernels] planning with {_profile()} ...", flush=True)
    plans = make_plans(settings)
    print("[parallel_kernels] one process ...", flush=True)
    single, references = one_process(settings), first_losses(settings)
    print(f"[parallel_kernels] context parallelism, {WORLD} ranks ...", flush=True)
    context = run_local(context_rank, WORLD, settings, plans, timeout_s=settings.timeout_s)[0]
    for seq, pair in zip(settings.seqs, _cp_pairs(settings)):
        _check_first_losses(context["losses"], (pair,), references[f"seq {seq}"])
    print(f"[parallel_kernels] expert parallelism, {WORLD} ranks ...", flush=True)
    experts = run_local(experts_rank, WORLD, settings, plans, timeout_s=settings.timeout_s)[0]
    _check_first_losses(experts["losses"], MOE_PAIRS, references["moe"])
    loads = f"{load_start} → {_loadavg()}"
    section = render_section(
        settings, single, context, experts, plans, references, command, time.monotonic() - start, loads
    )
    publish(SECTION, section, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
