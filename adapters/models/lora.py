"""PEFT adapters for the learner: wrapping a causal LM with LoRA, and its weights for sync and save.

Only plain LoRA on linear layers is supported (no DoRA, no embedding or convolution LoRA), and
never on the output layer: the packed forward applies ``lm_head`` to gathered hidden states
itself, and TRL's AsyncGRPOTrainer rules out lm_head adapters. ``target_modules="all-linear"``
is fine, as peft leaves the output layer out of it.

The learner shards the wrapped model with FSDP2 and gathers a full state dict (PEFT keys such as
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` and
``...q_proj.lora_A.default.weight``); the functions here turn that dict into the merged weights
under the base model's own keys (:func:`merged_state_dict`), or into the adapter-only weights
that ``PeftModel.save_pretrained`` writes (:func:`adapter_state_dict`).
:func:`merged_with_lost_update` merges and also counts the update entries that rounding on the
way to a lower-precision server loses (:mod:`asyncgrpo.core.weights.lora_precision`).

Example::

    model = wrap_with_lora(model, LoraConfig(r=16, target_modules="all-linear"))
    full = ...  # the gathered full state dict of ``model``
    weights = merged_state_dict(model, full)  # loads into AutoModelForCausalLM
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from torch import Tensor
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.packed_forward import base_model
from asyncgrpo.adapters.models.vision_language import frozen_prefixes
from asyncgrpo.core.weights.lora_precision import SAMPLED_ENTRIES, UpdateCounts, lost_update

_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
_LM_HEAD_ERROR = (
    "PEFT adapters on lm_head are not supported (TRL's AsyncGRPOTrainer rules them out): "
    "remove the output layer ({name!r}) from LoraConfig.{field}; target_modules='all-linear' "
    "already leaves it out"
)


def check_peft_config(peft_config: PeftConfig, output_layer: str = "lm_head") -> LoraConfig:
    """Reject configurations the learner cannot train, before the model is touched.

    Args:
        peft_config: the configuration passed as ``peft_config``.
        output_layer: the model's output-layer name (``lm_head`` for transformers' causal LMs).

    Returns:
        ``peft_config``, which is a :class:`~peft.LoraConfig`.

    Raises:
        ValueError: not a :class:`~peft.LoraConfig`, DoRA, or ``output_layer`` listed in
            ``target_modules`` or ``modules_to_save``.
    """
    if not isinstance(peft_config, LoraConfig):
        raise ValueError(
            f"peft_config is a {type(peft_config).__name__}; only LoraConfig (plain LoRA on "
            "linear layers) is supported"
        )
    if peft_config.use_dora:
        raise ValueError("LoraConfig.use_dora=True is not supported: set use_dora=False")
    for field in ("target_modules", "modules_to_save"):
        names = getattr(peft_config, field) or ()
        names = [names] if isinstance(names, str) else list(names)
        if any(name == output_layer or name.endswith(f".{output_layer}") for name in names):
            raise ValueError(_LM_HEAD_ERROR.format(name=output_layer, field=field))
    return peft_config


def wrap_with_lora(model: PreTrainedModel, peft_config: PeftConfig) -> PeftModel:
    """``get_peft_model(model, peft_config)``, checked before and after wrapping.

    Only the adapters require grad afterwards. The check after wrapping catches what the config
    alone cannot show: a regular expression in ``target_modules`` that matches the output layer,
    or LoRA on a layer type other than ``nn.Linear``. On a vision-language model the frozen
    vision tower gets no adapters: with ``exclude_modules`` unset it is excluded here.

    Raises:
        ValueError: see :func:`check_peft_config`; or an adapter on the output layer, on a
            non-linear layer, or in the vision tower.
    """
    output_layer = _output_layer_name(model)
    lora_config = check_peft_config(peft_config, output_layer.rsplit(".", 1)[-1])
    frozen = frozen_prefixes(model)
    if frozen and not lora_config.exclude_modules:
        lora_config = dataclasses.replace(lora_config, exclude_modules=_under(frozen))
    peft_model = get_peft_model(model, lora_config)
    head = base_model(peft_model).get_output_embeddings()
    if isinstance(head, BaseTunerLayer | ModulesToSaveWrapper):
        raise ValueError(_LM_HEAD_ERROR.format(name=output_layer, field="target_modules"))
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ValueError(
                f"LoRA on {name} ({type(module).__name__}) is not supported; only linear layers "
                "can carry adapters: narrow LoraConfig.target_modules"
            )
        base_name = name.removeprefix("base_model.model.")
        if isinstance(module, LoraLayer) and base_name.startswith(frozen):
            raise ValueError(
                f"LoRA on {base_name}: the vision tower stays frozen and the server keeps the "
                "checkpoint's weights for it; leave it out of LoraConfig.target_modules, or "
                "leave LoraConfig.exclude_modules unset and it is excluded for you"
            )
    return peft_model


def _under(prefixes: tuple[str, ...]) -> str:
    """A regular expression (for ``LoraConfig.exclude_modules``) matching every module under
    ``prefixes``.

    Example:
        >>> import re
        >>> bool(re.fullmatch(_under(("model.visual.",)), "model.visual.blocks.0.attn.qkv"))
        True
    """
    return "(?:" + "|".join(re.escape(prefix) + ".*" for prefix in prefixes) + ")"


def merged_state_dict(model: PeftModel, full_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The base model's weights with every LoRA adapter merged in, under the base model's keys.

    ``W' = W + scaling * (B @ A)`` (transposed for ``fan_in_fan_out`` layers), computed in
    float32 and returned in ``W``'s dtype; a LoRA bias is added to the base bias.

    Args:
        model: the (possibly sharded) :class:`~peft.PeftModel`, for its LoRA scalings.
        full_state_dict: the full state dict of ``model`` (PEFT keys), on any device.

    Returns:
        A state dict that loads into the base architecture (``AutoModelForCausalLM``).
    """
    return _merged(model, full_state_dict, None)[0]


def merged_with_lost_update(
    model: PeftModel, full_state_dict: Mapping[str, Tensor], then: Sequence[torch.dtype]
) -> tuple[dict[str, Tensor], UpdateCounts]:
    """:func:`merged_state_dict`, and the update entries that rounding loses on the way to the
    server: :func:`~asyncgrpo.core.weights.lora_precision.lost_update` of each merged tensor
    (float32 merge against its base), through the base's dtype and then ``then`` (the export
    dtype, the server's dtype), over at most
    :data:`~asyncgrpo.core.weights.lora_precision.SAMPLED_ENTRIES` strided entries of each,
    summed."""
    return _merged(model, full_state_dict, tuple(then))


def _merged(
    model: PeftModel, full_state_dict: Mapping[str, Tensor], then: tuple[torch.dtype, ...] | None
) -> tuple[dict[str, Tensor], UpdateCounts]:
    merged: dict[str, Tensor] = {}
    counts = UpdateCounts()
    for key, tensor, lost in merged_tensors(model, full_state_dict.items(), full_state_dict, then):
        merged[key] = tensor
        counts += lost
    return merged, counts


def merged_tensors(
    model: PeftModel,
    tensors: Iterable[tuple[str, Tensor]],
    lora_state: Mapping[str, Tensor],
    then: Sequence[torch.dtype] | None = None,
) -> Iterator[tuple[str, Tensor, UpdateCounts]]:
    """:func:`merged_state_dict` one tensor at a time, on the device each tensor comes on:
    ``(base model key, tensor, lost)`` for each base tensor of ``tensors`` (PEFT keys; LoRA
    entries are skipped), the adapters of ``lora_state`` (its ``.lora_`` entries, unsharded)
    merged in where it is a LoRA layer's. With ``then``, ``lost`` counts the entries rounding
    loses as :func:`merged_with_lost_update` does (empty counts otherwise)."""
    lora = _lora_modules(model)
    for key, tensor in tensors:
        if ".lora_" in key or ".original_module." in key:
            continue
        module_key, _, leaf = key.rpartition(".base_layer.")
        lost = UpdateCounts()
        if module_key in lora:
            exact = _merge_one(lora[module_key], module_key, leaf, tensor, lora_state)
            if then is not None:
                lost = lost_update(tensor, exact, (tensor.dtype, *then), SAMPLED_ENTRIES)
            tensor = exact.to(tensor.dtype)
        yield _base_key(key), tensor, lost


def adapter_state_dict(
    model: PeftModel, full_state_dict: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The adapter-only weights under peft's saved keys (what ``PeftModel.save_pretrained``
    writes to ``adapter_model.safetensors``), from the full state dict of ``model``."""
    return get_peft_model_state_dict(model, state_dict=dict(full_state_dict))


def _output_layer_name(model: PreTrainedModel) -> str:
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is head:
            return name
    return "lm_head"


def _lora_modules(model: PeftModel) -> dict[str, LoraLinear]:
    """PEFT key prefix (``base_model.model.<module path>``) of each LoRA linear layer."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _merge_one(
    module: LoraLinear, module_key: str, leaf: str, base: Tensor, state: Mapping[str, Tensor]
) -> Tensor:
    """Every active adapter of ``module`` merged into its base ``weight`` or ``bias``, in
    float32."""
    merged = base.float()
    for adapter in module.active_adapters:
        a = state[f"{module_key}.lora_A.{adapter}.weight"].float()
        b = state[f"{module_key}.lora_B.{adapter}.weight"].float()
        scaling = module.scaling[adapter]
        if leaf == "weight":
            delta = b @ a
            merged = merged + scaling * (delta.T if module.fan_in_fan_out else delta)
        elif leaf == "bias" and module.lora_bias.get(adapter, False):
            merged = merged + scaling * state[f"{module_key}.lora_B.{adapter}.bias"].float()
    return merged


def _base_key(key: str) -> str:
    """PEFT key -> base model key: drop the wrapper prefix and the base-layer indirection."""
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return _SAVED_COPY.sub(".", key)
