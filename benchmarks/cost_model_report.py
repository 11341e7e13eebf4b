"""The BENCHMARKS.md section of ``benchmarks/cost_model.py``: predicted against measured step
time and peak memory per plan, the rank correlation and median errors against their targets,
where the time and the memory go."""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cost_model import Settings

MiB = 2**20
TARGET_SPEARMAN = 0.9
TARGET_MEDIAN_ERROR = 0.20
TARGET_MEMORY_ERROR = 0.20


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def _degrees(plan) -> str:
    return " ".join(f"{axis}={size}" for axis, size in plan.degrees.items())


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}"


def render_section(
    rows, settings: Settings, command: str, elapsed_s: float, loads: str, hardware, profile: Path, models: dict
) -> str:
    """The section for ``rows`` (cost_model.analyse), measured under ``settings`` with ``hardware``
    (the profile at ``profile``) on the GPT sizes ``models``."""
    distinct = [r for r in rows if r["duplicate_of"] is None]
    predicted = [r["plan"].cost.step_s for r in distinct]
    measured = [r["step_s"] for r in distinct]
    rho = spearman(predicted, measured)
    mape = statistics.median(abs(_error(p, m)) for p, m in zip(predicted, measured))
    memory_errors = [abs(_error(r["plan"].cost.peak_memory, r["memory"]["peak_step"])) for r in distinct]
    within = sum(e <= TARGET_MEMORY_ERROR for e in memory_errors)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    link = hardware.links[0]
    lines = [
        "## Cost model: predicted vs measured step time and peak memory",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s in all; one `run_local` per world size); "
        f"date {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, shared and noisy (load average {loads}); CPU, gloo, one torch thread per "
        "rank "
        f"(4 ranks on {os.cpu_count()} cores is oversubscribed); torch {torch.__version__}, Python "
        f"{platform.python_version()}.",
        f"- hardware profile: `{profile}`, from `autopar calibrate` ({hardware.description.split(':')[0]}): "
        "measured compute contention (the same op mix on every rank at once vs one rank alone) "
        + ", ".join(f"{n} ranks x{f:.2f}" for n, f in sorted(hardware.contention_by_ranks.items()))
        + "; rendezvous per blocking collective "
        + ", ".join(f"{n} ranks {t * 1e3:.2f} ms" for n, t in sorted(link.sync_by_ranks.items()))
        + f"; {hardware.cores_per_host} cores.",
        "- models: examples/gpt.py, fp32, AdamW; "
        + "; ".join(f"{k} = `build({', '.join(f'{a}={b}' for a, b in v.items())})`" for k, v in models.items())
        + ". Strategies: DP `{dp: N, tp: 1}`; TP `{dp: 1, tp: N}` + Megatron constraints; TP+SP adds `attn_norm`, "
        "`mlp_norm`: S(1); TP+SP+regather keeps those norms' gathered outputs as shards, gathered again in backward "
        "(`regather=True`; TP+SP pins it off); "
        "DPxTP `{dp: 2, tp: 2}` + Megatron constraints; auto = no degrees, no constraints; a suffix +selective, "
        "+selective-op or +full pins that recomputation level (each other plan leaves it to the search). Plans are "
        "made once, in the "
        "parent process, before the ranks start.",
        "- predicted: `plan.cost.step_s` = compute (each op's forward + backward timed on this machine at its "
        "unsharded "
        "shape, one thread, scaled by the share of its work a rank does, x the contention `autopar calibrate` measured "
        "for "
        "that many ranks) + exposed "
        "communication (alpha-beta per collective the plan implies, + the rendezvous per blocking collective) + "
        "gradient "
        "sync not hidden behind backward + the AdamW step (80 B per local parameter / memory bandwidth x contention). "
        "Measured: `train_step` + `optimizer.step()` + `zero_grad()`, a barrier before each step, the slowest rank, "
        "median "
        f"of {settings.rounds * settings.steps_per_round} timed steps after {settings.warmup_steps} warm-up steps, "
        "plans "
        f"interleaved in {settings.rounds} rounds.",
        "- memory: predicted `plan.cost.peak_memory` = params + AdamW state + gradient-sync buckets + the larger of "
        "(saved activations + 2 x the largest activation) and gradients. Measured: the "
        "largest rank's peak during `train_step` with the AdamW state present and gradients None at the start (as "
        "after "
        "`zero_grad()`): the bytes of the live tensors named before the step (parameter shards, AdamW state, "
        "gradient-sync "
        "buckets) + the highest running sum of the CPU allocator's allocations and frees recorded by "
        "`torch.profiler.profile(profile_memory=True)` during the step.",
        "",
        "| plan | ranks | degrees | predicted ms | measured ms | error % | predicted MiB | measured MiB | error % |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cost = r["plan"].cost
        name = r["case"].name + (f" (= {r['duplicate_of']})" if r["duplicate_of"] else "")
        lines.append(
            f"| {name} | {r['world']} | {_degrees(r['plan'])} | {cost.step_s * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
            f"{_pct(_error(cost.step_s, r['step_s']))} | {cost.peak_memory / MiB:.1f} | "
            f"{r['memory']['peak_step'] / MiB:.1f} | "
            f"{_pct(_error(cost.peak_memory, r['memory']['peak_step']))} |"
        )
    lines += [
        "",
        f"Over the {len(distinct)} distinct plans (an automatic plan identical to another row counts once):",
        "",
        f"- step time, Spearman rank correlation predicted vs measured: **{rho:.2f}** (target ≥ {TARGET_SPEARMAN}): "
        f"{verdict(rho >= TARGET_SPEARMAN)}",
        f"- step time, median absolute error: **{mape * 100:.0f}%** (target ≤ {TARGET_MEDIAN_ERROR * 100:.0f}%): "
        f"{verdict(mape <= TARGET_MEDIAN_ERROR)}",
        f"- peak memory within 20%: **{within} of {len(distinct)}** plans, median absolute error "
        f"{statistics.median(memory_errors) * 100:.0f}%, worst {max(memory_errors) * 100:.0f}%: "
        f"{verdict(within == len(distinct))}",
        "",
        "### Where the time goes (ms)",
        "",
        "The twin is the same step with every collective replaced by a local stand-in of the same shapes (no "
        "communication; timed in the same rounds), so measured − twin is what communication costs inside the step.",
        "",
        "| plan | ranks | predicted compute + optimizer | twin (measured) | predicted communication + sync | measured "
        "− twin |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in distinct:
        cost = r["plan"].cost
        lines.append(
            f"| {r['case'].name} | {r['world']} | {(cost.compute_s + cost.optimizer_s) * 1e3:.1f} | "
            f"{r['twin_s'] * 1e3:.1f} | "
            f"{(cost.comm_s + cost.grad_sync_s) * 1e3:.1f} | {(r['step_s'] - r['twin_s']) * 1e3:.1f} |"
        )
    lines += [
        "",
        "### Memory, by category (MiB, the largest rank)",
        "",
        "Measured baseline = the tensors a rank keeps between steps; saved = distinct storages autograd saved for "
        "backward in one step (hooked in a separate step; parameters left out); residual = what the allocator walk "
        "says is live after the step minus what the named tensors hold (0 = nothing missed).",
        "",
        "| plan | ranks | predicted params+optim+buckets | measured baseline | predicted activations + temporary | "
        "measured saved | measured peak − baseline | residual |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in distinct:
        memory, m = r["plan"].cost.memory, r["memory"]
        steady = memory["params"] + memory["optimizer"] + memory["grad_buckets"]
        lines.append(
            f"| {r['case'].name} | {r['world']} | {steady / MiB:.1f} | {m['baseline'] / MiB:.1f} | "
            f"{(memory['activations'] + memory['temporary']) / MiB:.1f} | {m['saved_activations'] / MiB:.1f} | "
            f"{(m['peak_step'] - m['baseline']) / MiB:.1f} | {m['walk_residual'] / MiB:.1f} |"
        )
    return "\n".join(lines)
