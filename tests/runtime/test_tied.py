"""Which weights pipeline stages share, decided from every stage program (the same on every rank)."""

from types import SimpleNamespace

import pytest

from autopar.ir import ConfigError, PipelineKind, Schedule
from autopar.runtime.tied import shared_weights

NAMES = {"p_embed": "embed.weight", "p_layer0": "layers.0.w", "p_layer1": "layers.1.w", "p_norm": "norm.weight"}


def _stages(*params):
    return [SimpleNamespace(index=i, params=p) for i, p in enumerate(params)]


def test_a_weight_several_stage_modules_use_is_shared_by_them():
    stages = _stages(("p_embed", "p_layer0"), ("p_layer1",), ("p_norm",), ("p_norm", "p_embed"))
    shared = shared_weights(stages, NAMES, Schedule(stages=4), zero=1)
    assert shared == {"embed.weight": (0, 3), "norm.weight": (2, 3)}


def test_zero3_refuses_two_uses_on_one_device_naming_the_weight():
    stages = _stages(("p_embed",), ("p_layer0",), ("p_layer1",), ("p_embed",))
    zbv = Schedule(stages=2, virtual=2, kind=PipelineKind.ZBV)  # device 0 runs modules 0 and 3
    assert shared_weights(stages, NAMES, zbv, zero=1) == {"embed.weight": (0, 3)}
    with pytest.raises(ConfigError, match="'embed.weight' is used by stage modules \\[0, 3\\], two of them on one"):
        shared_weights(stages, NAMES, zbv, zero=3)
