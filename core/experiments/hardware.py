"""What the planner knows of the hardware and the model: GPUs and interconnects from their
data sheets, and a model's parameters, FLOPs per token and KV-cache bytes per token.

Every figure here is a vendor's published peak (dense bf16, no sparsity; bandwidth per GPU and
direction), not a measurement: predictions made from them are upper bounds and say so.

Example:
    >>> spec = model_spec({"hidden_size": 1536, "num_hidden_layers": 28,
    ...                    "num_attention_heads": 12, "num_key_value_heads": 2,
    ...                    "intermediate_size": 8960, "vocab_size": 151936,
    ...                    "tie_word_embeddings": True})  # Qwen2.5-1.5B's config.json
    >>> round(spec.parameters / 1e9, 2), spec.kv_bytes_per_token  # bf16 K and V, all layers
    (1.54, 28672.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from asyncgrpo.core.packing.flops import ModelShape, model_shape

BF16_BYTES = 2


@attrs.frozen
class GPU:
    """A GPU's published peak figures.

    Attributes:
        name: as the workload file and ``--gpu`` name it.
        bf16_flops: dense bf16 FLOP/s.
        memory_bytes_per_s: HBM bandwidth, bytes/s.
        memory_bytes: HBM capacity, bytes.
    """

    name: str
    bf16_flops: float
    memory_bytes_per_s: float
    memory_bytes: float = 80e9


GPUS: Mapping[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100", 312e12, 2.039e12, 80e9),
        GPU("h100", 989e12, 3.35e12, 80e9),
        GPU("h200", 989e12, 4.8e12, 141e9),
        GPU("h20", 148e12, 4.0e12, 96e9),
        GPU("b200", 2250e12, 8.0e12, 180e9),
        GPU("l40s", 362e12, 0.864e12, 48e9),
    )
}
"""Vendors' data sheets: A100 80GB SXM, H100 SXM, H200 SXM, H20, B200 (HGX), L40S."""


@attrs.frozen
class Interconnect:
    """A link's published bandwidth per GPU and direction, bytes/s."""

    name: str
    bytes_per_s: float


INTERCONNECTS: Mapping[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect("nvlink5", 900e9),  # B200: 1.8 TB/s both directions
        Interconnect("nvlink4", 450e9),  # H100/H200 SXM: 900 GB/s both directions
        Interconnect("nvlink3", 300e9),  # A100 SXM: 600 GB/s both directions
        Interconnect("pcie5", 64e9),  # x16
        Interconnect("pcie4", 32e9),  # x16
        Interconnect("ib-xdr", 100e9),  # 800 Gb/s per GPU
        Interconnect("ib-ndr", 50e9),  # 400 Gb/s per GPU
        Interconnect("ib-hdr", 25e9),  # 200 Gb/s per GPU
        Interconnect("ethernet-100g", 12.5e9),
    )
}
"""Within a node (NVLink, PCIe) and between nodes (InfiniBand, Ethernet), per GPU."""


@attrs.frozen
class ModelSpec:
    """What the part models need of a model.

    Attributes:
        parameters: all weights (embeddings included), the bytes a push sends are
            ``2 x parameters`` in bf16.
        flops_per_token: forward FLOPs per token (``2 x`` the weights a token multiplies;
            attention's quadratic part left out), the backward twice that.
        kv_bytes_per_token: KV-cache bytes per token in bf16 over all layers; None when
            unknown (the KV cache is then left out of the generator's model).
        shape: the decoder's shape when a config gave it (None: parameters only).
    """

    parameters: float = attrs.field()
    flops_per_token: float
    kv_bytes_per_token: float | None = None
    shape: ModelShape | None = None

    @parameters.validator
    def _positive(self, attribute: attrs.Attribute, value: float) -> None:
        if not value > 0:
            raise ValueError(f"ModelSpec.parameters must be > 0, got {value}")

    @property
    def weight_bytes(self) -> float:
        """The weights in bf16, bytes."""
        return BF16_BYTES * self.parameters


def parameters_only(parameters: float, kv_bytes_per_token: float | None = None) -> ModelSpec:
    """A model known by its parameter count: ``2 x parameters`` FLOPs per token.

    Example:
        >>> parameters_only(1.5e9).flops_per_token
        3000000000.0
    """
    return ModelSpec(parameters, 2.0 * parameters, kv_bytes_per_token)


def _get(config: Mapping[str, Any] | Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def model_spec(config: Mapping[str, Any] | Any) -> ModelSpec:
    """A model's spec from its HF config (``config.json`` as a mapping, or a transformers
    config): the decoder's linear weights (:func:`~asyncgrpo.core.packing.flops.model_shape`,
    MoE counted by the experts a token is routed to), the embeddings and an untied LM head;
    KV bytes ``2 x layers x kv_heads x head_dim x 2``.

    Raises:
        ValueError: a config without ``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads`` or ``vocab_size`` (naming the missing key).
    """
    text = (
        config.get_text_config()
        if hasattr(config, "get_text_config")
        else (_get(config, "text_config") or config)
    )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if _get(text, key) is None:
            raise ValueError(
                f"the model's config has no {key!r}: give the config.json of a "
                "decoder (or [model] parameters and kv_bytes_per_token)"
            )
    shape = model_shape(text)
    heads = int(_get(text, "num_attention_heads"))
    kv_heads = int(_get(text, "num_key_value_heads") or heads)
    embeddings = shape.hidden * shape.vocab
    tied = bool(_get(text, "tie_word_embeddings"))
    experts = int(_get(text, "num_local_experts") or _get(text, "num_experts") or 0)
    routed = int(_get(text, "num_experts_per_tok") or 0)
    stored = shape.linear_params
    if experts and routed:  # every expert is stored; a token multiplies the routed ones
        mlp_active = 3 * shape.hidden * int(_get(text, "moe_intermediate_size") or 0) * routed
        stored += shape.layers * mlp_active * (experts - routed) // routed
    parameters = stored + embeddings * (1 if tied else 2)
    flops = 2.0 * (shape.linear_params + embeddings)  # the LM head on every token
    kv = 2.0 * shape.layers * kv_heads * shape.head_dim * BF16_BYTES
    return ModelSpec(float(parameters), flops, kv, shape)
