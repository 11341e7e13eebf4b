import pytest
import torch
from equivalence import load_example
from planning import meta_model

from autopar.ir import TraceError
from autopar.passes.capture.graph import capture, module_path


def test_capture_lifts_parameters_and_inputs_with_shapes_and_module_paths():
    model = meta_model("gpt.py", hidden=32, layers=1, heads=2, vocab=64, seq=8)
    captured = capture(model, model.example_inputs(4, device="meta"))
    assert list(captured.params.values()) == [name for name, _ in model.named_parameters()]
    assert len(captured.user_inputs) == 2 and captured.buffer_updates == ()
    paths = {module_path(n) for n in captured.graph.nodes if n.op == "call_function"}
    assert "layers.0.attn.wq" in paths
    assert all("val" in n.meta for n in captured.graph.nodes if n.op != "output")


def test_the_fingerprint_follows_the_input_shapes():
    model = meta_model("mlp.py")
    small, large = (capture(model, model.example_inputs(b, device="meta")).fingerprint for b in (4, 8))
    assert small != large
    assert small == capture(model, model.example_inputs(4, device="meta")).fingerprint


def test_tied_weights_become_one_parameter():
    model = meta_model("hf.py", "build_gpt2")
    captured = capture(model, model.example_inputs(2, device="meta"))
    assert captured.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in captured.params.values()


def test_mixed_precision_captures_the_model_as_it_computes_in_16_bits():
    """Parameters and floating inputs in bf16 (the model's own upcasts kept), the model untouched, ties kept."""
    model = meta_model("hf.py", "build_llama")
    inputs = model.example_inputs(2, device="meta")
    captured = capture(model, inputs, param_dtype=torch.bfloat16)
    dtypes = {n.meta["val"].dtype for n in captured.graph.find_nodes(op="placeholder") if n.name in captured.params}
    assert dtypes == {torch.bfloat16} and {p.dtype for p in model.parameters()} == {torch.float32}

    def upcasts(graph):
        return sum(n.op == "call_function" and n.kwargs.get("dtype") == torch.float32 for n in graph.nodes)

    # RMSNorm computes in fp32 (a cast that fp32 weights make a no-op): the bf16 graph keeps it
    assert upcasts(captured.graph) > upcasts(capture(model, inputs).graph)
    gpt2 = meta_model("hf.py", "build_gpt2")
    assert capture(gpt2, gpt2.example_inputs(2, device="meta"), param_dtype=torch.float16).tied == {
        "lm_head.weight": "transformer.wte.weight"
    }


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a value: not traceable
            return x.mean()
        return -x.mean()


def test_an_untraceable_model_is_a_clear_error_naming_the_file_and_line():
    line = DataDependent.forward.__code__.co_firstlineno + 1
    with pytest.raises(TraceError, match=rf"(?s)could not trace DataDependent at {__file__}:{line} .*control flow"):
        capture(DataDependent(), (torch.randn(2, 2),))


class UnsetTopK(torch.nn.Module):
    top_k = None  # a configuration value left unset (Hugging Face's DeepSeek-V2 default)

    def forward(self, x):
        return torch.topk(x, k=self.top_k, dim=-1).values.sum()


def test_a_model_whose_own_code_fails_is_told_so_not_sent_to_control_flow():
    line = UnsetTopK.forward.__code__.co_firstlineno + 1
    expected = rf"(?s)at {__file__}:{line} .*TypeError.*The model's own code raised this"
    with pytest.raises(TraceError, match=expected) as caught:
        capture(UnsetTopK(), (torch.randn(2, 4),))
    assert "control flow" not in str(caught.value)


class RotaryTooShort(torch.nn.Module):
    """Heads of 8 rotated by a table of 4: a configuration whose sizes disagree."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", torch.ones(4))

    def forward(self, x):
        return (x.view(2, 3, 8) * self.cos).sum()


def test_a_model_whose_shapes_disagree_is_told_so_not_sent_to_control_flow():
    model, x = RotaryTooShort(), torch.randn(2, 24)
    with pytest.raises(RuntimeError, match="must match the size"):
        model(x)  # it fails run as it is too
    line = RotaryTooShort.forward.__code__.co_firstlineno + 1
    expected = rf"(?s)at {__file__}:{line} .*The shapes at the model's line above disagree"
    with pytest.raises(TraceError, match=expected) as caught:
        capture(model, (x,))
    assert "control flow" not in str(caught.value)


class Keywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None, return_dict=True):
        y = self.linear(x) * (1 if scale is None else scale)
        return {"sum": y.sum(), "y": y} if return_dict else (y.sum(), y)


def test_keyword_inputs_and_constants_and_the_output_structure():
    captured = capture(Keywords(), (), {"x": torch.randn(2, 4), "scale": torch.ones(4), "return_dict": False})
    assert captured.user_inputs == ("x", "scale")  # the constant is baked in: no placeholder
    leaves, spec = torch.utils._pytree.tree_flatten(((), {"x": 0, "scale": 1, "return_dict": False}))
    assert captured.in_spec == spec
    assert captured.out_spec == torch.utils._pytree.tree_flatten((0, 1))[1]


class _KeysIntoSlices(torch.nn.Module):
    """Writes two pieces into slices of an empty tensor with ``copy_``, broadcasting one and casting
    the other, as DeepSeek-V3's attention builds its keys."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 12)

    def forward(self, x):
        nope, rope = self.proj(x).split([8, 4], dim=-1)
        keys = x.new_empty(3, 4, 12, dtype=torch.float64)
        keys[..., :8].copy_(nope)
        keys[..., 8:].copy_(rope[:1])  # broadcast over the first dim
        return (keys * keys).sum()


def test_copy_into_a_slice_is_captured_as_ops_autograd_differentiates():
    """Functionalized ``copy_`` is ``aten.copy``, which has no derivative: the graph has none, and its
    gradients are the eager model's."""
    torch.manual_seed(0)
    model, x = _KeysIntoSlices(), torch.randn(3, 4, 8, requires_grad=True)
    captured = capture(model, (x,))
    assert torch.ops.aten.copy.default not in {n.target for n in captured.graph.nodes}
    params = [model.get_parameter(name) for name in captured.params.values()]
    (captured_loss,) = captured.graph_module(*params, x)
    got = torch.autograd.grad(captured_loss, [x, *params])
    want = torch.autograd.grad(model(x), [x, *params])
    assert torch.allclose(captured_loss, model(x))
    assert all(torch.allclose(g, w) for g, w in zip(got, want))


def test_examples_trace_where_the_model_is():
    """An example batch elsewhere than the model (CPU token ids for a meta model here; CUDA
    batches for a CPU model on a GPU machine) gives shapes and dtypes: the graph traces on the
    model's device (a meta model's as on the CPU, below) instead of failing in torch.export's device
    propagation."""
    model = meta_model("gpt.py", hidden=32, layers=1, heads=2, vocab=64, seq=16)
    ids = torch.randint(0, 64, (2, 16))
    captured = capture(model, (ids, ids))
    tokens = captured.graph_module.graph.find_nodes(op="placeholder")[-1].meta["val"]
    assert tokens.device.type == "cpu" and tokens.shape == (2, 16) and tokens.dtype == torch.int64


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_a_model_without_weights_captures_as_its_cpu_twin(precision):
    """On meta, attention returns its heads outermost and the CPU kernel innermost, so the reshape
    after it copied on meta only: a plan made without weights did not load for the model that runs.
    Traced as on the CPU, both capture one graph, and the meta model keeps its meta tensors."""
    sizes = dict(hidden=32, layers=2, heads=4, vocab=64, seq=16)
    meta = meta_model("gpt.py", **sizes)
    cpu = load_example("gpt.py").build(**sizes)
    tied = meta_model("gpt.py", **sizes)
    tied.output.weight = tied.tok_embeddings.weight
    on_meta = capture(meta, meta.example_inputs(2, device="meta"), param_dtype=precision)
    on_cpu = capture(cpu, cpu.example_inputs(2), param_dtype=precision)
    assert on_meta.fingerprint == on_cpu.fingerprint
    assert all(t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter) for t in meta.state_dict().values())
    assert capture(tied, tied.example_inputs(2, device="meta")).tied == {"output.weight": "tok_embeddings.weight"}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_hugging_face_models_without_weights_capture_as_their_cpu_twins(family):
    """Every family of benchmarks/families.py does (JetMoE aside: its sizes come from the data)."""
    from_config = load_example("hf.py").from_config
    sizes = dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64)
    with torch.device("meta"):
        meta = from_config(family=family, **sizes)
    cpu = from_config(family=family, **sizes)
    tokens = torch.randint(0, 64, (2, 16))
    call = dict(input_ids=tokens, labels=tokens)
    on_meta = capture(meta, (), {name: value.to("meta") for name, value in call.items()})
    assert on_meta.fingerprint == capture(cpu, (), call).fingerprint


class _NoGradient(torch.autograd.Function):
    """A backward that is not the forward's derivative (as a straight-through or sampled estimator's)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 0


class _WithCustomBackward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _NoGradient.apply(self.linear(x)).sum()


def test_a_custom_autograd_backward_which_export_drops_is_said(monkeypatch):
    from autopar.passes.capture import calls

    said, apply = [], torch.autograd.Function.__dict__["apply"]
    monkeypatch.setattr(calls, "say_once", said.append)
    captured = capture(_WithCustomBackward(), (torch.randn(2, 4),))
    assert len(said) == 1 and "_NoGradient (" in said[0] and "test_graph.py" in said[0], said
    ops = [str(n.target) for n in captured.graph.nodes if n.op == "call_function"]
    assert "aten.mul.Tensor" in ops  # the forward traced; its custom backward is gone (said above)
    assert torch.autograd.Function.__dict__["apply"] is apply  # restored


class _PartlyWithoutGradients(torch.nn.Module):
    """Runs a layer twice, the first time under no_grad (as HRM's early reasoning cycles)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            x = self.linear(x).tanh()
        return self.linear(x).square().sum()


def test_what_the_forward_runs_without_gradients_passes_none():
    torch.manual_seed(0)
    model, x = _PartlyWithoutGradients(), torch.randn(3, 4, requires_grad=True)
    captured = capture(model, (x,))
    params = [model.get_parameter(name) for name in captured.params.values()]
    (captured_loss,) = captured.graph_module(*params, x)
    got = torch.autograd.grad(captured_loss, params, allow_unused=True)
    want = torch.autograd.grad(model(x), params)
    assert torch.allclose(captured_loss, model(x)) and all(torch.allclose(g, w) for g, w in zip(got, want))
    (again,) = captured.graph_module(*params, x)
    assert torch.autograd.grad(again, x, allow_unused=True)[0] is None  # x feeds only the no-grad region


@torch.library.custom_op("autopar_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_scaled.register_fake(lambda x: torch.empty_like(x))
_scaled.register_autograd(lambda ctx, grad: grad * 2)


class _WithCustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _scaled(self.linear(x)).sum()


def test_a_custom_op_keeps_its_backward_and_is_not_said(monkeypatch):
    # torch.library runs a custom op's autograd as an autograd.Function: the op stays one node,
    # its backward with it (autopar's own mixture-of-experts ops are such)
    from autopar.passes.capture import calls

    said = []
    monkeypatch.setattr(calls, "say_once", said.append)
    captured = capture(_WithCustomOp(), (torch.randn(2, 4),))
    assert torch.ops.autopar_test.scaled.default in {n.target for n in captured.graph.nodes} and said == [], said
