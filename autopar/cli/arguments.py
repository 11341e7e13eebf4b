"""The ``autopar`` command line: its parser, the option types, and where profiles live.

The only place (with :mod:`autopar.cli.commands`) that reads argv and the environment.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from autopar.api import EXAMPLE_SEQ
from autopar.ir import KERNEL_DIMS, PIPELINES, RECOMPUTE, AutoparError, Mesh, MeshError, Precision, parse_placement

DEFAULT_FACTORY = "build"
BATCH_PER_DEVICE = 2
UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
USAGE_ERROR = 2
VERIFY_MISMATCH = 3  # autopar verify: the plan ran, and its step differs from one process's


class UsageError(Exception):
    """The command line is wrong: exit 2 with this message."""


class VerifyFailed(Exception):
    """autopar verify could not finish its run (a rank died or timed out): exit 1 with this message."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="plan MODEL on a mesh and print the decisions")
    _planning_options(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--save", metavar="PLAN.json", help="also save the plan (for `explain`, `parallelize(plan=...)`)")
    plan.add_argument(
        "--timeline", metavar="FILE.svg", help="also draw the pipeline schedule's timeline as an SVG file"
    )
    plan.add_argument(
        "--at",
        type=_sizes,
        metavar="batch=N,seq=N",
        help="also predict the plan at another global batch and/or sequence (no new search)",
    )
    plan.set_defaults(handler="plan")

    explain = commands.add_parser("explain", help="print a saved plan; needs no model")
    explain.add_argument("plan_file", metavar="PLAN.json")
    explain.set_defaults(handler="explain")

    export = commands.add_parser("export", help="plan MODEL and write each rank's program, plan.json, graph.dot")
    _planning_options(export)
    export.add_argument("--out", required=True, metavar="DIR", help="folder to write into (created)")
    export.set_defaults(handler="export")

    verify = commands.add_parser(
        "verify",
        help="run a plan on local gloo ranks against one process; exit 0 when exact",
        description="One training step of MODEL under the plan on local gloo ranks, and as the plain model in "
        "one process: the worst relative error of the loss, every gradient and every updated parameter. "
        "Exit 0 when every one is within fp32 tolerance, 3 when not. A model or mesh too big for this machine "
        "is verified on a smaller copy with the same placement pattern (see --shrink).",
    )
    _planning_options(verify)
    verify.add_argument("--plan", metavar="PLAN.json", help="verify this plan (default: plan MODEL with the options)")
    verify.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    verify.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="stop the ranks after S seconds (default 600)"
    )
    verify.add_argument(
        "--max-ranks", type=_positive_int, default=4, metavar="N", help="local ranks it may start (default 4)"
    )
    verify.add_argument(
        "--shrink",
        choices=("auto", "always", "never"),
        default="auto",
        help="run a smaller copy (fewer layers, smaller widths and degrees, the plan's placements): "
        "auto when the model or mesh does not fit here (default)",
    )
    verify.set_defaults(handler="verify")

    run = commands.add_parser(
        "run",
        help="run SCRIPT as N local ranks, as torchrun would",
        usage="autopar run SCRIPT --nproc N [--max-restarts K] [--timeout S] [--collective-timeout S] "
        "[-- SCRIPT_ARGS ...]",
    )
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("--nproc", type=_positive_int, required=True, metavar="N")
    run.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="when a rank fails, stop all and start all again, up to K times (torchrun's --max-restarts)",
    )
    run.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="terminate all ranks after S seconds for the whole job, restarts included (exit 124)",
    )
    run.add_argument(
        "--collective-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="fail a collective that waits longer than S seconds for a peer (the process-group timeout; "
        "default 1800); the ranks read it as $AUTOPAR_COLLECTIVE_TIMEOUT",
    )
    run.set_defaults(handler="run")

    calibrate = commands.add_parser(
        "calibrate", help="measure this machine and write a hardware profile that plan/export use"
    )
    calibrate.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats, 2 ranks only (~10 s instead of ~30 s)"
    )
    calibrate.add_argument(
        "--ranks", type=_ranks, default=(2, 4), metavar="2,4", help="group sizes to measure collectives over"
    )
    calibrate.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo: this machine's CPU processes (default); "
        "nccl: its GPUs, one per rank (pass the profile to plan with --hardware)",
    )
    calibrate.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help=f"where to write the profile (default {_tilde(default_profile_path())}; "
        f"with nccl {_tilde(default_profile_path('nccl'))})",
    )
    calibrate.set_defaults(handler="calibrate")
    return parser


def _planning_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="FILE.py[:FACTORY(k=v, ...)] or an example name (gpt, mlp, hf:build_llama(layers=2)); "
        f"the factory defaults to {DEFAULT_FACTORY}()",
    )
    parser.add_argument("--mesh", type=_mesh, required=True, help="device mesh, outermost first, e.g. 2x4")
    parser.add_argument(
        "--batch", type=_positive_int, help=f"global batch size (default: {BATCH_PER_DEVICE} per device)"
    )
    parser.add_argument(
        "--seq",
        type=_positive_int,
        help="tokens per sequence of the inputs autopar makes for a model without example_inputs (a Hugging Face "
        f"causal LM: random input_ids as labels; default {EXAMPLE_SEQ}, or the model's maximum if shorter)",
    )
    parser.add_argument("--degrees", type=parse_degrees, help="pin parallel sizes, e.g. dp=2,tp=4")
    parser.add_argument(
        "--constraint",
        type=_constraint,
        action="append",
        default=[],
        metavar="PATTERN=PLACEMENT",
        help="pin a parameter or module (fnmatch pattern) on the tp axis, e.g. 'layers.*.mlp.fc1=S(-1)', or a "
        f"module's parallel kernel ({', '.join(KERNEL_DIMS)}), e.g. 'layers.*.attn=ring'; repeatable",
    )
    parser.add_argument(
        "--hardware",
        help=f"hardware profile name or .json file (default: {_tilde(default_profile_path())} "
        "if `autopar calibrate` wrote it, else cpu-local)",
    )
    parser.add_argument(
        "--memory-limit", type=parse_bytes, metavar="BYTES", help="per-device memory, e.g. 8GiB, 512MiB, 1e9"
    )
    parser.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        help="pin the ZeRO stage over the dp axis (default: the fastest that fits, the lowest of near-equals)",
    )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help="pin activation recomputation (default: the fastest that fits, the least of near-equals)",
    )
    parser.add_argument(
        "--microbatches", type=_positive_int, help="pieces each rank's batch runs in (default: searched with pipelines)"
    )
    parser.add_argument("--pipeline", choices=PIPELINES, help="pin the pipeline schedule (default: searched)")
    parser.add_argument(
        "--virtual",
        type=_positive_int,
        help="pin the stage modules per device of an interleaved schedule (Megatron's virtual pipeline stages; "
        "default: searched)",
    )
    parser.add_argument(
        "--precision",
        choices=tuple(Precision),
        help="what training computes in: fp32, or bf16/fp16 compute copies with fp32 master weights and optimizer "
        "state (default: the hardware's natural choice, bf16-mixed on A100/H100/H200, fp32 on CPU)",
    )
    parser.add_argument(
        "--stage-cuts",
        type=lambda text: [cut.strip() for cut in text.split(",")],
        metavar="LAYER,...",
        help="pin the layers that start each pipeline stage module after the first, e.g. layers.6 (default: balanced)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="plan for compiled programs (torch.compile, communication scheduled for overlap: "
        "parallelize(..., compile=True)), priced from that schedule",
    )
    parser.add_argument(
        "--async-tp",
        action="store_true",
        help="with --compile, run each tensor-parallel matmul in pieces with its collective",
    )
    parser.add_argument(
        "--regather",
        choices=("on", "off"),
        help="whether linears of an all-gathered activation (a sequence-parallel norm's output) keep its shard and "
        "gather it again in backward, as Megatron-LM does (default: where memory needs it)",
    )


def _int_at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _ranks(text: str) -> tuple[int, ...]:
    sizes = tuple(_positive_int(item) for item in text.split(","))
    if min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a collective needs groups of at least 2 ranks, e.g. 2,4")
    return sizes


def _sizes(text: str) -> dict[str, int]:
    pairs = [item.partition("=") for item in text.split(",")]
    if not all(
        key.strip() in ("batch", "seq") and value.strip().isdigit() and int(value) > 0 for key, _, value in pairs
    ):
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r}: write batch=N and/or seq=N joined by a comma, e.g. batch=2048,seq=4096"
        )
    return {key.strip(): int(value) for key, _, value in pairs}


def _mesh(text: str) -> Mesh:
    try:
        return Mesh.parse(text)
    except MeshError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_degrees(text: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` → ``{"dp": 2, "tp": 4}`` (an argparse type: bad text is an ArgumentTypeError)."""
    degrees = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"cannot read {item!r}: write dim=size pairs joined by commas, e.g. dp=2,tp=4"
            )
        degrees[name.strip()] = int(size)
    return degrees


def _constraint(text: str) -> tuple[str, str]:
    pattern, _, placement = text.partition("=")
    if not pattern or not placement:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r}: write PATTERN=PLACEMENT, e.g. 'layers.*.mlp.fc1=S(-1)'"
        )
    if placement.strip() in KERNEL_DIMS:  # a parallel kernel, e.g. 'layers.*.attn=ring'
        return pattern.strip(), placement.strip()
    try:
        parse_placement(placement)
    except AutoparError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return pattern.strip(), placement.strip()


def parse_bytes(text: str) -> float:
    """Read a byte count: ``"8GiB"``, ``"512MiB"``, ``"1e9"``, ``"80GB"``.

    >>> parse_bytes("512MiB")
    536870912.0
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as bytes: write e.g. 8GiB, 512MiB, 80GB or 1e9")
    return float(match.group(1)) * UNITS[unit]


def default_profile_path(backend: str = "gloo") -> Path:
    """Where ``autopar calibrate`` writes and plan/export look for this machine's profile
    (a GPU profile is only written there: plan takes it with ``--hardware``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (
        Path(cache)
        / "autopar"
        / "profiles"
        / ("gpu-calibrated.json" if backend == "nccl" else "cpu-local-calibrated.json")
    )


def _tilde(path: Path) -> str:
    home = str(Path.home())
    return "~" + str(path)[len(home) :] if str(path).startswith(home + os.sep) else str(path)
