"""The spread guard's warning, as a run without reward spread meets it: while the trainer
waits at one step, the watch closes a step's worth of groups again and again; the warning
comes once for that step, not again with other counts."""

from __future__ import annotations

from structlog.testing import capture_logs

from asyncgrpo.core import metrics
from asyncgrpo.shell.run.spread_guard import WARN_AFTER_SPREADLESS, SpreadGuard


def close_spreadless_steps(guard: SpreadGuard, trainer_step: int, count: int) -> list[bool]:
    """``count`` of the watch's steps, each one group with zero spread, at one trainer step."""
    stops = []
    for _ in range(count):
        guard.group_seen([metrics.mean("frac_reward_zero_std", 1.0)])
        stops.append(guard.close_step(trainer_step, entropy=float("nan")))
    return stops


def test_the_no_spread_warning_comes_once_per_trainer_step() -> None:
    guard = SpreadGuard(stop_after=None, num_generations=8)
    with capture_logs() as logs:
        stops = close_spreadless_steps(guard, trainer_step=0, count=3 * WARN_AFTER_SPREADLESS)
        close_spreadless_steps(guard, trainer_step=1, count=WARN_AFTER_SPREADLESS)
    warnings = [e for e in logs if e["event"].startswith("no reward spread left")]
    assert [(w["step"], w["spreadless_steps"]) for w in warnings] == [
        (0, WARN_AFTER_SPREADLESS),
        (1, 4 * WARN_AFTER_SPREADLESS),
    ]
    assert not any(stops) and all("entropy" not in w for w in warnings)  # none before a step
