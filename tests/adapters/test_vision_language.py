"""A vision-language checkpoint trains its text model only: it loads with
AutoModelForImageTextToText, the vision tower is frozen and left out of weight sync, and a
prompt carrying an image is refused."""

import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer

from asyncgrpo.adapters.models.causal_lm import build_tokenizer, load_causal_lm
from asyncgrpo.adapters.models.chat import render_prompt
from asyncgrpo.adapters.models.lora import wrap_with_lora
from asyncgrpo.adapters.models.vision_language import frozen_prefixes, is_synced_weight
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner.optimization import build_optimizer


def test_loads_with_image_text_to_text_and_freezes_the_tower(tiny_vl) -> None:
    model = load_causal_lm(tiny_vl)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert frozen_prefixes(model) == ("model.visual.",)
    for name, parameter in model.named_parameters():
        assert parameter.requires_grad == (not name.startswith("model.visual.")), name
    assert any(name.startswith("model.visual.") for name, _ in model.named_parameters())


def test_the_tower_gets_no_gradient_and_no_optimizer_state(tiny_vl) -> None:
    model = load_causal_lm(tiny_vl)
    optimizer = build_optimizer(model, AsyncGRPOConfig(output_dir="unused", learning_rate=1e-3))
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False).logits.sum().backward()
    optimizer.step()
    tower = {id(p) for n, p in model.named_parameters() if n.startswith("model.visual.")}
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not tower & optimized
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert not any(id(p) in tower for p in optimizer.state)


def test_weight_sync_sends_the_text_weights_under_the_checkpoint_names(tiny_vl) -> None:
    model = load_causal_lm(tiny_vl)
    prefixes = frozen_prefixes(model)
    synced = [name for name in model.state_dict() if is_synced_weight(name, prefixes)]
    assert "lm_head.weight" in synced
    assert "model.language_model.embed_tokens.weight" in synced
    assert not [name for name in synced if "visual" in name]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text"}]},
        {"role": "user", "content": "what is this?", "images": ["x.png"]},
    ],
)
def test_a_prompt_with_an_image_is_refused(message) -> None:
    with pytest.raises(ValueError, match="image or a video: training on images is not"):
        render_prompt(build_tokenizer(), [message], None, None)


def test_lora_stays_off_the_vision_tower(tiny_vl) -> None:
    """``target_modules="all-linear"`` reaches the tower's linear layers too; they get no
    adapter, so nothing the server keeps frozen is trained or synced."""
    model = wrap_with_lora(load_causal_lm(tiny_vl), LoraConfig(r=4, target_modules="all-linear"))
    adapted = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    assert any(".language_model." in name for name in adapted)
    assert not [name for name in adapted if ".visual." in name]
    assert not [n for n, p in model.named_parameters() if p.requires_grad and ".visual." in n]


def test_lora_asked_for_in_the_vision_tower_is_refused(tiny_vl) -> None:
    """The negative control: with ``exclude_modules`` set by the user nothing is excluded for
    them, and an adapter that lands in the tower is refused naming it."""
    config = LoraConfig(r=4, target_modules="all-linear", exclude_modules=["lm_head"])
    with pytest.raises(ValueError, match=r"LoRA on model\.visual\..*vision tower"):
        wrap_with_lora(load_causal_lm(tiny_vl), config)
