"""Signals inside :func:`signals_interrupt` raise ``Interrupted``; inside
:func:`interrupts_deferred` the first one waits for the block to end (a checkpoint or a weight
transfer is never cut in the middle), a second one is raised at once. A run already stopping
on an error ends with that error, whatever signal arrives during its teardown."""

from __future__ import annotations

import os
import pickle
import signal

import pytest

from asyncgrpo.shell.run.interrupts import (
    Interrupted,
    TrainingInterrupted,
    failures_outrank_signals,
    interrupts_deferred,
    signals_interrupt,
)


def send(signum: int) -> None:
    """Deliver ``signum`` to this process; its handler runs before ``os.kill`` returns."""
    os.kill(os.getpid(), signum)


def test_a_signal_raises_interrupted_naming_it() -> None:
    with signals_interrupt(), pytest.raises(Interrupted) as raised:
        send(signal.SIGTERM)
    assert raised.value.signum == signal.SIGTERM
    assert str(raised.value) == "interrupted by SIGTERM"


def test_a_deferred_signal_is_raised_when_the_block_ends() -> None:
    finished = []
    with signals_interrupt(), pytest.raises(Interrupted) as raised, interrupts_deferred():
        send(signal.SIGINT)
        finished.append("inner")
        with interrupts_deferred():  # nested: held until the outermost block ends
            finished.append("nested")
        finished.append("outer")
    assert finished == ["inner", "nested", "outer"]
    assert raised.value.signum == signal.SIGINT


def test_a_second_signal_is_raised_at_once() -> None:
    finished = []
    with signals_interrupt(), pytest.raises(Interrupted) as raised, interrupts_deferred():
        send(signal.SIGINT)
        send(signal.SIGTERM)
        finished.append("after both")
    assert finished == []
    assert raised.value.signum == signal.SIGTERM
    with signals_interrupt(), interrupts_deferred():
        pass  # nothing is left held from the interrupted block


def test_without_a_signal_the_block_ends_normally() -> None:
    with signals_interrupt(), interrupts_deferred():
        value = 1
    assert value == 1


@pytest.mark.parametrize("error", [Interrupted(15), TrainingInterrupted(2, "stopped at step 3")])
def test_interrupts_survive_pickling(error: Interrupted) -> None:
    """torch.distributed gathers a rank's exception as a pickle (its distributed checkpoint
    does): the copy keeps the class, the signal and the message."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (copy.signum, str(copy)) == (error.signum, str(error))


class Teardown:
    """A context whose exit (the teardown) receives ``signum`` before it finishes."""

    def __init__(self, signum: int, finished: list[str]) -> None:
        self.signum, self.finished = signum, finished

    def __enter__(self) -> Teardown:
        return self

    def __exit__(self, *exc: object) -> None:
        send(self.signum)
        self.finished.append("teardown")


def test_a_signal_during_the_teardown_of_a_failing_run_keeps_its_error() -> None:
    """torchrun sends SIGTERM to every rank once one rank fails; the others, stopping on the
    same error, still end with it and finish their teardown."""
    finished: list[str] = []
    with (
        pytest.raises(RuntimeError, match="server gone") as raised,
        signals_interrupt(),
        failures_outrank_signals() as failing,
        Teardown(signal.SIGTERM, finished),
    ):
        try:
            raise RuntimeError("server gone")
        except RuntimeError as error:
            failing(error)
            raise
    assert finished == ["teardown"]
    assert raised.value.__notes__ == [
        "SIGTERM arrived while the run was stopping on this error; its teardown went on to the end"
    ]
    with signals_interrupt(), pytest.raises(Interrupted):  # nothing is left held or failing
        send(signal.SIGTERM)


def test_before_a_failure_is_named_a_signal_in_the_teardown_still_interrupts() -> None:
    """The negative control: without ``failing(error)`` the signal replaces the error."""
    finished: list[str] = []
    with (
        pytest.raises(Interrupted),
        signals_interrupt(),
        failures_outrank_signals(),
        Teardown(signal.SIGTERM, finished),
    ):
        raise RuntimeError("server gone")
    assert finished == []


def test_a_second_signal_during_a_failing_teardown_is_raised_at_once() -> None:
    with (
        pytest.raises(Interrupted) as raised,
        signals_interrupt(),
        failures_outrank_signals() as failing,
    ):
        failing(RuntimeError("server gone"))
        send(signal.SIGTERM)
        send(signal.SIGINT)
    assert raised.value.signum == signal.SIGINT


def test_a_failure_named_again_keeps_the_signal_noted_on_it() -> None:
    """A run whose part failed to start names the error before closing what started
    (``TrainingRun.start``) and the trainer names it again: a signal noted in between still
    counts, so the next one is raised at once."""
    error = RuntimeError("rollout process did not start")
    with (
        pytest.raises(Interrupted) as raised,
        signals_interrupt(),
        failures_outrank_signals() as failing,
    ):
        failing(error)
        send(signal.SIGTERM)  # noted on the error: the teardown goes on
        failing(error)
        send(signal.SIGINT)
    assert raised.value.signum == signal.SIGINT
    assert len(error.__notes__) == 1
