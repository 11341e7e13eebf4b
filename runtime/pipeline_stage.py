"""One stage of a torch pipelining schedule as autopar runs it (:mod:`autopar.runtime.pipeline`):
each send and receive it posts logged in words, so a transfer that fails can be named, and its
backward passes synced over data parallelism where the pipeline says.

Zero-bubble schedules split each backward in two: the input pass, which records the nodes where
the weights' paths join the inputs' ("intermediates") and their gradients, and the weight pass,
which starts from those. torch's weight pass misses a stage output that the weights alone make
(T5's position bias, made in one stage from its bias table and sent to the next): no intermediate
lies on its path, so the gradient the next stage returns for it never reaches the table. The
stage takes those outputs' gradients to the weights itself (:func:`_weights_only_outputs`), and
torch's groups of weights are differentiated as one (:func:`_one_group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

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
        self._chunk = None  # the microbatch whose backward runs
        self._weights_only: dict[int, list] = {}  # microbatch → (edge, gradient) of outputs the weights alone make
        self._weights_only_at: tuple[int, ...] | None = None  # which outputs those are (the program decides)

    def clear_runtime_states(self) -> None:  # at the start of every step
        super().clear_runtime_states()
        self._weight_passes = 0
        self._weights_only.clear()

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._chunk = bwd_chunk_id
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._chunk = bwd_chunk_id
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

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
        if backward_type == "input" and self.dw_builder is None:  # before torch's input pass detaches the outputs
            if self._weights_only_at is None:  # found once: every microbatch runs the same program
                self._weights_only_at = _weights_only_outputs(bwd_kwargs)
            self._weights_only[self._chunk] = _edges(bwd_kwargs, self._weights_only_at)
        if backward_type == "weight" and self.dw_builder is None:
            _accumulate(self._weights_only.pop(self._chunk, []), list(self.submod.parameters()))
            bwd_kwargs = {**bwd_kwargs, "param_groups": _one_group(bwd_kwargs["param_groups"])}
        # (with a weight pass of ours, a "full" backward makes input gradients only: the pass syncs)
        if backward_type == "input" or self.dw_builder is not None or not self._syncs(last_backward):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self._sync_now():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _one_group(groups: list[dict]) -> list[dict]:
    """torch's weight pass (zero-bubble schedules, eager) differentiates each group of weights on
    its own and frees the graph as it goes; weights whose paths share a node (T5's one position
    bias, read by every layer of the stage) then fail "backward through the graph a second time".
    As one group, the weight gradients are one pass over the stage's graph (each weight once)."""
    if len(groups) <= 1:
        return groups
    params = {id(param): param for group in groups for param in group["params"]}  # each weight once
    intermediates = [node for group in groups for node in group["intermediates"]]
    return [{"params": list(params.values()), "intermediates": intermediates,
             "grads": [grads for group in groups for grads in group["grads"]]}]  # fmt: skip


def _weights_only_outputs(bwd_kwargs: dict) -> tuple[int, ...]:
    """Which of the stage's outputs no input of the stage reaches (made from its weights alone)."""
    if bwd_kwargs.get("output_grads") is None:  # the last stage: its loss
        return ()
    inputs = [value for value in bwd_kwargs["input_values"] if isinstance(value, torch.Tensor) and value.requires_grad]
    stops = {_get_grad_fn_or_grad_acc(value) for value in inputs}
    outputs = bwd_kwargs["stage_output"]
    return tuple(
        i for i, output in enumerate(outputs)
        if isinstance(output, torch.Tensor) and output.grad_fn is not None and not _reaches(output.grad_fn, stops)
    )  # fmt: skip


def _edges(bwd_kwargs: dict, indices: tuple[int, ...]) -> list[tuple[GradientEdge, torch.Tensor]]:
    """(autograd edge, the gradient the next stage returned) of those outputs."""
    outputs, grads = bwd_kwargs["stage_output"], bwd_kwargs.get("output_grads")
    return [(GradientEdge(outputs[i].grad_fn, outputs[i].output_nr), grads[i]) for i in indices if grads[i] is not None]


def _reaches(node, stops: set) -> bool:
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        if current in stops:
            return True
        for following, _ in current.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                stack.append(following)
    return False


def _accumulate(outputs: list[tuple[GradientEdge, torch.Tensor]], weights: list[torch.Tensor]) -> None:
    """Those outputs' gradients taken to the weights and added to theirs (before torch's weight
    pass, which frees the graph)."""
    weights = [weight for weight in weights if weight.requires_grad]
    if not outputs or not weights:
        return
    edges, grads = zip(*outputs)
    for weight, grad in zip(weights, torch.autograd.grad(edges, weights, grads, retain_graph=True, allow_unused=True)):
        if grad is not None:
            weight.grad = grad if weight.grad is None else weight.grad + grad
