import pytest
import torch

from autopar.ir import ConfigError
from autopar.passes.runner import PassError, PassLog, at_node


def test_the_runner_times_passes_and_names_the_pass_and_node_of_a_failure():
    graph = torch.fx.symbolic_trace(torch.nn.ReLU()).graph
    node = next(n for n in graph.nodes if n.op == "call_function" or n.op == "call_module" or n.op == "placeholder")

    def broken():
        with at_node(node):
            raise KeyError("missing")

    log = PassLog()
    assert log.run("double", lambda x: 2 * x, 21) == 42
    with pytest.raises(PassError, match=r"pass broken failed at node .*: KeyError"):
        log.run("broken", broken)
    assert set(log.seconds) == {"double", "broken"}


def test_user_errors_pass_through_unchanged():
    def refuse():
        raise ConfigError("choose another option")

    with pytest.raises(ConfigError, match="choose another option"):
        PassLog().run("search", refuse)
