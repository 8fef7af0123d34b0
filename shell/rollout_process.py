"""The rollout process: a spawned child running one ``AsyncRolloutLoop`` on one event loop.

The trainer side (:class:`RolloutProcess`) starts it with CUDA hidden, feeds it the policy
version and the tokens each step consumed, takes its messages, and watches it: a crash comes
back with the child's traceback, a missing heartbeat for ``rollout_worker_timeout`` seconds
raises, and :meth:`RolloutProcess.stop` cancels the in-flight requests and joins it.

Everything sent into the child is pickled; :func:`check_picklable` fails early, at
``train()``, with a ``TypeError`` that names the reward function, tool or factory that cannot
be sent (a lambda or a closure).
"""

from __future__ import annotations

import contextlib
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

from asyncgrpo.adapters.parent_death import die_with_parent
from asyncgrpo.core.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout_loop import AsyncRolloutLoop, GroupOutcome, LoopReport, callable_name

_CONTEXT = mp.get_context("spawn")


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


class _Shared:
    """The shared values between trainer and child."""

    def __init__(self) -> None:
        self.messages: mp.Queue = _CONTEXT.Queue()
        self.errors: mp.Queue = _CONTEXT.Queue()
        self.version = _CONTEXT.Value("q", 0)
        self.step_tokens = _CONTEXT.Value("d", -1.0)
        self.taken = _CONTEXT.Value("q", 0)
        self.in_flight = _CONTEXT.Value("q", 0)
        self.heartbeat = _CONTEXT.Value("d", time.time())
        self.stop = _CONTEXT.Event()


@attrs.frozen
class _ProcessChannels:
    """The loop's :class:`~asyncgrpo.shell.rollout_loop.Channels` across the process boundary."""

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

    def report_in_flight(self, groups: int) -> None:
        self.shared.in_flight.value = groups

    def beat(self) -> None:
        self.shared.heartbeat.value = time.time()

    def stop_requested(self) -> bool:
        return self.shared.stop.is_set()


def _child_main(spec: LoopSpec, shared: _Shared, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the trainer stops this process itself. A trainer
    # killed outright takes this process with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, parent_pid)
    try:
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
    """

    def __init__(self, spec: LoopSpec, timeout_s: float = 300.0) -> None:
        spec.check()
        self.spec = spec
        self.timeout_s = timeout_s
        self._shared = _Shared()
        self._process: Any = None

    def start(self) -> RolloutProcess:
        with _cuda_hidden():
            self._process = _CONTEXT.Process(
                target=_child_main, args=(self.spec, self._shared, os.getpid()),
                name="asyncgrpo-rollout",
                daemon=True,
            )  # fmt: skip
            self._process.start()
        self._shared.heartbeat.value = time.time()
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def set_model_version(self, version: int) -> None:
        self._shared.version.value = version

    def step_consumed(self, tokens: float) -> None:
        """Report the step size the staleness allowance is measured in: the unpacked tokens a
        full step holds (:attr:`asyncgrpo.core.step_queue.StepQueue.tokens_per_step`)."""
        self._shared.step_tokens.value = float(tokens)

    def samples_taken(self, tokens: int) -> None:
        """Report tokens of samples the trainer is done with (trained, or dropped as stale or
        oversize); until then they count against the staleness allowance."""
        with self._shared.taken.get_lock():
            self._shared.taken.value += tokens

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
                f"(rollout_worker_timeout={self.timeout_s:.0f} s); it is hung"
            )

    def _child_error(self) -> str | None:
        try:
            return self._shared.errors.get_nowait()
        except queue.Empty:
            return None

    def get(self, wait_s: float) -> GroupOutcome | LoopReport | None:
        """The next message, or ``None`` after ``wait_s`` seconds; checks the child's health."""
        try:
            return self._shared.messages.get(timeout=wait_s)
        except queue.Empty:
            self.check_alive()
            return None

    def _discard_messages(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self._shared.messages.get_nowait()

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the loop to stop (in-flight requests are cancelled), then join the process."""
        if self._process is None:
            return
        self._shared.stop.set()
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
