"""The knobs of ``asyncgrpo simulate`` (:class:`SimulationConfig`): the run's settings, named
after ``AsyncGRPOConfig`` where they exist, and the part models the simulation composes (the
length distributions, the generator, the trainer's costs, the push, the contention).

Every knob that is a number is also a flag of ``asyncgrpo simulate``; the part models given as
records (``prompt_lengths``, ``completion_lengths``, ``generator``) come from the planner and
the calibration, and take precedence over the numbers they refine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs

from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.experiments import lengths
from asyncgrpo.core.experiments.parts import Contention
from asyncgrpo.shell.config import AsyncGRPOConfig

_CONFIG_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
"""The simulator's knobs named after config fields take the config's defaults."""
RECORD = {"flag": False}
"""Metadata of a knob that is a record, not a flag."""


@attrs.frozen
class SimulationConfig:
    """Knobs of the simulated run (names follow ``AsyncGRPOConfig`` where they exist).

    Attributes:
        max_steps: optimizer steps to simulate.
        dataset_size: prompts in the simulated dataset.
        num_generations: rollouts per prompt (G).
        max_staleness: as in the config; samples further behind are dropped.
        max_concurrent_rollouts: rollouts in flight at most (groups start whole).
        groups_per_step: the colocated synchronous baseline of most frameworks (verl's,
            TRL's colocated mode): this many groups start together, the whole batch, once the
            last step's weights have landed and every sample before them is trained; None:
            the pacing and ``max_concurrent_rollouts`` admit groups (this trainer).
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
            uniform (:func:`asyncgrpo.core.experiments.lengths.uniform_with_mean`): a run whose
            replies mostly stop at ``max_completion_length`` packs as many groups into a step
            as it measured.
        prompt_lengths, completion_lengths: distributions that replace the numbers above
            (:mod:`asyncgrpo.core.experiments.lengths`; a workload's quantiles or histogram).
        group_length_correlation: how alike a group's completion lengths are, in [0, 1]
            (:func:`asyncgrpo.core.experiments.lengths.group_quantiles`): 0 draws each alone;
            1 gives the group one length, as when the prompt sets it (hard problems draw long
            answers). Long groups then finish steps after the short ones they started with,
            and are the ones dropped as stale.
        generation_tokens_per_s: each server's throughput, shared by the requests it runs.
        generator: each server's part model instead (:mod:`asyncgrpo.core.experiments.generator`:
            throughput growing with the requests in flight, bounded by its KV cache, prefill).
        num_servers: generation servers, each group routed to one (core.servers.routing).
        training_tokens_per_s: trainer throughput in forwarded tokens (shared prefixes
            counted once, as the planner packs them).
        training_fixed_s: seconds every step takes beyond its tokens (planning, optimizer).
        training_per_sample_s: seconds per sample of a step.
        training_slowdown, generation_slowdown: how much longer each side takes while the
            other runs on shared cores (:class:`~asyncgrpo.core.experiments.parts.Contention`;
            1: separate devices).
        weight_sync_s: seconds of each push: the servers stand still for its last
            ``server_pause_s`` and the version lands at its end.
        server_pause_s: seconds at the end of each push that the servers stand still (the
            reload or transfer; the file written before it does not stop them); None: the
            whole push.
        push_trainer_s: seconds of each push's work on the trainer's own cores (the disk path
            writes its file there): with the push beside the step, they add to the step it
            runs beside.
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
    groups_per_step: int | None = None
    token_budget: int = 4096
    rows_per_step: int = 1
    prompt_tokens: int = 64
    longest_prompt_tokens: int | None = None
    min_completion_tokens: int = 8
    max_completion_tokens: int = 128
    mean_completion_tokens: float | None = None
    prompt_lengths: lengths.Lengths | None = attrs.field(default=None, metadata=RECORD)
    completion_lengths: lengths.Lengths | None = attrs.field(default=None, metadata=RECORD)
    group_length_correlation: float = 0.0
    generation_tokens_per_s: float = 4500.0
    generator: generators.Generator | None = attrs.field(default=None, metadata=RECORD)
    num_servers: int = 1
    training_tokens_per_s: float = 6000.0
    training_fixed_s: float = 0.0
    training_per_sample_s: float = 0.0
    training_slowdown: float = 1.0
    generation_slowdown: float = 1.0
    weight_sync_s: float = 0.0
    server_pause_s: float | None = None
    push_trainer_s: float = 0.0
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
        positive = (
            "max_steps",
            "dataset_size",
            "num_generations",
            "token_budget",
            "rows_per_step",
            "logging_steps",
            "num_servers",
            "weight_sync_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SimulationConfig.{name} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("SimulationConfig.max_staleness must be >= 0")
        lengths.check_correlation(
            self.group_length_correlation, "SimulationConfig.group_length_correlation"
        )
        if not self.tick_s > 0:
            raise ValueError(f"SimulationConfig.tick_s must be > 0, got {self.tick_s}")
        Contention(self.training_slowdown, self.generation_slowdown)  # its own checks
        if self.server_pause_s is not None and not 0 <= self.server_pause_s <= self.weight_sync_s:
            raise ValueError(
                f"SimulationConfig.server_pause_s ({self.server_pause_s}) must lie between 0 "
                f"and weight_sync_s ({self.weight_sync_s}): the servers stand still for part "
                "of a push at most"
            )
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
        longest = self.prompt_distribution.maximum + self.completion_distribution.maximum
        if longest > self.token_budget:
            raise ValueError(
                f"SimulationConfig.token_budget ({self.token_budget}) is below the longest "
                f"sample ({longest:.0f} tokens); raise token_budget"
            )

    @property
    def prompt_distribution(self) -> lengths.Lengths:
        """The prompts' lengths: ``prompt_lengths``, else ``prompt_tokens`` up to
        ``longest_prompt_tokens`` (uniform around the mean).

        Example:
            >>> SimulationConfig(prompt_tokens=15, longest_prompt_tokens=20).prompt_distribution
            Lengths(knots=((0.0, 10.0), (1.0, 20.0)))
        """
        if self.prompt_lengths is not None:
            return self.prompt_lengths
        longest = self.longest_prompt_tokens
        if longest is None:
            return lengths.constant(self.prompt_tokens)
        return lengths.uniform(2 * self.prompt_tokens - longest, longest)

    @property
    def completion_distribution(self) -> lengths.Lengths:
        """The completions' lengths: ``completion_lengths``, else the shortest, the longest and
        the mean (:func:`~asyncgrpo.core.experiments.lengths.uniform_with_mean`)."""
        if self.completion_lengths is not None:
            return self.completion_lengths
        return lengths.uniform_with_mean(
            self.min_completion_tokens, self.max_completion_tokens, self.mean_completion_tokens
        )

    @property
    def completion_tokens(self) -> float:
        """The mean completion length, tokens."""
        return self.completion_distribution.mean

    @property
    def server_generator(self) -> generators.Generator:
        """Each server's part model: ``generator``, else ``generation_tokens_per_s`` shared by
        the requests it runs."""
        if self.generator is not None:
            return self.generator
        return generators.constant(self.generation_tokens_per_s)

    @property
    def contention(self) -> Contention:
        return Contention(self.training_slowdown, self.generation_slowdown)

    def scaled_down(self, scale: int) -> SimulationConfig:
        """``1 / scale`` of the cluster (:mod:`asyncgrpo.core.experiments.scale`): its servers,
        trainer rows and colocated groups (rounded, at least one), rollouts in flight and
        trainer throughput, so that each server's load and each step's time stay the same
        with ``scale`` times fewer samples a step.

        Example:
            >>> config = SimulationConfig(
            ...     num_servers=8, rows_per_step=66, max_concurrent_rollouts=256
            ... )
            >>> small = config.scaled_down(4)
            >>> small.num_servers, small.rows_per_step, small.max_concurrent_rollouts
            (2, 16, 64)
        """
        if scale < 1 or self.num_servers % scale:
            raise ValueError(
                f"SimulationConfig.scaled_down: scale {scale} must divide num_servers "
                f"({self.num_servers})"
            )
        groups = self.groups_per_step
        return attrs.evolve(
            self,
            num_servers=self.num_servers // scale,
            rows_per_step=max(1, round(self.rows_per_step / scale)),
            max_concurrent_rollouts=max(
                self.num_generations, round(self.max_concurrent_rollouts / scale)
            ),
            groups_per_step=None if groups is None else max(1, round(groups / scale)),
            training_tokens_per_s=self.training_tokens_per_s / scale,
            training_per_sample_s=self.training_per_sample_s * scale,
        )
