"""``AsyncRolloutLoop``: generates and scores rollouts, one anyio event loop.

It runs inside the rollout process (:mod:`asyncgrpo.shell.rollout_process`) and talks to the
trainer only through :class:`Channels`. For every prompt position (:mod:`asyncgrpo.core.cursor`)
it asks ``filter_prompt``, waits for the staleness allowance (:mod:`asyncgrpo.core.pacing`),
runs ``num_generations`` rollouts (each holding one slot under the vLLM load cap), and hands the
finished group to the scoring task, which sums the rewards, calls ``compute_advantages``, drops
zero-signal groups, reconciles turns into samples and publishes them.

Subclass it and override a hook to change one step (the table in TRL's AsyncGRPOTrainer
documentation):

==============================  =======================================================
``filter_prompt(row_index, row, epoch)``  once per prompt, before generation
``generate_one(prompt, tools, group_id)``  once per rollout (default: the tool loop)
``generate_one_turn(prompt_ids)``          once per sampling request (one vLLM call)
``compute_advantages(group)``              once per group, after rewards are summed
``setup()``, ``close()``                   when the loop starts and stops
==============================  =======================================================
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import anyio
import attrs
import numpy as np
import structlog

from asyncgrpo.adapters.chat import (
    ToolCall,
    assistant_message,
    environment_tools,
    parse_tool_calls,
    render_prompt,
    tool_schema,
)
from asyncgrpo.adapters.vllm_client import (
    PromptTooLongError,
    SamplingParams,
    ServerGate,
    VLLMClient,
)
from asyncgrpo.adapters.weight_transfer import adapter_name
from asyncgrpo.core import cursor, pacing
from asyncgrpo.core.activity import Activity, describe_activities
from asyncgrpo.core.advantages import score_group, standardize_rewards, sum_rewards
from asyncgrpo.core.metrics import Observation, ratio, value
from asyncgrpo.core.reconcile import reconcile_turns
from asyncgrpo.core.records import Rollout, RolloutGroup, TrainingSample, TurnRecord
from asyncgrpo.core.rollout_metrics import GroupFacts, group_observations
from asyncgrpo.core.scoring import check_reward_values, group_samples
from asyncgrpo.shell.config import AsyncGRPOConfig

log = structlog.get_logger("asyncgrpo.rollout")

METRICS_POLL_S = 5.0
_GROUP_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("group_version", default=0)
_ROLLOUT: contextvars.ContextVar[_RolloutKey | None] = contextvars.ContextVar(
    "rollout", default=None
)
# (group_id, row_index) of the group a rollout task works for, for the activity report
_GROUP: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("group", default=(-1, -1))
HEARTBEAT_S = 1.0
TOO_LONG_IN_A_ROW = 32  # this many prompts in a row rejected as too long (or an epoch): raise


@attrs.frozen
class GroupOutcome:
    """A group's result for the trainer: its samples (none if filtered or dropped) and, with
    ``log_completions``, its ``(prompt, completion, reward)`` texts."""

    position: int
    row_index: int
    samples: tuple[TrainingSample, ...]
    observations: tuple[Observation, ...]
    completions: tuple[tuple[str, str, float], ...] = ()

    @property
    def forwarded_tokens(self) -> int:
        return sum(len(s.sequence) for s in self.samples)


@attrs.frozen
class LoopReport:
    """Loop-level observations (load, throughput, tools), sent every few seconds."""

    observations: tuple[Observation, ...]


class Channels(Protocol):
    """How the loop talks to the trainer (a process boundary in production)."""

    def publish(self, message: GroupOutcome | LoopReport) -> None: ...

    def model_version(self) -> int: ...

    def tokens_per_step(self) -> float | None: ...

    def tokens_taken(self) -> int: ...

    def report_in_flight(self, groups: int) -> None: ...

    def beat(self, activity: str = "") -> None:
        """Alive; ``activity`` says what the loop is doing (the calls in flight)."""

    def stop_requested(self) -> bool: ...


def callable_name(fn: Callable[..., Any]) -> str:
    """A readable name for a reward function, tool or factory (partials and instances too)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def check_conversational(prompt: Any, row_index: int) -> None:
    """Raise a ``ValueError`` unless ``prompt`` is a list of ``{'role', 'content'}`` messages.

    Example:
        >>> check_conversational("What is 2 + 2?", 0)
        Traceback (most recent call last):
        ...
        ValueError: dataset row 0: 'prompt' must be conversational, a list of {'role': ..., \
'content': ...} messages, got str: 'What is 2 + 2?'
    """
    if isinstance(prompt, (str, bytes, Mapping)) or not all(
        isinstance(m, Mapping) and "role" in m for m in prompt
    ):
        raise ValueError(
            f"dataset row {row_index}: 'prompt' must be conversational, a list of "
            f"{{'role': ..., 'content': ...}} messages, got {type(prompt).__name__}: "
            f"{str(prompt)[:200]!r}"
        )


def _leaves(group: BaseExceptionGroup) -> list[Any]:
    """The exceptions of ``group``, nested groups flattened."""
    found: list[Any] = []
    for error in group.exceptions:
        found += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (callable instances with async __call__)
    )


def _root_cause(group: BaseExceptionGroup) -> BaseException:
    """The first real error inside nested task-group errors (cancellations skipped)."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _root_cause(error)
        if not isinstance(error, anyio.get_cancelled_exc_class()):
            return error
    return group


@attrs.define
class _RolloutKey:
    """Which rollout a task generates (its prompt position and index in the group) and how many
    requests it has sent, for :func:`asyncgrpo.core.cursor.request_seed`."""

    position: int
    index: int
    turns: int = 0


@attrs.define
class _PendingGroup:
    position: int
    row_index: int
    row: Mapping[str, Any]
    prompt: list[dict[str, Any]]
    group_id: int
    model_version: int
    rollouts: list[Rollout]
    env_rewards: list[tuple[type, float] | None]
    completed_at: float = 0.0


class AsyncRolloutLoop:
    """Generates and scores rollouts for :class:`asyncgrpo.AsyncGRPOTrainer`.

    Hooks may read ``self.config`` (an :class:`AsyncGRPOConfig`, or a subclass with its own
    fields) and ``self.tokenizer``. Subclasses must be importable (defined at module level):
    the loop is built inside a spawned process.
    """

    def __init__(
        self,
        config: AsyncGRPOConfig,
        model_name: str,
        dataset: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        processing_class: Any,
        channels: Channels,
        *,
        max_model_len: int,
        token_budget: int,
        rows_per_step: int = 1,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], object]
        | Mapping[str, Callable[[], object]]
        | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        start_cursor: cursor.PromptCursor | None = None,
        server_gate: ServerGate | None = None,
    ) -> None:
        self.config = config
        self.server_gate = server_gate
        self.model_name = model_name
        self.lora_prefix = lora_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tokenizer = processing_class
        self.channels = channels
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.rows_per_step = rows_per_step
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.start_cursor = start_cursor or cursor.PromptCursor()
        self.eos_token_ids = self._eos_ids(processing_class)
        self.sampling = SamplingParams(
            max_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p or 0.0,
            repetition_penalty=config.repetition_penalty,
            num_sampler_logprobs=config.num_sampler_logprobs if config.score_centering else 0,
        )
        self.client: VLLMClient | None = None
        self._ledger = pacing.GenerationLedger()
        self._taken_seen = 0
        self._load_cap = pacing.LoadCap(cap=config.max_concurrent_rollouts)
        self._in_flight = 0
        self._reserved = 0
        self._slots = anyio.Condition()
        self._tool_limiter = anyio.CapacityLimiter(config.max_concurrent_rollouts)
        self._env_pool: dict[str, list[object]] = defaultdict(list)
        self._pending_obs: list[Observation] = []
        self._generated_tokens = 0
        self._completed_rollouts = 0
        self._next_group_id = 0
        self._unkeyed_requests = 0
        self._activities: dict[int, Activity] = {}
        self._too_long_in_a_row = 0
        self._activity_ids = itertools.count()

    @staticmethod
    def _eos_ids(tokenizer: Any) -> frozenset[int]:
        ids = {tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)}
        return frozenset(int(i) for i in ids if i is not None)

    # ------------------------------------------------ hooks (TRL's AsyncGRPOTrainer API)

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; rejected prompts count as consumed."""
        return True

    async def setup(self) -> None:
        """Create resources other hooks need (runs on the loop's event loop)."""

    async def close(self) -> None:
        """Release what :meth:`setup` created (runs on exit, failures included)."""

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group, NaN -> 0."""
        return standardize_rewards(np.asarray(group.rewards, dtype=np.float64))

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """Sample one reply with the config's sampling settings (one vLLM request).

        The request's seed is :func:`~asyncgrpo.core.cursor.request_seed` of the prompt's
        position, the rollout's index and the turn, so a resumed run samples the same way."""
        if self.client is None:
            raise RuntimeError("generate_one_turn called before the loop started")
        seed = self._next_seed()
        adapter = adapter_name(self.lora_prefix, _GROUP_VERSION.get()) if self.lora_prefix else None
        gen = await self.client.generate(prompt_ids, self.sampling, seed, model=adapter)
        self._generated_tokens += len(gen.output_ids)
        return TurnRecord(
            prompt_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_log_probs=gen.output_log_probs,
            output_sampler_logprobs=gen.top_logprobs,
        )

    def _next_seed(self) -> int:
        key = _ROLLOUT.get()
        if key is None:  # a request outside a rollout task (a hook called directly)
            self._unkeyed_requests += 1
            return cursor.request_seed(self.config.seed, -1, 0, self._unkeyed_requests)
        key.turns += 1
        return cursor.request_seed(self.config.seed, key.position, key.index, key.turns - 1)

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Callable[..., Any]], group_id: int = 0
    ) -> Rollout:
        """One rollout: the multi-turn tool loop over the chat template.

        Each turn renders the whole conversation, samples a reply, and runs the reply's tool
        calls in the model's order; it stops at a reply without tool calls or after
        ``max_tool_calling_iterations`` tool rounds.
        """
        by_name = {callable_name(t): t for t in tools}
        schemas = [tool_schema(t) for t in tools] or None
        messages = [dict(m) for m in prompt]
        completion: list[dict[str, Any]] = []
        turns: list[TurnRecord] = []
        calls_made = failures = rounds = 0
        limit = self.config.max_tool_calling_iterations
        while True:
            prompt_ids = render_prompt(self.tokenizer, messages, schemas,
                                       self.config.chat_template_kwargs)  # fmt: skip
            with self._doing("generation"):
                turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            text = self._decode(turn.output_ids)
            content, calls = parse_tool_calls(text) if tools else (text, ())
            reply = assistant_message(content, calls)
            messages.append(reply)
            completion.append(reply)
            if not calls or (limit is not None and rounds >= limit):
                break
            rounds += 1
            self._pending_obs.append(value("tools/parallel_calls_mean", len(calls)))
            for call in calls:
                with self._doing(f"tool {call.name!r}"):
                    answer, failed = await self._call_tool(call, by_name)
                calls_made += 1
                failures += failed
                message = {"role": "tool", "name": call.name, "content": answer}
                messages.append(message)
                completion.append(message)
        return Rollout(
            completion=completion,
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
            tool_call_count=calls_made,
            tool_failure_count=failures,
        )

    # ----------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Run until the trainer asks to stop (or a fault raises)."""
        self.client = VLLMClient(
            self.config.vllm_server_base_url,
            self.model_name,
            timeout_s=self.config.vllm_server_timeout,
            max_connections=self.config.max_concurrent_rollouts,
            gate=self.server_gate,
        )
        try:
            await self._start_load_cap()
            self._warn_if_candidate_sets_are_missing()
            await self.setup()
            send, receive = anyio.create_memory_object_stream[_PendingGroup](
                self.score_queue_maxsize
            )
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._heartbeat_forever)
                    tg.start_soon(self._poll_server_forever)
                    tg.start_soon(self._score_forever, receive)
                    await self._dispatch(tg, send)
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                raise _root_cause(group) from None
            finally:
                send.close()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()
                await self.client.aclose()

    async def _dispatch(self, tg: anyio.abc.TaskGroup, send: Any) -> None:
        size = self._dataset_size()
        rejected_in_a_row = 0
        for position in cursor.positions_from(self.start_cursor):
            if self.channels.stop_requested():
                return
            epoch, row_index = self._row_at(position, size)
            row = self._row(row_index)
            if not self.filter_prompt(row_index, row, epoch):
                rejected_in_a_row += 1
                if size is not None and rejected_in_a_row >= size:
                    raise RuntimeError(
                        f"filter_prompt rejected all {size} prompts of an epoch; no batch can "
                        "reach the trainer"
                    )
                self.channels.publish(GroupOutcome(position, row_index, (), ()))
                continue
            rejected_in_a_row = 0
            if not await self._wait_for_allowance():
                return
            self._ledger = pacing.group_started(self._ledger)
            self.channels.report_in_flight(self._ledger.groups_in_flight)
            self._reserved += self.config.num_generations
            group_id = self._next_group_id
            self._next_group_id += 1
            tg.start_soon(self._run_group, send, position, row_index, row, group_id)

    async def _wait_for_allowance(self) -> bool:
        """Wait until a rollout slot is free and the staleness allowance admits a group."""
        waited_from: float | None = None
        await anyio.lowlevel.checkpoint()
        while True:
            if self.channels.stop_requested():
                return False
            if not self._admits(self._reserved):
                await anyio.sleep(0.02)
                continue
            taken = self.channels.tokens_taken()
            self._ledger = pacing.samples_taken(self._ledger, taken - self._taken_seen)
            self._taken_seen = taken
            allowance = pacing.token_allowance(
                self.channels.tokens_per_step(), self.config.max_staleness,
                self.token_budget, self.rows_per_step,
            )  # fmt: skip
            if pacing.may_start_group(self._ledger, allowance):
                break
            waited_from = waited_from or time.monotonic()
            await anyio.sleep(0.02)
        if waited_from is not None and self._ledger.groups_completed:
            self._pending_obs.append(
                value("rollout/backpressure_s", time.monotonic() - waited_from)
            )
        return True

    async def _run_group(
        self, send: Any, position: int, row_index: int, row: dict[str, Any], group_id: int
    ) -> None:
        pending = _PendingGroup(
            position=position,
            row_index=row_index,
            row=row,
            prompt=self._prompt_of(row, row_index),
            group_id=group_id,
            model_version=self.channels.model_version(),
            rollouts=[],
            env_rewards=[],
        )
        _GROUP_VERSION.set(pending.model_version)  # its rollouts finish under this policy
        _GROUP.set((group_id, row_index))
        results: list[tuple[Rollout, tuple[type, float] | None] | None] = [None] * (
            self.config.num_generations
        )

        async def one(index: int) -> None:
            _ROLLOUT.set(_RolloutKey(position, index))  # this task's copy of the context
            results[index] = await self._one_rollout(pending)

        too_long: list[PromptTooLongError] = []
        try:
            async with anyio.create_task_group() as tg:
                for index in range(self.config.num_generations):
                    tg.start_soon(one, index)
        except* PromptTooLongError as errors:
            too_long += _leaves(errors)
        finally:
            self._reserved -= self.config.num_generations
        if too_long:
            self._skip_too_long(pending, too_long[0])
            return
        self._too_long_in_a_row = 0
        pending.rollouts = [r[0] for r in results if r is not None]
        pending.env_rewards = [r[1] for r in results if r is not None]
        pending.completed_at = time.monotonic()
        await send.send(pending)
        self._pending_obs.append(
            value("rollout/score_block_s", time.monotonic() - pending.completed_at)
        )

    def _skip_too_long(self, pending: _PendingGroup, error: PromptTooLongError) -> None:
        """A prompt the server rejects as too long: skip its group (consumed, as a filtered
        prompt), count it (``rollout/prompt_too_long_count``) and log its row; raise when
        every prompt of an epoch, or ``TOO_LONG_IN_A_ROW`` in a row, were rejected."""
        self._too_long_in_a_row += 1
        limit = min(self._dataset_size() or TOO_LONG_IN_A_ROW, TOO_LONG_IN_A_ROW)
        if self._too_long_in_a_row >= limit:
            raise PromptTooLongError(
                f"the last {self._too_long_in_a_row} prompts were all rejected as too long; "
                f"no batch can reach the trainer. {error}"
            ) from error
        log.warning("skipped a prompt the server rejected as too long", row=pending.row_index,
                    position=pending.position, error=str(error)[:400])  # fmt: skip
        self._ledger = pacing.group_finished(self._ledger, 0)
        counted = (value("rollout/prompt_too_long_count", 1),)
        self.channels.publish(GroupOutcome(pending.position, pending.row_index, (), counted))
        # after the publish: the trainer waits for a group counted here to arrive
        self.channels.report_in_flight(self._ledger.groups_in_flight)

    def _admits(self, in_flight: int) -> bool:
        """Whether one more rollout fits under the load cap and max_concurrent_rollouts."""
        limit = self.config.max_concurrent_rollouts
        return pacing.rollouts_to_admit(in_flight, self._load_cap, limit) > 0

    async def _one_rollout(
        self, pending: _PendingGroup
    ) -> tuple[Rollout, tuple[type, float] | None]:
        async with self._slots:
            while not self._admits(self._in_flight):
                await self._slots.wait()
            self._in_flight += 1
        start = time.monotonic()
        try:
            prompt, tools, environment = await self._prepare(pending)
            rollout = await self.generate_one(prompt, tools, pending.group_id)
            env_reward = await self._environment_reward(environment)
            if environment is not None:
                self._env_pool[self._env_name(pending.row)].append(environment)
        finally:
            async with self._slots:
                self._in_flight -= 1
                self._completed_rollouts += 1
                self._slots.notify_all()
        self._pending_obs.append(value("rollout/duration_s", time.monotonic() - start))
        return rollout, env_reward

    async def _prepare(
        self, pending: _PendingGroup
    ) -> tuple[list[dict[str, Any]], list[Callable[..., Any]], object | None]:
        prompt = [dict(m) for m in pending.prompt]
        tools = list(self.tools)
        if self.environment_factory is None:
            return prompt, tools, None
        name = self._env_name(pending.row)
        pool = self._env_pool[name]
        if pool:
            environment = pool.pop()
        else:
            with self._doing(f"environment factory {name!r}"):
                environment = await anyio.to_thread.run_sync(
                    self._factory(name), limiter=self._tool_limiter
                )
        kwargs = {k: v for k, v in pending.row.items() if k not in ("prompt", "environment")}
        start = time.monotonic()
        with self._doing(f"{type(environment).__name__}.reset"):
            text = await anyio.to_thread.run_sync(
                functools.partial(environment.reset, **kwargs), limiter=self._tool_limiter
            )
        self._pending_obs.append(value("env/reset_s", time.monotonic() - start))
        if isinstance(text, str):
            if prompt and prompt[-1].get("role") == "user":
                prompt[-1]["content"] = f"{prompt[-1].get('content') or ''}{text}"
            else:
                prompt.append({"role": "user", "content": text})
        elif text is not None:
            raise TypeError(
                f"{type(environment).__name__}.reset must return a str or None, "
                f"got {type(text).__name__}"
            )
        if not prompt:
            raise ValueError(
                f"row {pending.row_index} has no 'prompt' and {type(environment).__name__}.reset "
                "returned None; return the prompt from reset() or add a prompt column"
            )
        tools += list(environment_tools(environment).values())
        return prompt, tools, environment

    async def _environment_reward(self, environment: object | None) -> tuple[type, float] | None:
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is None:
            return None
        start = time.monotonic()
        with self._doing(f"{type(environment).__name__}.get_reward"):
            if _is_async(get_reward):
                reward = await get_reward()
            else:
                reward = await anyio.to_thread.run_sync(get_reward, limiter=self._tool_limiter)
        self._pending_obs.append(value("env/reward_s", time.monotonic() - start))
        if reward is None:
            return None
        return type(environment), float(reward)

    async def _call_tool(
        self, call: ToolCall, tools: Mapping[str, Callable[..., Any]]
    ) -> tuple[str, int]:
        if call.error is not None:
            return f"Error: {call.error}", 1
        tool = tools.get(call.name)
        if tool is None:
            self._pending_obs.append(value("tools/unknown_name_count", 1))
            return f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}", 1
        start = time.monotonic()
        failed = 0
        try:
            if _is_async(tool):
                result = await tool(**call.arguments)
            else:
                result = await anyio.to_thread.run_sync(
                    functools.partial(tool, **call.arguments), limiter=self._tool_limiter
                )
            answer = result if isinstance(result, str) else str(result)
        except Exception as error:  # a tool's failure is the model's feedback, not a crash
            failed = 1
            answer = f"Error: {type(error).__name__}: {error}"
        latency = time.monotonic() - start
        self._pending_obs += [
            value("tools/latency_s", latency),
            value(f"tools/{call.name}/latency_s", latency),
            value(f"tools/{call.name}/call_count", 1),
            value(f"tools/{call.name}/failure_count", failed),
        ]
        return answer, failed

    # ----------------------------------------------------------------- scoring

    async def _score_forever(self, receive: Any) -> None:
        async with receive:
            async for pending in receive:
                started = time.monotonic()
                outcome = await self._score(pending)
                done = time.monotonic()
                self._ledger = pacing.group_finished(self._ledger, outcome.forwarded_tokens)
                self.channels.publish(attrs.evolve(outcome, observations=(
                    *outcome.observations,
                    value("rollout/score_wait_s", started - pending.completed_at),
                    value("rollout/score_s", done - started),
                    value("rollout/score_queue_size", receive.statistics().current_buffer_used),
                )))  # fmt: skip
                # after the publish: the trainer waits for a group counted here to arrive
                self.channels.report_in_flight(self._ledger.groups_in_flight)

    @staticmethod
    def _reward_kwargs(pending: _PendingGroup) -> dict[str, list[Any]]:
        """The row's columns but ``prompt``, one value per rollout, as reward keywords."""
        return {k: [v] * len(pending.rollouts) for k, v in pending.row.items() if k != "prompt"}

    async def _reward_columns(self, pending: _PendingGroup) -> dict[str, list[float | None]]:
        g = len(pending.rollouts)
        kwargs = self._reward_kwargs(pending)
        inputs = dict(
            prompts=[pending.prompt] * g,
            completions=[r.completion for r in pending.rollouts],
            completion_ids=[list(r.completion_ids) for r in pending.rollouts],
            **kwargs,
        )
        columns: dict[str, list[float | None]] = {}

        async def call(fn: Callable[..., Any]) -> None:
            name = callable_name(fn)
            try:
                with self._doing(
                    f"reward function {name!r}", (pending.group_id, pending.row_index)
                ):
                    if _is_async(fn):
                        result = await fn(**inputs)
                    else:
                        result = await anyio.to_thread.run_sync(functools.partial(fn, **inputs))
            except Exception as error:
                raise RuntimeError(
                    f"reward function {name!r} raised {type(error).__name__}: {error}"
                ) from error
            columns[name] = check_reward_values(name, result, g)

        async with anyio.create_task_group() as tg:
            for fn in self.reward_funcs:
                tg.start_soon(call, fn)
        env_rewards = pending.env_rewards
        for env_type in {e[0] for e in env_rewards if e is not None}:
            columns[env_type.__name__] = [
                e[1] if e is not None and e[0] is env_type else None for e in env_rewards
            ]
        return {name: columns[name] for name in sorted(columns)}

    async def _score(self, pending: _PendingGroup) -> GroupOutcome:
        g = len(pending.rollouts)
        columns = await self._reward_columns(pending)
        rollout_rewards = [r.reward for r in pending.rollouts]
        rewards = sum_rewards([*columns.values(), rollout_rewards], g)
        reconciled = [reconcile_turns(r.turns) for r in pending.rollouts]
        group = RolloutGroup(
            prompts=[pending.prompt] * g,
            reward_kwargs=self._reward_kwargs(pending),
            completions=[r.completion for r in pending.rollouts],
            completions_ids=[r.completion_ids for r in pending.rollouts],
            completions_sequences=[r.sequences for r in reconciled],
            tool_call_counts=[r.tool_call_count for r in pending.rollouts],
            tool_failure_counts=[r.tool_failure_count for r in pending.rollouts],
            model_version=pending.model_version,
            group_id=pending.group_id,
            row_index=pending.row_index,
            env_rewards=pending.env_rewards,
            rollout_rewards=rollout_rewards,
            queued_at=pending.completed_at,
            rewards=rewards,
        )
        score = score_group(rewards, lambda _: self.compute_advantages(group))
        now = time.monotonic()
        samples = group_samples(
            [r.sequences for r in reconciled], score, [r.rollout_id for r in pending.rollouts],
            model_version=pending.model_version, group_id=pending.group_id,
            row_index=pending.row_index, prompt_position=pending.position, queued_at=now,
        )  # fmt: skip
        facts = GroupFacts(
            rollouts=pending.rollouts,
            reconciled=reconciled,
            score=score,
            reward_columns=columns,
            eos_token_ids=self.eos_token_ids,
            has_tools=bool(self.tools) or self.environment_factory is not None,
            loop_exhausted=[bool(r.completion and r.completion[-1].get("tool_calls"))
                            for r in pending.rollouts],
        )  # fmt: skip
        texts = ()
        if self.config.log_completions:
            prompt = str(pending.prompt[-1].get("content", "")) if pending.prompt else ""
            texts = tuple(
                (prompt, "\n".join(str(m.get("content") or "") for m in r.completion),
                 float(reward))
                for r, reward in zip(pending.rollouts, rewards, strict=True)
            )  # fmt: skip
        return GroupOutcome(pending.position, pending.row_index, samples,
                            tuple(group_observations(facts)), texts)  # fmt: skip

    # ----------------------------------------------------------------- load and liveness

    async def _start_load_cap(self) -> None:
        assert self.client is not None
        snapshot = await self.client.metrics()
        self._load_cap = pacing.initial_load_cap(
            snapshot.kv_cache_tokens if snapshot else None,
            self.max_model_len,
            self.config.max_concurrent_rollouts,
        )

    def _warn_if_candidate_sets_are_missing(self) -> None:
        if self.config.top_k > 0 or self.config.top_p < 1.0:
            warnings.warn(
                "top_k/top_p is set but this server does not return the sampler's candidate "
                "sets (vLLM >= 0.28 with --return-sampling-mask --enable-scale-out on the V2 "
                "model runner); the trainer normalises over the full vocabulary, so importance "
                "ratios are biased",
                stacklevel=2,
            )

    @contextlib.contextmanager
    def _doing(self, what: str, group: tuple[int, int] | None = None) -> Iterator[None]:
        """Record a call in flight for :meth:`describe_activity` (the current task's group
        unless ``group`` is given)."""
        group_id, row_index = group or _GROUP.get()
        key = next(self._activity_ids)
        self._activities[key] = Activity(what, group_id, row_index, time.monotonic())
        try:
            yield
        finally:
            del self._activities[key]

    def describe_activity(self) -> str:
        """One line: rollouts in flight and the longest-running calls (reward functions,
        tools, environment methods, generation requests), with their groups."""
        calls = describe_activities(self._activities.values(), time.monotonic())
        return f"{self._in_flight} rollouts in flight; {calls}"

    async def _heartbeat_forever(self) -> None:
        while True:
            self.channels.beat(self.describe_activity())
            await anyio.sleep(HEARTBEAT_S)

    async def _poll_server_forever(self) -> None:
        assert self.client is not None
        last_time, last_tokens = time.monotonic(), 0
        last_retries = last_preemptions = last_regenerated = 0
        last_completed = 0
        while True:
            await anyio.sleep(METRICS_POLL_S)
            snapshot = await self.client.metrics()
            self._load_cap = pacing.next_load_cap(
                pacing.rollouts_completed(self._load_cap,
                                          self._completed_rollouts - last_completed),
                snapshot.load if snapshot else None,
                self.config.max_concurrent_rollouts,
            )  # fmt: skip
            last_completed = self._completed_rollouts
            async with self._slots:
                self._slots.notify_all()
            now = time.monotonic()
            obs = [
                ratio("rollout/generated_tokens_per_s", self._generated_tokens - last_tokens,
                      now - last_time),
                value("rollout/concurrency", self._in_flight),
                value("rollout/concurrency_cap", self._load_cap.cap),
                value("rollout/vllm_retry_count", self.client.retry_count - last_retries),
                value("rollout/vllm_regenerated_count",
                      self.client.regenerated_count - last_regenerated),
            ]  # fmt: skip
            if snapshot is not None:
                obs += [
                    value("rollout/vllm_kv_cache_usage_frac", snapshot.load.kv_cache_usage),
                    value("rollout/vllm_running_requests", snapshot.load.running),
                    value("rollout/vllm_queued_requests", snapshot.load.waiting),
                    value("rollout/vllm_preemption_count",
                          max(0, snapshot.preemptions - last_preemptions)),
                ]  # fmt: skip
                last_preemptions = snapshot.preemptions
            last_time, last_tokens = now, self._generated_tokens
            last_retries = self.client.retry_count
            last_regenerated = self.client.regenerated_count
            obs, self._pending_obs = obs + self._pending_obs, []
            self.channels.publish(LoopReport(tuple(obs)))

    # ----------------------------------------------------------------- dataset rows

    def _dataset_size(self) -> int | None:
        if self.dataset is None:
            return None
        return len(self.dataset)

    def _row_at(self, position: int, size: int | None) -> tuple[int, int]:
        if size is None:
            return 0, position
        return cursor.row_at(position, size, self.config.prompt_order_seed)

    def _row(self, row_index: int) -> dict[str, Any]:
        if self.dataset is None:
            return {}
        return dict(self.dataset[row_index])

    def _prompt_of(self, row: Mapping[str, Any], row_index: int) -> list[dict[str, Any]]:
        prompt = row.get("prompt")
        if prompt is None:
            if self.environment_factory is None:
                raise ValueError(
                    f"dataset row {row_index} has no 'prompt' column; prompts "
                    "must be conversational (a list of role/content messages)"
                )
            return []
        check_conversational(prompt, row_index)
        return [dict(m) for m in prompt]

    def _env_name(self, row: Mapping[str, Any]) -> str:
        if not isinstance(self.environment_factory, Mapping):
            return ""
        name = row.get("environment")
        if name not in self.environment_factory:
            raise ValueError(
                f"dataset row's 'environment' is {name!r}; it must name one of "
                f"{sorted(self.environment_factory)}"
            )
        return str(name)

    def _factory(self, name: str) -> Callable[[], object]:
        factory = self.environment_factory
        if isinstance(factory, Mapping):
            return factory[name]
        assert factory is not None
        return factory

    def _decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        for token in (self.tokenizer.eos_token, getattr(self.tokenizer, "pad_token", None)):
            if token:
                text = text.replace(token, "")
        return text
