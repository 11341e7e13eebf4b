"""The call autopar plans a Hugging Face model with when given none, for its kind of input and head;
and the KV cache off on every config of an encoder-decoder while capturing."""

import pytest
import torch
import transformers

from autopar.ir import ConfigError
from autopar.passes.capture.calls import capture_settings, example_call
from autopar.passes.capture.graph import capture

ENCODER = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _meta(model_class: str, config_class: str, config: dict | None = None, **more):
    config = {**(config or {}), **more}
    with torch.device("meta"):
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=100, n_positions=24, n_embd=32, n_layer=1, n_head=2)),
         {"input_ids": ((8, 24), torch.int64), "labels": ((8, 24), torch.int64)}),
        (("BertForSequenceClassification", "BertConfig", dict(ENCODER, num_labels=3)),
         {"input_ids": ((8, 256), torch.int64), "labels": ((8,), torch.int64)}),
        (("BertForSequenceClassification", "BertConfig", dict(ENCODER, num_labels=1)),  # regression
         {"input_ids": ((8, 256), torch.int64), "labels": ((8,), torch.float32)}),
        (("BertForTokenClassification", "BertConfig", dict(ENCODER, num_labels=5)),
         {"input_ids": ((8, 256), torch.int64), "labels": ((8, 256), torch.int64)}),
        (("ViTForImageClassification", "ViTConfig", dict(ENCODER, image_size=48, patch_size=16)),
         {"pixel_values": ((8, 3, 48, 48), torch.float32), "labels": ((8,), torch.int64)}),
        (("ResNetForImageClassification", "ResNetConfig", dict(hidden_sizes=[8], depths=[1], embedding_size=8)),
         {"pixel_values": ((8, 3, 224, 224), torch.float32), "labels": ((8,), torch.int64)}),  # no size: ImageNet's
        (("WhisperForConditionalGeneration", "WhisperConfig",
          dict(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, num_mel_bins=16, max_source_positions=20, max_target_positions=40,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
         {"input_features": ((8, 16, 40), torch.float32), "labels": ((8, 40), torch.int64)}),
    ],
)  # fmt: skip
def test_the_planning_call_follows_the_input_and_the_head(model, expected):
    call = example_call(_meta(*model), 8, 256)
    assert {name: (tuple(value.shape), value.dtype) for name, value in call.items()} == expected


def test_a_contrastive_dual_encoder_is_called_with_both_inputs_and_its_loss():
    text = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32)
    call = example_call(_meta("CLIPModel", "CLIPConfig", text_config=text, vision_config=vision), 8, 256)
    assert call.pop("return_loss") is True
    assert {name: (tuple(value.shape), value.dtype) for name, value in call.items()} == {
        "input_ids": ((8, 16), torch.int64), "pixel_values": ((8, 3, 32, 32), torch.float32)
    }  # fmt: skip


def test_a_model_autopar_cannot_call_says_what_to_pass():
    with pytest.raises(ConfigError, match=r"cannot tell how to call Linear .*example_inputs"):
        example_call(torch.nn.Linear(2, 2), 8, 16)


def test_an_encoder_decoder_is_captured_with_the_cache_off_on_its_decoders_own_config():
    model = _meta(
        "T5ForConditionalGeneration", "T5Config",
        vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0,
    )  # fmt: skip
    assert model.decoder.config is not model.config and model.decoder.config.use_cache
    with capture_settings(model):
        assert not model.config.use_cache and not model.decoder.config.use_cache
    assert model.decoder.config.use_cache  # restored
    captured = capture(model, (), example_call(model, 4, 16))  # returns no cache, which export cannot
    assert captured.out_spec.num_leaves >= 2  # the loss and the logits (the encoder's state too)
