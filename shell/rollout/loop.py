"""``AsyncRolloutLoop``: generates and scores rollouts, one anyio event loop.

It runs inside the rollout process (:mod:`asyncgrpo.shell.rollout.process`) and talks to the
trainer only through :class:`~asyncgrpo.shell.rollout.messages.Channels`. For every prompt
position (:mod:`asyncgrpo.core.rollout.cursor`) it asks ``filter_prompt``, waits for the staleness
allowance (:mod:`asyncgrpo.core.rollout.pacing`), runs ``num_generations`` rollouts (each holding
one slot under the vLLM load cap), and hands the finished group to the scoring task, which sums the
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

Its parts live beside it: admission under pacing and routing
(:mod:`asyncgrpo.shell.rollout.admission`), a group's rollouts under the load cap, generated
again elsewhere when its server goes (:mod:`asyncgrpo.shell.rollout.groups`), what the current
task works for (:mod:`asyncgrpo.shell.rollout.context`), the tool loop and environments
(:mod:`asyncgrpo.shell.rollout.tools`), group scoring (:mod:`asyncgrpo.shell.rollout.scoring`),
evaluations (:mod:`asyncgrpo.shell.rollout.evaluation`), dataset rows
(:mod:`asyncgrpo.shell.rollout.prompts`), the heartbeat (:mod:`asyncgrpo.shell.rollout.heartbeat`)
and the messages to the trainer (:mod:`asyncgrpo.shell.rollout.messages`). Here: the hooks, the
dispatcher, the scoring task and the server poller, on one event loop.

With several servers (``vllm_server_base_url`` a list), each group goes to one of them
(:class:`~asyncgrpo.shell.servers.routing.ServerPool`: the least loaded for its cap, among
those holding the trainer's weights and not too far behind), every turn of its rollouts
included; ``self.client`` is the client of the server the current group runs on. A group
whose server goes away is generated again, whole and with the same seeds, on another one.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import structlog

from asyncgrpo.adapters.host_memory import give_back_freed_memory
from asyncgrpo.adapters.transfer.files import adapter_name
from asyncgrpo.adapters.vllm.client import (
    PRIORITY_POLICY,
    ServerGate,
    VLLMClient,
)
from asyncgrpo.core.metrics import Observation
from asyncgrpo.core.packing.host_memory import rollout_trim_due
from asyncgrpo.core.records import Rollout, RolloutGroup, TurnRecord
from asyncgrpo.core.rollout import cursor, sample_wait
from asyncgrpo.core.rollout.advantages import standardize_rewards
from asyncgrpo.core.rollout.candidate_sets import plan_candidate_sets
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.rollout.admission import Admission
from asyncgrpo.shell.rollout.evaluation import EvalRollout, Evaluator
from asyncgrpo.shell.rollout.groups import GroupRunner
from asyncgrpo.shell.rollout.heartbeat import Heartbeat
from asyncgrpo.shell.rollout.messages import Channels, EvalOutcome, GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.prompts import PromptRows
from asyncgrpo.shell.rollout.scoring import GroupScorer, PendingGroup
from asyncgrpo.shell.rollout.tools import EnvironmentFactory, ToolLoop
from asyncgrpo.shell.servers import (
    EvalRequest,
    RolloutGate,
    ServerPool,
    ServerSettings,
    SharedServers,
)

log = structlog.get_logger("asyncgrpo.rollout")

METRICS_POLL_S = 4.5  # off vLLM's 5 s keep-alive boundary
EVAL_PRIORITY = 1  # vLLM schedules lower values first; training's requests have 0
REJECTIONS_WITHOUT_DATASET = 10_000
"""Without a train_dataset (an environment makes every prompt) there is no epoch to pass over:
this many prompts rejected by ``filter_prompt`` in a row stand for one and end the run, as a
whole epoch rejected ends a run with a dataset."""


def policy_cache_salt(version: int) -> str:
    """The ``cache_salt`` of a request sent while its server holds policy ``version``: vLLM
    hashes the salt into every cached block, so requests of different versions share none.

    Example:
        >>> policy_cache_salt(3)
        'policy-v3'
    """
    return f"policy-v{version}"


def root_cause(group: BaseExceptionGroup) -> BaseException:
    """The first real error inside nested task-group errors (cancellations skipped)."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return root_cause(error)
        if not isinstance(error, anyio.get_cancelled_exc_class()):
            return error
    return group


class AsyncRolloutLoop:
    """Generates and scores rollouts for :class:`asyncgrpo.AsyncGRPOTrainer`.

    Hooks may read ``self.config`` (an :class:`AsyncGRPOConfig`, or a subclass with its own
    fields) and ``self.tokenizer``. Subclasses must be importable (defined at module level):
    the loop is built inside the rollout process.
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
        environment_factory: EnvironmentFactory | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        start_cursor: cursor.PromptCursor | None = None,
        server_gate: ServerGate | None = None,
        servers: SharedServers | None = None,
        eval_datasets: Mapping[str, Any] | None = None,
        eval_reward_funcs: Sequence[Callable[..., Any]] | None = None,
    ) -> None:
        self.config = config
        self.server_gate = server_gate
        self.shared_servers = servers  # several servers: their trust and versions (the trainer's)
        self.pool: ServerPool | None = None
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
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.start_cursor = start_cursor or cursor.PromptCursor()
        self.eos_token_ids = self._eos_ids(processing_class)
        self.sampling = config.sampling_params()
        self._candidate_logprobs: int | None = None  # set at start: see _plan_candidate_sets
        self._pending_obs: list[Observation] = []
        self.heartbeat = Heartbeat(channels, self._rollouts_in_flight)
        self.groups: GroupRunner | None = None  # runs each admitted group; set in opened()
        self.admission = Admission(
            config, channels, self._version_of, token_budget, rows_per_step, self._observe
        )
        self.tool_loop = ToolLoop(
            config, processing_class, environment_factory, self.heartbeat.doing, self._observe
        )
        self._generated_tokens = 0
        self._next_group_id = 0
        self._unkeyed_requests = 0
        self.eval_sampling = config.eval_sampling_params()
        self._priority_scheduling = False  # set at start: whether the servers schedule by it
        self.evaluator = Evaluator(
            dict(eval_datasets or {}),
            list(eval_reward_funcs or self.reward_funcs),
            config.eval_num_generations,
            config.max_concurrent_rollouts,
            self.evaluation_rollout,
            self._server_versions,
            self._wait_for_version_change,
            self.heartbeat.doing,
        )

    @property
    def client(self) -> VLLMClient | None:
        """The client of the server the current group runs on (the first server outside a
        group's task; ``None`` before the loop starts)."""
        if self.pool is None:
            return None
        return self.pool[context.SERVER.get()].client

    @property
    def rerouting(self) -> bool:
        """Several servers with the trainer's records: a group whose server goes away is
        generated again on another one."""
        return self.shared_servers is not None and len(self.shared_servers) > 1

    def _version_of(self, server: int) -> int:
        """The policy version a group started now on ``server`` is generated by."""
        if self.rerouting:
            assert self.shared_servers is not None
            return self.shared_servers.version(server)
        return self.channels.model_version()

    def _routable(self, server: int) -> bool:
        if self.rerouting:
            assert self.shared_servers is not None
            return self.shared_servers.routable(server)
        return True  # one server: its gate waits out an outage

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
        """Sample one reply with the config's sampling settings (one vLLM request); inside an
        evaluation with its settings (:attr:`eval_sampling`: ``eval_temperature``,
        ``eval_max_completion_length``), below training's priority where the server schedules
        by priority.

        The request's seed is :func:`~asyncgrpo.core.rollout.cursor.request_seed` of the prompt's
        position, the rollout's index and the turn, so a resumed run samples the same way.
        With ``weight_push_keeps_kv_cache`` its prefix cache is salted with the policy version
        its server holds now (:func:`policy_cache_salt`)."""
        if self.client is None:
            raise RuntimeError("generate_one_turn called before the loop started")
        seed = self._next_seed()
        salt = None
        if self.config.weight_push_keeps_kv_cache:
            salt = policy_cache_salt(self._version_of(context.SERVER.get()))
        adapter = None
        if self.lora_prefix:
            adapter = adapter_name(self.lora_prefix, context.GROUP_VERSION.get())
        evaluation = context.EVALUATING.get()
        if evaluation is not None:  # below training's priority, no candidate sets
            priority = EVAL_PRIORITY if self._priority_scheduling else 0
            gen = await self.client.generate(
                prompt_ids, evaluation, seed, model=adapter, priority=priority, cache_salt=salt
            )
        else:
            gen = await self.client.generate(
                prompt_ids,
                self.sampling,
                seed,
                model=adapter,
                candidate_sets_logprobs=self._candidate_logprobs,
                cache_salt=salt,
            )
            self._generated_tokens += len(gen.output_ids)
            assert self.pool is not None
            server = self.pool[context.SERVER.get()]
            server.requests += 1
            server.generated_tokens += len(gen.output_ids)
        return TurnRecord(
            prompt_ids=prompt_ids,
            output_ids=gen.output_ids,
            output_log_probs=gen.output_log_probs,
            output_sampling_mask=gen.sampling_masks,
            output_sampler_logprobs=gen.top_logprobs,
        )

    def _next_seed(self) -> int:
        key = context.ROLLOUT.get()
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
        async with self.opened():
            send, receive = anyio.create_memory_object_stream[PendingGroup](
                self.score_queue_maxsize
            )
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self.heartbeat.beat_forever)
                    tg.start_soon(self._poll_server_forever)
                    tg.start_soon(self._scorer().score_forever, receive)
                    tg.start_soon(self._relay_trainer_changes)
                    if self.evaluator.rows:
                        tg.start_soon(self._evaluate_forever)
                    await self._dispatch(tg, send)
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                raise root_cause(group) from None
            finally:
                send.close()

    def _scorer(self) -> GroupScorer:
        assert self.pool is not None
        return GroupScorer(
            self.reward_funcs,
            self.compute_advantages,
            self.heartbeat,
            self.admission,
            eos_token_ids=self.eos_token_ids,
            has_tools=bool(self.tools) or self.environment_factory is not None,
            log_completions=self.config.log_completions,
            several_servers=len(self.pool) > 1,
        )

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The loop's clients and servers, ready (load caps, candidate sets, the servers'
        scheduling, :meth:`setup`); :meth:`close` and the clients' end on exit. :meth:`run`
        trains inside it; an evaluation outside training (:meth:`evaluate`) runs inside it
        too."""
        settings = ServerSettings.of(self.config)
        clients = [self._client_of(settings, index) for index in range(settings.count)]
        self.pool = ServerPool(
            clients,
            self.config.max_concurrent_rollouts,
            self._version_of,
            self._routable,
            self._outages if self.rerouting else None,
        )
        try:
            await self._start_load_cap()
            await self._plan_candidate_sets()
            self.groups = GroupRunner(
                self.config,
                self.pool,
                self.generate_one,
                self.tool_loop,
                self.tools,
                self.prompt_rows,
                self.admission,
                self.heartbeat,
                self.shared_servers,
                self._observe,
            )
            self._priority_scheduling = all(
                [await c.scheduling_policy() == PRIORITY_POLICY for c in clients]
            )
            await self.setup()
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()
                for client in clients:
                    await client.aclose()

    def _client_of(self, settings: ServerSettings, server: int) -> VLLMClient:
        return settings.client(
            self.model_name,
            server,
            max_connections=self.config.max_concurrent_rollouts,
            gate=self._gate_of(server),
            stall_outage=self.rerouting,
        )

    def _gate_of(self, server: int) -> ServerGate | None:
        """The gate of ``server``'s client: the given one with one server; with several and
        the trainer's records, a gate that reroutes (:class:`~asyncgrpo.shell.servers.
        RolloutGate`)."""
        if not self.rerouting:
            return self.server_gate if server == 0 else None
        assert self.shared_servers is not None
        return RolloutGate(
            self.shared_servers.trusts[server], self.config.vllm_server_timeout, reroute=True
        )

    def _outages(self, server: int) -> int:
        assert self.shared_servers is not None
        return self.shared_servers.trusts[server].read().outages

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
                if size is None and rejected_in_a_row >= REJECTIONS_WITHOUT_DATASET:
                    raise RuntimeError(
                        f"filter_prompt rejected {rejected_in_a_row} prompts in a row of a run "
                        "without a train_dataset (the environment makes every prompt; each row "
                        "is {} at epoch 0), so no batch can reach the trainer: make "
                        "filter_prompt accept some of them"
                    )
                self.heartbeat.publish(
                    GroupOutcome(position, row_index, (), (), dropped=sample_wait.FILTERED)
                )
                await anyio.lowlevel.checkpoint()  # rejecting never blocks the loop's other tasks
                continue
            rejected_in_a_row = 0
            assert self.pool is not None
            admitted = await self.admission.admit(self.pool)
            if admitted is None:
                return
            server, version = admitted
            group_id = self._next_group_id
            self._next_group_id += 1
            assert self.groups is not None
            tg.start_soon(
                self.groups.run, send, position, row_index, row, group_id, server, version
            )

    async def _relay_trainer_changes(self) -> None:
        """Wake the dispatcher whenever the trainer changes what it reads."""
        while True:
            await self.channels.wait_for_trainer()
            self.admission.changes.notify()

    # ----------------------------------------------------------------- evaluation

    async def evaluate(self, request: EvalRequest) -> EvalOutcome:
        """Evaluate every evaluation dataset at ``request.version`` (inside :meth:`opened`):
        each prompt's ``eval_num_generations`` rollouts on the servers holding that version
        (:class:`~asyncgrpo.shell.rollout.evaluation.Evaluator`)."""
        return await self.evaluator.evaluate(request)

    async def evaluation_rollout(
        self, which: EvalRollout, prompt: list[dict[str, Any]], row: Mapping[str, Any]
    ) -> tuple[Rollout, tuple[type, float] | None]:
        """One rollout of an evaluation through this loop's rollout code (:meth:`generate_one`,
        tools and environments as in training), with the evaluation's sampling settings, on
        ``which.server`` at ``which.version``; its seeds are its own (a negative position)."""
        context.SERVER.set(which.server)
        context.GROUP_VERSION.set(which.version)
        context.GROUP.set((-1, which.row_index))
        context.ROW.set(row)
        context.ROLLOUT.set(context.RolloutKey(-1 - which.row_index, which.index))
        context.EVALUATING.set(self.eval_sampling)
        environment = None
        try:
            messages, tools, environment = await self.tool_loop.open_environment(
                prompt, dict(row), which.row_index, self.tools
            )
            rollout = await self.generate_one(messages, tools, -1)
            return rollout, await self.tool_loop.environment_reward(environment)
        finally:
            if environment is not None:
                self.tool_loop.release_environment(row, environment)

    def _server_versions(self) -> list[int]:
        assert self.pool is not None
        return [self._version_of(server) for server in range(len(self.pool))]

    async def _wait_for_version_change(self) -> None:
        self.admission.changes.arm()
        await self.admission.changes.wait()

    async def _evaluate_forever(self) -> None:
        """Run each evaluation the trainer asks for, one at a time, and publish its outcome."""
        while True:
            request = self.channels.eval_request()
            if request is None:
                await self._wait_for_version_change()
                continue
            with self.heartbeat.doing(f"evaluation of version {request.version}", (-1, -1)):
                outcome = await self.evaluate(request)
            self.channels.publish(outcome)
            self.channels.eval_finished(request.request_id)

    # ----------------------------------------------------------------- load and liveness

    async def _start_load_cap(self) -> None:
        """Each server's first load cap, from the KV cache its /metrics reports."""
        assert self.pool is not None
        await self.pool.start_caps(self.max_model_len)

    async def _plan_candidate_sets(self) -> None:
        """Read from the server whether it can return candidate sets; warn once if top-k/top-p
        needs them and it cannot
        (:func:`~asyncgrpo.core.rollout.candidate_sets.plan_candidate_sets`)."""
        assert self.client is not None
        support = await self.client.candidate_set_support()
        plan = plan_candidate_sets(
            support, self.config.top_k, self.config.top_p, self.sampling.num_sampler_logprobs
        )
        if plan.warning is not None:
            warnings.warn(plan.warning, stacklevel=2)
        self._candidate_logprobs = plan.logprobs_to_request if plan.request_sets else None

    def _rollouts_in_flight(self) -> int:
        return self.pool.in_flight if self.pool is not None else 0

    def _observe(self, *observations: Observation) -> None:
        """Keep metrics for the next :class:`LoopReport`."""
        self._pending_obs.extend(observations)

    async def _poll_server_forever(self) -> None:
        """Every few seconds: each server's /metrics moves its load cap, and a report of the
        loop's metrics goes to the trainer (:meth:`ServerPool.report`); every minute or so the
        process's free heap goes back to the kernel (:func:`~asyncgrpo.core.packing.
        host_memory.rollout_trim_due`)."""
        assert self.pool is not None
        last_time = trimmed_at = time.monotonic()
        while True:
            await anyio.sleep(METRICS_POLL_S)
            await self.pool.poll()
            self.admission.changes.notify()
            assert self.groups is not None
            await self.groups.wake()
            now = time.monotonic()
            obs = self.pool.report(now - last_time, self._generated_tokens)
            last_time = now
            obs, self._pending_obs = obs + self._pending_obs, []
            self.channels.publish(LoopReport(tuple(obs)))
            if rollout_trim_due(now - trimmed_at):
                give_back_freed_memory()
                trimmed_at = now
