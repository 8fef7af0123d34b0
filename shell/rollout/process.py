"""The rollout process: a child running one ``AsyncRolloutLoop`` on one event loop, forked by
the fork server of :mod:`asyncgrpo.shell.rollout.child` (a restart, or the next run in the same
Python process, starts in well under a second).

The trainer side (:class:`RolloutProcess`) starts it with CUDA hidden, feeds it the policy
version and the tokens each step consumed, takes its messages, and watches it: a crash comes
back with the child's traceback, a missing heartbeat for ``rollout_worker_timeout`` seconds
raises, and :meth:`RolloutProcess.stop` cancels the in-flight requests and joins it.

Nothing hangs silently: the heartbeat carries what the loop is doing (the calls in flight, see
:mod:`asyncgrpo.core.rollout.activity`). While the trainer waits for samples and none comes, it logs
that report every ``LONG_WAIT_LOG_S`` seconds, and after ``rollout_worker_timeout`` seconds it
raises with it (a reward function, tool or environment call that never returns blocks only its
worker thread, so the heartbeat alone would go on beating). The child dies with the trainer
(a parent-death signal) and ignores Ctrl-C, which the trainer handles.

Everything sent into the child is pickled; :func:`~asyncgrpo.shell.rollout.spec.check_picklable`
fails early, at ``train()``, with a ``TypeError`` that names the reward function, tool or
factory that cannot be sent (a lambda or a closure). The child's side is
:mod:`asyncgrpo.shell.rollout.child`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import structlog

from asyncgrpo.core.metrics import mean, total
from asyncgrpo.core.rollout import sample_wait
from asyncgrpo.core.rollout.cursor import PromptCursor, restart_cursor
from asyncgrpo.core.run.step_queue import InFlight
from asyncgrpo.shell.rollout.child import (
    CONTEXT,
    SharedState,
    child_main,
    in_flight_of_word,
)
from asyncgrpo.shell.rollout.messages import GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.spec import LoopSpec, RolloutWorkerError
from asyncgrpo.shell.servers import (
    EvalRequest,
    SharedServers,
    SharedTrust,
    VersionPin,
)

log = structlog.get_logger("asyncgrpo.rollout_process")
LONG_WAIT_LOG_S = 60.0  # log a wait for samples this long, and every this often after
WAIT_GAP_S = 5.0  # a pause between two get() calls this long: the trainer was busy, not waiting
FAILED_STOP_GRACE_S = 1.0  # a child that failed or hung is not waited for longer than this
TRACEBACK_WAIT_S = 1.0  # after the child exited, how long its traceback may take to arrive


STARTUP_FAILURE_EXIT_CODE = 1
"""A child's exit code when Python raised before :func:`child_main` caught anything (importing
the main script, unpickling the process): the same start would raise again, so it is not
restarted. A signal gives a negative code; a failure in the loop sends its traceback."""


def _main_script() -> str:
    """The path of the trainer's main script, which the rollout process imports."""
    return str(getattr(sys.modules["__main__"], "__file__", None) or "(none: interactive)")


def _exit_description(code: int | None) -> str:
    """``"exited with code -9 (killed by SIGKILL)"`` for a process's exit code."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exited with code {code} (killed by {name})"
    return f"exited with code {code}"


@contextlib.contextmanager
def _cuda_hidden() -> Iterator[None]:
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


class RolloutProcess:
    """The trainer's handle on the rollout process.

    Example::

        process = RolloutProcess(spec, timeout_s=config.rollout_worker_timeout).start()
        try:
            for message in process.messages(wait_s=1.0):
                ...
        finally:
            process.stop()

    ``trust``: the server outage record shared with the trainer (the run's, which its first
    weight push already wrote to); a fresh one when not given. ``servers``: with several
    servers, the run's records of all of them (the first one's trust is ``trust``). ``pin``:
    the run's evaluation requests and the version they hold
    (:class:`~asyncgrpo.shell.servers.VersionPin`; a fresh one when not given).

    ``restarts``: how many times a child that dies without a traceback (a signal, an
    out-of-memory kill) is started again, from ``resume_cursor()`` (the trainer's prompt
    cursor: what was in flight is generated again, what reached the trainer is not); after
    that, or without ``resume_cursor``, its death fails the run. ``on_start`` is called with
    each child's pid.

    While the trainer waits for samples, a child that sends nothing at all for ``timeout_s``
    is hung (:class:`RolloutWorkerError`); one whose groups arrive but are all dropped is not,
    and the wait is logged with the counts (:mod:`asyncgrpo.core.rollout.sample_wait`).
    """

    def __init__(
        self,
        spec: LoopSpec,
        timeout_s: float = 300.0,
        trust: SharedTrust | None = None,
        servers: SharedServers | None = None,
        *,
        pin: VersionPin | None = None,
        restarts: int = 0,
        resume_cursor: Callable[[], PromptCursor] | None = None,
        on_start: Callable[[int | None], None] | None = None,
    ) -> None:
        spec.check()
        self.spec = spec
        self.timeout_s = timeout_s
        self.restarts = restarts
        self.restarted = 0
        self._resume_cursor = resume_cursor
        self._on_start = on_start
        self._shared = SharedState(trust, servers, pin)
        self._process: Any = None
        self._waiting_since: float | None = None  # the trainer waits and no sample came
        self._silent_since: float | None = None  # ... and nothing at all came
        self._tally = sample_wait.WaitTally()  # what came meanwhile, all dropped
        self._last_get = -math.inf
        self._logged_wait_s = 0.0
        self._failed = False  # it raised: stopping it does not wait for it

    def start(self) -> RolloutProcess:
        with _cuda_hidden():
            self._process = CONTEXT.Process(
                target=child_main,
                args=(pickle.dumps(self.spec), self._shared, os.getpid(), dict(os.environ)),
                name="asyncgrpo-rollout",
                daemon=True,
            )
            self._process.start()
        self._shared.child_started()
        self._shared.heartbeat.value = time.time()
        if self._on_start is not None:
            self._on_start(self._process.pid)
        return self

    def _restart(self, how: str) -> LoopReport:
        """Start a new child from the trainer's prompt cursor after the last one died; its
        shared values are fresh (the dead child may have held their locks), the trainer's
        figures (policy version, steps, step size) carried over. Returns the metrics."""
        assert self._resume_cursor is not None
        lost = self.in_flight().groups
        old, self._shared = (
            self._shared,
            SharedState(self._shared.trust, self._shared.servers, self._shared.pin),
        )
        for name in ("version", "step_tokens", "steps_taken"):
            getattr(self._shared, name).value = getattr(old, name).value
        old.close()
        self._process.join(0)
        self._process = None
        self.restarted += 1
        start = restart_cursor(self._resume_cursor())
        self.spec = attrs.evolve(self.spec, start_cursor=start)
        log.warning(
            "the rollout process died; restarting it from the trainer's prompt cursor "
            "(the groups that were in flight are generated again)",
            how=how,
            restart=self.restarted,
            restarts=self.restarts,
            regenerated_groups=lost,
            from_position=start.next_untrained,
        )
        self.start()
        self._new_wait()
        return LoopReport(
            (
                total("rollout/process_restart_count", 1),
                mean("rollout/process_restart_regenerated_groups", lost),
            )
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def pin(self) -> VersionPin:
        """The run's evaluation requests and the version they hold (carried across restarts:
        a restarted child runs the pinned request again)."""
        return self._shared.pin

    def request_evaluation(self, version: int, step: int) -> EvalRequest:
        """Ask for an evaluation at ``version`` (pinning it) and wake the loop."""
        request = self._shared.pin.pin(version, step)
        self._shared.wakeup.notify()
        return request

    @property
    def trust(self) -> SharedTrust:
        """Outages of the vLLM server seen by either side, and those the trainer's weights were
        pushed after (:mod:`asyncgrpo.shell.servers.outages`)."""
        return self._shared.trust

    def restart_wait_clock(self) -> None:
        """Forget the trainer's wait for samples (it was waiting for the server instead)."""
        self._new_wait()

    def _new_wait(self) -> None:
        self._waiting_since = self._silent_since = None
        self._tally = sample_wait.WaitTally()

    def _note_gap(self) -> None:
        """A pause of the trainer's calls longer than ``WAIT_GAP_S``: it was busy, not
        waiting; a wait starts anew."""
        now = time.monotonic()
        if now - self._last_get > WAIT_GAP_S:
            self._new_wait()
        self._last_get = now

    def samples_dropped(self, reason: str, count: int) -> None:
        """The trainer dropped ``count`` samples (``sample_wait.STALE`` or ``OVERSIZE``): told
        in the report of a long wait."""
        self._note_gap()
        self._tally = sample_wait.samples_dropped(self._tally, reason, count)

    def set_model_version(self, version: int) -> None:
        self._shared.version.value = version
        self._shared.wakeup.notify()

    def set_server_version(self, server: int, version: int) -> None:
        """The trainer's weights of ``version`` landed on ``server`` (a run with several
        servers: groups routed there are generated by that version)."""
        self._shared.servers.set_version(server, version)
        self._shared.wakeup.notify()

    def step_consumed(self, tokens: float) -> None:
        """Report the step size the staleness allowance is measured in: the unpacked tokens a
        full step holds (:attr:`asyncgrpo.core.run.step_queue.StepQueue.tokens_per_step`)."""
        self._shared.step_tokens.value = float(tokens)
        self._shared.wakeup.notify()

    def set_steps_taken(self, steps: int) -> None:
        """Report the steps the trainer has taken out of its queue, the one it trains now
        included (call before releasing that step's tokens with :meth:`samples_taken`).
        Groups started while the server's policy is more than ``max_staleness`` behind it could
        only be dropped as stale, so the loop starts none
        (:func:`asyncgrpo.core.rollout.pacing.may_start_group`)."""
        self._shared.steps_taken.value = steps
        self._shared.wakeup.notify()

    def samples_taken(self, tokens: int) -> None:
        """Report tokens of samples the trainer is done with (trained, or dropped as stale or
        oversize); until then they count against the staleness allowance."""
        self._shared.taken.value += tokens  # the trainer is its only writer
        self._shared.wakeup.notify()

    def in_flight(self) -> InFlight:
        """The groups the loop has started and not yet published, with the oldest one's
        policy version (its last report)."""
        return in_flight_of_word(int(self._shared.in_flight.value))

    def check_alive(self) -> LoopReport | None:
        """Raise :class:`RolloutWorkerError` if the child failed, stopped beating, or exited
        with no restart left; a child that died without a traceback is restarted while
        ``restarts`` last (the restart's metrics are returned)."""
        try:
            return self._check_alive()
        except RolloutWorkerError:
            self._failed = True
            raise

    def _check_alive(self) -> LoopReport | None:
        error = self._child_error()
        if error is not None:
            raise RolloutWorkerError(f"the rollout process failed:\n{error}")
        if self._process is not None and not self._process.is_alive():
            error = self._child_error(wait_s=TRACEBACK_WAIT_S)  # written just before it exited
            if error is not None:
                raise RolloutWorkerError(f"the rollout process failed:\n{error}")
            if self._process.exitcode == STARTUP_FAILURE_EXIT_CODE:
                raise RolloutWorkerError(
                    f"the rollout process exited with code {STARTUP_FAILURE_EXIT_CODE} before "
                    "its loop started (no traceback came back): it failed while importing the "
                    f"main script {_main_script()} or what the trainer sent it, and its error "
                    "is printed above, on stderr. A script that builds or trains the trainer at "
                    "its top level does this: the rollout process imports the script, running "
                    'its top level again. Put that under `if __name__ == "__main__":`'
                )
            how = _exit_description(self._process.exitcode)
            if self.restarted < self.restarts and self._resume_cursor is not None:
                return self._restart(how)
            again = (
                f" after {self.restarted} restart(s) (rollout_worker_restarts={self.restarts})"
                if self.restarts
                else ""
            )
            raise RolloutWorkerError(
                f"the rollout process {how} and no traceback (killed by a signal or out of "
                f"memory?){again}. The run stops; resume it from its last checkpoint with "
                "asyncgrpo train --resume (or trainer.train(resume_from_checkpoint=True))"
            )
        silent = time.time() - self._shared.heartbeat.value
        if silent > self.timeout_s:
            raise RolloutWorkerError(
                f"the rollout process sent no heartbeat for {silent:.0f} s "
                f"(rollout_worker_timeout={self.timeout_s:.0f} s); its event loop is blocked "
                "(a hook or async call that blocks without awaiting). At its last heartbeat: "
                f"{self.activity()}"
            )
        return None

    def activity(self) -> str:
        """What the rollout loop was doing at its last heartbeat (calls in flight)."""
        return self._shared.activity.value.decode("utf-8", "replace") or "not started yet"

    def _check_progress(self) -> None:
        """Log a long wait for samples; raise when nothing at all came for ``timeout_s``."""
        if self._waiting_since is None:
            return
        now = time.monotonic()
        waited = now - self._waiting_since
        silent = now - (self._silent_since if self._silent_since is not None else now)
        verdict = sample_wait.judge_wait(waited, silent, self.timeout_s, self._tally)
        producing = bool(self._tally.groups or self._tally.dropped)
        if verdict is sample_wait.WaitVerdict.HUNG:
            self._failed = True
            came = f" ({sample_wait.describe_drops(self._tally)})" if producing else ""
            raise RolloutWorkerError(
                f"no sample reached the trainer for {waited:.0f} s while it waited, and "
                f"nothing at all for {silent:.0f} s{came} (rollout_worker_timeout="
                f"{self.timeout_s:.0f} s). The rollout process is alive; it is doing: "
                f"{self.activity()}. A call that never returns blocks the run: give it a "
                "timeout of its own, or raise rollout_worker_timeout if it is that slow on "
                "purpose"
            )
        every = min(LONG_WAIT_LOG_S, self.timeout_s / 2)
        if waited - self._logged_wait_s < every:
            return
        self._logged_wait_s = waited
        if producing:
            log.warning(
                "waiting for samples: the rollout process is producing groups, but "
                "every one is dropped (not a hang; the run goes on)",
                waited_s=round(waited),
                dropped=sample_wait.describe_drops(self._tally),
                rollout=self.activity(),
            )
        else:
            log.warning(
                "waiting for samples",
                waited_s=round(waited),
                fails_after_s=self.timeout_s,
                rollout=self.activity(),
            )

    def _child_error(self, wait_s: float = 0.0) -> str | None:
        try:
            if wait_s > 0:
                return self._shared.errors.get(timeout=wait_s)
            return self._shared.errors.get_nowait()
        except (queue.Empty, EOFError):  # nothing sent; or it exited without sending
            return None

    def _await_exit(self) -> None:
        """The messages' write end closed: the child is exiting; wait until it has (bounded:
        a child that closed the pipe and lives on is left to :meth:`check_alive`)."""
        if self._process is not None:
            self._process.join(TRACEBACK_WAIT_S + 5.0)

    def get(self, wait_s: float) -> GroupOutcome | LoopReport | None:
        """The next message, or ``None`` after ``wait_s`` seconds; checks the child's health
        and, while calls keep finding no samples, how long the trainer has been waiting. After
        a restart of a child that died, the restart's metrics (a :class:`LoopReport`)."""
        self._note_gap()
        try:
            message = self._shared.messages.get(timeout=wait_s)
        except (EOFError, OSError):  # the write end closed ("end of file during message":
            self._await_exit()  # mid-message): the child exited
            if self._process is not None and self._process.is_alive():
                raise
            message = self.check_alive()
        except queue.Empty:
            now = time.monotonic()
            if self._waiting_since is None:
                self._waiting_since = now - wait_s
                self._logged_wait_s = 0.0
            if self._silent_since is None:
                self._silent_since = now - wait_s
            message = self.check_alive()
            if message is None:
                self._check_progress()
        else:
            if isinstance(message, GroupOutcome):
                self._silent_since = None
                if message.samples:
                    self._new_wait()
                else:
                    # A stream of groups that are all dropped is still a wait for samples: its
                    # report must not need a lull of ``wait_s`` between them to be logged.
                    if self._waiting_since is None:
                        self._waiting_since = time.monotonic()
                        self._logged_wait_s = 0.0
                    self._tally = sample_wait.outcome_arrived(self._tally, 0, message.dropped)
                    self._check_progress()
        self._last_get = time.monotonic()
        return message

    def _discard_messages(self) -> None:
        with contextlib.suppress(queue.Empty, EOFError, OSError):
            while True:
                self._shared.messages.get_nowait()

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the loop to stop (in-flight requests are cancelled), then join the process; a
        child that failed or hung (this handle raised) gets ``FAILED_STOP_GRACE_S`` at most,
        since a call that never returns would hold it until ``grace_s``."""
        if self._process is None:
            return
        if self._failed:
            grace_s = min(grace_s, FAILED_STOP_GRACE_S)
        self._shared.stop.value = 1
        self._shared.wakeup.notify()
        deadline = time.monotonic() + grace_s
        while self._process.is_alive() and time.monotonic() < deadline:
            self._discard_messages()  # a child exits only once its queued messages are read
            self._process.join(0.1)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._process = None
        self._shared.close()
