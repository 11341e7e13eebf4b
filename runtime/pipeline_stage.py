"""One stage of a torch pipelining schedule as autopar runs it (:mod:`autopar.runtime.pipeline`):
each send and receive it posts logged in words, so a transfer that fails can be named, and its
backward passes synced over data parallelism where the pipeline says."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from autopar.runtime.faults import listing

if TYPE_CHECKING:
    from autopar.passes.rewrite.stages import StageProgram


class Transfers:
    """The stage-to-stage sends and receives this rank posted last, in words: torch's schedule
    posts and waits for them itself, so a transfer that times out (a peer stalled or died) is
    named from here (see ``autopar.runtime.pipeline.PipelineModule._step``)."""

    def __init__(self):
        self.last: dict[str, str] = {}  # "receive" / "send" → the last one posted

    def posted(self, ops: list[dist.P2POp], stage: int, what: str, values: tuple[str, ...], microbatch: int):
        if ops:  # one message per value, all to one peer and of one direction
            kind = "receive" if ops[0].op is dist.irecv else "send"
            peer = f"{'from' if kind == 'receive' else 'to'} rank {ops[0].peer}"
            named = listing(list(values)) if values else "its values"
            self.last[kind] = f"{kind} of stage {stage}'s {what} ({named}) for microbatch {microbatch} {peer}"
        return ops

    def describe(self) -> str:
        posted = "; ".join(self.last[kind] for kind in ("receive", "send") if kind in self.last)
        return "between pipeline stages" + (f" (the last this rank posted: {posted})" if posted else "")


class Stage(PipelineStage):
    """A PipelineStage that runs each backward making weight gradients (a full backward, or a
    zero-bubble weight pass; with ``last_only`` its last one) inside ``sync_now()`` when given:
    torch's hook for data parallelism. ``weight_pass`` (compiled zero-bubble stages) builds each
    backward's weight pass. Each send and receive it posts is logged in ``transfers`` with the
    values it carries."""

    def __init__(
        self, *args, program: StageProgram, transfers: Transfers, sync_now=None, last_only=False, weight_pass=None, **kw
    ):
        super().__init__(*args, dw_builder=self._synced_weight_pass if weight_pass is not None else None, **kw)
        self._sync_now, self._last_only, self._weight_pass = sync_now, last_only, weight_pass
        self._program, self._transfers = program, transfers
        self._weight_passes = 0  # built this step: torch builds one per microbatch's backward, in order

    def clear_runtime_states(self) -> None:  # at the start of every step
        super().clear_runtime_states()
        self._weight_passes = 0

    def _syncs(self, last_backward: bool) -> bool:
        return self._sync_now is not None and (last_backward or not self._last_only)

    def _synced_weight_pass(self):
        self._weight_passes += 1
        run = self._weight_pass()
        if not self._syncs(self._weight_passes == self.chunks):
            return run

        def synced() -> None:
            with self._sync_now():
                run()

        return synced

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        return self._transfers.posted(ops, self.stage_index, "inputs", self._program.received, fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        return self._transfers.posted(ops, self.stage_index, "outputs", self._program.sent, fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        grads = tuple(f"grad of {name}" for name in self._program.sent)
        return self._transfers.posted(ops, self.stage_index, "output gradients", grads, bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        grads = tuple(f"grad of {name}" for name in self._program.received)
        return self._transfers.posted(ops, self.stage_index, "input gradients", grads, bwd_chunk_id)

    def _to_tensor(self, arg):
        """torch learns each stage's shapes by running it once, the first step, on tensors made
        from the metadata the previous stage sent, with ``torch.empty``: garbage that a stage
        reading values turns into an error (labels into cross-entropy: "Target ... is out of
        bounds", token ids into an embedding) or into counts an all-to-all disagrees on. Zeros
        are a valid index and the same on every rank."""
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                tensor.zero_()
        return tensor

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        # (with a weight pass of ours, a "full" backward makes input gradients only: the pass syncs)
        if backward_type == "input" or self.dw_builder is not None or not self._syncs(last_backward):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self._sync_now():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
