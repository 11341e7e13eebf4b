"""launch_local: torchrun's variables, prefixed output, prompt failure and timeout handling, and
torchrun's restart semantics (a failed rank stops all; all start again while restarts remain)."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from autopar.ir.errors import ConfigError
from autopar.runtime import init_from_env, launch_local
from autopar.runtime.launch import TIMEOUT_EXIT_CODE

ALL_REDUCE_SCRIPT = """
    import torch, torch.distributed as dist
    from autopar.runtime import init_from_env
    init_from_env()
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():g}")
    dist.destroy_process_group()
"""

# rank 0 records its pid, then would wait far longer than the test; rank 1 then fails
FAILING_SCRIPT = """
    import os, sys, time
    pid_path = sys.argv[1]
    if os.environ["RANK"] == "1":
        while not os.path.exists(pid_path):
            time.sleep(0.01)
        sys.exit(3)
    with open(pid_path + ".tmp", "w") as pid_file:
        pid_file.write(str(os.getpid()))
    os.replace(pid_path + ".tmp", pid_path)
    time.sleep(60)
"""

# the rank records its pid, then would wait far longer than the test
RECORDING_SCRIPT = """
    import os, sys, time
    with open(sys.argv[1] + ".tmp", "w") as pid_file:
        pid_file.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(60)
"""

SLEEPING_SCRIPT = """
    import time
    time.sleep(60)
"""

# rank 1 fails on the first attempt only; every start of every rank is recorded
FLAKY_SCRIPT = """
    import os, sys
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']} restarts, rank {rank}")
    sys.exit(3 if rank == "1" and (attempt == "0" or sys.argv[1] == "always") else 0)
"""


def _script(tmp_path, source: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def _is_running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.ranks
def test_ranks_all_reduce_and_output_is_prefixed(tmp_path, capfd):
    assert launch_local(_script(tmp_path, ALL_REDUCE_SCRIPT), [], nproc=2, timeout_s=60) == 0
    lines = capfd.readouterr().out.splitlines()
    assert "[rank 0] rank 0 of 2: sum 3" in lines
    assert "[rank 1] rank 1 of 2: sum 3" in lines


@pytest.mark.ranks
def test_failing_rank_terminates_the_others(tmp_path, capfd):
    pid_path = tmp_path / "rank0.pid"
    start = time.monotonic()
    code = launch_local(_script(tmp_path, FAILING_SCRIPT), [str(pid_path)], nproc=2, timeout_s=60)
    assert code == 3
    assert time.monotonic() - start < 15
    assert pid_path.exists() and not _is_running(int(pid_path.read_text()))
    assert "rank 1 exited with code 3" in capfd.readouterr().err


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.ranks
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path):
    pid_path = tmp_path / "rank0.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from autopar.runtime import launch_local; "
         "launch_local(sys.argv[1], sys.argv[2:], nproc=1, timeout_s=60)",
         _script(tmp_path, RECORDING_SCRIPT), str(pid_path)],
    )  # fmt: skip
    try:
        assert _wait_for(pid_path.exists, 60), "the rank never started"
        launcher.send_signal(signal.SIGKILL)  # it cannot terminate its ranks: the kernel must
        rank = int(pid_path.read_text())
        assert _wait_for(lambda: not _is_running(rank), 10), f"rank pid {rank} outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.ranks
def test_timeout_terminates_every_rank(tmp_path, capfd):
    start = time.monotonic()
    code = launch_local(_script(tmp_path, SLEEPING_SCRIPT), [], nproc=2, timeout_s=1)
    assert code == TIMEOUT_EXIT_CODE
    assert time.monotonic() - start < 10
    assert "timed out" in capfd.readouterr().err


def test_init_outside_a_launcher_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        init_from_env()


@pytest.mark.ranks
def test_a_failed_rank_restarts_every_rank(tmp_path, capfd):
    assert launch_local(_script(tmp_path, FLAKY_SCRIPT), ["once"], nproc=2, timeout_s=60, max_restarts=2) == 0
    captured = capfd.readouterr()
    starts = sorted(line for line in captured.out.splitlines() if "attempt" in line)
    assert starts == [f"[rank {r}] attempt {a} of 2 restarts, rank {r}" for r in (0, 1) for a in (0, 1)]
    assert "restart 1 of 2: starting all 2 ranks again" in captured.err and "restart 2 of 2" not in captured.err


@pytest.mark.ranks
def test_restarts_run_out_with_the_failed_rank_exit_code(tmp_path, capfd):
    assert launch_local(_script(tmp_path, FLAKY_SCRIPT), ["always"], nproc=2, timeout_s=60, max_restarts=2) == 3
    captured = capfd.readouterr()
    assert sum("rank 1] attempt" in line for line in captured.out.splitlines()) == 3
    assert "restart 2 of 2" in captured.err and captured.err.count("rank 1 exited with code 3") == 3
