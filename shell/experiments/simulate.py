"""A discrete-time simulation of the asynchronous pipeline, driven by the real core.

Generation and training are simulated by part models (:class:`SimulationConfig` holds them:
each server a generator decoding every request of a group with its own length, its throughput
growing with the requests it runs and bounded by its KV cache,
:mod:`asyncgrpo.core.experiments.generator`; a trainer with a throughput and fixed costs; the
push; the contention of shared cores; and a toy policy whose success probability on a prompt
is ``sigmoid(skill - difficulty)``), but every decision is the core's: which groups start
(:mod:`asyncgrpo.core.rollout.pacing`), how a group is scored
(:mod:`asyncgrpo.core.rollout.advantages`), how turns become samples
(:mod:`asyncgrpo.core.rollout.reconcile`, :mod:`asyncgrpo.core.rollout.scoring`, as the rollout
loop builds them), which samples are too stale and when a step is taken with which samples
(:mod:`asyncgrpo.core.run.step_queue`, the trainer's own queue and planner), which prompts are
consumed (:mod:`asyncgrpo.core.rollout.cursor`) and how metrics aggregate
(:mod:`asyncgrpo.core.metrics`).

A group finishes when its longest response does, so a synchronous step (``max_staleness`` 0)
waits for the longest of its responses while the server runs fewer and fewer requests; running
ahead keeps it full. Use the simulation to see how ``max_staleness``, throughputs and batch
sizes trade staleness against idle time before spending compute. Time is simulated: a run
takes about a second.

With ``num_servers`` > 1 every group goes to one server by the rollout loop's own routing
(:func:`asyncgrpo.core.servers.routing.route_group`), and a push pauses them all. Weights are
pushed every ``weight_sync_steps`` steps and pause the servers for ``weight_sync_s``; the
servers' policy moves to the pushed version when the push lands. With ``weight_push_overlap``
(the config's default) the push runs beside the next step, one at a time, a newer snapshot
replacing one that waits; without, the step waits for its push. Groups start on the servers'
policy, so the pacing and the step queue see the same lag as the trainer's (``behind``: steps
taken less the servers' version).

Besides the trainer's metrics, each window logs ``rollout/concurrency`` and
``rollout/generated_tokens_per_s`` (as the rollout loop does) and ``sim/generator_idle_frac``,
the share of server time with no request running (pauses included).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog
from tqdm import tqdm

from asyncgrpo.core import metrics
from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.records import TrainingSequence
from asyncgrpo.core.rollout import advantages, cursor, pacing
from asyncgrpo.core.rollout.scoring import check_reward_values, group_samples
from asyncgrpo.core.run import step_queue
from asyncgrpo.core.servers import routing
from asyncgrpo.shell.experiments.simulation_config import SimulationConfig
from asyncgrpo.shell.experiments.simulation_state import (
    Group,
    Pipeline,
    TrainingStep,
    WindowCounters,
)
from asyncgrpo.shell.run import MetricsFile

__all__ = ["STALL_AFTER_S", "SimulationConfig", "simulate"]

log = structlog.get_logger("asyncgrpo.simulate")

STALL_AFTER_S = 3600.0


def _start_groups(state: Pipeline, training: bool) -> None:
    """Start every group that rollout slots and the staleness allowance admit; a group that
    waited on the allowance with slots free records that wait as ``rollout/backpressure_s``.
    New groups get the servers' policy, ``state.behind(training)`` versions behind the steps
    taken (the step training counts)."""
    c = state.config
    if c.groups_per_step is not None:  # colocated: the whole batch at once, between steps
        if not (state.in_flight or state.queue or training or state.pushes):
            for _ in range(c.groups_per_step):
                _start_group(state, training)
        return
    behind = state.behind(training)
    allowance = state.steps.allowance_behind(behind)
    while True:
        slots = c.max_concurrent_rollouts - len(state.in_flight) * c.num_generations
        if slots < c.num_generations:
            return
        if not pacing.may_start_group(
            state.ledger, allowance, behind=behind, max_staleness=c.max_staleness
        ):
            if state.blocked_since is None and state.ledger.groups_completed > 0:
                state.blocked_since = state.clock
            return
        if state.blocked_since is not None:
            state.observe(metrics.mean("rollout/backpressure_s", state.clock - state.blocked_since))
            state.blocked_since = None
        _start_group(state, training)


def _start_group(state: Pipeline, training: bool) -> None:
    """Start the next prompt's group on the server routing picks."""
    c = state.config
    server = _route(state, training)
    _, row = cursor.row_at(state.next_position, c.dataset_size, c.seed)
    lengths = c.completion_distribution.sample(
        state.rng, c.num_generations, c.group_length_correlation
    ).tolist()
    prompt = int(c.prompt_distribution.sample(state.rng, 1)[0])
    group = Group(state.next_position, row, state.policy, lengths, prompt, server)
    state.in_flight[group.position] = group
    state.requests.add(group.position, server, lengths, prompt)
    # the group's prompt is prefilled once (its requests share it: prefix caching)
    state.prefill_left_s[server] += c.server_generator.prefill_s(prompt)
    state.ledger = pacing.group_started(state.ledger)
    state.next_position += 1


def _route(state: Pipeline, training: bool) -> int:
    """The server a new group goes to, by the rollout loop's routing: every server holds the
    servers' policy (a push reaches all), each may take every slot; the least loaded wins."""
    c = state.config
    if c.num_servers == 1:
        return 0
    reserved = [0] * c.num_servers
    for group in state.in_flight.values():
        reserved[group.server] += c.num_generations
    views = [routing.ServerView(True, state.policy, r, c.max_concurrent_rollouts) for r in reserved]
    server = routing.route_group(views, state.version + int(training), c.max_staleness)
    assert server is not None, "a group starts only while slots are free and it is not stale"
    return server


def _single_turn(prompt: np.ndarray, output: np.ndarray) -> TrainingSequence:
    """The sequence a one-turn rollout reconciles to: ``prompt`` then ``output`` (int64 [P]
    and [N]), the output trained, at a sampler log-prob of -1 nat a token."""
    return TrainingSequence(
        input_ids=np.concatenate([prompt, output]),
        trained_mask=np.repeat(np.array([0, 1], dtype=np.int8), [len(prompt), len(output)]),
        sampler_logprobs=np.repeat([0.0, -1.0], [len(prompt), len(output)]),
    )


def _finish_group(state: Pipeline, group: Group) -> None:
    c = state.config
    p_success = 1.0 / (1.0 + math.exp(-(state.skill - state.difficulty[group.row])))
    successes = state.rng.binomial(1, p_success, c.num_generations).astype(float).tolist()
    rewards = advantages.sum_rewards(
        [check_reward_values("simulated success", successes, c.num_generations).values],
        c.num_generations,
    )
    score = advantages.score_group(rewards)
    # the group's own prompt: its first token is its position, so that the packing shares
    # no prefix between groups (different prompts), only within the group
    prompt = np.arange(group.prompt)
    prompt[0] = group.position
    outputs = state.rng.integers(1000, 2000, sum(group.lengths))
    starts = np.cumsum([0, *group.lengths]).tolist()
    sequences = [[_single_turn(prompt, outputs[a:b])] for a, b in itertools.pairwise(starts)]
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


def _generate(state: Pipeline) -> bool:
    """One tick of generation: each server prefills the prompts of the groups it started,
    then decodes the requests it runs, every server in one pass
    (:func:`asyncgrpo.core.experiments.generator.advance_servers`),
    slower while the trainer trains on shared cores; groups whose every response is done
    finish. Returns whether any server ran a request."""
    c = state.config
    counters, requests = state.counters, state.requests
    counters.ticks += 1
    counters.requests += int(np.count_nonzero(requests.generated < requests.length))
    if not len(requests) or state.paused:  # the servers stand still while weights are pushed
        return False
    seconds = c.tick_s * c.contention.generation_rate(state.training)
    before = requests.generated
    # each server with requests first prefills the prompts of the groups it started
    busy = np.bincount(requests.server, minlength=c.num_servers) > 0
    counters.busy_server_ticks += int(np.count_nonzero(busy))
    prefill = np.where(busy, np.minimum(state.prefill_left_s, seconds), 0.0)
    state.prefill_left_s -= prefill
    generated = generators.advance_servers(
        c.server_generator,
        before,
        requests.length,
        requests.prompt,
        requests.server,
        seconds - prefill,
    )
    requests.generated = generated
    counters.tokens += float(np.sum(requests.generated - before))
    done = requests.generated >= requests.length
    if not np.any(done & (before < requests.length)):  # no response ended this tick
        return True
    generating = set(np.unique(requests.group[~done]).tolist())
    finished = [key for key in state.in_flight if key not in generating]
    if finished:
        requests.keep(~np.isin(requests.group, finished))
        for key in finished:
            _finish_group(state, state.in_flight.pop(key))
    return True


def _take_step(state: Pipeline) -> step_queue.TakenStep | None:
    """Move the queued groups into the step queue, as the trainer does with the rollout
    process's messages, and take a step if the queue is ready (else None).

    Stale and oversize drops and the step's samples are the queue's decisions, the same the
    trainer makes; their tokens are released to the generator's ledger.
    """
    state.observe(metrics.mean("rollout/queue_size", sum(len(g) for g in state.queue)))
    _apply(state, step_queue.advance(state.steps, state.version))
    while state.queue:
        _apply(state, step_queue.arrive(state.steps, state.queue.popleft(), state.version))
    in_flight = step_queue.InFlight.of(group.version for group in state.in_flight.values())
    # colocated: the step is the whole batch, taken once all of it is in
    whole_batch = state.config.groups_per_step is not None
    if whole_batch and (state.in_flight or not state.steps.buffer):
        return None
    if not whole_batch and not step_queue.ready(state.steps, in_flight, behind=state.behind(False)):
        return None
    step = step_queue.take_step(state.steps)
    state.steps = step.queue
    state.ledger = pacing.samples_taken(state.ledger, step.released_tokens)
    return step


def _apply(state: Pipeline, decided: step_queue.Arrival) -> None:
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


def _train(state: Pipeline, step: step_queue.TakenStep) -> float:
    """Apply one step; returns its seconds of training work (alone on its devices)."""
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
    beside_push = c.weight_push_overlap and state.version % c.weight_sync_steps == 0
    push_work = c.push_trainer_s if beside_push and state.version > 0 else 0.0
    return (
        c.training_fixed_s
        + c.training_per_sample_s * len(batch)
        + step.forwarded_tokens / c.training_tokens_per_s
        + push_work
    )


def _push_after(state: Pipeline, trained_at: float) -> float:
    """Push the trained step's weights when one is due; returns when the step ends (after its
    push unless the push runs beside the next step)."""
    c = state.config
    due = (state.version + 1) % c.weight_sync_steps == 0
    lands_at = state.push(state.version + 1, trained_at) if due else trained_at
    waits = due and not c.weight_push_overlap
    state.observe(metrics.mean("perf/weight_sync_s", lands_at - trained_at if waits else 0.0))
    if due and c.weight_push_overlap:
        state.observe(metrics.mean("perf/weight_push_s", lands_at - trained_at))
    return lands_at if waits else trained_at


def _stall_after_s(config: SimulationConfig) -> float:
    """Simulated seconds without a step that mean the pipeline stalled: an hour, or 100 times
    the longest response decoded alone, whichever is longer."""
    alone = config.server_generator.tokens_per_s(1, config.prompt_distribution.maximum)
    return max(STALL_AFTER_S, 100.0 * config.completion_distribution.maximum / alone)


def simulate(
    config: SimulationConfig,
    output_dir: str | Path,
    progress: bool = True,
    on_window: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Run the simulation; writes ``metrics.jsonl`` to ``output_dir`` and returns the windows.
    With ``progress`` it shows a progress bar and logs each window (else windows log at debug
    level: a caller simulating many settings reports them itself).

    Example (ten steps in windows of five; quiet, so the windows log at debug level):
        >>> import tempfile
        >>> from structlog.testing import capture_logs
        >>> config = SimulationConfig(max_steps=10, logging_steps=5)
        >>> with tempfile.TemporaryDirectory() as output_dir, capture_logs() as logged:
        ...     windows = simulate(config, output_dir, progress=False)
        >>> [window["step"] for window in windows], [entry["log_level"] for entry in logged]
        ([5, 10], ['debug', 'debug'])
    """
    rng = np.random.default_rng(config.seed)
    state = Pipeline(config, rng, rng.normal(0.0, 1.0, config.dataset_size))
    windows: list[dict[str, float]] = []
    last_step_at = last_step_end = 0.0
    stall_after = _stall_after_s(config)
    bar = tqdm(total=config.max_steps, desc="simulate", unit="step", disable=not progress)
    with MetricsFile(output_dir) as metrics_file:
        while state.version < config.max_steps:
            state.land_pushes()
            _start_groups(state, training=state.training)
            generating = _generate(state)
            if state.step is None:
                batch = _take_step(state)
                if batch is None:
                    if state.waiting_since is None:
                        state.waiting_since = state.clock
                else:
                    waited = state.clock - (state.waiting_since or state.clock)
                    state.observe(metrics.mean("perf/rollout_wait_s", waited))
                    state.waiting_since = None
                    state.step = TrainingStep(_train(state, batch))
                    last_step_at = state.clock
            else:
                step = state.step
                if step.ends_at is None and step.work_left_s <= 1e-12:
                    # trained: the work ran out during the last tick
                    step.ends_at = _push_after(state, state.clock + step.work_left_s)
                if step.ends_at is not None and state.clock >= step.ends_at:
                    state.observe(metrics.mean("perf/step_s", step.ends_at - last_step_end))
                    last_step_end = step.ends_at
                    state.step = None
                    state.version += 1
                    bar.update(1)
                    if state.version % config.logging_steps == 0:
                        window = _close_window(state, metrics_file, progress)
                        windows.append(window)
                        if on_window is not None:
                            on_window(state.version, window)
            if state.step is not None and state.step.ends_at is None:
                rate = config.contention.training_rate(generating)
                state.step.work_left_s -= config.tick_s * rate
            state.clock += config.tick_s
            if state.clock - last_step_at > stall_after:
                raise RuntimeError(
                    f"simulated pipeline stalled: no step for {stall_after:.0f} simulated "
                    f"seconds at step {state.version} (queue {len(state.queue)}, in flight "
                    f"{len(state.in_flight)}); this is a pacing bug, please report it"
                )
    bar.close()
    return windows


def _close_window(state: Pipeline, metrics_file: MetricsFile, loud: bool) -> dict[str, float]:
    summary = metrics.summarize(state.window)
    summary |= state.counters.figures(state.config.num_servers, state.config.tick_s)
    state.counters = WindowCounters()
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
