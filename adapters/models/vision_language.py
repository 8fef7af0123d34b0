"""Vision-language checkpoints trained on text: load, freeze everything outside the text model,
keep it out of weight sync, refuse images.

TRL's AsyncGRPOTrainer documentation trains Qwen3.5, shipped as a vision-language checkpoint,
on text-only datasets. Such a checkpoint (its config has a ``vision_config``) loads with
``AutoModelForImageTextToText``; the learner trains its text model and LM head only:

* :func:`freeze_outside_text_model` sets ``requires_grad=False`` on the vision tower and
  projector, so they get no gradients and no optimizer state;
* :func:`is_synced_weight` keeps their weights out of every weight-sync path, so the server
  keeps the checkpoint's values (the names that are synced are the checkpoint's own, which is
  what vLLM's loader expects);
* :func:`reject_images` refuses a prompt that carries images (not supported).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel

IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image", "video", "video_url"})
FROZEN_PREFIXES_ATTR = "_asyncgrpo_frozen_prefixes"


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether ``config`` describes a vision-language model (it has a vision config)."""
    return getattr(config, "vision_config", None) is not None


def freeze_outside_text_model(model: PreTrainedModel) -> tuple[str, ...]:
    """Freeze every parameter outside the text decoder and the LM head; returns the frozen
    module prefixes (``"model.visual."`` for Qwen3.5), also kept on the model for
    :func:`is_synced_weight`."""
    text = {id(p) for p in model.get_decoder().parameters()}
    text |= {id(p) for p in model.get_output_embeddings().parameters()}
    prefixes: list[str] = []
    for name, module in model.named_modules():
        params = list(module.parameters())
        if not params or any(id(p) in text for p in params):
            continue
        if not any(name.startswith(prefix) for prefix in prefixes):
            prefixes.append(f"{name}.")
    for name, parameter in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            parameter.requires_grad_(False)
    setattr(model, FROZEN_PREFIXES_ATTR, tuple(prefixes))
    return tuple(prefixes)


def frozen_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """The prefixes :func:`freeze_outside_text_model` froze on ``model`` (or its PEFT base)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return getattr(base, FROZEN_PREFIXES_ATTR, ())


def is_synced_weight(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the weight ``name`` (a checkpoint key) goes to the server."""
    return not name.startswith(prefixes)


def reject_images(messages: Iterable[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` when a message carries an image or a video."""
    for index, message in enumerate(messages):
        if any(message.get(key) for key in ("images", "image", "videos", "video")):
            raise ValueError(_IMAGES_ERROR.format(index=index))
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES for part in content
        ):
            raise ValueError(_IMAGES_ERROR.format(index=index))


_IMAGES_ERROR = (
    "message {index} of the prompt carries an image or a video: training on images is not "
    "supported; vision-language checkpoints train on text-only prompts (their vision tower is "
    "frozen)"
)
