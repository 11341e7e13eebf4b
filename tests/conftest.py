"""Puts tests/ on sys.path so every test imports the harness as ``from distributed import ...``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
