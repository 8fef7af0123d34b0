"""A discrete-time simulation of the asynchronous pipeline, driven by the real core.

Generation and training are simulated (a generator with a fixed token throughput shared by
the groups in flight, a trainer with a fixed throughput, and a toy policy whose success
probability on a prompt is ``sigmoid(skill - difficulty)``), but every decision is the core's:
which groups start (:mod:`asyncgrpo.core.rollout.pacing`), how a group is scored
(:mod:`asyncgrpo.core.rollout.advantages`), how turns become samples
(:mod:`asyncgrpo.core.rollout.reconcile`, :mod:`asyncgrpo.core.rollout.scoring`, as the rollout loop
builds them), which samples are too stale and when a step is taken with
which samples (:mod:`asyncgrpo.core.run.step_queue`, the trainer's own queue and planner), which
prompts are consumed (:mod:`asyncgrpo.core.rollout.cursor`) and how metrics aggregate
(:mod:`asyncgrpo.core.metrics`).

Use it to see how ``max_staleness``, throughputs and batch sizes trade staleness against
trainer idle time before spending compute. Time is simulated: a run takes about a second.

With ``num_servers`` > 1 the generator is that many servers, each with its own throughput
shared by its groups; every group goes to one of them by the rollout loop's own routing
(:func:`asyncgrpo.core.servers.routing.route_group`), and a push pauses them all.

Weights are pushed every ``weight_sync_steps`` steps and pause the servers for
``weight_sync_s``; the servers' policy moves to the pushed version when the push lands. With
``weight_push_overlap`` (the config's default) the push runs beside the next step, one at a
time, a newer snapshot replacing one that waits; without, the step waits for its push. Groups
start on the servers' policy, so the pacing and the step queue see the same lag as the
trainer's (``behind``: steps taken less the servers' version).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import structlog
from tqdm import tqdm

from asyncgrpo.core import metrics
from asyncgrpo.core.records import TrainingSample, TurnRecord
from asyncgrpo.core.rollout import advantages, cursor, pacing
from asyncgrpo.core.rollout.reconcile import reconcile_turns
from asyncgrpo.core.rollout.scoring import check_reward_values, group_samples
from asyncgrpo.core.run import step_queue
from asyncgrpo.core.servers import routing
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.run import MetricsFile

log = structlog.get_logger("asyncgrpo.simulate")

STALL_AFTER_S = 3600.0
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
"""The simulator's knobs named after config fields take the config's defaults."""


@attrs.frozen
class SimulationConfig:
    """Knobs of the simulated run (names follow ``AsyncGRPOConfig`` where they exist).

    Attributes:
        max_steps: optimizer steps to simulate.
        dataset_size: prompts in the simulated dataset.
        num_generations: rollouts per prompt (G).
        max_staleness: as in the config; samples further behind are dropped.
        max_concurrent_rollouts: rollouts in flight at most (groups start whole).
        token_budget: tokens per row.
        rows_per_step: ``gradient_accumulation_steps x num_processes`` (planned as one
            process's micro-batches).
        prompt_tokens: tokens per prompt (the mean, with ``longest_prompt_tokens``).
        longest_prompt_tokens: the longest prompt; None: every prompt has ``prompt_tokens``.
            Otherwise a group's prompt length is uniform in ``[2 x prompt_tokens - longest,
            longest]``: pacing counts a group in flight as the largest so far, so the
            longest prompts set how many groups a step takes.
        min_completion_tokens, max_completion_tokens: the shortest and longest completion.
        mean_completion_tokens: their mean; None: uniform between the two. Otherwise a length
            is the nearer end with the probability that moves the uniform mean there, else
            uniform (:meth:`completion_lengths`): a run whose replies mostly stop at
            ``max_completion_length`` packs as many groups into a step as it measured.
        generation_tokens_per_s: generator throughput shared by all groups in flight (with
            several servers: each server's, shared by its groups).
        num_servers: generation servers, each group routed to one (core.servers.routing).
        training_tokens_per_s: trainer throughput in forwarded tokens (shared prefixes
            counted once, as the planner packs them).
        training_fixed_s: seconds every step takes beyond its tokens (planning, optimizer).
        training_per_sample_s: seconds per sample of a step.
        weight_sync_s: seconds of each push: the servers stand still meanwhile and the
            version lands at its end.
        weight_sync_steps: steps between pushes.
        weight_push_overlap: the push runs beside the next step (else the step waits for it).
        skill_per_step: the toy policy's skill gain per step at full signal.
        logging_steps: steps per logging window.
        tick_s: simulated seconds per tick.
        seed: seeds prompt difficulties, rewards, lengths and the prompt order.
    """

    max_steps: int = 60
    dataset_size: int = 128
    num_generations: int = _CONFIG_DEFAULTS["num_generations"]
    max_staleness: int = _CONFIG_DEFAULTS["max_staleness"]
    max_concurrent_rollouts: int = _CONFIG_DEFAULTS["max_concurrent_rollouts"]
    token_budget: int = 4096
    rows_per_step: int = 1
    prompt_tokens: int = 64
    longest_prompt_tokens: int | None = None
    min_completion_tokens: int = 8
    max_completion_tokens: int = 128
    mean_completion_tokens: float | None = None
    generation_tokens_per_s: float = 4500.0
    num_servers: int = 1
    training_tokens_per_s: float = 6000.0
    training_fixed_s: float = 0.0
    training_per_sample_s: float = 0.0
    weight_sync_s: float = 0.0
    weight_sync_steps: int = _CONFIG_DEFAULTS["weight_sync_steps"]
    weight_push_overlap: bool = _CONFIG_DEFAULTS["weight_push_overlap"]
    skill_per_step: float = 0.12
    logging_steps: int = _CONFIG_DEFAULTS["logging_steps"]
    tick_s: float = 0.01
    seed: int = _CONFIG_DEFAULTS["seed"]

    def __attrs_post_init__(self) -> None:
        if self.max_concurrent_rollouts < self.num_generations:
            raise ValueError(
                "SimulationConfig.max_concurrent_rollouts must be >= num_generations "
                "(a group starts whole)"
            )
        for name in (
            "max_steps",
            "dataset_size",
            "num_generations",
            "token_budget",
            "rows_per_step",
            "logging_steps",
            "num_servers",
            "weight_sync_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SimulationConfig.{name} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("SimulationConfig.max_staleness must be >= 0")
        mean = self.mean_completion_tokens
        if (
            mean is not None
            and not self.min_completion_tokens <= mean <= self.max_completion_tokens
        ):
            raise ValueError(
                f"SimulationConfig.mean_completion_tokens ({mean}) must lie between "
                f"min_completion_tokens ({self.min_completion_tokens}) and "
                f"max_completion_tokens ({self.max_completion_tokens})"
            )
        if self.longest_prompt_tokens is not None and not (
            self.prompt_tokens <= self.longest_prompt_tokens < 2 * self.prompt_tokens
        ):
            raise ValueError(
                f"SimulationConfig.longest_prompt_tokens ({self.longest_prompt_tokens}) must be "
                f"at least prompt_tokens ({self.prompt_tokens}) and below twice it (the "
                "shortest prompt is 2 x prompt_tokens - longest_prompt_tokens, at least 1)"
            )
        longest = (self.longest_prompt_tokens or self.prompt_tokens) + self.max_completion_tokens
        if longest > self.token_budget:
            raise ValueError(
                f"SimulationConfig.token_budget ({self.token_budget}) is below the longest "
                f"sample ({longest} tokens); raise token_budget"
            )

    @property
    def completion_tokens(self) -> float:
        """The mean completion length, tokens."""
        if self.mean_completion_tokens is not None:
            return self.mean_completion_tokens
        return (self.min_completion_tokens + self.max_completion_tokens) / 2

    def prompt_length(self, rng: np.random.Generator) -> int:
        """One group's prompt length (``prompt_tokens``, or uniform around it up to
        ``longest_prompt_tokens``).

        Example:
            >>> config = SimulationConfig(prompt_tokens=15, longest_prompt_tokens=20)
            >>> rng = np.random.default_rng(0)
            >>> lengths = [config.prompt_length(rng) for _ in range(20_000)]
            >>> min(lengths), max(lengths), round(float(np.mean(lengths)), 1)
            (10, 20, 15.0)
        """
        longest = self.longest_prompt_tokens
        if longest is None:
            return self.prompt_tokens
        return int(rng.integers(2 * self.prompt_tokens - longest, longest + 1))

    def completion_lengths(self, rng: np.random.Generator, count: int) -> list[int]:
        """``count`` completion lengths in ``[min_completion_tokens, max_completion_tokens]``
        with mean ``completion_tokens``: uniform, each one replaced by the end on the mean's
        side with the probability that moves the mean there.

        Example:
            >>> config = SimulationConfig(min_completion_tokens=8, max_completion_tokens=16,
            ...                           mean_completion_tokens=15.0)
            >>> lengths = config.completion_lengths(np.random.default_rng(0), 20_000)
            >>> min(lengths), max(lengths), round(float(np.mean(lengths)), 1)
            (8, 16, 15.0)
        """
        low, high = self.min_completion_tokens, self.max_completion_tokens
        lengths = rng.integers(low, high + 1, count)
        middle, mean = (low + high) / 2, self.completion_tokens
        if mean == middle:
            return lengths.tolist()
        end = high if mean > middle else low
        at_end = rng.random(count) < (mean - middle) / (end - middle)
        return np.where(at_end, end, lengths).tolist()


@attrs.define
class _Group:
    position: int
    row: int
    version: int
    lengths: list[int]
    remaining: float
    prompt: int
    server: int = 0


@attrs.define
class _Push:
    """A push of ``version``'s weights: the servers stand still from ``start`` to ``end``."""

    version: int
    start: float
    end: float


@attrs.define
class _Pipeline:
    """Mutable state of one simulated run (the shell's side; the decisions live in core)."""

    config: SimulationConfig
    rng: np.random.Generator
    difficulty: np.ndarray
    skill: float = -1.0
    version: int = 0
    policy: int = 0
    pushes: deque[_Push] = attrs.field(factory=deque)
    clock: float = 0.0
    ledger: pacing.GenerationLedger = attrs.field(factory=pacing.GenerationLedger)
    prompt_cursor: cursor.PromptCursor = attrs.field(factory=cursor.PromptCursor)
    steps: step_queue.StepQueue = attrs.field(default=None)
    next_position: int = 0
    next_group_id: int = 0
    in_flight: list[_Group] = attrs.field(factory=list)
    queue: deque[tuple[TrainingSample, ...]] = attrs.field(factory=deque)
    window: metrics.MetricWindow = attrs.field(factory=metrics.MetricWindow)
    blocked_since: float | None = None
    waiting_since: float | None = None

    def __attrs_post_init__(self) -> None:
        c = self.config
        if self.steps is None:
            self.steps = step_queue.StepQueue(
                step_queue.QueueSettings(c.token_budget, 1, c.rows_per_step, c.max_staleness)
            )

    def observe(self, *observations: metrics.Observation) -> None:
        self.window = metrics.record(self.window, observations)

    def behind(self, training: bool) -> int:
        """Steps taken (the one training counts) less the servers' policy version."""
        return self.version + int(training) - self.policy

    @property
    def paused(self) -> bool:
        """Whether a push holds the servers still now."""
        return bool(self.pushes) and self.pushes[0].start <= self.clock

    def land_pushes(self) -> None:
        """The servers take each push whose end has come."""
        while self.pushes and self.pushes[0].end <= self.clock:
            self.policy = self.pushes.popleft().version

    def push(self, version: int, at: float) -> float:
        """Push ``version``'s weights from ``at``, after the push in flight (a snapshot still
        waiting is replaced); returns when it lands."""
        if len(self.pushes) > 1:
            self.pushes.pop()
        start = max(at, self.pushes[-1].end) if self.pushes else at
        self.pushes.append(_Push(version, start, start + self.config.weight_sync_s))
        return self.pushes[-1].end


def _start_groups(state: _Pipeline, training: bool) -> None:
    """Start every group that rollout slots and the staleness allowance admit; a group that
    waited on the allowance with slots free records that wait as ``rollout/backpressure_s``.
    New groups get the servers' policy, ``state.behind(training)`` versions behind the steps
    taken (the step training counts)."""
    c = state.config
    behind = state.behind(training)
    allowance = state.steps.allowance_behind(behind)
    while True:
        slots = c.max_concurrent_rollouts - len(state.in_flight) * c.num_generations
        if slots < c.num_generations:
            return
        if not pacing.may_start_group(state.ledger, allowance, behind=behind,
                                      max_staleness=c.max_staleness):  # fmt: skip
            if state.blocked_since is None and state.ledger.groups_completed > 0:
                state.blocked_since = state.clock
            return
        if state.blocked_since is not None:
            state.observe(metrics.mean("rollout/backpressure_s", state.clock - state.blocked_since))
            state.blocked_since = None
        server = _route(state, training)
        _, row = cursor.row_at(state.next_position, c.dataset_size, c.seed)
        lengths = c.completion_lengths(state.rng, c.num_generations)
        state.in_flight.append(
            _Group(
                state.next_position,
                row,
                state.policy,
                lengths,
                float(sum(lengths)),
                c.prompt_length(state.rng),
                server,
            )
        )
        state.ledger = pacing.group_started(state.ledger)
        state.next_position += 1


def _route(state: _Pipeline, training: bool) -> int:
    """The server a new group goes to, by the rollout loop's routing: every server holds the
    servers' policy (a push reaches all), each may take every slot; the least loaded wins."""
    c = state.config
    if c.num_servers == 1:
        return 0
    reserved = [0] * c.num_servers
    for group in state.in_flight:
        reserved[group.server] += c.num_generations
    views = [routing.ServerView(True, state.policy, r, c.max_concurrent_rollouts)
             for r in reserved]  # fmt: skip
    server = routing.route_group(views, state.version + int(training), c.max_staleness)
    assert server is not None, "a group starts only while slots are free and it is not stale"
    return server


def _finish_group(state: _Pipeline, group: _Group) -> None:
    c = state.config
    p_success = 1.0 / (1.0 + math.exp(-(state.skill - state.difficulty[group.row])))
    successes = state.rng.binomial(1, p_success, c.num_generations).astype(float).tolist()
    rewards = advantages.sum_rewards(
        [check_reward_values("simulated success", successes, c.num_generations).values],
        c.num_generations,
    )
    score = advantages.score_group(rewards)
    prompt = list(range(group.prompt))
    sequences = [
        reconcile_turns([TurnRecord(prompt, outputs, [-1.0] * len(outputs))]).sequences
        for outputs in (state.rng.integers(1000, 2000, n).tolist() for n in group.lengths)
    ]
    samples = group_samples(
        sequences,
        score,
        [f"{group.position}-{rollout}" for rollout in range(len(group.lengths))],
        model_version=group.version,
        group_id=state.next_group_id,
        row_index=group.row,
        prompt_position=group.position,
        queued_at=state.clock,
    )
    state.next_group_id += 1
    tokens = sum(len(s.sequence) for s in samples)
    state.ledger = pacing.group_finished(state.ledger, tokens)
    state.prompt_cursor = cursor.group_outcome(state.prompt_cursor, group.position, len(samples))
    state.queue.append(tuple(samples))
    if c.num_servers > 1:
        state.observe(metrics.total(f"rollout/server/{group.server}/groups_count", 1))
    state.observe(
        metrics.mean("reward", float(np.nanmean(rewards)), weight=c.num_generations),
        metrics.mean("frac_reward_zero_std", 0.0 if score.kept else 1.0),
        metrics.mean("reward_group_std", score.group_std, weight=len(samples)),
    )


def _generate(state: _Pipeline) -> None:
    """One tick of generation: each server's throughput shared by its groups."""
    if not state.in_flight:
        return
    groups = [0] * state.config.num_servers
    for group in state.in_flight:
        groups[group.server] += 1
    tick_tokens = state.config.generation_tokens_per_s * state.config.tick_s
    for group in list(state.in_flight):
        group.remaining -= tick_tokens / groups[group.server]
        if group.remaining <= 0:
            state.in_flight.remove(group)
            _finish_group(state, group)


def _take_step(state: _Pipeline) -> step_queue.TakenStep | None:
    """Move the queued groups into the step queue, as the trainer does with the rollout
    process's messages, and take a step if the queue is ready (else None).

    Stale and oversize drops and the step's samples are the queue's decisions, the same the
    trainer makes; their tokens are released to the generator's ledger.
    """
    state.observe(metrics.mean("rollout/queue_size", sum(len(g) for g in state.queue)))
    _apply(state, step_queue.advance(state.steps, state.version))
    while state.queue:
        _apply(state, step_queue.arrive(state.steps, state.queue.popleft(), state.version))
    in_flight = step_queue.InFlight.of(group.version for group in state.in_flight)
    if not step_queue.ready(state.steps, in_flight, behind=state.behind(False)):
        return None
    step = step_queue.take_step(state.steps)
    state.steps = step.queue
    state.ledger = pacing.samples_taken(state.ledger, step.released_tokens)
    return step


def _apply(state: _Pipeline, decided: step_queue.Arrival) -> None:
    state.steps = decided.queue
    dropped = (*decided.stale, *decided.oversize)
    if not dropped:
        return
    state.ledger = pacing.samples_taken(state.ledger, decided.released_tokens)
    state.prompt_cursor = cursor.samples_consumed(
        state.prompt_cursor, [s.prompt_position for s in dropped]
    )
    if decided.stale:
        state.observe(metrics.total("sample/dropped_stale_count", len(decided.stale)))


def _train(state: _Pipeline, step: step_queue.TakenStep) -> float:
    """Apply one step; returns its simulated duration in seconds."""
    c = state.config
    batch = step.samples
    staleness = [s.staleness(state.version) for s in batch]
    signal = float(np.mean([abs(s.advantage) for s in batch]))
    state.skill += c.skill_per_step * signal / (1.0 + 0.25 * float(np.mean(staleness)))
    state.prompt_cursor = cursor.samples_consumed(
        state.prompt_cursor, [s.prompt_position for s in batch]
    )
    state.observe(
        metrics.mean("sample/staleness_mean", float(np.mean(staleness)), weight=len(batch)),
        metrics.maximum("sample/staleness_max", float(max(staleness))),
        metrics.mean(
            "sample/time_in_queue_s",
            float(np.mean([state.clock - s.queued_at for s in batch])),
            weight=len(batch),
        ),
        metrics.mean("batch/forwarded_tokens_per_step", step.forwarded_tokens),
        metrics.mean("batch/trained_tokens_per_step", sum(s.sequence.num_trained for s in batch)),
        metrics.mean("batch/samples_per_step", len(batch)),
    )
    return (c.training_fixed_s + c.training_per_sample_s * len(batch)
            + step.forwarded_tokens / c.training_tokens_per_s)  # fmt: skip


def _train_and_push(state: _Pipeline, batch: step_queue.TakenStep) -> float:
    """Train a step taken now and push its weights when one is due; returns when the step
    ends (after its push unless the push runs beside the next step)."""
    c = state.config
    trained_at = state.clock + _train(state, batch)
    due = (state.version + 1) % c.weight_sync_steps == 0
    lands_at = state.push(state.version + 1, trained_at) if due else trained_at
    waits = due and not c.weight_push_overlap
    state.observe(metrics.mean("perf/weight_sync_s", lands_at - trained_at if waits else 0.0))
    if due and c.weight_push_overlap:
        state.observe(metrics.mean("perf/weight_push_s", lands_at - trained_at))
    return lands_at if waits else trained_at


def simulate(
    config: SimulationConfig,
    output_dir: str | Path,
    progress: bool = True,
    on_window: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Run the simulation; writes ``metrics.jsonl`` to ``output_dir`` and returns the windows.
    With ``progress`` it shows a progress bar and logs each window (else windows log at debug
    level: a caller simulating many settings reports them itself).

    Example:
        >>> import tempfile
        >>> windows = simulate(SimulationConfig(max_steps=10), tempfile.mkdtemp(),
        ...                    progress=False)
        >>> len(windows), windows[-1]["step"]
        (2, 10)
    """
    rng = np.random.default_rng(config.seed)
    state = _Pipeline(config, rng, rng.normal(0.0, 1.0, config.dataset_size))
    windows: list[dict[str, float]] = []
    step_ends_at: float | None = None
    last_step_at = last_step_end = 0.0
    bar = tqdm(total=config.max_steps, desc="simulate", unit="step", disable=not progress)
    with MetricsFile(output_dir) as metrics_file:
        while state.version < config.max_steps:
            state.land_pushes()
            _start_groups(state, training=step_ends_at is not None)
            if not state.paused:  # the servers stand still while weights are pushed
                _generate(state)
            if step_ends_at is None:
                batch = _take_step(state)
                if batch is None:
                    if state.waiting_since is None:
                        state.waiting_since = state.clock
                else:
                    waited = state.clock - (state.waiting_since or state.clock)
                    state.observe(metrics.mean("perf/rollout_wait_s", waited))
                    state.waiting_since = None
                    step_ends_at = _train_and_push(state, batch)
                    state.observe(metrics.mean("perf/step_s", step_ends_at - last_step_end))
                    last_step_at = state.clock
            elif state.clock >= step_ends_at:
                last_step_end = step_ends_at
                step_ends_at = None
                state.version += 1
                bar.update(1)
                if state.version % config.logging_steps == 0:
                    window = _close_window(state, metrics_file, progress)
                    windows.append(window)
                    if on_window is not None:
                        on_window(state.version, window)
            state.clock += config.tick_s
            if state.clock - last_step_at > STALL_AFTER_S:
                raise RuntimeError(
                    f"simulated pipeline stalled: no step for {STALL_AFTER_S:.0f} simulated "
                    f"seconds at step {state.version} (queue {len(state.queue)}, in flight "
                    f"{len(state.in_flight)}); this is a pacing bug, please report it"
                )
    bar.close()
    return windows


def _close_window(state: _Pipeline, metrics_file: MetricsFile, loud: bool) -> dict[str, float]:
    summary = metrics.summarize(state.window)
    summary["epoch"] = cursor.epochs_consumed(state.prompt_cursor, state.config.dataset_size)
    summary["policy/skill"] = state.skill
    metrics_file.write(state.version, summary)
    (log.info if loud else log.debug)(
        "window",
        step=state.version,
        reward=round(summary.get("reward", math.nan), 3),
        staleness_max=summary.get("sample/staleness_max"),
        queue=summary.get("rollout/queue_size"),
    )
    state.window = metrics.MetricWindow()
    return {"step": state.version, **summary}
