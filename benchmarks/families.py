"""Unmodified Hugging Face families on 4 gloo ranks: DP, TP, pipeline, context parallelism and
the automatic plan, one training step against one process; and compiled (``compile=True``) on 2
ranks: DP, TP, pipeline and, with experts, expert parallelism (``COMPILED_PLANS``).

    python benchmarks/coverage.py families [--only llama,qwen2] [--quick] [--compiled]

Each family is ``AutoModelForCausalLM.from_config`` on a small config (:mod:`hf_configs`), as it
comes. ``autopar.parallelize(model, 4)`` plans it with no example inputs, pinned to ``dp=4``,
to ``tp=4``, to ``pp=2, dp=2`` or ``cp=2, dp=2`` on a 2x2 mesh, or not pinned (the search's own
choice), and a family with mixture-of-experts layers to ``ep=4``, its experts split over the
ranks; then one step as a script takes it:
``pmodel(input_ids=..., labels=...).loss.backward()`` and AdamW, against the same step of the
model in one process. The labels are padded as a batch of texts of different lengths is
(right padding labelled -100, another length per row), so the ranks and the microbatches each
count another number of targets. A case passes when the loss, every full gradient and every parameter
after the step are allclose (rtol 1e-4, atol 1e-6). A family that cannot run says why: the
first line of the error autopar raises (for a model torch.export cannot trace, the file and
line of the construct).
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
from hf_configs import small_model

import autopar
from autopar.passes.capture.moe import expert_modules

PLANS = {
    "DP": {"degrees": {"dp": 4}},
    "TP": {"degrees": {"tp": 4}},
    "PP2xDP2": {"mesh": "2x2", "degrees": {"pp": 2, "dp": 2}},
    "CP2xDP2": {"mesh": "2x2", "degrees": {"cp": 2, "dp": 2}},
    "auto": {},
    "EP4": {"degrees": {"ep": 4}},  # mixture-of-experts families only, their experts split (expert_pins)
}
# compile=True on 2 ranks: every program through torch.compile (inductor), its collectives scheduled
COMPILED_PLANS = {
    "DP2": {"mesh": 2, "degrees": {"dp": 2}, "compile": True},
    "TP2": {"mesh": 2, "degrees": {"tp": 2}, "compile": True},
    "PP2": {"mesh": 2, "degrees": {"pp": 2}, "compile": True},
    "EP2": {"mesh": 2, "degrees": {"ep": 2}, "compile": True},
}
MOE_ONLY = {"EP4", "EP2"}
BATCH, SEQ, LR, EPS = 8, 32, 1e-4, 1e-6
# Clean under torch.export in the HF survey (research/hf_families.md): dense, MoE, SSM, MLA,
# sliding windows, ALiBi, tied embeddings, fused QKV.
FAMILIES = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "gpt2", "gpt_neo", "gpt_neox", "gptj", "gpt_bigcode", "phi", "phi3", "olmo",
    "olmo2", "olmoe", "starcoder2", "stablelm", "falcon", "opt", "bloom", "granite", "granitemoe",
    "cohere", "glm", "smollm3", "internlm3", "deepseek_v3", "deepseek_v2", "minicpm3", "glm4_moe_lite", "mamba",
    "dbrx",  # loops over the experts a batch hits: data-dependent Python control flow
    "jetmoe",  # tokens split by counts it computes: sizes only the data decides
    "inkling2_text",  # a stage boundary value that is not contiguous
    "gpt_oss",  # experts with biases, their gate and up columns interleaved; attention sinks
    "llama4_text",  # every expert run on every token scaled by its router score (the experts op's weighted inputs)
    # Hybrids of attention with linear attention or state-space layers, and more MoE routers:
    "qwen3_next",  # gated delta rule (chunked linear attention) and 512 experts with a shared one
    "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini",  # the gated delta rule too
    "nemotron_h", "falcon_h1", "bamba", "zamba2",  # Mamba-2 layers beside attention (zamba2: a shared block)
    "jamba",  # Mamba-1 layers and MoE
    "lfm2",  # short gated convolutions beside attention
    "minimax",  # lightning (linear) attention and MoE
    "exaone4", "seed_oss", "cohere2", "helium", "apertus", "flex_olmo",
    "ernie4_5_moe", "hunyuan_v1_moe", "phimoe", "afmoe", "dots1",
]  # fmt: skip


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Worst |value - reference| / (1e-6 + 1e-4·|reference|): at most 1 is allclose (rtol 1e-4, atol 1e-6)."""
    value, reference = value.detach().float().to(reference.device), reference.detach().float()
    return ((value - reference).abs() / (1e-6 + 1e-4 * reference.abs())).max().item()


def padded(tokens: torch.Tensor) -> torch.Tensor:
    """The labels of ``tokens`` as a right-padded batch has them: row b's last 3b + 1 ignored (-100)."""
    labels = tokens.clone()
    for row in range(labels.shape[0]):
        labels[row, labels.shape[1] - 3 * row - 1 :] = -100
    return labels


def one_step(family: str, pins: dict, device: str = "cpu") -> dict:
    """One training step of ``family`` under ``pins`` against one process (see the module docstring);
    on ``device`` (the runtime's, by its process group's backend) for the step and the reference."""
    torch.manual_seed(0)
    model = small_model(family)
    pins = dict(pins)
    started = time.perf_counter()
    pmodel = autopar.parallelize(model, pins.pop("mesh", 4), **pins)
    planned = time.perf_counter() - started
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    tokens, labels = tokens.to(device), padded(tokens).to(device)
    started = time.perf_counter()
    out = pmodel(input_ids=tokens, labels=labels)
    out.loss.backward()
    first_step = time.perf_counter() - started  # compiled: the compile's
    grads = {name: p.grad.full_tensor() for name, p in pmodel.named_parameters() if p.grad is not None}
    optimizer.step()
    model.to(device)
    reference_optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    reference = model(input_ids=tokens, labels=labels)
    reference.loss.backward()
    reference_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    reference_optimizer.step()
    # a rank of a pipeline holds its stages' parameters only: each rank checks those it holds
    # (coverage.py takes the worst over the ranks), and every parameter is held by some rank
    held = dict(pmodel.named_parameters())
    worst = max(
        [relative(out.loss, reference.loss)]
        + [relative(grads[name], reference_grads[name]) for name in reference_grads if name in held]
        + [relative(p.full_tensor(), model.get_parameter(name)) for name, p in held.items()]
    )
    degrees = {axis: size for axis, size in pmodel.plan.degrees.items() if size > 1}
    if pmodel.plan.schedule.stages > 1:
        degrees["pp"] = pmodel.plan.schedule.stages
    missing = sorted(name for name, _ in model.named_parameters() if name not in held)
    return {
        "ok": worst <= 1,
        "worst": worst,
        "degrees": degrees,
        "plan_s": planned,
        "step_s": first_step,
        "missing": missing,
    }


def expert_pins(family: str, pins: dict) -> dict | None:
    """``pins`` with every layer's experts op pinned to the expert-parallel kernel (the search
    alone runs every expert on each rank's tokens at these sizes), or None for a dense family."""
    model = small_model(family)
    layers = expert_modules(model)  # the modules the experts ops belong to
    return {**pins, "constraints": dict.fromkeys(layers, "experts")} if layers else None


def run_families(rank: int, world: int, families: list[str], plans: dict = PLANS) -> list[dict]:
    """On each of ``world`` ranks: every family under every plan; a case that raises gives its error."""
    warnings.simplefilter("ignore")
    logging.getLogger("autopar").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch._logging.set_logs(all=logging.CRITICAL)
    rows = []
    for family in families:
        row = {"family": family}
        for label, pins in plans.items():
            if label in MOE_ONLY and (pins := expert_pins(family, pins)) is None:
                row[label] = None  # nothing to split
                continue
            try:
                row[label] = one_step(family, pins)
            except Exception as error:  # noqa: BLE001  (the row says why)
                text = str(error).strip().splitlines()
                row[label] = {"ok": False, "error": f"{type(error).__name__}: {text[0] if text else ''}"}
        rows.append(row)
    return rows
