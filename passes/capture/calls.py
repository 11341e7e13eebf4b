"""How a model is called: its arguments bound by name, an example call when none is given,
and the settings a model is captured under (Hugging Face models: no KV cache, exportable
experts; a custom autograd backward, which export drops, said).

Pre: an ``nn.Module`` (any, or a Hugging Face ``PreTrainedModel`` recognized by duck typing,
with no import of transformers).
Post: :func:`bind_call` turns ``model(*args, **kwargs)`` into one dict of named arguments in
the forward's order (omitted and ``None`` defaults dropped), the form :func:`capture` exports
and the runtime matches calls against; :func:`example_call` is such a dict for planning;
:func:`capture_settings` switches a model, while capturing, to what export can trace.

Why the KV cache goes: a cache is generation state (``DynamicCache``), not a tensor export can
return; training never reads it. Hugging Face's ``use_cache`` is turned off on the config
while capturing, and a call's own ``use_cache`` is dropped (said once, as a warning).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from autopar.ir import ConfigError
from autopar.passes.capture.dropout import attention_dropout_as_math

# Arguments that ask for generation state: never part of a training graph (see the module docstring).
CACHE_ARGUMENTS = ("use_cache",)
# Mixture-of-experts implementations (transformers' ``experts_implementation``) that export to aten
# ops; the default "grouped_mm" exports as one opaque custom op, "eager" loops over data-dependent experts.
EXPORTABLE_EXPERTS = "batched_mm"
_said: set[str] = set()


def say_once(message: str) -> None:
    """A warning logged once per process (to stderr unless logging is set up otherwise; the
    library prints nothing to stdout)."""
    if message not in _said:
        _said.add(message)
        logging.getLogger("autopar").warning("autopar: %s", message)


def bind_call(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``model(*args, **kwargs)``'s arguments by name, in the forward's order; arguments left at
    a ``None`` default (or passed as ``None``) and cache switches are dropped.

    >>> bind_call(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}).keys()
    dict_keys(['input'])
    """
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise ConfigError(f"{type(model).__name__}.forward{signature} cannot take this call: {error}") from None
    named = {}
    for name, value in bound.arguments.items():
        parameter = signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ConfigError(
                    f"{type(model).__name__}.forward takes *{name}: autopar binds every input by name; pass "
                    "them as keywords of a forward with named parameters"
                )
            continue
        items = value.items() if parameter.kind is inspect.Parameter.VAR_KEYWORD else [(name, value)]
        for key, item in items:
            if key in CACHE_ARGUMENTS and _caches(model):
                if item:
                    say_once(f"{type(model).__name__}: {key}={item!r} ignored; a parallelized model keeps no cache")
                continue
            if item is not None:
                named[key] = item
    return named


def example_call(model: nn.Module, batch: int, seq: int) -> dict:
    """A call to plan with: ``model.example_inputs(batch)`` (autopar's examples), or, for a
    Hugging Face model, its main input made from its config (:func:`_main_input`: token ids,
    images or audio) and, when its forward takes them, ``labels`` of the shape its head's name says
    (:func:`_labels`); a contrastive dual encoder (CLIP, SigLIP: a text and a vision config, a
    forward taking ``return_loss``) both its inputs and its loss. ``ConfigError`` when the model
    offers neither."""
    if callable(getattr(model, "example_inputs", None)):
        return bind_call(model, tuple(model.example_inputs(batch)), {})
    config = getattr(model, "config", None)
    parameters = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    text, vision = (getattr(config, f"{part}_config", None) for part in ("text", "vision"))
    if text is not None and vision is not None and {"input_ids", "pixel_values", "return_loss"} <= set(parameters):
        tokens, images = _tokens(text, batch, seq, generator), _images(vision, batch, generator)
        return {"input_ids": tokens.to(device), "pixel_values": images.to(device), "return_loss": True}
    main = _main_input(model, config, batch, seq, generator) if config is not None else None
    if main is not None and main[0] in parameters:
        call = {main[0]: main[1]}
        labels = _labels(type(model).__name__, config, main[1], seq, generator) if "labels" in parameters else None
        if labels is not None:
            call["labels"] = labels
        return {name: value.to(device) for name, value in call.items()}
    raise ConfigError(
        f"autopar cannot tell how to call {type(model).__name__} to plan it: pass example_inputs=(...) and/or "
        "example_kwargs={...} (the GLOBAL batch), or give the model an example_inputs(batch_size) method"
    )


IMAGE_SIZE = 224  # ImageNet's, for a vision config that does not say (ResNet's, ConvNeXt's)
AUDIO_SAMPLES = 16000  # a second of raw audio at 16 kHz (wav2vec 2.0's, HuBERT's rate)


def _main_input(model: nn.Module, config, batch: int, seq: int, generator) -> tuple[str, torch.Tensor] | None:
    """A Hugging Face model's main input (``main_input_name``) made from its config: ``input_ids``
    of ``[batch, seq]`` random tokens (``seq`` capped by the model's positions), ``pixel_values`` of
    its image size, Whisper's ``input_features`` (its mel bins over twice its encoder positions) or
    raw ``input_values``; None for another, or where the config lacks the sizes."""
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids" and isinstance(getattr(config, "vocab_size", None), int):
        return name, _tokens(config, batch, seq, generator)
    if name == "pixel_values":
        return name, _images(config, batch, generator)
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if name == "input_features" and isinstance(bins, int) and isinstance(positions, int):
        return name, torch.randn(batch, bins, 2 * positions, generator=generator)
    if name == "input_values":
        return name, torch.randn(batch, AUDIO_SAMPLES, generator=generator)
    return None


def _tokens(config, batch: int, seq: int, generator) -> torch.Tensor:
    """``[batch, seq]`` random tokens of the config's vocabulary, ``seq`` capped by its positions."""
    seq = min(seq, (config_positions(config) or (None, seq))[1])
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator)


def _images(config, batch: int, generator) -> torch.Tensor:
    """Random images of the config's size (ImageNet's where it says none) and channels."""
    size = getattr(config, "image_size", IMAGE_SIZE)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return torch.randn(batch, getattr(config, "num_channels", 3), height, width, generator=generator)


def _labels(head: str, config, main: torch.Tensor, seq: int, generator) -> torch.Tensor | None:
    """Labels as Hugging Face's heads take them, told by the head's class name: one class per
    example for ``...ForSequenceClassification`` / ``ForImageClassification`` / ``ForAudioClassification``
    (a float score where ``num_labels`` is 1: regression), one per token for
    ``...ForTokenClassification``; for a language-model head the tokens themselves, or, on images
    or audio, ``[batch, seq]`` tokens (capped by the decoder's positions); None without a vocabulary."""
    classes = getattr(config, "num_labels", 2)
    if head.endswith("TokenClassification"):
        return torch.randint(0, classes, main.shape[:2], generator=generator)
    if head.endswith("Classification"):
        if classes == 1:
            return torch.randn(main.shape[0], generator=generator)
        return torch.randint(0, classes, main.shape[:1], generator=generator)
    if not main.is_floating_point():
        return main
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    seq = min(seq, getattr(config, "max_target_positions", seq))
    return torch.randint(0, vocab, (main.shape[0], seq), generator=generator)


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")


def config_positions(config) -> tuple[str, int] | None:
    """The longest sequence the model's config allows and the field that says so, when one does
    (text sub-configs included; the name differs by family: ``max_seq_len`` is MPT's)."""
    for source in (config, getattr(config, "text_config", None)):
        for name in POSITION_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return name, value
    return None


def _caches(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "use_cache")


def _configs(model: nn.Module) -> list:
    """Every distinct config object of the model's modules: an encoder-decoder's decoder reads a
    copy of its own (T5's), which the top-level ``use_cache`` does not reach."""
    configs = (getattr(module, "config", None) for module in model.modules())
    return list({id(config): config for config in configs if config is not None}.values())


@contextmanager
def capture_settings(model: nn.Module):
    """While active: no KV cache (``use_cache = False`` on every config of the model), attention's
    dropout as its math form (:func:`autopar.passes.capture.dropout.attention_dropout_as_math`),
    mixture-of-experts blocks on transformers' exportable ``batched_mm`` implementation, and
    torch.distributions' argument checks off (data-dependent asserts, e.g. in Hugging Face's BLT);
    all restored on exit."""
    with ExitStack() as stack:
        caching = [config for config in _configs(model) if getattr(config, "use_cache", False)]
        if caching:
            say_once(f"{type(model).__name__}: captured with use_cache=False (a KV cache is generation state)")
        for config in caching:
            stack.enter_context(_attribute(config, "use_cache", False))
        if _uses_unexportable_experts(model):
            previous = model.get_experts_implementation()
            model.set_experts_implementation(EXPORTABLE_EXPERTS)
            stack.callback(model.set_experts_implementation, previous)
        validate = torch.distributions.Distribution._validate_args
        torch.distributions.Distribution.set_default_validate_args(False)
        stack.callback(torch.distributions.Distribution.set_default_validate_args, validate)
        stack.enter_context(_custom_backwards_said())
        stack.enter_context(attention_dropout_as_math())
        yield model


@contextmanager
def _custom_backwards_said():
    """While active, notes each ``torch.autograd.Function`` with a backward of its own that the
    forward applies to a tensor needing a gradient; says so on exit. torch.export traces such a
    Function's forward and drops its backward (pytorch/pytorch#106388), so the captured program
    differentiates the forward instead: the gradients differ wherever that backward is not the
    forward's derivative (a sampled, clipped or straight-through gradient)."""
    function = torch.autograd.Function
    apply, found = function.__dict__["apply"], {}

    def noting(cls, *args, **kwargs):
        # a custom op's own autograd (torch.library) stays with its op, one node in the graph
        own = not cls.__module__.startswith("torch._library") and (
            cls.backward is not function.backward or cls.vjp is not function.vjp
        )
        if own and torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args):
            caller = inspect.currentframe().f_back  # the model's line applying it
            found.setdefault(cls.__qualname__, f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return apply.__func__(cls, *args, **kwargs)

    function.apply = classmethod(noting)
    try:
        yield
    finally:
        function.apply = apply
    for name, where in found.items():
        say_once(
            f"{name} ({where}) is a torch.autograd.Function with a backward of its own, which torch.export "
            "drops: autopar's program differentiates its forward instead, so the gradients differ wherever that "
            "backward is not the forward's derivative (a sampled, clipped or straight-through gradient)"
        )


def _uses_unexportable_experts(model: nn.Module) -> bool:
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if not callable(can_set) or not can_set():  # transformers: a model without switchable experts
        return False
    return any(value not in (None, EXPORTABLE_EXPERTS) for value in model.get_experts_implementation().values())


@contextmanager
def _attribute(owner, name: str, value):
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)
