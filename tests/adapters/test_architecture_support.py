"""Every layer the tree-packed forward cannot compute is refused on the tree, naming the model
type, the layer class and why, and sends the model to the per-sample path; only a decoder no
path computes exactly (bidirectional attention) is refused by the trainer; supported
architectures take the tree (their numbers are checked in
test_packed_forward.py, test_hybrid_packed_forward.py and test_packed_attention_parts.py)."""

import pytest
import torch
import transformers as tf
from datasets import Dataset
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.kernels.architecture_support import (
    TrainingPath,
    UnsupportedArchitectureError,
    check_tree_packing_support,
    training_path,
)
from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.models.causal_lm import tiny_config
from asyncgrpo.adapters.models.hybrid import tiny_hybrid_config

SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build(config):
    """The model on the meta device: its classes and config, no weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def refused(config, *fragments: str) -> None:
    model = build(config)
    for check in (check_tree_packing_support, enable_tree_attention):
        with pytest.raises(UnsupportedArchitectureError) as error:
            check(model)
        for fragment in fragments:
            assert fragment in str(error.value)


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("qwen3", 64),
        tiny_config("llama", 64),
        tiny_hybrid_config("qwen3_5", 64),
        tiny_hybrid_config("qwen3_next", 64),
        # sinks and sliding windows (its model class "GptOssModel" is no state-space "SSM")
        tf.GptOssConfig(**SMALL, head_dim=16, num_local_experts=2, num_experts_per_tok=1),
        tf.Qwen3Config(
            **SMALL, head_dim=16, use_sliding_window=True, sliding_window=16, max_window_layers=0
        ),
        tf.MistralConfig(**SMALL, head_dim=16, sliding_window=16),  # a model-wide window
        tf.Gemma2Config(**SMALL, head_dim=16),  # windows, attention and final-logit soft-caps
        tf.Llama4TextConfig(**SMALL, head_dim=16, num_local_experts=2),  # chunked layers
        tf.CohereConfig(**SMALL),  # a logit scale
    ],
    ids=lambda c: c.model_type,
)
def test_supported_layers_and_attention_parts_are_accepted(config) -> None:
    check_tree_packing_support(build(config))


def test_other_state_space_layers_are_refused_on_the_tree_and_take_the_per_sample_path() -> None:
    config = tf.JambaConfig(**SMALL, attn_layer_period=2, attn_layer_offset=1, num_experts=2)
    refused(config, "'jamba'", "JambaMambaMixer", "state-space or recurrent")
    path = training_path(build(config))
    assert path.kind == "per_sample"
    assert any("JambaMambaMixer" in reason for reason in path.reasons)


def test_lfm2_short_convolutions_take_the_tree() -> None:
    config = tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"])
    check_tree_packing_support(build(config))
    assert training_path(build(config)) == TrainingPath("tree")


def test_a_logits_scaling_the_head_does_not_apply_takes_the_per_sample_path() -> None:
    config = tf.GraniteConfig(**SMALL, logits_scaling=4.0)
    refused(config, "'granite'", "logits_scaling=4.0")
    assert training_path(build(config)).kind == "per_sample"


def test_supported_layers_take_the_tree() -> None:
    assert training_path(build(tiny_config("qwen3", 64))) == TrainingPath("tree")


def test_bidirectional_attention_has_no_exact_path() -> None:
    config = tf.Gemma3TextConfig(**SMALL, head_dim=16, use_bidirectional_attention=True)
    refused(config, "'gemma3_text'", "Gemma3Attention", "use_bidirectional_attention=True")
    with pytest.raises(UnsupportedArchitectureError, match="tokens would see their future"):
        training_path(build(config))


def test_the_trainer_refuses_a_model_without_an_exact_path_at_construction(tmp_path) -> None:
    model = build(tf.Gemma3TextConfig(**SMALL, head_dim=16, use_bidirectional_attention=True))
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention"):
        AsyncGRPOTrainer(
            model=model,
            reward_funcs=len,
            args=AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1),
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]]}),
        )
