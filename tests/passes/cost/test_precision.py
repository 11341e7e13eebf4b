"""Precision in the plan: the cost model prices the policy, whatever dtype the model was captured in.

Mixed precision keeps 16-bit weights and gradients and an fp32 master copy with two fp32 moments
(autopar.ir.precision.model_state_bytes); activations and collectives move 16-bit values; compute
runs at the preset's 16-bit rates. The default is the hardware's natural choice.
"""

import pytest
import torch
from planning import meta_model, plan_example

import autopar
from autopar.ir import PlanOptions, PrecisionPolicy, get_profile, model_state_bytes
from autopar.passes.cost.efficiency import GEMMS
from autopar.passes.cost.facts import analyze

MLP = dict(hidden=2048, ffn=8192, layers=2)


def _plan(precision=None, hardware="a100-80gb", **options):
    return plan_example(
        "mlp.py", 8, batch=8192, model_kwargs=MLP, hardware=hardware, degrees={"dp": 8}, zero=0, recompute="none",
        precision=precision, **options,
    )  # fmt: skip


def test_the_default_is_the_hardware_s_natural_choice():
    assert PlanOptions(hardware="a100-80gb").precision_policy.precision == "bf16-mixed"
    assert PlanOptions(hardware="h200-141gb").precision_policy.precision == "bf16-mixed"
    assert PlanOptions(hardware="cpu-local").precision_policy.precision == "fp32"
    assert PlanOptions(hardware="a100-80gb", precision="fp16-mixed").precision_policy.param_dtype == "float16"
    assert _plan().precision == "bf16-mixed" and _plan("fp32").precision == "fp32"


def test_parallelize_on_gpu_ranks_plans_for_their_gpu_and_its_precision(monkeypatch):
    # the two-argument form on NCCL ranks names no hardware: it plans for the GPU (an H100 found
    # on an H100 machine planned for this host's CPU profile and trained in fp32)
    from autopar import api

    monkeypatch.setattr(api.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(api.torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    options = api._on_this_hardware(PlanOptions())
    assert options.profile.name == "h100-80gb" and options.precision_policy.precision == "bf16-mixed"
    assert api._on_this_hardware(PlanOptions(hardware="cpu-local")).precision_policy.precision == "fp32"
    monkeypatch.setattr(api.dist, "get_backend", lambda: "gloo")
    assert api._on_this_hardware(PlanOptions()).hardware is None  # gloo ranks: this machine's profile


def test_precision_changes_model_state_by_the_bytes_per_parameter():
    fp32, mixed = _plan("fp32"), _plan("bf16-mixed")
    params = sum(p.numel() for p in meta_model("mlp.py", **MLP).parameters())
    for plan in (fp32, mixed):
        expected = model_state_bytes(params, precision=plan.precision)
        for category in ("params", "grads", "optimizer"):
            assert plan.cost.memory[category] == pytest.approx(expected[category]), (plan.precision, category)
    # FSDP2's layout, as the runtime holds it: the fp32 master plus a 16-bit compute copy (4 + 2
    # bytes against 4), fp32 gradients of the master, Adam's two fp32 moments under both
    assert mixed.cost.memory["params"] == pytest.approx(fp32.cost.memory["params"] * 6 / 4)
    assert mixed.cost.memory["grads"] == pytest.approx(fp32.cost.memory["grads"])
    assert mixed.cost.memory["optimizer"] == pytest.approx(fp32.cost.memory["optimizer"])
    # gradients are reduced in fp32 under both (FSDP2's default reduce_dtype): the sync buckets agree
    assert mixed.cost.memory["grad_buckets"] == pytest.approx(fp32.cost.memory["grad_buckets"])
    # activations are 16-bit values
    assert mixed.cost.memory["activations"] == pytest.approx(fp32.cost.memory["activations"] / 2, rel=0.01)


def test_compute_runs_at_the_preset_s_rate_for_the_compute_dtype():
    fp32, mixed = _plan("fp32"), _plan("bf16-mixed")
    assert mixed.cost.model_flops == fp32.cost.model_flops
    a100 = get_profile("a100-80gb")
    model = meta_model("mlp.py", **MLP)
    captured = autopar.capture(model, model.example_inputs(8192, device="meta"))
    times = {}
    for precision in ("fp32", "bf16-mixed"):
        facts = analyze(captured, a100, policy=PrecisionPolicy.of(precision)).values()
        ops = [f for f in facts if f.kind == "op"]
        times[precision] = [
            sum(f.full_time_s for f in ops if (f.node.target in GEMMS) is gemm) for gemm in (True, False)
        ]
    (gemms, others), (gemms16, others16) = times["fp32"], times["bf16-mixed"]
    # GEMMs are compute-bound in both, at the peaks' ratio (312 / 19.5); GELU, the loss and the residual
    # add stream half the bytes
    assert gemms / gemms16 == pytest.approx(a100.peak_flops["bfloat16"] / a100.peak_flops["float32"], rel=0.01)
    assert others / others16 == pytest.approx(2, rel=0.05)
    assert fp32.cost.compute_s / mixed.cost.compute_s == pytest.approx(
        (gemms + others) / (gemms16 + others16), rel=0.05
    )  # the plan's compute: these ops, each rank's 1/8 of the rows (its GEMMs a little less efficient)


def test_a_model_captured_in_fp32_is_priced_as_the_policy_runs_it():
    model = meta_model("gpt.py", hidden=256, layers=2, heads=4, vocab=1024, seq=128)
    half = meta_model("gpt.py", hidden=256, layers=2, heads=4, vocab=1024, seq=128).to(torch.bfloat16)
    a100 = get_profile("a100-80gb")
    policy = PrecisionPolicy.of("bf16-mixed")
    graphs = [autopar.capture(m, m.example_inputs(16, device="meta")) for m in (model, half)]
    as_fp32, as_bf16 = (analyze(graph, a100, policy=policy) for graph in graphs)
    for name, fact in as_fp32.items():
        other = as_bf16[name]
        assert (fact.elem_bytes, fact.dtype, fact.precision) == (other.elem_bytes, other.dtype, other.precision), name
        assert fact.full_time_s == pytest.approx(other.full_time_s), name
        assert fact.profile.io_bytes == other.profile.io_bytes, name
    linear = next(f for f in as_fp32.values() if f.kind == "op" and "linear" in str(f.node.target))
    assert linear.dtype == "bfloat16" and linear.elem_bytes == 2
    tokens = next(f for f in as_fp32.values() if f.kind == "input")
    assert tokens.elem_bytes == 8  # integer inputs keep their dtype


class UpcastLoss(torch.nn.Module):
    """A loss over fp32 logits whatever the compute dtype, as Megatron and torchtitan take it."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(64, 512)

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.head(x).float(), labels)


def test_a_model_captured_in_the_compute_dtype_keeps_its_own_upcasts():
    """Captured as bf16-mixed runs it (as ``plan`` captures), the loss over upcast logits is priced
    in fp32 and the cast itself counts; captured in fp32, every floating op is priced in bf16."""
    x, labels = torch.empty(256, 64, device="meta"), torch.empty(256, dtype=torch.int64, device="meta")
    with torch.device("meta"):
        model = UpcastLoss()
    policy = PrecisionPolicy.of("bf16-mixed")
    a100 = get_profile("a100-80gb")
    ops = {
        precision: {
            str(f.node.target): f
            for f in analyze(autopar.capture(model, (x, labels), precision=precision), a100, policy=policy).values()
            if f.kind == "op"
        }
        for precision in ("bf16-mixed", None)
    }
    as_run, as_fp32 = ops["bf16-mixed"], ops[None]
    assert as_run["aten.linear.default"].dtype == "bfloat16" and as_run["aten._to_copy.default"].dtype == "float32"
    assert (
        as_run["aten.cross_entropy_loss.default"].profile.io_bytes
        > as_fp32["aten.cross_entropy_loss.default"].profile.io_bytes
    )
    assert as_run["aten._to_copy.default"].full_time_s > 0
    assert "aten._to_copy.default" not in as_fp32  # .float() of an fp32 tensor is no op in the graph


def test_collectives_move_compute_dtype_bytes():
    fp32, mixed = (
        plan_example(
            "mlp.py", (2, 4), batch=131072, model_kwargs=MLP, hardware="a100-80gb", degrees={"dp": 2, "tp": 4},
            zero=0, recompute="none", precision=precision,
            constraints={"blocks.*.fc1": "S(-1)", "blocks.*.fc2": "P"},
        )
        for precision in ("fp32", "bf16-mixed")
    )  # fmt: skip
    # the tensor-parallel all-reduces of activations (64 MiB in bf16): half the bytes, about half the time
    assert mixed.cost.comm_s == pytest.approx(fp32.cost.comm_s / 2, rel=0.1)


def test_zero_2_and_3_hold_gradient_buckets_in_flight_not_a_copy_of_every_gradient():
    # DDP keeps a flat copy of every synced gradient; ZeRO-2 frees each 25 MB bucket once it is
    # reduce-scattered and ZeRO-3 each layer's: one filling while the one before is in flight
    kwargs = dict(hidden=1024, layers=8, heads=8, vocab=1024, seq=64)
    model = meta_model("gpt.py", "build", **kwargs)
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")) * 4  # fp32 grads
    # the position embedding's gradient is summed as its output's (an activation's, in backward), not in a bucket
    synced = sum(p.numel() for n, p in model.named_parameters() if n != "pos_embeddings.weight") * 4
    buckets = {
        zero: plan_example(
            "gpt.py", 8, 64, model_kwargs=kwargs, degrees={"dp": 8}, zero=zero, hardware="h100-80gb"
        ).cost.memory["grad_buckets"]
        for zero in (0, 2, 3)
    }
    assert buckets[0] == pytest.approx(synced)
    assert buckets[2] == pytest.approx(2 * max(25 * 2**20, 1024 * 1024 * 4))  # two buckets, none under a weight
    assert buckets[3] == pytest.approx(2 * layer)
