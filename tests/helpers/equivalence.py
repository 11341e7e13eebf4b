"""Shared by the equivalence tests: train one step both ways and compare, inside a rank."""

import importlib.util
from pathlib import Path

import torch
from shared_captures import build

import autopar
from autopar.verify import ADAM_EPS, ATOL, LEARNING_RATE, RTOL  # the step and tolerance autopar verify uses

ROOT = Path(__file__).resolve().parents[2]

# Megatron layouts, pinned by module name (the search fills in everything else).
GPT_TP = {
    "layers.*.attn.w[qkv]": "S(-1)",
    "layers.*.attn.wo": "P",
    "layers.*.mlp.fc1": "S(-1)",
    "layers.*.mlp.fc2": "P",
}
GPT_SP = {**GPT_TP, "layers.*.attn_norm": "S(1)", "layers.*.mlp_norm": "S(1)"}
MLP_TP = {"blocks.*.fc1": "S(-1)", "blocks.*.fc2": "P"}
LLAMA_TP = {
    "model.layers.*.self_attn.[qkv]_proj": "S(-1)",
    "model.layers.*.self_attn.o_proj": "P",
    "model.layers.*.mlp.[gu][ap]*_proj": "S(-1)",
    "model.layers.*.mlp.down_proj": "P",
}
LLAMA_SP = {**LLAMA_TP, "model.layers.*.input_layernorm": "S(1)", "model.layers.*.post_attention_layernorm": "S(1)"}
# The vocabulary split (Megatron-LM, torchtitan): embedding rows, output projection columns, and
# the loss over split classes (computed in the model's own forward, "<top>").
GPT_VOCAB = {"tok_embeddings": "vocab", "output": "S(-1)", "<top>": "vocab"}
LLAMA_VOCAB = {"model.embed_tokens": "vocab", "lm_head": "S(-1)", "<top>": "vocab"}
GPT2_TP = {"transformer.h.*.mlp.c_fc": "S(-1)", "transformer.h.*.mlp.c_proj": "P"}
GPT2_SP = {**GPT2_TP, "transformer.h.*.ln_[12]": "S(1)"}


def load_example(file: str, folder: str = "examples"):
    """A script of the repository's ``folder`` as a module (``load_example("hf_configs.py", "benchmarks")``)."""
    spec = importlib.util.spec_from_file_location(Path(file).stem, ROOT / folder / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_one_step(builder, kwargs: dict, batch: int, world: int, options: dict, inspect=None) -> dict:
    """Single-process reference vs autopar on this rank; returns the worst relative errors
    (and what ``inspect(pmodel)`` returns, after the step)."""
    torch.manual_seed(0)
    model = build(builder, **kwargs)
    inputs = model.example_inputs(batch)
    if options.pop("ignore_targets", False):
        inputs = (*inputs[:-1], with_ignored_targets(inputs[-1]))
    options_optimizer = options.pop("optimizer", "dtensor")
    check_forward = options.pop("check_forward", False)
    mesh = options.pop("mesh", world)
    if options.pop("made_on_meta", False):  # the plan made as `autopar plan` makes it, given to parallelize
        with torch.device("meta"):
            meta = builder(**kwargs)
        options = dict(plan=autopar.plan(meta, mesh, meta.example_inputs(batch, device="meta"), **options))
    pmodel = autopar.parallelize(model, mesh, inputs, **options)

    forward = pmodel(*inputs) if check_forward else None
    reference = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    ref_loss = model(*inputs)
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    reference.step()

    if options_optimizer == "shards":
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LEARNING_RATE, eps=ADAM_EPS)
    else:  # a torch optimizer over the DTensor parameters
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    local_inputs = pmodel.shard_batch(*inputs)
    loss = pmodel.train_step(*local_inputs)
    grads = {name: p.grad.full_tensor() for name, p in pmodel.named_parameters()}
    optimizer.step()
    params = {name: p.full_tensor() for name, p in pmodel.named_parameters()}

    ref_params = dict(model.named_parameters())
    pipelined = pmodel.plan.schedule.stages > 1  # a rank holds only its stages' parameters
    assert grads.keys() <= ref_grads.keys() if pipelined else grads.keys() == ref_grads.keys(), (
        sorted(grads),
        sorted(ref_grads),
    )
    return {
        "degrees": pmodel.plan.degrees,
        "loss": _rel(loss, ref_loss),
        "grad": max((_rel(grads[n], ref_grads[n]), n) for n in grads),
        "param": max((_rel(params[n], ref_params[n]), n) for n in params),
        "overlapped_loss_reduction": pmodel._peeled_loss_program(
            pmodel._calls.prepare(local_inputs, {}, split=pmodel._calls.axes)[0]
        )[1]
        is not None,
        "collectives": sum(1 for node in pmodel.program.graph.nodes if "autopar" in str(node.target)),
        "kernels": sorted(kernel for node in pmodel.program.graph.nodes if (kernel := _kernel(node))),
        "held": sorted(grads),
        "forward": _rel(forward, ref_loss) if check_forward else None,
        "schedule": pmodel.plan.schedule,
        **(inspect(pmodel) if inspect is not None else {}),
    }


def with_ignored_targets(labels: torch.Tensor) -> torch.Tensor:
    """Row b of the batch ignores its first b + 1 targets (-100, ``F.cross_entropy``'s ignore_index),
    so every data-parallel shard counts another number of targets."""
    labels = labels.clone()
    for row in range(labels.shape[0]):
        labels[row, : row + 1] = -100
    return labels


KERNEL_OPS = {
    "autopar.ring_attention.default": "ring",
    "autopar.ulysses_attention.default": "ulysses",
    "autopar.vocab_embedding.default": "vocab",
    "autopar.vocab_cross_entropy.default": "vocab",
    "autopar.gathered_linears.default": "regather",
}


def _kernel(node) -> str | None:
    """The parallel kernel a program node runs, if any (experts: a moe op given a group)."""
    if str(node.target) == "autopar.moe.default":
        return "experts" if node.args[-1] else None
    return KERNEL_OPS.get(str(node.target))


def _rel(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Worst |value - reference| / (ATOL + RTOL·|reference|): at most 1 means allclose holds.

    The absolute floor matters for elements near zero, e.g. zero-initialized biases after one
    step (≈ lr); a missing or mis-sharded update (≈ lr = 1e-4) exceeds it 100-fold.
    """
    value, reference = value.detach().float(), reference.detach().float()
    return ((value - reference).abs() / (ATOL + RTOL * reference.abs())).max().item()


def run_cases(rank: int, world: int, cases: list, batch: int = 8) -> list[dict]:
    """``compare_one_step`` for each (example file, builder, model kwargs, options), on this rank;
    a case that raises gives ``{"error": ...}`` and the next cases still run."""
    return [
        run_case(
            lambda: compare_one_step(getattr(load_example(f"{file}.py"), builder), kwargs, batch, world, dict(options))
        )
        for file, builder, kwargs, options in cases
    ]


def run_case(compare) -> dict:
    """``compare()``, or ``{"error": ...}`` when it raises (planning errors are raised on every rank alike)."""
    try:
        return compare()
    except Exception as error:  # noqa: BLE001  (reported by check_every_case, with the other cases)
        return {"error": f"{type(error).__name__}: {error}"}


def check_every_case(cases: list, results: list, check) -> None:
    """``check(case, result)`` for every case; fails once, naming every case that failed (an
    error raised while running it, or a failed assertion), not only the first."""
    failures = []
    for case, result in zip(cases, results, strict=True):
        try:
            assert "error" not in result, result.get("error")
            check(case, result)
        except AssertionError as failure:
            failures.append(f"- {case}: {failure}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


def assert_matches(label: str, result: dict) -> None:
    """Loss, every full gradient and every parameter after AdamW allclose to the reference:
    each figure is the worst |x - ref| / (1e-6 + 1e-4·|ref|), at most 1."""
    assert result["loss"] <= 1, (label, result)
    assert result["grad"][0] <= 1, (label, result)
    assert result["param"][0] <= 1, (label, result)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def load_and_compare(reader, optimizer, path, model, reference) -> tuple[dict, dict]:
    """Load a checkpoint into ``reader`` and its optimizer; the logical state, and whether the
    parameters and AdamW moments this rank holds equal the single-process ``model``'s and
    ``reference`` optimizer's (plus the learning rate the checkpoint set)."""
    from autopar.runtime.checkpoint import load_checkpoint, logical_state

    load_checkpoint(reader, optimizer, path)
    state = logical_state(reader, optimizer)
    params = dict(model.named_parameters())
    return state, {
        "params": all(close(p.full_tensor(), params[name]) for name, p in reader.named_parameters()),
        "moments": all(
            close(state["optimizer"][name][key].full_tensor(), reference.state[params[name]][key])
            for name in state["optimizer"]
            for key in ("exp_avg", "exp_avg_sq")
        ),
        "lr": optimizer.param_groups[0]["lr"],
    }


def reference_after_one_step(builder, kwargs: dict, batch: int):
    """The single-process model (seed 0), its inputs and its AdamW after one training step."""
    torch.manual_seed(0)
    model = builder(**kwargs)
    inputs = model.example_inputs(batch)
    reference = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    model(*inputs).backward()
    reference.step()
    reference.zero_grad()
    return model, inputs, reference
