"""Compute efficiency from shapes, on a GPU profile with kernel figures (``HardwareProfile.kernels``).

One rule per kind of kernel, each from published figures (see ``autopar/ir/hardware.py`` for the
numbers and their sources):

- GEMMs (:func:`gemm_efficiency`): the best fraction of peak a well-shaped GEMM reaches (the
  Maximum Achievable Matmul FLOPS table, stas00/ml-engineering) times three textbook losses from
  NVIDIA's Matrix Multiplication Background guide (DU-09799-001): *tile quantization* (the output
  is cut into Tm x Tn tiles, a partial tile costs a whole one), *wave quantization* (the tiles run
  in waves of one per SM; a partial last wave costs a whole one) and the tile's fixed prologue and
  epilogue against its main loop over k (``k / (k + k_fill)``). A GEMM also streams its operands
  and result through memory, which bounds thin GEMMs (:func:`gemm_seconds`); few tiles cannot keep
  the memory system busy either (DeepGEMM's M=64 rows).
- Attention (:func:`attention_rate`): the fused kernel's measured FLOP/s by sequence length and head
  size, causal or not (FlashAttention's forward + backward benchmark configuration), interpolated in
  log2 of the sequence and linearly in the head size, constant beyond the table's ends; then scaled
  by how well the call's blocks fill the GPU against the table's configuration (:func:`attention_fill`):
  one sequence over the few heads a tensor-parallel rank holds keeps a fraction of the table's rate.
- Streaming ops (:func:`streaming_seconds`): bytes over the achieved share of memory bandwidth.
- A mixture of experts op (:func:`experts_work`): its router's GEMM and one grouped GEMM per
  projection, a batch of E GEMMs over the rows routed to each expert, priced as GEMMs; its copies of
  the routed rows and its gated activation streamed.
- The chunked gated delta rule (:func:`recurrence_work`): its chunks' products, batched over every
  chunk of every head, priced as GEMMs; its inputs and output streamed.

Every function takes plain numbers or sympy expressions (costs symbolic in batch and sequence,
:mod:`symbolic`): ceilings, maxima and the interpolation stay open until a size is given.

    >>> from autopar.ir import get_profile
    >>> h100 = get_profile("h100-80gb")
    >>> round(gemm_efficiency(8192, 8192, 8192, "bfloat16", h100.kernels), 3)   # cuBLAS measured 0.804
    0.798
"""

from __future__ import annotations

import math
from bisect import bisect_right

import sympy
import torch

from autopar.ir import OP_NAMESPACE, HardwareProfile, KernelFigures
from autopar.passes.capture.recurrences import recurrence_op
from autopar.passes.cost.ops import maximum, minimum
from autopar.runtime.kernels.expert_parallel import first_expert_slot

aten = torch.ops.aten

# op → (slot of the left operand, slot of the right operand, whether the right one is stored [n, k])
GEMMS = {
    aten.linear.default: (0, 1, True),
    aten.mm.default: (0, 1, False),
    aten.addmm.default: (1, 2, False),
    aten.bmm.default: (0, 1, False),
    aten.baddbmm.default: (1, 2, False),
    aten.matmul.default: (0, 1, False),
}
ATTENTION = aten.scaled_dot_product_attention.default
EXPERTS = (f"{OP_NAMESPACE}::moe", f"{OP_NAMESPACE}::moe_experts")  # mixture of experts: router and experts, experts
BACKWARD_OVER_FORWARD = 2.5  # FlashAttention's FLOP convention: backward counts 2.5x the forward
ATTENTION_TILE = 128  # query (forward) or key (backward) rows one block of the fused kernel takes
TABLE_TOKENS, TABLE_HIDDEN = 16384, 2048  # the tables' configuration: batch x sequence, heads x head size
# How sharply a fused attention kernel's rate saturates as its blocks fill the GPU (the p of a smooth
# min(x, 1)): fitted to 32 attention measurements on one H200, median error 8% (benchmarks/gpu.py)
FILL_SHARPNESS = 1.5


def ceil_div(a, b):
    """⌈a / b⌉ for numbers, ``sympy.ceiling`` for an expression in batch and sequence."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.ceiling(sympy.sympify(a) / b)
    return math.ceil(a / b)


def gemm_efficiency(m, n, k, dtype: str, figures: KernelFigures, batch=1):
    """Fraction of peak FLOP/s a compute-bound (batch x) m x n x k GEMM reaches.

    ``best · useful · k / (k + k_fill)``, where ``useful`` is the share of the tile slots its
    waves occupy that hold real output: m·n·batch / (waves · SMs · Tm · Tn), with
    ⌈m/Tm⌉·⌈n/Tn⌉·batch tiles in ⌈tiles / SMs⌉ waves (tile and wave quantization). The library
    picks among its tile shapes; taken here as the one that wastes least, every shape at the same
    main-loop efficiency (an upper bound for the smaller tiles).

    >>> from autopar.ir import get_profile
    >>> a100 = get_profile("a100-80gb").kernels
    >>> round(gemm_efficiency(1024, 10240, 5120, "bfloat16", a100), 3)   # the MAMF shape: 271.2 of 312
    0.869
    """
    best = figures.gemm_best.get(dtype, figures.gemm_best.get("bfloat16", 1.0))
    return best * shape_factor(m, n, k, figures, batch)


def shape_factor(m, n, k, figures: KernelFigures, batch=1):
    """What the shape keeps of the best efficiency: tile and wave quantization times the main
    loop's share ``k / (k + k_fill)`` (see :func:`gemm_efficiency`)."""
    useful = maximum(*(_useful(m, n, batch, tile, figures.sms) for tile in figures.tiles))
    return useful * k / (k + figures.k_fill)


def _useful(m, n, batch, tile: tuple[int, int], sms: int):
    rows, cols = tile
    waves = ceil_div(batch * ceil_div(m, rows) * ceil_div(n, cols), sms)
    return batch * m * n / (waves * sms * rows * cols)


def gemm_seconds(m, n, k, dtype: str, itemsize: int, hardware: HardwareProfile, batch=1):
    """Seconds of one (batch x) m x n x k GEMM: the slower of its FLOPs at :func:`gemm_efficiency`
    and streaming A, B and C once through memory, plus one launch.

    Streaming runs at the figures' share of bandwidth, less when fewer tiles than SMs are in flight.
    """
    figures = hardware.kernels
    flops = 2 * batch * m * n * k
    compute = flops / (_peak(hardware, dtype) * gemm_efficiency(m, n, k, dtype, figures, batch))
    rows, cols = min(figures.tiles, key=lambda tile: tile[0] * tile[1])
    busy = minimum(1, batch * ceil_div(m, rows) * ceil_div(n, cols) / figures.sms)
    streamed = itemsize * batch * (m * k + k * n + m * n)
    memory = streamed / (hardware.memory_bandwidth * figures.memory_efficiency * busy)
    return maximum(compute, memory) + hardware.op_overhead_s


def attention_rate(seq, head_dim, causal: bool, figures: KernelFigures):
    """FLOP/s of the fused attention kernel's forward + backward, in FlashAttention's convention
    (forward 4·b·h·s²·d, halved when causal; backward 2.5x the forward).

    >>> from autopar.ir import get_profile
    >>> attention_rate(4096, 128, True, get_profile("a100-80gb").kernels) / 1e12
    173.0
    """
    by_dim = figures.attention["causal" if causal else "full"]
    dims = sorted(by_dim)
    if isinstance(head_dim, sympy.Basic):
        raise TypeError("the head size is a weight dim: it never depends on batch or sequence")
    if head_dim <= dims[0] or head_dim >= dims[-1]:
        return _along_sequence(seq, by_dim[dims[0] if head_dim <= dims[0] else dims[-1]])
    upper = dims[bisect_right(dims, head_dim)]
    lower = dims[bisect_right(dims, head_dim) - 1]
    share = (head_dim - lower) / (upper - lower)
    return (1 - share) * _along_sequence(seq, by_dim[lower]) + share * _along_sequence(seq, by_dim[upper])


def _along_sequence(seq, rates: dict[int, float]):
    """The rate at ``seq``: linear in log2 of the sequence between measured lengths, flat outside."""
    points = sorted(rates.items())
    if not isinstance(seq, sympy.Basic):
        if seq <= points[0][0]:
            return points[0][1]
        if seq >= points[-1][0]:
            return points[-1][1]
        index = bisect_right([s for s, _ in points], seq)
        (s0, r0), (s1, r1) = points[index - 1], points[index]
        return r0 + (r1 - r0) * math.log2(seq / s0) / math.log2(s1 / s0)
    pieces = [(points[0][1], seq <= points[0][0])]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        pieces.append((r0 + (r1 - r0) * sympy.log(seq / s0, 2) / math.log2(s1 / s0), seq <= s1))
    pieces.append((points[-1][1], True))
    return sympy.Piecewise(*pieces)


def attention_fill(batch_heads, seq, causal: bool, sms: int):
    """Share of its steady rate fused attention over ``batch_heads`` (batch x heads) sequences of
    ``seq`` keeps: a block per tile of ATTENTION_TILE queries, one block per SM at a time, and a
    causal block's work grows with its position (the last does all ``n`` steps, the first one), so
    with few blocks the longest sets the time. With ``x`` the work per SM in units of the longest
    block (causal: batch_heads·(n + 1) / (2·SMs); full: batch_heads·n / SMs), the share is a
    smooth min(x, 1).

    >>> round(attention_fill(8, 4096, True, 132), 2)    # a tp-8 rank's 8 heads of one 4k sequence
    0.63
    """
    n = ceil_div(seq, ATTENTION_TILE)
    x = batch_heads * ((n + 1) / 2 if causal else n) / sms
    return x / (1 + x**FILL_SHARPNESS) ** (1 / FILL_SHARPNESS)


def attention_seconds(batch_heads, seq_q, seq_k, head_dim, causal: bool, hardware: HardwareProfile, needs_grad: bool):
    """Seconds of fused attention over ``batch_heads`` (batch x heads) query blocks: its FLOPs in
    FlashAttention's convention over :func:`attention_rate` at the key length, as much of it as the
    blocks fill the GPU against the table's configuration (:func:`attention_fill`), plus launches."""
    forward = 4 * batch_heads * seq_q * seq_k * head_dim * (0.5 if causal else 1.0)
    flops = forward * (1 + BACKWARD_OVER_FORWARD if needs_grad else 1.0)
    launches = 2 if needs_grad else 1
    figures = hardware.kernels
    table_heads = maximum(1, TABLE_TOKENS / seq_k) * TABLE_HIDDEN / head_dim
    fill = attention_fill(batch_heads, seq_q, causal, figures.sms) / attention_fill(
        table_heads, seq_k, causal, figures.sms
    )
    return flops / (attention_rate(seq_k, head_dim, causal, figures) * fill) + launches * hardware.op_overhead_s


def streaming_seconds(nbytes, hardware: HardwareProfile):
    """Seconds to stream ``nbytes`` through memory at the achieved share of its bandwidth."""
    share = hardware.kernels.memory_efficiency if hardware.kernels else 1.0
    return nbytes / (hardware.memory_bandwidth * share)


def gemm_dims(target, slot_shapes) -> tuple | None:
    """(batch, m, n, k) of a GEMM op's forward from its input shapes, or None for other ops."""
    if target not in GEMMS:
        return None
    left, right, stored_nk = GEMMS[target]
    if len(slot_shapes) <= max(left, right):
        return None
    a, b = slot_shapes[left], slot_shapes[right]
    if len(a) < 2 or len(b) < 2:
        return None
    if stored_nk:  # linear: x [..., k] @ w[n, k]ᵀ
        return 1, math.prod(a[:-1]), b[0], a[-1]
    if len(b) == 2:  # x [..., m, k] @ w [k, n]: the leading dims are more rows
        return 1, math.prod(a[:-1]), b[1], a[-1]
    return math.prod(a[:-2]), a[-2], b[-1], a[-1]


def gemm_list(dims: tuple, needs_grad: bool, grads: tuple[bool, bool] = (True, True)) -> list[tuple]:
    """The (batch, m, n, k) GEMMs a matmul runs: its forward, and with a gradient the backward
    products of the inputs ``grads`` says need one (left, right: the input gradient m x k over n,
    the weight gradient n x k over m, as cuBLAS lays them; a frozen weight has none)."""
    batch, m, n, k = dims
    backward = [g for g, wanted in zip([(batch, m, k, n), (batch, n, k, m)], grads) if wanted]
    return [(batch, m, n, k)] + (backward if needs_grad else [])


def shaped_seconds(
    target,
    slot_shapes,
    hardware,
    dtype: str,
    itemsize: int,
    needs_grad: bool,
    causal: bool = False,
    pieces: int = 1,
    grads: tuple[bool, bool] = (True, True),
    top_k: int = 1,
    chunk: int = 64,
):
    """Seconds of a GEMM's, attention's or mixture of experts' forward (+ backward) at these input
    shapes, its batch run in ``pieces`` microbatches one after another; None for any other op.

    A microbatch divides the rows of a GEMM's activation (the m of x @ wᵀ, or the batch count of a
    batched product), the batch of attention and an experts op's tokens; weights keep their shapes.
    ``grads``: which of a GEMM's two inputs get a gradient (:func:`gemm_list`); ``top_k``: experts
    per token of an experts op; ``chunk``: the steps per chunk of a gated delta rule.
    """
    dims = gemm_dims(target, slot_shapes)
    if dims is not None:
        batch, m, n, k = dims
        batch, m = (batch / pieces, m) if batch != 1 else (batch, m / pieces)
        gemms = gemm_list((batch, m, n, k), needs_grad, grads)
        return pieces * sum(gemm_seconds(mm, nn, kk, dtype, itemsize, hardware, bb) for bb, mm, nn, kk in gemms)
    if target is ATTENTION and len(slot_shapes) >= 3:
        q, k = slot_shapes[0], slot_shapes[1]
        heads = math.prod(q[:-2]) / pieces
        return pieces * attention_seconds(heads, q[-2], k[-2], q[-1], causal, hardware, needs_grad)
    work = _composite_work(target, slot_shapes, top_k, chunk, needs_grad, pieces)
    if work is not None:
        gemms, streamed = work
        seconds = sum(gemm_seconds(mm, nn, kk, dtype, itemsize, hardware, bb) for bb, mm, nn, kk in gemms)
        return pieces * (seconds + streaming_seconds(streamed * itemsize, hardware))
    return None


def _composite_work(target, slot_shapes, top_k: int, chunk: int, needs_grad: bool, pieces: int = 1):
    """(the (batch, m, n, k) GEMMs, the elements streamed) of a mixture of experts op or a gated
    delta rule; None for any other op."""
    experts = experts_work(target, slot_shapes, top_k, needs_grad, pieces)
    return experts if experts is not None else recurrence_work(target, slot_shapes, chunk, needs_grad, pieces)


def experts_work(target, slot_shapes, top_k: int, needs_grad: bool, pieces: int = 1):
    """(the (batch, m, n, k) GEMMs, the elements streamed) of one microbatch of a mixture of experts
    op (``autopar::moe``, ``autopar::moe_experts``) at these input shapes, or None for another op.

    x [T, H] through ``top_k`` of the E local experts each, evenly routed: T·top_k/E rows per
    expert, so a grouped GEMM of E GEMMs per projection (gate-up: 2F of H, down: H of F), after the
    router's T x E over H (``moe``). Where experts and tokens split over one axis (expert
    parallelism) the rows per expert stay the whole batch's: T/p·top_k/(E/p). Streamed: each routed
    row copied in and out (2H) and the gated activation reading its gate and up halves and writing
    their product (3F). With a gradient, backward runs the experts' forward again (the op keeps no
    routed activations) and each GEMM's input and weight gradients (the router's too), streaming
    twice the forward's elements.
    """
    if not experts_op(target):
        return None
    first = first_expert_slot(target)
    x, gate_up, down = slot_shapes[0], slot_shapes[first], slot_shapes[first + 1]
    tokens, hidden = x[0] / pieces, x[-1]
    experts = gate_up[0]
    rows = tokens * top_k / experts
    up, width = math.prod(gate_up[1:]) // hidden, math.prod(down[1:]) // hidden  # 2F, F
    experts_forward = [(experts, rows, up, hidden), (experts, rows, hidden, width)]
    router = [(1, tokens, slot_shapes[1][0], hidden)] if target.name().endswith("::moe") else []
    streamed = tokens * top_k * (2 * hidden + 3 * width)
    if not needs_grad:
        return router + experts_forward, streamed
    backward = [g for dims in router + experts_forward for g in gemm_list(dims, True)[1:]]
    return router + 2 * experts_forward + backward, 3 * streamed


def recurrence_work(target, slot_shapes, chunk: int, needs_grad: bool, pieces: int = 1):
    """(the (batch, m, n, k) GEMMs, the elements streamed) of one microbatch of a chunked gated delta
    rule (``autopar::gated_delta_rule``) at these input shapes, or None for another op.

    q, k [B, T, Hk, Dk] and v [B, T, H, Dv] (key heads repeated to H) cut into T/C chunks of C steps,
    each chunk of each head: the decayed key products k·kᵀ and q·kᵀ (C x C over Dk), the triangular
    system's solve against the values and keys (C x Dv and C x Dk over C), the state [Dk, Dv] read by
    the chunk's keys and queries (C x Dv over Dk, twice), the chunk's attention over its corrected
    values (C x Dv over C) and the state's update (Dk x Dv over C). Priced as GEMMs batched over
    every chunk of every head: a fused kernel (flash-linear-attention's) carries the state from chunk
    to chunk inside one launch, and that chain's latency is not priced. It streams only the inputs
    and the output. With a gradient, backward runs the forward again and both gradients of each
    product.
    """
    if not recurrence_op(target):
        return None
    (batch, steps, _, dk), (_, _, heads, dv) = slot_shapes[0], slot_shapes[2]
    blocks = batch / pieces * heads * ceil_div(steps, chunk)  # (head, chunk) pairs
    products = [(chunk, chunk, dk)] * 2 + [(chunk, dv, chunk), (chunk, dk, chunk)]  # within the chunk
    products += [(chunk, dv, dk)] * 2 + [(chunk, dv, chunk), (dk, dv, chunk)]  # with the state
    forward = [(blocks, m, n, k) for m, n, k in products]
    streamed = batch / pieces * heads * steps * (2 * dk + 2 * dv + 2)  # q, k, v, g, beta in; the output out
    if not needs_grad:
        return forward, streamed
    backward = [g for dims in forward for g in gemm_list(dims, True)[1:]]
    return 2 * forward + backward, 3 * streamed


def experts_op(target) -> bool:
    """Whether ``target`` is a mixture of experts op (:data:`EXPERTS`)."""
    return isinstance(target, torch._ops.OpOverload) and target.name() in EXPERTS


def work_units(target, slot_shapes, top_k: int = 1, chunk: int = 64):
    """How much work a GEMM, attention, experts op (``top_k`` experts per token) or gated delta rule
    (``chunk`` steps per chunk) does at these shapes, in any unit that is proportional to its FLOPs
    (multiply-adds of the forward); 0 for other ops."""
    dims = gemm_dims(target, slot_shapes)
    if dims is not None:
        return math.prod(dims)
    if target is ATTENTION and len(slot_shapes) >= 3 and len(slot_shapes[0]) >= 2:
        q, k = slot_shapes[0], slot_shapes[1]
        return math.prod(q[:-2]) * q[-2] * k[-2] * q[-1]
    work = _composite_work(target, slot_shapes, top_k, chunk, False)
    if work is not None:
        return sum(math.prod(dims) for dims in work[0])
    return 0


def _peak(hardware: HardwareProfile, dtype: str):
    return hardware.peak_flops.get(dtype, hardware.peak_flops["float32"])
