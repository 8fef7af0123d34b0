"""How far the learner's bf16 LM head moves the log-probs the importance ratio is built on.

With ``bf16=True`` the learner computes the LM head's logits in bfloat16 (its weights and the
final hidden states in bf16, as FSDP2's mixed precision casts them) and only the softmax in
float32. This script measures, on the real pretrained model a package ships
(``smollm2-135m``), the log-probs of sampled tokens from bf16 logits against float32 logits
of the same float32 hidden states: the part of the trainer's log-prob error the head alone
adds. Tokens are drawn from the model's own distribution at temperature 1 after text prompts,
so they are the tokens a run would train on.

    python benchmarks/head_precision.py      # about a minute on 2 cores
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoTokenizer

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.models.packaged import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Question: what is 17 times 23? Answer:",
    "Once upon a time, in a small village by the sea,",
    "The derivative of sin(x) is",
    "import numpy as np\nx = np.",
    "In 1969, the first humans",
    "A list of prime numbers: 2, 3, 5,",
]
TOKENS = 64  # sampled per prompt


def main() -> None:
    torch.manual_seed(0)
    path = resolve_model("smollm2-135m")
    model = load_causal_lm(path, "float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    head = model.get_output_embeddings().weight
    differences = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, do_sample=True, top_k=0, top_p=1.0)
            hidden = model.model(input_ids=out).last_hidden_state[0, ids.shape[1] - 1 : -1]
            targets = out[0, ids.shape[1] :]
            exact = torch.log_softmax(hidden @ head.T, -1)
            rounded = torch.log_softmax((hidden.bfloat16() @ head.bfloat16().T).float(), -1)
            picked = torch.arange(len(targets)), targets
            differences.append((rounded[picked] - exact[picked]).double().numpy())
    d = np.abs(np.concatenate(differences))
    ratio = np.expm1(d)
    vocab = head.shape[0]
    print(f"{len(d)} sampled tokens after {len(PROMPTS)} prompts, smollm2-135m (vocab {vocab})")
    print(
        f"|logp(bf16 head) - logp(fp32 head)|: median {np.median(d):.2e}, 90th percentile "
        f"{np.percentile(d, 90):.2e}, max {d.max():.2e}"
    )
    print(
        f"importance ratio error |exp(difference) - 1|: median {np.median(ratio):.2e}, "
        f"max {ratio.max():.2e}"
    )


if __name__ == "__main__":
    main()
