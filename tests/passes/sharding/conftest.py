"""Prints what the rule validation checked (test_rule_validation.py) at the end of the run."""

from rule_check import TALLY


def pytest_terminal_summary(terminalreporter):
    if TALLY.forward:
        terminalreporter.write_line(f"sharding rule validation: {TALLY.summary()}")
