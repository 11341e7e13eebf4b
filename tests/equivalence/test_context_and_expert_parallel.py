"""Context and expert parallelism against the unparallelized model: same loss, full gradients
and parameters after AdamW (fp32), on gloo groups of 2 and 4 ranks. Each attention method
(ring, Ulysses) causal and not, on eager attention fused at capture and on HF Llama; experts of
the MoE example and of HF Mixtral; each composed with data, tensor and pipeline parallelism (the
pipeline with ignored targets, which its sequence chunks and microbatches count unequally)."""

import pytest
from equivalence import GPT_SP, GPT_TP, assert_matches, check_every_case, run_cases

from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

LONG = dict(hidden=32, layers=2, heads=4, vocab=64, seq=32)  # seq splits into 2 x 4 chunks
MOE = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)
MIXTRAL = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16, aux_loss_coef=0.02)  # its router loss too
RING, ULYSSES = {"layers.*.attn": "ring"}, {"layers.*.attn": "ulysses"}
EXPERTS, MIXTRAL_EXPERTS = {"layers.*.moe": "experts"}, {"model.layers.*.mlp": "experts"}
ATTENTION_TP = {name: placement for name, placement in GPT_TP.items() if ".attn." in name}  # Megatron's heads split


def _attention_cases(cp: int) -> list:
    return [
        ("long_context_gpt", "build", {**LONG, "causal": causal}, dict(degrees={"cp": cp}, constraints=method))
        for method in (RING, ULYSSES)
        for causal in (True, False)
    ]


HF_LLAMA = dict(hidden=64, layers=2, heads=4, kv_heads=2, seq=32)  # with RoPE, its causal mask proved at capture

TWO_RANKS = _attention_cases(2) + [
    (
        "long_context_gpt",
        "build",
        {**LONG, "attention": "eager"},
        dict(degrees={"cp": 2}, constraints=RING),
    ),  # fused at capture
    ("hf", "build_llama", HF_LLAMA, dict(degrees={"cp": 2}, constraints={"model.layers.*.self_attn": "ring"})),
    ("hf", "build_llama", HF_LLAMA, dict(degrees={"cp": 2}, constraints={"model.layers.*.self_attn": "ulysses"})),
    ("moe_gpt", "build", MOE, dict(degrees={"ep": 2}, constraints=EXPERTS)),
    ("hf", "build_mixtral", MIXTRAL, dict(degrees={"ep": 2}, constraints=MIXTRAL_EXPERTS)),
]
FOUR_RANKS = _attention_cases(4) + [
    ("long_context_gpt", "build", LONG, dict(mesh="2x2", degrees={"dp": 2, "cp": 2}, constraints=RING)),
    (
        "long_context_gpt",
        "build",
        LONG,
        dict(mesh="2x2", degrees={"cp": 2, "tp": 2}, constraints={**GPT_TP, **ULYSSES}),
    ),
    ("long_context_gpt", "build", LONG, dict(mesh="2x2", degrees={"cp": 2, "tp": 2}, constraints={**GPT_SP, **RING})),
    (  # ignored targets: the cp ranks and the microbatches count unequal targets
        "long_context_gpt",
        "build",
        LONG,
        dict(mesh="2x2", degrees={"pp": 2, "cp": 2}, constraints=RING, microbatches=2, ignore_targets=True),
    ),
    ("moe_gpt", "build", MOE, dict(degrees={"ep": 4}, constraints=EXPERTS)),  # Mixtral EP4: test_unmodified_models
    (
        "moe_gpt",
        "build",
        MOE,
        dict(mesh="2x2", degrees={"dp": 2, "ep": 2}, constraints=EXPERTS, zero=1, optimizer="shards"),
    ),
    ("moe_gpt", "build", MOE, dict(mesh="2x2", degrees={"ep": 2, "tp": 2}, constraints={**ATTENTION_TP, **EXPERTS})),
]


def _check(case, result):
    file, builder, kwargs, options = case
    label = f"{file}:{builder} causal={kwargs.get('causal', True)} {options['degrees']} {options['constraints']}"
    assert_matches(label, result)
    pinned = {dim: n for dim, n in options["degrees"].items() if dim != "pp"}
    assert {dim: n for dim, n in result["degrees"].items() if n > 1} == pinned, (label, result)
    kernel = next(value for value in options["constraints"].values() if value in ("ring", "ulysses", "experts"))
    assert result["kernels"] and set(result["kernels"]) == {kernel}, (label, result)  # the kernel really ran
    if "tp" in options["degrees"]:  # and the pinned tensor parallelism communicates too
        assert result["collectives"] > len(result["kernels"]) + 3, (label, result)


@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_one_training_step_matches_single_process(world, cases):
    results = run_local(run_cases, world, cases, 4, timeout_s=600)[0]
    check_every_case(cases, results, _check)
