"""Models that are not causal language models, parallelized with the two-argument form (no example
inputs) and trained as one process trains them, on 2 gloo ranks in one spawn: the slice of
``benchmarks/other_models.py`` (which runs every model there on DP2, TP2 and the free plan) that
covers each new path. autopar's ResNet (examples/cnn.py) on DP2: BatchNorm's statistics averaged
over the ranks and its running statistics updated as one process updates them; a BERT sequence
classifier (labels per example) on its free plan; T5 (an encoder-decoder whose decoder has a
config of its own) on TP2, and on two stages of the zero-bubble V schedule (its decoder's position
bias, made from a bias table alone in one stage and sent to the next: the gradient returned for it
reaches the table); Whisper (audio features in) on DP2. Loss, every full gradient, every parameter
after AdamW and every floating buffer allclose (rtol 1e-4, atol 1e-6), every parameter held by some
rank."""

import pytest
from equivalence import check_every_case, load_example

from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

CASES = [
    ("examples/cnn.py", "DP2", {"degrees": {"dp": 2}}),
    ("bert-cls", "auto", {}),
    ("t5", "TP2", {"degrees": {"tp": 2}}),
    ("t5", "PP2 zbv", {"degrees": {"pp": 2}, "pipeline": "zbv"}),
    ("whisper", "DP2", {"degrees": {"dp": 2}}),
]


def _all_cases(rank, world):
    other_models = load_example("other_models.py", "benchmarks")
    return [other_models.run_models(rank, world, [name], {label: pins})[0][label] for name, label, pins in CASES]


def test_other_models_train_as_one_process():
    other_models = load_example("other_models.py", "benchmarks")
    by_rank = run_local(_all_cases, 2, timeout_s=600)

    def check(case, results):
        name, _, pins = case
        result = other_models.worst_over_ranks(results, name)  # failing where no rank holds some parameter
        assert "error" not in result, result["error"]
        assert result["ok"], result
        assert {k: v for k, v in result["degrees"].items() if k in pins.get("degrees", {})} == pins.get("degrees", {})

    check_every_case(CASES, [list(r) for r in zip(*by_rank)], check)
