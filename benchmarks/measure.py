"""What the benchmarks measure besides time: the memory a rank holds (its named tensors, and
the allocator's peak during a step), a step's compute alone, its collectives replaced by
local stand-ins, and how fast the shared cores run.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.passes.rewrite.overlap import schedule_communication
from autopar.runtime.functional import FUNCTIONAL_FORMS

functional = torch.ops._c10d_functional

# --------------------------------------------------------------------------- memory


def _storages(tensors) -> dict[int, int]:
    """data_ptr → bytes of every distinct storage behind ``tensors`` (views count once)."""
    found = {}
    for tensor in tensors:
        if isinstance(tensor, torch.distributed.tensor.DTensor):
            tensor = tensor._local_tensor
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def persistent_tensors(pmodel, optimizer) -> dict[str, dict[int, int]]:
    """The storages a rank keeps between steps, by category."""
    params = list(pmodel.parameters())
    return {
        "params": _storages(params),
        "grads": _storages(p.grad for p in params if p.grad is not None),
        # its state, and the tensors it steps where they are not the parameters' own (ZeRO-1/2's chunks)
        "optimizer": _storages(
            [*(v for state in optimizer.state.values() for v in state.values()), *_stepped(optimizer)]
        ),
        "buffers": _storages(pmodel.buffers()),
        # GradSync's flat buckets (private: no public accessor), one per synced gradient byte
        "grad_buckets": _storages(bucket.buffer for bucket in pmodel._grad_sync._buckets),
    }


def _stepped(optimizer) -> list:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _live_bytes(categories: dict[str, dict[int, int]]) -> int:
    merged = {}
    for storages in categories.values():
        merged.update(storages)
    return sum(merged.values())


def saved_activation_bytes(pmodel, batch, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one ``train_step``
    (parameters, in ``exclude``, left out). Its own step: a pack hook that returns the tensor
    keeps a saved output alive in a tensor <-> grad_fn cycle until the garbage collector
    runs, so the peak is measured in another step, without the hook."""
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.update(_storages([tensor]))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        pmodel.train_step(*batch)
    gc.collect()
    return sum(n for ptr, n in saved.items() if ptr not in exclude)


def forward_allocations(forward) -> tuple[object, int, int]:
    """``forward()``'s result, the bytes allocated inside it and still live when it returns (for
    a loss: what its autograd graph holds for backward, plus the loss), and the highest net
    allocation on the way. A block allocated before and freed inside would count negative:
    call it with gradients freed (a forward frees nothing else it did not allocate)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = forward()
    net = peak = 0
    for _, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        net += nbytes
        peak = max(peak, net)
    return result, net, peak


class _EagerStep:
    """A plain model whose forward returns the loss, with the ``train_step`` the helpers call."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def train_step(self, *batch):
        loss = self.model(*batch)
        loss.backward()
        return loss.detach()


def activation_memory(module, optimizer, batch, inputs=None) -> dict:
    """What one step of ``module`` (a parallelized module, or a plain model returning its loss)
    keeps for backward: ``saved``, the bytes autograd saves in ``train_step(*batch)``
    (:func:`saved_activation_bytes`, parameters left out); and, in another step, over the forward
    alone, ``held_after_forward`` (bytes allocated and still live when it returns) and
    ``forward_peak`` (:func:`forward_allocations`). A parallelized module's forward takes the
    global ``inputs`` (it shards them itself; given ``batch``, this rank's share, it would shard
    that again and measure a smaller problem); a plain model's, ``batch``. Gradients are freed
    before each and after."""
    step = module if hasattr(module, "train_step") else _EagerStep(module)
    exclude = set(_storages(module.parameters()))
    _clear_grads(module, optimizer)
    saved = saved_activation_bytes(step, batch, exclude)
    _clear_grads(module, optimizer)
    loss, held, peak = forward_allocations(lambda: module(*(batch if inputs is None else inputs)))
    loss.backward()
    _clear_grads(module, optimizer)
    return {"saved": saved, "held_after_forward": held, "forward_peak": peak}


def _clear_grads(pmodel, optimizer) -> None:
    """``zero_grad()`` on the plain leaves and on the DTensor parameters sharing their storage,
    so the old gradients are freed now, not (unseen by the profiler) inside the next step."""
    optimizer.zero_grad(set_to_none=True)
    for param in pmodel.parameters():
        param.grad = None
    gc.collect()


def measure_memory(pmodel, optimizer, batch) -> dict:
    """Peak bytes this rank holds during one ``train_step``, and what makes them up.

    baseline: the live storages named before the step (parameter shards, AdamW state,
    buffers, gradient-sync buckets; no gradients). The profiler records every allocation
    and free of a block made while it runs, in order; their running sum on top of the
    baseline is the live memory, its maximum the peak. A block allocated before profiling
    and freed inside would be missed, so the gradients are freed first, and
    ``walk_residual`` (what the walk says is live after the step minus what the named
    tensors hold) checks that nothing else was: 0 when the walk is complete.
    """
    _clear_grads(pmodel, optimizer)
    before = persistent_tensors(pmodel, optimizer)
    persistent_ids = {ptr for storages in before.values() for ptr in storages}
    saved = saved_activation_bytes(pmodel, batch, persistent_ids)
    _clear_grads(pmodel, optimizer)
    baseline = _live_bytes(before)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pmodel.train_step(*batch)
        with record_function("cost_model.optimizer_step"):
            optimizer.step()
    events = prof.profiler.kineto_results.events()
    split = min((e.start_ns() for e in events if e.name() == "cost_model.optimizer_step"), default=math.inf)
    net = peak_step = peak_optimizer = 0
    net_after_step = None
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if start >= split and net_after_step is None:
            net_after_step = net
        net += nbytes
        if start < split:
            peak_step = max(peak_step, net)
        else:
            peak_optimizer = max(peak_optimizer, net)
    after = persistent_tensors(pmodel, optimizer)
    return {
        "baseline": baseline,
        "by_category": {k: sum(v.values()) for k, v in before.items()},
        "grads_after": sum(after["grads"].values()),
        "peak_step": baseline + peak_step,
        "peak_optimizer": baseline + peak_optimizer,
        "saved_activations": saved,
        "walk_residual": baseline + (net_after_step if net_after_step is not None else net) - _live_bytes(after),
    }


# --------------------------------------------------------------------------- communication


COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")  # what runtime/ calls


class _Done:
    """What an asynchronous collective returns when nothing was sent."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _stand_ins() -> dict:
    """Local stand-ins of the collectives: same shapes, same output writes, no communication."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return _Done() if async_op else None

    def all_gather_single(output, input, group=None, async_op=False):
        rows = output.view(-1, input.numel())
        rows.copy_(input.reshape(1, -1).expand_as(rows))
        return _Done() if async_op else None

    def reduce_scatter_single(output, input, op=None, group=None, async_op=False):
        output.view(-1).copy_(input.view(-1)[: output.numel()])
        return _Done() if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        output.copy_(input)
        return _Done() if async_op else None

    return {
        "all_reduce": all_reduce,
        "all_gather_single": all_gather_single,
        "reduce_scatter_single": reduce_scatter_single,
        "all_to_all_single": all_to_all_single,
    }


class _Patched:
    """Replace ``torch.distributed`` collectives for the duration of a ``with`` block."""

    def __init__(self, replacements: dict):
        self.replacements, self.originals = replacements, {}

    def __enter__(self):
        for name, fn in self.replacements.items():
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)


def no_communication() -> _Patched:
    """Inside: every collective the runtime calls is a local stand-in (timing only; sums are wrong)."""
    return _Patched(_stand_ins())


def model_state_bytes(competitor) -> int:
    """Parameters, gradients and optimizer state on this rank, each storage once."""
    optimizer = competitor.optimizer
    inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optim", None) or optimizer
    tensors = [t for p in competitor.module.parameters() for t in (p, p.grad)]
    tensors += [t for group in inner.param_groups for p in group["params"] for t in (p, p.grad)]
    tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())


def _scattered(x, reduce_op, group_size, group_name):
    return x[: x.shape[0] // group_size].clone()


def _exchanged(x, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    return x.clone() if rows == x.shape[0] else x.new_empty((rows, *x.shape[1:]))


class _LocalCollectives(TorchDispatchMode):
    """Inside: the functional collectives are local ops of their shapes and memory traffic, nothing
    sent. Traced inside it, autopar's functional forms keep every layout copy around their
    collectives (:data:`autopar.runtime.functional.FUNCTIONAL_FORMS`, whatever they become)."""

    STAND_INS = {
        functional.all_reduce.default: lambda x, reduce_op, group_name: x.clone(),
        functional.all_gather_into_tensor.default: lambda x, group_size, group_name: torch.cat([x] * group_size),
        functional.reduce_scatter_tensor.default: _scattered,
        functional.all_to_all_single.default: _exchanged,
        functional.wait_tensor.default: lambda x: x,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.STAND_INS.get(func, func)(*args, **(kwargs or {}))


def _stand_in_forms() -> dict:
    """The ``autopar::`` collectives' functional forms with their collectives local (a compiled
    twin's: the same shapes and copies, no communication)."""

    def local(form):
        def without_communication(*args):
            with _LocalCollectives():
                return form(*args)

        return without_communication

    return {op: local(form) for op, form in FUNCTIONAL_FORMS.items()}


def schedule_without_communication(graph, forms) -> None:
    """A compiled twin's scheduling pass: every collective lowered to its local stand-in
    (``forms``, the real ones, ignored); the program's opaque kernels communicate through
    ``torch.distributed``, which :func:`no_communication` replaces."""
    schedule_communication(graph, _stand_in_forms())


# --------------------------------------------------------------------------- machine


def python_loop_s() -> float:
    """Seconds a fixed pure-Python loop (10^7 additions) takes here, the median of 3: how fast the
    shared cores ran while the search times were taken (it varies from day to day)."""
    times = []
    for _ in range(3):
        started, total = time.perf_counter(), 0
        for i in range(10_000_000):
            total += i
        times.append(time.perf_counter() - started)
    return statistics.median(times)
