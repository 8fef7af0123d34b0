"""A weight version the servers keep while an evaluation reads it.

The trainer pins version ``v`` when it asks for an evaluation (:meth:`VersionPin.pin`, as the
push of ``v`` lands), the rollout process reads the request and releases the pin when the
evaluation has finished (:meth:`VersionPin.finish`), and the trainer's push of any later
version waits meanwhile (:meth:`VersionPin.hold`). So every completion of an evaluation comes
from the weights of ``v``; a version that changed under an evaluation in flight would mix two
policies, and an evaluation redone at each new version might never finish when steps are
shorter than evaluations.

It crosses the spawn into the rollout process; each value has one writer and is an aligned
machine word (the trainer: the request and a cancellation; the rollout process: the finished
request), so neither side can be left waiting on a lock the other died holding. A rollout
process that dies mid-evaluation is started again with the same pin, and its successor runs the
pinned request again.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import attrs

_CONTEXT = mp.get_context("spawn")
POLL_S = 0.02


@attrs.frozen
class EvalRequest:
    """The trainer asks for an evaluation of every evaluation dataset at weight ``version``
    (the trainer's step ``step``); ``request_id`` counts the requests of a run from 1."""

    request_id: int
    version: int
    step: int


class VersionPin:
    """The pinned version of a run (see the module docstring)."""

    def __init__(self) -> None:
        self._request_id = _CONTEXT.Value("q", 0, lock=False)  # trainer
        self._version = _CONTEXT.Value("q", -1, lock=False)  # trainer
        self._step = _CONTEXT.Value("q", 0, lock=False)  # trainer
        self._cancelled = _CONTEXT.Value("q", 0, lock=False)  # trainer
        self._finished = _CONTEXT.Value("q", 0, lock=False)  # rollout process

    # ----------------------------------------------------------- the trainer's side

    def pin(self, version: int, step: int) -> EvalRequest:
        """Ask for an evaluation at ``version`` and hold later pushes until it has finished;
        the request's id. The previous request must have finished or been cancelled."""
        if self.pinned() is not None:
            raise RuntimeError("an evaluation is already in flight; pin one at a time")
        request = EvalRequest(int(self._request_id.value) + 1, version, step)
        self._version.value = version
        self._step.value = step
        self._request_id.value = request.request_id  # last: the reader checks it first
        return request

    def pinned(self) -> int | None:
        """The version held for an evaluation in flight, or None."""
        request_id = int(self._request_id.value)
        done = max(int(self._finished.value), int(self._cancelled.value))
        return int(self._version.value) if request_id > done else None

    def hold(self, version: int) -> float:
        """Wait while an evaluation reads an older version than ``version`` (a push of
        ``version`` would change it under the evaluation); the seconds waited."""
        started = time.monotonic()
        if (held := self.pinned()) is None or held >= version:
            return 0.0
        while (held := self.pinned()) is not None and held < version:
            time.sleep(POLL_S)
        return time.monotonic() - started

    def cancel(self) -> None:
        """Release the pin without a result (the run is ending): pushes go on."""
        self._cancelled.value = int(self._request_id.value)

    # ----------------------------------------------------------- the rollout process's side

    def request(self) -> EvalRequest | None:
        """The request to run now (pinned, not finished, not cancelled), or None."""
        request_id = int(self._request_id.value)
        if request_id <= max(int(self._finished.value), int(self._cancelled.value)):
            return None
        return EvalRequest(request_id, int(self._version.value), int(self._step.value))

    def finish(self, request_id: int) -> None:
        """The request ``request_id`` has finished (its outcome is published)."""
        self._finished.value = request_id
