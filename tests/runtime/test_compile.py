"""Compiling a program (one process, no process group): a graph break is an error naming the
program's node; a program compiles once and then runs without recompiling."""

import pytest
import torch
import torch.fx as fx

from autopar.ir import CompileError
from autopar.runtime.compile import Compiler


def _program(breaking: bool) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    if breaking:
        graph.call_function(torch._dynamo.graph_break, ())  # what an untraceable op does to Dynamo
    graph.output((graph.call_function(torch.ops.aten.tanh.default, (scaled,)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_break_names_the_node_it_happened_at():
    run = Compiler()(_program(breaking=True))
    with pytest.raises(CompileError, match=r"node graph_break .*without a graph break"):
        run(torch.randn(3))


def test_a_program_compiles_on_its_first_call_only():
    program = _program(breaking=False)
    compiler = Compiler()
    run = compiler(program)
    assert compiler(program) is run  # one compiled form per program
    x = torch.randn(3)
    (first,) = run(x)
    compile_s = run.compile_s
    assert compile_s is not None and torch.allclose(first, torch.tanh(2 * x))
    run(x)
    assert run.compile_s == compile_s


def test_inductors_cache_is_keyed_on_autopars_runtime_sources(monkeypatch):
    """A graph compiled against an op's old fake kernel is never loaded after the kernel changed:
    inductor's FX graph cache key carries a hash of autopar.runtime's sources (its tag)."""
    import torch._inductor.compile_fx

    from autopar.runtime import compile as compile_module

    tags = []
    record = lambda *args, **kwargs: tags.append(torch.compiler.config.cache_key_tag)  # noqa: E731
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", record)
    compile_module._locked_inductor(_program(breaking=False), [torch.randn(3)], config_patches={})
    assert tags == [f"autopar-{compile_module.runtime_sources_hash()}"] and torch.compiler.config.cache_key_tag == ""
