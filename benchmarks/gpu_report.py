"""The BENCHMARKS.md section of a priced ``benchmarks/gpu.py`` record: a table per part, or the
error the part raised."""

from __future__ import annotations

import statistics

KINDS = ("GEMM", "attention", "other ops", "optimizer")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _table(title: str, columns: list[str], rows: list[list], note: str = "") -> list[str]:
    """A markdown table under its heading, and a note after it."""
    lines = [f"#### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines + ([""] + [note] if note else []) + [""]


def _kernel_rows(kernels: list, labels: list[str]) -> tuple[list[list], str]:
    rows, ratios = [], {label: [] for label in labels}
    for entry in kernels:
        for name, part in [*entry["gemms"].items(), ("attention", entry["attention"])]:
            for label in labels:
                ratios[label].append(part[f"{label}_s"] / part["measured_s"])
            row = entry["row"].split("|")[1].strip()
            priced = [_ratio(part[f"{label}_s"], part["measured_s"]) for label in labels]
            rows.append([row, entry["tp"], name, f"{part['measured_s'] * 1e3:.3f}", *priced])
    note = "; ".join(
        f"{label}: predicted / measured median {statistics.median(r):.2f} (range {min(r):.2f}-{max(r):.2f}) "
        f"over {len(r)} kernels"
        for label, r in ratios.items()
    )
    return rows, note


def _step_rows(steps: list) -> list[list]:
    rows = []
    for entry in steps:
        shape, sequences = entry["shape"], entry.get("sequences", 1)
        name = f"{entry['name']} (h {shape['hidden']}, {shape['layers']} layers, {sequences} x {shape['seq']} tokens)"
        for label, run in entry["runs"].items():
            if "error" in run:
                rows.append([name, "", label, f"failed: {run['error'][:200]}", "", "", "", ""])
                continue
            ours = label.startswith("autopar")
            predicted = entry["predicted_compiled_s" if "compiled" in label else "predicted_step_s"]
            rows.append(
                [
                    name,
                    f"{predicted * 1e3:.1f}" if ours else "",
                    label,
                    f"{run['median_s'] * 1e3:.1f}",
                    _ratio(predicted, run["median_s"]) if ours else "",
                    f"{entry['model_flops'] / run['median_s'] / 1e12:.0f}",
                    f"{run['first_s']:.1f}",
                    f"{run['first_loss']:.4f}",
                ]
            )
    return rows


def render(records: list[dict]) -> str:
    """The BENCHMARKS.md section: its method once, then each device's record."""
    lines = [
        "## One GPU: the cost model's kernels and a one-GPU step, measured",
        "",
        "- measured: `autopar calibrate --backend nccl --out gpu-calibrated.json` then `python benchmarks/gpu.py "
        "--out gpu.json` on one GPU; each record and its profile are kept in `benchmarks/data/gpu/`",
        "- priced: `python benchmarks/gpu.py --render RECORD... --calibrated PROFILE...` prices every measurement "
        "with this code's cost model, on autopar's preset of the device and on its calibrated profile; predicted / "
        "measured above 1: the model is pessimistic",
        "- kernels: the best of three back-to-back loops of about 20 ms each, over their calls; steps: the "
        "median of 10 after 3 warm-up steps (the first step, which compiles, timed apart); a step of several "
        "sequences runs them as microbatches of one, gradients accumulated",
        "- one GPU: NCCL refuses two ranks on one device, so no collective, tensor parallelism, ZeRO or "
        "pipeline ran on CUDA here; the calibrated profile keeps the preset's links",
        "",
    ]
    for record in records:
        lines += _render_record(record)
    return "\n".join(lines)


def _render_record(record: dict) -> list[str]:
    """One device's tables: per part a table, or the error it raised."""
    lines = [
        f"### {record['device']} (torch {record['torch']}, {record['measured_at']}; priced on `{record['preset']}`"
        + (" and calibrated)" if _has_calibrated(record) else ")"),
        "",
        *([f"- {record['note']}", ""] if record.get("note") else []),
    ]
    labels = ["preset", "calibrated"] if _has_calibrated(record) else ["preset"]
    priced = [f"{label} / measured" for label in labels]
    names = "kernels attention_occupancy optimizer casts equivalence hf_families other_models steps".split()
    parts = {part: record.get(part) for part in names}
    for part, value in parts.items():  # a record holds the parts its run measured
        if part in record and (not value or (isinstance(value, dict) and "error" in value)):
            lines += [f"{part}: not measured ({(value or {}).get('error', 'no result')})", ""]
    if isinstance(parts["kernels"], list):
        rows, note = _kernel_rows(parts["kernels"], labels)
        title = "Kernels of each Megatron-Core r0.8 H100 row's layer (one sequence, its tp; GEMMs fwd + 2 bwd, bf16)"
        lines += _table(title, ["row", "tp", "GEMM", "measured ms", *priced], rows, note)
    if isinstance(parts["attention_occupancy"], list):
        rows = [
            [r["seq"], r["head_dim"], "causal" if r["causal"] else "full", r["heads"], f"{r['flops_per_s'] / 1e12:.0f}"]
            + [_ratio(r[f"{label}_s"], r["seconds"]) for label in labels]
            for r in parts["attention_occupancy"]
        ]
        columns = ["sequence", "head size", "mask", "heads", "measured TFLOP/s", *priced]
        lines += _table("Attention (one sequence) as fewer heads fill the GPU", columns, rows)
    if isinstance(parts["optimizer"], list):
        rows = [
            [
                r["optimizer"],
                f"{r['elements'] / 1e6:.0f} M",
                f"{r['seconds'] * 1e3:.2f}",
                _ratio(r["preset_s"], r["seconds"]),
            ]
            for r in parts["optimizer"]
        ]
        note = "The model prices foreach AdamW, what autopar's runtime and torch run by default."
        columns = ["optimizer", "parameters", "measured ms", "preset / measured"]
        lines += _table("One AdamW step over fp32 parameters", columns, rows, note)
    if isinstance(parts["casts"], dict) and "error" not in parts["casts"]:
        rows = [
            [kind, f"{rate / 1e9:.0f}"] + [_ratio(rate, record["casts_priced"][label][kind]) for label in labels]
            for kind, rate in parts["casts"].items()
        ]
        note = (
            "Bytes read and written over the time: a narrowing cast (float32 to bfloat16: mixed precision's copy of "
            "its masters) and a widening one (a gradient's back to its fp32 master, fp32 logits), 2^28 elements, "
            "eager. The model prices a widening cast at its own rate in eager programs; compiled, as other streaming "
            "kernels (inductor writes the cast into its own kernels)."
        )
        columns = ["cast", "measured GB/s", *priced]
        lines += _table("Eager casts between float32 and bfloat16", columns, rows, note)
    if isinstance(parts["equivalence"], dict) and "error" not in parts["equivalence"]:
        rows = [
            [label, f"{r['loss']:.6f}", f"{r['reference_loss']:.6f}", f"{r['max_grad_diff']:.2e}", r["grads_compared"]]
            for label, r in parts["equivalence"].items()
        ]
        title = f"autopar on {record['backend']} (one rank), fp32, one step against the plain model"
        columns = ["program", "loss", "plain model's", "max full-gradient difference", "gradients compared"]
        lines += _table(title, columns, rows)
    if isinstance(parts["hf_families"], list):
        title = (
            f"Unmodified Hugging Face families on {record['backend']} (one rank, `autopar.parallelize(model, 1)`), "
            "fp32, one step against the plain model"
        )
        columns = ["family", "program", "plan s", "step s", "worst difference / tolerance", "result"]
        lines += _table(title, columns, [_family_row(r) for r in parts["hf_families"]], FAMILIES_NOTE)
    if isinstance(parts["other_models"], list):
        title = (
            f"Other models on {record['backend']} (one rank, `autopar.parallelize(model, 1)`), fp32, "
            "one step against the plain model"
        )
        rows = [[r["model"], f"{r['plan_s']:.1f}" if "plan_s" in r else "", _verdict(r)] for r in parts["other_models"]]
        note = (
            "benchmarks/other_models.py's models and batches, dropout off (a fused attention kernel on the GPU "
            "draws masks no other program can), convolutions without TF32; the loss, every full gradient, every "
            "parameter after AdamW and every floating buffer (BatchNorm's running statistics) within rtol 1e-4, "
            "atol 1e-6."
        )
        lines += _table(title, ["model", "plan s", "result"], rows, note)
    if isinstance(parts["steps"], list):
        title = "One-GPU training step, bf16 mixed precision, AdamW (first step, which compiles, apart)"
        columns = ["shape", "predicted ms", "run", "measured ms", "predicted / measured", "TFLOP/s (model)"]
        lines += _table(title, [*columns, "first step s", "first loss"], _step_rows(parts["steps"]))
        rows = [
            [entry["name"], label]
            + [f"{measured[k] * 1e3:.1f} / {entry['predicted_by_kind'][k] * 1e3:.1f}" for k in KINDS]
            for entry in parts["steps"]
            for label, measured in entry.get("measured_by_kind", {}).items()
        ]
        title = (
            "Where the eager steps spend their time: device seconds per kind of kernel (torch.profiler, two steps) "
            "against the cost model's one-GPU time per kind"
        )
        lines += _table(title, ["shape", "run", *(f"{kind} measured / predicted ms" for kind in KINDS)], rows)
    return lines


FAMILIES_NOTE = (
    "Each family's small config as the coverage benchmark builds it (hidden 64, 2 layers; "
    "benchmarks/hf_configs.py), planned with no example inputs; the step (its first, compiling when compiled) "
    "is `pmodel(input_ids=..., labels=...).loss.backward()` and AdamW, with right-padded labels; "
    "tolerance: rtol 1e-4, atol 1e-6 on the loss, every full gradient and every parameter after the step."
)


def _family_row(r: dict) -> list:
    if "error" in r:
        return [r["family"], r["program"], "", "", "", f"failed: {r['error'][:200]}"]
    passed = "matches" if r["ok"] else "differs"
    return [r["family"], r["program"], f"{r['plan_s']:.1f}", f"{r['step_s']:.1f}", f"{r['worst']:.2f}", passed]


def _verdict(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error'][:200]}"
    return f"{'matches' if r['ok'] else 'differs'} (worst {r['worst']:.2f} of the tolerance)"


def _has_calibrated(record: dict) -> bool:
    kernels = record.get("kernels")
    if isinstance(kernels, list) and kernels:
        return "calibrated_s" in kernels[0]["attention"]
    return "calibrated" in record.get("casts_priced", {})
