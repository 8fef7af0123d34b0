"""Diverging weights: a step whose loss or gradient norm is not finite is skipped, and a run of
such steps stops the run.

**A skipped step.** The learner decides after the gradients are clipped, from the step's loss
summed over processes and its gradient norm (already a global value), which every process sees
alike (:func:`step_is_finite`), so every process skips together: the optimizer and the schedule
do not step, the gradients are zeroed, the step counts (the step counter moves on, so the
samples' versions and ``max_steps`` keep counting steps) and is logged in
:data:`NONFINITE_STEP_COUNT`; its samples' prompts are consumed, not trained (outcome
:data:`NONFINITE` in ``positions.jsonl``). The weights are left as they were, so nothing
non-finite reaches the optimizer's state, a checkpoint or the server.

**Stopping.** After a skipped step the weights and the optimizer are those of the last finite
step, so the next step differs only in its batch. A non-finite value caused by one batch (an
extreme importance ratio, an overflow in low precision) is unlikely to come back on the next
batches; one caused by the weights (diverged: huge logits) comes back on every batch, since the
weights no longer change. ``stop_after_nonfinite_steps`` (3 by default) such steps in a row
stop the run with a checkpoint of the last finite weights (:func:`diverged_message`): with a
one-batch cause of probability ``p`` per step, three in a row happen by chance with
probability ``p**3`` (one in a million steps at ``p = 1%``), and waiting for them costs two
steps' samples.

Example:
    >>> steps = NonfiniteSteps(last_finite_step=10)
    >>> for finite in (True, False, False, True, False, False, False):
    ...     steps = after_step(steps, finite)
    >>> steps
    NonfiniteSteps(last_finite_step=14, in_a_row=3, total=5)
    >>> must_stop(steps, stop_after=3)
    True
"""

from __future__ import annotations

import math

import attrs

NONFINITE_STEP_COUNT = "train/nonfinite_step_count"
"""The metric: steps skipped because their loss or gradient norm was not finite (summed)."""
NONFINITE = "nonfinite"
"""The outcome in ``positions.jsonl`` of the samples of a skipped step (consumed, not
trained)."""


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether a step may be applied: its loss (summed over processes and micro-batches) and
    its gradient norm (over every process, before clipping) are both finite.

    Example:
        >>> step_is_finite(0.25, 3.0), step_is_finite(float("nan"), 3.0)
        (True, False)
        >>> step_is_finite(0.25, float("inf"))
        False
    """
    return math.isfinite(loss) and math.isfinite(grad_norm)


@attrs.frozen
class NonfiniteSteps:
    """The steps of a run so far, as the divergence rule counts them.

    Attributes:
        last_finite_step: the step whose weights the learner holds: the last step applied (the
            step the run started from before any).
        in_a_row: skipped steps since then.
        total: skipped steps in the whole run (this process's run, not before a resume).
    """

    last_finite_step: int = 0
    in_a_row: int = 0
    total: int = 0


def after_step(steps: NonfiniteSteps, finite: bool) -> NonfiniteSteps:
    """Count one step: applied (``finite``) or skipped."""
    step = steps.last_finite_step + steps.in_a_row + 1
    if finite:
        return NonfiniteSteps(last_finite_step=step, in_a_row=0, total=steps.total)
    return attrs.evolve(steps, in_a_row=steps.in_a_row + 1, total=steps.total + 1)


def must_stop(steps: NonfiniteSteps, stop_after: int) -> bool:
    """Whether ``stop_after`` (``stop_after_nonfinite_steps``) steps in a row were skipped."""
    return steps.in_a_row >= stop_after


RESTART = (
    "start the run again (a resumed checkpoint keeps the learning rate it was saved with, "
    "whatever learning_rate says)"
)


def _remedy(learning_rate: float, max_grad_norm: float) -> str:
    clip = (
        f"keep gradient clipping on (max_grad_norm={max_grad_norm:g}; lower it to clip harder)"
        if max_grad_norm > 0
        else f"turn gradient clipping on (max_grad_norm={max_grad_norm:g}; e.g. 1.0)"
    )
    return f"Lower learning_rate (now {learning_rate:g}; e.g. {learning_rate / 10:g}) and {clip}"


def diverged_message(
    steps: NonfiniteSteps,
    stop_after: int,
    loss: float,
    grad_norm: float,
    learning_rate: float,
    max_grad_norm: float,
    checkpoint: str,
) -> str:
    """The error that stops a run after ``stop_after`` skipped steps in a row: the steps, the
    last values, where the last finite weights are and what to change.

    Example:
        >>> steps = NonfiniteSteps(last_finite_step=1, in_a_row=3, total=3)
        >>> nan, inf = float("nan"), float("inf")
        >>> print(diverged_message(steps, 3, nan, inf, 1e6, 1.0, "out/checkpoint-4"))
        the loss or the gradient norm was not finite for stop_after_nonfinite_steps=3 steps
        in a row (steps 2 to 4; at step 4 loss=nan, grad_norm=inf): the weights have
        diverged. Each such step was skipped, so no optimizer step, checkpoint or weight
        push saw a non-finite value; the last finite weights (step 1) are in
        out/checkpoint-4. Lower learning_rate (now 1e+06; e.g. 100000) and keep gradient
        clipping on (max_grad_norm=1; lower it to clip harder), then start the run again (a
        resumed checkpoint keeps the learning rate it was saved with, whatever learning_rate
        says)
    """
    first = steps.last_finite_step + 1
    last = steps.last_finite_step + steps.in_a_row
    return (
        f"the loss or the gradient norm was not finite for stop_after_nonfinite_steps="
        f"{stop_after} steps in a row (steps {first} to {last}; at step {last} loss={loss:g}, "
        f"grad_norm={grad_norm:g}): the weights have diverged. Each such step was skipped, so "
        "no optimizer step, checkpoint or weight push saw a non-finite value; the last finite "
        f"weights (step {steps.last_finite_step}) are in {checkpoint}. "
        f"{_remedy(learning_rate, max_grad_norm)}, then {RESTART}"
    )


def weights_diverged_message(
    step: int, learning_rate: float, max_grad_norm: float, output_dir: str
) -> str:
    """The error when an optimizer step on finite gradients made the weights themselves
    non-finite (a learning rate beyond what float32 holds): they are not pushed or saved.

    Example:
        >>> print(weights_diverged_message(3, 1e39, 0.0, "out"))
        the optimizer step of step 3 made the weights non-finite although its loss and
        gradient norm were finite: learning_rate is too large for them. They were neither
        pushed to the server nor saved; the newest checkpoint in out holds the last saved
        weights. Lower learning_rate (now 1e+39; e.g. 1e+38) and turn gradient clipping on
        (max_grad_norm=0; e.g. 1.0), then start the run again (a resumed checkpoint keeps the
        learning rate it was saved with, whatever learning_rate says)
    """
    return (
        f"the optimizer step of step {step} made the weights non-finite although its loss and "
        "gradient norm were finite: learning_rate is too large for them. They were neither "
        f"pushed to the server nor saved; the newest checkpoint in {output_dir} holds the last "
        f"saved weights. {_remedy(learning_rate, max_grad_norm)}, then {RESTART}"
    )
