"""Every sharding rule proven on its own (STYLE.md 16): each op of the rule table, every
strategy its rule offers, on random shapes and values, forward and backward (rule_check.py).
The count checked is printed at the end of the run (conftest.py)."""

import pytest
import torch
from rule_check import TALLY, Sample, check_sample, op_name, validate
from rule_samples import SAMPLES

from autopar.passes.sharding.rules import _ADDITIVE, _ALSO_POINTWISE, _SCALING, OWN_OPS, RULES

EXAMPLES_PER_OP = 12  # hypothesis examples per op


def test_every_op_of_the_rule_table_has_a_sample():
    table = {op_name(op) for op in (*RULES, *_ALSO_POINTWISE, *_ADDITIVE, *_SCALING)} | set(OWN_OPS)
    missing = sorted(table - set(SAMPLES))
    assert not missing, f"add a sample for {missing} to tests/helpers/rule_samples.py so their rules are checked"


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_every_strategy_matches_the_op_on_whole_tensors(op):
    validate(SAMPLES[op], EXAMPLES_PER_OP)
    assert op in TALLY.forward or op in TALLY.kernels, f"no strategy of {op} was checked"


aten = torch.ops.aten
F64 = torch.float64


def _x(*shape):
    return torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))


# The cases the validation found wrong, each fixed in rules.py or the rewrite's localize_arguments.
REGRESSIONS = {
    # P -> P for x + 2: the ranks' x_r + 2 sum to x + 2p (only P(avg) -> P(avg) holds)
    "add of a number": Sample(aten.add.Tensor, (_x(2), 2)),
    "sub of a number": Sample(aten.sub.Tensor, (_x(2), 2)),
    # P -> P for a cast to integers: truncation is not linear
    "cast to int64": Sample(aten._to_copy.default, (_x(2),), {"dtype": torch.int64}),
    # argmax(dim=0) drops dim 0: a shard of input dim 1 is output dim 0
    "argmax dropping its dim": Sample(aten.argmax.default, (_x(2, 2, 2), 0, False)),
    # a shard of 1 row: squeeze(0) would drop it; unflatten's sizes are the whole dim's
    "squeeze of a sharded dim": Sample(aten.squeeze.dim, (_x(2), 0)),
    "unflatten of a sharded dim": Sample(aten.unflatten.int, (_x(2), 0, [1, 2])),
    # a class-weighted mean divides by each shard's own total weight: the shards' means do not average
    "weighted cross-entropy mean": Sample(
        aten.cross_entropy_loss.default,
        (_x(4, 6), torch.tensor([0, 1, 2, 3]), torch.rand(6, dtype=F64) + 0.5, 1),
        constant_inputs=(2,),
    ),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_rule_bugs_found_by_the_validation_stay_fixed(case):
    assert check_sample(REGRESSIONS[case], 2) == []
