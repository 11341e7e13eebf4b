"""Puts tests/ on sys.path so tests share helpers as plain imports (``from planning import ...``),
and points the CLI's cache at an empty folder, so a profile calibrated on this machine
(``autopar calibrate``) does not change what the tests plan."""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
