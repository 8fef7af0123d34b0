"""Scoring a finished group in the rollout process: the reward functions called, the rewards
summed, the advantages computed, the samples built and the group's metrics gathered.

The reward functions of a group run concurrently (synchronous ones in threads); a raising
function fails the run with its name, and its values are checked by
:func:`asyncgrpo.core.rollout.scoring.check_reward_values`. The environments' ``get_reward`` values
are a column per environment type, checked the same way. A NaN or infinite reward counts as
unscored (None): :class:`NonfiniteRewardWarnings` warns once per source, and the group's metrics
count them (``rewards/<name>/nonfinite_count``). The samples are built by
:func:`asyncgrpo.core.rollout.scoring.group_samples`, as the simulator builds them.
:class:`GroupScorer` is the rollout loop's scoring task: it scores each finished group in the
order they finish and publishes its outcome.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import anyio
import attrs
import numpy as np
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from asyncgrpo.core.metrics import mean, total
from asyncgrpo.core.records import Rollout, RolloutGroup
from asyncgrpo.core.rollout import sample_wait
from asyncgrpo.core.rollout.advantages import score_group, sum_rewards
from asyncgrpo.core.rollout.metrics import GroupFacts, group_observations
from asyncgrpo.core.rollout.reconcile import reconcile_turns
from asyncgrpo.core.rollout.scoring import RewardValues, check_reward_values, group_samples
from asyncgrpo.shell.rollout.admission import Admission
from asyncgrpo.shell.rollout.heartbeat import Heartbeat
from asyncgrpo.shell.rollout.messages import GroupOutcome
from asyncgrpo.shell.rollout.tools import is_async, reward_names

RewardColumns = dict[str, list[float | None]]

log = structlog.get_logger("asyncgrpo.rollout")


@attrs.define
class PendingGroup:
    """A group between dispatch and scoring: where it came from, and its rollouts (with each
    rollout's environment reward, or None) once they are done."""

    position: int
    row_index: int
    row: Mapping[str, Any]
    prompt: list[dict[str, Any]]
    group_id: int
    model_version: int
    rollouts: list[Rollout]
    env_rewards: list[tuple[type, float] | None]
    completed_at: float = 0.0
    server: int = 0  # the server it was generated on (its index in vllm_server_base_url)


def reward_kwargs(pending: PendingGroup) -> dict[str, list[Any]]:
    """The row's columns but ``prompt``, one value per rollout, as reward keywords."""
    return {k: [v] * len(pending.rollouts) for k, v in pending.row.items() if k != "prompt"}


async def reward_values(
    pending: PendingGroup,
    reward_funcs: Sequence[Callable[..., Any]],
    doing: Callable[[str, tuple[int, int]], AbstractContextManager[None]],
) -> dict[str, RewardValues]:
    """The checked rewards of each reward function and each environment type, by name
    (sorted), each with one value (or None) per rollout and the rollouts whose reward was NaN
    or infinite (unscored).

    Raises:
        RuntimeError: a reward function raised (names it; the cause is chained).
        ValueError: a reward function returned a wrong number of values or a non-number.
    """
    g = len(pending.rollouts)
    kwargs = reward_kwargs(pending)
    inputs = dict(
        prompts=[pending.prompt] * g,
        completions=[r.completion for r in pending.rollouts],
        completion_ids=[list(r.completion_ids) for r in pending.rollouts],
        **kwargs,
    )
    values: dict[str, RewardValues] = {}

    async def call(fn: Callable[..., Any], name: str) -> None:
        try:
            with doing(f"reward function {name!r}", (pending.group_id, pending.row_index)):
                if is_async(fn):
                    result = await fn(**inputs)
                else:
                    result = await anyio.to_thread.run_sync(functools.partial(fn, **inputs))
        except Exception as error:
            raise RuntimeError(
                f"reward function {name!r} raised {type(error).__name__}: {error}"
            ) from error
        values[name] = check_reward_values(name, result, g)

    async with anyio.create_task_group() as tg:
        for fn, name in zip(reward_funcs, reward_names(reward_funcs), strict=True):
            tg.start_soon(call, fn, name)
    env_rewards = pending.env_rewards
    for env_type in {e[0] for e in env_rewards if e is not None}:
        column = [e[1] if e is not None and e[0] is env_type else None for e in env_rewards]
        values[env_type.__name__] = check_reward_values(env_type.__name__, column, g)
    return {name: values[name] for name in sorted(values)}


async def reward_columns(
    pending: PendingGroup,
    reward_funcs: Sequence[Callable[..., Any]],
    doing: Callable[[str, tuple[int, int]], AbstractContextManager[None]],
) -> RewardColumns:
    """The columns of :func:`reward_values` alone (evaluations: a NaN or infinite reward is
    unscored there too, without a warning or count)."""
    checked = await reward_values(pending, reward_funcs, doing)
    return {name: list(column.values) for name, column in checked.items()}


@attrs.define
class NonfiniteRewardWarnings:
    """Warns once per reward source (reward function or environment type) that returned a NaN
    or infinite reward, naming it and the prompt of the first group where it did; the rewards
    themselves are already unscored (None). Kept by the scoring task, so a rollout process
    warns once per source."""

    warned: set[str] = attrs.field(factory=set)

    def check(self, pending: PendingGroup, values: Mapping[str, RewardValues]) -> None:
        """Warn for each source of ``values`` with a non-finite reward not warned about yet."""
        for name, column in values.items():
            if not column.nonfinite or name in self.warned:
                continue
            self.warned.add(name)
            prompt = str(pending.prompt[-1].get("content", "")) if pending.prompt else ""
            log.warning(
                f"reward function {name!r} returned NaN or an infinite reward; it counts as "
                "unscored (None), and rewards/<name>/nonfinite_count counts them; return None "
                "for a completion the function cannot score (warned once per function)",
                reward=name,
                completions=list(column.nonfinite),
                row=pending.row_index,
                prompt=prompt[:200],
            )


def scored_outcome(
    pending: PendingGroup,
    values: Mapping[str, RewardValues],
    compute_advantages: Callable[[RolloutGroup], np.ndarray],
    *,
    eos_token_ids: frozenset[int],
    has_tools: bool,
    log_completions: bool,
) -> GroupOutcome:
    """The group's outcome for the trainer: rewards summed over ``values`` (by source, from
    :func:`reward_values`) and the rollouts' own, advantages by ``compute_advantages`` (the
    loop's hook), samples (none for a group without signal), the group's metrics and, with
    ``log_completions``, its texts."""
    g = len(pending.rollouts)
    columns = {name: list(column.values) for name, column in values.items()}
    rollout_rewards = [r.reward for r in pending.rollouts]
    rewards = sum_rewards([*columns.values(), rollout_rewards], g)
    reconciled = [reconcile_turns(r.turns) for r in pending.rollouts]
    group = RolloutGroup(
        prompts=[pending.prompt] * g,
        reward_kwargs=reward_kwargs(pending),
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
    score = score_group(rewards, lambda _: compute_advantages(group))
    now = time.monotonic()
    samples = group_samples(
        [r.sequences for r in reconciled],
        score,
        [r.rollout_id for r in pending.rollouts],
        model_version=pending.model_version,
        group_id=pending.group_id,
        row_index=pending.row_index,
        prompt_position=pending.position,
        queued_at=now,
    )
    facts = GroupFacts(
        rollouts=pending.rollouts,
        reconciled=reconciled,
        score=score,
        reward_columns=columns,
        nonfinite_rewards={name: len(column.nonfinite) for name, column in values.items()},
        eos_token_ids=eos_token_ids,
        has_tools=has_tools,
        loop_exhausted=[
            bool(r.completion and r.completion[-1].get("tool_calls")) for r in pending.rollouts
        ],
    )
    texts: tuple[tuple[str, str, float], ...] = ()
    if log_completions:
        prompt = str(pending.prompt[-1].get("content", "")) if pending.prompt else ""
        texts = tuple(
            (prompt, "\n".join(str(m.get("content") or "") for m in r.completion), float(reward))
            for r, reward in zip(pending.rollouts, rewards, strict=True)
        )
    return GroupOutcome(
        pending.position,
        pending.row_index,
        samples,
        tuple(group_observations(facts)),
        texts,
        dropped="" if samples else sample_wait.ZERO_SPREAD,
    )


@attrs.frozen
class GroupScorer:
    """The rollout loop's scoring task: each group the dispatcher finished is scored
    (:func:`reward_values`, :func:`scored_outcome`) in the order they finish, admission is told
    the tokens it will forward, and its outcome goes to the trainer through the heartbeat with
    the scoring's own timings (``rollout/score_wait_s``, ``rollout/score_s``,
    ``rollout/score_queue_size``; with several servers, the server's group count).

    Attributes:
        reward_funcs: the loop's reward functions.
        compute_advantages: the loop's hook (rewards of a group to its advantages).
        heartbeat: the loop's :class:`~asyncgrpo.shell.rollout.heartbeat.Heartbeat` (what the
            task is doing while a reward function runs; publishing the outcome).
        admission: the loop's :class:`~asyncgrpo.shell.rollout.admission.Admission`.
        eos_token_ids, has_tools, log_completions: as :func:`scored_outcome` takes them.
        several_servers: whether the run has more than one server.
    """

    reward_funcs: Sequence[Callable[..., Any]]
    compute_advantages: Callable[[RolloutGroup], np.ndarray]
    heartbeat: Heartbeat
    admission: Admission
    eos_token_ids: frozenset[int]
    has_tools: bool
    log_completions: bool
    several_servers: bool

    async def score_forever(self, receive: MemoryObjectReceiveStream[PendingGroup]) -> None:
        """Score what ``receive`` brings until it closes."""
        nonfinite = NonfiniteRewardWarnings()  # NaN/inf rewards: unscored, warned once a source
        async with receive:
            async for pending in receive:
                started = time.monotonic()
                values = await reward_values(pending, self.reward_funcs, self.heartbeat.doing)
                nonfinite.check(pending, values)
                outcome = scored_outcome(
                    pending,
                    values,
                    self.compute_advantages,
                    eos_token_ids=self.eos_token_ids,
                    has_tools=self.has_tools,
                    log_completions=self.log_completions,
                )
                done = time.monotonic()
                self.admission.finished(outcome.forwarded_tokens, pending.model_version)
                where = (
                    (total(f"rollout/server/{pending.server}/groups_count", 1),)
                    if self.several_servers
                    else ()
                )
                self.heartbeat.publish(
                    attrs.evolve(
                        outcome,
                        observations=(
                            *outcome.observations,
                            mean("rollout/score_wait_s", started - pending.completed_at),
                            mean("rollout/score_s", done - started),
                            mean(
                                "rollout/score_queue_size", receive.statistics().current_buffer_used
                            ),
                            *where,
                        ),
                    )
                )
                self.admission.report_in_flight()
