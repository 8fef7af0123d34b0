"""Model FLOPs of a training step and the model FLOPs utilisation (``perf/fwd_bwd_mfu``).

Counted per forwarded row, as the model computes it (tree packing included: a shared prompt
is forwarded, and counted, once):

* linear layers: ``2 x linear_params`` FLOPs per forwarded token (a multiply and an add per
  weight), over the decoder layers' linear weights;
* the LM head: ``2 x hidden x vocab`` per trained position (the learner computes logits only
  where a trained token is predicted);
* attention: ``4 x heads x head_dim`` per (query, key) pair the tree mask allows, per layer
  (``Q K^T`` and ``P V``), counting the pairs of each row exactly;
* backward: twice the forward, so a forward and backward step is ``3 x`` the forward.

Recomputation under gradient checkpointing is not counted (model FLOPs, not hardware FLOPs),
so MFU does not rise when checkpointing makes a step slower. The peak is the device's dense
peak for the training dtype from :data:`GPU_PEAK_FLOPS`; on a CPU (or an unlisted GPU) the
shell measures one with a matmul at start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

GPU_PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    # (name substring, dense bf16 FLOP/s, fp32 FLOP/s without TF32), vendor datasheets;
    # the first match wins, so the more specific names come first.
    ("H100 PCIe", 756e12, 51e12),
    ("H200", 989e12, 67e12),
    ("H100", 989e12, 67e12),
    ("GH200", 989e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10", 125e12, 31.2e12),
    ("RTX 4090", 165e12, 82.6e12),
)


@attrs.frozen
class ModelShape:
    """What the FLOP count needs from a decoder model.

    Attributes:
        linear_params: weights of the decoder layers' linear maps (attention projections and
            MLP), all layers together; the LM head excluded.
        layers: decoder layers with softmax attention.
        heads: query heads per layer.
        head_dim: width of a head.
        hidden: the residual width (input of the LM head).
        vocab: rows of the LM head.
    """

    linear_params: int
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int


def model_shape(config: Any) -> ModelShape:
    """A decoder's shape from its config: a transformers config or ``config.json`` as a
    mapping (dense MLPs, or MoE with the experts a token is routed to); linear-attention layers
    are counted as softmax attention.

    Example:
        >>> model_shape({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100})
        ModelShape(linear_params=73728, layers=2, heads=4, head_dim=16, hidden=64, vocab=100)
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    elif isinstance(config, Mapping) and config.get("text_config"):
        config = config["text_config"]

    def get(name: str) -> Any:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim") or hidden // heads)
    kv_heads = int(get("num_key_value_heads") or heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = int(get("num_experts_per_tok") or 0)
    moe_width = int(get("moe_intermediate_size") or 0)
    mlp = (
        3
        * hidden
        * (experts * moe_width if experts and moe_width else int(get("intermediate_size")))
    )
    layers = int(get("num_hidden_layers"))
    return ModelShape(
        linear_params=layers * (attention + mlp),
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=int(get("vocab_size")),
    )


def query_key_pairs(
    cu_seqlens_q: Sequence[int] | np.ndarray, cu_seqlens_k: Sequence[int] | np.ndarray
) -> int:
    """(query, key) pairs a tree-packed row attends: per segment of ``q`` queries whose path
    holds ``k`` keys (itself last, causal), ``q (k - q) + q (q + 1) / 2``.

    Example:
        >>> query_key_pairs([0, 4], [0, 4])  # one causal sequence of 4: 1 + 2 + 3 + 4
        10
        >>> query_key_pairs([0, 4, 6], [0, 4, 10])  # a 2-token branch under a 4-token prefix
        21
    """
    q = np.diff(np.asarray(cu_seqlens_q, dtype=np.int64))
    k = np.diff(np.asarray(cu_seqlens_k, dtype=np.int64))
    if len(q) != len(k) or np.any(k < q) or np.any(q < 0):
        raise ValueError("every segment needs as many or more keys than queries")
    return int(np.sum(q * (k - q) + q * (q + 1) // 2))


def forward_flops(
    shape: ModelShape, forwarded_tokens: int, trained_tokens: int, pairs: int
) -> float:
    """FLOPs of one forward over rows with these totals.

    Example:
        >>> shape = ModelShape(linear_params=100, layers=2, heads=2, head_dim=4, hidden=8,
        ...                    vocab=10)
        >>> forward_flops(shape, forwarded_tokens=3, trained_tokens=2, pairs=6)
        1304.0
    """
    linear = 2.0 * shape.linear_params * forwarded_tokens
    head = 2.0 * shape.hidden * shape.vocab * trained_tokens
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * pairs
    return linear + head + attention


def train_flops(shape: ModelShape, forwarded_tokens: int, trained_tokens: int, pairs: int) -> float:
    """FLOPs of a forward and backward: three forwards."""
    return 3.0 * forward_flops(shape, forwarded_tokens, trained_tokens, pairs)


def gpu_peak_flops(device_name: str, bf16: bool) -> float | None:
    """The dense peak of a listed GPU for the training dtype, or None when it is not listed.

    Example:
        >>> gpu_peak_flops("NVIDIA H200", bf16=True)
        989000000000000.0
        >>> gpu_peak_flops("Some new accelerator", bf16=True) is None
        True
    """
    for name, bf16_peak, fp32_peak in GPU_PEAK_FLOPS:
        if name.lower() in device_name.lower():
            return bf16_peak if bf16 else fp32_peak
    return None


def matmul_flops(n: int) -> float:
    """FLOPs of one ``n x n`` by ``n x n`` matmul (the peak probe)."""
    return 2.0 * n**3
