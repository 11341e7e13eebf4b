"""Shared by the mixed-precision tests and benchmark: the single-process step that applies the
same policy as autopar (fp32 masters, 16-bit forward and backward, fp32 gradients), and the
bytes of model state a rank holds."""

import torch

from autopar.passes.capture.graph import cast_floating, computing_in


def reference_step(model, inputs, dtype: torch.dtype, optimizer: torch.optim.Optimizer, loss_scale: float = 1.0):
    """One step of ``model``, whose fp32 parameters are the masters: forward and backward with
    ``dtype`` copies of them and of the floating inputs (FSDP2's ``param_dtype``), the loss times
    ``loss_scale``; the gradients cast to fp32 and unscaled onto the masters; ``optimizer.step()``.
    Returns the loss (in ``dtype``) and the masters' gradients."""
    with computing_in(model, dtype):
        copies = dict(model.named_parameters())
        loss = model(*(cast_floating(value, dtype) for value in inputs))
        (loss * loss_scale).backward()
    for name, master in model.named_parameters():
        master.grad = copies[name].grad.float() / loss_scale
    grads = {name: master.grad.clone() for name, master in model.named_parameters()}
    optimizer.step()
    return loss.detach(), grads


def state_bytes(pmodel, optimizer) -> int:
    """Bytes of parameters, their 16-bit compute copies, gradients and optimizer state on this
    rank (each storage counted once)."""
    tensors = []
    for param in pmodel.parameters():
        tensors += [param.to_local(), None if param.grad is None else param.grad.to_local()]
    for group in optimizer.param_groups:
        tensors += [t for p in group["params"] for t in (p, p.grad)]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values()) + pmodel._precision.held_bytes()
