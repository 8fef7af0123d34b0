"""How much smaller a plan may simulate a split of the GPUs, and what that costs it.

A split's simulation (``asyncgrpo plan --workload``) costs time in proportion to the samples
it simulates, and its re-planning of the step queue more than that. A large cluster runs few
samples per server: 8,192 samples a step over 40 servers is 205 each. Simulating ``1 / scale``
of the cluster, ``servers / scale`` servers, ``rows / scale`` trainer rows at ``1 / scale`` of
the trainer's throughput and ``prompts / scale`` prompts a step (rows and prompts rounded),
keeps every server's load, a row's packing and each step's time the same, with ``scale``
times fewer samples.

Two things change. A step's longest response, which a synchronous step waits for, is the
longest of fewer draws: :func:`simulation_scale` takes the largest scale whose expected longest
response (:meth:`~asyncgrpo.core.experiments.lengths.Lengths.expected_longest`) is within
``tolerance`` of the whole step's, and that divides the servers. And a paced step (a small
``max_staleness``) waits on the last groups the pacing admitted, fewer on a share of the
cluster: such settings come out optimistic, and the planner simulates them whole where it
could choose them (:data:`~asyncgrpo.core.experiments.recommend.PACED_STALENESS`).

Example (the 1.5B math run of docs/experiments.md on 128 GPUs: 40 servers, 2,592 rows and
512 prompts of 16 a step):
    >>> from asyncgrpo.core.experiments.lengths import from_quantiles
    >>> responses = from_quantiles({0.5: 6500, 0.9: 16000}, maximum=27648, mean=8000)
    >>> simulation_scale(40, 2592, 512, 16, responses)  # 4 servers, 259 rows, 819 samples
    10
    >>> simulation_scale(40, 2592, 512, 16, responses, tolerance=0.0)
    1
"""

from __future__ import annotations

from asyncgrpo.core.experiments.lengths import Lengths, independent_draws

MIN_ROWS_PER_STEP = 100
"""The fewest trainer rows a simulated step keeps (its rows are rounded to a whole number)."""
SCALE_TOLERANCE = 0.02
"""How much shorter the simulated step's expected longest response may be than the whole
step's: a synchronous step's generation is at most this much shorter."""
ROUND_OFF = 1e-9
"""Relative round-off of :meth:`~asyncgrpo.core.experiments.lengths.Lengths.expected_longest`
(a sum of some thousand terms whose order numpy's vectorized summation may change from one
process to the next): a shorter expected longest by less than this is not shorter."""


def simulation_scale(
    servers: int,
    rows_per_step: int,
    prompts_per_step: int,
    num_generations: int,
    responses: Lengths,
    tolerance: float = SCALE_TOLERANCE,
    group_correlation: float = 0.0,
) -> int:
    """The largest ``scale`` that divides ``servers``, leaves at least
    :data:`MIN_ROWS_PER_STEP` rows a step (rounded, they change a step's room by at most
    half a row in that many) and keeps the expected longest of the step's
    ``prompts_per_step / scale x num_generations`` responses within ``tolerance`` (a fraction)
    of the whole step's; 1 when none does. A group's responses alike in length
    (``group_correlation``) count as fewer independent draws
    (:func:`~asyncgrpo.core.experiments.lengths.independent_draws`).

    Example (the module's run; where a group's responses are alike, a step's longest is
    nearly that of its prompts, and a share of them falls short sooner):
        >>> from asyncgrpo.core.experiments.lengths import from_quantiles
        >>> responses = from_quantiles({0.5: 6500, 0.9: 16000}, maximum=27648, mean=8000)
        >>> [simulation_scale(40, 2592, 512, 16, responses, group_correlation=c)
        ...  for c in (0.0, 0.1, 0.5, 1.0)]
        [10, 5, 2, 1]
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"simulation_scale: tolerance must be in [0, 1), got {tolerance}")
    per_group = independent_draws(num_generations, group_correlation)

    def draws(scale: int) -> int:
        """The independent draws of a step simulated on ``1 / scale`` of the cluster."""
        return max(1, int(prompts_per_step * per_group // scale))

    longest = responses.expected_longest(draws(1))
    fitting = (
        scale
        for scale in range(servers, 1, -1)
        if servers % scale == 0
        and rows_per_step / scale >= MIN_ROWS_PER_STEP
        and prompts_per_step >= scale
        and responses.expected_longest(draws(scale))
        >= (1.0 - tolerance) * longest * (1.0 - ROUND_OFF)
    )
    return next(fitting, 1)
