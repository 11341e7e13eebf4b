"""Expert parallelism: a mixture-of-experts layer as one custom op, ``autopar::moe`` (router
and experts), or its experts alone as ``autopar::moe_experts`` (routed by the model's own ops).

Capture (``passes/capture/moe.py``) turns every MoE block into one call of this op, so the graph holds
no data-dependent routing; the rewrite only changes ``group_name`` and hands the op this rank's
slice of the expert weights. The math is Mixtral's (``MixtralSparseMoeBlock``):

    logits = x @ router_weightᵀ                       [T, E]
    probs  = softmax(logits) (in fp32); the top_k experts per token by probability,
             their probabilities renormalized to sum to 1 if ``normalize``
    out[t] = Σ_j weight[t, j] · (down[e] @ glu(gate_up[e] @ x[t] + gate_up_bias[e]) + down_bias[e])
             with e the token's j-th expert; glu is the op's ``activation`` (``expert_activations.py``:
             SwiGLU's ``silu(g) · u`` on the halves g, u for Mixtral), the biases GPT-OSS's (None: 0).

``group_name == ""``: every expert is local (the single-process meaning, also used by plain
data parallelism). With an EP group of P ranks, rank r holds experts [r·E/P, (r+1)·E/P) and
only its own tokens: it routes them, sends each kept (token, expert) slot to the expert's owner
with an all-to-all of uneven splits (gloo supports them; the counts go first, in their own
all-to-all), runs its experts one matmul per expert on the rows it received, and returns the
rows by the reverse all-to-all, where they are weighted and summed per token. A token whose
two experts live on one rank is sent twice.

Capacity (``capacity_factor > 0``, GShard-style dropping): each expert takes at most
``C = ceil(capacity_factor · T · top_k / E)`` slots from ONE rank's T tokens, in the order
"every token's first choice, then every token's second choice, ..." (token order inside a
choice). A slot over capacity contributes 0; its weight is not renormalized. Dropping is decided
by the sending rank, before dispatch, so EP equals the single-process op run on each rank's
batch separately (an expert then receives up to P·C rows). ``capacity_factor <= 0`` is dropless.

Gradients. ``backward`` of the local loss gives, on each rank:
- ``x`` and ``router_weight``: the gradient of this rank's local loss, as without EP;
- ``gate_up`` and ``down`` (the local experts): Σ over ALL ranks q of d(loss_q)/dW, summed
  over the tokens of rank q routed to these experts, because the combine all-to-all's backward
  brings every rank's output gradient to the owner. If the training loss is the mean of the P
  rank-local mean losses, divide the expert gradients by P (and do not all-reduce them over the
  EP group: each expert lives on one rank of it); the router weight's gradient is all-reduced
  over the group like any replicated parameter's.

Backward recomputes the experts' forward (routed activations, as many as the data decides, are
not kept: a fixed-shape op cannot return them): it sends each slot's input and output gradient
to its owner and gets back the input and gate-weight gradients (``cost.kernels.dispatch_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.kernels.expert_activations import gated_activation, gated_activation_vjp


@dataclass(frozen=True)
class _Routing:
    """Which experts each token goes to, and with what weights (fp32)."""

    probs: Tensor  # [T, E] softmax of the router logits
    top_probs: Tensor  # [T, k] the chosen experts' probabilities
    weights: Tensor  # [T, k] the combine weights (top_probs, renormalized if asked)
    experts: Tensor  # [T, k] chosen expert ids
    keep: Tensor  # [T, k] False where a slot is over its expert's capacity


@dataclass(frozen=True)
class _Dispatch:
    """Where the kept slots go and how the received rows group by local expert."""

    slots: Tensor  # kept slot ids (t·k + j) in send order: sorted by expert, so by owner rank
    send_splits: list[int]  # rows to each group rank
    recv_splits: list[int]  # rows from each group rank
    by_expert: Tensor  # permutation of the received rows that groups them by local expert
    expert_rows: list[int]  # rows per local expert, in that grouped order


def first_expert_slot(target) -> int:
    """Where an op's expert tensors (gate_up, down, their biases) start among its tensor inputs:
    after x and the router weight (``moe``), x, the weights and the ids (``moe_experts``)."""
    return 3 if "moe_experts" in str(target) else 2


def _group(group_name: str):
    return _resolve_process_group(group_name) if group_name else None


def _check_shapes(x, router_weight, gate_up, down, top_k: int, group, gate_up_bias=None, down_bias=None) -> None:
    if x.dim() != 2 or router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"moe needs x [tokens, hidden] and router_weight [experts, hidden], got {tuple(x.shape)} "
            f"and {tuple(router_weight.shape)}: flatten batch and sequence into tokens first"
        )
    _check_experts(router_weight.shape[0], x.shape[1], gate_up, down, top_k, group, gate_up_bias, down_bias)


def _check_experts(experts: int, hidden: int, gate_up, down, top_k: int, group, *biases) -> None:
    group_size = _size(group)
    if experts % group_size:
        raise ValueError(
            f"{experts} experts cannot be split over an EP group of {group_size} ranks; "
            "choose an ep degree that divides the number of experts"
        )
    local = experts // group_size
    ffn = down.shape[-1] if down.dim() == 3 else -1
    if gate_up.shape != (local, 2 * ffn, hidden) or down.shape != (local, hidden, ffn):
        raise ValueError(
            f"with {experts} experts over {group_size} ranks, moe needs gate_up [{local}, 2·ffn, {hidden}] "
            f"and down [{local}, {hidden}, ffn], got {tuple(gate_up.shape)} and {tuple(down.shape)}: pass this "
            "rank's slice of the stacked expert weights"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts, {experts}")
    for name, bias, shape in zip(("gate_up_bias", "down_bias"), biases, (gate_up.shape[:2], down.shape[:2])):
        if bias is not None and bias.shape != shape:
            raise ValueError(
                f"the experts' {name} must be [{', '.join(map(str, shape))}] (this rank's experts, then their "
                f"outputs), got {tuple(bias.shape)}"
            )


def _route(logits: Tensor, top_k: int, normalize: bool, capacity_factor: float) -> _Routing:
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    weights = top_probs / top_probs.sum(-1, keepdim=True) if normalize else top_probs
    keep = _under_capacity(experts, probs.shape[1], capacity_factor)
    return _Routing(probs, top_probs, weights, experts, keep)


def _under_capacity(experts: Tensor, num_experts: int, capacity_factor: float) -> Tensor:
    """Keep the first C slots of each expert in (choice, token) order; all of them if dropless."""
    if capacity_factor <= 0:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, top_k = experts.shape
    capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
    hits = F.one_hot(experts.t().reshape(-1), num_experts)  # slots in (choice, token) order
    position = (hits.cumsum(0) * hits).sum(-1) - 1  # how many earlier slots chose the same expert
    return (position < capacity).view(top_k, tokens).t()


def _plan_dispatch(experts: Tensor, keep: Tensor, num_experts: int, group) -> _Dispatch:
    """Where each kept slot of ``experts`` [T, k] (expert ids, of ``num_experts`` in all) goes."""
    group_size = _size(group)
    local = num_experts // group_size
    # dropped slots get the key num_experts, so a stable sort puts them last, in token order
    key = torch.where(keep, experts, num_experts).reshape(-1)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    slots = torch.argsort(key, stable=True)[: int(counts.sum())]
    sent = counts.view(group_size, local)  # [owner rank, its local expert]
    received = sent.clone()
    if group is not None:
        dist.all_to_all_single(received.view(-1), sent.reshape(-1), group=group)
    # received rows come by source rank, then by expert: group them by expert, stably
    expert_of_row = torch.arange(local, device=key.device).repeat(group_size).repeat_interleave(received.reshape(-1))
    return _Dispatch(
        slots=slots,
        send_splits=sent.sum(1).tolist(),
        recv_splits=received.sum(1).tolist(),
        by_expert=torch.argsort(expert_of_row, stable=True),
        expert_rows=received.sum(0).tolist(),
    )


def _exchange(rows: Tensor, send_splits: list[int], recv_splits: list[int], group) -> Tensor:
    """Rows to their ranks (``send_splits`` per rank, in rank order): all-to-all of uneven splits."""
    if group is None:
        return rows
    received = rows.new_empty((sum(recv_splits), rows.shape[1]))
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group)
    return received


def _to_experts(rows: Tensor, plan: _Dispatch, group) -> Tensor:
    """Dispatch: slot rows (send order) → this rank's rows grouped by local expert."""
    return _exchange(rows, plan.send_splits, plan.recv_splits, group)[plan.by_expert]


def _from_experts(rows: Tensor, plan: _Dispatch, group) -> Tensor:
    """Combine: rows grouped by local expert → their slots' ranks, in send order."""
    ungrouped = torch.empty_like(rows)
    ungrouped[plan.by_expert] = rows
    return _exchange(ungrouped, plan.recv_splits, plan.send_splits, group)


@dataclass(frozen=True)
class _Experts:
    """This rank's experts: ``gate_up`` [E_local, 2F, H], ``down`` [E_local, H, F], their biases
    [E_local, 2F] and [E_local, H] or None, the gated activation between them, and whether a slot's
    weight scales the token going in (Llama 4's) rather than the expert's output."""

    gate_up: Tensor
    down: Tensor
    gate_up_bias: Tensor | None
    down_bias: Tensor | None
    activation: str  # its name (expert_activations.py)
    weighted_inputs: bool = False

    def project(self, expert: int, rows: Tensor) -> Tensor:
        return F.linear(rows, self.gate_up[expert], None if self.gate_up_bias is None else self.gate_up_bias[expert])

    def output(self, expert: int, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.down[expert], None if self.down_bias is None else self.down_bias[expert])


def _experts_forward(rows: Tensor, experts: _Experts, expert_rows: list[int]) -> Tensor:
    glu = gated_activation(experts.activation)
    return torch.cat([experts.output(e, glu(experts.project(e, x))) for e, x in enumerate(rows.split(expert_rows))])


def _experts_backward(rows, grads, weights, experts: _Experts, expert_rows):
    """Recompute each expert on its rows and return (dx rows, d weight rows, d gate_up, d down,
    d gate_up bias, d down bias: empty where the experts have none).

    ``grads`` are the tokens' output gradients, ``weights`` the slots' combine weights: the
    expert's output y enters the loss as weight · y, so d weight = ⟨grad, y⟩ and dy = weight · grad.
    The activation's gradient is :func:`gated_activation_vjp`'s (autograd does not record inside an
    op). One expert's rows at a time: on the CPU they stay in cache (whole-batch elementwise ops
    and the joins they need took 1.6x as long).
    """
    d_gate_up, d_down = (w.new_zeros(w.shape) for w in (experts.gate_up, experts.down))  # contiguous as the fakes
    activation_vjp = gated_activation_vjp(experts.activation)
    d_biases = [
        rows.new_empty(0) if b is None else b.new_zeros(b.shape) for b in (experts.gate_up_bias, experts.down_bias)
    ]
    d_rows, d_weights = [], []
    for e, (x, grad, weight) in enumerate(
        zip(rows.split(expert_rows), grads.split(expert_rows), weights.split(expert_rows))
    ):
        hidden, glu_vjp = activation_vjp(experts.project(e, x))
        d_weights.append((grad * experts.output(e, hidden)).sum(-1))
        d_out = grad * weight[:, None]
        d_down[e] = d_out.t() @ hidden
        d_projected = glu_vjp(d_out @ experts.down[e])
        d_gate_up[e] = d_projected.t() @ x
        for d_bias, d in zip(d_biases, (d_projected, d_out)):
            if d_bias.numel():
                d_bias[e] = d.sum(0)
        d_rows.append(d_projected @ experts.gate_up[e])
    return torch.cat(d_rows), torch.cat(d_weights), d_gate_up, d_down, *d_biases


@torch.library.custom_op("autopar::moe", mutates_args=())
def moe(
    x: Tensor,
    router_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    top_k: int,
    normalize: bool,
    capacity_factor: float,
    activation: str,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    group_name: str,
) -> tuple[Tensor, Tensor]:
    """A mixture-of-experts layer on ``x`` [T, H]: ``(out [T, H], router_logits [T, E])``.

    ``gate_up`` [E_local, 2F, H] (gate rows, then up rows) and ``down`` [E_local, H, F] are this
    rank's experts, ``activation`` their gated activation (``expert_activations.py``), the biases
    [E_local, 2F] and [E_local, H] or None; ``group_name`` is the EP group ("" for none). See the
    module docstring for the math, capacity and gradient semantics. Example::

        out, logits = torch.ops.autopar.moe(x, router.weight, gate_up, down, 2, True, 0.0, "silu", None, None, "")
    """
    group = _group(group_name)
    _check_shapes(x, router_weight, gate_up, down, top_k, group, gate_up_bias, down_bias)
    logits = F.linear(x, router_weight)
    routing = _route(logits, top_k, normalize, capacity_factor)
    experts = _Experts(gate_up, down, gate_up_bias, down_bias, activation)
    return _combine(x, routing.experts, routing.keep, routing.weights, experts, group), logits


def _combine(x: Tensor, chosen: Tensor, keep: Tensor, weights: Tensor, experts: _Experts, group) -> Tensor:
    """Σ_j weights[t, j] · expert_j(x[t]) for the kept slots (Σ_j expert_j(weights[t, j] · x[t])
    with weighted inputs), each slot's row sent to its expert's owner."""
    (tokens, hidden), top_k = x.shape, chosen.shape[1]
    plan = _plan_dispatch(chosen, keep, experts.gate_up.shape[0] * _size(group), group)
    rows = x[plan.slots // top_k]
    if experts.weighted_inputs:
        rows = rows * weights.reshape(-1)[plan.slots].to(x.dtype)[:, None]
        weights = torch.ones_like(weights)
    returned = _from_experts(_experts_forward(_to_experts(rows, plan, group), experts, plan.expert_rows), plan, group)
    slot_outputs = x.new_zeros((tokens * top_k, hidden))
    slot_outputs[plan.slots] = returned
    return (weights.to(x.dtype).unsqueeze(-1) * slot_outputs.view(tokens, top_k, hidden)).sum(1)


def _combine_backward(grad_out, x, chosen, keep, weights, experts: _Experts, group):
    """(d x, d weights [T, k] in fp32, and the experts' gradients as :func:`_experts_backward`
    gives them) of :func:`_combine`: each kept slot's input row, output gradient and weight go to
    the expert's owner, which recomputes the expert and sends back the input gradient and the
    weight's gradient (the reverse all-to-all)."""
    (tokens, hidden), top_k = x.shape, chosen.shape[1]
    plan = _plan_dispatch(chosen, keep, experts.gate_up.shape[0] * _size(group), group)
    token_of_slot = plan.slots // top_k
    rows, slot_weights = x[token_of_slot], weights.reshape(-1)[plan.slots].to(x.dtype)
    sent = [rows, slot_weights]
    if experts.weighted_inputs:  # the expert takes w·x and its output counts once
        sent = [rows * slot_weights[:, None], torch.ones_like(slot_weights)]
    received = _to_experts(torch.cat([sent[0], grad_out[token_of_slot], sent[1][:, None]], dim=1), plan, group)
    d_rows, d_weight_rows, *d_experts = _experts_backward(
        received[:, :hidden], received[:, hidden:-1], received[:, -1], experts, plan.expert_rows
    )
    returned = _from_experts(torch.cat([d_rows, d_weight_rows[:, None]], dim=1), plan, group)
    d_rows, d_slot_weights = returned[:, :hidden], returned[:, -1]
    if experts.weighted_inputs:  # d(w·x): dx = w · d row, dw = ⟨d row, x⟩
        d_rows, d_slot_weights = d_rows * slot_weights[:, None], (d_rows * rows).sum(-1)
    d_x = x.new_zeros(x.shape).index_add_(0, token_of_slot, d_rows)
    d_weights = weights.new_zeros(tokens * top_k, dtype=torch.float32)
    d_weights[plan.slots] = d_slot_weights.float()
    return d_x, d_weights.view(tokens, top_k), *d_experts


def _size(group) -> int:
    return group.size() if group is not None else 1


@moe.register_fake
def _(x, router_weight, gate_up, down, top_k, normalize, capacity_factor, activation, gate_up_bias, down_bias, group):
    _check_shapes(x, router_weight, gate_up, down, top_k, _group(group), gate_up_bias, down_bias)
    gated_activation(activation)  # an unknown name fails at capture, named
    return x.new_empty(x.shape), x.new_empty((x.shape[0], router_weight.shape[0]))


BackwardGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # the bias gradients empty where none


@torch.library.custom_op("autopar::moe_backward", mutates_args=())
def moe_backward(
    grad_out: Tensor,
    grad_logits: Tensor,
    x: Tensor,
    router_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    router_logits: Tensor,
    top_k: int,
    normalize: bool,
    capacity_factor: float,
    activation: str,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    group_name: str,
) -> BackwardGrads:
    """Gradients of :func:`moe` for x, router_weight, gate_up, down and the biases (what its
    autograd calls; a bias the experts lack gets an empty one).

    Routing is recomputed from the saved ``router_logits``; the experts' part is :func:`_combine_backward`.
    """
    routing = _route(router_logits, top_k, normalize, capacity_factor)
    experts = _Experts(gate_up, down, gate_up_bias, down_bias, activation)
    d_x, d_weights, *d_experts = _combine_backward(
        grad_out, x, routing.experts, routing.keep, routing.weights, experts, _group(group_name)
    )
    if normalize:  # w = v / Σv  ⇒  dv = (dw − Σ_j dw_j·w_j) / Σv
        d_weights = (d_weights - (d_weights * routing.weights).sum(-1, keepdim=True)) / routing.top_probs.sum(
            -1, keepdim=True
        )
    d_probs = torch.zeros_like(routing.probs).scatter_(1, routing.experts, d_weights)
    d_logits = routing.probs * (d_probs - (d_probs * routing.probs).sum(-1, keepdim=True))
    d_logits = d_logits.to(x.dtype) + grad_logits
    return d_x + d_logits @ router_weight, d_logits.t() @ x, *d_experts


@moe_backward.register_fake
def _(grad_out, grad_logits, x, router_weight, gate_up, down, router_logits, *options):
    gate_up_bias, down_bias = options[-3:-1]
    return (
        *(t.new_empty(t.shape) for t in (x, router_weight, gate_up, down)),
        *_bias_grads(x, gate_up_bias, down_bias),
    )


def _bias_grads(x: Tensor, *biases) -> list[Tensor]:
    return [x.new_empty(0) if b is None else b.new_empty(b.shape) for b in biases]


def _save_for_backward(ctx, inputs, output):
    x, router_weight, gate_up, down, *options, gate_up_bias, down_bias, group_name = inputs
    ctx.save_for_backward(x, router_weight, gate_up, down, output[1], gate_up_bias, down_bias)
    ctx.options, ctx.group_name = options, group_name


def _moe_autograd(ctx, grad_out, grad_logits):
    x, router_weight, gate_up, down, router_logits, gate_up_bias, down_bias = ctx.saved_tensors
    grad_out = torch.zeros_like(x) if grad_out is None else grad_out
    grad_logits = torch.zeros_like(router_logits) if grad_logits is None else grad_logits
    *grads, d_gate_up_bias, d_down_bias = moe_backward(
        grad_out, grad_logits, x, router_weight, gate_up, down, router_logits, *ctx.options,
        gate_up_bias, down_bias, ctx.group_name,
    )  # fmt: skip
    biases = _present(d_gate_up_bias, gate_up_bias), _present(d_down_bias, down_bias)
    return (*grads, None, None, None, None, *biases, None)


def _present(grad: Tensor, bias: Tensor | None) -> Tensor | None:
    return None if bias is None else grad


moe.register_autograd(_moe_autograd, setup_context=_save_for_backward)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    weights: Tensor,
    chosen: Tensor,
    gate_up: Tensor,
    down: Tensor,
    capacity_factor: float,
    activation: str,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    weighted_inputs: bool,
    group_name: str,
) -> Tensor:
    """The experts of a mixture-of-experts layer routed by the model's own router: ``out`` [T, H]
    = Σ_j weights[t, j] · expert ``chosen[t, j]`` (x[t]), for ``weights`` and ``chosen`` [T, k]
    (the combine weights, the expert ids) computed as ordinary ops before it (DeepSeek-V3's
    grouped sigmoid routing, for one); with ``weighted_inputs`` Σ_j expert ``chosen[t, j]``
    (weights[t, j] · x[t]) (Llama 4's). Experts, dispatch, capacity and expert gradients as
    :func:`moe`; ``weights`` gets its gradient, ``chosen`` none. Example::

        out = torch.ops.autopar.moe_experts(x, top_weights, top_ids, gate_up, down, 0.0, "silu", None, None, False, "")
    """
    group = _group(group_name)
    _check_routed(x, weights, chosen, gate_up, down, group, gate_up_bias, down_bias)
    experts = _Experts(gate_up, down, gate_up_bias, down_bias, activation, weighted_inputs)
    return _combine(x, chosen, _kept(chosen, gate_up, capacity_factor, group), weights, experts, group)


def _kept(chosen: Tensor, gate_up: Tensor, capacity_factor: float, group) -> Tensor:
    return _under_capacity(chosen, gate_up.shape[0] * _size(group), capacity_factor)


def _check_routed(x, weights, chosen, gate_up, down, group, gate_up_bias, down_bias) -> None:
    if x.dim() != 2 or weights.shape != chosen.shape or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts needs x [tokens, hidden] and weights, experts [tokens, top_k], got {tuple(x.shape)}, "
            f"{tuple(weights.shape)} and {tuple(chosen.shape)}: flatten batch and sequence into tokens first"
        )
    experts = gate_up.shape[0] * _size(group)
    _check_experts(experts, x.shape[1], gate_up, down, weights.shape[1], group, gate_up_bias, down_bias)


@moe_experts.register_fake
def _(
    x, weights, chosen, gate_up, down, capacity_factor, activation, gate_up_bias, down_bias, weighted_inputs, group_name
):
    _check_routed(x, weights, chosen, gate_up, down, _group(group_name), gate_up_bias, down_bias)
    gated_activation(activation)
    return x.new_empty(x.shape)


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_out: Tensor,
    x: Tensor,
    weights: Tensor,
    chosen: Tensor,
    gate_up: Tensor,
    down: Tensor,
    capacity_factor: float,
    activation: str,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    weighted_inputs: bool,
    group_name: str,
) -> BackwardGrads:
    """Gradients of :func:`moe_experts` for x, weights, gate_up, down and the biases (empty where none)."""
    group = _group(group_name)
    keep = _kept(chosen, gate_up, capacity_factor, group)
    experts = _Experts(gate_up, down, gate_up_bias, down_bias, activation, weighted_inputs)
    d_x, d_weights, *d_experts = _combine_backward(grad_out, x, chosen, keep, weights, experts, group)
    return d_x, d_weights.to(weights.dtype), *d_experts


@moe_experts_backward.register_fake
def _(grad_out, x, weights, chosen, gate_up, down, capacity_factor, activation, gate_up_bias, down_bias, *_):
    return (*(t.new_empty(t.shape) for t in (x, weights, gate_up, down)), *_bias_grads(x, gate_up_bias, down_bias))


def _save_routed(ctx, inputs, output):
    x, weights, chosen, gate_up, down, capacity_factor, activation, gate_up_bias, down_bias, *last = inputs
    ctx.save_for_backward(x, weights, chosen, gate_up, down, gate_up_bias, down_bias)
    ctx.options, ctx.last = (capacity_factor, activation), last  # last: weighted_inputs, group_name


def _moe_experts_autograd(ctx, grad_out):
    x, weights, chosen, gate_up, down, gate_up_bias, down_bias = ctx.saved_tensors
    d_x, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias = moe_experts_backward(
        grad_out, x, weights, chosen, gate_up, down, *ctx.options, gate_up_bias, down_bias, *ctx.last
    )
    biases = _present(d_gate_up_bias, gate_up_bias), _present(d_down_bias, down_bias)
    return d_x, d_weights, None, d_gate_up, d_down, None, None, *biases, None, None


moe_experts.register_autograd(_moe_experts_autograd, setup_context=_save_routed)
