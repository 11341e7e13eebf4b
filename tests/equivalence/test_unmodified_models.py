"""Unmodified Hugging Face models (``AutoModelForCausalLM.from_config``), parallelized with no
example inputs and trained as a one-process script trains them: ``out = pmodel(**batch);
out.loss.backward(); optimizer.step()`` with the optimizer built before the first call. Against
the model itself: the loss, every full gradient, its global norm and the gradients clipped to a
smaller one (``pmodel.clip_grad_norm_``), and every parameter after AdamW (fp32, rtol 1e-4), on 4
gloo ranks, in one spawn.

Llama, Mixtral and GPT-2 (tied embedding and head, and dropout: its masks are the ones one process
draws) on DP2xTP2 (Llama from a per-rank data loader, ``local_batches``), Mixtral on EP4,
DeepSeek-V3 (its router's own ops, then the experts op) on EP2xTP2; a Qwen2 with tied embeddings
across pipeline stages on PP4, PP2xDP2 with ZeRO-1 (its labels right-padded, another length per
row, so microbatches count unequal targets) and ZeRO-3, and the zero-bubble V schedule (both uses
on one device); JetMoE (experts over attention heads and the MLP, its tokens split by counts it
computes: sizes only the data decides, other ones in each microbatch) on PP2xDP2. The same
families on DP4, TP4, PP2xDP2, CP2xDP2 and EP4 are ``benchmarks/coverage.py families``'s columns
(the same check, on every rank), with every other family (Inkling-2, Zamba2 and Llama 4 among
them, whose stage boundaries and weighted experts tests/equivalence/test_pipeline_parallel.py and
tests/runtime/kernels/test_expert_parallel.py check on small models). Also on one of the models:
calls of other sizes and with a padding mask (no new plan), a loss computed outside from returned
logits, and a batch the mesh cannot split."""

import pytest
import torch
from equivalence import ADAM_EPS, LEARNING_RATE, _rel, check_every_case, load_example, run_case
from shared_captures import build

import autopar
from autopar.runtime.spawn import run_local

pytestmark = pytest.mark.ranks  # every test here starts ranks (tests/conftest.py)

SIZES = dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, seq=16)
TIED = dict(SIZES, layers=4)  # a Qwen2 whose head is its embedding: 4 layers for 4 stages
BATCH, SEQ = 8, 16
CLIP = 1e-3  # every step's gradients clipped to this global norm (pmodel.clip_grad_norm_), below any of theirs
PP2xDP2, DP2xTP2 = (dict(mesh="2x2", degrees={a: 2, "dp": 2}) for a in ("pp", "tp"))
CASES = [
    ("llama", SIZES, dict(DP2xTP2, local_batches=True)),  # each rank passes its data-parallel share
    ("mixtral", SIZES, DP2xTP2),
    ("gpt2", dict(SIZES, dropout=0.1), DP2xTP2),  # its dropout draws the masks one process draws
    ("mixtral", SIZES, dict(degrees={"ep": 4})),
    ("deepseek_v3", SIZES, dict(degrees={"ep": 2, "tp": 2}, constraints={"model.layers.*.mlp.experts": "experts"})),
    ("qwen2", TIED, dict(degrees={"pp": 4})),
    ("qwen2", TIED, dict(PP2xDP2, zero=1, padded=True)),  # microbatches counting unequal targets
    ("qwen2", TIED, dict(PP2xDP2, zero=3)),
    ("qwen2", TIED, dict(PP2xDP2, pipeline="zbv")),
    ("jetmoe", SIZES, PP2xDP2),  # tokens split by counts it computes: sizes only the data decides, per microbatch
]


def _batch(seed: int, batch: int = BATCH, seq: int = SEQ) -> dict:
    tokens = torch.randint(0, SIZES["vocab"], (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens, "labels": tokens.roll(1, 0)}  # a graph mixing them up would show


def _one_step(family: str, sizes: dict, options: dict) -> dict:
    options = dict(options)
    torch.manual_seed(0)
    model = build(load_example("hf.py").from_config, family=family, **sizes)
    padded = options.pop("padded", False)
    stream = torch.get_rng_state()  # parallelize must leave it as it is on every rank (planning runs on one)
    pmodel = autopar.parallelize(model, options.pop("mesh", 4), **options)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)  # before any call
    batch = _batch(1)
    if padded:  # right padding labelled -100, another length per row
        lengths = SEQ - torch.arange(BATCH) - 1
        batch["labels"] = batch["labels"].masked_fill(torch.arange(SEQ) >= lengths[:, None], -100)
    if options.get("local_batches"):
        share = BATCH // pmodel.dp_size
        start = pmodel.dp_rank * share
        out = pmodel(**{name: value[start : start + share] for name, value in batch.items()})
    else:
        out = pmodel(**batch)
    out.loss.backward()
    grads = {name: p.grad.full_tensor().clone() for name, p in pmodel.named_parameters()}  # (clipped in place)
    norm = pmodel.clip_grad_norm_(CLIP)
    clipped = {name: p.grad.full_tensor() for name, p in pmodel.named_parameters()}
    optimizer.step()
    params = {name: p.full_tensor() for name, p in pmodel.named_parameters()}

    reference_optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    torch.set_rng_state(stream)  # the reference draws its dropout masks from where the script's stream was
    reference = model(**batch)
    reference.loss.backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    reference_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    reference_optimizer.step()
    reference_params = dict(model.named_parameters())
    return {
        "type": (type(out).__name__, type(reference).__name__),
        "degrees": {**pmodel.plan.degrees, "pp": pmodel.plan.schedule.stages},
        "loss": _rel(out.loss, reference.loss),
        "grad": max((_rel(grads[n], reference_grads[n]), n) for n in grads),
        "param": max((_rel(params[n], reference_params[n]), n) for n in params),
        "norm": (_rel(norm, reference_norm), norm.item(), reference_norm.item()),
        # each clipped gradient scaled back by the reference's factor: every rank scaled by the global one
        "clipped": max((_rel(clipped[n] * (reference_norm / CLIP), reference_grads[n]), n) for n in clipped),
        "held": sorted(grads),
        "all": sorted(reference_grads),
    }


def _other_calls() -> dict:
    """One DP4 Llama called in other ways than it was planned for."""
    torch.manual_seed(0)
    model = build(load_example("hf.py").from_config, family="llama", **SIZES)
    pmodel = autopar.parallelize(model, 4, degrees={"dp": 4})
    results = {}
    longer = _batch(2, batch=16, seq=8)  # other sizes: captured again, the same plan
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as a tokenizer pads, labelled -100: ranks count unequal targets
    padded = _batch(3)  # with a mask, another graph: planned again, the parameters where they were
    padded.update(attention_mask=mask, labels=padded["labels"].masked_fill(mask == 0, -100))
    for name, batch in (("sizes", longer), ("padding", padded)):
        model.zero_grad()
        reference = model(**batch)
        reference.loss.backward()
        out = pmodel(**batch)
        out.loss.backward()
        grad = max(_rel(p.grad.full_tensor(), model.get_parameter(n).grad) for n, p in pmodel.named_parameters())
        results[name] = (_rel(out.loss, reference.loss), grad)
        pmodel.zero_grad()
    tokens = _batch(4)["input_ids"]  # no labels: the model returns logits, the loss is the script's
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), tokens.flatten()).backward()
    logits = pmodel(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    results["outside"] = max(
        _rel(p.grad.full_tensor(), model.get_parameter(n).grad) for n, p in pmodel.named_parameters()
    )
    calls = {
        "train_step": lambda: pmodel.train_step(**pmodel.shard_batch(input_ids=tokens)),
        "odd": lambda: pmodel(**_batch(5, batch=6)),
    }
    for name, call in calls.items():
        try:
            call()
            results[name] = "no error"
        except autopar.ConfigError as error:
            results[name] = str(error)
    return results


def _all_cases(rank, world):
    results = [run_case(lambda case=case: _one_step(*case)) for case in CASES]
    return results, run_case(_other_calls)


def _check(case, results):
    family, _, options = case
    for result in results:
        assert "error" not in result, result["error"]
        assert result["type"][0] == result["type"][1], result["type"]
        assert result["loss"] <= 1 and result["grad"][0] <= 1 and result["param"][0] <= 1, result
        assert result["norm"][0] <= 1 and result["norm"][1] > CLIP and result["clipped"][0] <= 1, result  # clipped
        expected = {**options["degrees"], "pp": options["degrees"].get("pp", 1)}
        assert {k: v for k, v in result["degrees"].items() if k in expected} == expected, result["degrees"]
    assert set().union(*(r["held"] for r in results)) == set(results[0]["all"])  # every parameter lives somewhere


def test_unmodified_models_train_as_one_process():
    by_rank = run_local(_all_cases, 4, timeout_s=1200)
    check_every_case(
        CASES, [{"ranks": list(r)} for r in zip(*(cases for cases, _ in by_rank))], lambda c, r: _check(c, r["ranks"])
    )
    for _, other in by_rank:
        assert "error" not in other, other
        assert other["sizes"][0] <= 1 and other["sizes"][1] <= 1, other
        assert other["padding"][0] <= 1 and other["padding"][1] <= 1, other
        assert other["outside"] <= 1, other
        assert "first output is its scalar loss" in other["train_step"], other
        assert "'input_ids'" in other["odd"] and "divisible by 4" in other["odd"], other
