"""examples/train.py with faults injected: what the fault-tolerance tests launch in its place.

    faulty_train.py --fault ATTEMPT:RANK:STEP:KIND [--fault ...] TRAIN_ARGS...

On restart ATTEMPT (``TORCHELASTIC_RESTART_COUNT``, set by ``autopar run`` and torchrun), rank
RANK, where KIND is

- ``kill``: SIGKILLs itself when it is about to train step STEP (its peers are then inside that
  step's collectives, or the checkpoint's);
- ``kill-in-write``: SIGKILLs itself inside the checkpoint write of step STEP, after its own DCP
  file is on disk and before the ranks have agreed the write is done (the folder stays partial);
- ``stall``: sleeps far past any timeout when it is about to train step STEP;
- ``stall-in-backward``: the same, from inside the backward of step STEP (its peers are then
  in that backward's collectives).

Each fault prints ``[fault] ...`` first, so a test can tell it happened.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train  # noqa: E402


def _faults_here() -> dict[int, str]:
    """STEP → KIND for this rank and attempt, taken out of sys.argv."""
    attempt, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ["RANK"]
    faults, rest, args = {}, [], iter(sys.argv[1:])
    for arg in args:
        if arg != "--fault":
            rest.append(arg)
            continue
        fault_attempt, fault_rank, step, kind = next(args).split(":")
        if (fault_attempt, fault_rank) == (attempt, rank):
            faults[int(step)] = kind
    sys.argv[1:] = rest
    return faults


def _die(text: str) -> None:
    print(f"[fault] rank {os.environ['RANK']} {text}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _stall(text: str) -> None:
    print(f"[fault] rank {os.environ['RANK']} stalls {text}", flush=True)
    time.sleep(3600)


def main() -> None:
    faults = _faults_here()
    batch_of_step = train.arithmetic_batch
    stall_in_backward = []  # the step whose backward stalls, once its batch is drawn

    def arithmetic_batch(step, *args):
        kind = faults.get(step)
        if kind == "kill" and step > 0:  # step 0 is also the example batch, drawn before training
            _die(f"killed itself before step {step}")
        if kind == "stall" and step > 0:
            _stall(f"before step {step}")
        if kind == "stall-in-backward" and step > 0:
            stall_in_backward.append(step)
        return batch_of_step(step, *args)

    backward = torch.Tensor.backward

    def backward_that_stalls(tensor, *args, **kwargs):
        if stall_in_backward:  # the hook runs inside the autograd engine, as backward starts
            step = stall_in_backward.pop()
            tensor.register_hook(lambda grad: _stall(f"in the backward of step {step}"))
        return backward(tensor, *args, **kwargs)

    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        written.wait()
        for step, kind in faults.items():
            if kind == "kill-in-write" and f"step-{step:08d}" in str(self.path):
                _die(f"killed itself while writing the checkpoint of step {step} (its DCP file is on disk)")
        return written

    train.arithmetic_batch = arithmetic_batch
    torch.Tensor.backward = backward_that_stalls
    FileSystemWriter.write_data = write_then_die
    train.main()


if __name__ == "__main__":
    main()
