"""The generator probe's training load: a model's forward and backward in a loop, on the cores
the CPU plan gives the trainer, logging each step's seconds.

It stands for the trainer's use of the cores and memory bandwidth while the probe measures the
server beside it (:mod:`asyncgrpo.shell.experiments.generator_probe`); only the ratio of its step
time beside generation to its step time alone is used. Run as a process of its own until it is
terminated::

    python -m asyncgrpo.shell.experiments.training_load MODEL_DIR TOKENS BF16 SERVER_URL STEPS_FILE

``TOKENS``: the row each step forwards (the runs' ``token_budget``); ``BF16``: ``1`` to compute
in bf16 under autocast, as the learner does where it chose bf16; ``SERVER_URL``: the server the
CPU plan shares the cores with (the trainer's are the rest). Each step appends
``<monotonic end time> <step seconds>`` to ``STEPS_FILE``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch


def run(model_dir: str, tokens: int, bf16: bool, server_url: str, steps_file: Path) -> None:
    """Train until terminated (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.shell.config import AsyncGRPOConfig
    from asyncgrpo.shell.servers import cpus_shared_with_server

    config = AsyncGRPOConfig(output_dir=str(steps_file.parent), vllm_server_base_url=server_url)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with cpus_shared_with_server(config, torch.device("cpu")), steps_file.open("a") as out:
        while True:
            ids = torch.randint(0, vocab, (1, tokens), generator=generator)
            started = time.perf_counter()
            with precision:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            out.write(f"{time.monotonic()} {time.perf_counter() - started}\n")
            out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    model_dir, tokens, bf16, server_url, steps_file = list(sys.argv[1:] if argv is None else argv)
    run(model_dir, int(tokens), bf16 == "1", server_url, Path(steps_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
