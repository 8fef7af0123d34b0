"""Pacing decisions: how far generation may run ahead, and how hard to load the vLLM server.

Three limits bound the rollouts in flight (the "concurrency" section of TRL's AsyncGRPOTrainer
documentation):

1. **Staleness allowance** (:func:`token_allowance`, :func:`may_start_group`): generation keeps
   at most ``max(max_staleness, 1)`` steps' worth of tokens queued, buffered by the trainer or
   in flight, fewer while the server's policy lags the trainer's steps (:func:`steps_left`),
   a group starting only if its expected tokens fit too. A sample's tokens count
   from its group's end until the trainer trains or drops it (:mod:`asyncgrpo.core.run.step_queue`
   releases them), so in steady state a sample waits at most ``max_staleness`` steps. The step
   size is the trainer's (:attr:`~asyncgrpo.core.run.step_queue.StepQueue.tokens_per_step`); before
   the first step every row counts as full; until the first group completes, one group at a
   time. No group starts whose samples could only be dropped: while the trainer has taken
   more than ``max_staleness`` steps beyond the policy the server holds (at ``max_staleness=0``:
   while it trains a step and pushes the weights). Samples more than ``max_staleness`` weight
   updates old are dropped (by the trainer's step queue, :mod:`asyncgrpo.core.run.step_queue`).
2. **vLLM load cap** (:class:`LoadCap`, :func:`next_load_cap`): a state machine over /metrics
   snapshots, starting at ``KV-cache tokens // max_model_len`` requests.
3. **max_concurrent_rollouts**: the hard ceiling set by the user.

Nothing here owns a task, a clock or a client: the shell feeds observations in and acts on the
decisions that come out.
"""

from __future__ import annotations

import math

import attrs

RAISE_BELOW_KV_USAGE = 0.60
CUT_ABOVE_KV_USAGE = 0.80
MAX_RAISE_FRACTION = 0.25
CUT_FACTOR = 0.70


def token_allowance(
    tokens_per_step: float | None,
    max_staleness: int,
    token_budget: int,
    rows_per_step: int,
    behind: int = 0,
) -> float:
    """Tokens that may be queued, buffered or in flight: the steps a new group's samples can
    still be trained in (:func:`steps_left`) times a step.

    Args:
        tokens_per_step: the unpacked tokens a full step holds, as the trainer's queue measured
            it (:mod:`asyncgrpo.core.run.step_queue`); ``None`` before the first step, when every
            row counts as full (``token_budget`` tokens).
        max_staleness: the config's ``max_staleness`` (0 still allows one step ahead).
        token_budget: tokens per row.
        rows_per_step: ``gradient_accumulation_steps x num_processes``.
        behind: as in :func:`may_start_group`; 0 for the trainer's view, once its weights
            have landed.

    Example:
        >>> token_allowance(None, 4, 1024, 2), token_allowance(1500.0, 0, 1024, 2)
        (8192.0, 1500.0)
        >>> token_allowance(1500.0, 4, 1024, 2, behind=2)
        4500.0
    """
    if tokens_per_step is None:
        tokens_per_step = float(token_budget * rows_per_step)
    return float(steps_left(max_staleness, behind)) * float(tokens_per_step)


def steps_left(max_staleness: int, behind: int) -> int:
    """The steps a group started now can be trained in before its samples are too stale:
    ``max(max_staleness, 1)`` while the server holds the trainer's newest weights, and fewer
    while it lags.

    A group started ``behind`` versions behind the steps taken is first trained by the next
    step, at staleness ``behind``, and by each later one a version staler: the next
    ``max_staleness + 1 - behind`` steps can train it (none once ``behind > max_staleness``).
    With the push beside the step the server lags by one or two versions in steady state, so
    counting the lag matters: a whole ``max_staleness`` steps of tokens started two versions
    behind leaves the last step's samples stale. ``behind=0`` (the trainer waits for a step's
    samples with its weights landed) keeps ``max(max_staleness, 1)``, not ``max_staleness + 1``:
    generation runs at most ``max_staleness`` steps ahead (one at ``max_staleness=0``).

    Example:
        >>> [steps_left(4, b) for b in range(6)], steps_left(0, 0), steps_left(1, 1)
        ([4, 4, 3, 2, 1, 0], 1, 1)
    """
    return max(0, min(max(max_staleness, 1), max_staleness + 1 - behind))


@attrs.frozen
class GenerationLedger:
    """What the rollout side has outstanding, for the staleness allowance.

    Attributes:
        queued_tokens: tokens of samples finished but not yet trained or dropped by the trainer
            (on the rollout queue or in the trainer's buffer).
        groups_in_flight: groups started whose scoring has not finished.
        groups_completed: groups completed so far (any outcome).
        largest_group_tokens: the most tokens one completed group put on the queue; 0 until
            one completes. A group in flight is expected to bring as many: completion lengths
            vary from group to group, and counting the mean group let groups longer than it
            push the samples behind them past their last step.
    """

    queued_tokens: int = 0
    groups_in_flight: int = 0
    groups_completed: int = 0
    largest_group_tokens: int = 0

    def in_flight_tokens(self) -> int:
        """Tokens the groups in flight are expected to bring (each the largest group so far)."""
        return self.groups_in_flight * self.largest_group_tokens


def may_start_group(
    ledger: GenerationLedger, allowance: float, *, behind: int, max_staleness: int
) -> bool:
    """Whether the worker may start one more group now.

    A group started now is generated by the server's policy and trained at the earliest by the
    trainer's next step, whose version is the number of steps taken so far, so its samples are
    at least ``behind`` versions old. With ``behind > max_staleness`` they can only be dropped
    as stale, so no group starts (at ``max_staleness=0``: none from the moment the trainer
    takes a step until its weights reach the server).

    Otherwise, before any group completes the size of a group is unknown, so one group runs at a
    time. Afterwards a group starts if queued plus in-flight tokens plus its own expected tokens
    (each group in flight and the new one counted as the largest so far) stay within
    ``allowance``. With nothing queued or in flight a group
    may always start, so a small allowance (say ``max_staleness=0``) never deadlocks; nor does a
    full buffer: the trainer takes a step when no group can start
    (:func:`asyncgrpo.core.run.step_queue.ready`).

    Args:
        ledger: what the worker has outstanding.
        allowance: tokens it may hold (:func:`token_allowance`).
        behind: steps the trainer has taken (the one it trains now included) minus the policy
            version new groups are generated with; 0 when the server holds the newest weights.
        max_staleness: the config's ``max_staleness``.

    Example:
        >>> may_start_group(GenerationLedger(groups_in_flight=1), 1e9, behind=0, max_staleness=1)
        False
        >>> ledger = GenerationLedger(queued_tokens=800, groups_completed=3,
        ...                           largest_group_tokens=200)
        >>> [may_start_group(ledger, a, behind=0, max_staleness=0) for a in (1000.0, 999.0)]
        [True, False]
        >>> [may_start_group(GenerationLedger(), 1e9, behind=1, max_staleness=m) for m in (0, 1)]
        [False, True]
    """
    if behind > max_staleness:
        return False
    if ledger.groups_completed == 0:
        return ledger.groups_in_flight == 0
    if ledger.queued_tokens == 0 and ledger.groups_in_flight == 0:
        return True
    expected = ledger.queued_tokens + ledger.in_flight_tokens() + ledger.largest_group_tokens
    return expected <= allowance


def group_started(ledger: GenerationLedger) -> GenerationLedger:
    """The ledger after one more group starts."""
    return attrs.evolve(ledger, groups_in_flight=ledger.groups_in_flight + 1)


def group_finished(ledger: GenerationLedger, forwarded_tokens: int) -> GenerationLedger:
    """The ledger after a group finishes; its kept samples' tokens join the queue.

    Args:
        forwarded_tokens: tokens of the samples the group put on the queue (0 if dropped).
    """
    if ledger.groups_in_flight < 1:
        raise ValueError("group_finished called with no group in flight")
    return GenerationLedger(
        queued_tokens=ledger.queued_tokens + forwarded_tokens,
        groups_in_flight=ledger.groups_in_flight - 1,
        groups_completed=ledger.groups_completed + 1,
        largest_group_tokens=max(ledger.largest_group_tokens, forwarded_tokens),
    )


def samples_taken(ledger: GenerationLedger, forwarded_tokens: int) -> GenerationLedger:
    """The ledger after the trainer is done with samples holding ``forwarded_tokens`` (trained
    or dropped)."""
    return attrs.evolve(ledger, queued_tokens=max(0, ledger.queued_tokens - forwarded_tokens))


@attrs.frozen
class ServerLoad:
    """One /metrics snapshot of the vLLM server, summed (or maxed) over its engines.

    Attributes:
        kv_cache_usage: KV-cache usage fraction in [0, 1] (max over engines).
        running: requests being decoded.
        waiting: requests accepted but not yet scheduled.
    """

    kv_cache_usage: float
    running: int
    waiting: int


@attrs.frozen
class LoadCap:
    """The live cap on rollouts in flight that follows the server's load.

    Attributes:
        cap: current cap, in ``[1, max_concurrent_rollouts]``.
        completed_since_raise: rollouts completed since the cap last rose; bounds the next
            raise, so the cap grows only as fast as the server proves it can serve.
    """

    cap: int
    completed_since_raise: int = 0


def initial_load_cap(
    kv_cache_tokens: int | None, max_model_len: int, max_concurrent_rollouts: int
) -> LoadCap:
    """Start at the requests that fit the KV cache at full length, within ``[1, ceiling]``.

    ``kv_cache_tokens=None`` (no /metrics on the server) gives the ceiling.

    Example:
        >>> initial_load_cap(65536, 4096, 512).cap, initial_load_cap(None, 4096, 512).cap
        (16, 512)
    """
    if kv_cache_tokens is None:
        return LoadCap(cap=max_concurrent_rollouts)
    return LoadCap(cap=_clamp(kv_cache_tokens // max_model_len, max_concurrent_rollouts))


def rollouts_completed(state: LoadCap, count: int) -> LoadCap:
    """The state after ``count`` more rollouts completed."""
    return attrs.evolve(state, completed_since_raise=state.completed_since_raise + count)


def next_load_cap(
    state: LoadCap, snapshot: ServerLoad | None, max_concurrent_rollouts: int
) -> LoadCap:
    """Adjust the cap from one /metrics snapshot (polled every few seconds).

    * no snapshot (the server has no /metrics): the cap is ``max_concurrent_rollouts``;
    * KV usage above 80%: cut by 30% (running requests finish, new ones wait);
    * KV usage below 60% and nothing waiting: raise by up to 25%, and by no more than the
      rollouts completed since the last raise;
    * otherwise unchanged. The cap stays in ``[1, max_concurrent_rollouts]``.

    Example:
        >>> state = LoadCap(cap=16, completed_since_raise=100)
        >>> next_load_cap(state, ServerLoad(0.3, 16, 0), 512).cap
        20
        >>> next_load_cap(state, ServerLoad(0.9, 16, 4), 512).cap
        11
    """
    if snapshot is None:
        return LoadCap(cap=max_concurrent_rollouts)
    if snapshot.kv_cache_usage > CUT_ABOVE_KV_USAGE:
        cut = _clamp(math.floor(state.cap * CUT_FACTOR), max_concurrent_rollouts)
        return LoadCap(cap=cut, completed_since_raise=0)
    if snapshot.kv_cache_usage < RAISE_BELOW_KV_USAGE and snapshot.waiting == 0:
        step = min(math.ceil(state.cap * MAX_RAISE_FRACTION), state.completed_since_raise)
        if step > 0:
            return LoadCap(cap=_clamp(state.cap + step, max_concurrent_rollouts))
    return attrs.evolve(state, cap=_clamp(state.cap, max_concurrent_rollouts))


def rollouts_to_admit(in_flight: int, state: LoadCap, max_concurrent_rollouts: int) -> int:
    """How many more rollouts may start now under both the load cap and the hard ceiling.

    Example:
        >>> rollouts_to_admit(10, LoadCap(cap=12), 512)
        2
    """
    limit = min(state.cap, max_concurrent_rollouts)
    return max(0, limit - in_flight)


def _clamp(cap: int, ceiling: int) -> int:
    return max(1, min(int(cap), ceiling))
