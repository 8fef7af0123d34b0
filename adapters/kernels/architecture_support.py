"""Which decoder layers the tree-packed forward computes exactly, and a refusal for the rest.

The packed forward runs a row of several samples laid out as a prefix trie. Its result equals
forwarding each sample alone only when every token-mixing layer knows the tree:

* full attention, gated or not, through
  :data:`~asyncgrpo.adapters.kernels.attention.TREE_ATTENTION`, with the attention parts of
  :mod:`~asyncgrpo.adapters.kernels.attention_parts`: sliding windows (Mistral, Gemma 2/3,
  OLMo 3, gpt-oss) and chunks (Llama 4) counted along each token's own sample, attention
  sinks (gpt-oss), attention logit soft-capping (Gemma 2); a backend that lacks a part gives
  the row to one that has it;
* final-logit soft-capping (Gemma 2/3) and logit scales (Cohere) in the packed LM head
  (:mod:`asyncgrpo.adapters.kernels.lm_head_log_probs`);
* gated DeltaNet (Qwen3.5/3.6, Qwen3-Next), through
  :mod:`asyncgrpo.adapters.kernels.gated_delta_net`;
* LFM2's gated short convolutions (``layer_types`` entries ``"conv"``), through
  :mod:`asyncgrpo.adapters.kernels.short_conv`;
* Mamba-2 mixers (Mamba-2, Bamba, Granite 4.0 hybrids, Nemotron-H, Falcon-H1), through
  :mod:`asyncgrpo.adapters.kernels.mamba2`.

Anything else would compute something different without an error on the tree, so
:func:`check_tree_packing_support` refuses it there (``enable_tree_attention``), naming the
model type, the layer class and why:

* layer types other than full, sliding, chunked and linear (gated DeltaNet) attention and
  LFM2's convolutions;
* ``logits_scaling`` after the LM head (Granite divides by it, HyperCLOVA X multiplies);
* bidirectional attention (Gemma 3's ``use_bidirectional_attention``): tokens would see their
  future;
* other state-space or recurrent layers (Mamba, short convolutions, other linear attentions):
  their state would run from one packed sample into the next;
* attention the tree attention cannot stand in for: a model that computes it in its own code
  rather than through transformers' attention functions (Bloom, Falcon, GPT-J), or a decoder
  layer that calls its attention without passing its keywords on (Nemotron, StableLM), so the
  row's tree layout would never reach it (both read from the classes' source).

Such a model still trains: :func:`training_path` (trainer construction, the learner) gives it
the per-sample forward (:mod:`asyncgrpo.adapters.kernels.per_sample_forward`), exact for any
causal decoder, with the reasons for the log. Only a decoder that is not causal (bidirectional
attention) has no exact path and is refused.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from typing import Literal

import attrs
import torch
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.attention_parts import decoder_of
from asyncgrpo.adapters.kernels.gated_delta_net import GATED_DELTA_NET_CLASSES
from asyncgrpo.adapters.kernels.mamba2 import MAMBA2_CLASSES
from asyncgrpo.adapters.kernels.short_conv import SHORT_CONV_CLASSES

SUPPORTED_LAYER_TYPES = frozenset(
    {"full_attention", "linear_attention", "sliding_attention", "chunked_attention", "conv"}
)
FAMILY_LAYER_TYPES = {"falcon_h1": frozenset({"hybrid"})}
"""Layer types whose meaning is a family's own: Falcon-H1's ``"hybrid"`` layer runs attention
and Mamba-2 side by side (Zamba2's ``"hybrid"`` is another layer, with a shared block)."""
_TREE_MIXERS = GATED_DELTA_NET_CLASSES | SHORT_CONV_CLASSES | MAMBA2_CLASSES

_RECURRENT_CLASS = re.compile(
    # "SSM" only in capitals, where it names a layer: case-blind it would match "GptOssModel".
    r"mamba|mixer|shortconv|deltanet|deltaattention|linearattention|recurrent|rglru|rwkv"
    r"|(?-i:SSM|Ssm)",
    re.IGNORECASE,
)
_TOKEN_MIXER_CLASS = re.compile(r"attention|mixer|conv|deltanet", re.IGNORECASE)


class UnsupportedArchitectureError(ValueError):
    """The model has a layer that the tree-packed forward would compute wrongly."""


@attrs.frozen
class TrainingPath:
    """How the learner forwards a model's rows.

    Attributes:
        kind: ``"tree"``, the tree-packed forward (shared prefixes computed once), or
            ``"per_sample"``, each sample its own sequence through the model's own forward.
        reasons: why the tree cannot compute the model (``"per_sample"`` only), one line each.
    """

    kind: Literal["tree", "per_sample"]
    reasons: tuple[str, ...] = ()


def training_path(model: PreTrainedModel) -> TrainingPath:
    """The tree when it computes every layer of ``model`` exactly, else the per-sample forward.

    Raises:
        UnsupportedArchitectureError: ``model`` is not causal, so neither path computes what
            sampling token by token does.
    """
    decoder = decoder_of(model)
    non_causal = _non_causal_reasons(decoder.config.get_text_config(), decoder)
    if non_causal:
        raise UnsupportedArchitectureError(
            f"model type {model.config.model_type!r} ({type(model).__name__}) cannot train: "
            "both the tree-packed and the per-sample forward are causal, as sampling is:\n  "
            + "\n  ".join(non_causal)
        )
    reasons = unsupported_layers(model)
    return TrainingPath("per_sample", tuple(reasons)) if reasons else TrainingPath("tree")


def unsupported_layers(model: PreTrainedModel) -> list[str]:
    """One line per reason ``model`` cannot train on tree-packed rows; empty when it can."""
    decoder = decoder_of(model)
    config = decoder.config.get_text_config()
    reasons = [
        *_non_causal_reasons(config, decoder),
        *_config_reasons(config, decoder),
        *_module_reasons(decoder),
        *_plumbing_reasons(decoder),
    ]
    return list(dict.fromkeys(reasons))


def check_tree_packing_support(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every layer of ``model`` is computed
    exactly by the tree-packed forward (see the module docstring)."""
    reasons = unsupported_layers(model)
    if reasons:
        model_type = model.config.model_type
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} ({type(model).__name__}) cannot train with tree packing, "
            "which supports full, sliding-window and chunked attention (gated or not, with "
            "sinks or soft-capping), gated DeltaNet, LFM2's short convolutions and Mamba-2 "
            "only:\n  " + "\n  ".join(reasons)
        )


def _config_reasons(config, decoder: PreTrainedModel) -> list[str]:
    model_type = config.model_type
    layers = list(getattr(decoder, "layers", []))
    reasons = []
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        supported = SUPPORTED_LAYER_TYPES | FAMILY_LAYER_TYPES.get(model_type, frozenset())
        for index, layer_type in enumerate(layer_types):
            if layer_type not in supported:
                reasons.append(
                    f"{model_type} layer {index} ({_mixer_names(layers, index)}) is "
                    f"{layer_type!r}: the tree backends compute full, sliding-window, chunked "
                    f"and gated DeltaNet layers ({sorted(SUPPORTED_LAYER_TYPES)}) only"
                )
    if getattr(config, "logits_scaling", None) not in (None, 1.0):
        reasons.append(
            f"{model_type} scales its output logits by logits_scaling={config.logits_scaling} "
            "(Granite divides, HyperCLOVA X multiplies): the packed LM head applies only "
            "logit_scale and final_logit_softcapping"
        )
    return reasons


def _non_causal_reasons(config, decoder: PreTrainedModel) -> list[str]:
    # Gemma 4's "vision" is bidirectional among image tokens only: text stays causal
    if getattr(config, "use_bidirectional_attention", None) not in (True, "all"):
        return []
    layers = list(getattr(decoder, "layers", []))
    return [
        f"{config.model_type} ({_mixer_names(layers, 0)}) has use_bidirectional_attention="
        "True: tokens would see their future"
    ]


def _module_reasons(decoder: PreTrainedModel) -> list[str]:
    model_type = decoder.config.get_text_config().model_type
    reasons = []
    for name, module in decoder.named_modules():
        cls = type(module).__name__
        if (
            _RECURRENT_CLASS.search(cls)
            and not _is_tree_mixer(module)
            and "norm" not in cls.lower()  # Mamba2RMSNorm: token-local
            and not any(_is_tree_mixer(inner) for inner in module.modules())  # a container
        ):
            reasons.append(
                f"{model_type} {name} ({cls}) is a state-space or recurrent layer that is not "
                "gated DeltaNet, LFM2's short convolution or Mamba-2: its state would run from "
                "one packed sample into the next"
            )
    return reasons


def _is_tree_mixer(module: torch.nn.Module) -> bool:
    return any(c.__name__ in _TREE_MIXERS for c in type(module).__mro__)


def _plumbing_reasons(decoder: PreTrainedModel) -> list[str]:
    """Attention the tree attention would not reach (see the module docstring), judged from
    the source of each decoder layer class and of its attention modules."""
    model_type = decoder.config.get_text_config().model_type
    reasons = []
    # the decoder's layer list: ``layers`` in most families, ``h`` in Bloom, Falcon, GPT-J
    stack: Iterable[torch.nn.Module] = next(
        (c for c in decoder.children() if isinstance(c, torch.nn.ModuleList)), []
    )
    layers = {type(layer): layer for layer in stack}
    for layer_class, layer in layers.items():
        for name, child in layer.named_children():
            child_class = type(child)
            if (
                "attention" not in child_class.__name__.lower()
                or _RECURRENT_CLASS.search(child_class.__name__)
                or any(
                    "attention" in type(m).__name__.lower()
                    for m in child.modules()
                    if m is not child
                )
            ):
                continue  # not attention, or a wrapper around it (DBRX's norm-attention-norm)
            own = _source(child_class.forward)
            call = _call_source(_source(layer_class.forward), name)
            if own is not None and "ALL_ATTENTION_FUNCTIONS" not in own:
                reasons.append(
                    f"{model_type} {name} ({child_class.__name__}) computes attention in its "
                    "own code, not through transformers' attention functions: tree attention "
                    "cannot stand in for it"
                )
            elif call is not None and "**" not in call:
                reasons.append(
                    f"{model_type} {layer_class.__name__} calls its {name} "
                    f"({child_class.__name__}) without passing its keywords on: the row's tree "
                    "layout would not reach the attention"
                )
    return reasons


def _source(function: object) -> str | None:
    """The source of ``function``, None when it is not at hand."""
    try:
        return inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def _call_source(source: str | None, attribute: str) -> str | None:
    """The first ``self.<attribute>(...)`` call in ``source``, arguments included; None when
    there is no source or no such call."""
    start = -1 if source is None else source.find(f"self.{attribute}(")
    if source is None or start < 0:
        return None
    depth = 0
    for end in range(start + len(attribute) + 5, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start : end + 1]
    return None


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
