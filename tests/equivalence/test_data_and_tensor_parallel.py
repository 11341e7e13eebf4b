"""Rewrite + runtime against the unparallelized model: same loss, full gradients and
parameters after AdamW (fp32), on real gloo process groups of 2 and 4 ranks.

The vocabulary-split cases (``*_VOCAB``) cover GPT and Llama on TP2, TP4 and DP2xTP2, each model
with and without sequence parallelism, all with ignored targets (a different count per row). The
``regather`` cases keep the sequence-parallel norms' outputs as shards and gather them again in
backward (GPT's fused q/k/v linear, Llama's separate q, k, v and gate/up; under ZeRO-3 too, whose
gathered weights the fused linears read).
"""

import pytest
from equivalence import (
    GPT2_SP,
    GPT2_TP,
    GPT_SP,
    GPT_TP,
    GPT_VOCAB,
    LLAMA_SP,
    LLAMA_TP,
    LLAMA_VOCAB,
    MLP_TP,
    assert_matches,
    check_every_case,
    run_cases,
)

from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

GPT = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
MLP = dict(hidden=32, ffn=64, layers=2)
HF = dict(hidden=64, layers=2, heads=4, vocab=128, seq=16)
IGNORED = dict(ignore_targets=True)  # rows ignore 1, 2, ... targets: data-parallel shards count differently

TWO_RANKS = [
    ("mlp", "build", MLP, dict(degrees={"dp": 2})),
    ("mlp", "build", MLP, dict(degrees={"tp": 2}, constraints=MLP_TP)),
    ("gpt", "build", GPT, dict(degrees={"dp": 2}, **IGNORED)),
    ("gpt", "build", GPT, dict(degrees={"dp": 2}, optimizer="shards")),
    ("gpt", "build", GPT, dict(degrees={"tp": 2}, constraints=GPT_TP)),
    ("gpt", "build", GPT, dict(degrees={"tp": 2}, constraints=GPT_SP)),
    ("gpt", "build", GPT, dict(degrees={"tp": 2}, constraints={**GPT_TP, **GPT_VOCAB}, **IGNORED)),
    ("hf", "build_gpt2", HF, dict(degrees={"tp": 2}, constraints=GPT2_TP)),
    ("hf", "build_gpt2", HF, dict(degrees={"tp": 2}, constraints=GPT2_SP)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 2}, constraints=LLAMA_TP)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 2}, constraints=LLAMA_SP)),
    ("gpt", "build", GPT, dict(degrees={"tp": 2}, constraints=GPT_SP, regather=True)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 2}, constraints=LLAMA_SP, regather=True)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 2}, constraints={**LLAMA_SP, **LLAMA_VOCAB}, **IGNORED)),
    ("hf", "build_mixtral", HF, dict(degrees={"dp": 2})),
    # plans made on the meta device, as `autopar plan` makes them (attention's strides differ there)
    ("gpt", "build", GPT, dict(degrees={"tp": 2}, constraints=GPT_SP, regather=True, made_on_meta=True)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 2}, constraints=LLAMA_SP, made_on_meta=True)),
]

FOUR_RANKS = [
    ("mlp", "build", MLP, dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints=MLP_TP)),
    ("gpt", "build", GPT, {}),
    ("gpt", "build", GPT, dict(degrees={"dp": 4}, **IGNORED)),
    ("gpt", "build", GPT, dict(degrees={"tp": 4}, constraints=GPT_TP)),
    ("gpt", "build", GPT, dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints=GPT_SP)),
    ("hf", "build_gpt2", HF, dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints=GPT2_TP)),
    ("hf", "build_llama", HF, dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints=LLAMA_SP)),
    (
        "hf",
        "build_llama",
        HF,
        dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints=LLAMA_SP, zero=3, regather=True),
    ),
    ("gpt", "build", GPT, dict(degrees={"tp": 4}, constraints={**GPT_SP, **GPT_VOCAB}, **IGNORED)),
    ("hf", "build_llama", HF, dict(degrees={"tp": 4}, constraints={**LLAMA_TP, **LLAMA_VOCAB}, **IGNORED)),
    ("gpt", "build", GPT, dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints={**GPT_TP, **GPT_VOCAB}, **IGNORED)),
    (
        "hf",
        "build_llama",
        HF,
        dict(mesh="2x2", degrees={"dp": 2, "tp": 2}, constraints={**LLAMA_SP, **LLAMA_VOCAB}, **IGNORED),
    ),
]


def _check(case, result):
    file, builder, _, options = case
    label = f"{file}:{builder} {options.get('degrees', 'auto')} {sorted(options.get('constraints', {}))[:1]}"
    assert_matches(label, result)
    if "degrees" in options:
        expected = {**{"dp": 1, "tp": 1}, **options["degrees"]}
        if len(options["degrees"]) == 1:
            expected = {k: (v if k in options["degrees"] else 1) for k, v in expected.items()}
        assert result["degrees"] == expected, (label, result)
    if options.get("degrees") in ({"dp": 2}, {"dp": 4}):  # the loss all-reduce overlaps backward
        assert result["overlapped_loss_reduction"], (label, result)
    if "constraints" in options:  # a pinned tensor-parallel plan really communicates
        assert result["collectives"] > 0, (label, result)
    if "vocab" in options.get("constraints", {}).values():  # the embedding and the loss run split
        assert result["kernels"].count("vocab") >= 2, (label, result)
    if options.get("regather"):  # both norms' outputs of both layers kept as shards
        assert result["kernels"].count("regather") >= 4 and result["schedule"].regather, (label, result)


@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_one_training_step_matches_single_process(world, cases):
    results = run_local(run_cases, world, cases, timeout_s=600)[0]
    check_every_case(cases, results, _check)
