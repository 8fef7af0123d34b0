"""Every layer the tree-packed forward cannot compute is refused up front, naming the model
type, the layer class and why; supported architectures pass."""

import pytest
import torch
import transformers as tf
from datasets import Dataset
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.kernels.architecture_support import (
    UnsupportedArchitectureError,
    check_tree_packing_support,
)
from asyncgrpo.adapters.kernels.attention import enable_tree_attention, tree_attention_forward
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
    ],
    ids=lambda c: c.model_type,
)
def test_full_attention_and_gated_deltanet_are_supported(config) -> None:
    check_tree_packing_support(build(config))


def test_attention_sinks_are_refused() -> None:
    config = tf.GptOssConfig(
        **SMALL,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"] * 2,
    )
    refused(config, "'gpt_oss'", "GptOssAttention", "attention sinks")


def test_other_state_space_layers_are_refused() -> None:
    config = tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"])
    refused(config, "'lfm2'", "Lfm2ShortConv", "state-space or recurrent", "'conv'")


def test_sliding_window_layers_are_refused() -> None:
    config = tf.Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=16, max_window_layers=0
    )
    refused(config, "'qwen3'", "Qwen3Attention", "'sliding_attention'")


def test_a_model_wide_sliding_window_is_refused() -> None:
    config = tf.MistralConfig(**SMALL, head_dim=16, sliding_window=16)
    refused(config, "'mistral'", "MistralAttention", "sliding_window=16")


def test_attention_logit_soft_capping_is_refused() -> None:
    config = tf.Gemma2Config(
        **SMALL, head_dim=16, layer_types=["full_attention"] * 2, final_logit_softcapping=None
    )
    refused(config, "'gemma2'", "Gemma2Attention", "attn_logit_softcapping=50.0")


def test_final_logit_soft_capping_is_refused() -> None:
    config = tf.Gemma2Config(
        **SMALL, head_dim=16, layer_types=["full_attention"] * 2, attn_logit_softcapping=None
    )
    refused(config, "'gemma2'", "final_logit_softcapping=30.0")


def test_the_attention_function_refuses_sinks_it_is_handed() -> None:
    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="s_aux"):
        tree_attention_forward(
            torch.nn.Linear(1, 1), x, x, x, None, tree_layout=None, s_aux=torch.zeros(2)
        )


def test_the_trainer_refuses_at_construction(tmp_path) -> None:
    model = build(tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"]))
    with pytest.raises(UnsupportedArchitectureError, match="Lfm2ShortConv"):
        AsyncGRPOTrainer(
            model=model,
            reward_funcs=len,
            args=AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1),
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]]}),
        )
