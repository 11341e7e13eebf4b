"""Every user mistake in the table (tests/helpers/bad_inputs.py) gets an AutoparError (or a
command's non-zero exit) that says what is wrong and what to do; the table is rendered into
BENCHMARKS.md by benchmarks/bad_input_table.py."""

import re

import pytest
from bad_inputs import MISTAKES, in_ranks

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)


@pytest.fixture(scope="module")
def ranked_texts(tmp_path_factory) -> dict[str, str]:
    """The mistakes that need a process group, made together on two ranks (one spawn)."""
    return in_ranks([m for m in MISTAKES if m.in_ranks], tmp_path_factory.mktemp("ranked"))


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
def test_every_mistake_gets_an_error_naming_it_and_the_fix(mistake, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # plan files are written (and named) relative to here
    text = request.getfixturevalue("ranked_texts")[mistake.what] if mistake.in_ranks else mistake.make(tmp_path)
    assert text.startswith(mistake.error + ":"), text
    assert re.search(mistake.says, text), text
