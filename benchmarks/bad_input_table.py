"""The table of user mistakes and what autopar says to each.

    python benchmarks/bad_input_table.py            # writes the "bad-inputs" section of BENCHMARKS.md
    python benchmarks/bad_input_table.py --quick    # prints only

Makes every mistake of tests/helpers/bad_inputs.py (the table tests/autopar/test_bad_inputs.py
checks) in a scratch folder, those needing a process group on two local gloo ranks, and renders
each with the error text a user gets.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).parent))
from bad_inputs import MISTAKES, in_ranks, table_markdown  # noqa: E402
from publish import publish  # noqa: E402

SECTION = "bad-inputs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="print, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # plan files are written, and named in the messages, relative to here
        texts = {m.what: m.make(Path(folder)) for m in MISTAKES if not m.in_ranks}
        texts.update(in_ranks([m for m in MISTAKES if m.in_ranks], Path(folder)))
        os.chdir(ROOT)
    section = "\n".join(
        [
            "## Bad input: every mistake, the error it gets",
            "",
            f"`python benchmarks/bad_input_table.py`: each of the {len(MISTAKES)} mistakes of "
            "tests/helpers/bad_inputs.py made as a user would (the test suite checks each text names what is "
            "wrong and what to do). Errors are "
            "`autopar.AutoparError` subclasses; those inside a process group are raised on every rank alike.",
            "",
            table_markdown(texts),
        ]
    )
    publish(SECTION, section, args.quick)


if __name__ == "__main__":
    main()
