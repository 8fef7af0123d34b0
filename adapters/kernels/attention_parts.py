"""The attention parts of a model's layers, read from its config and modules, one declaration
per part (the names and which backend has which are in
:mod:`asyncgrpo.core.packing.attention_choice`):

* sliding window (``layer_types`` entries ``"sliding_attention"`` with ``sliding_window``, or
  a model-wide ``sliding_window``: Mistral, Gemma 2/3, OLMo 3, gpt-oss, Qwen with
  ``use_sliding_window``);
* chunked attention (``layer_types`` entries ``"chunked_attention"`` with
  ``attention_chunk_size``: Llama 4 text);
* attention sinks (a ``sinks`` parameter on the attention module, passed as ``s_aux``: gpt-oss);
* attention logit soft-capping (``attn_logit_softcapping``: Gemma 2).

Windows and chunks count positions along each token's own path in the trie, its position in
its own sample (``PackedRow.position_ids``), never row indices. :func:`model_attention_parts`
is the model's declaration, per decoder layer (for the backend choice and the support check);
:func:`call_attention_parts` reads the same parts from what transformers hands the attention
function on each call, so the tree computes what the stock layer computes.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers import PreTrainedModel

from asyncgrpo.core.packing.attention_choice import CHUNKED, SINKS, SLIDING_WINDOW, SOFTCAP

SLIDING_LAYER = "sliding_attention"
CHUNKED_LAYER = "chunked_attention"


def config_setting(config: object, name: str) -> Any:
    """``config``'s setting ``name``, None when it has none; a setting that varies per layer
    (Gemma 4's ``head_dim``, which transformers refuses to read model-wide) is its largest
    value over the layers."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        values = [getattr(layer, name, None) for layer in getattr(config, "per_layer_config", ())]
        present = [value for value in values if value is not None]
        return max(present) if present else None


@attrs.frozen
class AttentionParts:
    """One attention layer's parts.

    Attributes:
        window: sliding window in positions of the token's own sample (a query at position
            ``i`` sees keys at ``i - window < j <= i``), or ``None``.
        chunk: chunk length in positions (a query sees the keys of its own ``chunk``-aligned
            block, ``j // chunk == i // chunk``), or ``None``.
        softcap: attention logit cap (scores become ``cap * tanh(scores / cap)``), or ``None``.
        sinks: the layer has a learned per-head sink logit in each softmax's denominator.
    """

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("window", "chunk", "softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"attention part {name} must be > 0 or None, got {value}")

    @property
    def names(self) -> frozenset[str]:
        """The parts present, by their names in :mod:`~asyncgrpo.core.packing.attention_choice`."""
        present = {
            SLIDING_WINDOW: self.window is not None,
            CHUNKED: self.chunk is not None,
            SOFTCAP: self.softcap is not None,
            SINKS: self.sinks,
        }
        return frozenset(name for name, has in present.items() if has)

    @property
    def mask_shape(self) -> tuple[int | None, int | None]:
        """``(window, chunk)``: what the layer's mask adds to the tree's."""
        return self.window, self.chunk


def model_attention_parts(model: PreTrainedModel) -> tuple[AttentionParts, ...]:
    """One :class:`AttentionParts` per decoder layer of ``model``, from its text config and
    its attention modules."""
    decoder = decoder_of(model)
    config = decoder.config.get_text_config()
    layers = list(getattr(decoder, "layers", []))
    count = int(getattr(config, "num_hidden_layers", len(layers)))
    return tuple(
        AttentionParts(
            window=_layer_window(config, index),
            chunk=_layer_chunk(config, index),
            softcap=getattr(config, "attn_logit_softcapping", None),
            sinks=index < len(layers) and _has_sinks(layers[index]),
        )
        for index in range(count)
    )


def decoder_of(model: PreTrainedModel) -> PreTrainedModel:
    """The model's decoder stack (embeddings, layers, final norm): ``model.get_decoder()``,
    except where transformers 5.19 returns the causal LM itself because its
    ``base_model_prefix`` names no attribute (Llama 4 text: ``"language_model"``, the stack is
    ``model``)."""
    decoder = model.get_decoder()
    stack = getattr(model, "model", None)
    if decoder is model and isinstance(stack, PreTrainedModel):
        return stack
    return decoder


def call_attention_parts(module: torch.nn.Module, kwargs: dict[str, object]) -> AttentionParts:
    """The parts of one attention call: the window, soft-cap and sinks transformers passes to
    the attention function (``sliding_window``, ``softcap``, ``s_aux``), and the chunk of the
    module's layer (Llama 4 applies it through its mask, which tree attention does not build)."""
    config = getattr(module, "config", None)
    layer_index = getattr(module, "layer_idx", None)
    chunk = None
    if config is not None and layer_index is not None:
        chunk = _layer_chunk(config.get_text_config(), int(layer_index))
    return AttentionParts(
        window=kwargs.get("sliding_window"),  # type: ignore[arg-type]
        chunk=chunk,
        softcap=kwargs.get("softcap"),  # type: ignore[arg-type]
        sinks=kwargs.get("s_aux") is not None,
    )


def _layer_window(config, index: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None:
        return window if layer_types[index] == SLIDING_LAYER else None
    return window if getattr(config, "use_sliding_window", True) else None


def _layer_chunk(config, index: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or index >= len(layer_types) or layer_types[index] != CHUNKED_LAYER:
        return None
    return getattr(config, "attention_chunk_size", None)


def _has_sinks(layer: torch.nn.Module) -> bool:
    return any(
        isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in layer.modules()
    )
