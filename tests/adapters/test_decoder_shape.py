"""The learner's memory decision reads each model's layer as built (asyncgrpo.adapters.models.
fsdp.decoder_shape): its norms over the hidden size and its per-head query/key norms."""

import pytest
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from asyncgrpo.adapters.models.fsdp import decoder_shape

SIZES = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


@pytest.mark.parametrize(
    ("config_class", "model_class", "norms", "qk_norm"),
    [
        (LlamaConfig, LlamaForCausalLM, 2, False),
        (Qwen3Config, Qwen3ForCausalLM, 2, True),
        (Gemma3TextConfig, Gemma3ForCausalLM, 4, True),  # norms before and after each block
    ],
    ids=["llama", "qwen3", "gemma3"],
)
def test_the_shape_follows_the_layer_as_built(config_class, model_class, norms, qk_norm) -> None:
    shape = decoder_shape(model_class(config_class(**SIZES)))
    assert (shape.hidden_norms, shape.qk_norm) == (norms, qk_norm)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads) == (2, 64, 96, 4)
    assert (shape.q_width, shape.kv_width, shape.head_dim) == (128, 64, 32)
