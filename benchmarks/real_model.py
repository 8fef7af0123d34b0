"""The real model's training step on one CPU core: fp32 against bf16, gradient checkpointing on
and off, LoRA against full, side by side.

SmolLM2-135M-Instruct (``asyncgrpo model smollm2-135m``; 134.5M parameters, tied embeddings)
trains :meth:`Learner.train_step` on one tree-packed row of ``--groups`` groups, each of 8
samples sharing a ``--prompt``-token prompt with ``--completion``-token completions (all
trained), as an arithmetic task's step holds them. Each setting runs in a process of its own
(so that its peak memory is its own), ``--steps`` steps after one warm-up, and the settings
take turns over ``--rounds`` rounds in alternating order. One torch thread: the core the
trainer gets beside a vLLM server on 2 cores.

Printed per setting: the median forwarded tokens/s of forward+backward (``perf/fwd_bwd_s``),
its ratio to fp32 with checkpointing (the trainer's default until now), the MFU against the
peak this core reaches in that dtype (``perf/fwd_bwd_mfu``), the optimizer's seconds, and the
process's peak resident memory::

    .venv/bin/python benchmarks/real_model.py
    .venv/bin/python benchmarks/real_model.py --settings fp32-ckpt,bf16 --rounds 3

``--baseline COMMIT`` adds the trainer as it was at ``COMMIT`` (a git worktree of it, imported
in place of this checkout): the first of ``--settings`` run by that code, ``baseline``, takes
its turn with the others and is the reference of the ratios. So a change to the learner is
measured side by side with the code before it, in the same setting::

    .venv/bin/python benchmarks/real_model.py --baseline HEAD --settings fp32,fp32-ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SETTINGS = {  # name: (bf16, gradient_checkpointing, lora)
    "fp32-ckpt": (False, True, False),
    "fp32": (False, False, False),
    "bf16-ckpt": (True, True, False),
    "bf16": (True, False, False),
    "lora-fp32": (False, False, True),
    "lora-bf16": (True, False, True),
}


def one_setting(name: str, steps: int, groups: int, prompt: int, completion: int) -> dict:
    """Run one setting in this process; its figures."""
    import numpy as np
    import torch
    from peft import LoraConfig

    from asyncgrpo.adapters.models.causal_lm import load_causal_lm
    from asyncgrpo.adapters.models.packaged import resolve_model
    from asyncgrpo.core.packing.tree import pack_row
    from asyncgrpo.core.records import TrainingSample, TrainingSequence
    from asyncgrpo.shell.config import AsyncGRPOConfig
    from asyncgrpo.shell.learner import Learner
    from asyncgrpo.shell.run.flops import FlopsMeter

    torch.set_num_threads(1)
    bf16, checkpointing, lora = SETTINGS[name]
    model = load_causal_lm(resolve_model("smollm2-135m"))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    samples = []
    for group in range(groups):
        shared = rng.integers(10, vocab, prompt)
        for member in range(8):
            tokens = np.concatenate([shared, rng.integers(10, vocab, completion)])
            mask = np.r_[np.zeros(prompt, np.int8), np.ones(completion, np.int8)]
            logprobs = np.where(mask == 1, -np.log(vocab), 0.0)
            samples.append(
                TrainingSample(
                    TrainingSequence(tokens, mask, logprobs),
                    (-1.0) ** member,
                    0,
                    group,
                    0,
                    group,
                    f"{group}-{member}",
                )
            )
    row = pack_row(samples)
    with tempfile.TemporaryDirectory() as out:
        config = AsyncGRPOConfig(
            output_dir=out,
            bf16=bf16,
            gradient_checkpointing=checkpointing,
            learning_rate=1e-6,
            use_cpu=True,
            score_centering=False,
        )
        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None
        with Learner(model, config, peft_config=peft) as learner:
            meter = FlopsMeter(model.config, learner.device, bf16)
            flops = meter.of_rows([row])
            seconds, optimizer = [], []
            for step in range(steps + 1):
                out_metrics = learner.train_step([row]).metrics
                if step:
                    seconds.append(out_metrics["perf/fwd_bwd_s"])
                    optimizer.append(out_metrics["perf/optimizer_s"])
    median = statistics.median(seconds)
    return {
        "setting": name,
        "forwarded_tokens": row.num_tokens,
        "fwd_bwd_s": seconds,
        "tokens_per_s": row.num_tokens / median,
        "mfu": flops / (median * meter.peak_flops),
        "optimizer_s": statistics.median(optimizer),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


@contextlib.contextmanager
def checkout_of(commit: str) -> Iterator[dict[str, str]]:
    """The environment that imports ``asyncgrpo`` from a worktree of ``commit`` (the package's
    folders laid out as the install maps them), removed afterwards."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree, shim = Path(tmp) / "tree", Path(tmp) / "shim" / "asyncgrpo"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), commit],
            check=True,
        )
        try:
            shim.mkdir(parents=True)
            for entry in (tree / "asyncgrpo").iterdir():
                (shim / entry.name).symlink_to(entry)
            for package in ("core", "adapters", "shell"):
                (shim / package).symlink_to(tree / package)
            yield {**os.environ, "PYTHONPATH": str(shim.parent)}
        finally:
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=True
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--completion", type=int, default=24)
    parser.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="also run the first of --settings as COMMIT's trainer ran it",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a setting's own process
    args = parser.parse_args()
    if args.one:
        print(
            json.dumps(one_setting(args.one, args.steps, args.groups, args.prompt, args.completion))
        )
        return
    names = args.settings.split(",")
    with contextlib.ExitStack() as stack:
        environments = {name: None for name in names}
        if args.baseline:
            names = ["baseline", *names]
            environments["baseline"] = stack.enter_context(checkout_of(args.baseline))
        results = run_rounds(args, names, environments)
    reference = "baseline" if args.baseline else "fp32-ckpt" if "fp32-ckpt" in names else names[0]
    base = statistics.median(r["tokens_per_s"] for r in results[reference])
    first = results[names[0]][0]
    if args.baseline:
        print(f"baseline: {args.settings.split(',')[0]}, the trainer at {args.baseline}")
    print(
        f"SmolLM2-135M-Instruct, one thread; a row of {args.groups} groups x 8 samples, "
        f"{args.prompt}-token prompts, {args.completion}-token completions: "
        f"{first['forwarded_tokens']} forwarded tokens; {args.rounds} rounds x {args.steps} "
        "steps per setting"
    )
    print(
        "| setting | fwd+bwd tokens/s (median; range of rounds) | vs "
        + reference
        + " | MFU | optimizer s | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        rates = [r["tokens_per_s"] for r in results[name]]
        mid = statistics.median(rates)
        print(
            f"| {name} | {mid:.0f} [{min(rates):.0f}, {max(rates):.0f}] | {mid / base:.2f}x "
            f"| {statistics.median(r['mfu'] for r in results[name]):.2f} "
            f"| {statistics.median(r['optimizer_s'] for r in results[name]):.2f} "
            f"| {max(r['peak_rss_mib'] for r in results[name]):.0f} |"
        )


def run_rounds(
    args: argparse.Namespace, names: list[str], environments: dict[str, dict[str, str] | None]
) -> dict[str, list[dict]]:
    """Each setting in a process of its own, ``args.rounds`` rounds in alternating order."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else list(reversed(names)):
            command = [
                sys.executable,
                __file__,
                "--one",
                names[1] if name == "baseline" else name,
                "--steps",
                str(args.steps),
                "--groups",
                str(args.groups),
                "--prompt",
                str(args.prompt),
                "--completion",
                str(args.completion),
            ]
            done = subprocess.run(
                command, capture_output=True, text=True, check=True, env=environments[name]
            )
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(
                f"round {round_ + 1} {name}: {results[name][-1]['tokens_per_s']:.0f} tokens/s",
                file=sys.stderr,
            )
    return results


if __name__ == "__main__":
    main()
