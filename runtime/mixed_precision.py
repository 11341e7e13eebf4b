"""Mixed precision at run time, with FSDP2's ``MixedPrecisionPolicy`` meaning.

The parameters (the DTensors ``pmodel.parameters()`` returns, and the leaves they share
storage with) are the fp32 masters, sharded as the plan says (ZeRO-3: this rank's chunk), and
the optimizer steps them. The program computes with 16-bit copies of them:

- **Where the cast lives: in the runtime, once per call.** The graph is captured in the
  compute dtype (``passes.capture.graph.capture(param_dtype=...)``), so it already holds the
  model's own upcasts (norms, softmax in fp32) exactly as the model runs under FSDP2; the
  runtime feeds it :class:`MixedPrecision` leaves: a 16-bit copy of each master, cast afresh at
  each call of the module (a train step, a forward: :meth:`MixedPrecision.new_call`), so its
  microbatches and pipeline stages share one cast, as FSDP2 casts once per forward. Version
  counters cannot say when a master changed: a foreach optimizer step on DTensors moves neither
  the DTensor's nor its local tensor's. A rewrite pass inserting casts at parameter uses would
  cast once per use and per microbatch, and could not recover the model's upcasts from a graph
  captured in fp32. Under ZeRO-3 the copy is of the shard, so the
  per-layer all-gathers move 16-bit data, as FSDP2's do. A compiled program that sums gradients
  itself casts the masters itself (``leaves(cast_by_program=True)``:
  :mod:`autopar.passes.rewrite.compiled`), placed against its sums so they run in
  ``reduce_dtype``; the copies here are made only for programs that take them.
- **Gradients** leave the 16-bit graph through each leaf's backward, which casts the gradient
  to the master's fp32, so they accumulate (over microbatches too) and are reduced in fp32
  by default; ``reduce_dtype`` makes the reduction buckets that dtype instead (``GradSync``,
  ZeRO's reduce-scatters), the sums landing in fp32 again.
- **fp16** adds dynamic loss scaling with ``torch.amp.GradScaler``'s rules (:class:`LossScaler`):
  each program output scales the gradient flowing back into it, so ``loss.backward()`` in any
  training loop is scaled; once a step's gradients are complete (summed over every axis) they
  are unscaled in place and checked on every rank; if any rank saw inf or NaN, every gradient
  is dropped (``grad = None``: torch optimizers then skip the step) and the scale is lowered.

The loss and other outputs come back in the compute dtype, as from the model under FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from autopar.ir import PrecisionPolicy


@dataclass
class LossScaler:
    """Dynamic loss scaling, ``torch.amp.GradScaler``'s rules and defaults: gradients are
    computed for ``loss * scale``; a step whose gradients hold inf or NaN is skipped and the
    scale multiplied by ``backoff_factor``; after ``growth_interval`` steps in a row without
    one, the scale is multiplied by ``growth_factor``. Example::

        scaler = LossScaler(growth_interval=2)
        found_inf = scaler.unscale_(grads)   # grads /= scale; True if any is not finite
        scaler.update(found_inf)             # 2**16 → 2**15 if found_inf
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0  # steps without inf or NaN since the scale last changed
    skipped: bool = field(default=False)  # whether the last step's gradients were dropped

    def unscale_(self, grads: list[Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide ``grads`` by the scale in place; whether any rank of ``group`` (None: this
        process alone) found a gradient element that is not finite."""
        found = torch.zeros(1)
        inverse = torch.full((1,), 1.0 / self.scale)
        for device_grads in _by_device(grads):
            found_here = torch.zeros(1, device=device_grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(device_grads, found_here, inverse.to(found_here.device))
            found += found_here.cpu()
        if group is not None:
            found = found.to(_collective_device(group))
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> None:
        """GradScaler's ``update``: back off after an overflow, grow after a run of good steps."""
        self.skipped = found_inf
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if grown != float("inf") else self.scale
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])


def _by_device(grads: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple, list[Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return list(groups.values())


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )


class _ComputeLeaf(torch.autograd.Function):
    """The 16-bit copy of a master as the program's leaf: forward hands out the copy (made
    once per call), backward casts the gradient to the master's dtype, where it accumulates."""

    @staticmethod
    def forward(ctx, master: Tensor, copy: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)  # ZeRO-3's gathers return no gradient: pass none on
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        return (None if grad is None else grad.to(ctx.dtype)), None


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by the loss scale (fp16)."""

    @staticmethod
    def forward(ctx, value: Tensor, scaler: LossScaler) -> Tensor:
        ctx.scale = scaler.scale
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


class MixedPrecision:
    """A module's precision policy at run time: the leaves its programs take, its inputs and
    outputs, and the end of each step. Under "fp32" every method is the identity. Example::

        precision = MixedPrecision(plan.precision_policy, masters)   # name → fp32 leaf
        precision.new_call()                         # at each call of the module
        leaves = precision.leaves()                  # name → 16-bit leaf, cast once per call
        outputs = precision.outputs(program(*leaves.values(), *precision.inputs(batch)))
        outputs[0].backward()                        # fp32 gradients on the masters
        skip = precision.finish(grads, group)        # fp16: unscale; True: inf/NaN somewhere
    """

    def __init__(self, policy: PrecisionPolicy, masters: dict[str, Tensor]):
        self.policy = policy
        self.param_dtype = getattr(torch, policy.param_dtype) if policy.mixed else None
        self.reduce_dtype = getattr(torch, policy.reduce_dtype)
        self.loss_scaler = LossScaler() if policy.loss_scaling else None
        self.masters = masters  # name → the leaf a DTensor parameter shares storage with
        self._copies: dict[str, Tensor] = {}  # made on first use: a program casting for itself needs none
        self._cast_this_call = False

    def new_call(self) -> None:
        """A call of the module begins: the masters may have changed since the copies were made
        (an optimizer step, a checkpoint load, the user's own edit), so they are cast again at
        first use. New tensors, not copies into the old ones: an earlier call's autograd graph
        may still hold those for its backward."""
        self._cast_this_call = False

    def leaves(self, through: dict[str, Tensor] | None = None, cast_by_program: bool = False) -> dict[str, Tensor]:
        """name → the tensor the programs take for that parameter: the master itself, or its
        16-bit copy (recast if the master changed since), through which gradients reach the master
        (or the leaf ``through`` names for it: a pipeline stage's own leaf of a shared weight,
        sharing the master's storage); the masters where the program casts them itself."""
        leaves = {**self.masters, **(through or {})}
        if self.param_dtype is None or cast_by_program:
            return leaves
        if not self._cast_this_call:
            with torch.no_grad():
                self._copies = {
                    name: master.to(self.param_dtype)
                    for name, master in self.masters.items()
                    if master.is_floating_point()
                }
            self._cast_this_call = True
        for name, copy in self._copies.items():
            target = leaves[name]
            leaves[name] = _ComputeLeaf.apply(target, copy) if target.requires_grad else copy
        return leaves

    def inputs(self, values) -> tuple:
        """Floating inputs in the compute dtype (FSDP2's ``cast_forward_inputs``); others as they are."""
        if self.param_dtype is None:
            return tuple(values)
        return tuple(v.to(self.param_dtype) if torch.is_tensor(v) and v.is_floating_point() else v for v in values)

    def outputs(self, values) -> tuple:
        """The program's outputs; under loss scaling their gradients are scaled on the way back."""
        if self.loss_scaler is None:
            return tuple(values)
        return tuple(
            _ScaledGradient.apply(v, self.loss_scaler) if torch.is_tensor(v) and v.requires_grad else v for v in values
        )

    def finish(self, grads: list[Tensor], group: dist.ProcessGroup | None) -> bool:
        """At the end of a step's backward (gradients complete): unscale ``grads`` (each storage
        listed once) and update the scale; whether the step must be skipped (any rank of
        ``group`` found inf or NaN). Without loss scaling, nothing to do."""
        if self.loss_scaler is None:
            return False
        found_inf = self.loss_scaler.unscale_(grads, group)
        self.loss_scaler.update(found_inf)
        return found_inf

    def held_bytes(self) -> int:
        """Bytes of the 16-bit copies this rank keeps."""
        return sum(copy.numel() * copy.element_size() for copy in self._copies.values())
