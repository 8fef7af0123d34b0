"""Tiny random decoders of the families transformers ships and vLLM registers, built from
transformers' own configs (hidden 64, 2 layers, 4 query and 2 KV heads of dim 16 where the
family has attention, vocab 100, ``initializer_range`` 0.2: weights large enough that every
layer moves the log-probs), each with the layer kinds that make it that family: a recurrent
layer and an attention layer for hybrids, experts where the family has them."""

import transformers as tf

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

RECURRENT = {
    "lfm2": lambda: tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"]),
    "lfm2_moe": lambda: tf.Lfm2MoeConfig(
        **SMALL,
        layer_types=["conv", "full_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        num_dense_layers=1,
        moe_intermediate_size=32,
    ),
    "falcon_h1": lambda: tf.FalconH1Config(
        **SMALL,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=4,
    ),
    "mamba": lambda: tf.MambaConfig(**NO_ATTENTION, state_size=8),
    "mamba2": lambda: tf.Mamba2Config(
        **NO_ATTENTION, num_heads=8, head_dim=16, state_size=8, chunk_size=4, n_groups=1
    ),
    "falcon_mamba": lambda: tf.FalconMambaConfig(**NO_ATTENTION, state_size=8),
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
    "jamba": lambda: tf.JambaConfig(
        **SMALL,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
    ),
    "granite_scaled": lambda: tf.GraniteConfig(**SMALL, logits_scaling=4.0),
}
"""Families the tree cannot compute (a recurrent state, a head it does not apply): they train
on the per-sample forward."""
