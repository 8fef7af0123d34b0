"""Signals inside :func:`signals_interrupt` raise ``Interrupted``; inside
:func:`interrupts_deferred` the first one waits for the block to end (a checkpoint or a weight
transfer is never cut in the middle), a second one is raised at once."""

from __future__ import annotations

import os
import pickle
import signal

import pytest

from asyncgrpo.shell.run.interrupts import (
    Interrupted,
    TrainingInterrupted,
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
