"""Checkpointer and checkpoint checks on 2 gloo ranks (one spawn): a save is atomic and the newest
``keep`` stay; resume restores parameters, optimizer, step, RNG and data position, and skips an
incomplete newest checkpoint; a truncated, missing or other model's checkpoint is refused on
every rank with nothing loaded, and the error names what is wrong."""

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from equivalence import load_example

import autopar
from autopar.runtime import Checkpointer, load_checkpoint
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

MLP = dict(hidden=16, ffn=32, layers=2)
BATCH = 8


class Position:
    """A stand-in for a stateful data loader."""

    def __init__(self):
        self.index = 0

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def _trained(seed: int, world: int, optimizer_class=torch.optim.AdamW, **mlp):
    torch.manual_seed(seed)
    model = load_example("mlp.py").build(**{**MLP, **mlp})
    inputs = model.example_inputs(BATCH)
    pmodel = autopar.parallelize(model, world, inputs, degrees={"dp": world})
    optimizer = pmodel.optimizer(
        optimizer_class, lr=1e-2, **({"momentum": 0.9} if optimizer_class is torch.optim.SGD else {})
    )
    return pmodel, optimizer, inputs


def _step(pmodel, optimizer, inputs) -> None:
    pmodel.train_step(*pmodel.shard_batch(*inputs))
    optimizer.step()
    optimizer.zero_grad()


def _weights(pmodel) -> dict:
    return {name: p.full_tensor().clone() for name, p in pmodel.named_parameters()}


def _refusal(load) -> tuple[str, str]:
    try:
        load()
    except autopar.AutoparError as error:
        return type(error).__name__, str(error)
    return "loaded", ""


def _on_rank_zero(change) -> None:
    if dist.get_rank() == 0:
        change()
    dist.barrier()


def _checkpointer_checks(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    results = {}
    pmodel, optimizer, inputs = _trained(0, world)
    checkpointer = Checkpointer(folder / "job", every=2, keep=2)
    position = Position()
    for step in range(1, 7):
        _step(pmodel, optimizer, inputs)
        position.index = 10 * step
        saved = checkpointer.maybe_save(step, pmodel, optimizer, data=position)
        results.setdefault("saved", []).append(saved is not None)
    results["kept"] = sorted(path.name for path in (folder / "job").iterdir())
    weights, draws = _weights(pmodel), torch.rand(3)  # the RNG as saved at step 6 is the one before this draw

    # a second job: other weights, the RNG moved on, then resumed
    resumed, resumed_optimizer, _ = _trained(1, world)
    resumed_position = Position()
    torch.rand(5)
    results["step"] = checkpointer.resume(resumed, resumed_optimizer, data=resumed_position)
    results["draws"] = torch.equal(torch.rand(3), draws)
    results["weights"] = all(torch.equal(w, _weights(resumed)[n]) for n, w in weights.items())
    results["position"] = resumed_position.index
    _step(pmodel, optimizer, inputs)
    _step(resumed, resumed_optimizer, inputs)
    results["next_step"] = all(torch.equal(w, _weights(resumed)[n]) for n, w in _weights(pmodel).items())
    results["plan"] = (checkpointer.plan(world) == pmodel.plan, checkpointer.plan(world + 1))

    # a newest checkpoint whose manifest is gone (as if its write never finished), a partial folder
    # and a half-deleted one (a crash mid-drop)
    def incomplete():
        shutil.copytree(folder / "job/step-00000006", folder / "job/step-00000010")
        os.remove(folder / "job/step-00000010/autopar.json")
        (folder / "job/.step-00000012.partial").mkdir()
        (folder / "job/.step-00000002.deleting").mkdir()

    _on_rank_zero(incomplete)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["fallback"] = checkpointer.resume(resumed, resumed_optimizer)
    results["warned"] = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    checkpointer.save(12, pmodel, optimizer)
    results["after_partial"] = sorted(path.name for path in (folder / "job").iterdir())

    # bad checkpoints, loaded directly: refused on every rank before any tensor changes
    source = folder / "job/step-00000012"
    before = _weights(resumed)

    def damaged(name: str, damage) -> Path:
        target = folder / name
        _on_rank_zero(lambda: (shutil.copytree(source, target), damage(target)))
        return target

    def truncate(path: Path) -> None:
        data = (path / "__1_0.distcp").read_bytes()
        (path / "__1_0.distcp").write_bytes(data[: len(data) // 2])

    refusals = {
        "truncated": damaged("truncated", truncate),
        "no metadata": damaged("no-metadata", lambda path: os.remove(path / ".metadata")),
        "missing": folder / "does-not-exist",
    }
    results["refused"] = {
        kind: _refusal(lambda path=path: load_checkpoint(resumed, resumed_optimizer, path))
        for kind, path in refusals.items()
    }
    results["untouched"] = all(torch.equal(w, _weights(resumed)[n]) for n, w in before.items())
    wider, wider_optimizer, _ = _trained(0, world, hidden=24)
    results["refused"]["other model"] = _refusal(lambda: load_checkpoint(wider, wider_optimizer, source))
    sgd_model, sgd, _ = _trained(0, world, optimizer_class=torch.optim.SGD)
    results["refused"]["other optimizer"] = _refusal(lambda: load_checkpoint(sgd_model, sgd, source))
    return results


def test_checkpoints_are_atomic_resume_everything_and_refuse_bad_input(tmp_path):
    rank_0, rank_1 = run_local(_checkpointer_checks, 2, str(tmp_path), timeout_s=180)
    assert rank_0["refused"] == rank_1["refused"], "every rank refuses alike"
    results = rank_0
    assert results["saved"] == [False, True, False, True, False, True]
    assert results["kept"] == ["step-00000004", "step-00000006"]
    assert results["step"] == 6 and results["position"] == 60
    assert results["draws"] and results["weights"] and results["next_step"]
    assert results["plan"] == (True, None)
    assert results["fallback"] == 6 and "step-00000010 has no autopar.json" in results["warned"][0]
    assert results["after_partial"] == ["step-00000006", "step-00000012"]  # leftovers and the broken 10 went

    refused = results["refused"]
    assert refused["truncated"][0] == "IncompleteCheckpointError"
    assert "__1_0.distcp is" in refused["truncated"][1] and "bytes (written:" in refused["truncated"][1]
    assert (
        refused["no metadata"][0] == "IncompleteCheckpointError" and ".metadata is missing" in refused["no metadata"][1]
    )
    assert refused["missing"] == (
        "IncompleteCheckpointError",
        f"no checkpoint at {tmp_path}/does-not-exist: the folder does not exist",
    )
    assert results["untouched"]
    assert refused["other model"][0] == "CheckpointError"
    assert "'blocks.0.fc1.weight' is (32, 16) there and (32, 24) here" in refused["other model"][1]
    assert refused["other optimizer"][0] == "CheckpointError"
    assert "['exp_avg', 'exp_avg_sq', 'step'], this one keeps ['momentum_buffer']" in refused["other optimizer"][1]
