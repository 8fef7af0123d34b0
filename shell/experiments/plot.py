"""``asyncgrpo plot RUN_DIR``: PNG plots of a run from its ``metrics.jsonl``.

A run with several servers gets a panel per server metric too (groups, generated tokens/s,
rollouts in flight and outages of each server, ``rollout/server/<i>/...``). A run that
evaluated gets two more from ``evaluations.jsonl``: each dataset's evaluation reward, with its
interval, by step (its weight version) and by seconds of training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.shell.run import EVALUATIONS_FILE, read_metrics

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "reward_kept", "reward_dropped")),
    (
        "collapse: groups with no reward spread, duplicate replies, entropy",
        ("frac_reward_zero_std", "completions/duplicate_frac", "entropy"),
    ),
    ("distinct completions per group", ("completions/distinct_per_group",)),
    ("staleness", ("sample/staleness_mean", "sample/staleness_max")),
    (
        "staleness by completion length (quarters of max_completion_length; q4 the longest)",
        tuple(f"sample/length_q{q}/staleness_mean" for q in range(1, 5)),
    ),
    (
        "share of samples dropped as stale, by completion length",
        tuple(f"sample/length_q{q}/dropped_stale_frac" for q in range(1, 5)),
    ),
    ("queue", ("rollout/queue_size", "perf/rollout_wait_s", "rollout/backpressure_s")),
    (
        "throughput",
        (
            "rollout/generated_tokens_per_s",
            "perf/wall_clock_trained_tokens_per_s",
            "perf/fwd_bwd_forwarded_tokens_per_s",
        ),
    ),
)


SERVER_PANELS: tuple[tuple[str, str], ...] = (
    ("groups per window, by server", "groups_count"),
    ("generated tokens/s, by server", "generated_tokens_per_s"),
    ("rollouts in flight, by server", "in_flight"),
    ("outages, by server", "outage_count"),
)


def server_panels(rows: Sequence[dict[str, float]]) -> list[tuple[str, list[str]]]:
    """One panel per :data:`SERVER_PANELS` metric a run with several servers logged, a line
    per server.

    Example:
        >>> server_panels([{"step": 1, "rollout/server/0/groups_count": 2.0,
        ...                 "rollout/server/1/groups_count": 1.0}])
        [('groups per window, by server', ['rollout/server/0/groups_count', \
'rollout/server/1/groups_count'])]
    """
    parts = [key.split("/") for row in rows for key in row if key.startswith("rollout/server/")]
    servers = sorted({int(p[2]) for p in parts if len(p) > 3 and p[2].isdigit()})
    panels = []
    for title, metric in SERVER_PANELS:
        names = [f"rollout/server/{i}/{metric}" for i in servers]
        if any(name in row for row in rows for name in names):
            panels.append((title, names))
    return panels


def evaluation_rewards(rows: Sequence[dict[str, float]]) -> list[str]:
    """The ``eval/<name>/reward`` metrics of a run's evaluations, one per dataset.

    Example:
        >>> evaluation_rewards([{"step": 0, "eval/test/reward": 0.5, "eval/test/pass@1": 0.5}])
        ['eval/test/reward']
    """
    names = {key for row in rows for key in row}
    return sorted(n for n in names if n.startswith("eval/") and n.endswith("/reward"))


def _draw_evaluations(axes: Sequence[Any], rows: Sequence[dict[str, float]]) -> None:
    """Each dataset's evaluation reward with its interval, by step and by training time."""
    for ax, x_name, label in zip(
        axes, ("step", "time_s"), ("step (weight version)", "seconds of training"), strict=True
    ):
        for name in evaluation_rewards(rows):
            points = [
                (
                    r[x_name],
                    r[name],
                    r.get(name + "/ci_low", r[name]),
                    r.get(name + "/ci_high", r[name]),
                )
                for r in rows
                if r.get(name) is not None
            ]
            x, y, low, high = zip(*points, strict=True)
            ax.plot(x, y, marker="o", label=name)
            ax.fill_between(x, low, high, alpha=0.2)
        ax.set_title(f"evaluation reward (90% interval over prompts), by {label}")
        ax.set_xlabel(label)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)


def plot_run(run_dir: str | Path, panels: Sequence[tuple[str, Sequence[str]]] = PANELS) -> Path:
    """Draw one panel per group of metrics against ``step`` (and per server metric of a run
    with several servers, :func:`server_panels`); returns the PNG's path.

    Metrics a run did not log are skipped; a panel with nothing to show says so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no logging windows yet")
    panels = [*panels, *server_panels(rows)]
    evaluated = (Path(run_dir) / EVALUATIONS_FILE).is_file()
    evaluations = read_metrics(run_dir, EVALUATIONS_FILE) if evaluated else []
    extra = 2 if evaluation_rewards(evaluations) else 0
    count = len(panels) + extra
    fig, axes = plt.subplots(count, 1, figsize=(8, 2.6 * count))
    if extra:
        _draw_evaluations(axes[len(panels) :], evaluations)
    for ax, (title, names) in zip(axes, panels, strict=False):
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
        ax.set_xlabel("step")
    fig.tight_layout()
    path = Path(run_dir) / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
