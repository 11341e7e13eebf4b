"""Training survives a dead rank and resumes on another cluster (examples/train.py, 4 gloo ranks).

One uninterrupted 4-rank run (checkpoints every 2 steps, all kept) is the reference for both tests:

- a 4-rank job under ``autopar run --max-restarts 2`` loses rank 1 to SIGKILL before step 5,
  restarts from step 4, loses rank 2 to SIGKILL inside the write of checkpoint 6 (a partial folder
  that must never load), restarts from step 4 again and finishes: its final parameters and AdamW
  state equal the reference's bitwise (the data of step s depends only on s; the job trains with
  the reference's saved plan, since a search times ops on this machine and two near-equal plans can
  swap between runs; a restart reuses the checkpoint's plan);
- the reference's checkpoint of step 4 (what a 4-rank job that stopped there leaves) resumed by
  the same script on 2 ranks under ``torchrun --max-restarts 1``: it plans for 2 ranks (dp=2
  here, where the reference ran dp=4), loses rank 1 before step 7, restarts from its own checkpoint 6,
  and its loss at every step from 4 on equals the reference's within 1e-4.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from autopar.runtime.launch import free_port

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 10, 2
TRAIN = ["--steps", str(STEPS), "--hidden", "32", "--seq", "16", "--batch", "32", "--vocab", "16", "--lr", "1e-2"]
TRAIN += ["--log-every", "1", "--checkpoint-every", str(EVERY)]
AUTOPAR_RUN = [sys.executable, "-m", "autopar.cli", "run"]


def _run(command: list[str]) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _losses(output: str) -> dict[int, float]:
    """step → loss, the last printed for each step (a restarted job prints some twice)."""
    losses = {}
    for line in output.splitlines():
        if "] step " in line or line.startswith("step "):
            step, loss = line.split("step")[1].split()[0], line.split("loss")[1].split()[0]
            losses[int(step)] = float(loss)
    return losses


def _checkpoint(path: Path, out: Path) -> dict:
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    output = _run(
        AUTOPAR_RUN
        + ["examples/train.py", "--nproc", "4", "--timeout", "200", "--"]
        + TRAIN
        + ["--checkpoint-dir", str(folder), "--checkpoint-keep", str(STEPS // EVERY)]
    )
    assert "Plan for mesh 4" in output, output[-3000:]  # dp=4 here: each step all-reduces gradients
    return folder, _losses(output)


def test_killed_ranks_restart_and_end_bitwise_as_the_uninterrupted_run(reference, tmp_path):
    folder, _ = reference
    faulty = tmp_path / "faulty"
    output = _run(
        AUTOPAR_RUN
        + ["tests/helpers/faulty_train.py", "--nproc", "4", "--max-restarts", "2", "--timeout", "220", "--"]
        + ["--fault", "0:1:5:kill", "--fault", "1:2:6:kill-in-write", *TRAIN, "--checkpoint-dir", str(faulty)]
        + ["--plan", str(folder / f"step-{EVERY:08d}" / "plan.json")]
    )
    assert "[fault] rank 1 killed itself before step 5" in output
    assert "[fault] rank 2 killed itself while writing the checkpoint of step 6" in output
    assert "restart 1 of 2" in output and "restart 2 of 2" in output
    assert output.count("resumed from step 4 on 4 ranks") == 2, output[-4000:]  # checkpoint 6 never completed
    assert sorted(p.name for p in faulty.iterdir()) == ["step-00000008", "step-00000010"]  # keep=2, no partial
    final = f"step-{STEPS:08d}"
    ours, theirs = _checkpoint(faulty / final, tmp_path / "ours.pt"), _checkpoint(folder / final, tmp_path / "ref.pt")
    assert ours["model"].keys() == theirs["model"].keys() and ours["optimizer"]["output.weight"]["step"] == STEPS
    assert _bitwise_equal(ours, theirs)


def test_four_rank_checkpoint_resumes_on_two_ranks_under_torchrun(reference, tmp_path):
    folder, reference_losses = reference
    resumed = tmp_path / "two-ranks"
    resumed.mkdir()
    shutil.copytree(folder / "step-00000004", resumed / "step-00000004")
    output = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
        + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        + ["tests/helpers/faulty_train.py", "--fault", "0:1:7:kill", *TRAIN, "--checkpoint-dir", str(resumed)]
    )
    assert "Plan for mesh 2" in output and "resumed from step 4 on 2 ranks" in output
    assert "[fault] rank 1 killed itself before step 7" in output and "resumed from step 6 on 2 ranks" in output
    losses = _losses(output)
    assert sorted(losses) == list(range(4, STEPS)), losses
    for step, loss in losses.items():
        assert abs(loss - reference_losses[step]) <= 1e-4 * abs(reference_losses[step]), (step, loss, reference_losses)
