import json

import pytest

from asyncgrpo.shell.commands import main
from asyncgrpo.shell.commands.simulate import SimulationConfig, simulate
from asyncgrpo.shell.run import read_metrics


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_simulation_respects_staleness_and_learns(tmp_path, max_staleness) -> None:
    config = SimulationConfig(max_steps=40, max_staleness=max_staleness, logging_steps=10)
    windows = simulate(config, tmp_path, progress=False)
    assert [w["step"] for w in windows] == [10, 20, 30, 40]
    assert all(w["sample/staleness_max"] <= max_staleness for w in windows)
    assert windows[-1]["reward"] > windows[0]["reward"]
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["reward"]) for r in rows] == [(w["step"], w["reward"]) for w in windows]


def test_metrics_file_writes_nan_as_null(tmp_path) -> None:
    simulate(
        SimulationConfig(max_steps=5, dataset_size=8, logging_steps=5), tmp_path, progress=False
    )
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON: no NaN tokens
        assert "NaN" not in line


def test_cli_runs_and_rejects_bad_config_with_the_field_name(tmp_path, capsys) -> None:
    assert (
        main(["simulate", "--output-dir", str(tmp_path), "--max-steps", "5", "--no-progress"]) == 0
    )
    assert "simulated 5 steps" in capsys.readouterr().out
    assert main(["simulate", "--output-dir", str(tmp_path), "--token-budget", "8"]) == 2
    assert "token_budget" in capsys.readouterr().err


def test_plot_writes_a_png_of_a_run(tmp_path, capsys) -> None:
    simulate(SimulationConfig(max_steps=10), tmp_path, progress=False)
    assert main(["plot", str(tmp_path)]) == 0
    png = (tmp_path / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
