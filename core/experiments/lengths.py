"""Token-length distributions: the prompts and responses of a workload, as the simulator and
the planner draw them.

A distribution is its inverse CDF, piecewise linear through knots ``(probability, length)``
from probability 0 to 1. A flat stretch (two knots with the same length) is a point mass: the
responses cut at ``max_completion_length``, which in a math RL run can be a tenth of them or
more. Every constructor builds knots:

* :func:`constant`, :func:`uniform`;
* :func:`uniform_with_mean`: uniform between two ends, with a point mass at the end on the
  mean's side that moves the mean there (what the simulator drew from a calibration run's
  shortest, longest and mean completion);
* :func:`from_quantiles`: a mean, quantiles and the maximum, linear between the quantiles, and
  above the highest a tail to the maximum shaped to give the mean (a power of the probability:
  a long thin tail; or, for a higher mean, linear with a point mass at the maximum);
* :func:`from_histogram`: bin edges and counts, uniform within each bin.

Why the shape matters: a synchronous step waits for its longest response
(:meth:`Lengths.expected_longest`), and a request in flight holds on average
:meth:`Lengths.in_flight_tokens` tokens of KV cache, more than the mean, since long responses
stay in flight longer.

Example:
    >>> lengths = from_quantiles({0.5: 1500, 0.9: 6000}, maximum=8192, mean=2650)
    >>> round(lengths.mean), lengths.quantile(0.5), lengths.maximum
    (2650, 1500.0, 8192.0)
    >>> round(lengths.truncated_fraction, 3)  # responses cut at the maximum
    0.059
    >>> round(lengths.expected_longest(128))  # a step of 128 responses waits for ~this
    8192
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

TAIL_KNOTS = 65
"""Knots of a tail above the highest quantile (:func:`from_quantiles`)."""
LARGEST_EXPONENT = 1e6
"""The steepest tail :func:`from_quantiles` draws (its lengths nearly all at the quantile)."""
LONGEST_GRID = 4097
"""Points of the probability grid :meth:`Lengths.expected_longest` integrates over."""


class LengthsError(ValueError):
    """A length distribution that cannot be built; the message names the value and the fix."""


def _check_knots(instance: Lengths, attribute: attrs.Attribute, knots: tuple) -> None:
    probabilities = [p for p, _ in knots]
    lengths = [v for _, v in knots]
    if len(knots) < 2 or probabilities[0] != 0.0 or probabilities[-1] != 1.0:
        raise LengthsError("Lengths.knots must run from probability 0 to 1")
    if any(b < a for a, b in itertools.pairwise(probabilities)) or any(
        b < a for a, b in itertools.pairwise(lengths)
    ):
        raise LengthsError(f"Lengths.knots must not decrease, got {knots}")
    if lengths[0] < 1:
        raise LengthsError(f"lengths are at least 1 token, got a shortest of {lengths[0]}")


@attrs.frozen
class Lengths:
    """A token-length distribution (the module's docstring).

    Attributes:
        knots: ``(probability, length)`` pairs of the inverse CDF, probability from 0 to 1,
            neither decreasing; lengths in tokens.
    """

    knots: tuple[tuple[float, float], ...] = attrs.field(
        converter=lambda ks: tuple((float(p), float(v)) for p, v in ks), validator=_check_knots
    )

    @property
    def minimum(self) -> float:
        return self.knots[0][1]

    @property
    def maximum(self) -> float:
        return self.knots[-1][1]

    def _segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = np.array([k[0] for k in self.knots])
        v = np.array([k[1] for k in self.knots])
        return np.diff(p), v[:-1], v[1:]

    @property
    def mean(self) -> float:
        """The mean length, tokens."""
        width, low, high = self._segments()
        return float(np.sum(width * (low + high) / 2.0))

    @property
    def second_moment(self) -> float:
        """The mean squared length, tokens squared."""
        width, low, high = self._segments()
        return float(np.sum(width * (low * low + low * high + high * high) / 3.0))

    @property
    def truncated_fraction(self) -> float:
        """The point mass at the maximum: the share of lengths that hit it exactly."""
        return sum(
            b[0] - a[0] for a, b in itertools.pairwise(self.knots) if a[1] == b[1] == self.maximum
        )

    def quantile(self, probability: float) -> float:
        """The length at ``probability`` of the inverse CDF."""
        if not 0.0 <= probability <= 1.0:
            raise LengthsError(f"a quantile's probability lies in [0, 1], got {probability}")
        p = [k[0] for k in self.knots]
        # the last knot of a point mass wins at its probability, so ``quantile(q)`` returns a
        # given quantile even where a flat stretch starts there
        index = int(np.searchsorted(p, probability, side="right")) - 1
        if index >= len(p) - 1:
            return self.maximum
        (p0, v0), (p1, v1) = self.knots[index], self.knots[index + 1]
        return v0 if p1 == p0 else v0 + (v1 - v0) * (probability - p0) / (p1 - p0)

    def in_flight_tokens(self, prompt_tokens: float = 0.0) -> float:
        """Mean KV-cache tokens of a request in flight under continuous batching: its prompt
        and, since a request's time in flight grows with its length, ``E[L^2] / (2 E[L])`` of
        its response (length-biased, half generated on average)."""
        return prompt_tokens + self.second_moment / (2.0 * self.mean)

    def expected_longest(self, count: int) -> float:
        """The expected longest of ``count`` independent lengths, tokens:
        ``integral of Q(u) d(u^count)`` over the inverse CDF ``Q``."""
        if count < 1:
            raise LengthsError(f"count must be >= 1, got {count}")
        u = np.linspace(0.0, 1.0, LONGEST_GRID)
        q = np.interp(u, [k[0] for k in self.knots], [k[1] for k in self.knots])
        weight = np.diff(u**count)
        return float(np.sum(weight * (q[:-1] + q[1:]) / 2.0))

    def in_units(self, unit: float) -> Lengths:
        """The lengths counted in units of ``unit`` tokens (at least one unit).

        Example:
            >>> uniform(100, 900).in_units(100).knots
            ((0.0, 1.0), (1.0, 9.0))
        """
        if unit <= 0:
            raise LengthsError(f"a token unit is > 0, got {unit}")
        return Lengths(tuple((p, max(1.0, v / unit)) for p, v in self.knots))

    def sample(self, rng: np.random.Generator, count: int, correlation: float = 0.0) -> np.ndarray:
        """``count`` integer lengths drawn by the inverse CDF (``rng`` is the caller's): one
        group's responses, each drawn from this distribution, their lengths correlated by
        ``correlation`` (:func:`group_quantiles`; 0: independent)."""
        u = group_quantiles(rng, count, correlation)
        p = [k[0] for k in self.knots]
        values = np.interp(u, p, [k[1] for k in self.knots])
        # a point mass: np.interp returns its length on the flat stretch already
        return np.clip(np.floor(values + 0.5), self.minimum, self.maximum).astype(np.int64)


def check_correlation(correlation: float, name: str = "a group's length correlation") -> None:
    """Raise :class:`LengthsError`, naming ``name``, unless ``correlation`` (a group's length
    correlation) lies in [0, 1]."""
    if not 0.0 <= correlation <= 1.0:
        raise LengthsError(
            f"{name} lies in [0, 1] (0: each response's length drawn alone, 1: the prompt "
            f"sets it for the whole group), got {correlation}"
        )


def independent_draws(count: int, correlation: float) -> float:
    """How many independent lengths ``count`` responses of a group, correlated by
    ``correlation``, are worth: Kish's effective sample size ``count / (1 + (count - 1) c)``
    (``count`` when drawn alone, 1 when the prompt sets them).

    Example:
        >>> independent_draws(16, 0.0), independent_draws(16, 1.0), independent_draws(16, 0.5)
        (16.0, 1.0, 1.8823529411764706)
    """
    check_correlation(correlation)
    return count / (1.0 + (count - 1) * correlation)


def group_quantiles(rng: np.random.Generator, count: int, correlation: float) -> np.ndarray:
    """``count`` quantiles in [0, 1], each uniform, correlated within the group through a
    Gaussian copula: the normal scores ``sqrt(c) Z + sqrt(1 - c) e_i`` (one ``Z`` for the
    group, one ``e_i`` per response) mapped through the normal CDF. ``correlation`` 0 draws
    each alone (as ``rng.random(count)``); 1 gives the group one quantile, as when a prompt
    sets how long every answer to it is (hard problems draw long answers).

    Example:
        >>> q = group_quantiles(np.random.default_rng(0), 4, 1.0)
        >>> bool(np.all(q == q[0])), bool(0.0 < q[0] < 1.0)
        (True, True)
    """
    check_correlation(correlation)
    if correlation == 0.0:
        return rng.random(count)
    shared = math.sqrt(correlation) * rng.standard_normal()
    own = rng.standard_normal(count) if correlation < 1.0 else np.zeros(count)
    scores = shared + math.sqrt(1.0 - correlation) * own
    return np.array([0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) for z in scores])


def constant(length: float) -> Lengths:
    """Every length ``length``.

    Example:
        >>> constant(64).mean, constant(64).expected_longest(8)
        (64.0, 64.0)
    """
    return Lengths(((0.0, length), (1.0, length)))


def uniform(low: float, high: float) -> Lengths:
    """Uniform on ``[low, high]``."""
    if high < low:
        raise LengthsError(f"uniform lengths need low <= high, got {low} and {high}")
    return Lengths(((0.0, low), (1.0, high)))


def uniform_with_mean(low: float, high: float, mean: float | None = None) -> Lengths:
    """Uniform on ``[low, high]``, with the end on the mean's side taking the share of draws
    that moves the mean to ``mean`` (None: the middle, plain uniform).

    Example:
        >>> lengths = uniform_with_mean(8, 16, mean=15.0)
        >>> lengths.mean, round(lengths.truncated_fraction, 2)
        (15.0, 0.75)
    """
    middle = (low + high) / 2.0
    if mean is None or mean == middle:
        return uniform(low, high)
    if not low <= mean <= high:
        raise LengthsError(
            f"the mean ({mean}) must lie between the shortest ({low}) and the longest ({high})"
        )
    end = high if mean > middle else low
    share = (mean - middle) / (end - middle)
    if end == high:
        return Lengths(((0.0, low), (1.0 - share, high), (1.0, high)))
    return Lengths(((0.0, low), (share, low), (1.0, high)))


def _tail(low: float, high: float, start: float, exponent: float) -> list[tuple[float, float]]:
    """Knots from ``(start, low)`` to ``(1, high)`` along ``low + (high - low) x t^exponent``
    (``t`` from 0 to 1 over the stretch): most lengths near ``low``, a tail to ``high``."""
    t = np.linspace(0.0, 1.0, TAIL_KNOTS)
    return [
        (start + (1.0 - start) * float(x), low + (high - low) * float(x) ** exponent) for x in t[1:]
    ]


def from_quantiles(
    quantiles: Mapping[float, float],
    maximum: float,
    mean: float | None = None,
    minimum: float = 1.0,
) -> Lengths:
    """Lengths through ``quantiles`` (probability -> length) up to ``maximum``, linear between
    them. Above the highest quantile (or from ``minimum`` when none is given), a tail to
    ``maximum`` whose shape gives the mean: a power of the probability (most lengths near the
    quantile, a long thin tail) down to linear, then a point mass at ``maximum`` (responses
    cut there) for a mean higher still. ``mean`` None: linear.

    Raises:
        LengthsError: quantiles out of order or outside ``[minimum, maximum]``, or a ``mean``
            the quantiles cannot give (the error says the range they allow).
    """
    points = sorted((float(p), float(v)) for p, v in quantiles.items())
    if any(not 0.0 < p < 1.0 for p, _ in points):
        raise LengthsError(
            "quantile probabilities lie strictly between 0 and 1 (p50 = 0.5); "
            f"got {[p for p, _ in points]}"
        )
    if any(b[1] < a[1] for a, b in itertools.pairwise(points)):
        raise LengthsError(f"quantiles must not decrease with their probability, got {points}")
    if minimum > maximum:
        raise LengthsError(f"the maximum ({maximum}) is below the shortest ({minimum})")
    if points and not (minimum <= points[0][1] and points[-1][1] <= maximum):
        raise LengthsError(
            f"quantiles must lie within [{minimum}, {maximum}] (the shortest "
            f"and the maximum), got {points}"
        )
    knots = [(0.0, float(minimum)), *points]
    top_p, top_v = knots[-1]
    linear = Lengths((*knots, (1.0, maximum)))
    if mean is None:
        return linear
    most = linear.mean + (1.0 - top_p) * (maximum - (top_v + maximum) / 2.0)
    least = Lengths((*knots, *_tail(top_v, maximum, top_p, LARGEST_EXPONENT))).mean
    if not least - 1e-9 <= mean <= most + 1e-9 or (top_p == 1.0 and mean != linear.mean):
        raise LengthsError(
            f"a mean of {mean} tokens does not fit these quantiles and maximum: they allow "
            f"{least:.1f} (lengths above the highest quantile close to it) to {most:.1f} "
            "(every one cut at the maximum); change the mean or the quantiles"
        )
    if mean >= linear.mean:  # linear, and a point mass at the maximum for the rest
        gain = maximum - (top_v + maximum) / 2.0
        mass = 0.0 if gain == 0 else min((mean - linear.mean) / gain, 1.0 - top_p)
        if mass <= 0.0:
            return linear
        return Lengths((*knots, (1.0 - mass, maximum), (1.0, maximum)))
    low, high = 1.0, LARGEST_EXPONENT  # the tail's exponent: its mean falls as the exponent grows
    for _ in range(100):
        exponent = math.sqrt(low * high)
        if Lengths((*knots, *_tail(top_v, maximum, top_p, exponent))).mean > mean:
            low = exponent
        else:
            high = exponent
    return Lengths((*knots, *_tail(top_v, maximum, top_p, math.sqrt(low * high))))


def from_histogram(edges: Sequence[float], counts: Sequence[float]) -> Lengths:
    """Lengths uniform within each bin ``[edges[i], edges[i + 1]]``, the bins weighted by
    ``counts`` (a bin of zero width, two equal edges, is a point mass).

    Example:
        >>> lengths = from_histogram([1, 100, 1000, 1000], [50, 40, 10])
        >>> round(lengths.mean, 1), round(lengths.truncated_fraction, 3)
        (345.2, 0.1)
    """
    if len(edges) != len(counts) + 1 or not counts:
        raise LengthsError(
            f"a histogram has one more edge than counts, got {len(edges)} edges "
            f"and {len(counts)} counts"
        )
    if any(c < 0 for c in counts) or sum(counts) <= 0:
        raise LengthsError(f"histogram counts are >= 0 and not all 0, got {list(counts)}")
    cumulative = np.concatenate([[0.0], np.cumsum(counts) / float(sum(counts))])
    cumulative[-1] = 1.0
    return Lengths(tuple(zip(cumulative.tolist(), map(float, edges), strict=True)))
