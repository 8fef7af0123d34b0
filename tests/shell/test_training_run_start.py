"""``TrainingRun.start`` builds a run whole, or leaves nothing running: when a part fails to
start, the parts started before it are closed, in the order ``close`` closes them, after the
caller's ``on_failure`` learned the error.

The run's outside systems (the sync path, the pushes, the server's settings, the rollout
process) are fakes that record what happens to them, so no server or model is involved.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncgrpo.adapters.models.causal_lm import tiny_config
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import AsyncRolloutLoop
from asyncgrpo.shell.run import training_run
from asyncgrpo.shell.run.inputs import RunInputs
from asyncgrpo.shell.run.training_run import RunBooks, TrainingRun
from asyncgrpo.shell.servers import VersionPin


class FailedToStart(RuntimeError):
    """What the part told to fail raises."""


class Recorder:
    """Records ``<part>.<event>`` in order; the event named ``fail_at`` raises instead."""

    def __init__(self, fail_at: str | None) -> None:
        self.events: list[str] = []
        self.fail_at = fail_at

    def __call__(self, event: str) -> None:
        self.events.append(event)
        if event == self.fail_at:
            raise FailedToStart(f"{event} failed")


class FakePart:
    """A started part: each method named in ``methods`` records ``<name>.<method>``."""

    def __init__(self, name: str, record: Recorder, methods: tuple[str, ...]) -> None:
        self.lora_name = None
        for method in methods:
            setattr(self, method, self._recording(f"{name}.{method}", record))

    @staticmethod
    def _recording(event: str, record: Recorder) -> Any:
        def method(*args: Any, **kwargs: Any) -> None:
            record(event)

        return method


def _books(tmp: Path) -> RunBooks:
    args = AsyncGRPOConfig(output_dir=str(tmp), disable_tqdm=True)
    inputs = RunInputs(
        args=args,
        model_name="tiny",
        model_config=tiny_config("qwen3", vocab_size=64),
        processing_class=None,
        dataset=None,
        reward_funcs=(),
        tools=(),
        environment_factory=None,
        loop_cls=AsyncRolloutLoop,
        callbacks=None,
        after_checkpoint=lambda step, rank0: None,
    )
    learner = SimpleNamespace(rank=0, world_size=1, step=0, device=torch.device("cpu"), bf16=False)
    return RunBooks.open(inputs, learner, None)


def _fake_outside(monkeypatch: pytest.MonkeyPatch, record: Recorder) -> None:
    """Replace what ``TrainingRun.start`` starts with parts that tell ``record``."""
    weights = FakePart("weights", record, ("start", "close"))
    pushes = FakePart("pushes", record, ("start", "close"))
    process = FakePart(
        "process",
        record,
        ("start", "stop", "set_server_version", "set_model_version", "set_steps_taken"),
    )
    process.pin = VersionPin()  # the evaluations read and release it
    monkeypatch.setattr(training_run, "open_weight_sync", lambda *args: weights)
    monkeypatch.setattr(training_run, "WeightPusher", lambda *args, **kwargs: None)
    monkeypatch.setattr(training_run, "RunPushes", lambda *args: pushes)
    monkeypatch.setattr(
        training_run,
        "ParityGuard",
        SimpleNamespace(for_run=lambda *args: record("parity.for_run")),
    )
    served = SimpleNamespace(max_model_len=lambda model_name: 64)
    monkeypatch.setattr(training_run, "ServerSettings", SimpleNamespace(of=lambda args: served))
    monkeypatch.setattr(
        training_run,
        "FlopsMeter",
        lambda *args: SimpleNamespace(peak_flops=1e12, peak_source="datasheet"),
    )
    monkeypatch.setattr(training_run, "RolloutProcess", lambda *args, **kwargs: process)


STARTED = [
    "weights.start",
    "parity.for_run",
    "pushes.start",
    "process.start",
    "process.set_server_version",
    "process.set_model_version",
    "process.set_steps_taken",
]


def test_a_started_run_holds_every_part_and_closes_them_in_order(tmp_path, monkeypatch) -> None:
    record = Recorder(fail_at=None)
    _fake_outside(monkeypatch, record)
    run = TrainingRun.start(_books(tmp_path))
    assert record.events == STARTED
    assert run.rollout is not None and run.rollout.token_budget == 64
    run.close()
    assert record.events[len(STARTED) :] == ["pushes.close", "process.stop", "weights.close"]


@pytest.mark.parametrize(
    ("fail_at", "closed"),
    [
        ("weights.start", ["weights.close"]),
        ("parity.for_run", ["pushes.close", "weights.close"]),
        ("pushes.start", ["pushes.close", "weights.close"]),
        ("process.start", ["pushes.close", "process.stop", "weights.close"]),
        ("process.set_steps_taken", ["pushes.close", "process.stop", "weights.close"]),
    ],
)
def test_a_part_that_fails_to_start_closes_those_started_before_it(
    tmp_path, monkeypatch, fail_at, closed
) -> None:
    record = Recorder(fail_at)
    _fake_outside(monkeypatch, record)
    books = _books(tmp_path)
    told: list[BaseException] = []
    with pytest.raises(FailedToStart, match=fail_at):
        TrainingRun.start(books, on_failure=lambda error: told.append(error) or record("told"))
    started = record.events.index(fail_at) + 1
    assert record.events[:started] == STARTED[: STARTED.index(fail_at) + 1]
    assert record.events[started:] == ["told", *closed]
    assert isinstance(told[0], FailedToStart)
    for opened in (books.window_log.file, books.evaluations.file):  # opened before the push
        assert (opened is None) == (fail_at in ("weights.start", "parity.for_run"))
        assert opened is None or opened._file.closed
