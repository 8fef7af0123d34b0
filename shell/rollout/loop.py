"""``AsyncRolloutLoop``: generates and scores rollouts, one anyio event loop.

It runs inside the rollout process (:mod:`asyncgrpo.shell.rollout.process`) and talks to the
trainer only through :class:`~asyncgrpo.shell.rollout.messages.Channels`. For every prompt
position (:mod:`asyncgrpo.core.cursor`) it asks ``filter_prompt``, waits for the staleness
allowance (:mod:`asyncgrpo.core.pacing`), runs ``num_generations`` rollouts (each holding one
slot under the vLLM load cap), and hands the finished group to the scoring task, which sums the
rewards, calls ``compute_advantages``, drops zero-signal groups, reconciles turns into samples
and publishes them.

Subclass it and override a hook to change one step (the table in TRL's AsyncGRPOTrainer
documentation):

==============================  =======================================================
``filter_prompt(row_index, row, epoch)``  once per prompt, before generation
``generate_one(prompt, tools, group_id)``  once per rollout (default: the tool loop)
``generate_one_turn(prompt_ids)``          once per sampling request (one vLLM call)
``compute_advantages(group)``              once per group, after rewards are summed
``setup()``, ``close()``                   when the loop starts and stops
==============================  =======================================================

Its parts live beside it: the tool loop and environments (:mod:`asyncgrpo.shell.rollout.tools`),
group scoring (:mod:`asyncgrpo.shell.rollout.scoring`), dataset rows
(:mod:`asyncgrpo.shell.rollout.prompts`) and the messages to the trainer
(:mod:`asyncgrpo.shell.rollout.messages`). Here: the hooks, dispatch under pacing and the
load cap, the server poller and the heartbeat, over one event loop's counters (rollouts in
flight, the generation ledger, generated tokens, calls in flight).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import structlog

from asyncgrpo.adapters.vllm_client import (
    PromptTooLongError,
    ServerGate,
    VLLMClient,
)
from asyncgrpo.adapters.weight_transfer import adapter_name
from asyncgrpo.core import cursor, pacing, sample_wait
from asyncgrpo.core.activity import Activity, describe_activities
from asyncgrpo.core.advantages import standardize_rewards
from asyncgrpo.core.candidate_sets import plan_candidate_sets
from asyncgrpo.core.metrics import Observation, ratio, value
from asyncgrpo.core.records import Rollout, RolloutGroup, TurnRecord
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout.messages import Channels, GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.prompts import PromptRows
from asyncgrpo.shell.rollout.scoring import PendingGroup, reward_columns, scored_outcome
from asyncgrpo.shell.rollout.tools import ToolLoop
from asyncgrpo.shell.servers import ServerSettings

log = structlog.get_logger("asyncgrpo.rollout")

METRICS_POLL_S = 4.5  # off vLLM's 5 s keep-alive boundary
CHANGE_BACKSTOP_S = 1.0  # the dispatcher looks again at least this often, changes or not
_GROUP_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("group_version", default=0)
_ROLLOUT: contextvars.ContextVar[_RolloutKey | None] = contextvars.ContextVar(
    "rollout", default=None
)
# (group_id, row_index) of the group a rollout task works for, for the activity report
_GROUP: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("group", default=(-1, -1))
HEARTBEAT_S = 1.0
TOO_LONG_IN_A_ROW = 32  # this many prompts in a row rejected as too long (or an epoch): raise


class _Changes:
    """Wakes the dispatcher when something it waits on may have changed: :meth:`arm` before
    looking, :meth:`wait` after, and a :meth:`notify` in between is not lost."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def arm(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            await self._event.wait()


def _leaves(group: BaseExceptionGroup) -> list[Any]:
    """The exceptions of ``group``, nested groups flattened."""
    found: list[Any] = []
    for error in group.exceptions:
        found += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found


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
        self.prompt_rows = PromptRows(
            dataset, config.prompt_order_seed, environment_factory is not None
        )
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
        self.sampling = config.sampling_params()
        self.client: VLLMClient | None = None
        self._candidate_logprobs: int | None = None  # set at start: see _plan_candidate_sets
        self._ledger = pacing.GenerationLedger()
        self._taken_seen = 0
        self._load_cap = pacing.LoadCap(cap=config.max_concurrent_rollouts)
        self._in_flight = 0
        self._reserved = 0
        self._slots = anyio.Condition()
        self._changes = _Changes()  # anything the dispatcher waits on may have changed
        self._pending_obs: list[Observation] = []
        self.tool_loop = ToolLoop(
            config, processing_class, environment_factory, self._doing, self._observe
        )
        self._generated_tokens = 0
        self._completed_rollouts = 0
        self._next_group_id = 0
        self._unkeyed_requests = 0
        self._activities: dict[int, Activity] = {}
        self._too_long_in_a_row = 0
        self._activity_ids = itertools.count()
        self._published = sample_wait.WaitTally()  # every group published, for the heartbeat

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
        gen = await self.client.generate(
            prompt_ids, self.sampling, seed, model=adapter,
            candidate_sets_logprobs=self._candidate_logprobs,
        )  # fmt: skip
        self._generated_tokens += len(gen.output_ids)
        return TurnRecord(
            prompt_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_log_probs=gen.output_log_probs,
            output_sampling_mask=gen.sampling_masks,
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
        ``max_tool_calling_iterations`` tool rounds (:class:`~.tools.ToolLoop`).
        """
        return await self.tool_loop.converse(prompt, tools, self.generate_one_turn)

    # ----------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Run until the trainer asks to stop (or a fault raises)."""
        self.client = ServerSettings.of(self.config).client(
            self.model_name,
            max_connections=self.config.max_concurrent_rollouts,
            gate=self.server_gate,
        )
        try:
            await self._start_load_cap()
            await self._plan_candidate_sets()
            await self.setup()
            send, receive = anyio.create_memory_object_stream[PendingGroup](
                self.score_queue_maxsize
            )
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._heartbeat_forever)
                    tg.start_soon(self._poll_server_forever)
                    tg.start_soon(self._score_forever, receive)
                    tg.start_soon(self._relay_trainer_changes)
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
        size = self.prompt_rows.size
        rejected_in_a_row = 0
        for position in cursor.positions_from(self.start_cursor):
            if self.channels.stop_requested():
                return
            epoch, row_index = self.prompt_rows.at(position, size)
            row = self.prompt_rows.row(row_index)
            if not self.filter_prompt(row_index, row, epoch):
                rejected_in_a_row += 1
                if size is not None and rejected_in_a_row >= size:
                    raise RuntimeError(
                        f"filter_prompt rejected all {size} prompts of an epoch; no batch can "
                        "reach the trainer"
                    )
                self._publish(GroupOutcome(position, row_index, (), (),
                                           dropped=sample_wait.FILTERED))  # fmt: skip
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
        """Wait until a rollout slot is free and the staleness allowance admits a group. The
        wait sleeps until something it depends on changes: a group here finishes or is scored,
        the load cap moves, or the trainer takes samples, takes a step or pushes weights."""
        waited_from: float | None = None
        await anyio.lowlevel.checkpoint()
        while True:
            self._changes.arm()  # a change from here on ends the wait below at once
            if self.channels.stop_requested():
                return False
            if self._admits(self._reserved) and self._allowance_admits():
                break
            waited_from = waited_from or time.monotonic()
            await self._changes.wait(CHANGE_BACKSTOP_S)
        if waited_from is not None and self._ledger.groups_completed:
            self._pending_obs.append(
                value("rollout/backpressure_s", time.monotonic() - waited_from)
            )
        return True

    def _allowance_admits(self) -> bool:
        """Whether the staleness allowance admits a group now
        (:func:`~asyncgrpo.core.pacing.may_start_group`)."""
        taken = self.channels.tokens_taken()
        self._ledger = pacing.samples_taken(self._ledger, taken - self._taken_seen)
        self._taken_seen = taken
        allowance = pacing.token_allowance(
            self.channels.tokens_per_step(), self.config.max_staleness,
            self.token_budget, self.rows_per_step,
        )  # fmt: skip
        behind = self.channels.steps_taken() - self.channels.model_version()
        return pacing.may_start_group(self._ledger, allowance, behind=behind,
                                      max_staleness=self.config.max_staleness)  # fmt: skip

    async def _relay_trainer_changes(self) -> None:
        """Wake the dispatcher whenever the trainer changes what it reads."""
        while True:
            await self.channels.wait_for_trainer()
            self._changes.notify()

    async def _run_group(
        self, send: Any, position: int, row_index: int, row: dict[str, Any], group_id: int
    ) -> None:
        pending = PendingGroup(
            position=position,
            row_index=row_index,
            row=row,
            prompt=self.prompt_rows.prompt_of(row, row_index),
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
            self._changes.notify()
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

    def _skip_too_long(self, pending: PendingGroup, error: PromptTooLongError) -> None:
        """A prompt the server rejects as too long: skip its group (consumed, as a filtered
        prompt), count it (``rollout/prompt_too_long_count``) and log its row; raise when
        every prompt of an epoch, or ``TOO_LONG_IN_A_ROW`` in a row, were rejected."""
        self._too_long_in_a_row += 1
        limit = min(self.prompt_rows.size or TOO_LONG_IN_A_ROW, TOO_LONG_IN_A_ROW)
        if self._too_long_in_a_row >= limit:
            raise PromptTooLongError(
                f"the last {self._too_long_in_a_row} prompts were all rejected as too long; "
                f"no batch can reach the trainer. {error}"
            ) from error
        log.warning("skipped a prompt the server rejected as too long", row=pending.row_index,
                    position=pending.position, error=str(error)[:400])  # fmt: skip
        self._ledger = pacing.group_finished(self._ledger, 0)
        self._changes.notify()
        counted = (value("rollout/prompt_too_long_count", 1),)
        self._publish(GroupOutcome(pending.position, pending.row_index, (), counted,
                                   dropped=sample_wait.PROMPT_TOO_LONG))  # fmt: skip
        # after the publish: the trainer waits for a group counted here to arrive
        self.channels.report_in_flight(self._ledger.groups_in_flight)

    def _admits(self, in_flight: int) -> bool:
        """Whether one more rollout fits under the load cap and max_concurrent_rollouts."""
        limit = self.config.max_concurrent_rollouts
        return pacing.rollouts_to_admit(in_flight, self._load_cap, limit) > 0

    async def _one_rollout(
        self, pending: PendingGroup
    ) -> tuple[Rollout, tuple[type, float] | None]:
        async with self._slots:
            while not self._admits(self._in_flight):
                await self._slots.wait()
            self._in_flight += 1
        start = time.monotonic()
        try:
            prompt, tools, environment = await self.tool_loop.open_environment(
                pending.prompt, pending.row, pending.row_index, self.tools
            )
            rollout = await self.generate_one(prompt, tools, pending.group_id)
            env_reward = await self.tool_loop.environment_reward(environment)
            if environment is not None:
                self.tool_loop.release_environment(pending.row, environment)
        finally:
            async with self._slots:
                self._in_flight -= 1
                self._completed_rollouts += 1
                self._slots.notify_all()
        self._pending_obs.append(value("rollout/duration_s", time.monotonic() - start))
        return rollout, env_reward

    # ----------------------------------------------------------------- scoring

    async def _score_forever(self, receive: Any) -> None:
        async with receive:
            async for pending in receive:
                started = time.monotonic()
                columns = await reward_columns(pending, self.reward_funcs, self._doing)
                outcome = scored_outcome(
                    pending, columns, self.compute_advantages,
                    eos_token_ids=self.eos_token_ids,
                    has_tools=bool(self.tools) or self.environment_factory is not None,
                    log_completions=self.config.log_completions,
                )  # fmt: skip
                done = time.monotonic()
                self._ledger = pacing.group_finished(self._ledger, outcome.forwarded_tokens)
                self._changes.notify()
                self._publish(attrs.evolve(outcome, observations=(
                    *outcome.observations,
                    value("rollout/score_wait_s", started - pending.completed_at),
                    value("rollout/score_s", done - started),
                    value("rollout/score_queue_size", receive.statistics().current_buffer_used),
                )))  # fmt: skip
                # after the publish: the trainer waits for a group counted here to arrive
                self.channels.report_in_flight(self._ledger.groups_in_flight)

    # ----------------------------------------------------------------- load and liveness

    async def _start_load_cap(self) -> None:
        assert self.client is not None
        snapshot = await self.client.metrics()
        self._load_cap = pacing.initial_load_cap(
            snapshot.kv_cache_tokens if snapshot else None,
            self.max_model_len,
            self.config.max_concurrent_rollouts,
        )

    async def _plan_candidate_sets(self) -> None:
        """Read from the server whether it can return candidate sets; warn once if top-k/top-p
        needs them and it cannot (:func:`~asyncgrpo.core.candidate_sets.plan_candidate_sets`)."""
        assert self.client is not None
        support = await self.client.candidate_set_support()
        plan = plan_candidate_sets(support, self.config.top_k, self.config.top_p,
                                   self.sampling.num_sampler_logprobs)  # fmt: skip
        if plan.warning is not None:
            warnings.warn(plan.warning, stacklevel=2)
        self._candidate_logprobs = plan.logprobs_to_request if plan.request_sets else None

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

    def _publish(self, outcome: GroupOutcome) -> None:
        """Send a group's outcome to the trainer, counted for the heartbeat's report."""
        self._published = sample_wait.outcome_arrived(self._published, len(outcome.samples),
                                                      outcome.dropped)  # fmt: skip
        self.channels.publish(outcome)

    def _observe(self, *observations: Observation) -> None:
        """Keep metrics for the next :class:`LoopReport`."""
        self._pending_obs.extend(observations)

    def describe_activity(self) -> str:
        """One line: rollouts in flight and the longest-running calls (reward functions,
        tools, environment methods, generation requests), with their groups."""
        calls = describe_activities(self._activities.values(), time.monotonic())
        published = self._published
        dropped = ", ".join(f"{n} {sample_wait.GROUP_REASONS.get(r, r)}"
                            for r, n in sorted(published.groups_dropped.items()))  # fmt: skip
        groups = f"; {published.groups} groups published" if published.groups else ""
        groups += f" ({dropped})" if dropped else ""
        return f"{self._in_flight} rollouts in flight; {calls}{groups}"

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
            self._changes.notify()
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
