"""Which decoder layers the tree-packed forward computes exactly, and a refusal for the rest.

The packed forward runs a row of several samples laid out as a prefix trie. Its result equals
forwarding each sample alone only when every token-mixing layer knows the tree:

* full attention, gated or not, through
:data:`~asyncgrpo.adapters.kernels.attention.TREE_ATTENTION`;
* gated DeltaNet (Qwen3.5/3.6, Qwen3-Next), through
  :mod:`asyncgrpo.adapters.kernels.gated_delta_net`.

Anything else would compute something different without an error, so
:func:`check_tree_packing_support` refuses it up front (trainer construction and
``enable_tree_attention``), naming the model type, the layer class and why:

* attention sinks (``sinks`` parameters, passed to the attention function as ``s_aux``:
  gpt-oss): no tree-attention backend adds the sink to the softmax denominator;
* sliding-window or chunked attention layers: the tree backends attend to the whole path;
* attention logit soft-capping (Gemma 2): no tree backend applies it; final logit
  soft-capping: the packed LM head does not apply it;
* other state-space or recurrent layers (Mamba, short convolutions, other linear attentions):
  their state would run from one packed sample into the next.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.gated_delta_net import GATED_DELTA_NET_CLASSES

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})

_RECURRENT_CLASS = re.compile(
    r"mamba|mixer|shortconv|deltanet|deltaattention|linearattention|recurrent|rglru|ssm|rwkv",
    re.IGNORECASE,
)
_TOKEN_MIXER_CLASS = re.compile(r"attention|mixer|conv|deltanet", re.IGNORECASE)


class UnsupportedArchitectureError(ValueError):
    """The model has a layer that the tree-packed forward would compute wrongly."""


def unsupported_layers(model: PreTrainedModel) -> list[str]:
    """One line per reason ``model`` cannot train on tree-packed rows; empty when it can."""
    decoder = model.get_decoder()
    config = decoder.config.get_text_config()
    reasons = [*_config_reasons(config, decoder), *_module_reasons(decoder)]
    return list(dict.fromkeys(reasons))


def check_tree_packing_support(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every layer of ``model`` is computed
    exactly by the tree-packed forward (see the module docstring)."""
    reasons = unsupported_layers(model)
    if reasons:
        model_type = model.config.model_type
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} ({type(model).__name__}) cannot train with tree packing, "
            "which supports full attention (gated or not) and gated DeltaNet layers only:\n  "
            + "\n  ".join(reasons)
        )


def _config_reasons(config, decoder: torch.nn.Module) -> list[str]:
    model_type = config.model_type
    layers = list(getattr(decoder, "layers", []))
    reasons = []
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        for index, layer_type in enumerate(layer_types):
            if layer_type not in SUPPORTED_LAYER_TYPES:
                reasons.append(
                    f"{model_type} layer {index} ({_mixer_names(layers, index)}) is "
                    f"{layer_type!r}: the tree backends attend to each token's whole path, so "
                    "sliding-window, chunked or other layer types would see the wrong keys"
                )
    elif getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    ):
        reasons.append(
            f"{model_type} ({_mixer_names(layers, 0)}) has sliding_window="
            f"{config.sliding_window}: the tree backends attend to each token's whole path"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        reasons.append(
            f"{model_type} ({_mixer_names(layers, 0)}) soft-caps attention logits "
            f"(attn_logit_softcapping={config.attn_logit_softcapping}): no tree-attention "
            "backend applies it"
        )
    if getattr(config, "final_logit_softcapping", None) is not None:
        reasons.append(
            f"{model_type} soft-caps its output logits (final_logit_softcapping="
            f"{config.final_logit_softcapping}): the packed LM head does not apply it"
        )
    return reasons


def _module_reasons(decoder: torch.nn.Module) -> list[str]:
    model_type = decoder.config.get_text_config().model_type
    reasons = []
    for name, module in decoder.named_modules():
        cls = type(module).__name__
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            reasons.append(
                f"{model_type} {name} ({cls}) has attention sinks (s_aux): no tree-attention "
                "backend adds the sink to the softmax"
            )
        elif _RECURRENT_CLASS.search(cls) and not any(
            c.__name__ in GATED_DELTA_NET_CLASSES for c in type(module).__mro__
        ):
            reasons.append(
                f"{model_type} {name} ({cls}) is a state-space or recurrent layer that is not "
                "gated DeltaNet: its state would run from one packed sample into the next"
            )
    return reasons


def _mixer_names(layers: list[torch.nn.Module], index: int) -> str:
    """The token-mixing classes of decoder layer ``index`` (its attention, conv, mixer)."""
    if index >= len(layers):
        return "no layer module"
    names = [
        type(child).__name__
        for child in layers[index].children()
        if _TOKEN_MIXER_CLASS.search(type(child).__name__)
    ]
    return ", ".join(names) or type(layers[index]).__name__
