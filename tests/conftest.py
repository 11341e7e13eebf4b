"""Puts tests/helpers/ on sys.path so tests share helpers as plain imports (``from planning import
...``), and points the CLI's cache at an empty folder, so a profile calibrated on this machine
(``autopar calibrate``) does not change what the tests plan.

The folders mirror the source (``ir/``, ``passes/<stage>/``, ``runtime/``, ``autopar/`` for the
API and CLI, ``examples/``); ``equivalence/`` holds the multi-process suites that train one step
on gloo ranks and compare with one process."""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
