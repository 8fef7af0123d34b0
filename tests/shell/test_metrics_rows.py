"""``metrics.jsonl``'s rows as read back: one per step, in step order, each evaluation in the
row of its weight version's step whenever its result arrives (before that row, after it, or for
a step that logs no window), none dropped; and the file itself only grows."""

from __future__ import annotations

import json
from pathlib import Path

from asyncgrpo.core import metrics
from asyncgrpo.shell.run.metrics_log import MetricsFile, WindowLog, read_metrics


def window_log(tmp_path: Path) -> WindowLog:
    log = WindowLog(tmp_path, num_completions_to_print=0)
    log.file = MetricsFile(tmp_path)
    return log


def write(log: WindowLog, step: int) -> dict[str, float]:
    window = metrics.record(metrics.MetricWindow(), [metrics.mean("reward", step / 8)])
    return log.write(step, window, {}, [])


def evaluated(version: int) -> dict[str, float]:
    return {"eval/held/reward": version / 8, "eval/held/version": float(version)}


def test_evaluations_join_the_rows_of_their_versions_in_step_order(tmp_path) -> None:
    """Every step logs (logging_steps=1, eval_steps=1, evaluations slower than steps): the
    evaluation of version 0 arrives before step 1's row, those of 1 and 2 together after step
    3's, that of 5 before step 5's row, and the last one (6) after step 6's row, which is then
    written again with the end's late window: each sits in its version's row."""
    log = window_log(tmp_path)
    log.evaluation(0, evaluated(0))
    for step in (1, 2, 3):
        summary = write(log, step)
        assert not any(name.startswith("eval/") for name in summary)  # trackers get them apart
    log.evaluation(1, evaluated(1))
    log.evaluation(2, evaluated(2))
    write(log, 4)
    log.evaluation(5, evaluated(5))
    write(log, 5)
    write(log, 6)
    log.evaluation(6, evaluated(6))
    write(log, 6)  # the end: what arrived after step 6's row joins it
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    by_version = {r["step"]: r["eval/held/version"] for r in rows if "eval/held/version" in r}
    assert by_version == {0: 0, 1: 1, 2: 2, 5: 5, 6: 6}
    assert all(r["reward"] == r["step"] / 8 for r in rows[1:])


def test_an_evaluation_of_a_step_without_a_row_gets_a_row_of_its_own(tmp_path) -> None:
    """logging_steps=3, eval_steps=2: the evaluations of versions 2 and 4 get rows of their
    own between the logged steps 3 and 6, whether they arrive before or after the next row;
    one still held when the run ends is written then."""
    log = window_log(tmp_path)
    log.evaluation(2, evaluated(2))
    write(log, 3)
    write(log, 6)
    log.evaluation(4, evaluated(4))
    log.evaluation(8, evaluated(8))
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 8]
    assert [r.get("eval/held/version") for r in rows] == [2, None, 4, None, 8]


def test_the_file_only_grows_across_late_evaluations_and_windows(tmp_path) -> None:
    """A late evaluation (of step 1, after step 2's row), the rest of step 2's window and an
    evaluation of a step without a window (4) are appended: the bytes written before never
    change, and read back each step is one row with everything it got."""
    log = window_log(tmp_path)
    path = tmp_path / "metrics.jsonl"
    write(log, 1)
    write(log, 2)
    before = path.read_bytes()
    log.evaluation(1, evaluated(1))
    write(log, 2)
    grown = path.read_bytes()
    assert grown.startswith(before) and len(grown) > len(before)
    log.evaluation(4, evaluated(4))
    write(log, 3)
    log.close()
    assert path.read_bytes().startswith(grown)
    written = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert written == [1, 2, 1, 2, 4, 3]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["eval/held/version"] == 1 and rows[0]["reward"] == 1 / 8
    assert rows[1]["reward"] == 2 / 8 and "eval/held/version" not in rows[1]
    assert rows[3] == {"step": 4, **evaluated(4)}
