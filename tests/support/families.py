"""Tiny random decoders of the families transformers ships and vLLM registers, built from
transformers' own configs (hidden 64, 2 layers, 4 query and 2 KV heads of dim 16 where the
family has attention, vocab 100, ``initializer_range`` 0.2: weights large enough that every
layer moves the log-probs), each with the layer kinds that make it that family: a recurrent
layer and an attention layer for hybrids, experts where the family has them."""

import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

SMALL = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
NO_ATTENTION = dict(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)

SHORT_CONVOLUTIONS = {
    "lfm2": lambda: tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"]),
    "lfm2_moe": lambda: tf.Lfm2MoeConfig(
        **SMALL,
        layer_types=["conv", "full_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        num_dense_layers=1,
        moe_intermediate_size=32,
    ),
}
"""LFM2's gated short convolutions: the tree computes them along each token's path."""

MAMBA2 = {
    "falcon_h1": lambda: tf.FalconH1Config(
        **SMALL,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=4,
    ),
    "mamba2": lambda: tf.Mamba2Config(
        **NO_ATTENTION, num_heads=8, head_dim=16, state_size=8, chunk_size=4, n_groups=1
    ),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
        **SMALL,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_chunk_size=4,
        num_local_experts=2,
        num_experts_per_tok=1,
    ),
    "nemotron_h": lambda: tf.NemotronHConfig(
        **SMALL,
        hybrid_override_pattern="M*",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        chunk_size=4,
        n_groups=1,
    ),
    "bamba": lambda: tf.BambaConfig(
        **SMALL,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_chunk_size=4,
    ),
}
"""Mamba-2 hybrids: the tree forks their convolution and scan at the trie's branch points."""

PER_SAMPLE = {
    "mamba": lambda: tf.MambaConfig(**NO_ATTENTION, state_size=8),
    "falcon_mamba": lambda: tf.FalconMambaConfig(**NO_ATTENTION, state_size=8),
    "jamba": lambda: tf.JambaConfig(
        **SMALL,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
    ),
    "granite_scaled": lambda: tf.GraniteConfig(**SMALL, logits_scaling=4.0),
    "zamba2": lambda: tf.Zamba2Config(
        **SMALL,
        layers_block_type=["linear_attention", "hybrid"],
        mamba_d_state=8,
        mamba_headdim=16,
        n_mamba_heads=8,
        chunk_size=4,
        adapter_rank=8,
    ),
}
"""Families the tree cannot compute (a recurrent state it does not fork, a head it does not
apply): they train on the per-sample forward."""

RECURRENT = {**MAMBA2, **PER_SAMPLE}
"""Every family above with a recurrent layer or a head of its own."""


GENERIC = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=4,
    attention_chunk_size=4,
    # experts: four, two per token, a shared one, the first layer dense where the family says
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    moe_topk=2,
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_ffn_hidden_size=32,
    zero_expert_num=2,
    num_layers=1,  # LongCat-Flash: each layer has two attention sublayers
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    v_head_dim=16,
    # other names of the same sizes
    ffn_hidden_size=64,
    n_inner=64,
    ffn_dim=64,
    word_embed_proj_dim=64,
    num_kv_heads=2,
    rotary_dim=8,
    n_embd=64,
    n_layer=2,
    n_head=4,
)
"""Sizes given to any family's text config that has the setting (by name)."""

BY_HAND = {
    "dbrx": lambda: tf.DbrxConfig(
        d_model=64,
        n_heads=4,
        n_layers=2,
        vocab_size=100,
        initializer_range=0.2,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "gemma3n_text": lambda: tf.Gemma3nTextConfig(
        **{**SMALL, "intermediate_size": [64, 64]},
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        num_kv_shared_layers=0,
        vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=8,
        laurel_rank=8,
        activation_sparsity_pattern=[0.0, 0.0],
    ),
    "qwen4_exp_text": lambda: tf.Qwen4ExpTextConfig(
        **SMALL,
        head_dim=16,
        layer_types=["linear_attention", "indexed_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=8,
        ple_embed_dim=16,
        heads_per_ngram=2,
        ngram_vocab_size_base=256,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=2,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
    ),
}
"""Families whose sizes :data:`GENERIC` cannot set (nested or per-layer settings)."""


def tiny_text_config(model_type: str):
    """``model_type``'s text config with :data:`GENERIC`'s sizes where it has those settings,
    and one layer of each of its layer types (two at least); the hand-written configs of
    :data:`RECURRENT`, :data:`SHORT_CONVOLUTIONS` and :data:`BY_HAND` come first where they
    exist."""
    default = CONFIG_MAPPING[model_type]().get_text_config()
    for named in (model_type, default.model_type):  # a vision-language family: its text model
        for configs in (RECURRENT, SHORT_CONVOLUTIONS, BY_HAND):
            if named in configs:
                return configs[named]()
    settings = default.to_dict()
    kwargs = {key: value for key, value in GENERIC.items() if key in settings}
    if "kv_lora_rank" in settings:  # MLA: RoPE on each head's rope part, a key per head
        kwargs["head_dim"] = GENERIC["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = GENERIC["num_attention_heads"]
    if settings.get("layer_types"):
        kinds = list(dict.fromkeys(settings["layer_types"]))
        kinds += kinds[:1] * (2 - len(kinds))
        kwargs.update(layer_types=kinds, num_hidden_layers=len(kinds))
    return type(default)(**kwargs)


def served_families() -> dict[str, str]:
    """``{model type: causal LM class}`` of every family transformers ships a causal LM of
    and vLLM registers that class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm import ModelRegistry

    served = set(ModelRegistry.get_supported_archs())
    return {
        model_type: name
        for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
        if isinstance(name, str) and name in served
    }
