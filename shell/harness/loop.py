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

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import structlog

from asyncgrpo.adapters.models.chat import parse_tool_calls, render_prompt
from asyncgrpo.adapters.openenv import (
    TrainingContractError,
    check_training_trace,
    harness_api,
    model_reply,
    step_result,
    tool_schemas,
)
from asyncgrpo.core.metrics import mean, total
from asyncgrpo.core.records import Rollout, TurnRecord
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.rollout import harness as decide
from asyncgrpo.shell.rollout import AsyncRolloutLoop, PromptRows, context

log = structlog.get_logger("asyncgrpo.rollout")

CLOSE_TIMEOUT_S = 30.0
"""Seconds a session's ``close()`` may take before the rollout goes on without it (logged)."""


def claim_close(holder: dict[str, Any], closer: str) -> bool:
    """Whether ``closer`` closes the rollout's session: the first to claim it (the harness
    thread once it is done, or the rollout task once it stops waiting), never both
    (``dict.setdefault`` is atomic)."""
    return holder.setdefault("closer", closer) == closer


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
        self.tool_calls = 0
        self.tool_failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        known = {tool.name for tool in self.session.list_tools()}
        self.tool_calls += 1
        if name not in known:
            self.tool_failures += 1
            self._observe(total("tools/unknown_name_count", 1))
            text = f"Error: unknown tool {name!r}; available tools: {sorted(known)}"
            return harness_api().ToolResult(data=text, error=text)
        start = time.monotonic()
        failed = 0
        try:
            result = self.session.call_tool(name, arguments)
            failed = int(getattr(result, "error", None) is not None)
        except Exception as error:  # the tool's failure is the model's feedback
            failed = 1
            text = f"Error: {type(error).__name__}: {error}"
            result = harness_api().ToolResult(data=text, error=text)
        latency = time.monotonic() - start
        self.tool_failures += failed
        self._observe(
            mean("tools/latency_s", latency),
            mean(f"tools/{name}/latency_s", latency),
            total(f"tools/{name}/call_count", 1),
            total(f"tools/{name}/failure_count", failed),
        )
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

    def __init__(self, *args: Any, session_factory: Any, harness_adapter: Any,
                 harness_limits: Any = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.prompt_rows = PromptRows(self.dataset, self.config.prompt_order_seed, True)
        self.session_factory = session_factory
        self.harness_adapter = harness_adapter
        self.harness_limits = harness_limits or harness_api().HarnessRunLimits(
            max_turns=decide.harness_max_turns(self.config.max_tool_calling_iterations)
        )
        self._threads = anyio.CapacityLimiter(max(1, self.config.max_concurrent_rollouts))

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Callable[..., Any]],
                           group_id: int = 0) -> Rollout:  # fmt: skip
        """One rollout driven by the harness; an unscored rollout without turns when the
        harness faults (counted, logged with the cause)."""
        key = context.ROLLOUT.get()
        position = key.position if key is not None else group_id
        seed = cursor.request_seed(self.config.seed, position, 0, 0)  # one task per group
        rollout_id = Rollout(completion=(), completion_ids=(), turns=()).rollout_id
        stop = threading.Event()
        turns: list[TurnRecord] = []
        started = time.monotonic()
        holder: dict[str, Any] = {"carried": context.carried()}
        outcome = decide.HarnessOutcome(decide.TIMED_OUT, cause="ran past harness_timeout_s")
        try:
            with anyio.move_on_after(self.config.harness_timeout_s):
                outcome = await anyio.to_thread.run_sync(
                    functools.partial(self._drive, dict(context.ROW.get() or {}), seed, rollout_id,
                                      turns, holder, stop),
                    abandon_on_cancel=True, limiter=self._threads,
                )  # fmt: skip
        finally:
            stop.set()  # an abandoned harness's next model turn raises
            if "session" in holder and claim_close(holder, "loop"):
                with anyio.CancelScope(shield=True):
                    await self._close(holder["session"])
        await anyio.lowlevel.checkpoint_if_cancelled()  # the loop stops: nothing to count
        if "sampling_error" in holder:  # the server's fault, not the harness's: as any rollout's
            raise holder["sampling_error"]
        seconds = time.monotonic() - started
        outcome = decide.HarnessOutcome(outcome.ending, seconds, outcome.reward,
                                        outcome.nonfinite_reward, outcome.cause)  # fmt: skip
        self._observe(*decide.outcome_observations(outcome))
        measured: MeasuredSession | None = holder.get("measured")
        calls = measured.tool_calls if measured is not None else 0
        failures = measured.tool_failures if measured is not None else 0
        if outcome.faulted:
            log.warning("a harness rollout ended unscored", ending=outcome.ending,
                        cause=outcome.cause[:500], rollout=rollout_id, seconds=round(seconds, 1),
                        position=position)  # fmt: skip
            return Rollout(completion=(), completion_ids=(), turns=(), tool_call_count=calls,
                           tool_failure_count=failures, rollout_id=rollout_id)  # fmt: skip
        return Rollout(
            completion=holder.get("completion", ()),
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns, tool_call_count=calls, tool_failure_count=failures,
            reward=outcome.reward, rollout_id=rollout_id,
        )  # fmt: skip

    # --- the harness thread ---------------------------------------------------------------

    def _drive(self, row: dict[str, Any], seed: int, rollout_id: str, turns: list[TurnRecord],
               holder: dict[str, Any], stop: threading.Event) -> decide.HarnessOutcome:  # fmt: skip
        """Create the session, run the harness, verify, close: how it ended. ``holder``
        shares the session and what the rollout keeps with the event loop's side."""
        model_step = self._model_step(turns, stop, holder)
        try:
            session = self.session_factory.create(task=row, seed=seed, episode_id=rollout_id)
        except Exception as error:
            return decide.HarnessOutcome(decide.SESSION_FAILED,
                                         cause=f"{type(error).__name__}: {error}")  # fmt: skip
        holder["session"] = session
        measured = holder["measured"] = MeasuredSession(session, self._observe)
        source = f"{type(session).__name__}.verify"
        try:
            initial = len(session.initial_messages())
            result = self.harness_adapter.run_white_box(model_step, measured,
                                                        self.harness_limits)  # fmt: skip
            if stop.is_set():
                raise HarnessStopped("abandoned")
            holder["completion"] = list(result.messages)[initial:]
            check_training_trace(turns, rollout_id)
            verified = session.verify(list(result.messages), final_state={
                "done": result.done, "metrics": dict(result.metrics)})  # fmt: skip
            reward, nonfinite = decide.verified_reward(verified.env_reward, source)
        except TrainingContractError as error:
            return decide.HarnessOutcome(decide.REFUSED, cause=str(error))
        except HarnessStopped as error:
            return decide.HarnessOutcome(decide.TIMED_OUT, cause=str(error))
        except Exception as error:
            return decide.HarnessOutcome(decide.CRASHED, cause=f"{type(error).__name__}: {error}")
        finally:
            if claim_close(holder, "harness"):
                self._close_now(session)
        return decide.HarnessOutcome(decide.FINISHED, reward=reward, nonfinite_reward=nonfinite)

    def _model_step(self, turns: list[TurnRecord], stop: threading.Event,
                    holder: dict[str, Any]) -> Callable[..., Any]:  # fmt: skip
        """OpenEnv's ``ModelStep`` for one rollout: render the conversation with the session's
        tools, sample on the event loop, parse the reply's tool calls. A sampling request that
        fails (the server went away, the prompt outgrew the context) is kept in ``holder`` for
        the rollout task to raise, as any rollout's would be: it is not the harness's fault."""

        async def sample(prompt_ids: list[int]) -> TurnRecord:
            context.adopt(holder["carried"])  # the rollout task's server, seeds and settings
            try:
                return await self.generate_one_turn(prompt_ids)
            except Exception as error:
                holder["sampling_error"] = error
                raise

        def model_step(messages: Sequence[dict[str, Any]], tools: Sequence[Any],
                       sampling: dict[str, Any]) -> Any:  # fmt: skip
            if stop.is_set():
                raise HarnessStopped("the rollout was abandoned (harness_timeout_s, or the run "
                                     "stopped)")  # fmt: skip
            prompt_ids = render_prompt(self.tokenizer, messages, tool_schemas(tools),
                                       self.config.chat_template_kwargs)  # fmt: skip
            turn = anyio.from_thread.run(sample, prompt_ids)
            turns.append(turn)
            content, calls = parse_tool_calls(self.tool_loop.decode(turn.output_ids))
            return step_result(model_reply(content, calls), turn)

        return model_step

    def _close_now(self, session: Any) -> None:
        try:
            session.close()
        except Exception as error:
            log.warning("a harness session's close() raised", session=type(session).__name__,
                        error=f"{type(error).__name__}: {error}")  # fmt: skip

    async def _close(self, session: Any) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            await anyio.to_thread.run_sync(self._close_now, session, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("a harness session's close() did not return", seconds=CLOSE_TIMEOUT_S,
                        session=type(session).__name__)  # fmt: skip
