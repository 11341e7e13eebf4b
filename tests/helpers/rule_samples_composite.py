"""Random calls of autopar's composite ops (mixtures of experts, the gated delta rule, the selective
scan, the linear recurrence) for the rule validation: part of ``rule_samples.SAMPLES``."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from rule_check import Sample
from rule_draws import F32, size, values


def experts(draw, p):
    """autopar::moe(x [T, H], router [E, H], gate_up [E, 2F, H], down [E, H, F]) on one rank (no group)."""
    tokens, hidden, ffn, count = size(draw, p), size(draw, p), size(draw, p), draw(st.integers(2, 4))
    x, router = values(draw, (tokens, hidden)), values(draw, (count, hidden))
    gate_up, down = values(draw, (count, 2 * ffn, hidden)), values(draw, (count, hidden, ffn))
    top_k = draw(st.integers(1, count))
    options = (top_k, draw(st.booleans()), 0.0, "silu", None, None, "")
    return Sample(torch.ops.autopar.moe.default, (x, router, gate_up, down, *options))


def routed_experts(draw, p):
    """autopar::moe_experts(x [T, H], weights [T, k], ids [T, k], gate_up, down, with or without
    biases [E, 2F] and [E, H], as GPT-OSS's) on one rank (no group)."""
    tokens, hidden, ffn, count = size(draw, p), size(draw, p), size(draw, p), draw(st.integers(2, 4))
    top_k = draw(st.integers(1, count))
    ids = values(draw, (tokens, count)).topk(top_k, dim=-1).indices  # distinct experts per token
    x, weights = values(draw, (tokens, hidden)), values(draw, (tokens, top_k))
    gate_up, down = values(draw, (count, 2 * ffn, hidden)), values(draw, (count, hidden, ffn))
    biases = (values(draw, (count, 2 * ffn)), values(draw, (count, hidden))) if draw(st.booleans()) else (None, None)
    activation = "clamped_swiglu:1.702:7:interleaved" if biases[0] is not None else "silu"
    options = (0.0, activation, *biases, draw(st.booleans()), "")  # the weights scaling outputs or inputs
    return Sample(torch.ops.autopar.moe_experts.default, (x, weights, ids, gate_up, down, *options))


def gated_delta_rule(draw, p):
    """autopar::gated_delta_rule(q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]) with
    Hv a multiple of Hk (grouped heads), over chunks of 4 steps (the last one padded)."""
    batch, steps, heads, groups = size(draw, p), draw(st.integers(1, 9)), size(draw, p), draw(st.sampled_from([1, 2]))
    dk, dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    q, k = (values(draw, (batch, steps, heads, dk), F32) for _ in range(2))
    v = values(draw, (batch, steps, heads * groups, dv), F32)
    g = -values(draw, (batch, steps, heads * groups), F32).abs()  # a decay: the state times exp(g) <= 1
    beta = values(draw, (batch, steps, heads * groups), F32).sigmoid()
    options = (4, draw(st.booleans()), "transformers.models.qwen3_next.modeling_qwen3_next")
    return Sample(torch.ops.autopar.gated_delta_rule.default, (q, k, v, g, beta, *options))


def selective_scan(draw, p):
    """autopar::selective_scan(u, delta [b, D, T], A [D, N], B, C [b, N, T], D, z [b, D, T], delta_bias [D]),
    B and C transposed views as Mamba passes them, A negative (a decaying state)."""
    batch, channels, steps, states = size(draw, p), size(draw, p), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    u, delta, z = (values(draw, (batch, channels, steps), F32) for _ in range(3))
    A = -values(draw, (channels, states), F32).abs()
    B, C = (values(draw, (batch, steps, states), F32).transpose(1, 2) for _ in range(2))
    D, bias = values(draw, (channels,), F32), values(draw, (channels,), F32)
    options = (True, False, "transformers.models.mamba.modeling_mamba")
    return Sample(torch.ops.autopar.selective_scan.default, (u, delta, A, B, C, D, z, bias, *options))


def linear_recurrence(draw, p):
    """autopar::linear_recurrence(x, a [b, T, w]), a gate in (0, 1) as Griffin's."""
    batch, steps, width = size(draw, p), draw(st.integers(1, 6)), size(draw, p)
    x, a = values(draw, (batch, steps, width), F32), values(draw, (batch, steps, width), F32).sigmoid()
    return Sample(torch.ops.autopar.linear_recurrence.default, (x, a))


COMPOSITE_SAMPLES = {
    "autopar.moe": experts,
    "autopar.moe_experts": routed_experts,
    "autopar.gated_delta_rule": gated_delta_rule,
    "autopar.selective_scan": selective_scan,
    "autopar.linear_recurrence": linear_recurrence,
}
