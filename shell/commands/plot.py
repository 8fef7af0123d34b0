"""``asyncgrpo plot RUN_DIR``: PNG plots of a run from its ``metrics.jsonl``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from asyncgrpo.shell.run import read_metrics

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "reward_kept", "reward_dropped")),
    ("collapse: groups with no reward spread, duplicate replies, entropy",
     ("frac_reward_zero_std", "completions/duplicate_frac", "entropy")),
    ("distinct completions per group", ("completions/distinct_per_group",)),
    ("staleness", ("sample/staleness_mean", "sample/staleness_max")),
    ("queue", ("rollout/queue_size", "perf/rollout_wait_s", "rollout/backpressure_s")),
    ("throughput", ("rollout/generated_tokens_per_s", "perf/wall_clock_trained_tokens_per_s",
                    "perf/fwd_bwd_forwarded_tokens_per_s")),
)  # fmt: skip


def plot_run(run_dir: str | Path, panels: Sequence[tuple[str, Sequence[str]]] = PANELS) -> Path:
    """Draw one panel per group of metrics against ``step``; returns the PNG's path.

    Metrics a run did not log are skipped; a panel with nothing to show says so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no logging windows yet")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True)
    for ax, (title, names) in zip(axes, panels, strict=True):
        drawn = False
        for name in names:
            points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker=".", label=name)
                drawn = True
        ax.set_title(title)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    path = Path(run_dir) / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
