"""Models that are not causal language models, unmodified, on 2 gloo ranks: encoders, encoder-decoders,
vision and audio models and their heads, and a convolutional network with BatchNorm.

    python benchmarks/other_models.py [--only bert,t5] [--quick]

Each is a Hugging Face model built from a small config, autopar's examples/cnn.py or a model
written with torch alone (``MODELS``; dropout and stochastic depth as configured, but T5's and
wav2vec 2.0's dropout, off: their free plans pipeline, and a pipeline draws each microbatch's masks
on its own; and wav2vec 2.0's LayerDrop and time masking, branches on Python-drawn random numbers
that no captured graph holds). ``autopar.parallelize(model, 2)`` plans it with no example inputs
(autopar makes the call from the config: token ids, images or audio, and labels of the shape the
head takes; the torch-only model, which has no config, is given its batch as ``example_kwargs``),
pinned to dp=2 (DP2) or tp=2 (TP2), or free (auto); then one step as a script takes it
(``pmodel(**batch).loss.backward()``, AdamW) against the same step in one process, the random
stream where it was before ``parallelize`` (dropout masks are the ones one process draws). ✓: the
loss, every full gradient, every parameter after the step and every floating buffer (BatchNorm's
running statistics) allclose (rtol 1e-4, atol 1e-6). Writes the "other-models" section of
BENCHMARKS.md (``--quick`` prints only).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
import warnings
from datetime import date
from pathlib import Path

import torch
from tabulate import tabulate

import autopar

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PLANS = {"DP2": {"degrees": {"dp": 2}}, "TP2": {"degrees": {"tp": 2}}, "auto": {}}
BATCH, SEQ, LR, EPS = 8, 32, 1e-4, 1e-6
TEXT = dict(vocab_size=128, max_position_embeddings=64)
ENCODER = dict(TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
SEQ2SEQ = dict(
    TEXT, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128,
)  # fmt: skip
IMAGE = 32


def _tokens(generator, high: int = 128, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, high, (BATCH, seq), generator=generator)


def _classes(generator, count: int) -> torch.Tensor:
    return torch.randint(0, count, (BATCH,), generator=generator)


def _images(generator) -> torch.Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)


# name → (what it is, transformers class, config class, config, batch from a generator)
MODELS = {
    "bert": ("encoder, masked LM", "BertForMaskedLM", "BertConfig", ENCODER,
             lambda g: {"input_ids": (t := _tokens(g)), "labels": t.masked_fill(t % 3 == 0, -100)}),
    "bert-cls": ("encoder, sequence classification", "BertForSequenceClassification", "BertConfig",
                 dict(ENCODER, num_labels=3), lambda g: {"input_ids": _tokens(g), "labels": _classes(g, 3)}),
    "roberta-tokens": ("encoder, token classification", "RobertaForTokenClassification", "RobertaConfig",
                       dict(ENCODER, max_position_embeddings=80, num_labels=5),
                       lambda g: {"input_ids": _tokens(g), "labels": torch.randint(0, 5, (BATCH, SEQ), generator=g)}),
    "distilbert-cls": ("encoder, sequence classification", "DistilBertForSequenceClassification",
                       "DistilBertConfig", dict(TEXT, dim=64, n_layers=2, n_heads=4, hidden_dim=128),
                       lambda g: {"input_ids": _tokens(g), "labels": _classes(g, 2)}),
    "llama-cls": ("decoder, sequence classification (last token's score)", "LlamaForSequenceClassification",
                  "LlamaConfig", dict(ENCODER, num_key_value_heads=2, num_labels=3, pad_token_id=0),
                  lambda g: {"input_ids": _tokens(g), "labels": _classes(g, 3)}),
    "t5": ("encoder-decoder, relative position bias", "T5ForConditionalGeneration", "T5Config",
           dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
                dropout_rate=0.0),
           lambda g: {"input_ids": _tokens(g), "labels": _tokens(g, seq=16)}),
    "bart": ("encoder-decoder, learned positions", "BartForConditionalGeneration", "BartConfig", SEQ2SEQ,
             lambda g: {"input_ids": _tokens(g), "labels": _tokens(g, seq=16)}),
    "vit": ("vision transformer, image classification", "ViTForImageClassification", "ViTConfig",
            dict(ENCODER, image_size=IMAGE, patch_size=8, num_labels=10),
            lambda g: {"pixel_values": _images(g), "labels": _classes(g, 10)}),
    "swin": ("windowed vision transformer, stochastic depth", "SwinForImageClassification", "SwinConfig",
             dict(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                  num_labels=10), lambda g: {"pixel_values": _images(g), "labels": _classes(g, 10)}),
    "convnext": ("convolutional, LayerNorm", "ConvNextForImageClassification", "ConvNextConfig",
                 dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
                 lambda g: {"pixel_values": _images(g), "labels": _classes(g, 10)}),
    "resnet": ("convolutional, BatchNorm", "ResNetForImageClassification", "ResNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
               lambda g: {"pixel_values": _images(g), "labels": _classes(g, 10)}),
    "whisper": ("speech encoder-decoder (mel features)", "WhisperForConditionalGeneration", "WhisperConfig",
                dict(SEQ2SEQ, num_mel_bins=16, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                lambda g: {"input_features": torch.randn(BATCH, 16, 32, generator=g), "labels": _tokens(g, seq=16)}),
    "wav2vec2-cls": ("speech encoder (raw audio), classification", "Wav2Vec2ForSequenceClassification",
                     "Wav2Vec2Config", dict(ENCODER, vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 2),
                                            conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                            num_conv_pos_embedding_groups=4, num_labels=4,
                                            layerdrop=0.0, mask_time_prob=0.0,  # Python-random branches
                                            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                            final_dropout=0.0),
                     lambda g: {"input_values": torch.randn(BATCH, 400, generator=g), "labels": _classes(g, 4)}),
    "clip": ("dual encoder, contrastive loss over the batch", "CLIPModel", "CLIPConfig",
             dict(text_config=dict(TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                  vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=IMAGE, patch_size=8), projection_dim=32),
             lambda g: {"input_ids": _tokens(g), "pixel_values": _images(g), "return_loss": True}),
    "examples/cnn.py": ("autopar's ResNet, BatchNorm", "cnn", None, dict(width=16, blocks=1, stages=2),
                        lambda g: {"images": _images(g)[:, :, :16, :16], "labels": _classes(g, 10)}),
    "torch.nn.Transformer": ("torch's own encoder (batch first, dropout), a plain nn.Module", "encoder", None,
                             dict(hidden=64, heads=4, layers=2),
                             lambda g: {"tokens": _tokens(g), "labels": _tokens(g)}),
}  # fmt: skip


class _TorchEncoder(torch.nn.Module):
    """``torch.nn.TransformerEncoder`` between an embedding and a head: a model written with torch
    alone (its multi-head attention's batch-first output is transposed, and dropped out)."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab: int = 128, dropout: float = 0.1):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.embed(tokens)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(name: str, dropout: bool = True) -> tuple[torch.nn.Module, dict]:
    """The model (seed 0) and the batch (seed 1) of ``name``; without ``dropout``, every dropout,
    stochastic depth and LayerDrop probability its config holds is 0."""
    _, model_class, config_class, sizes, batch = MODELS[name]
    torch.manual_seed(0)
    if model_class == "cnn":
        spec = importlib.util.spec_from_file_location("cnn", EXAMPLES / "cnn.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.build(**sizes)
    elif model_class == "encoder":
        model = _TorchEncoder(**sizes, dropout=0.1 if dropout else 0.0)
    else:
        import transformers

        config = getattr(transformers, config_class)(**sizes)
        for key, value in vars(config).items() if not dropout else ():
            if isinstance(value, float) and any(mark in key for mark in ("dropout", "drop_path", "layerdrop")):
                setattr(config, key, 0.0)
        model = getattr(transformers, model_class)(config)
    return model, batch(torch.Generator().manual_seed(1))


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """As :func:`families.relative` (not imported: the tests load this file without benchmarks/ on the path)."""
    value, reference = value.detach().float(), reference.detach().float()
    return ((value - reference).abs() / (1e-6 + 1e-4 * reference.abs())).max().item()


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def one_step(name: str, pins: dict, device: str = "cpu") -> dict:
    """One training step of ``name`` under ``pins`` (``mesh``: 2 ranks unless given) against one
    process (see the module docstring), on ``device`` (the runtime's, by its process group's
    backend); on a GPU without dropout: its fused attention draws masks no other program can draw."""
    model, batch = build(name, dropout=device == "cpu")
    pins = dict(pins)
    if not hasattr(model, "config") and not hasattr(model, "example_inputs"):
        pins["example_kwargs"] = batch  # a call autopar cannot make for a plain module
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    stream = torch.get_rng_state()  # the reference draws its dropout where the script's stream was
    started = time.perf_counter()
    pmodel = autopar.parallelize(model, pins.pop("mesh", 2), **pins)
    planned = time.perf_counter() - started
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
    loss = _loss(pmodel(**batch))
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pmodel.named_parameters() if p.grad is not None}
    optimizer.step()
    model.to(device)
    reference_optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    torch.set_rng_state(stream)
    reference = _loss(model(**batch))
    reference.backward()
    reference_optimizer.step()
    buffers = dict(model.named_buffers())
    # a pipeline's rank holds its stages' parameters only: each rank checks those it holds, and
    # together they hold every one (``held``)
    worst = max(
        [relative(loss, reference)]
        + [relative(grads[n], model.get_parameter(n).grad) for n in grads]
        + [relative(p.full_tensor(), model.get_parameter(n)) for n, p in pmodel.named_parameters()]
        + [relative(b, buffers[n]) for n, b in pmodel.named_buffers() if b.is_floating_point() and n in buffers]
    )
    degrees = {axis: size for axis, size in pmodel.plan.degrees.items() if size > 1}
    if pmodel.plan.schedule.stages > 1:
        degrees["pp"] = pmodel.plan.schedule.stages
    held = sorted(name for name, _ in pmodel.named_parameters())
    return {"ok": worst <= 1, "worst": worst, "degrees": degrees, "plan_s": planned, "held": held}


def run_models(rank: int, world: int, names: list[str], plans: dict = PLANS) -> list[dict]:
    """On each rank: every model under every plan; a case that raises gives its error."""
    warnings.simplefilter("ignore")
    logging.getLogger("autopar").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = []
    for name in names:
        row = {"model": name}
        for label, pins in plans.items():
            try:
                row[label] = one_step(name, dict(pins))
            except Exception as error:  # noqa: BLE001  (the row says why)
                text = str(error).strip().splitlines()
                row[label] = {"ok": False, "error": f"{type(error).__name__}: {text[0] if text else ''}"}
        rows.append(row)
    return rows


def check_on(device: str) -> list[dict]:
    """Every model through ``autopar.parallelize(model, 1)`` on one rank of ``device`` (its process
    group's backend), fp32 (no TF32 convolutions), without dropout: one step against the model."""
    rows, tf32 = [], torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for name in MODELS:
            try:
                rows.append({"model": name, **one_step(name, {"mesh": 1, "precision": "fp32"}, device)})
            except Exception as error:  # noqa: BLE001  (the row says why)
                rows.append({"model": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:500]})
    finally:
        torch.backends.cudnn.allow_tf32 = tf32  # the caller's setting, as it was
    return rows


def worst_over_ranks(results, name: str) -> dict:
    """The rank's result that fails, or the one furthest from one process; failing too where no
    rank holds some parameter."""
    results = list(results)
    worst = max(results, key=lambda r: ("error" in r, not r["ok"], r.get("worst", 0.0)))
    if "error" not in worst:
        model, _ = build(name)
        held = set().union(*(r["held"] for r in results))
        worst = {**worst, "ok": worst["ok"] and held >= {n for n, _ in model.named_parameters()}}
    return worst


def _cell(result: dict) -> str:
    if "error" in result:
        return "✗ " + result["error"][:80]
    degrees = " x ".join(f"{axis}{size}" for axis, size in result["degrees"].items()) or "one rank's work"
    return f"{'✓' if result['ok'] else '✗'} {degrees} ({result['plan_s']:.0f} s)"


def main() -> None:
    from publish import publish  # (run as a script: its folder is on the path; the tests import this file)

    from autopar.runtime.spawn import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated names of MODELS")
    parser.add_argument("--quick", action="store_true", help="print, do not write BENCHMARKS.md")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    started = time.perf_counter()
    by_rank = run_local(run_models, 2, names, timeout_s=3600)
    elapsed = time.perf_counter() - started
    rows = [{"model": ranks[0]["model"], **{label: worst_over_ranks((r[label] for r in ranks), ranks[0]["model"])
                                            for label in PLANS}} for ranks in zip(*by_rank)]  # fmt: skip
    table = [[row["model"], MODELS[row["model"]][0], *(_cell(row[label]) for label in PLANS)] for row in rows]
    passing = sum(all(row[label]["ok"] for label in PLANS) for row in rows)
    body = f"""## Other models: encoders, encoder-decoders, vision, audio and torch-only, unmodified, on 2 ranks

`python benchmarks/other_models.py` ({date.today()}, this machine: 2 shared cores, 2 gloo ranks,
{elapsed / 60:.0f} min). Each is a Hugging Face model built from a small config (`MODELS` in the
script), autopar's `examples/cnn.py`, or torch's own `nn.TransformerEncoder` between an embedding and a
head; dropout and stochastic depth as configured, but T5's and wav2vec 2.0's dropout, off: their free plans
pipeline, and a pipeline draws each microbatch's masks on its own (README); and wav2vec 2.0's LayerDrop and
time masking, branches on Python-drawn random numbers that no captured graph holds.
`autopar.parallelize(model, 2)` plans it with no example inputs (the call made from the config: token ids,
images or audio, labels of the shape the head takes; the torch-only model, with no config, is given its
batch), pinned to dp=2 (DP2) or tp=2 (TP2), or free (auto: the degrees it chose); one step as a script
takes it (`pmodel(**batch).loss.backward()`, AdamW) against one process. ✓: the loss, every full gradient,
every parameter after the step and every floating buffer (BatchNorm's running statistics) allclose (rtol
1e-4, atol 1e-6); the seconds are planning's. BatchNorm in training is decomposed into its means, so its
statistics are the whole batch's on every plan (synchronized batch norm), and its models plan no pipeline
or microbatches. **{passing} of {len(rows)} models pass every plan.**

{tabulate(table, headers=["model", "kind", *PLANS], tablefmt="github")}
"""
    publish("other-models", body, args.quick)


if __name__ == "__main__":
    main()
