"""Compiled per-rank programs: the rewritten program through ``torch.compile`` (inductor).

:class:`Compiler` turns a program (or a pipeline stage's, or a recomputed layer's, which go
with the program that calls them) into a callable that runs the same computation, compiled:

- Dynamo traces the program with ``fullgraph=True``: the ``autopar::`` ops are custom ops with
  fake kernels, so the whole program is one graph. A graph break is an error that names the
  program's node it happened at (:class:`~autopar.ir.CompileError`), not a silent slowdown.
- AOTAutograd splits forward and backward; the duals of autopar's collectives are in the
  backward graph, the gradient sync a program does itself too (see
  :func:`autopar.passes.rewrite.compiled.sync_in_program`). Before the split, ZeRO-3's layer gathers are marked
  for recomputation, so backward gathers each layer again instead of keeping its weights.
- After the split, the scheduling pass given to the compiler (``schedule``, e.g.
  :func:`autopar.passes.rewrite.overlap.schedule_communication`) replaces every collective by
  its functional form (:mod:`autopar.runtime.functional`) and places issues and waits;
  inductor's own reordering for peak memory is switched off so it keeps that order.
- Inductor's FX graph cache keeps compiled graphs on disk, keyed by the graph, the passes'
  source and autopar's runtime sources, where its ops' fake kernels are (AOTAutograd's cache
  stays off, see :func:`_locked_inductor`); local ranks whose
  programs are the same compile one at a time under a file lock, so the first fills the cache
  and the others load from it (on 2 cores, 4 ranks compiling the same graph at once would take 4 times as long).

Example::

    compiler = Compiler(schedule=schedule_communication)
    run = compiler(program)             # compiles on the first call
    loss = run(*params, *buffers, *inputs)[0]
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from autopar.ir import CompileError
from autopar.runtime.functional import FUNCTIONAL_FORMS
from autopar.runtime.weight_pass import WeightPasses

# Ops a compiled program recomputes in backward rather than keeping their outputs (ZeRO-3's gathers).
RECOMPUTED_OPS = (torch.ops.autopar.zero_gather_layer.default,)


@dataclass(frozen=True)
class Compiler:
    """How this module's programs are compiled.

    ``schedule(graph, forms)`` is the pass that places communication in each compiled forward
    and backward graph (``forms``: :data:`autopar.runtime.functional.FUNCTIONAL_FORMS`), None to
    leave autopar's collectives as blocking ops. ``prepare(program, inputs)`` rewrites a program
    on its first inputs before it is compiled (async tensor parallelism's pieces), returning the
    program and a count it reports. ``synced_in_program``: the parameters whose
    gradient sync the program does itself; the module's bucketed sync leaves them out.
    """

    schedule: Callable[[fx.Graph, dict], None] | None = None
    prepare: Callable[[fx.GraphModule, tuple], tuple[fx.GraphModule, int]] | None = None
    synced_in_program: frozenset[str] = frozenset()
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, program: fx.GraphModule, weights: tuple[str, ...] = ()) -> CompiledProgram:
        """The compiled form of ``program`` (the same object for the same program); with
        ``weights``, the placeholders whose gradients a zero-bubble schedule's weight pass makes."""
        if id(program) not in self._compiled:
            self._compiled[id(program)] = CompiledProgram(program, self.schedule, self.prepare, weights)
        return self._compiled[id(program)]


class CompiledProgram:
    """A program compiled on its first call; ``compile_s`` is how long that call took
    (the ``prepare`` pass on the first inputs' shapes, tracing, compiling or loading from the
    cache, and running once); ``prepared``: what ``prepare`` reported (how many collectives the
    async tensor-parallel pass split)."""

    def __init__(
        self,
        program: fx.GraphModule,
        schedule: Callable | None,
        prepare: Callable | None = None,
        weights: tuple[str, ...] = (),
    ):
        self.program = program
        self.compile_s: float | None = None
        self.prepared = 0
        self._prepare = prepare
        options = {
            "joint_custom_pre_pass": _RecomputeGathers(),
            "reorder_for_peak_memory": schedule is None,
        }
        if schedule is not None:
            options["post_grad_custom_post_pass"] = _SchedulePass(schedule)
        self._backend = functools.partial(_locked_inductor, config_patches=options)
        # a zero-bubble stage: the gradients of ``weights`` (placeholders) come from a pass of their own
        self.weight_passes = WeightPasses(weights) if weights else None
        if self.weight_passes is not None:
            self._backend = self.weight_passes.wrap(self._backend)
        self._run = None

    def __call__(self, *args):
        start = time.perf_counter()
        if self._run is None:
            if self._prepare is not None:
                self.program, self.prepared = self._prepare(self.program, args)
            self._run = torch.compile(self.program, backend=self._backend, fullgraph=True, dynamic=False)
        try:
            outputs = self._run(*args)
        except torch._dynamo.exc.Unsupported as error:
            failure = error.__context__
            if failure is not None and not isinstance(failure, torch._dynamo.exc.Unsupported):
                # the compiled program failed (a collective timed out, say) and Dynamo could not
                # trace fx's error report (a generator) on the way out: the failure is the error
                raise failure from None
            raise CompileError(_graph_break_message(self.program, error)) from error
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - start
        return outputs


def _locked_inductor(graph_module: fx.GraphModule, example_inputs, *, config_patches: dict, split=None):
    """Inductor, with ``split(inner_compile, graph, inputs, **options)`` compiling each backward
    graph where given (:class:`autopar.runtime.weight_pass.WeightPasses`)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    inner = _one_rank_at_a_time(compile_fx_inner)
    if split is not None:
        plain = inner

        def inner(graph, inputs, **options):
            if options.get("is_backward"):
                return split(plain, graph, inputs, **options)
            return plain(graph, inputs, **options)

    # AOTAutograd's cache is off: loaded from it (a second run, warm cache), a TP+SP program's
    # gradients came out wrong on one rank (GPT hidden 256, 2 ranks, torch 2.13), while fresh
    # compiles, and inductor's own FX graph cache alone, were exact. Inductor's cache still
    # spares every rank but the first the code generation.
    # No donated buffers (inductor reusing a saved tensor's memory once backward read it): the
    # forward-identity ops (grad_all_reduce, zero_scatter_layer) become their input itself in the
    # scheduling pass, after AOTAutograd took their outputs for fresh tensors it may donate, so a
    # saved "output" can be a parameter: Mamba's A_log, saved as grad_all_reduce(A_log), was
    # overwritten by the exp backward recomputed from it. And split, the backward's input pass must
    # leave what autograd saved for the weight pass.
    # Keyed on autopar's runtime sources too: a graph compiled against an op's old fake kernel
    # (its output strides, say) must not be loaded after the kernel changed.
    tag = f"{torch.compiler.config.cache_key_tag}autopar-{runtime_sources_hash()}"
    with (
        torch._functorch.config.patch(enable_autograd_cache=False, donated_buffer=False),
        torch.compiler.config.patch(cache_key_tag=tag),
    ):
        return compile_fx(
            graph_module,
            example_inputs,
            inner_compile=inner,
            config_patches=config_patches,
        )


@functools.cache
def runtime_sources_hash() -> str:
    """A hash of every source file of ``autopar.runtime``: its ops, their fake kernels, their functional forms."""
    files = tuple(str(path) for path in sorted(Path(__file__).parent.rglob("*.py")))
    return get_hash_for_files(files).hex()[:16]


def _one_rank_at_a_time(inner_compile):
    """``inner_compile`` under a file lock named by the graph: local ranks compiling the same
    graph take turns, and all but the first find it in inductor's cache."""

    @functools.wraps(inner_compile)
    def compile_locked(graph_module, example_inputs, *args, **kwargs):
        key = hashlib.sha256(graph_module.code.encode()).hexdigest()[:24]
        with _file_lock(Path(torch._inductor.runtime.cache_dir_utils.cache_dir()) / "autopar-locks" / key):
            return inner_compile(graph_module, example_inputs, *args, **kwargs)

    return compile_locked


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _SchedulePass(CustomGraphPass):
    """Inductor's hook for the scheduling pass; its uuid (part of the cache key) hashes the
    source of the pass and of the functional forms, so editing either recompiles."""

    def __init__(self, schedule: Callable[[fx.Graph, dict], None]):
        self.schedule = schedule

    def __call__(self, graph: fx.Graph) -> None:
        self.schedule(graph, FUNCTIONAL_FORMS)

    def uuid(self) -> bytes:
        files = (inspect.getfile(self.schedule), inspect.getfile(FUNCTIONAL_FORMS[RECOMPUTED_OPS[0]]), __file__)
        return get_hash_for_files(files, extra=self.schedule.__qualname__)


class _RecomputeGathers(CustomGraphPass):
    """Marks :data:`RECOMPUTED_OPS` (and the items taken from their outputs) for recomputation
    in AOTAutograd's joint graph, as activation checkpointing would."""

    def __call__(self, graph: fx.Graph) -> None:
        for node in graph.find_nodes(op="call_function", target=RECOMPUTED_OPS[0]):
            for marked in (node, *node.users):
                marked.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                marked.meta["ac_graph_id"] = 0

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _graph_break_message(program: fx.GraphModule, error: Exception) -> str:
    """Name the program's node Dynamo stopped at: the frame of the program's generated code in
    the error's user stack holds the node's assignment (``linear_3 = torch.ops.aten...``)."""
    frames = getattr(error, "real_stack", None) or []
    names = {node.name: node for node in program.graph.nodes}
    for frame in reversed(list(frames)):
        target = (frame.line or "").split("=")[0].strip()
        if target in names:
            return (
                f"torch.compile cannot compile node {target} ({names[target].format_node()}) of the per-rank program "
                f"without a graph break: {str(error).splitlines()[0]}. Run it uncompiled (compile=False) or make the "
                "op traceable (a custom op with a fake kernel)"
            )
    return (
        f"torch.compile cannot compile the per-rank program without a graph break: {str(error).splitlines()[0]}. "
        "Run it uncompiled (compile=False)"
    )
