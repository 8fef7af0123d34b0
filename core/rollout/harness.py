"""What a harness rollout gives training, decided without the harness.

A harness (OpenEnv's ``HarnessAdapter`` driving a ``ResourceSession``) runs one rollout's
conversation and tools; the trainer samples its turns. Here, as pure functions:

* how many model turns a rollout may take (:func:`harness_max_turns`);
* the training mask of a captured turn over prompt plus completion, as OpenEnv's
  ``TrainingTurn`` carries it (:func:`loss_mask`), and each turn's identity (:func:`node_id`);
* the reward a session's ``verify()`` forwards (:func:`verified_reward`): ``None`` and
  non-finite values leave the rollout unscored, as a reward function's ``None`` does;
* how a rollout ended (:class:`HarnessOutcome`) and its ``harness/*`` metrics
  (:func:`outcome_observations`).

A harness's fault is the rollout's, not the run's: a session that cannot be created, a harness
that raises or outlives ``harness_timeout_s``, or a captured turn that breaks the training
contract ends that rollout unscored and counted; its group is scored by the rollouts that
finished (TRL's AsyncGRPOTrainer documentation: unscored rollouts leave the group's statistics,
a group with none scored is dropped).
"""

from __future__ import annotations

import math
from typing import Final

import attrs

from asyncgrpo.core.metrics import Observation, mean, total
from asyncgrpo.core.records import TurnRecord

FINISHED: Final = "finished"
SESSION_FAILED: Final = "session_failed"  # the factory's create() raised
CRASHED: Final = "crashed"  # the harness, or the session's verify(), raised
TIMED_OUT: Final = "timed_out"  # it ran past harness_timeout_s
REFUSED: Final = "refused"  # a captured turn broke the training contract
ENDINGS: Final = (FINISHED, SESSION_FAILED, CRASHED, TIMED_OUT, REFUSED)
DEFAULT_MAX_TURNS: Final = 10
"""Model turns of a rollout when ``max_tool_calling_iterations`` is None (OpenEnv's own
``HarnessRunLimits`` default)."""


def harness_max_turns(max_tool_calling_iterations: int | None) -> int:
    """Model turns a harness rollout may take: one per round of tool calls, plus the turn that
    reads the last round's results (``max_tool_calling_iterations`` counts tool rounds, as the
    trainer's own tool loop does).

    Example:
        >>> harness_max_turns(0), harness_max_turns(3), harness_max_turns(None)
        (1, 4, 10)
    """
    if max_tool_calling_iterations is None:
        return DEFAULT_MAX_TURNS
    if max_tool_calling_iterations < 0:
        raise ValueError(
            f"max_tool_calling_iterations must be >= 0, got {max_tool_calling_iterations}"
        )
    return max_tool_calling_iterations + 1


def loss_mask(turn: TurnRecord) -> tuple[int, ...]:
    """The turn's mask over prompt plus completion (OpenEnv's ``TrainingTurn.loss_mask``):
    the prompt is context (0), each output token as the turn trains it.

    Example:
        >>> loss_mask(TurnRecord(prompt_ids=[1, 2], output_ids=[7, 8], output_log_probs=[-1, -2],
        ...                      output_mask=[1, 0]))
        (0, 0, 1, 0)
    """
    return (0,) * len(turn.prompt_ids) + tuple(turn.trained_mask())


def node_id(rollout_id: str, turn_index: int) -> str:
    """The identity of a rollout's ``turn_index``-th model call in its training trace.

    Example:
        >>> node_id("r-1a2b", 0)
        'r-1a2b/turn-0'
    """
    return f"{rollout_id}/turn-{turn_index}"


def verified_reward(value: object, source: str) -> tuple[float | None, bool]:
    """The reward ``verify()`` forwarded, and whether it was NaN or infinite (then unscored,
    as any source's non-finite reward is). ``None`` is unscored: never 0.

    Raises:
        TypeError: the value is not a number or None (names ``source``).

    Example:
        >>> verified_reward(1, "Calc.verify"), verified_reward(None, "Calc.verify")
        ((1.0, False), (None, False))
        >>> verified_reward(float("nan"), "Calc.verify")
        (None, True)
    """
    if value is None:
        return None, False
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{source} returned env_reward={value!r} ({type(value).__name__}); "
            "it must be a number, or None for an unscored rollout"
        )
    reward = float(value)
    if not math.isfinite(reward):
        return None, True
    return reward, False


@attrs.frozen
class HarnessOutcome:
    """How one harness rollout ended.

    Attributes:
        ending: one of :data:`ENDINGS`.
        seconds: from the session's creation to its close (s).
        reward: the verified reward, None when unscored.
        nonfinite_reward: ``verify()`` forwarded NaN or an infinity.
        cause: what went wrong (empty when it finished).
    """

    ending: str = attrs.field(validator=attrs.validators.in_(ENDINGS))
    seconds: float = 0.0
    reward: float | None = None
    nonfinite_reward: bool = False
    cause: str = ""

    @property
    def faulted(self) -> bool:
        return self.ending != FINISHED


def outcome_observations(outcome: HarnessOutcome) -> tuple[Observation, ...]:
    """The ``harness/*`` metrics of one rollout: ``harness/{ending}_count`` for each fault,
    ``harness/unscored_frac`` (rollouts without a reward, faults included),
    ``harness/reward_mean`` (the verified reward, over scored rollouts),
    ``harness/nonfinite_reward_count`` and ``harness/duration_s``.

    Example:
        >>> [o.name for o in outcome_observations(HarnessOutcome(TIMED_OUT, 30.0))]
        ['harness/duration_s', 'harness/unscored_frac', 'harness/timed_out_count']
    """
    found = [
        mean("harness/duration_s", outcome.seconds),
        mean("harness/unscored_frac", float(outcome.reward is None)),
    ]
    if outcome.reward is not None:
        found.append(mean("harness/reward_mean", outcome.reward))
    if outcome.faulted:
        found.append(total(f"harness/{outcome.ending}_count", 1))
    if outcome.nonfinite_reward:
        found.append(total("harness/nonfinite_reward_count", 1))
    return tuple(found)
