import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.adapters.models.causal_lm import build_tokenizer, load_causal_lm, tiny_config
from asyncgrpo.adapters.vllm.server import ServerSpec, ServerStartError, VLLMServer


def test_chat_template_is_prefix_preserving_with_tools() -> None:
    tok = build_tokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    first = [{"role": "user", "content": "What is 3 + 4?"}]
    grown = [
        *first,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}
            ],
        },
        {"role": "tool", "name": "add", "content": "7"},
    ]
    a = tok.apply_chat_template(first, tools=tools, tokenize=False, add_generation_prompt=True)
    b = tok.apply_chat_template(grown, tools=tools, tokenize=False, add_generation_prompt=True)
    assert b.startswith(a)
    assert '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>' in b
    assert "<tool_response>7</tool_response>" in b


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_tiny_models_round_trip_through_save_pretrained(fixture, request) -> None:
    path = request.getfixturevalue(fixture)
    tok = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(path)
    assert model.dtype == torch.float32
    assert model.config.head_dim == 64 and model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    again = AutoModelForCausalLM.from_pretrained(path)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_model_init_kwargs_dtype_wins_and_bad_dtype_is_named(tiny_qwen3) -> None:
    model = load_causal_lm(tiny_qwen3, dtype="float32", model_init_kwargs={"dtype": "bfloat16"})
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(tiny_qwen3, dtype="float8")
    with pytest.raises(ValueError, match="multiple of 64"):
        tiny_config("qwen3", vocab_size=10, hidden_size=100)


def test_server_serves_the_tiny_model(vllm_server, tiny_qwen3) -> None:
    models = httpx.get(f"{vllm_server.base_url}/v1/models").json()["data"]
    assert models[0]["id"] == str(tiny_qwen3) and models[0]["max_model_len"] == 1024


@pytest.mark.server
def test_server_failure_carries_its_last_log_lines(tmp_path) -> None:
    spec = ServerSpec(model=str(tmp_path / "no-such-model"), startup_timeout_s=120)
    with pytest.raises(ServerStartError, match="exited with code") as info:
        VLLMServer(spec, log_path=tmp_path / "server.log").start()
    assert "no-such-model" in str(info.value)
