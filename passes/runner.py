"""The pass runner: runs one pass, times it, optionally checks its result, names failures.

A pass that fails on a node notes the node on the exception (``add_note``); the runner
turns unexpected failures into ``PassError: pass rewrite failed at node ...: ...`` so a bug
report points at the pass and the node. User errors (:class:`AutoparError`) pass through
unchanged: they already say what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.ir import AutoparError


class PassError(RuntimeError):
    """An internal failure inside a pass (a bug to report, not a user mistake)."""


@dataclass
class PassLog:
    seconds: dict[str, float] = field(default_factory=dict)

    def run(self, name: str, function: Callable, *args, verify: Callable | None = None, **kwargs):
        """``function(*args, **kwargs)``, timed under ``name``; ``verify(result)`` after it."""
        started = time.perf_counter()
        try:
            result = function(*args, **kwargs)
            if verify is not None:
                verify(result)
        except AutoparError:
            raise
        except Exception as error:
            where = "".join(f" {note}" for note in getattr(error, "__notes__", ()))
            raise PassError(f"pass {name} failed{where}: {type(error).__name__}: {error}") from error
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        return result


@contextmanager
def at_node(node: fx.Node):
    """Note which node a failure happened at (read by :meth:`PassLog.run`)."""
    try:
        yield
    except AutoparError:
        raise
    except Exception as error:
        if not any(note.startswith("at node") for note in getattr(error, "__notes__", ())):
            error.add_note(f"at node {node.format_node()}")
        raise


def verify_graph(graph_module: fx.GraphModule) -> None:
    """Structural checks after a pass: well-formed graph, every call resolvable."""
    graph_module.graph.lint()
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and not callable(node.target):
            raise AssertionError(f"node {node.format_node()} calls a non-callable target")
