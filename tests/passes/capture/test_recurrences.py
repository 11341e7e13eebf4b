"""passes/capture/recurrences.py and runtime/kernels/recurrences.py: the chunked gated delta rule as
one ``autopar.gated_delta_rule`` node per layer, Mamba's selective scan as one
``autopar.selective_scan`` and Recurrent Gemma's linear recurrence as one
``autopar.linear_recurrence``, their values and gradients the model's own function's, and every call
an op cannot take left to that function."""

import inspect

import pytest
import torch
from equivalence import load_example
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.mamba import modeling_mamba
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

from autopar.ir import get_profile
from autopar.passes.capture.graph import capture, module_path
from autopar.passes.capture.recurrences import composite_recurrences
from autopar.passes.cost.facts import analyze
from autopar.passes.cost.ops import op_profile
from autopar.runtime import gated_delta_rule, linear_recurrence, selective_scan
from autopar.runtime.kernels.recurrences import (
    gated_delta_rule_backward,
    linear_recurrence_backward,
    selective_scan_backward,
)

hf_configs = load_example("hf_configs.py", "benchmarks")
SOURCE = modeling_qwen3_next.__name__
RULE = modeling_qwen3_next.torch_chunk_gated_delta_rule
SCAN_SOURCE = modeling_mamba.__name__
SCAN = modeling_mamba.mamba_selective_scan
RNN_SCAN = RecurrentGemmaRglru._rnn_scan


def _inputs(batch=2, steps=11, heads=2, groups=2, dk=3, dv=5):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, steps, heads, dk, generator=generator) for _ in range(2))
    v = torch.randn(batch, steps, heads * groups, dv, generator=generator)
    g = -torch.rand(batch, steps, heads * groups, generator=generator)
    beta = torch.rand(batch, steps, heads * groups, generator=generator)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("l2norm", [False, True])
def test_op_gives_the_models_values_and_gradients(l2norm):
    inputs = _inputs()  # 11 steps in chunks of 4: the last chunk padded; value heads in groups of 2
    expected, _ = RULE(*inputs, chunk_size=4, use_qk_l2norm_in_kernel=l2norm)
    seed = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected_grads = torch.autograd.grad(expected, inputs, seed)
    out = gated_delta_rule(*inputs, 4, l2norm, SOURCE)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, inputs, seed), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _scan_inputs(batch=2, channels=3, steps=7, states=4, dtype=torch.float32):
    """Mamba's scan inputs as its mixer passes them: B and C transposed views, D in float32."""
    generator = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(batch, channels, steps, generator=generator).to(dtype) for _ in range(3))
    A = -torch.rand(channels, states, generator=generator)
    B, C = (torch.randn(batch, steps, states, generator=generator).to(dtype).transpose(1, 2) for _ in range(2))
    D, bias = torch.randn(channels, generator=generator), torch.randn(channels, generator=generator)
    return [t.requires_grad_() for t in (u, delta, A, B, C, D, z, bias)]


def test_scan_gives_the_models_values_and_gradients():
    inputs = _scan_inputs()
    u, delta, A, B, C, D, z, bias = inputs
    expected = SCAN(u, delta, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)
    seed = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected_grads = torch.autograd.grad(expected, inputs, seed)
    out = selective_scan(*inputs, True, False, SCAN_SOURCE)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, inputs, seed), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _linear_inputs(batch=2, steps=7, width=5, dtype=torch.float32):
    """Griffin's x and its gate a in (0, 1), [batch, steps, width]."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, steps, width, generator=generator).to(dtype)
    a = torch.rand(batch, steps, width, generator=generator).to(dtype)
    return [x.requires_grad_(), a.requires_grad_()]


def test_linear_recurrence_gives_the_models_values_and_gradients():
    x, a = _linear_inputs()
    reset = torch.zeros(x.shape[:2] + (1,), dtype=torch.bool)
    reset[:, 0] = True  # the first position, as the model's positions make it
    expected, last = RNN_SCAN(None, x, a, reset, None)  # the method reads nothing of its module
    seed = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected_grads = torch.autograd.grad(expected, [x, a], seed)
    out = linear_recurrence(x, a * ~reset)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out[:, -1], last, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, [x, a], seed), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _layouts(outputs) -> list:
    return [(t.shape, t.dtype, t.stride()) for t in (outputs if isinstance(outputs, tuple) else [outputs])]


def test_ops_and_their_backwards_keep_the_layouts_their_fake_kernels_promise():
    """What torch.compile relies on: the fake kernels' shapes, dtypes and strides are the real ones'
    (a steps-innermost input of the rule; a bfloat16 scan beside its float32 D)."""
    q, k, v, g, beta = (t.detach() for t in _inputs())
    steps_innermost = q.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    calls = []
    for args in [(q, k, v, g, beta), (steps_innermost, k, v, g, beta)]:
        grad, options = torch.randn(v.shape), (4, True, SOURCE)
        calls += [(gated_delta_rule, (*args, *options)), (gated_delta_rule_backward, (grad, *args, *options))]
    for dtype in (torch.float32, torch.bfloat16):
        args, options = [t.detach() for t in _scan_inputs(dtype=dtype)], (True, False, SCAN_SOURCE)
        grad = torch.randn(args[0].shape)
        calls += [(selective_scan, (*args, *options)), (selective_scan_backward, (grad, *args, *options))]
    for dtype in (torch.float32, torch.bfloat16):
        x, a = (t.detach() for t in _linear_inputs(dtype=dtype))
        calls += [(linear_recurrence, (x, a)), (linear_recurrence_backward, (torch.randn(x.shape), x, a))]
    for op, inputs in calls:
        real = op(*inputs)
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(t) if torch.is_tensor(t) else t for t in inputs))
        assert _layouts(fake) == _layouts(real), op


def test_calls_the_op_cannot_take_run_the_models_function():
    model = hf_configs.small_model("qwen3_next")
    q, k, v, g, beta = _inputs()
    state = torch.randn(2, 4, 3, 5)
    with composite_recurrences(model):
        stand_in = modeling_qwen3_next.torch_chunk_gated_delta_rule
        assert stand_in is not RULE
        out, final = stand_in(q, k, v, g, beta, chunk_size=4, initial_state=state, output_final_state=True)
        _, no_state = stand_in(q, k, v, g, beta, chunk_size=4)  # the op's path: no final state
    assert modeling_qwen3_next.torch_chunk_gated_delta_rule is RULE  # back on exit
    want, want_final = RULE(q, k, v, g, beta, chunk_size=4, initial_state=state, output_final_state=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)
    assert no_state is None


def test_scans_the_op_cannot_take_run_the_models_function():
    model = hf_configs.small_model("mamba")
    u, delta, A, B, C, D, z, bias = (t.detach() for t in _scan_inputs())
    with composite_recurrences(model):
        stand_in = modeling_mamba.mamba_selective_scan
        assert stand_in is not SCAN
        out, state = stand_in(u, delta, A, B, C, D, z, bias, True, return_last_state=True)
        ungated = stand_in(u, delta, A, B, C, D, None, bias, True)
    assert modeling_mamba.mamba_selective_scan is SCAN
    want, want_state = SCAN(u, delta, A, B, C, D, z, bias, True, return_last_state=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    torch.testing.assert_close(ungated, SCAN(u, delta, A, B, C, D, None, bias, True), rtol=0, atol=0)


def test_linear_recurrences_the_op_cannot_take_run_the_models_method():
    """A cache's state and one decoding step stay the model's own loop."""
    model = hf_configs.small_model("recurrent_gemma")
    rglru = next(m for m in model.modules() if isinstance(m, RecurrentGemmaRglru))
    x, a = (t.detach() for t in _linear_inputs())
    reset, state = torch.zeros(x.shape[:2] + (1,), dtype=torch.bool), torch.randn(x.shape[0], x.shape[2])
    with composite_recurrences(model):
        assert RecurrentGemmaRglru._rnn_scan is not RNN_SCAN
        from_state = rglru._rnn_scan(x, a, reset, state)
        one_step = rglru._rnn_scan(x[:, :1], a[:, :1], reset[:, :1], state)
    assert RecurrentGemmaRglru._rnn_scan is RNN_SCAN  # back on exit
    for got, want in [
        (from_state, RNN_SCAN(rglru, x, a, reset, state)),
        (one_step, RNN_SCAN(rglru, x[:, :1], a[:, :1], reset[:, :1], state)),
    ]:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def _ops_of_a_model_with_its_own_loss_and_gradients(family: str, ids: torch.Tensor, op: str):
    """(``family``'s small model, its capture, its ``op`` nodes); checked: under the stand-ins its
    loss equals eager's bitwise and its gradients within float rounding, its functions back after."""
    torch.manual_seed(0)
    model = hf_configs.small_model(family)
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    assert modeling_mamba.mamba_selective_scan is SCAN and modeling_qwen3_next.torch_chunk_gated_delta_rule is RULE
    assert RecurrentGemmaRglru._rnn_scan is RNN_SCAN
    eager = model(input_ids=ids, labels=ids).loss
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    with composite_recurrences(model):
        loss = model(input_ids=ids, labels=ids).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager, rtol=0, atol=0)
    for (name, _), got, want in zip(model.named_parameters(), grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    return model, captured, [node for node in captured.graph.nodes if str(node.target) == f"autopar.{op}.default"]


def test_mamba_captures_one_scan_per_layer_with_its_own_loss_and_gradients():
    ids = torch.randint(0, hf_configs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    model, _, scans = _ops_of_a_model_with_its_own_loss_and_gradients("mamba", ids, "selective_scan")
    layers = range(len(model.backbone.layers))
    assert [module_path(node) for node in scans] == [f"backbone.layers.{i}.mixer" for i in layers]

    # the scan's FLOPs are its states read out, 2·b·D·T·N, as the flop counter counts its loop;
    # backward runs it again, then its VJP; it keeps its inputs only
    profile = op_profile(scans[0], needs_grad=True)
    (batch, channels, steps), states = scans[0].args[0].meta["val"].shape, model.config.state_size
    assert profile.forward_flops == 2 * batch * channels * steps * states
    assert profile.backward_flops == 3 * profile.forward_flops
    assert profile.saved_inputs == tuple(range(8))


class _KernelFunction(nn.Module):
    """What the ``kernels`` package makes of transformers' kernel functions (transformers 5.25
    requires it): a module whose forward takes the function's arguments and runs it."""

    def __init__(self, function):
        super().__init__()

        def forward(*args, **kwargs):
            return function(*args, **kwargs)

        forward.__signature__ = inspect.signature(getattr(function, "forward", function))  # already one, with kernels
        self.forward = forward


def test_a_scan_held_by_a_kernel_module_is_captured_as_one_op_per_layer(monkeypatch):
    held = _KernelFunction(SCAN)
    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", held)
    model = hf_configs.small_model("mamba")
    ids = torch.randint(0, hf_configs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    scans = [node for node in captured.graph.nodes if str(node.target) == "autopar.selective_scan.default"]
    assert len(scans) == len(model.backbone.layers) and modeling_mamba.mamba_selective_scan is held


def test_qwen3_next_captures_one_op_per_linear_attention_layer_with_its_own_loss_and_gradients():
    # two chunks of 64, the second padded
    ids = torch.randint(0, hf_configs.VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))
    model, captured, rules = _ops_of_a_model_with_its_own_loss_and_gradients("qwen3_next", ids, "gated_delta_rule")
    linear = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    assert [module_path(node) for node in rules] == [f"model.layers.{i}.linear_attn" for i in linear]

    # the cost model counts the model's own function's FLOPs; backward runs it again, then its VJP
    profile = op_profile(rules[0], needs_grad=True)
    assert profile.forward_flops > 0 and profile.backward_flops == 3 * profile.forward_flops
    assert profile.saved_inputs == (0, 1, 2, 3, 4)
    # on a GPU preset its time follows its shapes, at the op's own chunk size
    (fact,) = [f for f in analyze(captured, get_profile("h100-80gb")).values() if f.node in rules[:1]]
    assert fact.pacing is not None and fact.pacing.chunk == 64


def test_recurrent_gemma_captures_one_linear_recurrence_per_recurrent_layer_with_its_own_loss_and_gradients():
    ids = torch.randint(0, hf_configs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    model, _, recurrences = _ops_of_a_model_with_its_own_loss_and_gradients("recurrent_gemma", ids, "linear_recurrence")
    recurrent = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.temporal_block, "rg_lru")]
    assert recurrent and [module_path(node) for node in recurrences] == [
        f"model.layers.{i}.temporal_block.rg_lru" for i in recurrent
    ]
    # a product and a sum per element; backward runs it again, then back in time; it keeps its inputs
    profile = op_profile(recurrences[0], needs_grad=True)
    assert profile.forward_flops == 2 * recurrences[0].args[0].meta["val"].numel()
    assert profile.backward_flops == 3 * profile.forward_flops and profile.saved_inputs == (0, 1)
