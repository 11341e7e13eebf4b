"""autopar::moe: the composite op against the eager MoE blocks, its capacity rule by hand, and
expert parallelism on gloo against the single-process op (``moe_experts``, routed by the
model's own ops, too).

In-process, the op (group "") must reproduce moe_gpt's and Mixtral's blocks, forward and
backward. On P ranks every rank builds the same full tensors from one seed, runs the op on its
own tokens with its own experts, and compares with the single-process op: dropless on the
concatenation of all ranks' tokens, with capacity on each rank's tokens separately (capacity
counts one rank's batch). One spawn per world size covers every check.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from equivalence import load_example
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.passes.capture.moe import composite_moe
from autopar.runtime import build_device_mesh, group_name
from autopar.runtime.spawn import run_local

moe = torch.ops.autopar.moe
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
SOFTCAPPED = "softcapped_silu:1:1.5"  # caps the routed EP check's unit-scale values reach


def _scale_weights(block, generator) -> None:
    """Unit-scale outputs (the models' 0.02 init would make any error look small)."""
    router = block.gate.weight
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    with torch.no_grad():
        router.copy_(torch.randn(router.shape, generator=generator))
        gate_up.copy_(torch.randn(gate_up.shape, generator=generator) / math.sqrt(gate_up.shape[-1]))
        down.copy_(torch.randn(down.shape, generator=generator) / math.sqrt(down.shape[-1]))


def _run_block(block, x, upstream, logit_upstream):
    """Output, router logits (where the block returns them) and every gradient of one backward."""
    x = x.clone().requires_grad_()
    result = block(x)
    out = result[0] if isinstance(result, tuple) else result
    loss = (out * upstream).sum()
    if isinstance(result, tuple):  # the logits' own gradient (an aux loss's) flows too
        loss = loss + (result[1] * logit_upstream).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    logits = result[1].detach() if isinstance(result, tuple) else None
    return out.detach(), logits, x.grad, grads


def _assert_block_matches_eager(block, hidden: int) -> None:
    generator = torch.Generator().manual_seed(0)
    _scale_weights(block, generator)
    x = torch.randn(3, 5, hidden, generator=generator)
    upstream = torch.randn(3, 5, hidden, generator=generator)
    logit_upstream = torch.randn(15, block.gate.weight.shape[0], generator=generator)
    eager = _run_block(block, x, upstream, logit_upstream)
    with composite_moe(block):
        composite = _run_block(block, x, upstream, logit_upstream)
    torch.testing.assert_close(composite[0], eager[0], **TOLERANCE)
    if eager[1] is not None:
        torch.testing.assert_close(composite[1], eager[1], **TOLERANCE)
    torch.testing.assert_close(composite[2], eager[2], **TOLERANCE)
    assert composite[3].keys() == eager[3].keys()
    for name in eager[3]:
        torch.testing.assert_close(composite[3][name], eager[3][name], **TOLERANCE, msg=name)


def test_op_matches_moe_gpt_block_forward_and_backward():
    block = load_example("moe_gpt.py").MoEFeedForward(hidden=16, ffn=24, experts=8, top_k=2)
    _assert_block_matches_eager(block, 16)


def test_op_matches_mixtral_block_forward_and_backward():
    model = load_example("hf.py").build_mixtral(
        hidden=16, ffn=24, experts=4, top_k=2, layers=1, experts_implementation="eager"
    )
    _assert_block_matches_eager(model.model.layers[0].mlp, 16)


def _expert(x, gate_up, down):
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def test_capacity_drops_slots_over_capacity_first_choices_first():
    # 3 tokens, 2 experts, top-2: every token uses both. capacity = ceil(0.5·3·2/2) = 2 slots.
    # First choices: t0→e0, t1→e0, t2→e1; second: t0→e1, t1→e1, t2→e0. Expert 0 takes t0, t1
    # (first choices) and drops t2's second choice; expert 1 takes t2 (first), t0 (second) and
    # drops t1's second choice.
    generator = torch.Generator().manual_seed(1)
    x = torch.tensor([[2.0, 0.5], [1.0, 0.2], [-1.0, 0.3]], requires_grad=True)
    router = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], requires_grad=True)
    gate_up = torch.randn(2, 6, 2, generator=generator).requires_grad_()
    down = torch.randn(2, 2, 3, generator=generator).requires_grad_()
    upstream = torch.randn(3, 2, generator=generator)

    out, logits = moe(x, router, gate_up, down, 2, True, 0.5, "silu", None, None, "")
    actual = torch.autograd.grad((out * upstream).sum(), [x, router, gate_up, down])

    probs = torch.softmax(x @ router.t(), dim=-1)  # top-2 of 2 experts: weights are the probs
    kept = [[(0, 0), (0, 1)], [(1, 0)], [(2, 1)]]  # (token, expert) slots under capacity
    expected = torch.stack([sum(probs[t, e] * _expert(x[t], gate_up[e], down[e]) for t, e in slots) for slots in kept])
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(logits, x @ router.t(), **TOLERANCE)
    wanted = torch.autograd.grad((expected * upstream).sum(), [x, router, gate_up, down])
    for name, got, want in zip(["x", "router", "gate_up", "down"], actual, wanted):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=name)
    dropless, _ = moe(x, router, gate_up, down, 2, True, 0.0, "silu", None, None, "")
    assert not torch.allclose(dropless, out)  # the hand case really drops


def _traced_autopar_ops(*leaves) -> list[str]:
    def loss_grad(*leaves):
        out, logits = moe(*leaves, 2, True, 0.0, "silu", None, None, "")
        return torch.autograd.grad(out.sum() + logits.sum(), leaves)

    graph = make_fx(loss_grad, tracing_mode="fake")(*leaves).graph
    return [
        node.target.name()
        for node in graph.nodes
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "autopar"
    ]


def test_op_passes_opcheck_traces_with_its_backward_and_names_bad_shapes():
    x, router = torch.randn(6, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    gate_up, down = torch.randn(3, 10, 4, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True)
    # schema, autograd registration, fake impl against the real one, AOT dispatch
    torch.library.opcheck(moe.default, (x, router, gate_up, down, 2, True, 0.0, "silu", None, None, ""))
    weights, ids = torch.rand(6, 2, requires_grad=True), torch.tensor([[0, 1], [2, 0], [1, 2]] * 2)
    biases = torch.randn(3, 10, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    routed = (x, weights, ids, gate_up, down, 0.0, "silu:interleaved", *biases, True, "")
    torch.library.opcheck(torch.ops.autopar.moe_experts.default, routed)
    # stored transposed (Aria's, GPT-OSS's, DBRX's weights are views): the gradients' strides as the fake's
    transposed = gate_up.detach().transpose(1, 2).contiguous().transpose(1, 2), down.detach().mT.contiguous().mT
    backward = (torch.randn(6, 4), x.detach(), weights.detach(), ids, *transposed, 0.0, "silu", None, None, False, "")
    torch.library.opcheck(torch.ops.autopar.moe_experts_backward.default, backward)
    assert _traced_autopar_ops(x, router, gate_up, down) == ["autopar::moe", "autopar::moe_backward"]
    try:
        moe(x, router, gate_up[:2], down, 2, True, 0.0, "silu", None, None, "")
    except ValueError as error:
        assert "gate_up [3, 2·ffn, 4]" in str(error) and "(2, 10, 4)" in str(error)
    else:
        raise AssertionError("a gate_up with the wrong expert count must be refused")


HAND_ACTIVATIONS = {  # glu(gate, up) written out, apart from the ops' table (runtime/kernels/expert_activations.py)
    "silu": lambda g, u: g * torch.sigmoid(g) * u,
    "gelu": lambda g, u: 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u,
    "gelu_tanh": lambda g, u: 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u,
    "relu": lambda g, u: torch.where(g > 0, g, 0) * u,
    "softcapped_silu:1.5:2": lambda g, u: 1.5 * torch.tanh(g / 1.5) * torch.sigmoid(g) * 2 * torch.tanh(u / 2),
    "clamped_silu:1.5": lambda g, u: (
        torch.minimum(g, torch.tensor(1.5)).sigmoid()
        * torch.minimum(g, torch.tensor(1.5))
        * torch.maximum(torch.minimum(u, torch.tensor(1.5)), torch.tensor(-1.5))
    ),
    "clamped_swiglu:1.702:2": lambda g, u: (
        torch.minimum(g, torch.tensor(2.0))
        * torch.sigmoid(1.702 * torch.minimum(g, torch.tensor(2.0)))
        * (torch.maximum(torch.minimum(u, torch.tensor(2.0)), torch.tensor(-2.0)) + 1)
    ),
}


def _hand_experts(x, weights, ids, experts, glu, weighted: bool):
    """Σ_j w · expert_j(x), or Σ_j expert_j(w · x) when ``weighted`` (inputs), token by token."""
    gate_up, down, gate_up_bias, down_bias = experts
    rows = []
    for t, row in enumerate(ids.tolist()):
        outs = []
        for j, e in enumerate(row):
            w = weights[t, j]
            y = F.linear(
                glu(F.linear(w * x[t] if weighted else x[t], gate_up[e], gate_up_bias[e])), down[e], down_bias[e]
            )
            outs.append(y if weighted else w * y)
        rows.append(sum(outs))
    return torch.stack(rows)


def test_experts_compute_each_activation_and_its_gradient_and_name_an_unknown_one():
    """moe_experts against each expert written out per slot, out and every gradient (unit-scale
    values, past the caps and clamps), with biases, and with the weights on the inputs; an unknown
    activation is refused with the known ones."""
    generator = torch.Generator().manual_seed(2)
    tokens, ids = 6, torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1], [1, 0]])
    leaves = [
        torch.randn(tokens, 4, generator=generator),  # x
        torch.rand(tokens, 2, generator=generator),  # weights
        torch.randn(3, 10, 4, generator=generator),  # gate_up [E, 2F, H]
        torch.randn(3, 4, 5, generator=generator),  # down [E, H, F]
    ]
    upstream = torch.randn(tokens, 4, generator=generator)
    biases = [torch.randn(3, 10, generator=generator), torch.randn(3, 4, generator=generator)]
    interleaved = HAND_ACTIVATIONS["clamped_swiglu:1.702:2"]  # GPT-OSS's: gate and up columns alternate, biased
    cases = [(name, lambda h, glu=glu: glu(*h.chunk(2)), False, False) for name, glu in HAND_ACTIVATIONS.items()]
    cases.append(("clamped_swiglu:1.702:2:interleaved", lambda h: interleaved(h[..., ::2], h[..., 1::2]), True, False))
    cases.append(("gelu", lambda h: HAND_ACTIVATIONS["gelu"](*h.chunk(2)), False, True))  # Llama 4's weighted inputs
    for name, glu, biased, weighted in cases:
        x, weights, gate_up, down, *bias = (
            leaf.clone().requires_grad_() for leaf in leaves + (biases if biased else [])
        )
        gate_up_bias, down_bias = bias or (torch.zeros(3, 10), torch.zeros(3, 4))
        options = (0.0, name, *(bias or (None, None)), weighted, "")
        out = torch.ops.autopar.moe_experts(x, weights, ids, gate_up, down, *options)
        expected = _hand_experts(x, weights, ids, (gate_up, down, gate_up_bias, down_bias), glu, weighted)
        torch.testing.assert_close(out, expected, **TOLERANCE, msg=name)
        differentiated = [x, weights, gate_up, down, *bias]
        actual = torch.autograd.grad((out * upstream).sum(), differentiated)
        wanted = torch.autograd.grad((expected * upstream).sum(), differentiated)
        for leaf, got, want in zip(["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"], actual, wanted):
            torch.testing.assert_close(got, want, **TOLERANCE, msg=f"{name}: {leaf}")
    try:
        torch.ops.autopar.moe_experts(*leaves[:2], ids, *leaves[2:], 0.0, "swish", None, None, False, "")
    except ValueError as error:
        assert "'swish'" in str(error) and "gelu_tanh" in str(error) and "softcapped_silu" in str(error)
    else:
        raise AssertionError("an unknown activation must be refused")


# --- expert parallelism on gloo ------------------------------------------------------------


def _full_problem(P: int, tokens: int, hidden: int, ffn: int, experts: int):
    generator = torch.Generator().manual_seed(P)
    return {
        "x": torch.randn(P, tokens, hidden, generator=generator),
        "router": torch.randn(experts, hidden, generator=generator),
        "gate_up": torch.randn(experts, 2 * ffn, hidden, generator=generator) / math.sqrt(hidden),
        "down": torch.randn(experts, hidden, ffn, generator=generator) / math.sqrt(ffn),
        "upstream": torch.randn(P, tokens, hidden, generator=generator),
        "logit upstream": torch.randn(P, tokens, experts, generator=generator),
    }


def _loss_and_grads(problem, x, gate_up, down, ranks, options, group):
    """Σ over ``ranks`` of (out·upstream + logits·logit upstream), its outputs and gradients."""
    leaves = [
        x.clone().requires_grad_(),
        problem["router"].clone().requires_grad_(),
        gate_up.clone().requires_grad_(),
        down.clone().requires_grad_(),
    ]
    outs, logits = moe(*leaves, *options, group)
    upstream = problem["upstream"][ranks].reshape(-1, x.shape[-1])
    logit_upstream = problem["logit upstream"][ranks].reshape(-1, logits.shape[-1])
    ((outs * upstream).sum() + (logits * logit_upstream).sum()).backward()
    return outs.detach(), logits.detach(), [leaf.grad for leaf in leaves]


def _excess(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """How far ``actual`` is outside rtol/atol of ``expected`` (≤ 0: within)."""
    if actual.shape != expected.shape:
        return float("inf")
    bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * expected.abs()
    return ((actual - expected).abs() - bound).max().item()


def _check_ep(
    errors: dict, label: str, group: str, rank: int, P: int, top_k: int, normalize: bool, capacity_factor: float
) -> bool:
    """EP op on this rank vs the single-process op; returns whether any slot was dropped."""
    tokens, hidden, ffn, experts = 7, 6, 5, 8
    problem = _full_problem(P, tokens, hidden, ffn, experts)
    local = slice(rank * experts // P, (rank + 1) * experts // P)
    options = (top_k, normalize, capacity_factor, "silu", None, None)
    ep_out, ep_logits, ep_grads = _loss_and_grads(
        problem, problem["x"][rank], problem["gate_up"][local], problem["down"][local], [rank], options, group
    )
    everything = list(range(P))
    if capacity_factor <= 0:  # dropless: one op over every rank's tokens
        full_out, _, full_grads = _loss_and_grads(
            problem,
            problem["x"].reshape(P * tokens, hidden),
            problem["gate_up"],
            problem["down"],
            everything,
            options,
            "",
        )
        expected_out = full_out.view(P, tokens, hidden)[rank]
        expected_expert_grads = [g[local] for g in full_grads[2:]]
    else:  # capacity counts one rank's tokens: the op on each rank's batch, losses summed
        per_rank = [
            _loss_and_grads(problem, problem["x"][q], problem["gate_up"], problem["down"], [q], options, "")
            for q in everything
        ]
        expected_out = per_rank[rank][0]
        expected_expert_grads = [sum(run[2][i] for run in per_rank)[local] for i in (2, 3)]
    own_out, own_logits, own_grads = _loss_and_grads(
        problem, problem["x"][rank], problem["gate_up"], problem["down"], [rank], options, ""
    )
    errors[f"{label} out"] = _excess(ep_out, expected_out)
    errors[f"{label} out vs own-batch op"] = _excess(ep_out, own_out)
    errors[f"{label} router logits"] = _excess(ep_logits, own_logits)
    errors[f"{label} x grad"] = _excess(ep_grads[0], own_grads[0])
    errors[f"{label} router grad"] = _excess(ep_grads[1], own_grads[1])
    errors[f"{label} gate_up grad"] = _excess(ep_grads[2], expected_expert_grads[0])
    errors[f"{label} down grad"] = _excess(ep_grads[3], expected_expert_grads[1])
    dropless, _ = moe(
        problem["x"][rank],
        problem["router"],
        problem["gate_up"],
        problem["down"],
        top_k,
        normalize,
        0.0,
        "silu",
        None,
        None,
        "",
    )
    return not torch.allclose(dropless, own_out)


def _routed_leaves(problem, ranks, experts):
    """moe_experts' leaves on ``ranks``' tokens: x, weights (sigmoid scores of the top 2, as
    DeepSeek-V3 routes), then ``experts``' tensors; and the expert ids."""
    x = problem["x"][ranks].reshape(-1, problem["x"].shape[-1])
    scores = torch.sigmoid(x @ problem["router"].t())
    ids = scores.topk(2, dim=-1).indices
    leaves = [t.clone().requires_grad_() for t in (x, scores.gather(1, ids), *experts)]
    return leaves, ids


def _check_routed(errors: dict, label: str, group: str, rank: int, P: int) -> None:
    """moe_experts (the model's own routing) under EP on this rank vs the op over every rank's
    tokens: with Inkling-2's softcapped activation, with GPT-OSS's biases and interleaved gate, and
    with Llama 4's weights on the experts' inputs."""
    count, generator = 8, torch.Generator().manual_seed(5)
    problem = _full_problem(P, 7, 6, 5, count)
    biases = [torch.randn(count, 10, generator=generator), torch.randn(count, 6, generator=generator)]
    local = slice(rank * count // P, (rank + 1) * count // P)
    for case, activation, tensors in [
        ("", SOFTCAPPED, [problem["gate_up"], problem["down"]]),
        (" biased", "clamped_swiglu:1.702:1:interleaved", [problem["gate_up"], problem["down"], *biases]),
        (" weighted inputs", "silu", [problem["gate_up"], problem["down"]]),  # Llama 4's
    ]:
        runs = []
        for ranks, experts, group_of in (([rank], [t[local] for t in tensors], group), (list(range(P)), tensors, "")):
            leaves, ids = _routed_leaves(problem, ranks, experts)
            x, weights, gate_up, down, *bias = leaves
            options = (0.0, activation, *(bias or (None, None)), case == " weighted inputs", group_of)
            out = torch.ops.autopar.moe_experts(x, weights, ids, gate_up, down, *options)
            (out * problem["upstream"][ranks].reshape(out.shape)).sum().backward()
            runs.append((out.detach(), [leaf.grad for leaf in leaves]))
        (ep_out, ep_grads), (full_out, full_grads) = runs
        mine = slice(rank * ep_out.shape[0], (rank + 1) * ep_out.shape[0])
        errors[f"{label} routed{case} out"] = _excess(ep_out, full_out[mine])
        for name, ep_grad, full_grad in zip(["x", "weights"], ep_grads, full_grads):
            errors[f"{label} routed{case} {name} grad"] = _excess(ep_grad, full_grad[mine])
        for name, ep_grad, full_grad in zip(
            ["gate_up", "down", "gate_up_bias", "down_bias"], ep_grads[2:], full_grads[2:]
        ):
            errors[f"{label} routed{case} {name} grad"] = _excess(ep_grad, full_grad[local])


def _ep_checks(rank, world_size, groups: dict[str, str]) -> dict:
    errors, dropped = {}, {}
    for label, group in groups.items():
        process_group = _resolve_process_group(group)
        group_rank, P = dist.get_rank(process_group), dist.get_world_size(process_group)
        _check_routed(errors, label, group, group_rank, P)
        for top_k, normalize, capacity_factor in [(2, True, 0.0), (3, False, 0.0), (2, True, 0.75)]:
            case = f"{label} k={top_k} normalize={normalize} capacity={capacity_factor}"
            dropped[case] = _check_ep(errors, case, group, group_rank, P, top_k, normalize, capacity_factor)
    return {"errors": errors, "dropped": dropped}


def _two_ranks(rank, world_size):
    mesh = build_device_mesh({"ep": 2}, "cpu")
    ep = group_name(mesh, ("ep",))
    result = _ep_checks(rank, world_size, {"ep": ep})
    with FakeTensorMode():
        x, router = torch.empty(7, 6), torch.empty(8, 6)
        out, logits = moe(x, router, torch.empty(4, 10, 6), torch.empty(4, 6, 5), 2, True, 0.0, "silu", None, None, ep)
        result["fake shapes"] = (tuple(out.shape), tuple(logits.shape))
    try:
        moe(
            torch.randn(7, 6),
            torch.randn(8, 6),
            torch.randn(8, 10, 6),
            torch.randn(8, 6, 5),
            2,
            True,
            0.0,
            "silu",
            None,
            None,
            ep,
        )
        result["all experts on each rank"] = "no error"
    except ValueError as error:
        result["all experts on each rank"] = str(error)
    return result


def _four_ranks(rank, world_size):
    mesh = build_device_mesh({"dp": 2, "ep": 2}, "cpu")
    # all four ranks, and the dp axis: group ranks 0, 1 are global ranks {0, 2} or {1, 3}
    return _ep_checks(rank, world_size, {"dp+ep": group_name(mesh, ("dp", "ep")), "dp": group_name(mesh, ("dp",))})


def _failures(results) -> dict:
    return {
        rank: {name: excess for name, excess in result["errors"].items() if excess > 0}
        for rank, result in enumerate(results)
    }


@pytest.mark.ranks
def test_expert_parallel_matches_single_process_on_2_ranks():
    results = run_local(_two_ranks, 2, timeout_s=90)
    assert _failures(results) == {0: {}, 1: {}}
    assert all(dropped == ("capacity=0.75" in case) for case, dropped in results[0]["dropped"].items())
    assert results[0]["fake shapes"] == ((7, 6), (7, 8))
    assert "gate_up [4, 2·ffn, 6]" in results[0]["all experts on each rank"]


@pytest.mark.ranks
def test_expert_parallel_matches_single_process_on_4_ranks_and_a_sub_group():
    results = run_local(_four_ranks, 4, timeout_s=120)
    assert _failures(results) == {rank: {} for rank in range(4)}
    assert any(dropped for case, dropped in results[0]["dropped"].items() if "capacity=0.75" in case)
