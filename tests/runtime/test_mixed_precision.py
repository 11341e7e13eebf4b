"""The loss scaler against torch.amp.GradScaler, and the compute copies, in one process."""

import pytest
import torch

from autopar.ir import PrecisionPolicy
from autopar.runtime.mixed_precision import LossScaler, MixedPrecision

# A step's gradients: finite, or holding an inf or a NaN somewhere.
PATTERN = ["ok", "ok", "inf", "ok", "ok", "ok", "nan", "ok", "ok", "ok", "ok", "ok"]


def _grads(kind: str, scale: float) -> list[torch.Tensor]:
    grads = [torch.tensor([1.0, -2.0]) * scale, torch.tensor([[0.5]]) * scale]
    if kind != "ok":
        grads[1][0, 0] = float(kind)
    return grads


def test_loss_scaler_follows_grad_scaler_step_for_step():
    """The same gradients through torch.amp.GradScaler (which owns the rules) and LossScaler:
    the same steps skipped, the same scale after each, the same unscaled gradients."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
    ours = LossScaler(scale=2.0**4, growth_interval=3)
    for kind in PATTERN:
        optimizer.zero_grad()
        torch_scaler.scale((param * (1.0 if kind == "ok" else float(kind))).sum()).backward()
        before = param.detach().clone()
        torch_scaler.step(optimizer)
        torch_scaler.update()
        torch_skipped = torch.equal(param.detach(), before)

        grads = _grads(kind, ours.scale)
        found_inf = ours.unscale_(grads)
        ours.update(found_inf)
        assert (found_inf, ours.skipped) == (torch_skipped, torch_skipped), kind
        assert ours.scale == torch_scaler.get_scale(), (kind, ours.scale, torch_scaler.get_scale())
        if not found_inf:
            assert torch.equal(grads[0], torch.tensor([1.0, -2.0])) and grads[1].item() == 0.5
    assert (ours.scale, ours.growth_tracker) == (16.0, 2)  # 16 → 8 (inf) → 16 (3 good) → 8 (NaN) → 16 (3 good), 2 good


def test_loss_scaler_state_round_trips():
    scaler = LossScaler(growth_interval=2)
    scaler.update(found_inf=False)
    copy = LossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert (copy.scale, copy.growth_tracker) == (2.0**16, 1)


def test_compute_copies_are_cast_once_per_call_and_send_fp32_gradients_to_the_masters():
    master = torch.randn(4, 3, requires_grad=True)
    frozen = torch.randn(3)
    precision = MixedPrecision(PrecisionPolicy.of("bf16-mixed"), {"w": master, "b": frozen})
    precision.new_call()
    first = precision.leaves()
    copy = precision._copies["w"]
    second = precision.leaves()  # the same call (another microbatch, another stage): no new cast
    assert second["w"].data_ptr() == first["w"].data_ptr() == copy.data_ptr()
    assert first["w"].dtype == torch.bfloat16 and torch.equal(first["w"], master.detach().to(torch.bfloat16))
    assert second["b"].dtype == torch.bfloat16 and not second["b"].requires_grad

    (first["w"].sum() + second["w"].sum()).backward()  # two uses (two microbatches): summed on the master
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, torch.full((4, 3), 2.0))

    kept = copy.clone()
    with torch.no_grad():
        master.add_(1.0)  # an optimizer step; on a DTensor no version counter says so
    precision.new_call()
    third = precision.leaves()["w"]
    assert torch.equal(third, master.detach().to(torch.bfloat16))
    assert torch.equal(copy, kept)  # a new tensor: an earlier call's graph may still hold the old copy
    assert precision.held_bytes() == (12 + 3) * 2


def test_inputs_outputs_and_fp32_are_as_the_policy_says():
    master = torch.randn(2, requires_grad=True)
    fp32 = MixedPrecision(PrecisionPolicy.of("fp32"), {"w": master})
    assert fp32.leaves()["w"] is master and fp32.loss_scaler is None
    tokens, x = torch.tensor([1, 2]), torch.randn(2)
    assert fp32.inputs((tokens, x))[1] is x

    fp16 = MixedPrecision(PrecisionPolicy.of("fp16-mixed"), {"w": master})
    cast_tokens, cast_x = fp16.inputs((tokens, x))
    assert cast_tokens is tokens and cast_x.dtype == torch.float16
    fp16.loss_scaler.scale = 8.0
    (loss,) = fp16.outputs(((fp16.leaves()["w"] * 3).sum(),))
    loss.backward()  # the gradient flowing back is scaled; unscaled where the step ends
    assert torch.equal(master.grad, torch.full((2,), 24.0))
    assert fp16.finish([master.grad], group=None) is False and torch.equal(master.grad, torch.full((2,), 3.0))


@pytest.mark.parametrize("bad", [dict(precision="bf16"), dict(reduce_dtype="int8")])
def test_a_bad_precision_is_a_config_error(bad):
    from autopar.ir import ConfigError, PlanOptions

    with pytest.raises(ConfigError, match="choose one of"):
        PlanOptions(**bad)
