"""The rollout process's child side and what crosses the process boundary: the values and
queues the trainer and the child share (:class:`SharedState`: one writer each, nothing a dead
child could leave locked), the wake-up pipe the loop awaits (:class:`Wakeup`), the loop's
channels over them (:class:`ProcessChannels`), and the child's main (:func:`child_main`), which
builds the loop from the :class:`~asyncgrpo.shell.rollout.spec.LoopSpec` the trainer sent and
runs it, its failure's traceback going back to the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import multiprocessing.context
import os
import pickle
import signal
import time
import traceback

import anyio
import attrs
import setproctitle

from asyncgrpo.adapters.parent_death import die_with_forking_parent
from asyncgrpo.core.run.step_queue import InFlight
from asyncgrpo.shell.config import use_log_levels
from asyncgrpo.shell.rollout.messages import EvalOutcome, GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.spec import LoopSpec, RolloutWorkerError
from asyncgrpo.shell.servers import (
    EvalRequest,
    RolloutGate,
    SharedServers,
    SharedTrust,
    VersionPin,
)

PRELOADED = (
    "__main__",
    "asyncgrpo.shell.rollout.child",
    "asyncgrpo.shell.rollout.loop",
    "transformers.models.auto.tokenization_auto",
    "datasets",
)
"""What the fork server imports once, at the first rollout process a Python process starts
(about 5 s here, mostly transformers and torch): each rollout process after it, a restart or
the next ``train()`` in the same process, is forked ready in well under a second. Python 3.11's
fork server skips ``__main__`` here (it looks for a ``main_path`` that
``spawn.get_preparation_data`` never sets), so each rollout process imports the main script
itself, as spawn does, without its ``if __name__ == "__main__":`` block: a script that builds
the trainer at its top level is refused there (``asyncgrpo.shell.run.trainer``)."""


@functools.cache
def _preload_fork_server() -> None:
    """Give the fork server its :data:`PRELOADED` modules, once, before it starts.

    The list is process-wide: Python 3.11 has one fork server per process, shared by every
    ``multiprocessing`` forkserver context (a context of one's own would need a copy of
    ``popen_forkserver.Popen._launch``, a private function that changes between Python
    versions). So it is set here, when the first rollout process starts, not when asyncgrpo is
    imported: a program that imports asyncgrpo and starts no run keeps its own list. A fork
    server already running (started by the program) keeps the modules it was started with."""
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOADED))


class RolloutProcessStart(multiprocessing.context.ForkServerProcess):
    """A process forked by the fork server that preloads :data:`PRELOADED` first."""

    def start(self) -> None:
        _preload_fork_server()
        super().start()


class RolloutContext(multiprocessing.context.ForkServerContext):
    """The forkserver context whose processes preload :data:`PRELOADED` (see
    :func:`_preload_fork_server`)."""

    Process = RolloutProcessStart


CONTEXT = RolloutContext()
PROCESS_TITLE = "asyncgrpo: rollout process"
"""The rollout process's command line as ``ps`` and ``top`` show it (forked by the fork server,
it would show the fork server's)."""
ACTIVITY_BYTES = 2048

IN_FLIGHT_COUNT_BITS = 20  # groups in flight, and groups at the oldest version: each < 2**20


def in_flight_word(in_flight: InFlight) -> int:
    """``in_flight`` as one machine word, written and read whole (no torn read of the count
    and the version): the groups, the groups at the oldest version, and that version plus
    one (0: none) from bit ``2 x IN_FLIGHT_COUNT_BITS``."""
    oldest = 0 if in_flight.oldest_version is None else in_flight.oldest_version + 1
    bits = IN_FLIGHT_COUNT_BITS
    return in_flight.groups | in_flight.at_oldest << bits | oldest << 2 * bits


def in_flight_of_word(word: int) -> InFlight:
    """The :class:`~asyncgrpo.core.run.step_queue.InFlight` :func:`in_flight_word` wrote.

    Example:
        >>> in_flight_of_word(in_flight_word(InFlight(7, 12, 3)))
        InFlight(groups=7, oldest_version=12, at_oldest=3)
    """
    bits = IN_FLIGHT_COUNT_BITS
    mask = (1 << bits) - 1
    oldest = word >> 2 * bits
    return InFlight(word & mask, None if oldest == 0 else oldest - 1, word >> bits & mask)


class Wakeup:
    """A pipe the trainer writes a byte to whenever it changes what the rollout loop reads, and
    the loop awaits instead of polling (it crosses the spawn: the pipe's ends are
    ``multiprocessing`` connections). Writes never block: a full pipe already wakes the loop."""

    def __init__(self) -> None:
        self._reader, self._writer = CONTEXT.Pipe(duplex=False)

    def notify(self) -> None:
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.set_blocking(self._writer.fileno(), False)
            os.write(self._writer.fileno(), b"\0")

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    async def wait(self) -> None:
        """Return once a byte was written since the last wait (in the rollout process)."""
        fd = self._reader.fileno()
        os.set_blocking(fd, False)
        await anyio.wait_readable(fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 4096):
                pass


class SharedState:
    """The shared values between trainer and child.

    A child may die at any instruction (``SIGKILL``, an out-of-memory kill), so nothing here
    holds a lock the trainer could wait on forever: each value has one writer (the trainer:
    version, step size, steps and tokens taken, stop; the child: groups in flight, heartbeat,
    activity) and is an aligned machine word read and written whole (the activity text may be
    read half written: it is only shown). The queues are written by the child only; once it
    has started, the trainer closes its own copy of their write ends (:meth:`child_started`),
    so a child that dies mid-message ends the trainer's read with ``EOFError`` instead of
    leaving it waiting for the rest.
    """

    def __init__(
        self,
        trust: SharedTrust | None,
        servers: SharedServers | None = None,
        pin: VersionPin | None = None,
    ) -> None:
        self.messages: mp.Queue = CONTEXT.Queue()
        self.errors: mp.Queue = CONTEXT.Queue()
        self.version = CONTEXT.Value("q", 0, lock=False)
        self.step_tokens = CONTEXT.Value("d", -1.0, lock=False)
        self.taken = CONTEXT.Value("q", 0, lock=False)
        self.steps_taken = CONTEXT.Value("q", 0, lock=False)
        self.in_flight = CONTEXT.Value("q", 0, lock=False)
        self.heartbeat = CONTEXT.Value("d", time.time(), lock=False)
        self.activity = CONTEXT.Array("c", ACTIVITY_BYTES, lock=False)
        self.stop = CONTEXT.Value("b", 0, lock=False)
        self.servers = servers or SharedServers(first=trust or SharedTrust())
        self.trust = self.servers.trusts[0]
        self.pin = pin or VersionPin()
        self.wakeup = Wakeup()

    def child_started(self) -> None:
        """The trainer's side, once the child holds its copies: close the queues' write ends
        (the trainer only reads them)."""
        for q in (self.messages, self.errors):
            # mp.Queue keeps no public handle on it (a private attribute typeshed does not declare)
            q._writer.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        for q in (self.messages, self.errors):
            q.cancel_join_thread()
            q.close()
        self.wakeup.close()


@attrs.frozen
class ProcessChannels:
    """The loop's :class:`~asyncgrpo.shell.rollout.messages.Channels` across the process
    boundary."""

    shared: SharedState

    def publish(self, message: GroupOutcome | LoopReport | EvalOutcome) -> None:
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

    def report_in_flight(self, in_flight: InFlight) -> None:
        self.shared.in_flight.value = in_flight_word(in_flight)

    def beat(self, activity: str = "") -> None:
        self.shared.heartbeat.value = time.time()
        encoded = activity.encode("utf-8", "replace")[: ACTIVITY_BYTES - 1]
        self.shared.activity.value = encoded

    def stop_requested(self) -> bool:
        return bool(self.shared.stop.value)

    def eval_request(self) -> EvalRequest | None:
        return self.shared.pin.request()

    def eval_finished(self, request_id: int) -> None:
        self.shared.pin.finish(request_id)

    async def wait_for_trainer(self) -> None:
        await self.shared.wakeup.wait()


def load_spec(pickled: bytes) -> LoopSpec:
    """Unpickle the loop spec, naming the usual cause when user code cannot be found here."""
    try:
        return pickle.loads(pickled)
    except (AttributeError, ImportError) as error:
        raise RolloutWorkerError(
            f"the rollout process could not load what the trainer sent it: "
            f"{type(error).__name__}: {error}. The rollout process is another Python "
            "process: it imports the modules your reward functions, tools, environment "
            "factories and rollout loop class live in, and the script that started training "
            'without its `if __name__ == "__main__":` block. Define them at module level '
            "(above that block, or in an importable module), not inside it, in a notebook "
            "cell or in the interactive interpreter"
        ) from error


def adopt_environment(environment: dict[str, str]) -> None:
    """Take the trainer's ``environment`` as it was when it started this process. A spawned
    child would inherit it; a forked one has the fork server's, from the first rollout process
    of the trainer's Python process (``multiprocessing`` passes ``sys.path`` and the working
    directory, not the environment), and a reward function may read it. Settings a library
    reads once at import (``HF_HUB_OFFLINE`` of huggingface_hub, say) stay those of the fork
    server's start."""
    os.environ.clear()
    os.environ.update(environment)


def child_main(
    pickled_spec: bytes, shared: SharedState, parent_pid: int, environment: dict[str, str]
) -> None:
    # Ctrl-C reaches the whole process group: the trainer stops this process itself. A trainer
    # killed outright takes this process with it (its fork server exits with the trainer).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_forking_parent(signal.SIGKILL, parent_pid)
    setproctitle.setproctitle(PROCESS_TITLE)
    adopt_environment(environment)
    try:
        spec = load_spec(pickled_spec)
        use_log_levels(spec.config, main_process=False)  # log_level_replica
        loop = spec.loop_cls(
            spec.config,
            spec.model_name,
            spec.dataset,
            list(spec.reward_funcs),
            spec.processing_class,
            ProcessChannels(shared),
            max_model_len=spec.max_model_len,
            token_budget=spec.token_budget,
            rows_per_step=spec.rows_per_step,
            tools=list(spec.tools),
            environment_factory=spec.environment_factory,
            lora_name=spec.lora_name,
            start_cursor=spec.start_cursor,
            eval_datasets=spec.eval_datasets,
            eval_reward_funcs=spec.eval_reward_funcs,
            server_gate=RolloutGate(shared.trust, spec.config.vllm_server_timeout),
            **({"servers": shared.servers} if len(shared.servers) > 1 else {}),
            **spec.loop_options,
        )
        anyio.run(loop.run)
    except BaseException as error:
        shared.errors.put(f"{type(error).__name__}: {error}\n\n{traceback.format_exc()}")
        raise
