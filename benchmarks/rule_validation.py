"""Every sharding rule proven on its own: the rule-validation count, per op.

    python benchmarks/rule_validation.py            # 50 random calls per op; writes BENCHMARKS.md
    python benchmarks/rule_validation.py --quick    # 12 per op (what the test suite runs); prints only

Runs the validation of tests/passes/sharding/test_rule_validation.py (tests/helpers/rule_check.py:
each strategy's shards run per rank, combined, compared with the op on whole tensors, forward and
backward) with more random calls per op, and writes the "rule-validation" section.
"""

import argparse
import datetime
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).parent))
from publish import publish  # noqa: E402
from rule_check import TALLY, validate  # noqa: E402
from rule_samples import SAMPLES  # noqa: E402

SECTION = "rule-validation"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 calls per op, as the tests; print, do not write")
    args = parser.parse_args()
    examples = 12 if args.quick else 50
    started = time.perf_counter()
    for op in sorted(SAMPLES):
        validate(SAMPLES[op], examples)  # raises on the first wrong strategy, naming it
    elapsed = time.perf_counter() - started
    rows = [
        [op, len(TALLY.forward.get(op, ())), len(TALLY.backward.get(op, ())), len(TALLY.kernels.get(op, ()))]
        for op in sorted(SAMPLES)
    ]
    table = tabulate(rows, headers=["op", "strategies", "with backward", "kernel (elsewhere)"], tablefmt="github")
    section = "\n".join(
        [
            "## Sharding rules, each strategy proven",
            "",
            f"`python benchmarks/rule_validation.py` ({datetime.date.today()}, {examples} random calls per op, "
            f"{elapsed:.0f} s on this machine's 2 shared cores): **{TALLY.summary()}**. For every op of the rule "
            "table (passes/sharding/rules.py) and every strategy its rule offers on random shapes and values, the "
            "inputs are split as the strategy says (chunks, whole, random summands for partial values), the op runs "
            "per rank with the arguments the rewrite gives it, and the pieces combined as the output placement says "
            "(concatenate, equal, sum, mean) equal the op on the whole inputs (fp64); backward likewise, with the "
            "duals the rewrite relies on. Strategies run by a parallel kernel (ring/Ulysses attention, expert "
            "dispatch) are no local op: tests/runtime/kernels checks them on gloo ranks. The validation found seven "
            "wrong strategies, each fixed with a regression test: partial values through `x + number`, "
            "`x - number` and casts to integers, argmax dropping its dim, class-weighted cross-entropy means, "
            "`squeeze` and `unflatten` of a sharded dim.",
            "",
            table,
        ]
    )
    publish(SECTION, section, args.quick)


if __name__ == "__main__":
    main()
