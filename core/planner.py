"""The token-budget planner (TokenBudgetBatcher of TRL's AsyncGRPOTrainer) and a step's metrics.

A step is ``gradient_accumulation_steps`` micro-batches; a micro-batch is one row per process;
a row is tree-packed (:mod:`asyncgrpo.core.packing`) and holds at most ``token_budget``
*forwarded* tokens, shared tokens counted once. Samples are placed in the order given:

1. a sample longer than ``token_budget`` fits no row: it is dropped and counted
   (``batch/dropped_oversize_count``);
2. it goes to a row that already holds its group (its prompt is there) if it fits;
3. else to the row, among those it fits, whose attention cost after adding it is lowest;
   empty rows count as cost 0, so every process gets work before any row grows, and the most
   loaded row is raised only when every row would be;
4. else the micro-batch closes and the sample opens the next one. After the step's last
   micro-batch the remaining samples are left for the next step.

**Attention cost model.** A row's cost is the number of (query, key) pairs its attention
computes: every forwarded token attends to its whole path, so a token at trie depth ``d`` costs
``d + 1`` and a row costs ``sum(position_ids + 1)``. Adding a sample of length ``L`` that shares
``h`` positions with the row adds ``(L(L+1) - h(h+1)) / 2``. It is proportional to attention
FLOPs, which dominate long rows; linear layers scale with forwarded tokens, which the budget
bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from asyncgrpo.core.packing import PackedRow, shared_positions
from asyncgrpo.core.records import TrainingSample


def added_cost(length: int, shared: int) -> int:
    """Attention cost a sample of ``length`` tokens adds when ``shared`` positions exist.

    Example:
        >>> added_cost(5, 0), added_cost(5, 2)
        (15, 12)
    """
    return (length * (length + 1) - shared * (shared + 1)) // 2


def attention_cost(position_ids: np.ndarray) -> int:
    """Cost of a packed row: ``sum(position_ids + 1)`` (query-key pairs)."""
    return int((np.asarray(position_ids, dtype=np.int64) + 1).sum())


@attrs.frozen
class RowPlan:
    """Samples of one row (indices into the planner's input), its forwarded tokens and cost."""

    samples: tuple[int, ...] = ()
    tokens: int = 0
    cost: int = 0


@attrs.frozen
class StepPlan:
    """The micro-batches of one step.

    Attributes:
        micro_batches: each a tuple of ``num_processes`` rows (a row may be empty when a
            micro-batch holds fewer samples than processes).
        dropped_oversize: indices of samples longer than ``token_budget``.
        leftover: indices of samples that did not fit this step, in order.
    """

    micro_batches: tuple[tuple[RowPlan, ...], ...]
    dropped_oversize: tuple[int, ...]
    leftover: tuple[int, ...]

    @property
    def complete(self) -> bool:
        """True when the step filled up (some sample was left for the next step)."""
        return bool(self.leftover)

    @property
    def placed(self) -> tuple[int, ...]:
        """Indices of the samples placed in the step, row by row."""
        return tuple(i for mb in self.micro_batches for row in mb for i in row.samples)


class _OpenMicroBatch:
    """Rows being filled (local state of :func:`plan_step`)."""

    def __init__(self, num_processes: int) -> None:
        self.rows = [RowPlan() for _ in range(num_processes)]
        self.groups: list[set[int]] = [set() for _ in range(num_processes)]

    def is_empty(self) -> bool:
        return all(not row.samples for row in self.rows)

    def close(self) -> tuple[RowPlan, ...]:
        return tuple(self.rows)


def _shared_with_row(tokens: np.ndarray, row: RowPlan, all_tokens: Sequence[np.ndarray]) -> int:
    return max((shared_positions(tokens, all_tokens[j]) for j in row.samples), default=0)


def _place(
    open_mb: _OpenMicroBatch,
    index: int,
    sample: TrainingSample,
    all_tokens: Sequence[np.ndarray],
    token_budget: int,
) -> bool:
    tokens = all_tokens[index]
    options: list[tuple[int, int, int]] = []  # (cost after, row, new tokens)
    for r, row in enumerate(open_mb.rows):
        shared = _shared_with_row(tokens, row, all_tokens)
        new_tokens = len(tokens) - shared
        if row.tokens + new_tokens > token_budget:
            continue
        cost_after = row.cost + added_cost(len(tokens), shared)
        if sample.group_id in open_mb.groups[r]:
            options = [(cost_after, r, new_tokens)]
            break
        options.append((cost_after, r, new_tokens))
    if not options:
        return False
    cost_after, r, new_tokens = min(options)
    row = open_mb.rows[r]
    open_mb.rows[r] = RowPlan((*row.samples, index), row.tokens + new_tokens, cost_after)
    open_mb.groups[r].add(sample.group_id)
    return True


def plan_step(
    samples: Sequence[TrainingSample],
    token_budget: int,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
) -> StepPlan:
    """Place ``samples`` into one step's micro-batches (rules in the module docstring).

    Args:
        samples: candidates in arrival order.
        token_budget: forwarded tokens per row, shared tokens counted once.
        num_processes: rows per micro-batch.
        gradient_accumulation_steps: micro-batches per step.

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> def s(tokens, group):
        ...     seq = TrainingSequence(tokens, [0] + [1] * (len(tokens) - 1),
        ...                            [0.0] + [-1.0] * (len(tokens) - 1))
        ...     return TrainingSample(seq, 1.0, 0, group, group, group, "r")
        >>> plan = plan_step([s([1, 2, 3, 4], 0), s([1, 2, 3, 5], 0), s([9] * 9, 1)],
        ...                  token_budget=8)
        >>> [row.samples for mb in plan.micro_batches for row in mb], plan.dropped_oversize
        ([(0, 1)], (2,))
    """
    if token_budget < 1 or num_processes < 1 or gradient_accumulation_steps < 1:
        raise ValueError(
            "plan_step: token_budget, num_processes and gradient_accumulation_steps must be >= 1"
        )
    all_tokens = [s.sequence.input_ids for s in samples]
    closed: list[tuple[RowPlan, ...]] = []
    dropped: list[int] = []
    leftover: list[int] = []
    open_mb = _OpenMicroBatch(num_processes)
    for index, sample in enumerate(samples):
        if len(all_tokens[index]) > token_budget:
            dropped.append(index)
            continue
        if len(closed) == gradient_accumulation_steps:
            leftover.append(index)
            continue
        if _place(open_mb, index, sample, all_tokens, token_budget):
            continue
        closed.append(open_mb.close())
        open_mb = _OpenMicroBatch(num_processes)
        if len(closed) == gradient_accumulation_steps:
            leftover.append(index)
            continue
        _place(open_mb, index, sample, all_tokens, token_budget)
    if not open_mb.is_empty():
        closed.append(open_mb.close())
    return StepPlan(tuple(closed), tuple(dropped), tuple(leftover))


def batch_metrics(
    micro_batches: Sequence[Sequence[PackedRow | None]],
    token_budget: int,
    dropped_oversize: int = 0,
) -> dict[str, float]:
    """The ``batch/*`` metrics of TRL's AsyncGRPOTrainer of one step, from its packed rows.

    Args:
        micro_batches: per micro-batch, one packed row per process (``None`` for an empty
            row).
        token_budget: tokens per row, for ``batch/row_fill_frac``.
        dropped_oversize: samples the planner dropped as longer than the budget.

    Per-step values are sums over the step; per-row values are means over its rows.
    """
    rows = [row for mb in micro_batches for row in mb]
    filled = [row for row in rows if row is not None]
    forwarded = sum(row.num_tokens for row in filled)
    unpacked = sum(row.unpacked_tokens for row in filled)
    trained_positions = sum(len(row.trained_rows) for row in filled)
    row_tokens = [0 if row is None else row.num_tokens for row in rows]
    imbalance: list[float] = []
    padding: list[float] = []
    for mb in micro_batches:
        costs = [0 if row is None else attention_cost(row.position_ids) for row in mb]
        lengths = [0 if row is None else row.num_tokens for row in mb]
        if max(costs) > 0:
            imbalance.append(max(costs) / float(np.mean(costs)))
        if max(lengths) > 0:
            padding.append(1.0 - sum(lengths) / (len(lengths) * max(lengths)))
    samples = [sample for row in filled for sample in row.samples]
    return {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(sum(len(row.target_ids) for row in filled)),
        "batch/samples_per_step": float(len(samples)),
        "batch/groups_per_step": float(len({s.group_id for s in samples})),
        "batch/microbatches_per_step": float(len(micro_batches)),
        "batch/masked_token_frac": 1.0 - trained_positions / forwarded if forwarded else 0.0,
        "batch/samples_per_row": len(samples) / len(rows) if rows else 0.0,
        "batch/row_tokens_mean": float(np.mean(row_tokens)) if rows else 0.0,
        "batch/row_tokens_max": float(max(row_tokens, default=0)),
        "batch/row_fill_frac": float(np.mean(row_tokens)) / token_budget if rows else 0.0,
        "batch/row_imbalance": float(np.mean(imbalance)) if imbalance else 1.0,
        "batch/packing_ratio": unpacked / forwarded if forwarded else 1.0,
        "batch/pad_frac": float(np.mean(padding)) if padding else 0.0,
        "batch/dropped_oversize_count": float(dropped_oversize),
    }
