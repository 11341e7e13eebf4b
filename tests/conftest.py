"""Puts tests/ on sys.path so tests share helpers as plain imports (``from planning import ...``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
