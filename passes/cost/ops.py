"""Cost model: roofline compute, memory by category, the optimizer's and mixed precision's passes.

Every function returns seconds or bytes for ONE device. Each op is profiled once per
signature (op, shapes, dtypes) by running it, and its backward, on fake tensors
(:func:`op_profile`): forward and backward FLOPs are counted separately, and the tensors
autograd saves for backward are identified, which is what activation memory is made of.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from autopar.ir import OP_NAMESPACE, HardwareProfile, model_state_bytes
from autopar.ir.precision import PrecisionPolicy
from autopar.passes.capture.recurrences import linear_recurrence_op, recurrence_op, scan_op
from autopar.runtime.kernels.expert_parallel import first_expert_slot
from autopar.runtime.kernels.recurrences import DELTA_RULE, reference


@dataclass(frozen=True)
class OpProfile:
    """What one op costs on one device, unsharded."""

    forward_flops: float
    backward_flops: float
    io_bytes: float  # read and written by the forward's kernels
    saved_inputs: tuple[int, ...] = ()  # tensor-input slots autograd keeps for backward
    saves_output: bool = False
    saved_extra_bytes: float = 0.0  # tensors the op creates and autograd keeps (softmax stats, ...)
    backward_io_bytes: float = 0.0  # read and written by the backward's kernels (0: none ran, as add's)
    widened_bytes: float = 0.0  # of ``io_bytes``, those of widening casts (HardwareProfile.widening_bandwidth)
    backward_widened_bytes: float = 0.0  # of ``backward_io_bytes``, likewise


_PROFILES: dict[tuple, OpProfile] = {}  # signature → profile; repeated layers hit it


def compute_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` has when a step computes in ``cast`` (a mixed-precision
    policy's ``param_dtype``): floating tensors take it, integers (indices, labels) keep theirs."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def _signature(node: fx.Node, needs_grad: bool, cast: torch.dtype | None = None, wants=None):
    """(cache key, argument values, their pytree spec, whether each gets a gradient) of an op
    node, or None for a node that does no work of its own (not an aten op; takes a tuple
    (getitem) or a symbol). Floating tensors count in ``cast`` when one is given (see
    :func:`compute_dtype`); with ``needs_grad``, the inputs named in ``wants`` get a gradient
    (every one when None: a mask or a frozen weight gets none, and backward computes less)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    flat, spec = tree_flatten((node.args, node.kwargs))
    values = [arg.meta.get("val") if isinstance(arg, fx.Node) else arg for arg in flat]
    if any(isinstance(arg, fx.Node) and not isinstance(v, torch.Tensor) for arg, v in zip(flat, values)):
        return None
    grads = tuple(
        needs_grad and isinstance(v, torch.Tensor) and (wants is None or getattr(arg, "name", None) in wants)
        for arg, v in zip(flat, values)
    )
    where = _POSITIONS.get(node.target, ())

    def described(k: int, v) -> object:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), compute_dtype(v.dtype, cast)
        return "at" if k in where else repr(v)

    key = (str(node.target), needs_grad, cast, grads) + tuple(described(k, v) for k, v in enumerate(values))
    if where:  # the length a slice keeps is its output's
        key += tuple(tuple(t.shape) for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))
    return key, values, spec, grads


# Arguments (flat positions) that only say where an op reads or writes: a token loop that
# torch.export unrolls indexes position 0, 1, ... of one tensor at the same cost, and one
# signature for them all keeps the ops this machine times from growing with the sequence.
_POSITIONS = {
    torch.ops.aten.select.int: (2,),
    torch.ops.aten.select_scatter.default: (3,),
    torch.ops.aten.slice.Tensor: (2, 3),
    torch.ops.aten.slice_scatter.default: (3, 4),
    torch.ops.aten.narrow.default: (2,),
}


def op_profile(node: fx.Node, needs_grad: bool, cast: torch.dtype | None = None, wants=None) -> OpProfile:
    """Profile a call_function node on fake tensors (cached by op and argument signature), its
    floating inputs in ``cast`` when given: the op as a mixed-precision step runs it; with
    ``needs_grad``, a gradient for the inputs named in ``wants`` (every one when None)."""
    signature = _signature(node, needs_grad, cast, wants)
    if signature is None:
        return OpProfile(0.0, 0.0, 0.0)
    key, values, spec, grads = signature
    if key not in _PROFILES:
        tensors = [v for v in values if isinstance(v, torch.Tensor)] + tree_leaves(node.meta.get("val"))
        # factory ops have no tensor inputs: any fake mode will do
        fake_mode = detect_fake_mode(tuple(t for t in tensors if isinstance(t, torch.Tensor))) or FakeTensorMode()
        with fake_mode:
            try:
                _PROFILES[key] = _run_profile(node.target, values, spec, grads, cast)
            except (RuntimeError, AssertionError, TypeError, ValueError):
                # an op that pins its dtype (a metadata assertion, a typed buffer): as captured
                _PROFILES[key] = (
                    op_profile(node, needs_grad, wants=wants)
                    if cast is not None
                    else _run_profile(node.target, values, spec, grads)
                )
    return _PROFILES[key]


def _run_profile(target, values, spec, grads: tuple[bool, ...], cast: torch.dtype | None = None) -> OpProfile:
    """Run the op and its backward (for the values ``grads`` marks) on fresh fake leaves; note
    what autograd saves."""
    inputs = []
    # On meta tensors attention decomposes into its math form, which saves the seq x seq
    # scores; every real device (CPU included) runs a fused kernel that saves only its output
    # and log-sum-exp: profile what will run.
    fused = getattr(target, "overloadpacket", None) is torch.ops.aten.scaled_dot_product_attention
    for k, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            dtype = compute_dtype(v.dtype, cast)
            grad = grads[k] and dtype.is_floating_point
            device = "cpu" if fused and v.device.type == "meta" else v.device
            values[k] = torch.empty_strided(v.shape, v.stride(), dtype=dtype, device=device, requires_grad=grad)
            inputs.append(values[k])
    args, kwargs = tree_unflatten(values, spec)
    saved = []
    forward, traffic = FlopCounterMode(display=False), _Traffic()
    with forward, traffic, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = target(*args, **kwargs)
    outputs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
    # the kernels the op runs (a composite one several: cross-entropy writes and reads its log-softmax)
    io_bytes = traffic.bytes or sum(_nbytes(t) for t in inputs + outputs)
    widened = traffic.widened
    forward_flops = forward.get_total_flops() or _formula_flops(target, inputs, args)
    differentiable = [o for o in outputs if o.requires_grad]
    backward_flops = backward_io = backward_widened = 0.0
    if differentiable:
        backward, traffic = FlopCounterMode(display=False), _Traffic()
        wrt, seeds = [i for i in inputs if i.requires_grad], [torch.ones_like(o) for o in differentiable]
        with backward, traffic:
            torch.autograd.grad(differentiable, wrt, seeds, allow_unused=True)
        # autopar's recurrence ops keep only their inputs: their backward runs their forward again
        again = recurrence_op(target) or scan_op(target) or linear_recurrence_op(target)
        backward_flops = backward.get_total_flops() or (3 if again else 2) * forward_flops
        backward_io, backward_widened = traffic.bytes, traffic.widened
    slots, saves_output, extra = set(), False, 0.0
    for tensor in saved:
        base = tensor._base if tensor._base is not None else tensor
        if any(base is i for i in inputs):
            slots.add(next(k for k, i in enumerate(inputs) if base is i))
        elif any(base is o for o in outputs):
            saves_output = True
        else:
            extra += tensor.numel() * tensor.element_size()
    return OpProfile(
        float(forward_flops),
        float(backward_flops),
        float(io_bytes),
        tuple(sorted(slots)),
        saves_output,
        extra,
        float(backward_io),
        float(widened),
        float(backward_widened),
    )


class _Traffic(TorchDispatchMode):
    """Bytes the kernels an op dispatches read and write: each one's tensor arguments and results
    (views and queries launch none); ``widened``: those of widening casts."""

    def __init__(self):
        super().__init__()
        self.bytes = self.widened = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if results and not moves_no_data(func):  # a kernel: not a view, nor a query (prim.device)
            # a ``*_like`` factory takes only its argument's shape; empty_like writes nothing either
            read = [] if func.overloadpacket in _SHAPE_ONLY else tree_leaves((args, kwargs))
            written = [] if func.overloadpacket is torch.ops.aten.empty_like else results
            moved = sum(_nbytes(t) for t in read + written if isinstance(t, torch.Tensor))
            self.bytes += moved
            if func.overloadpacket in _CASTS and _widens(read, written):
                self.widened += moved
        return out


_CASTS = {torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.copy}


def _widens(read, written) -> bool:
    """A cast of floats to a wider float (bfloat16 or float16 to float32)."""
    sizes = [
        [t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
        for tensors in (read, written)
    ]
    return bool(sizes[0]) and bool(sizes[1]) and max(sizes[1]) > min(sizes[0])


_SHAPE_ONLY = {
    torch.ops.aten.empty_like,
    torch.ops.aten.zeros_like,
    torch.ops.aten.ones_like,
    torch.ops.aten.full_like,
    torch.ops.aten.rand_like,
    torch.ops.aten.randn_like,
}


def _nbytes(tensor: torch.Tensor) -> float:
    return tensor.numel() * tensor.element_size()


def _formula_flops(target, inputs, args) -> float:
    """FLOPs of ops the flop counter does not know on this device (CPU attention, autopar's
    mixture of experts, the gated delta rule: its model's own function, counted; the selective
    scan: its states read out by C, as the flop counter counts its loop; the linear recurrence)."""
    packet = getattr(target, "overloadpacket", None)
    if recurrence_op(target):  # q, k, v, g, beta, chunk_size, l2norm, source
        counter, (chunk_size, l2norm, source) = FlopCounterMode(display=False), args[5:8]
        with counter, torch.no_grad():
            reference(source, DELTA_RULE)(*inputs, chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2norm)
        return float(counter.get_total_flops())
    if scan_op(target):  # u [b, D, T], delta, A [D, N], ...: each step's [D, N] states times C's [N]
        return 2.0 * math.prod(inputs[0].shape) * inputs[2].shape[-1]
    if linear_recurrence_op(target):  # x, a [b, T, w]: a product and a sum per element
        return 2.0 * math.prod(inputs[0].shape)
    if packet is torch.ops.aten.scaled_dot_product_attention and len(inputs) >= 3:
        q, k = inputs[0], inputs[1]
        return 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]  # QKᵀ and PV
    if str(packet) in (f"{OP_NAMESPACE}.moe", f"{OP_NAMESPACE}.moe_experts"):
        routed = str(packet).endswith("moe_experts")  # moe_experts(x, weights, ids, gate_up, down, ...): no router
        first = first_expert_slot(packet)
        x, (gate_up, down) = inputs[0], inputs[first : first + 2]
        tokens, hidden = x.shape
        top_k = inputs[1].shape[1] if routed else args[4]  # each token through top_k experts: SwiGLU, then down
        router = 0.0 if routed else 2.0 * tokens * hidden * inputs[1].shape[0]
        return router + 2.0 * tokens * top_k * (gate_up[0].numel() + down[0].numel())
    return 0.0


def compute_time(profile: OpProfile, hardware: HardwareProfile, needs_grad: bool, dtype: str = "float32") -> float:
    """Roofline time of one op's forward and (when a gradient flows) backward, with launch overhead.

    A memory-bound backward moves the bytes its profile counted (``backward_io_bytes``; as many
    as the forward where none were counted), at the bandwidth streaming kernels reach
    (:attr:`HardwareProfile.streaming_bandwidth`).
    """
    passes = 2 if needs_grad else 1
    flops = profile.forward_flops + (profile.backward_flops if needs_grad else 0.0)
    moved, widened = profile.io_bytes, profile.widened_bytes
    if needs_grad:
        moved += profile.backward_io_bytes or profile.io_bytes
        widened += profile.backward_widened_bytes if profile.backward_io_bytes else profile.widened_bytes
    memory_s = streaming_s(moved, hardware, widened)
    return maximum(flops / hardware.flops_per_s(dtype), memory_s) + passes * hardware.op_overhead_s


def streaming_s(nbytes: float, hardware: HardwareProfile, widened: float = 0.0) -> float:
    """Seconds memory-bound kernels take to move ``nbytes``, ``widened`` of them by widening casts,
    which eager torch runs at :attr:`HardwareProfile.widening_bandwidth` (on an H200 about half the
    rate of the narrowing cast: benchmarks/gpu.py)."""
    return (nbytes - widened) / hardware.streaming_bandwidth + widened / hardware.widening_bandwidth


def moves_no_data(target) -> bool:
    """Views (``view``, ``transpose``, ``expand``, ...), ``_unsafe_view`` (a reshape's view of a
    fresh copy) and export's checks of a tensor's metadata launch no kernel: autograd, the
    allocator and the host see them, the device does not."""
    return bool(getattr(target, "is_view", False)) or target in _NO_KERNEL


_NO_KERNEL = {torch.ops.aten._unsafe_view.default, torch.ops.aten._assert_tensor_metadata.default}


def maximum(*values):
    """``max``, kept open (``sympy.Max``) where a value is an expression in batch and
    sequence length (:mod:`symbolic`); plain numbers take the plain ``max``."""
    return max(values) if all(isinstance(v, (int, float)) for v in values) else sympy.Max(*values)


def minimum(*values):
    """``min``, kept open (``sympy.Min``) for expressions, as :func:`maximum`."""
    return min(values) if all(isinstance(v, (int, float)) for v in values) else sympy.Min(*values)


MEASURE_LIMIT_BYTES = 64 * 2**20  # larger ops are timed by the roofline: planning must stay light
_TIMES: dict[tuple, float | None] = {}


def measured_time(
    node: fx.Node, needs_grad: bool, profile: OpProfile, repeats: int = 7, cast: torch.dtype | None = None, wants=None
) -> float | None:
    """Seconds of one op's forward (and backward) on THIS machine, real tensors of its
    unsharded shapes (floating ones in ``cast`` when given), one thread: the fastest of
    ``repeats`` (load from others only adds).

    What Alpa does for the device it plans for: small ops and attention run far from the
    matmul roofline on a CPU. None for ops without work or larger than ``MEASURE_LIMIT_BYTES``.
    """
    signature = _signature(node, needs_grad, cast, wants)
    if signature is None or profile.io_bytes > MEASURE_LIMIT_BYTES:
        return None
    key, values, spec, grads = signature
    if key not in _TIMES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        # the caller's random stream stays as it was: planning runs on one rank, and ranks whose streams
        # differ would draw different dropout masks for what they compute alike
        with torch.random.fork_rng(devices=[]):
            args, kwargs = tree_unflatten([_real_like(v, grad, cast) for v, grad in zip(values, grads)], spec)
            try:
                _TIMES[key] = min([_time_once(node.target, args, kwargs, needs_grad) for _ in range(repeats + 2)][2:])
            except (RuntimeError, ValueError, IndexError, AssertionError):  # needs real data or its own dtype
                _TIMES[key] = None  # the roofline then
            finally:
                torch.set_num_threads(threads)
    return _TIMES[key]


def _real_like(value, needs_grad: bool, cast: torch.dtype | None = None):
    if not isinstance(value, torch.Tensor):
        return value
    span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()) if size > 0)
    storage = torch.zeros(span, dtype=compute_dtype(value.dtype, cast))  # zeros: valid indices and labels
    if value.dtype.is_floating_point:
        storage.normal_()
    tensor = storage.as_strided(value.shape, value.stride())  # broadcast (stride-0) views stay views
    return tensor.requires_grad_(needs_grad) if value.dtype.is_floating_point else tensor


def _time_once(target, args, kwargs, needs_grad: bool) -> float:
    start = time.perf_counter()
    out = target(*args, **kwargs)
    grads = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if needs_grad and grads:
        torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
    return time.perf_counter() - start


# Foreach AdamW moves about 80 bytes per fp32 parameter: its passes (lerp, mul, addcmul,
# weight decay, sqrt, div, add, addcdiv) read and write parameter, gradient and two moments.
OPTIMIZER_BYTES_PER_PARAM = 80
# Mixed precision's casts, once per step (runtime/mixed_precision.py): each fp32 master a rank
# holds is copied to 16 bits (4 bytes read, 2 written), each 16-bit gradient back to fp32 (2 + 4).
RECAST_BYTES_PER_PARAM = 12
CAST_BYTES_PER_GRAD = RECAST_BYTES_PER_PARAM / 2  # the widening half


def optimizer_time(
    elements: float, hardware: HardwareProfile, contention: float = 1.0, recast: float = 0.0, copied: float = 0.0
) -> float:
    """Seconds of one AdamW step over ``elements`` local parameters, of mixed precision's casts
    of the ``recast`` parameter elements this rank holds, and of ``copied`` more bytes moved:
    memory-bound, streaming as elementwise kernels do, the gradients' casts back to fp32 as
    widening casts (on an H200, foreach AdamW over 740 M parameters took 16.8 ms, this gives 15.4:
    benchmarks/gpu.py)."""
    nbytes = elements * OPTIMIZER_BYTES_PER_PARAM + recast * RECAST_BYTES_PER_PARAM + copied
    return streaming_s(nbytes, hardware, widened=recast * CAST_BYTES_PER_GRAD) * contention


# Gradient accumulation: each microbatch after a step's first adds its fp32 gradients into the
# step's (both read, one written), after mixed precision cast them from 16 bits (2 read, 4 written).
ACCUMULATE_BYTES_PER_GRAD = 12


def accumulation_s(
    elements: float, fact, zero: int, data_parallel: int, hardware: HardwareProfile, contention: float = 1.0
) -> float:
    """Seconds each microbatch after a step's first spends adding the gradient of a parameter of
    ``elements`` (this rank's before ZeRO) into the step's: the whole gradient, or under ZeRO-2/3
    its reduce-scattered 1/dp, after mixed precision's cast of the whole (on one H100, 4 sequences
    of a 1.7B model: about 40 ms of a 420 ms step, benchmarks/gpu.py). A stack that accumulates
    otherwise gives its bytes per element (``HardwareProfile.grad_accumulation_bytes``); a frozen
    parameter has no gradient to add."""
    if not fact.needs_grad:
        return 0.0
    if hardware.grad_accumulation_bytes is not None:
        return elements * hardware.grad_accumulation_bytes / hardware.streaming_bandwidth * contention
    added = elements / (data_parallel if zero >= 2 else 1)
    cast = elements * CAST_BYTES_PER_GRAD if recasts(fact.precision) else 0.0
    return streaming_s(added * ACCUMULATE_BYTES_PER_GRAD + cast, hardware, widened=cast) * contention


def param_state_bytes(elements: float, fact, data_parallel: int, zero: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state a device holds of a parameter of
    ``elements`` (:func:`autopar.ir.model_state_bytes`); a frozen one holds its weights alone."""
    state = model_state_bytes(elements, data_parallel=data_parallel, zero_stage=zero, precision=fact.precision)
    return state if fact.needs_grad else {**state, "grads": 0.0, "optimizer": 0.0}


def state_update_s(
    elements: float, fact, zero: int, data_parallel: int, hardware: HardwareProfile, contention: float = 1.0
) -> float:
    """Seconds the step spends updating a parameter of ``elements`` (this rank's before ZeRO;
    ``fact``: its :class:`~autopar.passes.cost.facts.NodeFacts`) after backward: AdamW over its
    1/dp under ZeRO, mixed precision's recast (of its 1/dp under ZeRO-3), and ZeRO-1/2's copies
    around the gather of the stepped weights (:func:`zero_copy_bytes`). A frozen parameter is
    never stepped, and its 16-bit copy, made once, stays valid."""
    if not fact.needs_grad:
        return 0.0
    recast = elements / (data_parallel if zero >= 3 else 1) if recasts(fact.precision) else 0.0
    copied = elements * zero_copy_bytes(zero, data_parallel, fact.master_bytes, hardware)
    stepped = elements / (data_parallel if zero else 1)
    return optimizer_time(stepped, hardware, contention, recast, copied)


def zero_copy_bytes(zero: int, data_parallel: int, master_bytes: int, hardware: HardwareProfile) -> float:
    """Bytes per element of a whole parameter that autopar's ZeRO-1/2 step copies
    (:class:`autopar.runtime.zero.layout.ZeroOptimizer`): under ZeRO-1 its gradient's chunk
    made contiguous, then the stepped chunks packed for the all-gather and the gathered weights
    unpacked into the whole parameter (read and written). None where the stack gathers into the
    parameters' own storage (``HardwareProfile.zero_gathers_in_place``)."""
    if zero not in (1, 2) or data_parallel <= 1 or hardware.zero_gathers_in_place:
        return 0.0
    gradient_chunk = 2 * master_bytes / data_parallel if zero == 1 else 0.0
    return 2 * master_bytes * (1 + 1 / data_parallel) + gradient_chunk


@functools.cache
def recasts(precision: str) -> bool:
    """Whether parameters kept under ``precision`` are recast every step (mixed precision)."""
    return PrecisionPolicy.of(precision).mixed
