"""Placements of a tensor on one mesh axis, in DTensor's vocabulary.

``repr`` is machine-readable (``Shard(dim=1)``); ``str`` is compact (``S(1)``, ``R``, ``P``)
and :func:`parse_placement` reads it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.ir.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """The tensor is split into equal contiguous chunks along ``dim``, one per rank."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the tensor is their ``reduce_op`` ("sum" or "avg")."""

    reduce_op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial

_SHARD = re.compile(r"S\((-?\d+)\)$")
_PARTIAL = re.compile(r"P\((sum|avg)\)$")


def parse_placement(text: str) -> Placement:
    """Read a placement from its compact form.

    >>> parse_placement("S(1)"), parse_placement("R"), parse_placement("P(avg)")
    (Shard(dim=1), Replicate(), Partial(reduce_op='avg'))
    """
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if match := _SHARD.match(text):
        return Shard(int(match.group(1)))
    if match := _PARTIAL.match(text):
        return Partial(match.group(1))
    raise ConfigError(f"cannot read placement {text!r}: write S(dim), R, P or P(avg)")


def format_placements(placements: tuple[Placement, ...]) -> str:
    """Compact form of one placement per axis, e.g. ``(S(0), R)``."""
    return "(" + ", ".join(map(str, placements)) + ")"
