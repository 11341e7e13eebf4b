"""The ``autopar`` command: plan, explain, export and run from a shell.

The only module that reads argv (and, through ``launch_local``, hands the environment on).
Exit codes: 0 done; 1 autopar refused (an :class:`AutoparError`, printed as ``error: ...``) or a
verify run failed; 2 the command line was wrong (bad option, MODEL or file); 3 ``autopar verify``
found the plan's step different from one process's.

    autopar plan gpt --mesh 2x2 --batch 8
    autopar plan 'examples/gpt.py:build(hidden=4096, layers=32)' --mesh 2x4 --hardware h100-80gb --json
    autopar explain plan.json
    autopar export gpt --mesh 2x2 --degrees tp=4 --out exported/
    autopar verify gpt --mesh 2 --degrees tp=2          # exit 0 when the plan's step is exact
    autopar run train.py --nproc 4 -- --steps 10
    autopar run train.py --nproc 4 --max-restarts 3 --collective-timeout 300 -- --checkpoint-dir ckpt
    autopar calibrate --quick      # measure this machine; plan/export then use the profile
"""

from __future__ import annotations

import sys
import warnings

from autopar.cli.arguments import USAGE_ERROR, UsageError, VerifyFailed, default_profile_path, parse_bytes, parser
from autopar.cli.commands import COMMANDS
from autopar.cli.models import load_model
from autopar.ir import AutoparError

__all__ = ["UsageError", "default_profile_path", "load_model", "main", "parse_bytes"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``autopar`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    >>> main(["plan", "gpt", "--mesh", "2x2", "--batch", "8"])   # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if argv[:1] == ["run"] and "--" in argv:  # everything after "--" belongs to the script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    parser_ = parser()
    try:
        args = parser_.parse_args(argv)
    except SystemExit as stop:  # argparse has printed usage and the error (or --help)
        return stop.code if isinstance(stop.code, int) else USAGE_ERROR
    args.script_args = script_args
    try:
        with warnings.catch_warnings():
            # torch.export's own deprecation noise, not something a user can act on
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            return COMMANDS[args.handler](args)
    except UsageError as error:
        print(f"autopar {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except (AutoparError, VerifyFailed) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
