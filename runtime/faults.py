"""When one rank fails, every rank fails: promptly, with the same error, saying which rank and why.

A rank that raises while its peers wait in a collective leaves them waiting forever (or until
the process-group timeout, 30 minutes by default). Three tools close that gap, one for each
moment a failure can happen:

- **before the ranks communicate** (capture, search, rewrite, stage split, building modules):
  :func:`agree` runs a local step on every rank and exchanges the outcomes in one
  ``all_gather_object``, so a failure on some ranks is raised on all of them, the lowest failing
  rank's error, before any rank enters a collective the failed ones would never join (issue 15:
  stage-0 ranks waited in the pipeline's first receive while stage 1 had raised ConfigError).
  :func:`from_rank_zero` does the same for a decision only rank 0 takes (the plan search).
- **inside a collective**: :func:`collective` turns a c10d failure (the process-group timeout
  expired, or a peer's connection closed because it died) into a :class:`CollectiveError`
  naming this rank, the collective, its group and the plan node it ran for. Forward collectives
  are found in the traceback (:func:`program_node`); backward ones have no frame of the program
  there (autograd runs them), so each op records its program line when autograd saves its
  context (:func:`calling_site`) and its backward runs inside :func:`plan_node`; gradient syncs
  and ZeRO gathers pass their bucket to :func:`collective` as ``where``; a pipeline's transfers,
  which torch's schedule waits for itself, are named by what the stages last posted
  (``waited_in``), and a compiled program's waits by the program nodes ``overlap`` named them
  after (:func:`compiled_wait`).
- **around a step**: :func:`reported` posts any other error to the job's store (the c10d store
  that ``init_process_group`` joined), and completes a CollectiveError with the peers' posts
  (who raised what; who posted nothing: stalled or dead) and the program node the traceback
  shows. Under ``autopar run`` the store lives in the launcher, so it outlives any rank.
"""

from __future__ import annotations

import contextlib
import linecache
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

from autopar.ir import waited_for
from autopar.ir.errors import CollectiveError, DistributedError
from autopar.runtime.process_groups import world_timeout

T = TypeVar("T")
Where = str | Callable[[], str]  # a plan node in words, or a function making them when a failure needs them
PEER_REPORT_GRACE_S = 3.0  # how long a failed rank waits for its peers' posts before naming the silent ones
_FAILURE_KEY = "autopar/failure/{rank}"
# what c10d backends say when the timeout expires or a peer is gone (gloo raises a plain RuntimeError)
_COMMUNICATION_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "nccl")
# per thread: autograd may run backward on a device thread; a backward enters and leaves on one
_PLAN_NODES = threading.local()
_COMMENT_REACH = 4  # lines between a generated call and inductor's comment naming its node


def agree(step: Callable[[], T], what: str) -> T:
    """Run ``step()`` on this rank; return its result if it succeeded on every rank of the default
    group, else raise on every rank the error of the lowest failing rank (same type and message,
    with a note naming the rank). One ``all_gather_object``: call it where every rank does.

    Pre: no rank communicates inside ``step``. Example, in ``autopar.parallelize``::

        program = agree(lambda: rewrite(captured, plan, ...), "rewriting the graph")
    """
    try:
        result, failure = step(), None
    except Exception as error:  # noqa: BLE001  (raised below, on every rank)
        result, failure = None, error
    outcomes = [None] * dist.get_world_size()
    with collective(f"the exchange of outcomes after {what}"):
        dist.all_gather_object(outcomes, None if failure is None else _portable(failure))
    failed = [rank for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        _raise_everywhere(failure, outcomes[failed[0]], failed, what)
    return result


def from_rank_zero(decide: Callable[[], T], what: str) -> T:
    """Run ``decide()`` on rank 0 only and return its result on every rank (one broadcast); an
    error on rank 0 is raised on every rank. Example: ``plan = from_rank_zero(search, "planning")``."""
    outcome, failure = [None, None], None
    if dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except Exception as error:  # noqa: BLE001  (raised below, on every rank)
            outcome[1] = _portable(error)
            failure = error
    with collective(f"the broadcast of rank 0's outcome of {what}"):
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        _raise_everywhere(failure, outcome[1], [0], what)
    return outcome[0]


def _portable(error: BaseException) -> bytes:
    """``error`` pickled, or a DistributedError with its text where it does not survive pickling
    (an exception whose ``__init__`` takes other arguments than its message)."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001  (the text travels instead)
        return pickle.dumps(DistributedError(f"{type(error).__name__}: {error}"))


def _raise_everywhere(own: BaseException | None, first: bytes, failed: list[int], what: str):
    rank = dist.get_rank()
    if own is not None and rank == failed[0]:
        if len(failed) > 1:
            own.add_note(f"ranks {failed[1:]} failed too while {what}")
        raise agreed(own)
    error = pickle.loads(first)
    error.add_note(f"raised on rank {failed[0]} while {what}; every rank stops with it")
    raise agreed(error) from own


@contextlib.contextmanager
def collective(
    kind: str, group_name: str | None = None, where: Where | None = None, waited_in: str | None = None
) -> Iterator[None]:
    """Run one c10d call (or the wait for one): a failure of the communication becomes a
    :class:`CollectiveError` naming this rank, ``kind``, the group (its mesh axis and ranks) and
    where in the plan it ran: ``where`` (a phrase, or a function making it when needed), else
    the innermost :func:`plan_node` around it, else nothing (the traceback may still show a node).
    With ``waited_in`` (a file name ending), only failures raised from that file's code are
    named: a call that waits for its communication among other work (torch's pipeline schedule).

    Example: ``with collective("all_reduce", group_name): dist.all_reduce(out, group=...)``;
    ``with collective("gradient all-reduce", dp, where="in the gradient sync of bucket 2 (fc1.weight)")``.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        if not _is_communication_failure(error) or _collective_error(error) is not None:
            raise
        if waited_in is not None and not _raised_in(error, waited_in):
            raise
        if where is None:
            where = next(reversed(getattr(_PLAN_NODES, "stack", [])), None)
        raise _named(error, f"{kind} over {_describe_group(group_name)}", where) from error


@contextlib.contextmanager
def plan_node(where: Callable[[], str]) -> Iterator[None]:
    """A collective that fails inside (on this thread) names ``where()`` as its place in the plan,
    e.g. "in the backward of node chunk_2 (...) in module layers.0.attn". Nests: the innermost wins.

    Example, around an op's backward: ``with plan_node(lambda: "in the backward of " + ...): ...``.
    """
    stack = _PLAN_NODES.__dict__.setdefault("stack", [])
    stack.append(where)
    try:
        yield
    finally:
        stack.pop()


def listing(names: list[str], shown: int = 3) -> str:
    """``names`` for an error message, the first few only: ``"a, b, c and 5 more"``."""
    rest = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {rest} more" if rest > 0 else "")


@dataclass(frozen=True, eq=False)
class ProgramSite:
    """A line of a rewritten program's ``forward``: the call of one node, named on demand (a
    failure is rare; finding the node's line costs a scan of the graph)."""

    program: fx.GraphModule
    filename: str
    line: int

    def node(self) -> str:
        """``chunk_2 (chunk_2 = torch.ops.autopar.chunk.default(x, '3', 1)) in module layers.0``, or ""."""
        return _node_at(self.program, self.filename, self.line)


def calling_site() -> ProgramSite | None:
    """The innermost rewritten program (an fx GraphModule's ``forward``) on this thread's stack,
    at the line running now; None outside any. An op's autograd setup records it so that its
    backward, which autograd runs with no frame of the program, can name its node.

    Example: ``ctx.site = calling_site()``, then ``ctx.site.node()`` when a backward fails.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), fx.GraphModule):
            return ProgramSite(frame.f_locals["self"], frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


@contextlib.contextmanager
def reported(what: str) -> Iterator[None]:
    """Run a step that communicates. An error of this rank is posted to the job's store for the
    peers; a failed collective is raised as a CollectiveError completed with the program node it
    ran for (when the traceback shows one) and what the peers posted within a few seconds.

    Example: ``with reported("train_step"): loss = self._step(*inputs)``.
    """
    try:
        yield
    except Exception as error:
        if getattr(error, "autopar_reported", False):  # by a step inside this one (train_step calls forward)
            raise
        failed = _collective_error(error)  # torch's pipeline schedule wraps a stage's error in its own
        if failed is None and not _is_communication_failure(error):
            _post(f"{what} raised {_describe(error)}")
            error.autopar_reported = True
            raise
        failed = failed or error
        waited = compiled_wait(failed)
        inside = "a compiled program" if waited else _innermost_runtime_call(failed)
        named = getattr(failed, "collective", None) or f"a collective in {inside}"
        where = getattr(failed, "where", "") or (f"at node {node}" if (node := program_node(failed)) else waited)
        reason = _reason(getattr(failed, "cause", failed))
        _post(f"{what}: " + " ".join(part for part in (named, where, reason) if part))
        message = (
            f"rank {dist.get_rank()} of {dist.get_world_size()}: {named}{f' {where}' if where else ''} "
            f"{reason}, during {what}. {_peers_text()}"
        )
        raised = CollectiveError(message)
        raised.collective, raised.autopar_reported = named, True
        raise raised from error


def agreed(error: Exception) -> Exception:
    """Mark ``error`` as one every rank raises alike (a collective decided it, as ``check_finite``
    does): :func:`reported` passes it on without posting it as this rank's own failure.
    Example: ``raise agreed(NonFiniteError(...))``."""
    error.autopar_reported = True
    return error


def _named(error: BaseException, named: str, where: Where | None) -> CollectiveError:
    where = (where() if callable(where) else where) or ""
    raised = CollectiveError(f"rank {dist.get_rank()}: {named}{f' {where}' if where else ''} {_reason(error)}")
    raised.collective, raised.where, raised.cause = named, where, error
    return raised


def _raised_in(error: BaseException, file_ending: str) -> bool:
    """Whether the innermost Python frame of ``error``'s traceback is in a file ending so."""
    frames = list(_frames(error))
    return bool(frames) and frames[-1][0].f_code.co_filename.replace("\\", "/").endswith(file_ending)


def _collective_error(error: BaseException) -> CollectiveError | None:
    """``error`` or the CollectiveError it was raised from (torch's pipeline schedule re-raises a
    stage's error as "Failed to run stage backward")."""
    while error is not None and not isinstance(error, CollectiveError):
        error = error.__cause__
    return error


def _is_communication_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error).lower() for sign in _COMMUNICATION_SIGNS)


def _describe_group(group_name: str | None) -> str:
    """``mesh axis tp (ranks [0, 1])``, from the c10d group's DeviceMesh description."""
    group = dist.group.WORLD if group_name is None else _resolve_process_group(group_name)
    ranks = dist.get_process_group_ranks(group)
    description = group.group_desc or ""
    if description.startswith("mesh_"):
        return f"mesh axis {description.removeprefix('mesh_')} (ranks {ranks})"
    return f"the world (ranks {ranks})" if group is dist.group.WORLD else f"group {description} (ranks {ranks})"


def _reason(error: BaseException) -> str:
    """What went wrong, in words: the backend's message without its source location."""
    text = _first_line(error)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"timed out (process-group timeout {world_timeout().total_seconds():g} s)"
    if any(sign in text.lower() for sign in ("connection closed", "connection reset", "broken pipe")):
        return "failed: a peer closed its connection (it died or exited)"
    return "failed: " + re.sub(r"^\[[^\]]*\] ", "", text)  # gloo prefixes its source file and line


def _describe(error: BaseException) -> str:
    """``Type: first line``, and the root cause's when the error wraps one (torch's pipeline
    schedule re-raises a stage's error as "Failed to run stage backward")."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(error).__name__}: {_first_line(error)}"
    return text if root is error else f"{text} (caused by {type(root).__name__}: {_first_line(root)})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _frames(error: BaseException):
    traceback = error.__traceback__
    while traceback is not None:
        yield traceback.tb_frame, traceback.tb_lineno
        traceback = traceback.tb_next


def program_node(error: BaseException) -> str:
    """The innermost node of a rewritten program (an fx GraphModule) that ``error``'s traceback
    passes through, with its module path where capture recorded one, e.g. ``all_reduce_3
    (all_reduce_3 = torch.ops.autopar.all_reduce.default(mm_1, '7', 'sum')) in module
    layers.0.mlp.fc2``; "" when none does (a collective that autograd runs in backward, named
    by its :func:`plan_node` instead, or one inside torch's pipeline schedule)."""
    found = ""
    for cause in (error, getattr(error, "cause", None)):
        for frame, line_number in _frames(cause) if cause is not None else ():
            program = frame.f_locals.get("self")
            if isinstance(program, fx.GraphModule) and frame.f_code.co_name == "forward":
                found = _node_at(program, frame.f_code.co_filename, line_number) or found
    return found


def compiled_wait(error: BaseException) -> str:
    """Where ``error`` stopped a compiled program: "waiting for node all_gather_3" or "waiting
    for the backward of nodes a, b" (the program's nodes whose collective it waited for); ""
    when its traceback passes through no generated code. Inductor writes each call's nodes in a
    comment above it, and ``overlap`` named the waits after the program's nodes
    (:func:`autopar.ir.wait_name`)."""
    for frame, line_number in reversed(list(_frames(error))):
        if frame.f_code.co_name == "call" and _generated(frame.f_code.co_filename):
            for back in range(1, _COMMENT_REACH + 1):
                line = linecache.getline(frame.f_code.co_filename, line_number - back)
                if "Source Nodes: [" in line:
                    names = line.split("Source Nodes: [", 1)[1].split("]", 1)[0].split(", ")
                    waited = next((text for name in names if (text := waited_for(name))), "")
                    return f"waiting for {waited}" if waited else ""
    return ""


def _generated(filename: str) -> bool:
    """Whether ``filename`` is code inductor generated: under its cache folder, wherever
    ``TORCHINDUCTOR_CACHE_DIR`` puts it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # (an error's path: inductor loads only here)

    return Path(filename).resolve().is_relative_to(Path(cache_dir()).resolve())


def _node_at(program: fx.GraphModule, filename: str, line_number: int) -> str:
    source = linecache.getline(filename, line_number).strip()
    name = source.split("=")[0].strip()
    node = next((n for n in program.graph.nodes if n.name == name), None)
    return "" if node is None else f"{node.name} ({source.split(';')[0]}){_module_of(node)}"


def _module_of(node: fx.Node) -> str:
    for candidate in (node, *node.all_input_nodes):
        stack = candidate.meta.get("nn_module_stack")
        if stack:
            return f" in module {list(stack.values())[-1][0]}"
    return ""


def _innermost_runtime_call(error: BaseException) -> str:
    """``zero/gather.py:wait``: the innermost frame of autopar's runtime or of torch.distributed."""
    named = "torch.distributed"
    for frame, _ in _frames(error):
        path = frame.f_code.co_filename.replace("\\", "/")
        for root in ("/autopar/runtime/", "/runtime/", "/torch/distributed/"):
            if root in path and not path.endswith("/faults.py"):
                named = f"{path.split(root)[-1]}:{frame.f_code.co_name}"
                break
    return named


def _store():
    try:
        return _get_default_store()
    except (RuntimeError, ValueError):  # no default group any more
        return None


def _post(text: str) -> None:
    """Best effort: a peer that cannot read this still fails, only without the reason."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(_FAILURE_KEY.format(rank=dist.get_rank()), text)


def _peers_text() -> str:
    """What the other ranks posted within :data:`PEER_REPORT_GRACE_S`, and who posted nothing."""
    store, me, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:
        return ""
    reports: dict[int, str] = {}
    deadline = time.monotonic() + PEER_REPORT_GRACE_S
    with contextlib.suppress(Exception):  # the store may have died with its host
        while len(reports) < world - 1 and time.monotonic() < deadline:
            for rank in range(world):
                key = _FAILURE_KEY.format(rank=rank)
                if rank != me and rank not in reports and store.check([key]):
                    reports[rank] = store.get(key).decode()
            time.sleep(0.1)
    silent = [rank for rank in range(world) if rank != me and rank not in reports]
    told = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(reports.items()))
    parts = [f"Ranks {silent} reported nothing (stalled, killed, or waiting elsewhere)" if silent else ""]
    parts.append(f"peers reported: {told}" if told else "")
    return ". ".join(part for part in parts if part)
