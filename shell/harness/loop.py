"""``HarnessRolloutLoop``: the rollout loop whose rollouts an OpenEnv harness drives.

Each rollout creates a session for its dataset row (``session_factory.create(task=row, seed,
episode_id)``) and hands it to the harness adapter (``run_white_box``), which runs the
conversation and the session's tools; every model turn the adapter asks for is sampled here,
through :meth:`~asyncgrpo.shell.rollout.loop.AsyncRolloutLoop.generate_one_turn` (the group's
server, seeds, LoRA adapter and evaluation settings, as any rollout's), and recorded as a
:class:`~asyncgrpo.core.records.TurnRecord`. The session's ``verify()`` gives the reward. The
turns pass OpenEnv's training contract (``TrainingTrace``) and then become samples like any
rollout's (reconciliation, staleness, importance masking, the weight push: unchanged)::

    event loop (rollout task)               harness thread (one per rollout)
    generate_one ── to_thread ────────────► create(row) -> session
                                            adapter.run_white_box(model_step, session)
         generate_one_turn ◄── from_thread ── model_step(messages, tools)   (each turn)
         (vLLM request)    ──────────────►     reply -> the harness runs the tools
                                            session.verify(transcript) -> reward
                                            session.close()
    Rollout(turns, reward) ◄──────────────

OpenEnv's harness API is synchronous, so a rollout's harness runs on a worker thread; a harness
that outlives ``harness_timeout_s`` is abandoned (its next model turn raises, its session is
closed) and the rollout is unscored. Faults of a harness are its rollout's
(:mod:`asyncgrpo.core.rollout.harness`): counted in ``harness/*``, never the run's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import attrs
import structlog

from asyncgrpo.adapters.models.chat import render_prompt
from asyncgrpo.adapters.openenv import (
    TrainingContractError,
    check_training_trace,
    harness_api,
    model_reply,
    step_result,
    tool_schemas,
)
from asyncgrpo.core.records import Rollout, TurnRecord
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.rollout import harness as decide
from asyncgrpo.core.rollout.metrics import (
    UNKNOWN_TOOL_CALL,
    tool_call_observations,
    tool_error_feedback,
    unknown_tool_feedback,
)
from asyncgrpo.shell.harness.capture import CapturedRollout, CaptureEndpoint
from asyncgrpo.shell.rollout import AsyncRolloutLoop, PromptRows, context

log = structlog.get_logger("asyncgrpo.rollout")

CLOSE_TIMEOUT_S = 30.0
"""Seconds a session's ``close()`` may take before the rollout goes on without it (logged)."""


@attrs.define
class HarnessRun:
    """One harness rollout, shared by its rollout task (on the event loop) and its harness
    thread: what the thread made (the session, the turns, the completion) and what either side
    tells the other (``stop``, the sampling in flight, an error the rollout raises)."""

    rollout_id: str
    carried: list[Any]  # the rollout task's context (context.carried())
    started: float
    stop: threading.Event = attrs.field(factory=threading.Event)
    turns: list[TurnRecord] = attrs.field(factory=list)
    completion: list[Any] = attrs.field(factory=list)
    session: Any = None
    measured: MeasuredSession | None = None
    captured: CapturedRollout | None = None
    sampling: anyio.CancelScope | None = None  # the turn being sampled now
    run_error: Exception | None = None  # the server's fault or a wrong session: raised
    _closer: str | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def claim_close(self, closer: str) -> bool:
        """Whether ``closer`` closes the session: the first to claim it (the harness thread
        once it is done, or the rollout task once it stops waiting), never both."""
        with self._lock:
            if self._closer is None:
                self._closer = closer
            return self._closer == closer


class HarnessStopped(RuntimeError):
    """Raised into a harness thread whose rollout was abandoned (timed out or cancelled)."""


class MeasuredSession:
    """A session as the harness sees it, with each tool call timed and counted under the
    trainer's tool metrics (``tools/latency_s``, ``tools/{name}/call_count``,
    ``tools/{name}/failure_count``, ``tools/unknown_name_count``). A tool that raises is the
    model's feedback, as in the trainer's own tool loop: the harness gets an error result
    (``ToolResult(error=...)``) instead of the exception."""

    def __init__(self, session: Any, observe: Callable[..., None]) -> None:
        self.session = session
        self._observe = observe
        self._known = sorted(tool.name for tool in session.list_tools())
        self.tool_calls = 0
        self.tool_failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        self.tool_calls += 1
        if name not in self._known:
            self.tool_failures += 1
            self._observe(UNKNOWN_TOOL_CALL)
            text = unknown_tool_feedback(name, self._known)
            return harness_api().ToolResult(data=text, error=text)
        start = time.monotonic()
        failed = 0
        try:
            result = self.session.call_tool(name, arguments)
            failed = int(getattr(result, "error", None) is not None)
        except Exception as error:  # the tool's failure is the model's feedback
            failed = 1
            text = tool_error_feedback(error)
            result = harness_api().ToolResult(data=text, error=text)
        self.tool_failures += failed
        self._observe(*tool_call_observations(name, time.monotonic() - start, failed))
        return result


class HarnessRolloutLoop(AsyncRolloutLoop):
    """The rollout loop of :class:`~asyncgrpo.HarnessAsyncGRPOTrainer` (see the module
    docstring).

    Args (besides the loop's):
        session_factory: OpenEnv ``ResourceSessionFactory``; ``create(task=row, seed=...,
            episode_id=...)`` once per rollout, ``row`` the group's dataset row (``{}``
            without a dataset), ``seed`` the same for every rollout of a group.
        harness_adapter: OpenEnv ``HarnessAdapter`` (``MCPHarnessAdapter``, or your own) whose
            ``run_white_box`` runs the rollout.
        harness_limits: OpenEnv ``HarnessRunLimits``; None: ``max_turns`` from
            ``max_tool_calling_iterations`` (:func:`~asyncgrpo.core.rollout.harness.
            harness_max_turns`). Sampling settings come from the config, so its ``sampling``
            must be empty.
    """

    def __init__(
        self,
        *args: Any,
        session_factory: Any,
        harness_adapter: Any = None,
        harness_limits: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_rows = PromptRows(self.dataset, self.config.prompt_order_seed, True)
        self.session_factory = session_factory
        self.harness_adapter = harness_adapter
        self.harness_limits = harness_limits or harness_api().HarnessRunLimits(
            max_turns=decide.harness_max_turns(self.config.max_tool_calling_iterations)
        )
        self._threads = anyio.CapacityLimiter(max(1, self.config.max_concurrent_rollouts))
        self._running = threading.Condition()  # guards the count of harness threads running
        self._harnesses = 0
        self.capture = CaptureEndpoint(
            self.generate_one_turn,
            self.tokenizer,
            self.tool_loop.decode,
            self.tool_loop.parse_reply,
            self.config.keyword_arguments("chat_template_kwargs"),
            self.config.max_completion_length,
        )

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The loop's clients and servers, and in loop-owning mode (no ``harness_adapter``) the
        capture endpoint its agents call."""
        async with super().opened():
            try:
                if self.harness_adapter is not None:
                    yield
                    return
                async with self.capture.serving():
                    log.info(
                        "the capture endpoint serves the agents",
                        url=self.capture.base_url("EPISODE"),
                    )
                    yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self._harnesses_ended()

    async def _harnesses_ended(self) -> None:
        """Wait (at most ``CLOSE_TIMEOUT_S``) for the harness threads of rollouts the loop
        stopped waiting for: each closes the session it created, which ends what it started."""
        if not await anyio.to_thread.run_sync(self._wait_for_harnesses, CLOSE_TIMEOUT_S):
            log.warning(
                "harness threads still running as the rollout loop ends",
                threads=self._harnesses,
                waited_s=CLOSE_TIMEOUT_S,
            )

    def _wait_for_harnesses(self, timeout_s: float) -> bool:
        with self._running:
            return self._running.wait_for(lambda: self._harnesses == 0, timeout=timeout_s)

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Callable[..., Any]], group_id: int = 0
    ) -> Rollout:
        """One rollout driven by the harness; an unscored rollout without turns when the
        harness faults (counted, logged with the cause)."""
        key = context.ROLLOUT.get()
        position = key.position if key is not None else group_id
        seed = cursor.request_seed(self.config.seed, position, 0, 0)  # one task per group
        run = HarnessRun(
            Rollout(completion=(), completion_ids=(), turns=()).rollout_id,
            context.carried(),
            time.monotonic(),
        )
        outcome = decide.HarnessOutcome(decide.TIMED_OUT, cause="ran past harness_timeout_s")
        try:
            with anyio.move_on_after(self.config.harness_timeout_s):
                outcome = await anyio.to_thread.run_sync(
                    self._drive,
                    dict(context.ROW.get() or {}),
                    seed,
                    run,
                    abandon_on_cancel=True,
                    limiter=self._threads,
                )
        finally:
            run.stop.set()  # an abandoned harness's next model turn raises
            if run.sampling is not None:
                run.sampling.cancel()  # and the turn it waits for now
            self.capture.close(run.rollout_id)  # and its agent's calls are refused or cancelled
            if run.session is not None and run.claim_close("loop"):
                with anyio.CancelScope(shield=True):
                    await self._close(run.session)
        await anyio.lowlevel.checkpoint_if_cancelled()  # the loop stops: nothing to count
        if run.run_error is not None:  # the server's fault or a wrong session, not the harness's
            raise run.run_error
        seconds = time.monotonic() - run.started
        outcome = decide.HarnessOutcome(
            outcome.ending, seconds, outcome.reward, outcome.nonfinite_reward, outcome.cause
        )
        self._observe(*decide.outcome_observations(outcome))
        calls = run.measured.tool_calls if run.measured is not None else 0
        failures = run.measured.tool_failures if run.measured is not None else 0
        if outcome.faulted:
            log.warning(
                "a harness rollout ended unscored",
                ending=outcome.ending,
                cause=outcome.cause[:500],
                rollout=run.rollout_id,
                seconds=round(seconds, 1),
                position=position,
            )
            return Rollout(
                completion=(),
                completion_ids=(),
                turns=(),
                tool_call_count=calls,
                tool_failure_count=failures,
                rollout_id=run.rollout_id,
            )
        return Rollout(
            completion=run.completion,
            completion_ids=[t for turn in run.turns for t in turn.output_ids],
            turns=run.turns,
            tool_call_count=calls,
            tool_failure_count=failures,
            reward=outcome.reward,
            rollout_id=run.rollout_id,
        )

    # --- the harness thread ---------------------------------------------------------------

    def _drive(self, *args: Any) -> decide.HarnessOutcome:
        """:meth:`_run_session` on a harness thread, counted while it runs."""
        with self._running:
            self._harnesses += 1
        try:
            return self._run_session(*args)
        finally:
            with self._running:
                self._harnesses -= 1
                self._running.notify_all()

    def _run_session(
        self, row: dict[str, Any], seed: int, run: HarnessRun
    ) -> decide.HarnessOutcome:
        """Create the session, run the harness, verify, close: how it ended."""
        model_step = self._model_step(run)
        if self.harness_adapter is None:  # its URL serves before the agent starts
            run.captured = self.capture.open(run.rollout_id, run.carried)
        try:
            session = self.session_factory.create(task=row, seed=seed, episode_id=run.rollout_id)
        except Exception as error:
            return decide.HarnessOutcome(
                decide.SESSION_FAILED, cause=f"{type(error).__name__}: {error}"
            )
        run.session = session
        source = f"{type(session).__name__}.verify"
        try:
            if run.stop.is_set():  # abandoned while it was created: close it now
                raise HarnessStopped("abandoned")
            initial = len(session.initial_messages())
            if self.harness_adapter is None:
                transcript, final_state = self._agent_ran(session, run)
            else:
                transcript, final_state = self._adapter_ran(session, model_step, run)
            if run.stop.is_set():
                raise HarnessStopped("abandoned")
            run.completion = transcript[initial:]
            check_training_trace(run.turns, run.rollout_id)
            verified = session.verify(transcript, final_state=final_state)
            reward, nonfinite = decide.verified_reward(verified.env_reward, source)
        except TrainingContractError as error:
            return decide.HarnessOutcome(decide.REFUSED, cause=str(error))
        except HarnessStopped as error:
            return decide.HarnessOutcome(decide.TIMED_OUT, cause=str(error))
        except Exception as error:
            return decide.HarnessOutcome(decide.CRASHED, cause=f"{type(error).__name__}: {error}")
        finally:
            if run.claim_close("harness"):
                self._close_now(session)
        return decide.HarnessOutcome(decide.FINISHED, reward=reward, nonfinite_reward=nonfinite)

    def _adapter_ran(
        self, session: Any, model_step: Any, run: HarnessRun
    ) -> tuple[list[Any], dict[str, Any]]:
        """White-box: the adapter runs the rollout, sampling through ``model_step``; the
        transcript and the final state for ``verify()``."""
        run.measured = MeasuredSession(session, self._observe)
        result = self.harness_adapter.run_white_box(model_step, run.measured, self.harness_limits)
        return list(result.messages), {"done": result.done, "metrics": dict(result.metrics)}

    def _agent_ran(self, session: Any, run: HarnessRun) -> tuple[list[Any], dict[str, Any]]:
        """Loop-owning: the session's agent calls the capture endpoint (the session was
        created after its URL opened) until it exits; its captured turns go into the run's.

        Raises:
            HarnessStopped: the agent outlived ``harness_timeout_s``.
            RuntimeError: the agent exited with a code other than 0.
        """
        assert run.captured is not None
        if not callable(getattr(session, "wait_for_completion", None)):
            run.run_error = TypeError(
                f"{type(session).__name__} has no wait_for_completion(timeout_s): without a "
                "harness_adapter, sessions run their own agent (OpenEnv's LoopOwningSession); "
                "give a harness_adapter such as MCPHarnessAdapter() to sample each turn instead"
            )
            raise HarnessStopped("not a loop-owning session")
        left = self.config.harness_timeout_s - (time.monotonic() - run.started)
        try:
            code = session.wait_for_completion(timeout_s=max(left, 0.0))
        except TimeoutError as error:
            raise HarnessStopped(f"the agent ran past harness_timeout_s: {error}") from error
        finally:
            self.capture.close(run.rollout_id)
            run.turns.extend(run.captured.turns)
        if run.captured.sampling_error is not None:
            run.run_error = run.captured.sampling_error
            raise HarnessStopped("a sampling request failed")
        if code not in (0, None):
            raise RuntimeError(f"the agent exited with code {code} after {len(run.turns)} calls")
        return list(run.captured.transcript), {"exit_code": code, "calls": len(run.turns)}

    def _model_step(self, run: HarnessRun) -> Callable[..., Any]:
        """OpenEnv's ``ModelStep`` for one rollout: render the conversation with the session's
        tools, sample on the event loop, parse the reply's tool calls. A sampling request that
        fails (the server went away, the prompt outgrew the context) is kept in the run for
        the rollout task to raise, as any rollout's would be: it is not the harness's fault."""

        async def sample(prompt_ids: list[int]) -> TurnRecord:
            context.adopt(run.carried)  # the rollout task's server, seeds and settings
            with anyio.CancelScope() as scope:  # cancelled when the rollout is abandoned
                run.sampling = scope
                if run.stop.is_set():
                    scope.cancel()
                try:
                    return await self.generate_one_turn(prompt_ids)
                except Exception as error:
                    run.run_error = error
                    raise
            raise HarnessStopped("the rollout was abandoned while its turn was sampled")

        def model_step(
            messages: Sequence[dict[str, Any]], tools: Sequence[Any], sampling: dict[str, Any]
        ) -> Any:
            if run.stop.is_set():
                raise HarnessStopped(
                    "the rollout was abandoned (harness_timeout_s, or the run stopped)"
                )
            schemas = tool_schemas(tools)
            prompt_ids = render_prompt(
                self.tokenizer,
                messages,
                schemas,
                self.config.keyword_arguments("chat_template_kwargs"),
            )
            turn = anyio.from_thread.run(sample, prompt_ids)
            run.turns.append(turn)
            content, calls = self.tool_loop.parse_reply(
                self.tool_loop.decode(turn.output_ids), schemas
            )
            return step_result(model_reply(content, calls), turn)

        return model_step

    def _close_now(self, session: Any) -> None:
        try:
            session.close()
        except Exception as error:
            log.warning(
                "a harness session's close() raised",
                session=type(session).__name__,
                error=f"{type(error).__name__}: {error}",
            )

    async def _close(self, session: Any) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            await anyio.to_thread.run_sync(self._close_now, session, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning(
                "a harness session's close() did not return",
                seconds=CLOSE_TIMEOUT_S,
                session=type(session).__name__,
            )
