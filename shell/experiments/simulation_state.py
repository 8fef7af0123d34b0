"""The mutable state of one simulated run (:mod:`.simulate`): the groups and requests in
flight, the pushes, the trainer's step and the window's counters. The decisions live in core;
this is the shell's bookkeeping around them."""

from __future__ import annotations

from collections import deque

import attrs
import numpy as np

from asyncgrpo.core import metrics
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout import cursor, pacing
from asyncgrpo.core.run import step_queue
from asyncgrpo.shell.experiments.simulation_config import SimulationConfig


@attrs.define
class Group:
    """A group in flight: its prompt's position and row, the policy it started on, its
    responses' lengths, its prompt's tokens and its server."""

    position: int
    row: int
    version: int
    lengths: list[int]
    prompt: int
    server: int = 0


@attrs.define
class Requests:
    """Every request in flight, one entry each, in arrival order (the servers admit in that
    order): its group's id, its server, its response length, prompt tokens and tokens
    generated so far."""

    group: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int64))
    server: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int64))
    length: np.ndarray = attrs.field(factory=lambda: np.zeros(0))
    prompt: np.ndarray = attrs.field(factory=lambda: np.zeros(0))
    generated: np.ndarray = attrs.field(factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.group)

    def add(self, group: int, server: int, lengths: list[int], prompt: int) -> None:
        n = len(lengths)
        self.group = np.concatenate([self.group, np.full(n, group, np.int64)])
        self.server = np.concatenate([self.server, np.full(n, server, np.int64)])
        self.length = np.concatenate([self.length, np.asarray(lengths, float)])
        self.prompt = np.concatenate([self.prompt, np.full(n, float(prompt))])
        self.generated = np.concatenate([self.generated, np.zeros(n)])

    def keep(self, mask: np.ndarray) -> None:
        for name in ("group", "server", "length", "prompt", "generated"):
            setattr(self, name, getattr(self, name)[mask])


@attrs.define
class Push:
    """A push of ``version``'s weights from ``start`` to ``end``; the servers stand still
    from ``paused_from``."""

    version: int
    start: float
    end: float
    paused_from: float


@attrs.define
class TrainingStep:
    """The step the trainer is on: seconds of training work left, and when it ends once
    trained (None: still training; after a push it waits for, the push's landing)."""

    work_left_s: float
    ends_at: float | None = None


@attrs.define
class WindowCounters:
    """What a window logs besides its observations: ticks, the servers' busy ticks, requests
    generating summed over ticks (a finished response of a group in flight no longer
    counts), tokens generated."""

    ticks: int = 0
    busy_server_ticks: int = 0
    requests: float = 0.0
    tokens: float = 0.0

    def figures(self, servers: int, tick_s: float) -> dict[str, float]:
        if self.ticks == 0:
            return {}
        return {
            "rollout/concurrency": self.requests / self.ticks,
            "rollout/generated_tokens_per_s": self.tokens / (self.ticks * tick_s),
            "sim/generator_idle_frac": 1.0 - self.busy_server_ticks / (self.ticks * servers),
        }


@attrs.define
class Pipeline:
    """Mutable state of one simulated run."""

    config: SimulationConfig
    rng: np.random.Generator
    difficulty: np.ndarray
    skill: float = -1.0
    version: int = 0
    policy: int = 0
    pushes: deque[Push] = attrs.field(factory=deque)
    clock: float = 0.0
    ledger: pacing.GenerationLedger = attrs.field(factory=pacing.GenerationLedger)
    prompt_cursor: cursor.PromptCursor = attrs.field(factory=cursor.PromptCursor)
    steps: step_queue.StepQueue = attrs.field(default=None)
    next_position: int = 0
    next_group_id: int = 0
    in_flight: dict[int, Group] = attrs.field(factory=dict)
    requests: Requests = attrs.field(factory=Requests)
    prefill_left_s: np.ndarray = attrs.field(factory=lambda: np.zeros(0))
    queue: deque[tuple[TrainingSample, ...]] = attrs.field(factory=deque)
    window: metrics.MetricWindow = attrs.field(factory=metrics.MetricWindow)
    counters: WindowCounters = attrs.field(factory=WindowCounters)
    step: TrainingStep | None = None
    blocked_since: float | None = None
    waiting_since: float | None = None

    def __attrs_post_init__(self) -> None:
        c = self.config
        if self.steps is None:
            self.steps = step_queue.StepQueue(
                step_queue.QueueSettings(c.token_budget, 1, c.rows_per_step, c.max_staleness)
            )
        if not len(self.prefill_left_s):
            self.prefill_left_s = np.zeros(c.num_servers)

    def observe(self, *observations: metrics.Observation) -> None:
        self.window = metrics.record(self.window, observations)

    @property
    def training(self) -> bool:
        """Whether a step is under way (training, or waiting for its push)."""
        return self.step is not None

    def behind(self, training: bool) -> int:
        """Steps taken (the one training counts) less the servers' policy version."""
        return self.version + int(training) - self.policy

    @property
    def paused(self) -> bool:
        """Whether a push holds the servers still now."""
        return bool(self.pushes) and self.pushes[0].paused_from <= self.clock

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
        end = start + self.config.weight_sync_s
        pause = self.config.server_pause_s
        self.pushes.append(Push(version, start, end, start if pause is None else end - pause))
        return self.pushes[-1].end
