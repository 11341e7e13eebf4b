"""Checkpoints hold the logical state: written under one plan, read under another, they give
the single-process model's parameters and AdamW state, and training goes on as it would."""

import dataclasses

import pytest
import torch
from equivalence import ADAM_EPS, GPT_TP, LEARNING_RATE, close, load_and_compare, load_example, reference_after_one_step
from shared_captures import build

import autopar
from autopar.runtime.checkpoint import load_weights, save_checkpoint
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

GPT = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
BATCH = 8


def _parallel(gpt, seed: int, mesh, degrees, constraints, zero: int, lr: float):
    torch.manual_seed(seed)
    model = build(gpt.build, **GPT)
    inputs = model.example_inputs(BATCH)
    base = autopar.plan(model, mesh, inputs, degrees=degrees, constraints=constraints, zero=0)
    pmodel = autopar.parallelize(model, mesh, inputs, plan=dataclasses.replace(base, zero=zero))
    return pmodel, pmodel.optimizer(torch.optim.AdamW, lr=lr, eps=ADAM_EPS)


def _save_under_dp4_zero1_resume_under_others(rank: int, world: int, path: str) -> dict:
    gpt = load_example("gpt.py")
    model, inputs, reference = reference_after_one_step(gpt.build, GPT, BATCH)

    writer, writer_optimizer = _parallel(gpt, 0, 4, {"dp": 4, "tp": 1}, None, 1, LEARNING_RATE)
    writer.train_step(*writer.shard_batch(*inputs))
    writer_optimizer.step()
    save_checkpoint(writer, writer_optimizer, path)

    readers = {"DP2xTP2 ZeRO-3": ("2x2", {"dp": 2, "tp": 2}, GPT_TP, 3), "DP4 ZeRO-2": (4, {"dp": 4, "tp": 1}, None, 2)}
    return {name: _resume(gpt, model, reference, inputs, path, *reader) for name, reader in readers.items()}


def _resume(gpt, model, reference, inputs, path, mesh, degrees, constraints, zero) -> dict:
    """Load under another plan, with other weights and another learning rate (the checkpoint
    decides all of them); compare with the reference after its first step, then after a
    second step taken both ways."""
    reader, reader_optimizer = _parallel(gpt, 1, mesh, degrees, constraints, zero, 10 * LEARNING_RATE)
    state, loaded = load_and_compare(reader, reader_optimizer, path, model, reference)
    loaded["steps"] = {float(entry["step"]) for entry in state["optimizer"].values()}
    params = dict(model.named_parameters())
    ref_model = {name: p.detach().clone() for name, p in params.items()}
    ref_state = {p: {k: v.clone() for k, v in s.items()} for p, s in reference.state.items()}
    model(*inputs).backward()  # a second step, both ways
    reference.step()
    reference.zero_grad()
    reader.train_step(*reader.shard_batch(*inputs))
    reader_optimizer.step()
    loaded["second_step"] = all(close(p.full_tensor(), params[name]) for name, p in reader.named_parameters())
    with torch.no_grad():  # back to the first step for the next reader
        for name, p in params.items():
            p.copy_(ref_model[name])
        for p, s in ref_state.items():
            reference.state[p] = s
    return loaded


def test_a_checkpoint_from_one_plan_resumes_under_another(tmp_path):
    results = run_local(_save_under_dp4_zero1_resume_under_others, 4, str(tmp_path / "ckpt"), timeout_s=240)
    for by_reader in results:
        for reader, loaded in by_reader.items():
            assert loaded["params"] and loaded["moments"], (reader, loaded)
            assert loaded["steps"] == {1.0} and loaded["lr"] == LEARNING_RATE, (reader, loaded)
            assert loaded["second_step"], (reader, loaded)
    # exported: the weights read whole in this process (no process group) are the reference's after its step
    model, _, _ = reference_after_one_step(load_example("gpt.py").build, GPT, BATCH)
    weights = load_weights(tmp_path / "ckpt")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) == {name for name, _ in model.named_buffers()}, (missing, unexpected)
    assert weights.keys() == dict(model.named_parameters()).keys()
    assert all(close(weights[name], p) for name, p in model.named_parameters()), "weights differ"
