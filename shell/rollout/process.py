"""The rollout process: a spawned child running one ``AsyncRolloutLoop`` on one event loop.

The trainer side (:class:`RolloutProcess`) starts it with CUDA hidden, feeds it the policy
version and the tokens each step consumed, takes its messages, and watches it: a crash comes
back with the child's traceback, a missing heartbeat for ``rollout_worker_timeout`` seconds
raises, and :meth:`RolloutProcess.stop` cancels the in-flight requests and joins it.

Nothing hangs silently: the heartbeat carries what the loop is doing (the calls in flight, see
:mod:`asyncgrpo.core.activity`). While the trainer waits for samples and none comes, it logs
that report every ``LONG_WAIT_LOG_S`` seconds, and after ``rollout_worker_timeout`` seconds it
raises with it (a reward function, tool or environment call that never returns blocks only its
worker thread, so the heartbeat alone would go on beating). The child dies with the trainer
(a parent-death signal) and ignores Ctrl-C, which the trainer handles.

Everything sent into the child is pickled; :func:`check_picklable` fails early, at
``train()``, with a ``TypeError`` that names the reward function, tool or factory that cannot
be sent (a lambda or a closure).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import attrs
import structlog

from asyncgrpo.adapters.parent_death import die_with_parent
from asyncgrpo.core.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout.loop import AsyncRolloutLoop
from asyncgrpo.shell.rollout.messages import GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.tools import callable_name
from asyncgrpo.shell.servers import RolloutGate, SharedServers, SharedTrust

_CONTEXT = mp.get_context("spawn")
log = structlog.get_logger("asyncgrpo.rollout_process")
ACTIVITY_BYTES = 2048
LONG_WAIT_LOG_S = 60.0  # log a wait for samples this long, and every this often after
WAIT_GAP_S = 5.0  # a pause between two get() calls this long: the trainer was busy, not waiting


class RolloutWorkerError(RuntimeError):
    """The rollout process failed or hung; the message carries the child's traceback."""


def check_picklable(kind: str, objects: Sequence[Any] | Mapping[str, Any] | None) -> None:
    """Raise a ``TypeError`` naming the first object of ``kind`` that cannot be pickled."""
    items = objects.items() if isinstance(objects, Mapping) else enumerate(objects or ())
    for key, obj in items:
        try:
            pickle.dumps(obj)
        except Exception as error:
            name = callable_name(obj) if callable(obj) else repr(obj)
            where = f" (key {key!r})" if isinstance(objects, Mapping) else ""
            raise TypeError(
                f"{kind} {name!r}{where} cannot be sent to the rollout process: {error}. "
                "Use a module-level function, functools.partial or a callable class instance; "
                "lambdas and closures cannot be pickled"
            ) from error


@attrs.frozen
class LoopSpec:
    """Everything the child needs to build its loop (pickled into it)."""

    loop_cls: type[AsyncRolloutLoop]
    config: AsyncGRPOConfig
    model_name: str
    dataset: Any
    reward_funcs: tuple[Callable[..., Any], ...]
    processing_class: Any
    max_model_len: int
    token_budget: int
    rows_per_step: int
    tools: tuple[Callable[..., Any], ...] = ()
    environment_factory: Any = None
    lora_name: str | None = None
    start_cursor: PromptCursor = attrs.field(factory=PromptCursor)

    def check(self) -> None:
        """Fail early on anything that cannot reach the child."""
        check_picklable("reward function", self.reward_funcs)
        check_picklable("tool", self.tools)
        if isinstance(self.environment_factory, Mapping):
            check_picklable("environment factory", self.environment_factory)
        elif self.environment_factory is not None:
            check_picklable("environment factory", [self.environment_factory])
        check_picklable("rollout loop class", [self.loop_cls])
        check_picklable("dataset", [self.dataset])
        check_picklable("processing class", [self.processing_class])
        check_picklable("config", [self.config])


class _Wakeup:
    """A pipe the trainer writes a byte to whenever it changes what the rollout loop reads, and
    the loop awaits instead of polling (it crosses the spawn: the pipe's ends are
    ``multiprocessing`` connections). Writes never block: a full pipe already wakes the loop."""

    def __init__(self) -> None:
        self._reader, self._writer = _CONTEXT.Pipe(duplex=False)

    def notify(self) -> None:
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.set_blocking(self._writer.fileno(), False)
            os.write(self._writer.fileno(), b"\0")

    async def wait(self) -> None:
        """Return once a byte was written since the last wait (in the rollout process)."""
        fd = self._reader.fileno()
        os.set_blocking(fd, False)
        await anyio.wait_readable(fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 4096):
                pass


class _Shared:
    """The shared values between trainer and child."""

    def __init__(self, trust: SharedTrust | None, servers: SharedServers | None = None) -> None:
        self.messages: mp.Queue = _CONTEXT.Queue()
        self.errors: mp.Queue = _CONTEXT.Queue()
        self.version = _CONTEXT.Value("q", 0)
        self.step_tokens = _CONTEXT.Value("d", -1.0)
        self.taken = _CONTEXT.Value("q", 0)
        self.steps_taken = _CONTEXT.Value("q", 0)
        self.in_flight = _CONTEXT.Value("q", 0)
        self.heartbeat = _CONTEXT.Value("d", time.time())
        self.activity = _CONTEXT.Array("c", ACTIVITY_BYTES)
        self.stop = _CONTEXT.Event()
        self.servers = servers or SharedServers(first=trust or SharedTrust())
        self.trust = self.servers.trusts[0]
        self.wakeup = _Wakeup()


@attrs.frozen
class _ProcessChannels:
    """The loop's :class:`~asyncgrpo.shell.rollout.messages.Channels` across the process
    boundary."""

    shared: _Shared

    def publish(self, message: GroupOutcome | LoopReport) -> None:
        self.shared.messages.put(message)

    def model_version(self) -> int:
        return int(self.shared.version.value)

    def tokens_per_step(self) -> float | None:
        tokens = float(self.shared.step_tokens.value)
        return None if tokens < 0 else tokens

    def tokens_taken(self) -> int:
        return int(self.shared.taken.value)

    def steps_taken(self) -> int:
        return int(self.shared.steps_taken.value)

    def report_in_flight(self, groups: int) -> None:
        self.shared.in_flight.value = groups

    def beat(self, activity: str = "") -> None:
        self.shared.heartbeat.value = time.time()
        encoded = activity.encode("utf-8", "replace")[: ACTIVITY_BYTES - 1]
        self.shared.activity.value = encoded

    def stop_requested(self) -> bool:
        return self.shared.stop.is_set()

    async def wait_for_trainer(self) -> None:
        await self.shared.wakeup.wait()


def _load_spec(pickled: bytes) -> LoopSpec:
    """Unpickle the loop spec, naming the usual cause when user code cannot be found here."""
    try:
        return pickle.loads(pickled)
    except (AttributeError, ImportError) as error:
        raise RolloutWorkerError(
            f"the rollout process could not load what the trainer sent it: "
            f"{type(error).__name__}: {error}. The rollout process is spawned: it imports the "
            "modules your reward functions, tools, environment factories and rollout loop "
            "class live in, and runs the script that started training without its "
            '`if __name__ == "__main__":` block. Define them at module level (above that '
            "block, or in an importable module), not inside it, in a notebook cell or in the "
            "interactive interpreter"
        ) from error


def _child_main(pickled_spec: bytes, shared: _Shared, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the trainer stops this process itself. A trainer
    # killed outright takes this process with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, parent_pid)
    try:
        spec = _load_spec(pickled_spec)
        loop = spec.loop_cls(
            spec.config,
            spec.model_name,
            spec.dataset,
            list(spec.reward_funcs),
            spec.processing_class,
            _ProcessChannels(shared),
            max_model_len=spec.max_model_len,
            token_budget=spec.token_budget,
            rows_per_step=spec.rows_per_step,
            tools=list(spec.tools),
            environment_factory=spec.environment_factory,
            lora_name=spec.lora_name,
            start_cursor=spec.start_cursor,
            server_gate=RolloutGate(shared.trust, spec.config.vllm_server_timeout),
            **({"servers": shared.servers} if len(shared.servers) > 1 else {}),
        )
        anyio.run(loop.run)
    except BaseException as error:
        shared.errors.put(f"{type(error).__name__}: {error}\n\n{traceback.format_exc()}")
        raise


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
    servers, the run's records of all of them (the first one's trust is ``trust``).
    """

    def __init__(self, spec: LoopSpec, timeout_s: float = 300.0,
                 trust: SharedTrust | None = None,
                 servers: SharedServers | None = None) -> None:  # fmt: skip
        spec.check()
        self.spec = spec
        self.timeout_s = timeout_s
        self._shared = _Shared(trust, servers)
        self._process: Any = None
        self._waiting_since: float | None = None  # the trainer waits and no sample came
        self._last_get = -math.inf
        self._logged_wait_s = 0.0

    def start(self) -> RolloutProcess:
        with _cuda_hidden():
            self._process = _CONTEXT.Process(
                target=_child_main, args=(pickle.dumps(self.spec), self._shared, os.getpid()),
                name="asyncgrpo-rollout",
                daemon=True,
            )  # fmt: skip
            self._process.start()
        self._shared.heartbeat.value = time.time()
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def trust(self) -> SharedTrust:
        """Outages of the vLLM server seen by either side, and those the trainer's weights were
        pushed after (:mod:`asyncgrpo.shell.servers.outages`)."""
        return self._shared.trust

    def restart_wait_clock(self) -> None:
        """Forget the trainer's wait for samples (it was waiting for the server instead)."""
        self._waiting_since = None

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
        full step holds (:attr:`asyncgrpo.core.step_queue.StepQueue.tokens_per_step`)."""
        self._shared.step_tokens.value = float(tokens)
        self._shared.wakeup.notify()

    def set_steps_taken(self, steps: int) -> None:
        """Report the steps the trainer has taken out of its queue, the one it trains now
        included (call before releasing that step's tokens with :meth:`samples_taken`).
        Groups started while the server's policy is more than ``max_staleness`` behind it could
        only be dropped as stale, so the loop starts none
        (:func:`asyncgrpo.core.pacing.may_start_group`)."""
        self._shared.steps_taken.value = steps
        self._shared.wakeup.notify()

    def samples_taken(self, tokens: int) -> None:
        """Report tokens of samples the trainer is done with (trained, or dropped as stale or
        oversize); until then they count against the staleness allowance."""
        with self._shared.taken.get_lock():
            self._shared.taken.value += tokens
        self._shared.wakeup.notify()

    def groups_in_flight(self) -> int:
        """Groups the loop has started and not yet published (its last report)."""
        return int(self._shared.in_flight.value)

    def check_alive(self) -> None:
        """Raise :class:`RolloutWorkerError` if the child failed, exited or stopped beating."""
        error = self._child_error()
        if error is not None:
            raise RolloutWorkerError(f"the rollout process failed:\n{error}")
        if self._process is not None and not self._process.is_alive():
            raise RolloutWorkerError(
                f"the rollout process exited with code {self._process.exitcode} and no "
                "traceback (killed by a signal or out of memory?)"
            )
        silent = time.time() - self._shared.heartbeat.value
        if silent > self.timeout_s:
            raise RolloutWorkerError(
                f"the rollout process sent no heartbeat for {silent:.0f} s "
                f"(rollout_worker_timeout={self.timeout_s:.0f} s); its event loop is blocked "
                "(a hook or async call that blocks without awaiting). At its last heartbeat: "
                f"{self.activity()}"
            )

    def activity(self) -> str:
        """What the rollout loop was doing at its last heartbeat (calls in flight)."""
        return self._shared.activity.value.decode("utf-8", "replace") or "not started yet"

    def _check_progress(self) -> None:
        """Log a long wait for samples; raise when it passed ``timeout_s``."""
        if self._waiting_since is None:
            return
        waited = time.monotonic() - self._waiting_since
        if waited > self.timeout_s:
            raise RolloutWorkerError(
                f"no sample reached the trainer for {waited:.0f} s while it waited "
                f"(rollout_worker_timeout={self.timeout_s:.0f} s). The rollout process is "
                f"alive; it is doing: {self.activity()}. A call that never returns blocks the "
                "run: give it a timeout of its own, or raise rollout_worker_timeout if it is "
                "that slow on purpose"
            )
        every = min(LONG_WAIT_LOG_S, self.timeout_s / 2)
        if waited - self._logged_wait_s >= every:
            self._logged_wait_s = waited
            log.warning("waiting for samples", waited_s=round(waited),
                        fails_after_s=self.timeout_s, rollout=self.activity())  # fmt: skip

    def _child_error(self) -> str | None:
        try:
            return self._shared.errors.get_nowait()
        except queue.Empty:
            return None

    def get(self, wait_s: float) -> GroupOutcome | LoopReport | None:
        """The next message, or ``None`` after ``wait_s`` seconds; checks the child's health
        and, while calls keep finding no samples, how long the trainer has been waiting."""
        if time.monotonic() - self._last_get > WAIT_GAP_S:  # the trainer was busy meanwhile
            self._waiting_since = None
        try:
            message = self._shared.messages.get(timeout=wait_s)
        except queue.Empty:
            if self._waiting_since is None:
                self._waiting_since = time.monotonic() - wait_s
                self._logged_wait_s = 0.0
            self.check_alive()
            self._check_progress()
            message = None
        else:
            if isinstance(message, GroupOutcome) and message.samples:
                self._waiting_since = None
        self._last_get = time.monotonic()
        return message

    def _discard_messages(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self._shared.messages.get_nowait()

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the loop to stop (in-flight requests are cancelled), then join the process."""
        if self._process is None:
            return
        self._shared.stop.set()
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
        for q in (self._shared.messages, self._shared.errors):
            q.cancel_join_thread()
            q.close()
