"""The README's main job: the training example on local processes, under `autopar run` and torchrun."""

import subprocess
import sys
from pathlib import Path

import pytest

from autopar.runtime.launch import free_port

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "16", "--hidden", "32", "--seq", "16", "--batch", "8", "--vocab", "16", "--lr", "1e-2"]


def _losses(output: str) -> list[float]:
    return [float(line.split("loss")[1].split()[0]) for line in output.splitlines() if " loss " in line]


@pytest.mark.parametrize(
    "launcher",
    [
        [sys.executable, "-m", "autopar.cli", "run", "examples/train.py", "--nproc", "2", "--timeout", "120", "--"],
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "PORT",
            "examples/train.py",
        ],
    ],
    ids=["autopar-run", "torchrun"],
)
def test_the_example_trains_with_a_found_plan(launcher):
    launcher = [str(free_port()) if arg == "PORT" else arg for arg in launcher]
    done = subprocess.run(launcher + SMALL, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Plan for mesh 2" in done.stdout
    losses = _losses(done.stdout)
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], losses  # steps 0, 5, 10, 15 are printed: it learns
