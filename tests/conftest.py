"""Puts tests/helpers/ on sys.path so tests share helpers as plain imports (``from planning import
...``), and points the CLI's cache at an empty folder, so a profile calibrated on this machine
(``autopar calibrate``) does not change what the tests plan.

The folders mirror the source (``ir/``, ``passes/<stage>/``, ``runtime/``, ``autopar/`` for the
API and CLI, ``examples/``); ``equivalence/`` holds the multi-process suites that train one step
on gloo ranks and compare with one process.

A test that starts ranks is marked ``ranks``. The README's test command runs the others two at a
time (``-n 2``, pytest-xdist: each holds one core) and then these one at a time: their ranks
already fill the cores, and beside another test they would miss their timeouts. An unmarked test
that starts ranks fails, naming the mark it lacks.

At the end of the run it prints what the sharding rules' validation checked
(``tests/passes/sharding/test_rule_validation.py``), the workers' tallies joined."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

import autopar.runtime.launch
import autopar.runtime.spawn

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from rule_check import TALLY  # noqa: E402 (from helpers/)

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autopar-test-cache-")


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: the test starts processes (gloo ranks, or a launcher's)")


@pytest.fixture(autouse=True)
def _ranks_are_marked(request, monkeypatch):
    """Where a test is not marked ``ranks``, the two ways to start ranks (``run_local``'s port,
    ``launch_local``'s processes) refuse."""
    if request.node.get_closest_marker("ranks"):
        return

    def refuse(*_, **__):
        raise RuntimeError(f"{request.node.nodeid} starts ranks: mark it @pytest.mark.ranks (tests/conftest.py)")

    monkeypatch.setattr(autopar.runtime.spawn, "free_port", refuse)
    monkeypatch.setattr(autopar.runtime.launch, "_start_ranks", refuse)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its tally goes to the controller
        session.config.workeroutput["rule_tally"] = {
            kind: {op: sorted(strategies) for op, strategies in getattr(TALLY, kind).items()}
            for kind in ("forward", "backward", "kernels")
        }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for kind, by_op in getattr(node, "workeroutput", {}).get("rule_tally", {}).items():
        for op, strategies in by_op.items():
            getattr(TALLY, kind)[op].update(strategies)


def pytest_terminal_summary(terminalreporter):
    if TALLY.forward:
        terminalreporter.write_line(f"sharding rule validation: {TALLY.summary()}")
